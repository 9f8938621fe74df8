"""EAGLE (Li et al. 2024) and EAGLE-3 (Li et al. 2025) draft heads.

EAGLE: x_j = fc(concat(embed(token_{j+1}), f_j)) + fc_b -> one decoder layer -> o_j, with f_j
the target's hidden state after its final norm (what the LM head reads; EAGLE-1's reference
code takes the base LlamaModel's output, which is normed). o_j is the predicted f_{j+1}; the
draft distribution is the target's frozen LM head applied to o_j. The next draft step feeds
(o_j, drafted token) back: autoregression at the feature level. Trained with smooth-L1 on the
features plus soft cross-entropy against the target (train/losses.py).

EAGLE-3 is the public architecture, the one vLLM and SGLang run (`LlamaForCausalLMEagle3`:
SafeAILab/EAGLE `eagle/traineagle3/cnets.py`, SGLang `python/sglang/srt/models/llama_eagle3.py`,
vLLM `vllm/model_executor/models/llama_eagle3.py`), so its checkpoints load and export
(`spec_jax.drafters.formats.eagle3`). With g = the three captured target states at position j,
e = the target's embedding of token j+1, D the head's width:

    f_j  = fc(concat(g_low, g_mid, g_high))            fc [3 D_target, D], no bias
    h    = concat(input_layernorm(e), hidden_norm(f))   [2 D]; embedding first (cnets.py
                                                        LlamaDecoderLayeremb.forward)
    r    = f + o_proj(attention(q, k, v = h W_q, h W_k, h W_v))   q/k/v read 2 D
    o_j  = r + mlp(post_attention_layernorm(r))         the residual: the next step's feature
    logits_j = lm_head(norm(o_j))                       own lm_head [D, V_draft]

The next draft step feeds o_j (un-normed, not through fc) back as the feature, as SGLang's
`LlamaModel.forward` returns the pre-norm residual for draft decode. The draft vocabulary is
V_draft target ids (`draft_tokens`; public checkpoints store d2t = target id - draft id):
drafting reports q over the full vocabulary with zeros outside it (vLLM's `compute_logits`
scatters draft logits into a -inf full-vocabulary row), so the rejection sampler stays lossless.

Captured target states (decided in vLLM `model_executor/models/llama.py` `LlamaModel.forward`:
`if idx in self.aux_hidden_state_layers: aux_hidden_states.append(hidden_states + residual)`
*before* layer idx runs, with `get_eagle3_aux_hidden_state_layers` = (2, L//2, L-3); the same in
SGLang's `set_eagle3_layers_to_capture` and in EAGLE's `modeling_llama_kv.py`, `if idx==len(
self.layers)-3 or idx==len(self.layers)//2 or idx==2: all_hidden_states += (hidden_states,)`
before the layer): the residual stream ENTERING layers 2, L//2 and L-3, i.e. the OUTPUTS of
layers 1, L//2-1 and L-4 (SpecForge's training default [1, L//2-1, L-4] over HF hidden_states
index i+1). `target_layers` here are output indices (what `transformer.forward(return_layers)`
returns), so the public default is (1, L//2-1, L-4); a checkpoint's explicit
`eagle_aux_hidden_state_layer_ids` are vLLM's boundary indices (input of layer id), our
output index id-1.

Cache / position conventions are those of `spec_jax.drafters.feature_head`: head-cache slot j
holds (f_j, token_{j+1}) at RoPE position j, and o_j predicts token j+2 (vLLM's proposer pairs
target hidden i with input token i+1 at position i in the same way).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.drafters.base import derived_field, frozen_drafter
from spec_jax.drafters.feature_head import FeatureHead, head_layer_config
from spec_jax.drafters.head_layer import init_layer_params
from spec_jax.models import matmul
from spec_jax.models.config import ModelConfig
from spec_jax.models.blocks import (attention, out_projection, qkv_projections, swiglu_mlp,
                                    apply_rope, embed, rms_norm, rope_inv_freq, rope_tables)
from spec_jax.models.cache import write_rows


def _eye_block(d, parts, which, scale=1.0):
  """[parts*D, D] with an identity at block `which` (scale) and zeros elsewhere."""
  blocks = [jnp.eye(d) * scale if i == which else jnp.zeros((d, d)) for i in range(parts)]
  return jnp.concatenate(blocks, axis=0)


def public_default_layers(num_layers: int) -> Optional[tuple]:
  """vLLM / SGLang / EAGLE's default capture, as output indices: the inputs of layers
  (2, L//2, L-3) = outputs of (1, L//2-1, L-4). Each layer is captured once (a membership test
  in the layer loop), so the result is the distinct ids in layer order; None when that is not
  three layers of this target (L < 7 gives repeats, L < 4 an index below layer 0)."""
  ids = sorted({2, num_layers // 2, num_layers - 3})
  if len(ids) != 3 or ids[0] < 1 or ids[-1] > num_layers:
    return None
  return tuple(i - 1 for i in ids)


def default_eagle3_layers(num_layers: int) -> tuple:
  """The public default (public_default_layers) when this target has it; else low / middle /
  high spread evenly over the target's layer outputs (round(linspace(0, L-1, 3)))."""
  public = public_default_layers(num_layers)
  if public is not None:
    return public
  return tuple(int(round(x)) for x in np.linspace(0, num_layers - 1, 3))


