"""The command line of python -m spec_jax.bench: flags, the --config YAML file, the suites'
JSON files (rewritten atomically, marked partial while the spec suite runs) and --resume."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys
import time

from spec_jax.bench.prompts import PROMPT_SETS
from spec_jax.bench.report import FORMATTERS
from spec_jax.bench.results import ROOT, SCHEMA_VERSION, describe_cpu, log, machine_info
from spec_jax.bench.specs import DEFAULT_PAIRS, resolve_path
from spec_jax.files import atomic_write_json

DEFAULT_PLAIN_MODELS = ("../shared/models/stories260K", "../shared/models/tinystories656K",
                        "random:100m")
QUICK = dict(num_draft=[2, 4], batch=[1, 4], max_new_tokens=32, repeats=2, cost_repeats=5)


def scale_or_tuned(value):
  """--draft-temperature-scale: a number >= 0, or 'tuned'."""
  if value == "tuned":
    return value
  try:
    scale = float(value)
  except ValueError:
    scale = -1.0
  if not 0 <= scale < float("inf"):
    raise argparse.ArgumentTypeError(f"expected a finite number >= 0 or 'tuned', got {value!r}")
  return scale


def k_or_auto(value):
  """A --num-draft value: an integer K or 'auto' (the governor)."""
  if isinstance(value, str) and value.strip().lower() == "auto":
    return "auto"
  try:
    return int(value)
  except (TypeError, ValueError):
    raise argparse.ArgumentTypeError(f"K must be an integer or 'auto', got {value!r}") from None


def build_parser() -> argparse.ArgumentParser:
  """The flags of python -m spec_jax.bench (the --config file's keys are the same names)."""
  p = argparse.ArgumentParser(prog="python -m spec_jax.bench",
                              description="The honest side-by-side benchmark.",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", help="YAML file whose keys are these flags (dashes or "
                 "underscores); flags given on the command line win")
  p.add_argument("--suite", choices=("spec", "plain", "breakdown", "peer", "all"),
                 default="spec",
                 help="spec (default) | plain | breakdown (where a round's time goes) | peer "
                 "(against transformers' plain, assisted and prompt-lookup generation, each "
                 "library in its own process) | all (plain then spec)")
  p.add_argument("--pairs", nargs="+", default=["default"],
                 help="TARGET@DRAFTER ... or 'default' (%s)" % ", ".join(DEFAULT_PAIRS))
  p.add_argument("--num-draft", "-K", type=k_or_auto, nargs="+", default=[1, 2, 4, 6, 8],
                 help="K values, and 'auto' for the governor as one more column (plain K=0 is "
                 "always measured)")
  p.add_argument("--tree", action="append", default=None, metavar="D,k,N[,sampled]",
                 help="also run tree drafting (sj.TreeSpec(depth=D, top_k=k, num_nodes=N); "
                 "',sampled' for i.i.d. candidates) for every drafter that builds trees; "
                 "repeatable, one tree row per flag beside the chain rows")
  p.add_argument("--dtype", nargs="+", choices=("bfloat16", "float32"), default=None,
                 help="spec suite: the target's weights (and a draft model's) in each of these "
                 "dtypes, one set of rows per dtype (default: as stored). bf16 computes with "
                 "float32 accumulation, as GPU and TPU users run it")
  p.add_argument("--plain-dtypes", nargs="+", choices=("bfloat16", "float32"), default=[],
                 help="spec suite: plain decoding is also timed in these dtypes in every cell "
                 "(interleaved with the rest), so that each row's speedup over the fastest "
                 "plain decoding of any dtype is measured side by side")
  p.add_argument("--batch", "-B", type=int, nargs="+", default=[1, 4, 16])
  p.add_argument("--batches-per-cell", type=int, default=1, metavar="N",
                 help="spec suite: every timed measurement runs N consecutive batches of "
                 "distinct prompts (N x B prompts per cell; tokens/s = their tokens / their "
                 "seconds, tau and alpha over all their rows). A B = 1 cell is otherwise one "
                 "prompt, and at temperature 1 one sampled story moves it a lot")
  p.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")],
                 default=[0.0, 1.0], help="comma-separated, e.g. 0,1 (0 = greedy)")
  p.add_argument("--draft-temperature-scale", type=scale_or_tuned, default=1.0, metavar="S",
                 help="sampled cells: drafters draw at S x the temperature (sj.Sampling's "
                 "draft_temperature_scale; 1 = the same, 0 = greedy drafts; lossless either way), "
                 "or 'tuned': every chain K runs as sj.strategies.TunedDraftTemperature(K), "
                 "each row choosing its scale online")
  p.add_argument("--max-new-tokens", type=int, default=128,
                 help="new tokens per row (capped by the context of target and draft model)")
  p.add_argument("--repeats", type=int, default=3, help="timed rounds per configuration")
  p.add_argument("--cost-repeats", type=int, default=20, help="timed calls per cost ratio")
  p.add_argument("--prompts", default="tinystories",
                 help=f"{' | '.join(PROMPT_SETS)} | mixed (even rows tinystories, odd rows "
                 "random token ids the drafter cannot predict) | a .txt / .jsonl / .jsonl.gz "
                 "path | chat:SET (peer suite: each question's first turn in the model's chat "
                 "template, e.g. chat:spec_bench)")
  p.add_argument("--prompt-words", type=int, default=8,
                 help="words of each paragraph used as a prompt (.txt sources)")
  p.add_argument("--max-prompt-tokens", type=int, default=128)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--quick", action="store_true",
                 help="smoke run: K 2 4, batch 1 4, 32 new tokens, 2 repeats, 5 cost repeats")
  p.add_argument("--out", help="JSON output (default bench_results/bench_<suite>.json); the "
                 "spec suite rewrites it (marked partial) after every finished cell")
  p.add_argument("--resume", action="store_true",
                 help="spec suite: keep the finished cells of a partial --out file written with "
                 "the same options and measure only the rest")
  p.add_argument("--plain-models", nargs="+", default=list(DEFAULT_PLAIN_MODELS))
  p.add_argument("--plain-batch", type=int, nargs="+", default=[1, 8])
  p.add_argument("--plain-max-new-tokens", type=int, default=128)
  p.add_argument("--hf-threads", type=int, nargs="+", default=[0, 1],
                 help="torch thread counts for transformers (0 = the CPU core count); the first "
                 "is the headline, the others are extra columns")
  p.add_argument("--hf-dtypes", nargs="+", choices=("float32", "bfloat16"),
                 default=["float32", "bfloat16"],
                 help="peer suite: transformers runs in each of these torch dtypes (the headline "
                 "compares with its best dtype and thread count)")
  p.add_argument("--peer-batch", type=int, nargs="+", default=[1, 8],
                 help="peer suite: batch sizes (transformers' assisted generation and prompt "
                 "lookup run at batch 1 only)")
  p.add_argument("--peer-prompts", type=int, default=4,
                 help="peer suite: prompts per timed call (decoded B at a time)")
  p.add_argument("--peer-rounds", type=int, default=2,
                 help="peer suite: how many times the library processes alternate")
  p.add_argument("--peer-lookup-tokens", type=int, nargs="+", default=[10],
                 help="peer suite: the peers' prompt-lookup draft lengths (transformers' "
                 "prompt_lookup_num_tokens, llama.cpp's num_pred_tokens), one row each")
  p.add_argument("--peers", nargs="+", choices=("hf", "llamacpp"), default=["hf"],
                 help="peer suite: the libraries spec_jax is compared with: hf (transformers) "
                 "and/or llamacpp (llama-cpp-python on a GGUF file, batch 1; the 'peers' "
                 "extra)")
  p.add_argument("--llamacpp-threads", type=int, nargs="+", default=[0, 1],
                 help="peer suite: llama.cpp thread counts (n_threads = n_threads_batch; 0 = "
                 "the CPU core count)")
  p.add_argument("--peer-gguf", default=None,
                 help="peer suite: the GGUF file llama.cpp reads (default: the target itself "
                 "when it is a .gguf file)")
  p.add_argument("--fills", type=int, nargs="+", default=[256, 2048])
  p.add_argument("--max-verify-tokens", type=int, default=9, help="c(T) for T = 1..this")
  return p


