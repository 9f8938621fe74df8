"""Per-request latency inside one batched generate() call.

The engine runs a whole batch in one jitted loop; a row stops counting rounds when it finishes
(SpecStats.row_counts['rounds'][b] = the round at which row b finished). With
  ttft     = seconds of generate(max_new_tokens=1) on the same batch and capacity (the prefill,
             which emits every row's first token, and the drafter's init; the loop does not run),
  t_round  = (seconds of the full call - ttft) / loop iterations,
a request's end-to-end latency is ttft + rounds[b] * t_round, and its time per output token
is TPOT = (e2e - ttft) / (new tokens - 1) (undefined for a one-token answer).
"""

from __future__ import annotations


def row_counts(stats) -> dict:
  """The per-row counts of a generate() call: {'rounds', 'drafted', 'accepted', 'rejected':
  [B], 'accepted_at': [B][K]}. The one place that reads them from the engine's statistics."""
  counts = getattr(stats, "row_counts", None)
  if counts is None:
    raise RuntimeError("this spec_jax's generate() reports no per-row counts "
                       "(SpecStats.row_counts): per-request latency cannot be computed")
  return counts


def request_latencies(seconds: float, ttft: float, iterations: int, rounds, new_tokens) -> list:
  """Per row: {'ttft_s', 'e2e_s', 'tpot_s' (None for fewer than 2 new tokens)} from one batch's
  full-call seconds, prefill seconds, loop iterations, per-row rounds and new-token counts."""
  t_round = max(seconds - ttft, 0.0) / iterations if iterations else 0.0
  out = []
  for r, n in zip(rounds, new_tokens):
    e2e = ttft + r * t_round
    out.append({"ttft_s": ttft, "e2e_s": e2e,
                "tpot_s": (e2e - ttft) / (n - 1) if n > 1 else None})
  return out
