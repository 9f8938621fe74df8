"""The llama family's save_hf support: ModelConfig -> config.json, params -> HF tensors.

The inverse of spec_jax.models.llama.hf: the same tensor names (its LAYER_NAMES / TOP_NAMES,
read backwards), torch's [out, in] Linear layout, the model's dtype. Our q/k weights are already
in the rotate_half RoPE layout transformers uses (llama2.c checkpoints are permuted into it when
loaded), so no permutation is needed. A tied LM head is stored once, as
`model.embed_tokens.weight`.
"""

from __future__ import annotations

import numpy as np

from spec_jax.models.llama.hf import LAYER_NAMES, TOP_NAMES

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


# ----------------------------------------------------------------------------- config

def _check_expressible(c) -> None:
  """transformers' classes fix some flags per family; refuse what they cannot express."""
  if c.qk_norm != (c.model_type == "qwen3"):
    raise ValueError(f"save_hf: a {c.model_type} model with qk_norm={c.qk_norm} has no "
                     f"transformers class (q/k RMSNorm is exactly qwen3's); allowed: qk_norm "
                     f"only with model_type 'qwen3'")
  if c.model_type == "mistral" and c.qkv_bias:
    raise ValueError("save_hf: transformers' Mistral has no q/k/v biases; allowed: "
                     "qkv_bias=False for model_type 'mistral' (or use 'llama' / 'qwen2')")
  if c.model_type == "llama" and c.sliding_window is not None:
    raise ValueError(f"save_hf: transformers' Llama has no sliding window, and this llama model "
                     f"has sliding_window={c.sliding_window}; allowed: sliding_window=None for "
                     f"model_type 'llama' (or use 'mistral' / 'qwen2' / 'qwen3', which write it)")
  if c.num_mtp_layers:
    raise ValueError("save_hf: writing native MTP modules is not supported; the model has "
                     f"num_mtp_layers={c.num_mtp_layers} (allowed: 0)")


def hf_config(c) -> dict:
  """ModelConfig -> the config.json dict of its transformers class (what `llama.hf.config_fields`
  reads back into the same ModelConfig)."""
  _check_expressible(c)
  scaling = c.rope_scaling_dict
  eos = list(c.eos_token_ids)
  cfg = {
      "architectures": [_ARCHITECTURES[c.model_type]],
      "model_type": c.model_type,
      "vocab_size": c.vocab_size,
      "hidden_size": c.hidden_size,
      "intermediate_size": c.intermediate_size,
      "num_hidden_layers": c.num_layers,
      "num_attention_heads": c.num_heads,
      "num_key_value_heads": c.num_kv_heads,
      "head_dim": c.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": c.max_position_embeddings,
      "rms_norm_eps": c.rms_norm_eps,
      # Both spellings: transformers >= 5 reads rope_parameters, older versions the other two.
      "rope_theta": c.rope_theta,
      "rope_scaling": scaling or None,
      "rope_parameters": {"rope_type": "default", **scaling, "rope_theta": c.rope_theta},
      "tie_word_embeddings": c.tie_embeddings,
      "bos_token_id": c.bos_token_id,
      "eos_token_id": eos[0] if len(eos) == 1 else eos,
      "torch_dtype": c.dtype,
      "dtype": c.dtype,
  }
  if c.model_type in ("llama", "qwen3"):
    cfg["attention_bias"] = c.qkv_bias
  if c.model_type == "llama":
    cfg["mlp_bias"] = False
  if c.model_type == "mistral":
    cfg["sliding_window"] = c.sliding_window
  if c.model_type in ("qwen2", "qwen3"):
    cfg["use_sliding_window"] = c.sliding_window is not None
    cfg["sliding_window"] = c.sliding_window
    cfg["max_window_layers"] = 0 if c.sliding_window is not None else c.num_layers
  return cfg


# ----------------------------------------------------------------------------- tensors

def hf_tensors(c, params) -> dict:
  """{torch name: numpy array [out, in]} of every weight of params (canonical layout, stacked or
  per-layer dicts), the inverse of llama.hf.read_params."""
  _check_expressible(c)
  layers = params["layers"]
  stacked = not isinstance(layers, (list, tuple))
  leaf_names = layers.keys() if stacked else layers[0].keys()
  out = {}
  for name, (leaf, transpose) in TOP_NAMES.items():
    if leaf == "lm_head" and c.tie_embeddings:
      continue
    value = np.asarray(params[leaf])
    out[name] = np.ascontiguousarray(value.T if transpose else value)
  dtype = np.asarray(params["embed"]).dtype
  by_leaf = {leaf: (suffix, transpose) for suffix, (leaf, transpose) in LAYER_NAMES.items()}
  for i in range(c.num_layers):
    for leaf in leaf_names:
      suffix, transpose = by_leaf[leaf]
      value = np.asarray(layers[leaf][i] if stacked else layers[i][leaf])
      out[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(value.T if transpose else value)
    if c.qkv_bias and c.model_type in ("llama", "qwen3"):
      # attention_bias also gives transformers' o_proj a bias; ours is zero (llama.hf's _ZERO_ONLY).
      out[f"model.layers.{i}.self_attn.o_proj.bias"] = np.zeros((c.hidden_size,), dtype)
    if c.model_type == "qwen2" and not c.qkv_bias:
      # Qwen2 always has q/k/v biases: zeros are the same function (it reloads with qkv_bias).
      for proj, width in (("q", c.num_heads), ("k", c.num_kv_heads), ("v", c.num_kv_heads)):
        out[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = np.zeros((width * c.head_dim,),
                                                                       dtype)
  return out


def hf_export(c, params) -> tuple:
  """The family record's save_hf writer: (config.json dict, {HF name: array})."""
  return hf_config(c), hf_tensors(c, params)
