"""python -m spec_jax.eval: Spec-Bench-format evaluations of drafters against plain decoding.

    python -m spec_jax.eval --target PATH --drafter ngram [--drafter draft:MODEL ...] \
        --prompts spec_bench|mt_bench|humaneval|gsm8k|FILE [--limit-per-category N] \
        --batch 1 4 16 --num-draft 4 --temperature 0 --max-new-tokens 256 --out DIR

- Prompts go through the tokenizer's chat template when it has one, raw text otherwise;
  MT-bench's second turn is asked after the model's own first answer (plain decoding's); a
  prompt that does not fit the context (prompt + max new tokens) is skipped, counted and
  listed (--strict makes it an error).
- Plain decoding and every drafter run on the same prompts in the same run, batches formed in
  prompt order, round-robin per batch; at temperature 0 every drafter's output must equal plain
  decoding's token for token (a mismatch stops the run with an error).
- Per category and overall: tau, alpha, tokens/s, speedup over plain; per batch size: TTFT and
  per-request TPOT at p50/p90/p99 (from the round at which each row finished).
- DIR/results.json (everything, with machine info and the git commit), DIR/report.md, and PNG
  plots with matplotlib (the `plot` extra). A killed run resumes from DIR, measuring only the
  batches that are missing.

Modules: options (checked options), prompting (records -> token ids), runner (one batch of all
configurations), latency (per-request TTFT / TPOT), store (the resumable run directory),
aggregate (tables), report (report.md and plots), evaluate (the whole run), cli.
Timing and printing come from spec_jax.bench (timing, report, plots, results).
"""

from spec_jax.eval.cli import main
from spec_jax.eval.evaluate import evaluate
from spec_jax.eval.options import EvalOptions
from spec_jax.eval.runner import LossyOutputError

__all__ = ["main", "evaluate", "EvalOptions", "LossyOutputError"]
