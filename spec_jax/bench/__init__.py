"""python -m spec_jax.bench: the honest side-by-side benchmark.

Three suites, each one run that prints one table and writes one JSON file (atomically):

  --suite spec (default)  plain decoding (K=0) and every drafter of every (target, drafter) pair,
      at several K and batch sizes and temperatures, on the SAME prompts, in ONE run: tokens/s
      (median of repeats, min/max), speedup over plain decoding at the same batch and
      temperature in that run, alpha, tau, the measured cost ratios c_draft and c_verify, the
      analytic bound tau / (K c_draft + c_verify) and efficiency = speedup / bound
      (../shared/DESIGN.md, "Performance model"). Ends with one verdict line per pair and
      temperature: the best K per batch and whether it beats plain decoding there.
  --suite plain  plain greedy decoding of spec_jax against transformers' PyTorch `generate`
      (same prompts, same number of new tokens, greedy tokens checked equal before timing), and
      the verify cost ratio c(T) = t(forward over T new tokens at fill F) / t(forward over 1).
  --suite breakdown  where a speculative round's time goes (propose, verify, accept, other).

    python -m spec_jax.bench                                   # spec suite, default pairs
    python -m spec_jax.bench --quick                           # small smoke run
    python -m spec_jax.bench --suite plain
    python -m spec_jax.bench --config configs/bench_default.yaml
    python -m spec_jax.bench --pairs ../shared/models/stories260K@ngram --num-draft 2 4 \\
        --batch 1 8 --prompts ../shared/data/prompts/spec_bench.jsonl

Models (`TARGET` in a pair, `--plain-models`): a Hugging Face folder, a llama2.c folder or .bin
(anything `sj.load` reads), or `random:100m` / `random:tiny` / `random:tiny-draft` (random
weights, see RANDOM_MODELS; no tokenizer: prompts become seeded random token ids).
Drafters (`DRAFTER`): `ngram`, `ngram:MAX[:MIN]`, `draft:MODEL` (a DraftModel), `heads:PATH`.
A pair is written `TARGET@DRAFTER`; `--pairs default` is DEFAULT_PAIRS.

Timing rules: every configuration gets one warm-up call first (compilation is excluded:
generate() compiles ahead of time and times only the compiled call); every configuration of one
(target, batch, temperature) cell is then run round-robin, `repeats` times, with plain decoding
measured at the start AND at the end of every round, so slow phases of a shared machine hit
all configurations alike; stop_tokens=[] so every row of every configuration produces exactly
max_new_tokens new tokens; same prompts and same PRNG key everywhere. The spread (max-min)/median
of the plain baseline is reported as the machine's noise.

The package: timing (calibrated, interleaved timers) and timers (the engine's pieces in jitted
loops), specs (model / drafter / pair specs), prompts (prompt sets), metrics, suites/ (spec,
plain, breakdown), report (text and Markdown tables), plots (PNG figures, matplotlib optional),
results (JSON written atomically, machine info), definitions (what every field means), cli. The evaluation
harness, python -m spec_jax.eval, times and prints with the same modules.
"""

from spec_jax.bench.cli import main

__all__ = ["main"]
