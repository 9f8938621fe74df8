"""ModelConfig: the static, hashable description of a decoder-only transformer.

One config covers the llama, mistral, qwen2 and qwen3 families: they differ only in
grouped-query attention sizes, RoPE scaling, q/k RMSNorm (qwen3), qkv bias (qwen2),
the optional sliding window (mistral) and whether the LM head is tied to the embedding.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
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
    model_type: one of SUPPORTED_MODEL_TYPES (informational; the math is set by the flags).
    bos_token_id: prepended to text prompts when the tokenizer does not add it.
    eos_token_ids: tokens that end generation by default.
    dtype: "float32" or "bfloat16", the dtype of params and activations.
    attention_impl: how decode/verify attention runs: "auto" (Pallas kernel on GPU/TPU, the
      jnp reference on CPU), "reference", or "pallas" (interpret mode on CPU).
    num_mtp_layers: native multi-token-prediction modules carried by the checkpoint.
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

  @property
  def rope_scaling_dict(self) -> dict:
    return dict(self.rope_scaling or ())

  @property
  def num_params(self) -> int:
    d, f, v, l = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers
    hq, hkv, dh = self.num_heads, self.num_kv_heads, self.head_dim
    per_layer = d * dh * (hq + 2 * hkv) + hq * dh * d + 3 * d * f + 2 * d
    return v * d * (1 if self.tie_embeddings else 2) + l * per_layer + d

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)
