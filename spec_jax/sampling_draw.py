"""Drawing one token per row from unnormalised weights: `sample`, inverse-transform sampling in
two levels over the blocks `sample_layout` lays out (what `spec_jax.sampling` re-exports and the
rejection sampler draws its corrections and bonus tokens with)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


SAMPLE_BLOCK = 256     # tokens per block of the two-level draw in `sample` (~sqrt(V) for 64k)
SAMPLE_PARTS = 16      # the vocabulary is cut into up to this many equal parts before blocking


def sample_layout(vocab: int) -> tuple[int, int, int]:
  """(parts, blocks per part, block) of `sample`'s two-level draw over `vocab` tokens.

  The vocabulary is cut into `parts` equal runs of vocab // parts tokens (parts =
  gcd(vocab, SAMPLE_PARTS)), each padded with zero weights to whole blocks of `block` tokens,
  so no block straddles two parts. A vocabulary sharded over a mesh axis of 2, 4, 8 or 16
  devices (a model-parallel LM head's logits) then splits between whole blocks and XLA keeps
  the draw sharded, where blocks across shard boundaries made it all-gather every row's
  [V] float32 weights at each draw (Llama 3's 128,256 = 501 x 256 over 4 shards). The layout
  depends on the vocabulary alone, never on the mesh, so a mesh draws the tokens one device
  draws. A vocabulary whose parts would be shorter than a block keeps one part (blocks from
  token 0, the layout before parts); one divisible by SAMPLE_PARTS x SAMPLE_BLOCK (49,152,
  262,144) gets the same blocks, and so the same draws, under either rule.
  """
  block = min(vocab, SAMPLE_BLOCK)
  parts = math.gcd(vocab, SAMPLE_PARTS)
  if vocab // parts < block:
    parts = 1
  return parts, -(-(vocab // parts) // block), block


def first_positive_above(weights, cdf, u):
  """Inverse-transform sampling's index: the first i with weights[i] > 0 and u < cdf[i]
  (weights, cdf [..., n], u [..., 1]) -> int32 [...].

  With exact sums the filter changes nothing: a zero weight leaves the cdf flat, so the first
  cdf above u never sits at one. But XLA computes a long cumsum as a blocked tree whose sums
  are not monotone: at 512 or more blocks (Llama 3's 128,256 tokens) an empty block's cdf came
  out above its predecessor's, and `sample` drew a token of weight 0 (cut by top-k, banned,
  outside a grammar, outside a rejection's residual) about once in 10^7 draws. Where no
  positive weight's cdf exceeds u (rounding again) the index is the last positive one.
  """
  positive = weights > 0
  above = (cdf > u) & positive
  index = jnp.arange(weights.shape[-1], dtype=jnp.int32)
  # a max, not argmax of a reversal: XLA:TPU turns a reverse along a sharded axis into a
  # collective permute (tests/test_accelerators.py forbids reverses in the verify)
  last_positive = jnp.max(jnp.where(positive, index, 0), axis=-1)   # 0: all zero (undefined)
  return jnp.where(jnp.any(above, axis=-1), jnp.argmax(above, axis=-1),
                   last_positive).astype(jnp.int32)


def sample(key, probabilities):
  """Draws one token per row from probabilities [..., V] -> int32 [...].

  The weights need not be normalised (a rejection residual max(p - q, 0) is drawn as it is);
  zero-weight tokens are never drawn. Inverse-transform sampling in two levels: a block of
  SAMPLE_BLOCK tokens with probability S_g / S (its share of the mass), then a token inside it
  with probability p_i / S_g, so P(i) = p_i / S exactly up to float32 rounding of sums of at
  most max(G, SAMPLE_BLOCK) terms, G ~ V / SAMPLE_BLOCK blocks (laid out by `sample_layout`:
  whole blocks inside each of up to SAMPLE_PARTS equal parts of the vocabulary, so that a
  sharded vocabulary is drawn without gathering it). Gumbel-max (`jax.random.categorical`) draws
  the same distribution but needs V random numbers and 2V logarithms per row: 1.5 ms for one
  row of SmolLM2's 49,152 tokens and 118 ms for 128 rows on this CPU, against 0.23 ms and
  7.7 ms here (two uniforms per row, one sum and two short cumulative sums;
  scripts/sample_cost.py). A row whose weights are
  all zero draws an undefined token (nothing in the library produces one).
  """
  p = jnp.maximum(probabilities.astype(jnp.float32), 0.0)
  lead, vocab = p.shape[:-1], p.shape[-1]
  parts, blocks_per_part, block = sample_layout(vocab)
  per_part = vocab // parts
  p = p.reshape(lead + (parts, per_part))                              # [..., P, V/P]
  pad = [(0, 0)] * (len(lead) + 1) + [(0, blocks_per_part * block - per_part)]
  blocks = jnp.pad(p, pad).reshape(lead + (parts * blocks_per_part, block))   # [..., G, b]
  key_block, key_token = jax.random.split(key)

  def invert(weights, k):
    cdf = jnp.cumsum(weights, axis=-1)
    u = jax.random.uniform(k, lead + (1,), jnp.float32) * cdf[..., -1:]
    return first_positive_above(weights, cdf, u)

  g = invert(jnp.sum(blocks, axis=-1), key_block)                                 # [...]
  inside = jnp.take_along_axis(blocks, g[..., None, None], axis=-2)[..., 0, :]    # [..., b]
  i = invert(inside, key_token)
  part, within = g // blocks_per_part, (g % blocks_per_part) * block + i
  return (part * per_part + jnp.minimum(within, per_part - 1)).astype(jnp.int32)
