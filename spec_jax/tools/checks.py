"""What the tools share: the logits they compare after writing a folder, and their main().

Every tool writes something (a widened target, a converted GGUF, exported heads), reads it back
and compares logits with the source on a short prompt; exit status 0 when they agree within
--max-diff, 1 when not, 2 on a ValueError (bad input, said in one line).
"""

from __future__ import annotations

import sys

import numpy as np
from spec_jax.models.transformer import KVCache, forward
from spec_jax.drafters.medusa import medusa_logits


def target_logits(model, tokens) -> np.ndarray:
  """float32 logits [T, V] of one forward over `tokens` (a list of ids)."""
  import jax.numpy as jnp
  toks = jnp.asarray([list(tokens)], jnp.int32)
  cache = KVCache.zeros(model.config, 1, toks.shape[1])
  out = forward(model.params, model.config, toks, cache, jnp.zeros((1,), jnp.int32))
  return np.asarray(out.logits[0])


def head_logits(drafter, model, tokens, steps: int = 2) -> np.ndarray:
  """float32 draft logits of a head drafter over `tokens` on `model`.

  Medusa: [T, K, V], every head at every position. EAGLE / EAGLE-3 / MTP: [steps, T-1, V], the
  head's teacher-forced outputs (step 1) and its own-feature outputs (steps > 1, as when it
  drafts), through `FeatureHead.unroll`. DFlash: [T-1, b-1, V], the block anchored at every
  position but the last (`DFlash.training_hidden`); DSpark: [T-1, K, V], the same blocks with
  its Markov head teacher-forced (`DSpark.training_outputs`)."""
  import jax.numpy as jnp
  toks = jnp.asarray([list(tokens)], jnp.int32)
  cache = KVCache.zeros(model.config, 1, toks.shape[1])
  layers = getattr(drafter, "target_layers", ())
  out = forward(model.params, model.config, toks, cache, jnp.zeros((1,), jnp.int32),
                return_layers=layers)
  if drafter.kind == "medusa":
    return np.asarray(medusa_logits(drafter.params, out.hidden)[0])
  if drafter.kind == "dflash":
    anchors = jnp.arange(toks.shape[1] - 1, dtype=jnp.int32)[None]
    hidden = drafter.training_hidden(drafter.params, model.params, toks, out.layer_hidden,
                                     anchors)
    return np.asarray(drafter.logits(drafter.params, model.params, hidden[:, :, 1:])[0])
  if drafter.kind == "dspark":     # its Markov-corrected logits, teacher-forced: [T-1, K, V]
    anchors = jnp.arange(toks.shape[1] - 1, dtype=jnp.int32)[None]
    logits, _ = drafter.training_outputs(drafter.params, model.params, toks, out.layer_hidden,
                                         anchors)
    return np.asarray(logits[0])
  feats = drafter.target_feature(drafter.params, out.hidden, out.layer_hidden)
  outs = drafter.unroll(drafter.params, model.params, toks, feats, steps=steps)
  return np.stack([np.asarray(drafter.logits(drafter.params, model.params, o)[0]) for o in outs])


def max_logit_diff(a, b) -> float:
  """max |a - b|, where equal infinities (the -inf outside an EAGLE-3 draft vocabulary) count
  as no difference, any other mismatch of infinities as an infinite one, and a NaN on either
  side as an infinite one (a NaN compared with --max-diff passed every check)."""
  a, b = np.asarray(a), np.asarray(b)
  if np.isnan(a).any() or np.isnan(b).any():
    return float("inf")
  same_inf = np.isinf(a) & (a == b)
  return float(np.abs(np.where(same_inf, 0.0, a) - np.where(same_inf, 0.0, b)).max())


def prompt_tokens(model, prompt: str) -> list:
  """The ids of `prompt` (a fixed synthetic prompt for a model without a tokenizer)."""
  if model.tokenizer is not None:
    return model.encode(prompt)
  return [model.config.bos_token_id or 0] + [(7 * i + 3) % model.config.vocab_size
                                             for i in range(15)]


def num_params(params) -> int:
  import jax
  return int(sum(np.size(x) for x in jax.tree.leaves(params)))


def add_check_flags(parser, what: str, max_diff: float, prompt: bool = True) -> None:
  """--prompt (the check's text), --max-diff (exit 1 above it) and --overwrite (replace OUT)."""
  if prompt:
    parser.add_argument("--prompt", default="Once upon a time, there was a little girl named Lily.",
                        help=f"text of the {what} check")
  parser.add_argument("--max-diff", type=float, default=max_diff,
                      help=f"fail (exit 1) when the {what} differ by more")
  parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT")


def too_far(what: str, max_diff: float) -> int:
  """Say that `what` differ by more than --max-diff; the exit status 1."""
  print(f"error: {what} differ by more than --max-diff={max_diff}", file=sys.stderr)
  return 1


def tool_main(parse_args, run, argv=None) -> int:
  """Parse `argv`, run; a ValueError becomes `error: ...` on stderr and exit status 2."""
  args = parse_args(argv)
  try:
    return run(args)
  except (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
    # A mistyped path is bad input (2), as the tools' own checks say, not a failed check (1).
    print(f"error: {e}", file=sys.stderr)
    return 2
