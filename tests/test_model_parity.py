"""sj.load + transformer.forward against transformers' PyTorch models on tiny random configs."""

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import spec_jax as sj
from spec_jax.models import hf as hf_loader, hf_reader
from spec_jax.models.llama import hf as llama_hf
from spec_jax.models.transformer import KVCache, forward
from tests.numerics import MODEL_ULPS, assert_f32_close

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
               "rope_theta": 500000.0}

CASES = {
    # name: (config class, extra kwargs)
    "llama-gqa-untied": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama-mha-tied-llama3rope": ("LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=True,
                                                      rope_parameters=LLAMA3_ROPE)),
    "llama-bias-linearrope": ("LlamaConfig", dict(attention_bias=True, tie_word_embeddings=False,
                                                  rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                   "rope_theta": 10000.0})),
    "mistral-window8": ("MistralConfig", dict(sliding_window=8, tie_word_embeddings=False)),
    "qwen2-bias-tied": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3-qknorm-headdim16": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=False,
                                                   num_key_value_heads=4)),
}


def make_torch_model(class_name, seed=0, **kwargs):
  """A tiny transformers model with every weight random (norms and biases included), except
  o_proj biases, which stay zero (spec_jax only accepts them when zero)."""
  config = getattr(transformers, class_name)(**{**TINY, **kwargs})
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("o_proj.bias"):
        continue
      if "norm" in name:
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      else:
        p.copy_(0.05 * torch.randn_like(p))
  return model.eval()


def float64_logits(torch_model, tokens):
  """transformers' logits for int tokens [B, T], computed in float64 from the (float32) weights
  that were saved: the reference error is then negligible (tests/numerics.py)."""
  import copy
  with torch.no_grad():
    return copy.deepcopy(torch_model).double()(torch.tensor(tokens)).logits.numpy()


def jax_logits(model, tokens, capacity=16):
  cache = KVCache.zeros(model.config, tokens.shape[0], capacity)
  fwd = jax.jit(forward, static_argnums=1)
  out = fwd(model.params, model.config, jnp.asarray(tokens, jnp.int32), cache,
            jnp.zeros(tokens.shape[0], jnp.int32))
  return np.asarray(out.logits)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
  class_name, kwargs = CASES[case]
  torch_model = make_torch_model(class_name, **kwargs)
  torch_model.save_pretrained(tmp_path, safe_serialization=True)
  model = sj.load(tmp_path)
  cfg = model.config
  assert cfg.model_type == torch_model.config.model_type
  assert cfg.dtype == "float32" and model.tokenizer is None and model.mtp_params is None
  assert cfg.tie_embeddings == kwargs.get("tie_word_embeddings", False)
  assert cfg.num_kv_heads == kwargs.get("num_key_value_heads", 2)
  if case.startswith("qwen2") or "bias" in case:
    assert cfg.qkv_bias
  if case.startswith("qwen3"):
    assert cfg.qk_norm and cfg.head_dim == 16
  if case.startswith("mistral"):
    assert cfg.sliding_window == 8
  if "llama3rope" in case:
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling_dict["rope_type"] == "llama3"

  tokens = np.random.default_rng(0).integers(0, TINY["vocab_size"], size=(2, 12))
  want = float64_logits(torch_model, tokens)
  got = jax_logits(model, tokens)
  assert_f32_close(got, want, MODEL_ULPS)

  if "llama3rope" in case:
    # A pre-5.x config.json (rope_theta + rope_scaling) gives the same config.
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw["rope_theta"] = 500000.0
    raw["rope_scaling"] = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert sj.load(tmp_path).config == cfg


def test_rope_from_legacy_and_new_attributes():
  legacy = types.SimpleNamespace(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 4.0})
  assert llama_hf.rope_from_hf(legacy) == (1e6, (("factor", 4.0), ("rope_type", "linear")))
  assert llama_hf.rope_from_hf(types.SimpleNamespace(rope_theta=5.0, rope_scaling=None)) == (5.0, None)
  new = transformers.LlamaConfig(rope_parameters=LLAMA3_ROPE)
  theta, scaling = llama_hf.rope_from_hf(new)
  assert theta == 500000.0 and dict(scaling)["original_max_position_embeddings"] == 64
  with pytest.raises(ValueError, match="yarn.*supported: default, linear, llama3"):
    llama_hf.rope_from_hf(types.SimpleNamespace(rope_theta=1.0,
                                                 rope_scaling={"rope_type": "yarn", "factor": 2.0}))


def test_qwen2_mixed_sliding_layers_are_refused():
  cfg = transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=8,
                                 max_window_layers=1)
  with pytest.raises(ValueError, match="mixes sliding-window and full-attention"):
    hf_loader.config_from_hf(cfg)
  cfg = transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=8,
                                 max_window_layers=0)
  assert hf_loader.config_from_hf(cfg).sliding_window == 8
  assert hf_loader.config_from_hf(transformers.Qwen2Config(**TINY)).sliding_window is None


