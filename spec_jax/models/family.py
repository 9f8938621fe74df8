"""Family: everything spec_jax.models knows about one kind of model, in one record.

A family is one folder (spec_jax/models/llama/, spec_jax/models/gemma/) whose __init__ builds
a `Family`, and one line in the table (spec_jax.models.families.FAMILIES). Everything else —
ModelConfig's checks, sj.forward, sj.KVCache.zeros, sj.init_model, sj.load, save_hf,
ModelTarget (the decode core's view of a model) — asks the config's family
(`config.family`) and never tests which family it is.

The functions a family provides (config is a ModelConfig of one of its model_types):

  check_config(config)                      ValueError for what its forward cannot run
  num_params(config) -> int
  init_params(config, key) -> params        random weights; the layout its forward and its
                                            HF reader produce
  forward(params, config, tokens [B,T], cache, offsets [B], *, positions=None, tree_mask=None,
          return_layers=(), logits_index=None) -> ForwardOutput(logits, hidden, layer_hidden,
          cache)                            the target protocol's forward (decoding/target.py)
  init_cache(config, batch, capacity, head_major=None) -> cache
                                            any pytree the family owns: a KVCache for
                                            attention-only families (cache.py), or e.g. a
                                            record of a KVCache and recurrent states
  move_kv(cache, lengths, path, n_accepted) -> cache
                                            after a tree round, the accepted path's entries to
                                            contiguous slots (tree_capable: False when a family
                                            cannot, e.g. a recurrent state that must be
                                            recomputed along the path)
  max_verify: None, or the most tokens one verify may cover (K + 1) for commit_cache to work
                                            (a hybrid's per-position buffers); strategies that
                                            draft more are refused when they bind
  commit_cache(cache, lengths, n_accepted) -> cache
                                            after a chain round's acceptance: what a cache that
                                            is not positional must do to keep only the accepted
                                            prefix. None (KV caches): nothing, rejected slots
                                            are masked by lengths and overwritten later.
  constrain_cache(mesh, cache) -> cache     sharding annotations of the cache (the family's
                                            sharding rule for its cache; weights are placed by
                                            leaf name, spec_jax.sharding)
  prepare(params, config, mesh) -> params   loop-invariant work inside the decode jit (an
                                            execution layout); execution_layout the same for
                                            ahead-of-time lowering; prepare_model(model, mesh,
                                            donate) -> model, once outside any jit
  config_from_hf(hf_config, source, **kw) -> dict
                                            ModelConfig fields from a transformers config
                                            (ValueError for unsupported variants)
  read_params(config, where, folder, dtype=None) -> (config, numpy params, mtp or None)
                                            tensors (hf_reader.open_tensors' {name: file})
                                            into init_params' layout, every shape checked first
  hf_export(config, params) -> (config.json dict, {HF name: array})
                                            save_hf's writer; None: save_hf refuses the family
  llama_view(config) -> ModelConfig         a llama-family config of this model's sizes, what
                                            draft heads with a llama-style layer build on

Data: name; model_types (ModelConfig.model_type values); hf_model_types ({config.json
model_type: ModelConfig.model_type}); config_fields ({ModelConfig field only this family reads:
the value that means "unused"}: other families' configs must leave them so).

A family whose cache is not only a KV cache (a hybrid linear-attention model: Gated DeltaNet
layers with a recurrent state [B, H, Dk, Dv] and a conv window, attention layers with KV):
init_cache returns its own pytree, say a flax dataclass (kv: KVCache of the attention layers,
state [L_lin, B, H, Dk, Dv], conv [L_lin, B, W, C], and per-position buffers of both for the
T verify positions); its forward writes the KV as usual and the state after every new
position into those buffers; commit_cache(cache, lengths, n_accepted) copies position
n_accepted (the accepted prefix's last) into state and conv; tree_capable=False (or a move_kv
that recomputes the state along the path). ModelTarget.commit_cache calls it; the chain round
(decoding/rounds.chain_round) calls Target.commit_cache after acceptance (the KV-cache
families' None makes it the identity). spec_jax.models.qwen3_next is such a family.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from spec_jax.models import cache as cache_lib


def check_layer_types(config, supported) -> tuple:
  """config.layer_types normalised to a tuple of str (set on the frozen config) and checked:
  present, one per layer, each in `supported`; ValueError naming the field otherwise. The
  shared check of the families whose layers differ by kind (Gemma, the hybrid family)."""
  c = config
  if c.layer_types is None:
    raise ValueError(f"a {c.model_type} ModelConfig needs layer_types (one of "
                     f"{tuple(supported)} per layer)")
  types = tuple(str(t) for t in c.layer_types)
  object.__setattr__(c, "layer_types", types)
  unknown = sorted(set(types) - set(supported))
  if unknown:
    raise ValueError(f"layer_types: unsupported layer type(s) {unknown}; supported: "
                     f"{', '.join(supported)}")
  if len(types) != c.num_layers:
    raise ValueError(f"layer_types has {len(types)} entries but num_layers is {c.num_layers}")
  return types


def same_params(params, config, mesh=None):
  """The params as they are (a family without an execution layout)."""
  del config, mesh
  return params


def same_model(model, mesh=None, donate: bool = True):
  del mesh, donate
  return model


def same_config(config):
  return config


def no_check(config) -> None:
  del config


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family (module docstring). Hashable (frozen; functions hash by identity)."""
  name: str
  model_types: tuple
  hf_model_types: dict
  init_params: Callable
  forward: Callable
  init_cache: Callable
  num_params: Callable
  config_from_hf: Callable
  read_params: Callable
  check_config: Callable = no_check
  config_fields: dict = dataclasses.field(default_factory=dict)
  move_kv: Callable = cache_lib.move_kv
  tree_capable: bool = True
  commit_cache: Optional[Callable] = None
  max_verify: Optional[int] = None
  constrain_cache: Callable = cache_lib.constrain_cache
  prepare: Callable = same_params
  execution_layout: Callable = same_params
  prepare_model: Callable = same_model
  hf_export: Optional[Callable] = None
  llama_view: Callable = same_config

  def __hash__(self):
    return hash((self.name, self.model_types))
