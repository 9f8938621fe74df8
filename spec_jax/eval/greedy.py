"""The evaluation's greedy check: a drafter's greedy output must be plain greedy decoding's.

In float32 the check is exact, token for token. In bfloat16 a verify over K+1 rows and a
one-row step may run other kernels and round differently, so at a near-tie the two outputs can
part (docs/speed.md, "greedy in bf16"). There the check computes the target's logits at the
first position where a row's outputs differ (the bf16 weights in float32 arithmetic, the
prompt and plain decoding's tokens before that position) and accepts the divergence only when
both tokens are within BF16_ARGMAX_TOL of the logits' scale of the maximum: both are argmaxes up
to the model's own rounding. The divergence is recorded (row, position, both gaps) and counted
in the report. Anything else is a LossyOutputError: a bug in a drafter or the engine, not noise.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import spec_jax as sj

BF16_ARGMAX_TOL = 2.0 ** -6     # of the logits' scale; tests/test_bf16.py measured <= 0.0038
PLAIN = "none"


class LossyOutputError(RuntimeError):
  """Greedy speculative decoding produced other tokens than greedy plain decoding."""


def first_row_difference(a: list, b: list) -> Optional[int]:
  """The first position where two token lists differ (the shorter one's length when one is a
  strict prefix of the other), None when they are equal."""
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return i
  return None if len(a) == len(b) else min(len(a), len(b))


def reference_logits(model32, ids: list) -> np.ndarray:
  """float64 [V] logits of the next token after `ids` (float32 arithmetic; model32 is the
  target with its bf16 weights cast to float32)."""
  import jax.numpy as jnp
  seq = jnp.asarray([list(ids)], jnp.int32)
  cache = sj.KVCache.zeros(model32.config, 1, seq.shape[1])
  out = sj.forward(model32.params, model32.config, seq, cache, jnp.zeros((1,), jnp.int32))
  return np.asarray(out.logits[0, -1], np.float64)


def near_tie(logits: np.ndarray, a: int, b: int) -> dict:
  """Both tokens' distance to the maximum logit and the tolerance there."""
  top = float(np.max(logits))
  # scaled by the largest finite logit: a masked (-inf) entry would make every gap a tie
  finite = np.abs(logits[np.isfinite(logits)])
  tol = BF16_ARGMAX_TOL * (float(np.max(finite)) if finite.size else 0.0)
  gaps = (top - float(logits[a]), top - float(logits[b]))
  return {"gap_plain": gaps[0], "gap_drafter": gaps[1], "tol": tol,
          "near_tie": max(gaps) <= tol}


def check_greedy(unit, configs, outputs: dict,
                 reference: Optional[Callable] = None) -> list:
  """Checks every drafter's greedy tokens against plain decoding's (same dtype) on the real rows
  of `unit`; outputs: config key -> tokens per row. reference: () -> the float32 cast of a
  low-precision target (None for a float32 target: then every difference is an error).
  Returns the accepted near-tie divergences; raises LossyOutputError otherwise."""
  n = len(unit.requests)
  plain = outputs[PLAIN][:n]
  base_dtype = next(c.dtype for c in configs if c.key == PLAIN)
  prompts = unit.prompts()
  found = []
  for c in configs:
    if c.is_plain or c.dtype != base_dtype:   # another dtype's plain greedy may part at ties
      continue
    for row in range(n):
      ours, theirs = outputs[c.key][row], plain[row]
      pos = first_row_difference(theirs, ours)
      if pos is None:
        continue
      req = unit.requests[row]
      where = (f"drafter {c.label} (K={c.num_draft}) vs plain decoding on prompt {req.id} "
               f"({req.category}, turn {req.turn}, batch {unit.batch}) at new token {pos}: "
               f"{ours[pos:pos + 5]} instead of {theirs[pos:pos + 5]}")
      if reference is not None and pos < min(len(ours), len(theirs)):
        tie = near_tie(reference_logits(reference(), list(prompts[row]) + theirs[:pos]),
                       theirs[pos], ours[pos])
        if tie["near_tie"]:
          found.append(dict({"config": c.key, "id": req.id, "turn": req.turn, "row": row,
                             "position": pos}, **tie))
          continue
        raise LossyOutputError(
            f"greedy outputs differ beyond a near-tie: {where}; the two tokens lie "
            f"{tie['gap_plain']:.4g} and {tie['gap_drafter']:.4g} below the maximum logit, "
            f"the bf16 tolerance there is {tie['tol']:.4g}: a bug in the drafter or the engine")
      raise LossyOutputError(
          f"greedy outputs differ: {where}. Greedy speculative decoding must reproduce plain "
          f"decoding exactly: this is a bug in the drafter or the engine, not noise")
  return found