def test_bfloat16_and_sharded_checkpoints(tmp_path):
  torch_model = make_torch_model("LlamaConfig", seed=1, tie_word_embeddings=False)
  torch_model.save_pretrained(tmp_path / "f32", safe_serialization=True)
  torch_model.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="20KB")
  torch_model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16", safe_serialization=True)
  assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()

  bf16 = sj.load(tmp_path / "bf16")
  assert bf16.config.dtype == "bfloat16"
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf16.params))
  want = torch_model.model.layers[1].self_attn.q_proj.weight.detach().to(torch.bfloat16)
  np.testing.assert_array_equal(np.asarray(bf16.params["layers"]["wq"][1], np.float32),
                                want.float().numpy().T)
  upcast = sj.load(tmp_path / "bf16", dtype="float32")
  assert upcast.config.dtype == "float32"
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32), b),
               bf16.params, upcast.params)

  # The raw-bytes bf16 reader (for safetensors without numpy bf16 support) agrees.
  f = hf_reader.TensorFile(tmp_path / "bf16" / "model.safetensors")
  name = "model.layers.0.mlp.down_proj.weight"
  np.testing.assert_array_equal(f._read_raw(name), f.read(name))

  f32 = sj.load(tmp_path / "f32")
  down = sj.load(tmp_path / "f32", dtype="bfloat16")
  assert down.config.dtype == "bfloat16" and down.params["embed"].dtype == jnp.bfloat16
  sharded = sj.load(tmp_path / "sharded")
  assert sharded.config == f32.config
  jax.tree.map(np.testing.assert_array_equal, sharded.params, f32.params)


def test_sliding_window_cached_prefill_verify_and_decode_match_transformers(tmp_path):
  """A mistral model with window 8 run the way the engine runs it: a prefill, verify-sized
  chunks of 4 at ragged per-row offsets, then single-token decode steps, every step through the
  KV cache (capacity 32 > the window, so the windowed path is taken), against transformers'
  logits of one full forward; positions run well past the window."""
  torch_model = make_torch_model("MistralConfig", seed=2, sliding_window=8,
                                 tie_word_embeddings=False)
  torch_model.save_pretrained(tmp_path, safe_serialization=True)
  model = sj.load(tmp_path)
  cfg = model.config
  assert cfg.sliding_window == 8
  total = 24
  tokens = np.random.default_rng(1).integers(0, TINY["vocab_size"], size=(2, total))
  want = float64_logits(torch_model, tokens)                        # [2, total, V]
  fwd = jax.jit(forward, static_argnums=1)
  cache = KVCache.zeros(cfg, 2, 32)
  lengths = np.asarray([10, 7], np.int32)                           # ragged prefill
  prefill = np.where(np.arange(10)[None] < lengths[:, None], tokens[:, :10], 0)
  out = fwd(model.params, cfg, jnp.asarray(prefill, jnp.int32), cache, jnp.zeros(2, jnp.int32))
  got = np.asarray(out.logits)
  for b in range(2):
    assert_f32_close(got[b, :lengths[b]], want[b, :lengths[b]], MODEL_ULPS)
  cache = out.cache
  for step in (4, 4, 4, 1, 1):                                     # verify chunks, then decode
    chunk = np.stack([tokens[b, lengths[b]:lengths[b] + step] for b in range(2)])
    out = fwd(model.params, cfg, jnp.asarray(chunk, jnp.int32), cache, jnp.asarray(lengths))
    got = np.asarray(out.logits)
    for b in range(2):
      assert_f32_close(got[b], want[b, lengths[b]:lengths[b] + step], MODEL_ULPS,
                       err_msg=f"row {b} at offset {lengths[b]}")
    cache, lengths = out.cache, lengths + step
  assert lengths.min() > 2 * cfg.sliding_window


def test_a_tied_head_stored_with_other_values_is_refused_and_an_equal_one_loads(tmp_path):
  """tie_word_embeddings with lm_head.weight stored beside the embedding: the loader reads the
  embedding for both, transformers unties a head that differs; so a differing head is a
  ValueError (it gave other logits silently), an equal copy loads as before."""
  from safetensors.numpy import load_file, save_file
  torch_model = make_torch_model("LlamaConfig", tie_word_embeddings=True)
  torch_model.save_pretrained(tmp_path, safe_serialization=True)
  path = tmp_path / "model.safetensors"
  tensors = load_file(str(path))
  embed = tensors["model.embed_tokens.weight"]
  save_file(dict(tensors, **{"lm_head.weight": embed.copy()}), str(path),
            metadata={"format": "pt"})
  assert sj.load(tmp_path).config.tie_embeddings
  save_file(dict(tensors, **{"lm_head.weight": embed + 0.01}), str(path),
            metadata={"format": "pt"})
  with pytest.raises(ValueError, match="the stored lm_head.weight differs from "
                                       "model.embed_tokens.weight"):
    sj.load(tmp_path)


def test_a_mistral_config_with_an_attention_bias_key_has_no_biases(tmp_path):
  """transformers' MistralAttention has no q/k/v biases whatever attention_bias says; the
  loader asked for bias tensors the checkpoint does not have."""
  torch_model = make_torch_model("MistralConfig", attention_bias=True, tie_word_embeddings=False)
  torch_model.save_pretrained(tmp_path, safe_serialization=True)
  model = sj.load(tmp_path)
  assert not model.config.qkv_bias
  tokens = np.random.default_rng(0).integers(0, TINY["vocab_size"], size=(2, 12))
  assert_f32_close(jax_logits(model, tokens), float64_logits(torch_model, tokens), MODEL_ULPS)