def _list_field(v):
  """A YAML value for a list flag: a list, a comma-separated string or one scalar."""
  if isinstance(v, str) and "," in v:
    return [x.strip() for x in v.split(",") if x.strip()]
  return v if isinstance(v, list) else [v]


def _config_value(action, value, where: str):
  """One YAML value through its flag's type and choices, as argparse checks a command line
  (set_defaults alone skipped both: a bad --suite was a KeyError, a float16 dtype ran as
  float32 under a float16 label); ValueError naming the key."""
  if action.nargs == 0:                                  # store_true
    if not isinstance(value, bool):
      raise ValueError(f"{where}: expected true or false, got {value!r}")
    return value
  if isinstance(value, bool) and action.type in (int, float):
    raise ValueError(f"{where}: expected a number, got {value!r}")
  if action.type is int and isinstance(value, float) and not value.is_integer():
    raise ValueError(f"{where}: expected an integer, got {value!r}")
  try:
    converted = value if action.type is None else action.type(value)
  except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
    raise ValueError(f"{where}: {e}") from None
  if action.choices is not None and converted not in action.choices:
    raise ValueError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
  return converted


def config_defaults(parser: argparse.ArgumentParser, config: str) -> dict:
  """The --config YAML file as parser defaults (ValueError: missing file, unknown key, or a
  value its flag's type or choices refuse)."""
  import yaml
  path = resolve_path(config)
  if not path.is_file():
    raise ValueError(f"config file {config!r} not found")
  data = yaml.safe_load(path.read_text()) or {}
  if not isinstance(data, dict):
    raise ValueError(f"{path}: expected a mapping of flag names to values")
  dests = {a.dest: a for a in parser._actions}
  allowed = sorted(d for d in dests if d not in ("help", "config"))
  defaults = {}
  for key, value in data.items():
    dest = str(key).replace("-", "_")
    if dest not in allowed:
      raise ValueError(f"{path}: unknown key {key!r}; allowed: {', '.join(allowed)}")
    action, where = dests[dest], f"{path}: {key}"
    if dest == "temperatures":
      value = [float(x) for x in _list_field(value)]
    elif dest == "tree":
      value = [str(x) for x in (value if isinstance(value, list) else [value])]
    elif action.nargs == "+" or action.nargs == "*":
      items = _list_field(value) if dest != "pairs" else (
          value if isinstance(value, list) else [value])
      value = [_config_value(action, x, where) for x in items]
    elif value is not None or action.default is not None:
      value = _config_value(action, value, where)
    defaults[dest] = value
  return defaults


