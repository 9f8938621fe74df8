"""What a grammar constraint costs: its host compile time over the model's vocabulary, and the
decode step with and without it, side by side (python -m spec_jax.bench.constraint_cost).

Every configuration decodes the same chat prompt for exactly --new tokens (stop tokens off, so
a constrained row that completes its grammar keeps emitting its end token: the same number of
steps), once untimed, then --repeats interleaved rounds (timing.interleaved_rounds); the step
time is the median seconds / target passes, and the overhead is the per-round ratio's median
(with its spread: the noise). Plain decoding and a chain of n-gram drafts (whose verify
advances the automaton along the drafted prefix) are both measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


import spec_jax as sj
from spec_jax.files import atomic_write_json
from spec_jax.timing import interleaved_rounds

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "kind": {"enum": ["cat", "dog", "fox"]},
    "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    "size": {"type": "number"},
    "home": {"type": "object", "properties": {"town": {"type": "string", "maxLength": 15}},
             "required": ["town"]}},
    "required": ["name", "kind", "tags", "size", "home"]}
REGEX = r"(yes|no), because [a-z ,]+\."


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m spec_jax.bench.constraint_cost")
  p.add_argument("--model", default="../shared/models/smollm2-135m-instruct")
  p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
  p.add_argument("--new", type=int, default=64, help="new tokens per call")
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--num-draft", type=int, default=3)
  p.add_argument("--json", default=None, metavar="FILE", help="write the results here")
  args = p.parse_args(argv)

  model = sj.load(args.model, dtype=args.dtype)
  msgs = [[{"role": "user", "content": "Describe a pet as JSON."}]]
  compile_s = {}
  for name, make in (("json_schema", lambda: sj.constraints.json_schema(SCHEMA)),
                     ("regex", lambda: sj.constraints.regex(REGEX))):
    start = time.perf_counter()
    g = make().compile(model.tokenizer, vocab_size=model.config.vocab_size,
                       end_ids=model.tokenizer.eos_ids)
    compile_s[name] = {"seconds": time.perf_counter() - start, **g.sizes,
                       "table": [g.num_states, g.num_classes]}
    print(f"{name}: compiled in {compile_s[name]['seconds']:.2f} s, {g.sizes}", flush=True)

  configs = {}
  for drafter_name, drafter in (("plain", None), ("ngram", sj.drafters.NGram())):
    for c_name, constraint in (("free", None), ("json_schema", sj.constraints.json_schema(SCHEMA)),
                               ("regex", sj.constraints.regex(REGEX))):
      configs[f"{drafter_name}/{c_name}"] = dict(
          messages=msgs, drafter=drafter, num_draft=args.num_draft,
          max_new_tokens=args.new, sampling=sj.Sampling(0.0), stop_tokens=[],
          constraint=constraint)
  for kw in configs.values():                     # compile + a first run, untimed
    sj.generate(model, **kw)
  runs = {name: (lambda kw=kw: sj.generate(model, **kw).stats) for name, kw in configs.items()}
  results = interleaved_rounds(runs, args.repeats)
  step = {n: [s.seconds / max(int(s.rounds), 1) for s in stats] for n, stats in results.items()}
  out = {"model": args.model, "dtype": args.dtype, "new_tokens": args.new,
         "repeats": args.repeats, "compile": compile_s, "rows": []}
  print(f"\n{'config':<22}{'step ms':>9}{'tau':>6}{'overhead':>10}{'spread':>8}")
  for name in configs:
    base = name.split("/")[0] + "/free"
    ratios = [a / b for a, b in zip(step[name], step[base])]
    row = {"config": name, "step_ms": 1e3 * statistics.median(step[name]),
           "tau": statistics.median(s.mean_accepted_length for s in results[name]),
           "overhead_pct": 100 * (statistics.median(ratios) - 1),
           "spread_pct": 100 * (max(ratios) - min(ratios))}
    out["rows"].append(row)
    tau = row["tau"] if row["tau"] is not None else float("nan")
    print(f"{name:<22}{row['step_ms']:>9.2f}{tau:>6.2f}{row['overhead_pct']:>9.1f}%"
          f"{row['spread_pct']:>7.1f}%")
  if args.json:
    atomic_write_json(args.json, out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