class EAGLE(FeatureHead):
  """EAGLE-1 head: feature = the target's normed final hidden state."""

  kind = "eagle"

  @classmethod
  def init(cls, target, key=None, intermediate_size: Optional[int] = None,
           num_heads: Optional[int] = None, init_std: float = 0.02,
           greedy_drafts: bool = False, **kw) -> "EAGLE":
    """Fresh head for `target` (a Model). init_std scales the random weights (tests use a large
    one for varied drafts); fc starts as the identity on the feature."""
    if kw:
      raise ValueError(f"unknown EAGLE option(s): {', '.join(sorted(kw))}")
    key = jax.random.key(0) if key is None else key
    cfg = head_layer_config(target.config, intermediate_size, num_heads)
    d = cfg.hidden_size
    k1, k2 = jax.random.split(key)
    params = {
        "fc": _eye_block(d, 2, 1) + init_std * jax.random.normal(k1, (2 * d, d)),
        "fc_b": jnp.zeros((d,)),
        "layer": init_layer_params(cfg, k2, init_std),
    }
    return cls(params, target.config, cfg, (), greedy_drafts)


class EAGLE3Fused(FeatureHead):
  """spec_jax's own EAGLE-3 variant (kind "eagle3_fused"; not loadable by vLLM / SGLang).

  f_j = concat(captured layers)_j @ fuse, then EAGLE's x_j = fc(concat(emb, f_j)) + fc_b into a
  standard pre-norm decoder layer (the embedding enters the residual stream, unlike the public
  midlayer where it reaches the residual only through attention), an output RMSNorm and the
  target's frozen LM head. Kept because it drafts better on small targets (stories260K, same
  data, steps and prompts: greedy tau 3.71 vs 3.20, T=1 2.47 vs 2.23; README).
  """

  kind = "eagle3_fused"
  _DERIVED = ("head_dim", "qkv_bias", "qk_norm", "num_kv_heads")    # target_layers are taken

  def target_feature(self, params, hidden, layer_hidden):
    cat = jnp.concatenate([h.astype(jnp.float32) for h in layer_hidden], axis=-1)
    return matmul.dense_named(cat, params, "fuse")

  @classmethod
  def init(cls, target, key=None, target_layers: Optional[Sequence[int]] = None,
           intermediate_size: Optional[int] = None, num_heads: Optional[int] = None,
           init_std: float = 0.02, greedy_drafts: bool = False, **kw) -> "EAGLE3Fused":
    """Fresh heads; target_layers default to (1, L//2, L-1) clipped to the target."""
    if kw:
      raise ValueError(f"unknown eagle3_fused option(s): {', '.join(sorted(kw))}")
    key = jax.random.key(0) if key is None else key
    top = target.config.num_layers - 1
    layers = tuple(target_layers) if target_layers is not None else \
        (min(1, top), min(target.config.num_layers // 2, top), top)
    if len(layers) < 1:
      raise ValueError("eagle3_fused needs at least one target layer to fuse")
    cfg = head_layer_config(target.config, intermediate_size, num_heads)
    d, n = cfg.hidden_size, len(layers)
    k1, k2, k3 = jax.random.split(key, 3)
    params = {
        "fuse": _eye_block(d, n, n - 1) + init_std * jax.random.normal(k1, (n * d, d)),
        "fc": _eye_block(d, 2, 1) + init_std * jax.random.normal(k2, (2 * d, d)),
        "fc_b": jnp.zeros((d,)),
        "layer": init_layer_params(cfg, k3, init_std),
        "out_norm": jnp.ones((d,)),
    }
    return cls(params, target.config, cfg, layers, greedy_drafts)


def _vocab_key(draft_tokens) -> Optional[tuple]:
  if draft_tokens is None:
    return None
  return (len(draft_tokens), hashlib.sha1(np.asarray(draft_tokens, "<i4").tobytes()).hexdigest())


def check_draft_tokens(draft_tokens, vocab_size: int, what: str = "draft_tokens"):
  """int32 [V_draft] target ids of the draft vocabulary (draft id i -> draft_tokens[i]), or None
  for the identity over the whole vocabulary. Raises ValueError for ids out of [0, V) or
  repeated (the draft -> target map must be one-to-one)."""
  if draft_tokens is None:
    return None
  ids = np.asarray(draft_tokens)
  if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"{what} must be a non-empty 1-D list of integer target token ids, got "
                     f"shape {ids.shape} dtype {ids.dtype}")
  bad = ids[(ids < 0) | (ids >= vocab_size)]
  if bad.size:
    raise ValueError(f"{what} maps draft ids to target ids {bad[:5].tolist()} outside the "
                     f"target's vocabulary [0, {vocab_size}); allowed: 0 <= id < {vocab_size}")
  if len(np.unique(ids)) != ids.size:
    raise ValueError(f"{what} maps two draft ids to the same target id; allowed: distinct ids")
  if ids.size == vocab_size and np.array_equal(ids, np.arange(vocab_size)):
    return None
  return ids.astype(np.int32)


def midlayer_params(cfg: ModelConfig, key_qkv, key_rest, std: float = 0.02) -> dict:
  """Fresh params of EAGLE-3's decoder layer (`midlayer`; its input norms live outside):
  wq [2D, Hq Dh], wk, wv [2D, Hkv Dh] (they read concat(embedding, feature)), wo, mlp_norm and
  the MLP in D; normal(std) weights, a unit norm."""
  qkv = init_layer_params(cfg.replace(hidden_size=2 * cfg.hidden_size), key_qkv, std)
  ref = init_layer_params(cfg, key_rest, std)
  return {"wq": qkv["wq"], "wk": qkv["wk"], "wv": qkv["wv"], "wo": ref["wo"],
          "mlp_norm": ref["mlp_norm"], "w_gate": ref["w_gate"], "w_up": ref["w_up"],
          "w_down": ref["w_down"]}


def midlayer(cfg: ModelConfig, lp, residual, h, positions, k_cache, v_cache, offsets, inv_freq,
             tree_mask=None, head_major: bool = False):
  """EAGLE-3's decoder layer over T new slots with a one-layer cache.

  Args:
    cfg: the head's layer ModelConfig; lp: its params (wq/wk/wv [2D, H*Dh] read h).
    residual: [B, T, D] the feature f (the residual stream the layer adds to).
    h: [B, T, 2D] concat(input_layernorm(embedding), hidden_norm(f)).
    positions: int32 [B, T]; k_cache, v_cache: [B, S, Hkv, Dh] (head_major: [B, Hkv, S, Dh]);
      offsets: int32 [B] where the T new keys go (slot offsets[b] + t), attending to slots
      < offsets[b] and causally among the new ones.
    tree_mask: optional bool [B, T, W] (draft trees): replaces the causal mask over the last W
      slots, which end with the new ones (kernels_pallas.reference).
  Returns:
    (o [B, T, D], k_cache, v_cache).
  """
  b, t, _ = residual.shape
  hq, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  rope = rope_tables(positions, inv_freq)
  q, k, v = qkv_projections(cfg, lp, h)
  q = apply_rope(q.reshape(b, t, hq, dh), positions, tables=rope)
  k = apply_rope(k.reshape(b, t, hkv, dh), positions, tables=rope)
  k_cache = write_rows(k_cache[None], 0, k, offsets, head_major)[0]
  v_cache = write_rows(v_cache[None], 0, v.reshape(b, t, hkv, dh), offsets, head_major)[0]
  attn = attention(cfg, q, k_cache, v_cache, offsets + t, tree_mask, head_major)
  x = residual + out_projection(lp, attn.reshape(b, t, hq * dh))
  x = x + swiglu_mlp(lp, rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps))
  return x, k_cache, v_cache


