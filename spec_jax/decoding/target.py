"""The target protocol: all that the decode core asks of the model it speculates for.

The core (spec_jax.decoding, the tree round, the governor's loop) never reaches into a model's
params or cache: it calls these methods, so any JAX model can be a target — spec_jax.models'
transformers (`ModelTarget`, what `sj.decode(config=ModelConfig)` wraps) or a researcher's own
Flax NNX module or another library's transformer, wrapped in a few lines:

    @dataclasses.dataclass(frozen=True)        # hashable: it is a static argument of the jit
    class MyTarget(sj.Target):
      vocab_size: int = 32000
      max_position_embeddings: int = 4096
      eos_token_ids: tuple = (2,)

      def init_cache(self, batch, capacity):
        return my_model.empty_cache(batch, capacity)             # any pytree of arrays

      def forward(self, params, tokens, cache, offsets, *, positions=None, tree_mask=None,
                  return_layers=()):
        logits, hidden, cache = my_model.apply(params, tokens, cache, offsets)
        return sj.ForwardOutput(logits, hidden, (), cache)

    res = sj.decode(params, prompts, lens, key, config=MyTarget(), drafter=sj.drafters.NGram(),
                    num_draft=4, max_new_tokens=64, capacity=256, sampling=sj.Sampling(0.0))

The contract of `forward` (what the core relies on for losslessness): tokens int32 [B, T] are
row b's positions offsets[b] .. offsets[b]+T-1 (or `positions` [B, T] when given: a tree's
node depths); each new token attends to the row's cache entries before offsets[b] and, among
the T new ones, to those allowed by tree_mask [B, T, T] (causal when None); the new K/V are
written at cache slots offsets[b] .. offsets[b]+T-1, overwriting whatever stale entries lie
there (rejected drafts of earlier rounds). It returns logits [B, T, V] (float32), the hidden
state that drafters following the target read ([B, T, D] after the final norm; anything of
that shape, or zeros, for targets whose drafters do not need it), the residual stream after
each layer in `return_layers` (EAGLE-3 features; () when none are asked), and the new cache.
Trees also need `move_kv`; the mesh needs `constrain_cache`. The prefill calls `forward_last`
chunk by chunk (spec_jax.models.prefill): by default `forward` with the logits of one token per
row gathered; override it to skip the LM head over the other positions. A cache that is not
positional (a recurrent state) needs `commit_cache` after each round's acceptance.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax

from spec_jax.models.cache import KVCache
from spec_jax.models.config import ModelConfig


class Target:
  """Base class of decode targets (module docstring). Subclasses are hashable (frozen
  dataclasses, say) and implement init_cache and forward; the rest have defaults.

  Attributes:
    vocab_size: V, the size of the logits (drafters must share it).
    max_position_embeddings: the longest context (prompt + new tokens) a generation may reach.
    eos_token_ids: the tokens that end a generation by default (generate's stop_tokens=None).
    tree_capable: move_kv is implemented (tree drafting).
    max_verify: None, or the most tokens one verify may cover (K + 1): a cache that records
      per-position states for commit_cache has room for that many (strategy_for refuses more).
  """
  vocab_size: int
  max_position_embeddings: int
  eos_token_ids: tuple = ()
  tree_capable: bool = False
  max_verify: Optional[int] = None

  def init_cache(self, batch: int, capacity: int):
    """A fresh cache for B rows of S slots (a pytree of arrays)."""
    raise NotImplementedError

  def check_cache(self, cache, batch: int, capacity: int) -> None:
    """Raises ValueError unless `cache` is a cache for (batch, capacity) (decode's cache=):
    by default, init_cache's pytree structure, shapes and dtypes."""
    want = jax.eval_shape(lambda: self.init_cache(batch, capacity))
    got_leaves, got_def = jax.tree.flatten(cache)
    want_leaves, want_def = jax.tree.flatten(want)
    same = got_def == want_def and all(
        tuple(g.shape) == tuple(w.shape) and g.dtype == w.dtype
        for g, w in zip(got_leaves, want_leaves))
    if not same:
      shapes = lambda leaves: [tuple(x.shape) for x in leaves]
      raise ValueError(f"cache must be {type(self).__name__}.init_cache({batch}, {capacity}): "
                       f"leaves {shapes(want_leaves)}, got {shapes(got_leaves)}")

  def prepare(self, params, mesh=None):
    """Loop-invariant work on the params, inside the jit, once per decode call before the loop
    (an execution layout); default: the params as they are."""
    del mesh
    return params

  def forward(self, params, tokens, cache, offsets, *, positions=None, tree_mask=None,
              return_layers: Sequence[int] = ()):
    """-> ForwardOutput(logits [B,T,V] f32, hidden [B,T,D], layer_hidden, cache)."""
    raise NotImplementedError

  def forward_last(self, params, tokens, cache, offsets, logits_index, return_layers=()):
    """The prefill's forward: forward over tokens [B, T] with the logits of new token
    logits_index[b] of each row only -> ForwardOutput(logits [B, 1, V], hidden [B, T, D], ...).
    Default: the full forward, gathered; override it to skip the LM head elsewhere."""
    out = self.forward(params, tokens, cache, offsets, return_layers=return_layers)
    logits = jax.numpy.take_along_axis(out.logits, logits_index[:, None, None], axis=1)
    return out._replace(logits=logits)

  def move_kv(self, cache, lengths, path, n_accepted):
    """After a tree round: the accepted path's entries to contiguous slots. The verify wrote
    node i of row b at slot lengths[b]-1+i; node path[b, j] (j < n_accepted[b]) moves to slot
    lengths[b]+j. lengths int32 [B] (before the round); path int32 [B, D]; n_accepted [B]."""
    raise ValueError(f"{type(self).__name__} has no move_kv: tree drafting needs it (pass "
                     "tree=None for a chain)")

  def commit_cache(self, cache, lengths, n_accepted):
    """After a round's acceptance: keep the accepted prefix of the verify's writes. lengths
    int32 [B] before the round; n_accepted int32 [B]. The verify wrote positions lengths-1 ..
    lengths-1+K; the round keeps lengths-1 .. lengths+n_accepted-1. Default: nothing, as for a
    KV cache (rejected slots are masked by lengths and overwritten later). A recurrent state
    (linear attention) that the verify returned for every position selects position
    n_accepted here."""
    del lengths, n_accepted
    return cache

  def constrain_cache(self, mesh, cache):
    """Sharding annotations of the cache for a mesh (spec_jax.sharding); default: none."""
    del mesh
    return cache


@dataclasses.dataclass(frozen=True)
class ModelTarget(Target):
  """spec_jax.models' transformers as a Target, for every family: one per ModelConfig (equal
  configs, equal targets: one compile). Each method asks the config's family
  (spec_jax.models.families) at trace time; nothing here depends on which family it is."""
  config: ModelConfig

  family = property(lambda self: self.config.family)
  vocab_size = property(lambda self: self.config.vocab_size)
  max_position_embeddings = property(lambda self: self.config.max_position_embeddings)
  eos_token_ids = property(lambda self: self.config.eos_token_ids)
  tree_capable = property(lambda self: self.config.family.tree_capable)
  max_verify = property(lambda self: self.config.family.max_verify)

  def init_cache(self, batch, capacity):
    return self.family.init_cache(self.config, batch, capacity)

  def check_cache(self, cache, batch, capacity):
    if not isinstance(cache, KVCache):
      Target.check_cache(self, cache, batch, capacity)
      return
    want = jax.eval_shape(lambda: self.family.init_cache(self.config, batch, capacity,
                                                         cache.head_major))
    shapes = lambda c: [tuple(x.shape) for x in jax.tree.leaves((c.k, c.v))]
    if jax.tree.structure(cache) != jax.tree.structure(want) or shapes(cache) != shapes(want):
      layout = "[L, B, Hkv, S, Dh]" if cache.head_major else "[L, B, S, Hkv, Dh]"
      if cache.head_major:
        layout += (" (lane-packed [L, B, Hkv/p, S, p*Dh] where the TPU kernel reads it: made "
                   "under the same platform and mesh as the decode)")
      raise ValueError(f"cache must be {layout} buffers {shapes(want)} (sj.KVCache.zeros(config, "
                       f"B, capacity)), got {shapes(cache)}")

  def prepare(self, params, mesh=None):
    return self.family.prepare(params, self.config, mesh)

  def forward(self, params, tokens, cache, offsets, *, positions=None, tree_mask=None,
              return_layers=()):
    return self.family.forward(params, self.config, tokens, cache, offsets, positions=positions,
                               tree_mask=tree_mask, return_layers=return_layers)

  def forward_last(self, params, tokens, cache, offsets, logits_index, return_layers=()):
    return self.family.forward(params, self.config, tokens, cache, offsets,
                               return_layers=return_layers, logits_index=logits_index)

  def move_kv(self, cache, lengths, path, n_accepted):
    return self.family.move_kv(cache, lengths, path, n_accepted)

  def commit_cache(self, cache, lengths, n_accepted):
    commit = self.family.commit_cache
    return cache if commit is None else commit(cache, lengths, n_accepted)

  def constrain_cache(self, mesh, cache):
    return self.family.constrain_cache(mesh, cache)


def as_target(config) -> Target:
  """A Target for decode's `config=`: a Target as it is, a ModelConfig wrapped in ModelTarget;
  ValueError otherwise."""
  if isinstance(config, Target):
    return config
  if isinstance(config, ModelConfig):
    return ModelTarget(config)
  raise ValueError(f"config must be a spec_jax ModelConfig or a spec_jax.Target (the target "
                   f"protocol, spec_jax.decoding.target), got {type(config).__name__}")


def model_config(target: Target) -> Optional[ModelConfig]:
  """The ModelConfig behind a ModelTarget, None for other targets (what host-side helpers that
  know spec_jax.models' layouts, like the CPU execution-layout cache, ask)."""
  return target.config if isinstance(target, ModelTarget) else None
