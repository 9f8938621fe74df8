"""Medusa heads (Cai et al. 2024): K extra next-next-token heads on the target's last hidden.

Head i (0-based) reads the target's final hidden state h_t (after the final norm, what the LM
head reads) at the position t of the last verified token and predicts token t+2+i:

    r_i = h_t + silu(h_t @ w[i] + b[i])            residual SiLU block, w zero-initialised
                                                    (num_layers such blocks in sequence)
    logits_i = r_i @ lm_head[i]                     the head's own copy of the target's LM head

h_t predicts token t+1 itself (that token is the correction / bonus the verify just produced,
the last committed token), so head i drafts the (i+1)-th token after the last committed one.
With w = 0 every head starts as the target's own next-token head (the Medusa initialisation).

Vocabulary heads: each head owns a trainable copy of the target's LM head (`lm_head` [K, D, V],
initialised from the target's). Medusa-1 trains them; they are small here (D x V per head).

State: h_t, [B, D]. After the prefill it is PrefillInfo.hidden at prompt_lens-1 (it predicted
the first sampled token); after each verify it is VerifyInfo.hidden at index n_accepted (the
hidden after the last accepted input, which predicted the correction / bonus token).

Drafts for positions after the first are not conditioned on the earlier drafts (Medusa's
nature): q_i is a fixed distribution per head, still exact, so the rejection sampler keeps the
target's distribution. Sampled drafts carry their real q (`sampling.probs` of the head's logits
under the row's Sampling); with greedy_drafts=True the argmax is proposed deterministically.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from spec_jax import sampling as sampling_lib
from spec_jax.drafters.base import (DraftContext, FrozenDrafter, PrefillInfo, derived_field,
                                   frozen_drafter, params_field)
from spec_jax.models import matmul
from spec_jax.models.config import ModelConfig


def _row_keys(key, batch):
  return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(batch))


def init_medusa_params(target_config: ModelConfig, target_params, num_heads: int, key=None,
                       init_scale: float = 0.0, num_layers: int = 1) -> dict:
  """w [K, N, D, D] (zeros, or normal * init_scale / sqrt(D)), b [K, N, D] zeros, lm_head
  [K, D, V] copies of the target's LM head (N = num_layers residual blocks per head)."""
  d, v = target_config.hidden_size, target_config.vocab_size
  head = (target_params["embed"].T if target_config.tie_embeddings else target_params["lm_head"])
  head = jnp.asarray(head, jnp.float32)
  if init_scale and key is not None:
    w = init_scale / jnp.sqrt(d) * jax.random.normal(key, (num_heads, num_layers, d, d),
                                                     jnp.float32)
  else:
    w = jnp.zeros((num_heads, num_layers, d, d), jnp.float32)
  return {"w": w, "b": jnp.zeros((num_heads, num_layers, d), jnp.float32),
          "lm_head": jnp.broadcast_to(head[None], (num_heads, d, v)).copy()}


def medusa_logits(params, hidden):
  """hidden [..., D] -> float32 logits [..., K, V] of every head."""
  h = hidden.astype(jnp.float32)
  k, n = params["w"].shape[:2]
  r = jnp.broadcast_to(h[..., None, :], h.shape[:-1] + (k, h.shape[-1]))   # [..., K, D]
  for layer in range(n):
    pre = matmul.einsum("...kd,kde->...ke", r, params["w"][:, layer]) + params["b"][:, layer]
    r = r + jax.nn.silu(pre)
  return matmul.einsum("...kd,kdv->...kv", r, params["lm_head"])


@frozen_drafter
class Medusa(FrozenDrafter):
  """K = num_heads Medusa heads (max_draft = num_heads). See the module docstring.

  params: w [K, N, D, D], b [K, N, D], lm_head [K, D, V]; num_heads (K) and num_layers (N) are
  read from them (num_heads, when given, must agree)."""

  kind = "medusa"

  params: Any = params_field()
  target_config: ModelConfig = dataclasses.field()
  num_heads: Optional[int] = None
  greedy_drafts: bool = False
  num_layers: int = derived_field()

  def __post_init__(self):
    params, target_config = self.params, self.target_config
    k = int(params["w"].shape[0])
    if self.num_heads is not None and self.num_heads != k:
      raise ValueError(f"Medusa params have {k} heads but num_heads={self.num_heads}")
    d, v = target_config.hidden_size, target_config.vocab_size
    if params["lm_head"].shape != (k, d, v):
      raise ValueError(f"Medusa lm_head has shape {params['lm_head'].shape}; the target needs "
                       f"({k}, {d}, {v})")
    object.__setattr__(self, "num_heads", k)
    object.__setattr__(self, "num_layers", int(params["w"].shape[1]))
    object.__setattr__(self, "greedy_drafts", bool(self.greedy_drafts))

  @property
  def max_draft(self) -> int:
    return self.num_heads

  @classmethod
  def init(cls, target, num_heads: int = 4, key=None, init_scale: float = 0.0,
           greedy_drafts: bool = False, num_layers: int = 1) -> "Medusa":
    """Fresh heads for `target` (a Model); init_scale > 0 gives random non-zero blocks."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
      raise ValueError(f"Medusa num_heads must be an integer >= 1, got {num_heads!r}")
    key = jax.random.key(0) if key is None else key
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
      raise ValueError(f"Medusa num_layers must be an integer >= 1, got {num_layers!r}")
    params = init_medusa_params(target.config, target.params, num_heads, key, init_scale,
                                num_layers)
    return cls(params, target.config, greedy_drafts=greedy_drafts)

  @classmethod
  def from_hyper_params(cls, target, hyper_params: dict, key=None, **options) -> "Medusa":
    """A fresh drafter of the shape `hyper_params()` saved."""
    hp = dict(hyper_params)
    return cls.init(target, num_heads=int(hp.pop("num_heads")),
                    num_layers=int(hp.pop("num_layers", 1)), key=key, **options)

  def hyper_params(self) -> dict:
    return {"num_heads": self.num_heads, "num_layers": self.num_layers}

  def check_compatible(self, target) -> None:
    c = target.config
    if (c.hidden_size, c.vocab_size) != (self.target_config.hidden_size,
                                         self.target_config.vocab_size):
      raise ValueError(f"these Medusa heads were built for hidden size "
                       f"{self.target_config.hidden_size} and vocabulary "
                       f"{self.target_config.vocab_size}; the target has {c.hidden_size} and "
                       f"{c.vocab_size}")

  def init_state(self, params, prefill: PrefillInfo):
    idx = (prefill.prompt_lens - 1)[:, None, None]
    return jnp.take_along_axis(prefill.hidden, idx, axis=1)[:, 0].astype(jnp.float32)

  def propose(self, params, hidden, ctx: DraftContext):
    b, k = hidden.shape[0], ctx.num_draft
    sub = jax.tree.map(lambda x: x[:k], params)
    logits = medusa_logits(sub, hidden)                               # [B, K, V]
    if self.greedy_drafts or ctx.greedy:
      return jnp.argmax(logits, -1).astype(jnp.int32), None, hidden
    q = sampling_lib.probs(logits, ctx.sampling)                      # per-row settings on axis 0
    keys = jax.random.split(ctx.key, k)
    drafts = jnp.stack([jax.vmap(sampling_lib.sample)(_row_keys(keys[i], b), q[:, i])
                        for i in range(k)], axis=1)
    return drafts, q, hidden

  def commit(self, params, hidden, tokens, n_accepted, verify):
    idx = n_accepted[:, None, None]
    return jnp.take_along_axis(verify.hidden, idx, axis=1)[:, 0].astype(jnp.float32)
