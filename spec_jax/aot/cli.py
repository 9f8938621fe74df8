"""python -m spec_jax.aot --model CONFIG_OR_FOLDER --platform tpu:v6e|tpu:v5e-8|tpu:v5p|cuda ...

    python -m spec_jax.aot --model llama-3.1-8b --platform tpu:v6e --drafter eagle3:eagle3-llama-3.1-8b --num-draft 6
    python -m spec_jax.aot --model llama-3.1-8b --platform tpu:v5e-4 --mesh model=4 --drafter draft:llama-3.2-1b
    python -m spec_jax.aot --model llama-3.1-8b --platform cuda --mesh model=4 --tree 6,4,31 --drafter eagle3

Compiles the decode generate() runs (prefill + rounds, one program) through XLA:TPU's
compile-only topology (needs libtpu: pip install -e '.[aot]'; no chip) or exports it for CUDA
(StableHLO; no GPU), and prints per device: weights, KV cache, drafter and decode state, the
compiler's arguments / temporaries / peak (TPU), the chip's memory and whether it fits, and the
Pallas kernel calls in the program. Exit status 0 when it compiled, fits and holds the kernel
calls; 1 otherwise; 2 for bad arguments. CONFIG: a config.json, a folder with one, or a name in
configs/aot/ (llama-3.1-8b, llama-3.2-1b, qwen3-8b, gemma-4-31b, eagle3-llama-3.1-8b, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m spec_jax.aot", description=__doc__.split("\n\n")[2],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", required=True, help="target config.json / folder / configs/aot name")
  p.add_argument("--platform", required=True,
                 help="tpu:v5e | tpu:v5e-4 | tpu:v5e-8 | tpu:v6e | tpu:v6e-4 | tpu:v6e-8 | tpu:v5p "
                 "| tpu:vXX:AxB (a topology) | cuda")
  p.add_argument("--mesh", default=None, metavar="data=N,model=M",
                 help="shard over N x M devices (default: one device, no mesh)")
  p.add_argument("--drafter", default="none",
                 help="none | draft:CONFIG | eagle3[:CONFIG] | dflash:CONFIG")
  p.add_argument("--num-draft", type=int, default=4, help="K (ignored with --tree)")
  p.add_argument("--tree", default=None, metavar="DEPTH,TOP_K,NODES", help="tree drafting")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--prompt-len", type=int, default=512)
  p.add_argument("--capacity", type=int, default=4096)
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  p.add_argument("--attention-impl", default="auto", choices=("auto", "pallas", "reference"))
  p.add_argument("--greedy", action="store_true", help="compile the greedy program")
  p.add_argument("--json", default=None, help="append the report as one JSON line to this file")
  return p


def setup_environment(platform: str, devices: int) -> None:
  """Before jax is imported: CPU as the runtime (the topology is compile-only), libtpu's
  lockfile not taken (another process may hold it), host devices for a cuda mesh."""
  import jax        # imported already (spec_jax's package), but no backend made yet
  if not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  if platform == "cuda" and devices > 1:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={devices}").strip()


def parse_tree(text):
  from spec_jax.tree import TreeSpec
  if text is None:
    return None
  try:
    depth, top_k, nodes = (int(x) for x in text.split(","))
  except ValueError:
    raise ValueError(f"--tree is DEPTH,TOP_K,NODES (e.g. 6,4,31), got {text!r}") from None
  return TreeSpec(depth=depth, top_k=top_k, num_nodes=nodes)


def check_arguments(args) -> None:
  """The command line's own checks (ValueError), before anything is built: a platform name
  (not read as a TPU topology: "rocm" asked for libtpu), and shapes a decode can have (a batch
  of 0 or a prompt longer than the cache failed inside the compile)."""
  import re
  from spec_jax.aot.program import TPU_TOPOLOGIES
  if not (args.platform == "cuda" or args.platform in TPU_TOPOLOGIES
          or re.fullmatch(r"tpu:v\w+:\d+(x\d+)+", args.platform)):
    raise ValueError(f"--platform {args.platform!r}: use cuda, one of "
                     f"{', '.join(sorted(TPU_TOPOLOGIES))} or tpu:vXX:AxB (a topology)")
  for name in ("batch", "prompt_len", "capacity", "num_draft"):
    if getattr(args, name) < 1:
      raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  if args.prompt_len >= args.capacity:
    raise ValueError(f"--prompt-len {args.prompt_len} must be below --capacity "
                     f"{args.capacity} (the cache holds the prompt and the new tokens)")


def run(args):
  """The compile of one command line -> its program.Report (ValueError on bad input)."""
  from spec_jax.aot import program, shapes
  from spec_jax.sharding import parse_mesh_spec
  check_arguments(args)
  sizes = parse_mesh_spec(args.mesh) if args.mesh else {"data": 1, "model": 1}
  config = shapes.target_config(args.model, dtype=args.dtype).replace(
      attention_impl=args.attention_impl)
  model = shapes.abstract_model(config)
  drafter = shapes.drafter_from_spec(args.drafter, model)
  tree = parse_tree(args.tree)
  if args.batch % sizes["data"]:
    raise ValueError(f"--batch {args.batch} does not divide over data={sizes['data']}")
  label = (f"{pathlib_stem(args.model)} {args.drafter}"
           + (f" tree {args.tree}" if tree else (f" K={args.num_draft}" if drafter else "")))
  return program.compile_decode(
      model, drafter, platform=args.platform, data=sizes["data"], model_axis=sizes["model"],
      use_mesh=args.mesh is not None, batch=args.batch, prompt_len=args.prompt_len,
      capacity=args.capacity, num_draft=args.num_draft if drafter else 4, tree=tree,
      greedy=args.greedy, label=label)


def pathlib_stem(path: str) -> str:
  import pathlib
  return pathlib.Path(path).stem if path.endswith(".json") else pathlib.Path(path).name


def describe(report) -> str:
  from spec_jax import memory
  e = report.estimate
  kernels = "Triton" if report.platform == "cuda" else "Mosaic"
  lines = [f"{report.label} on {report.platform}"
           + (f" mesh {report.mesh}" if report.mesh else " (one device)")
           + f": compiled in {report.seconds:.0f} s",
           "  " + e.describe(report.device_bytes),
           f"  KV cache {report.cache_dtype}; {report.kernel_calls} {kernels} kernel call(s)"
           + ("" if report.vocab_gathers is None else
              f"; {report.vocab_gathers} vocabulary-sized all-gather(s)")]
  if e.compiled:
    base = e.weights + e.kv_cache
    temps = memory.device_temporaries(e.compiled)
    where = "in device memory" if "device_temporaries" in e.compiled else "(all memory spaces)"
    lines.append(f"  compiler temporaries {where} {temps / 2**30:.2f} GiB = "
                 f"{100 * temps / base:.1f}% of weights + KV; beyond "
                 f"weights, caches and state: {e.overhead / 2**30:.2f} GiB")
    if e.drafter_weights + e.state > 0.01 * base:
      # A draft model brings weights and a KV cache of its own (allocated in the program, so
      # among the temporaries): the same figure over everything resident.
      lines.append(f"  the same over all weights, caches and state (the drafter's too, "
                   f"{e.resident / 2**30:.2f} GiB): {100 * temps / e.resident:.1f}%")
    if "device_temporaries" in e.compiled:
      total = e.compiled["temporaries"]
      lines.append(f"  memory_analysis() temporaries, HBM and on-chip scratch together: "
                   f"{total / 2**30:.2f} GiB = {100 * total / base:.1f}% of weights + KV")
  return "\n".join(lines)


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  try:
    from spec_jax.sharding import parse_mesh_spec
    check_arguments(args)
    sizes = parse_mesh_spec(args.mesh) if args.mesh else {"data": 1, "model": 1}
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  setup_environment(args.platform, sizes["data"] * sizes["model"])
  try:
    report = run(args)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except Exception as e:  # noqa: BLE001 - XLA's own verdict, e.g. out of HBM
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    print(f"error: does not fit: XLA:TPU says {str(e).splitlines()[0]}", file=sys.stderr)
    return 1
  print(describe(report), flush=True)
  if args.json:
    with open(args.json, "a") as f:
      f.write(json.dumps(report.as_dict()) + "\n")
  ok = report.fits and (report.kernel_calls > 0 or args.attention_impl == "reference")
  if not report.fits:
    print("error: does not fit the device", file=sys.stderr)
  elif not ok:
    print("error: no Pallas kernel call in the program (the reference attention was traced)",
          file=sys.stderr)
  return 0 if ok else 1
