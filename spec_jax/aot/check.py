"""python -m spec_jax.aot.check: CI's accelerator check (issue 35), a few minutes on 2 cores.

Compiles a small real shape through XLA:TPU's compile-only v5e 2x2 topology (libtpu; no chip):
a Llama-3.2-1B-wide target cut to 4 layers (configs/aot/ci-llama-1b.json), B = 8, prompt 128,
capacity 2048, bfloat16:

  one chip, no mesh, plain decoding           the memory check and the platform check
  --mesh model=4, a draft model, K = 4        kernels shard_mapped: rows x KV heads
  --mesh model=4, an EAGLE-3 tree (7 nodes)   the head's kernel and the tree mask too
  --mesh data=4, a draft model, K = 4

About 4 minutes on the 2-core CI machine (the 31-node EAGLE-3 tree alone took 3; the 8B
runs of docs/accelerators.md cover the large trees).

and fails (exit 1) when any of issue 35's defects is back:
  1. a Mosaic kernel under a mesh that is not shard_mapped: the compile raises;
  2. program-sized temporaries (weights fused inside the jit, [B, P, V] prefill logits, f32
     [B, H, P, S] prefill scores): the compiler's temporaries exceed TEMP_LIMIT of weights + KV;
  3. backend choices read from the host (CPU) instead of the platform lowered for: no Mosaic
     kernel call in the program, or a float32 KV cache;
and, beyond the issue's three: a head_dim-64 cache that is not lane-packed, or an all-gather
of a vocabulary-sized buffer under a mesh (a token draw gathering each row's distribution).

`--put-back mesh|fuse|scores|logits|platform|lanes|parts` restores main's behaviour of one
defect in this process (a monkeypatch) to show that the check then fails;
docs/accelerators.md records those runs.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax

# Importing these makes no backend (spec_jax's package has imported jax already); the
# environment setup_environment sets is read when the first backend is made, in main.
from kernels_pallas import dispatch, lanes, platform, reference
from spec_jax import sampling_draw
from spec_jax.aot import program, shapes
from spec_jax.aot.cli import describe, parse_tree, setup_environment
from spec_jax.decoding import target as target_lib
from spec_jax.models import blocks, cache as cache_lib, llama

CI_TARGET = "ci-llama-1b"
CI_DRAFT = "ci-llama-1b-draft"
CI_EAGLE3 = "ci-eagle3-llama-1b"
PLATFORM = "tpu:v5e-4"
SHAPE = dict(batch=8, prompt_len=128, capacity=2048)
TEMP_LIMIT = 0.30          # compiler temporaries / (weights + KV), one chip, plain: measured 0.22
# here since the head_dim-64 cache is lane-packed (0.37 before, when each [S, 64] slab was
# padded to 128 lanes; 0.47 before the TPU cache kernels: 4 layers, so the prefill
# activations weigh more against the weights than in an 8B model, docs/accelerators.md); each
# memory defect put back raises it to 0.37-0.86 (scores 0.37, platform 0.54, logits 0.59,
# fuse 0.86)

RUNS = (  # (label, drafter spec, mesh (data, model) or None, num_draft, tree)
    ("plain, one chip", "none", None, 4, None),
    ("draft model K=4, model=4", f"draft:{CI_DRAFT}", (1, 4), 4, None),
    ("EAGLE-3 tree 3,2,7, model=4", f"eagle3:{CI_EAGLE3}", (1, 4), 3, (3, 2, 7)),
    ("draft model K=4, data=4", f"draft:{CI_DRAFT}", (4, 1), 4, None),
)


DEFECTS = ("mesh", "fuse", "scores", "logits", "platform", "lanes", "parts")


def put_back(defect: str) -> None:
  """Restores main's behaviour for one of issue 35's defects (this process only):
  mesh      the Mosaic kernel called as it is under a mesh (no shard_map)          defect 1
  fuse      the weights fused inside the decode jit, canonical ones passed in      defect 2
  scores    prefill attention over the whole capacity, float32 [B, H, P, S]      defect 2
  logits    the prefill's logits at every prompt position [B, P, V]               defect 2
  platform  every backend choice from jax.default_backend() (the CPU host)       defect 3
  lanes     head_dim-64 caches not lane-packed (each [S, 64] slab padded to 128 lanes in HBM;
            not one of the issue's defects: kernels_pallas.lanes, 2026-12-05)
  parts     token draws in blocks from token 0, across the vocabulary's shard boundaries
            (XLA all-gathers each row's distribution; not one of the issue's defects:
            sampling.sample_layout, 2026-12-05)
  """
  if defect == "mesh":
    dispatch.sharded = lambda call, mesh, *args, **kw: call(*args)
  elif defect == "fuse":
    # The family record is frozen; this put-back (one process, a diagnosis) swaps its in-jit
    # hook for the fused layout, which every target and draft model of the family reads.
    object.__setattr__(llama.FAMILY, "prepare", llama.layout.execution_layout)
    original = program.abstract_call
    program.abstract_call = lambda *a, **k: original(*a, **dict(k, prepared=False))
  elif defect == "scores":
    def whole_capacity(q, k, v, *args, layer=None, **kw):
      whole = (lambda c: c) if layer is None else (lambda c: c[layer])
      k, v = whole(k), whole(v)
      if kw.get("head_major"):         # a lane-packed slab unpacked (kernels_pallas.lanes)
        k, v = lanes.unpacked(k, q.shape[-1]), lanes.unpacked(v, q.shape[-1])
      return reference.verify_attention_reference(q, k, v, *args, **kw)
    blocks.verify_attention_blocked = whole_capacity
  elif defect == "logits":
    target_lib.ModelTarget.forward_last = target_lib.Target.forward_last
  elif defect == "lanes":
    cache_lib.default_lane_pack = lambda config: False
  elif defect == "parts":
    sampling_draw.SAMPLE_PARTS = 1           # where sample_layout reads it
  elif defect == "platform":
    platform.current = lambda: platform.normalize(jax.default_backend())
    platform.is_cpu = lambda: platform.current() == "cpu"
  else:
    raise ValueError(f"--put-back takes one of {DEFECTS}, got {defect!r}")


def failures(label: str, report, one_chip: bool) -> list:
  """What is wrong with one compile's report (empty: fine)."""
  bad = []
  if report.kernel_calls < 1:
    bad.append("no Mosaic kernel call: the reference attention was traced (defect 3)")
  if not report.cache_dtype.startswith("bfloat16 head-major"):
    bad.append(f"KV cache {report.cache_dtype}, not the TPU kernel's bfloat16 [L, B, Hkv, S, "
               f"Dh] (defect 3)")
  elif "heads per 128 lanes" not in report.cache_dtype:
    # CI's Llama-3.2-1B shape has head_dim 64 and 8 KV heads: packed in pairs on every mesh
    # here (kernels_pallas.lanes), else each [S, 64] slab is padded to 128 lanes in HBM.
    bad.append(f"KV cache {report.cache_dtype}: head_dim-64 heads not lane-packed")
  if report.vocab_gathers:
    # the vocabulary is split on "model": a gather of it is a whole distribution moved
    # between chips at each draw (sampling.sample_layout keeps the draw sharded)
    bad.append(f"{report.vocab_gathers} vocabulary-sized all-gather(s) under the mesh")
  est = report.estimate
  if not report.fits:
    bad.append("does not fit a v5e chip")
  if one_chip and est.compiled:
    # memory_analysis()'s figure (HBM and on-chip scratch together), as TEMP_LIMIT was set on
    # it (at this 4-layer shape the 112 MiB of VMEM scratch is ~10 % of W + KV).
    ratio = est.compiled["temporaries"] / (est.weights + est.kv_cache)
    if ratio > TEMP_LIMIT:
      bad.append(f"temporaries {ratio:.0%} of weights + KV > {TEMP_LIMIT:.0%} (defect 2)")
  return [f"{label}: {b}" for b in bad]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m spec_jax.aot.check", description=__doc__)
  p.add_argument("--put-back", choices=DEFECTS, default=None)
  p.add_argument("--only", type=int, nargs="*", default=None, help="run these RUNS indices")
  args = p.parse_args(argv)
  setup_environment(PLATFORM, 4)
  if args.put_back:
    put_back(args.put_back)
    print(f"put back: defect {args.put_back!r} (main's behaviour)")
  start, bad = time.perf_counter(), []
  target = shapes.abstract_model(shapes.target_config(CI_TARGET))
  for i, (label, spec, mesh, k, tree) in enumerate(RUNS):
    if args.only is not None and i not in args.only:
      continue
    drafter = shapes.drafter_from_spec(spec, target)
    data, model = mesh or (1, 1)
    try:
      report = program.compile_decode(
          target, drafter, platform=PLATFORM, data=data, model_axis=model,
          use_mesh=mesh is not None, num_draft=k, label=label,
          tree=parse_tree(",".join(map(str, tree))) if tree else None, **SHAPE)
    except Exception as e:  # noqa: BLE001 - a compile that fails is the finding
      bad.append(f"{label}: compile failed: {type(e).__name__}: {str(e)[:300]}")
      print(bad[-1], flush=True)
      continue
    print(describe(report), flush=True)
    found = failures(label, report, one_chip=mesh is None)
    for line in found:
      print("FAIL " + line, flush=True)
    bad += found
  failed = len(set(b.split(":")[0] for b in bad))
  ran = len(RUNS) if args.only is None else len(args.only)
  print(f"aot check: {ran} compiles, {failed} with failures "
        f"({time.perf_counter() - start:.0f} s)")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