@frozen_drafter
class EAGLE3(FeatureHead):
  """EAGLE-3 head in the public architecture (module docstring).

  Params: fc [3 D_target, D]; embed_norm, hidden_norm [D] (the midlayer's input_layernorm and
  hidden_norm); layer {wq [2D, Hq Dh], wk, wv [2D, Hkv Dh], wo, mlp_norm (post_attention_
  layernorm), w_gate, w_up, w_down}; norm [D]; lm_head [D, V_draft]; optionally embed [V, D]
  (a checkpoint's own embed_tokens that differs from the target's; else the target's is read).

  Args (beyond FeatureHead's):
    draft_tokens: int [V_draft] target ids of the draft vocabulary, or None (all V).
  """

  kind = "eagle3"

  draft_tokens: Any = dataclasses.field(default=None, compare=False, repr=False)
  vocab_key: Optional[tuple] = derived_field()      # draft_tokens' static identity

  def __post_init__(self):
    super().__post_init__()
    if len(self.target_layers) != 3:
      raise ValueError(f"eagle3: fc reads exactly three captured target layers (low, middle, "
                       f"high); got target_layers {list(self.target_layers)}")
    ids = check_draft_tokens(self.draft_tokens, self.target_config.vocab_size)
    object.__setattr__(self, "draft_tokens", ids)
    object.__setattr__(self, "vocab_key", _vocab_key(ids))
    want = (self.layer_config.hidden_size, self.draft_vocab_size)
    got = tuple(np.shape(self.params["lm_head"]))
    if got != want:
      raise ValueError(f"eagle3: lm_head has shape {got}; a draft vocabulary of "
                       f"{self.draft_vocab_size} needs {want}")

  @property
  def draft_vocab_size(self) -> int:
    return self.target_config.vocab_size if self.draft_tokens is None else len(self.draft_tokens)

  @classmethod
  def from_hyper_params(cls, target, hyper_params: dict, key=None, **options):
    """Every saved shape option is an init argument (init checks them)."""
    return cls.init(target, key=key, **hyper_params, **options)

  def hyper_params(self) -> dict:
    hp = super().hyper_params()
    hp["draft_tokens"] = None if self.draft_tokens is None else self.draft_tokens.tolist()
    c, t = self.layer_config, self.target_config
    if (c.rms_norm_eps, c.rope_theta, c.rope_scaling) != (t.rms_norm_eps, t.rope_theta,
                                                          t.rope_scaling):
      hp.update(rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                rope_scaling=None if c.rope_scaling is None else [list(x) for x in c.rope_scaling])
    if "embed" in self.params:
      hp["own_embedding"] = True
    return hp

  # ----------------------------------------------------------------------- the math

  def target_feature(self, params, hidden, layer_hidden):
    cat = jnp.concatenate([h.astype(jnp.float32) for h in layer_hidden], axis=-1)
    return matmul.dense_named(cat, params, "fc")

  def _embed(self, params, target_params, tokens):
    table = params if "embed" in params else target_params
    return embed(table, tokens).astype(jnp.float32)

  def _pre_attention(self, params, target_params, tokens, feature):
    eps = self.layer_config.rms_norm_eps
    e = rms_norm(self._embed(params, target_params, tokens), params["embed_norm"], eps)
    f = feature.astype(jnp.float32)
    # The layer's input in the target's activation dtype when the head's weights are no wider
    # (bf16 beside a bf16 target on an accelerator; float32 on CPU and for a float32 head): its
    # q/k/v then leave the dots in that dtype, as the target's do. (With float32 outputs
    # XLA:TPU fused RoPE's head-major relayout into the dot and kept a transposed copy of
    # wq|wk|wv, 96 MiB at 8B, live through the whole decode: docs/accelerators.md.)
    wo = params["layer"].get("wo", params["layer"].get("wo_t"))     # either layout (prepare)
    act = jnp.result_type(matmul.activation_dtype(self.target_config),
                          (wo[0] if isinstance(wo, (tuple, list)) else wo).dtype)
    h = jnp.concatenate([e, rms_norm(f, params["hidden_norm"], eps)], axis=-1)
    return f, h.astype(act)

  def _step(self, params, target_params, tokens, feature, k, v, offsets, positions=None,
            tree_mask=None):
    residual, h = self._pre_attention(params, target_params, tokens, feature)
    if positions is None:
      positions = offsets[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    return midlayer(self.layer_config, params["layer"], residual, h, positions, k, v, offsets,
                    rope_inv_freq(self.layer_config), tree_mask, self.head_major_cache)

  def draft_logits(self, params, out):
    """Head output o [..., D] -> float32 logits [..., V_draft] over the draft vocabulary."""
    o = rms_norm(out.astype(jnp.float32), params["norm"], self.layer_config.rms_norm_eps)
    return matmul.dense_named(o, params, "lm_head", out_dtype=jnp.float32)

  def logits(self, params, target_params, out):
    """Logits over the target's full vocabulary [..., V]: the draft logits at their target ids,
    -inf elsewhere (probability exactly 0 after any sampling transform)."""
    dl = self.draft_logits(params, out)
    if self.draft_tokens is None:
      return dl
    # Scattered along the leading axis of a [V, rows] buffer, then transposed: XLA:TPU lays a
    # scatter out with the scattered axis major, and a trailing [..., V] scatter put the small
    # leading axes minor, padding [8, 4, 128256] 16x to 250 MiB (docs/accelerators.md).
    lead = dl.shape[:-1]
    rows = dl.reshape(-1, dl.shape[-1]).T                                  # [V_draft, rows]
    full = jnp.full((self.target_config.vocab_size, rows.shape[1]), -jnp.inf, jnp.float32)
    full = full.at[jnp.asarray(self.draft_tokens)].set(rows)
    return full.T.reshape(lead + (self.target_config.vocab_size,))

  def proposal_logits(self, params, target_params, out):
    """The draft logits [..., V_d] as they are (a tree never builds the V-wide ones)."""
    return self.draft_logits(params, out)

  @property
  def proposal_vocab(self):
    return None if self.draft_tokens is None else np.asarray(self.draft_tokens, np.int32)

  def _propose_token(self, params, target_params, feature, key, sampling, greedy):
    if (self.greedy_drafts or greedy) and self.draft_tokens is not None:
      best = jnp.argmax(self.draft_logits(params, feature), -1)
      return jnp.asarray(self.draft_tokens)[best], None
    return super()._propose_token(params, target_params, feature, key, sampling, greedy)

  # ----------------------------------------------------------------------- construction

  @classmethod
  def init(cls, target, key=None, target_layers: Optional[Sequence[int]] = None,
           intermediate_size: Optional[int] = None, num_heads: Optional[int] = None,
           num_kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
           draft_tokens=None, rms_norm_eps: Optional[float] = None,
           rope_theta: Optional[float] = None, rope_scaling=None, own_embedding: bool = False,
           qkv_bias: bool = False, qk_norm: bool = False, init_std: float = 0.02,
           greedy_drafts: bool = False, **kw) -> "EAGLE3":
    """A fresh EAGLE-3 head for `target` (a Model).

    fc starts as the identity on the highest captured layer, lm_head as the target's LM head
    restricted to the draft vocabulary (`draft_tokens`, None = all), norms at 1, the layer
    normal(init_std). The other options rebuild a saved or loaded head's exact shape.
    """
    if kw:
      raise ValueError(f"unknown EAGLE-3 option(s): {', '.join(sorted(kw))}")
    if qkv_bias or qk_norm:
      raise ValueError("eagle3: the public EAGLE-3 layer has no q/k/v biases or q/k norms; "
                       "allowed: qkv_bias=False, qk_norm=False")
    key = jax.random.key(0) if key is None else key
    tc = target.config
    layers = tuple(target_layers) if target_layers is not None else \
        default_eagle3_layers(tc.num_layers)
    cfg = head_layer_config(tc, intermediate_size, num_heads, num_kv_heads)
    if head_dim is not None:
      cfg = cfg.replace(head_dim=int(head_dim))
    if rms_norm_eps is not None:
      cfg = cfg.replace(rms_norm_eps=float(rms_norm_eps))
    if rope_theta is not None:
      scaling = None if rope_scaling is None else tuple(tuple(x) for x in rope_scaling)
      cfg = cfg.replace(rope_theta=float(rope_theta), rope_scaling=scaling)
    ids = check_draft_tokens(draft_tokens, tc.vocab_size)
    d, dt = cfg.hidden_size, tc.hidden_size
    k1, k2, k3 = jax.random.split(key, 3)
    layer = midlayer_params(cfg, k2, k3, init_std)
    tp = target.params    # a Model's params are canonical (embed [V, D], lm_head [D, V])
    head_w = jnp.asarray(tp["embed"]).T if tc.tie_embeddings else jnp.asarray(tp["lm_head"])
    head_w = head_w.astype(jnp.float32)
    if ids is not None:
      head_w = head_w[:, jnp.asarray(ids)]
    params = {
        "fc": _eye_block(dt, 3, 2) + init_std * jax.random.normal(k1, (3 * dt, d)),
        "embed_norm": jnp.ones((d,)), "hidden_norm": jnp.ones((d,)),
        "layer": layer,
        "norm": jnp.ones((d,)),
        "lm_head": head_w,
    }
    if own_embedding:
      params["embed"] = jnp.asarray(tp["embed"], jnp.float32)
    return cls(params, tc, cfg, layers, greedy_drafts, ids)
