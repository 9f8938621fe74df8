"""Chunked prefill: right-padded prompts run through a forward C tokens at a time, for as many
chunks as the longest prompt needs (a dynamic count inside one `lax.while_loop`).

Why: the compiled decode then depends on the prompt buffer's static length only through its
buffers, not through the prefill's work, so generate() can pad every prompt to the cache
capacity and compile once per capacity bucket instead of once per prompt length; attention
scores are [B, H, C, S] per chunk, never [B, H, P, S]; and only the logits of each row's last
prompt token are computed (the LM head over every prompt position is ~40 % of a small model's
prefill FLOPs), never [B, P, V].

The result equals one forward over the whole prompt: chunk j's queries see the cache entries
the earlier chunks wrote plus their own causal block, exactly the visibility of the one-shot
forward; padding tokens after a row's prompt write KV slots that no real token attends to and
that generated tokens overwrite later (as in the one-shot prefill).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

PREFILL_CHUNK = 64


class Prefill(NamedTuple):
  """last_logits: float32 [B, V], the logits at each row's last prompt token (prompt_lens - 1);
  hidden: [B, P, D] the final hidden states over the padded prompt buffer, or None when not
  kept; layer_hidden: tuple of [B, P, D] (the requested layers' residual streams); cache."""
  last_logits: jax.Array
  hidden: Optional[jax.Array]
  layer_hidden: tuple
  cache: Any


def chunked_prefill(forward: Callable, tokens, prompt_lens, cache, *, chunk: int = PREFILL_CHUNK,
                    keep_hidden: bool = True, return_layers: Sequence[int] = (),
                    constrain_features: Callable = lambda x: x) -> Prefill:
  """Runs `forward` over tokens int32 [B, P] (row b's prompt in [0, prompt_lens[b])) in chunks.

  forward(tokens [B, C], cache, offsets [B], logits_index [B], return_layers) must return a
  ForwardOutput whose logits are [B, 1, V], those of new token logits_index[b] of row b (-1
  when row b's prompt ended in an earlier chunk: any logits, they are not used), with
  hidden [B, C, D] and layer_hidden of [B, C, D] over all C tokens (ModelTarget.forward_last).

  chunk: C (static); P is padded up to a multiple of C (when P <= C: one forward, no loop).
  keep_hidden: gather hidden / layer_hidden into [B, P, D] buffers (drafters that read the
  prompt's features); False returns hidden None and no layer_hidden.
  constrain_features: applied to each [B, P, D] buffer (a sharding annotation under a mesh:
  spec_jax.sharding.constrain_features splits D on "model", so the buffers that outlive the
  prefill are not whole on every device; each chunk's write stays local).
  """
  b, p = tokens.shape
  tokens = tokens.astype(jnp.int32)
  prompt_lens = prompt_lens.astype(jnp.int32)
  layers = tuple(int(i) for i in return_layers) if keep_hidden else ()
  c = max(1, min(int(chunk), p))
  if c == p:                                   # a short buffer: one forward, no loop
    out = forward(tokens, cache, jnp.zeros((b,), jnp.int32), prompt_lens - 1, layers)
    return Prefill(out.logits[:, 0], out.hidden if keep_hidden else None,
                   tuple(out.layer_hidden), out.cache)
  padded = -(-p // c) * c
  if padded != p:
    tokens = jnp.pad(tokens, ((0, 0), (0, padded - p)))
  n_chunks = (jnp.max(prompt_lens) + c - 1) // c

  def run(start, cache):
    piece = jax.lax.dynamic_slice_in_dim(tokens, start, c, axis=1)
    # -1 for a row whose prompt ended before this chunk: its logits are ignored, and a family
    # with a recurrent state (models.qwen3_next) reads it as "no real token here".
    last = jnp.clip(prompt_lens - 1 - start, -1, c - 1)
    return forward(piece, cache, jnp.full((b,), start, jnp.int32), last, layers)

  shapes = jax.eval_shape(lambda cache: run(jnp.int32(0), cache), cache)
  v = shapes.logits.shape[-1]
  buffers = lambda x: constrain_features(jnp.zeros((b, padded) + x.shape[2:], x.dtype))
  init = (cache, jnp.zeros((b, v), jnp.float32),
          buffers(shapes.hidden) if keep_hidden else None,
          tuple(buffers(h) for h in shapes.layer_hidden))

  def body(i, carry):
    cache, last_logits, hidden, layer_hidden = carry
    start = i * c
    out = run(start, cache)
    ends_here = (prompt_lens - 1 >= start) & (prompt_lens - 1 < start + c)
    last_logits = jnp.where(ends_here[:, None], out.logits[:, 0].astype(jnp.float32),
                            last_logits)
    write = lambda buf, h: constrain_features(jax.lax.dynamic_update_slice_in_dim(
        buf, h.astype(buf.dtype), start, axis=1))
    if keep_hidden:
      hidden = write(hidden, out.hidden)
    layer_hidden = tuple(write(buf, h) for buf, h in zip(layer_hidden, out.layer_hidden))
    return out.cache, last_logits, hidden, layer_hidden

  cache, last_logits, hidden, layer_hidden = jax.lax.fori_loop(0, n_chunks, body, init)
  if keep_hidden and padded != p:
    hidden = hidden[:, :p]
    layer_hidden = tuple(h[:, :p] for h in layer_hidden)
  return Prefill(last_logits, hidden, layer_hidden, cache)
