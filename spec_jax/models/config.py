"""ModelConfig: the static, hashable description of a decoder-only transformer.

model_type picks the family that runs it (`config.family`, from spec_jax.models.families).
The llama family (llama, mistral, qwen2, qwen3) differs only in grouped-query attention sizes,
RoPE scaling, q/k RMSNorm (qwen3), qkv bias (qwen2), the optional sliding window (mistral) and
whether the LM head is tied to the embedding.

The Gemma family (gemma3 / gemma4, spec_jax.models.gemma) adds a per-layer pattern of attention
types with per-type RoPE and KV shapes, sandwich norms, GeGLU, logit soft-capping, KV sharing
and per-layer embeddings: the fields after `num_mtp_layers`, which every other family's configs
leave at their defaults (a family's `config_fields`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from spec_jax.models.family import Family
from spec_jax.models.families import FAMILIES, SUPPORTED_MODEL_TYPES, family_of

ATTENTION_IMPLS = ("auto", "reference", "pallas")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static model hyper-parameters (hashable: usable as a `jax.jit` static argument).

  Attributes:
    vocab_size: V.
    hidden_size: D, the residual width.
    intermediate_size: F, the SwiGLU MLP width.
    num_layers: L.
    num_heads: Hq, query heads.
    num_kv_heads: Hkv, key/value heads (Hq % Hkv == 0; Hq == Hkv is plain MHA).
    head_dim: Dh; defaults to D // Hq.
    rope_theta: RoPE base.
    rope_scaling: None, or a tuple of (key, value) pairs from the HF config, e.g.
      (("rope_type", "llama3"), ("factor", 8.0), ...). Tuples keep the config hashable.
    rms_norm_eps: epsilon of every RMSNorm.
    tie_embeddings: LM head is the transposed token embedding.
    qkv_bias: q/k/v projections have a bias (qwen2).
    qk_norm: RMSNorm over head_dim on q and k before RoPE (qwen3).
    sliding_window: None, or the attention window (mistral).
    max_position_embeddings: the longest context the model was trained for.
    model_type: one of SUPPORTED_MODEL_TYPES: picks the family (within the llama family the
      math is set by the flags).
    bos_token_id: the checkpoint's BOS id (exported with it); text prompts get BOS exactly as
      the tokenizer adds it (transformers' tokenizer(text)), never from this field.
    eos_token_ids: tokens that end generation by default.
    dtype: "float32" or "bfloat16", the dtype of params and activations.
    attention_impl: how decode/verify attention runs: "auto" (Pallas kernel on GPU/TPU, the
      jnp reference on CPU), "reference", or "pallas" (interpret mode on CPU).
    num_mtp_layers: native multi-token-prediction modules carried by the checkpoint.

  Gemma fields (model_type "gemma3" / "gemma4" only; spec_jax.models.gemma.plan reads them):
    hidden_act: "silu" (SwiGLU) or "gelu_tanh" (GeGLU with the tanh GELU).
    embed_scale: the embedding is multiplied by sqrt(hidden_size), the scale cast to `dtype`.
    norm_plus_one: every RMSNorm is x_hat * (1 + w) (Gemma 3) rather than x_hat * w.
    attention_scale: the softmax scale of q.k (None: head_dim ** -0.5).
    final_logit_softcap: None, or c: logits -> c * tanh(logits / c).
    layer_types: per layer "sliding_attention" (window `sliding_window`) or "full_attention".
    rope_by_type: ((layer_type, rope_theta, rope_scaling items or None), ...): each type's RoPE
      (rope_scaling kinds: default, linear, proportional with partial_rotary_factor).
    kv_by_type: ((layer_type, num_kv_heads, head_dim), ...): each type's KV shape (Gemma 4's
      global_head_dim / num_global_key_value_heads on full layers); num_heads is shared.
    v_norm: values go through an RMSNorm without weight (Gemma 4).
    k_eq_v: full-attention layers use k_proj's output as V too (attention_k_eq_v).
    layer_scalar: each layer's output is multiplied by its learned scalar (Gemma 4).
    num_kv_shared_layers: the last N layers have no K/V of their own: they attend to the cache
      of the last earlier non-shared layer of their type.
    double_wide_mlp: the KV-shared layers' MLP is 2 * intermediate_size wide.
    per_layer_input_size: the per-layer-embedding (PLE) width (0: no PLE).
    per_layer_vocab_size: the PLE table's vocabulary.

  Hybrid fields (model_type "qwen3_next" / "qwen3_5_text" only; spec_jax.models.qwen3_next.plan
  reads them; layer_types is shared with Gemma, each layer "linear_attention" or
  "full_attention"):
    partial_rotary_factor: the fraction of head_dim that RoPE rotates on attention layers.
    linear_num_key_heads, linear_num_value_heads: Gated DeltaNet q/k heads and v heads
      (value heads a multiple of key heads).
    linear_key_head_dim, linear_value_head_dim: Dk, Dv of the recurrent state [Hv, Dk, Dv].
    linear_conv_kernel_dim: W, the causal depthwise conv's kernel (a window of W - 1 inputs).
    num_experts, num_experts_per_tok, moe_intermediate_size: Qwen3-Next's routed experts
      (0 experts: every MLP dense), shared_expert_intermediate_size its shared expert,
      norm_topk_prob whether top-k weights are renormalised, decoder_sparse_step and
      mlp_only_layers which layers are sparse.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: Optional[int] = None
  rope_theta: float = 10000.0
  rope_scaling: Optional[tuple] = None
  rms_norm_eps: float = 1e-5
  tie_embeddings: bool = False
  qkv_bias: bool = False
  qk_norm: bool = False
  sliding_window: Optional[int] = None
  max_position_embeddings: int = 2048
  model_type: str = "llama"
  bos_token_id: Optional[int] = 1
  eos_token_ids: tuple = (2,)
  dtype: str = "float32"
  attention_impl: str = "auto"
  num_mtp_layers: int = 0
  hidden_act: str = "silu"
  embed_scale: bool = False
  norm_plus_one: bool = False
  attention_scale: Optional[float] = None
  final_logit_softcap: Optional[float] = None
  layer_types: Optional[tuple] = None
  rope_by_type: Optional[tuple] = None
  kv_by_type: Optional[tuple] = None
  v_norm: bool = False
  k_eq_v: bool = False
  layer_scalar: bool = False
  num_kv_shared_layers: int = 0
  double_wide_mlp: bool = False
  per_layer_input_size: int = 0
  per_layer_vocab_size: int = 0
  partial_rotary_factor: float = 1.0
  linear_num_key_heads: int = 0
  linear_num_value_heads: int = 0
  linear_key_head_dim: int = 0
  linear_value_head_dim: int = 0
  linear_conv_kernel_dim: int = 0
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  shared_expert_intermediate_size: int = 0
  norm_topk_prob: bool = True
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple = ()

  def __post_init__(self):
    if self.head_dim is None:
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim"):
      if int(getattr(self, name)) <= 0:
        raise ValueError(f"ModelConfig.{name} must be a positive integer, got {getattr(self, name)!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                       f"num_kv_heads ({self.num_kv_heads})")
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(f"unsupported model_type {self.model_type!r}; supported: "
                       f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"ModelConfig.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"ModelConfig.attention_impl must be one of {ATTENTION_IMPLS}, "
                       f"got {self.attention_impl!r}")
    if isinstance(self.rope_scaling, dict):
      object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
    object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
    family = self.family
    for other in FAMILIES.values():
      changed = [k for k, v in other.config_fields.items()
                 if k not in family.config_fields and getattr(self, k) != v]
      if changed:
        raise ValueError(f"ModelConfig fields {', '.join(changed)} apply to model_type "
                         f"{' / '.join(other.model_types)} only, not {self.model_type!r}")
    family.check_config(self)

  @property
  def family(self) -> Family:
    """The family that runs this config (spec_jax.models.families)."""
    return family_of(self.model_type)

  @property
  def rope_scaling_dict(self) -> dict:
    return dict(self.rope_scaling or ())

  @property
  def num_params(self) -> int:
    return self.family.num_params(self)

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)