def parse_args(argv) -> argparse.Namespace:
  """Flags over --config over the defaults, then --quick; ValueError for bad values."""
  parser = build_parser()
  first = argparse.ArgumentParser(add_help=False)
  first.add_argument("--config")
  known, _ = first.parse_known_args(argv)
  if known.config:
    parser.set_defaults(**config_defaults(parser, known.config))
  args = parser.parse_args(argv)
  if args.quick:
    for k, v in QUICK.items():
      setattr(args, k, v)
  for name in ("repeats", "cost_repeats", "max_new_tokens", "plain_max_new_tokens",
               "peer_prompts", "peer_rounds", "batches_per_cell", "prompt_words",
               "max_prompt_tokens"):
    if getattr(args, name) < 1:
      raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
  if any(k < 1 for k in args.peer_lookup_tokens):
    raise ValueError("--peer-lookup-tokens must be >= 1")
  if any(t < 0 for t in args.hf_threads + args.llamacpp_threads):
    raise ValueError("thread counts must be >= 0 (0 = the CPU core count)")
  if any(b < 1 for b in args.batch + args.plain_batch + args.peer_batch):
    raise ValueError("batch sizes must be >= 1")
  if any(t < 0 for t in args.temperatures):
    raise ValueError("temperatures must be >= 0")
  if args.tree:
    from spec_jax.tree import parse_tree_spec
    for t in args.tree:
      parse_tree_spec(t)
  return args


