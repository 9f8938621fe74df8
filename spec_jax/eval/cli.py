"""The command line of python -m spec_jax.eval."""

from __future__ import annotations

import argparse
import sys

from spec_jax.bench.plots import PLOTS_HINT
from spec_jax.bench.tables import fmt, table
from spec_jax.eval.options import PROMPT_CHOICES, EvalOptions
from spec_jax.bench.specs import add_constraint_flags, constraint_of
from spec_jax.models.chat import parse_template_kwargs
from spec_jax.sampling import OPTIONS


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m spec_jax.eval",
                              description="Spec-Bench-format evaluations of drafters against "
                              "plain decoding.",
                              epilog="Writes DIR/results.json, DIR/report.md and DIR/*.png; "
                              "rerun the same command to resume a killed run.")
  p.add_argument("--target", required=True,
                 help="the target model: a Hugging Face folder or a llama2.c folder / .bin")
  p.add_argument("--drafter", action="extend", nargs="+", required=True, metavar="SPEC",
                 help="ngram | ngram:MAX[:MIN] | draft:MODEL | heads:PATH; repeat or list "
                 "several (plain decoding always runs beside them)")
  p.add_argument("--prompts", default="spec_bench", help=f"{PROMPT_CHOICES} | a .jsonl / "
                 ".jsonl.gz / .txt path (default: %(default)s)")
  p.add_argument("--limit-per-category", type=int, default=None, metavar="N",
                 help="only the first N questions of every category")
  p.add_argument("--batch", type=int, nargs="+", default=[1], help="batch sizes (default 1)")
  p.add_argument("--num-draft", default="4", metavar="K|auto",
                 help="draft tokens per round, or auto (the governor; default 4)")
  p.add_argument("--tree", action="append", default=None, metavar="D,k,N[,CANDIDATES]",
                 help="also decode with this draft tree (sj.TreeSpec(depth=D, top_k=k, "
                 "num_nodes=N[, candidates])) beside the chain of every drafter that builds "
                 "trees; repeatable")
  p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
  for name, opt in OPTIONS.items():     # the other sampling options, one per Sampling field
    if name != "temperature":
      p.add_argument("--" + name.replace("_", "-"), type=opt.parse, default=None,
                     help=f"{opt.help} (default: off)")
  add_constraint_flags(p)
  p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                 help="the chat template's options for every prompt, a JSON object, e.g. "
                 "'{\"enable_thinking\": false}' (Qwen3); default: the template's own")
  p.add_argument("--category", action="append", default=None, metavar="NAME",
                 help="run only this prompt category (repeat for several; default: all)")
  p.add_argument("--max-new-tokens", type=int, default=256)
  p.add_argument("--out", required=True, metavar="DIR", help="the run directory")
  p.add_argument("--strict", action="store_true",
                 help="prompts that do not fit the context are an error, not skipped")
  p.add_argument("--repeats", type=int, default=1, help="timed rounds per batch (default 1)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                 help="the target's (and draft models') weights; default: as stored")
  p.add_argument("--plain-dtypes", nargs="+", default=[], choices=["float32", "bfloat16"],
                 metavar="DTYPE", help="also time plain decoding in these dtypes, in every "
                 "unit: speedups are reported against the fastest plain of any dtype too")
  p.add_argument("--no-progress", action="store_true", help="log lines instead of a bar")
  p.add_argument("--mesh", default=None, metavar="data=N,model=M",
                 help="run every batch sharded over all devices of all processes; needed "
                 "under spec_jax.launch or on a pod (only process 0 writes DIR)")
  return p


def options_from(args) -> EvalOptions:
  return EvalOptions(target=args.target, drafters=tuple(args.drafter), out=args.out,
                     prompts=args.prompts, batch=tuple(args.batch), num_draft=args.num_draft,
                     temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                     limit_per_category=args.limit_per_category, strict=args.strict,
                     repeats=args.repeats, seed=args.seed,
                     progress=not args.no_progress, mesh=args.mesh, dtype=args.dtype,
                     plain_dtypes=tuple(args.plain_dtypes), sampling=sampling_from(args),
                     categories=tuple(args.category or ()), trees=tuple(args.tree or ()),
                     chat_template_kwargs=None if args.chat_template_kwargs is None else
                     parse_template_kwargs(args.chat_template_kwargs))


def sampling_from(args) -> tuple:
  """The sampling options given on the command line, (name, value) pairs (hashable: a logit
  bias as its sorted (id, bias) pairs)."""
  out = []
  for name, opt in OPTIONS.items():
    value = getattr(args, name, None)
    if name != "temperature" and value is not None:
      out.append((name, opt.scalar(value)))
  constraint = constraint_of(args)           # --regex / --json-schema FILE
  if constraint is not None:
    out.append(("constraint", (constraint.kind, constraint.source)))
  return tuple(out)


def summary_text(res: dict) -> str:
  """What the terminal shows at the end: overall speedups over the fastest plain decoding (with
  its noise), latency, where the files are."""
  rows = [[r["drafter"], r["batch"], fmt(r["tokens_per_s"], 1),
           f"{r['speedup_vs_fastest_plain']:.2f}x" if r["speedup_vs_fastest_plain"] else "-",
           f"{r['plain_noise']:.0%}" if r.get("plain_noise") is not None else "-"]
          for r in res["throughput"]]
  taus = {(r["drafter"], r["batch"]): r for r in res["summary"] if r["category"] == "all"}
  for row in rows:
    s = taus.get((row[0], row[1]), {})
    row += [fmt(s.get("tau")), fmt(s.get("alpha"))]
  lat = {(r["drafter"], r["batch"]): r for r in res["latency"]}
  for row in rows:
    t = lat.get((row[0], row[1]), {}).get("tpot_ms") or {}
    row += [fmt(t.get("p50"), 2), fmt(t.get("p99"), 2)]
  out = [table(["drafter", "B", "tok/s", "vs fastest plain", "plain noise", "tau", "alpha",
                "TPOT p50 ms", "TPOT p99 ms"], rows)]
  run = res["run"]
  out.append(f"\n{run['units']} batches ({run['units_measured']} measured, "
             f"{run['units_reused']} reused), {len(res['skipped'])} prompts skipped; "
             f"greedy check: {'passed' if res['greedy_check']['checked'] else 'n/a (T > 0)'}")
  out.append(f"written: {run['out']}/results.json, {run['out']}/report.md" +
             "".join(f", {run['out']}/{p}" for p in res["plots"]))
  if not res["plots"]:
    out.append(PLOTS_HINT)
  return "\n".join(out)


def main(argv=None) -> int:
  """0 on success; 2 with an `error:` line for bad options or inputs; 1 when greedy outputs
  of a drafter differ from plain decoding's."""
  from spec_jax import compile_cache, distributed
  from spec_jax.eval.evaluate import evaluate
  from spec_jax.eval.runner import LossyOutputError
  args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
  try:
    distributed.initialize()          # a multi-process run (spec_jax.launch, a pod) or nothing
    compile_cache.enable()            # a rerun (or a resumed run) compiles nothing
    res = evaluate(options_from(args))
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except LossyOutputError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  if distributed.is_main():
    print(summary_text(res))
  return 0
