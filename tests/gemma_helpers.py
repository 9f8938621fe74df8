"""Tiny random Gemma 3 / Gemma 4 models built with transformers' own classes (tests only).

Every weight is random (norm weights, layer scalars and the assistant's token ordering
included), written with save_pretrained so that the loader reads real folder layouts.
"""

from __future__ import annotations

import torch
import transformers

SLIDING, FULL = "sliding_attention", "full_attention"
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, sliding_window=4, max_position_embeddings=256,
            rms_norm_eps=1e-6)


def randomise(model, seed: int = 0, std: float = 0.05, embed_std=None):
  """Random weights in place: normal(std) matrices (embed_std for the embeddings), norms
  1 + 0.2 N(0, 1) (Gemma 3's 1 + w then spans 2 +- 0.2: a non-trivial scale), layer scalars
  U(0.5, 1.5), a random permutation as an assistant's token ordering."""
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif "embed_tokens" in name and embed_std is not None:
        p.copy_(embed_std * torch.randn_like(p))
      else:
        p.copy_(std * torch.randn_like(p))
    for name, b in model.named_buffers():
      if name.endswith("layer_scalar"):
        b.copy_(0.5 + torch.rand_like(b))
      elif name.endswith("token_ordering"):
        b.copy_(torch.randperm(b.numel()))
  return model.eval()


def gemma3_text_config(**kw):
  """Gemma 3 with the legacy fields: sliding_window_pattern 2 (sliding, full, ...), rope_theta
  on full layers with linear scaling, rope_local_base_freq on sliding layers, soft-capping."""
  base = dict(TINY, num_hidden_layers=4, sliding_window_pattern=2, rope_theta=1e6,
              rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 2.0},
              final_logit_softcapping=2.0, query_pre_attn_scalar=32)
  base.update(kw)
  return transformers.Gemma3TextConfig(**base)


def gemma4_dense_config(**kw):
  """Gemma 4 dense: k_eq_v full layers with a wider global head_dim and one kv head,
  proportional RoPE (the default partial_rotary_factor 0.25), no PLE, no KV sharing."""
  base = dict(TINY, num_hidden_layers=6, global_head_dim=16, num_global_key_value_heads=1,
              attention_k_eq_v=True, hidden_size_per_layer_input=0,
              layer_types=[SLIDING, SLIDING, FULL] * 2, final_logit_softcapping=3.0)
  base.update(kw)
  return transformers.Gemma4TextConfig(**base)


def gemma4_e2b_config(**kw):
  """Gemma 4 E2B-like: per-layer embeddings, the last 2 layers KV-shared with a double-wide
  MLP, a global head_dim of 16."""
  base = dict(TINY, num_hidden_layers=6, global_head_dim=16, hidden_size_per_layer_input=8,
              vocab_size_per_layer_input=TINY["vocab_size"], num_kv_shared_layers=2,
              use_double_wide_mlp=True, layer_types=[SLIDING, SLIDING, FULL] * 2)
  base.update(kw)
  return transformers.Gemma4TextConfig(**base)


def causal_lm(config, seed=0, **randomise_kw):
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  return randomise(model, seed, **randomise_kw)


def conditional_generation(text_config, seed=0):
  """The multimodal checkpoint class (what the hub ships) around a tiny text config: Gemma 4
  without towers, Gemma 3 with a tiny SigLIP tower (skipped by the loader)."""
  if text_config.model_type == "gemma4_text":
    cfg = transformers.Gemma4Config(text_config=text_config.to_dict(), vision_config=None,
                                    audio_config=None)
    cls = transformers.Gemma4ForConditionalGeneration
  else:
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=16, patch_size=8)
    cfg = transformers.Gemma3Config(text_config=text_config.to_dict(),
                                    vision_config=vision.to_dict(), mm_tokens_per_image=4)
    cls = transformers.Gemma3ForConditionalGeneration
  cfg._attn_implementation = "eager"
  return randomise(cls(cfg), seed)


def assistant(target_text_config, seed=1, ordered=True, num_centroids=8, top_k=2,
              hidden_size=16, **randomise_kw):
  """A tiny Gemma4AssistantForCausalLM for a target of this text config: 2 layers (sliding,
  full) whose head dims and kv heads match the target's, 4 query heads."""
  from transformers.models.gemma4_assistant import (Gemma4AssistantConfig,
                                                    Gemma4AssistantForCausalLM)
  t = target_text_config
  sliding = t.per_layer_config[t.layer_types.index(SLIDING)]
  full = t.per_layer_config[t.layer_types.index(FULL)]
  # Its per-type KV shapes are the target's (transformers repeats the target's kv heads by
  # the assistant's declared group size); k_eq_v carries num_global_key_value_heads.
  text = transformers.Gemma4TextConfig(
      vocab_size=t.vocab_size, hidden_size=hidden_size, intermediate_size=32,
      num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=sliding.num_key_value_heads, head_dim=sliding.head_dim,
      global_head_dim=full.head_dim, attention_k_eq_v=True,
      num_global_key_value_heads=full.num_key_value_heads,
      sliding_window=t.sliding_window, hidden_size_per_layer_input=0,
      vocab_size_per_layer_input=0, layer_types=[SLIDING, FULL])
  cfg = Gemma4AssistantConfig(text_config=text.to_dict(), backbone_hidden_size=t.hidden_size,
                              use_ordered_embeddings=ordered, num_centroids=num_centroids,
                              centroid_intermediate_top_k=top_k)
  cfg._attn_implementation = "eager"
  cfg.text_config._attn_implementation = "eager"
  return randomise(Gemma4AssistantForCausalLM(cfg), seed, **randomise_kw)