def options_dict(args) -> dict:
  """The parsed options as stored in the JSON (and compared by --resume)."""
  return dict(vars(args))


def output_path(args, suite: str, n_suites: int) -> pathlib.Path:
  """--out, or --out with a _<suite> suffix when several suites run, or the default
  bench_results/bench_<suite>.json."""
  if not args.out:
    return ROOT / "bench_results" / f"bench_{suite}.json"
  out = pathlib.Path(args.out)
  return out if n_suites == 1 else out.with_name(f"{out.stem}_{suite}.json")


def previous_partial(args, out_path: pathlib.Path):
  """With --resume: the partial spec-suite result at out_path if it was written with the same
  options (else None, and a log line says the run starts afresh)."""
  if not (args.resume and out_path.is_file()):
    return None
  old = json.loads(out_path.read_text())
  same = old.get("options", {}) | {"resume": True} == options_dict(args) | {"resume": True}
  if old.get("partial") and same:
    return old
  log(f"[bench] --resume: {out_path} is not a partial run of the same options; starting afresh")
  return None


def run_suite(suite: str, args, checkpoint, previous) -> dict:
  """Runs one suite -> its result dict (ValueError for bad options)."""
  from spec_jax.bench.suites.breakdown import run_breakdown_suite
  from spec_jax.bench.suites.peer import run_peer_suite
  from spec_jax.bench.suites.plain import run_plain_suite
  from spec_jax.bench.suites.spec import run_spec_suite
  if suite == "spec":
    return run_spec_suite(args, checkpoint=checkpoint, previous=previous)
  return {"plain": run_plain_suite, "breakdown": run_breakdown_suite,
          "peer": run_peer_suite}[suite](args)


def main(argv=None) -> int:
  """python -m spec_jax.bench: returns 0, or 2 with an `error:` line for bad options."""
  argv = list(sys.argv[1:] if argv is None else argv)
  try:
    args = parse_args(argv)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  from spec_jax import compile_cache
  compile_cache.enable()        # compiles are never timed; a rerun need not repeat them
  suites = ["plain", "spec"] if args.suite == "all" else [args.suite]
  for suite in suites:
    out_path = output_path(args, suite, len(suites))
    started = time.time()
    info = machine_info()

    def checkpoint(res, out_path=out_path, info=info, started=started):
      atomic_write_json(out_path, dict(res, partial=True, schema_version=SCHEMA_VERSION,
                                       machine=info, options=options_dict(args),
                                       wall_seconds=time.time() - started))

    previous = previous_partial(args, out_path) if suite == "spec" else None
    try:
      result = run_suite(suite, args, checkpoint, previous)
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    try:
      info["loadavg_end"] = os.getloadavg()
    except OSError:
      pass
    result.update({"schema_version": SCHEMA_VERSION, "partial": False,
                   "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                   "wall_seconds": time.time() - started, "machine": info,
                   "options": options_dict(args), "command": ["python", "-m", "spec_jax.bench"]
                   + argv})
    text = FORMATTERS[suite](result)
    result["table"] = text
    atomic_write_json(out_path, result)
    print(text)
    print(f"\n[{suite} suite: {result['wall_seconds']:.0f} s on {describe_cpu(info)}; JSON "
          f"written to {out_path}]")
  return 0
