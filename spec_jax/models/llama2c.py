"""llama2.c legacy (v0) `.bin` checkpoints.

Layout (little-endian): 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
seq_len; a negative vocab_size means an unshared classifier), then float32 arrays:

  token_embedding [V, D]   rms_att [L, D]   wq [L, D, D]   wk, wv [L, KV, D]   wo [L, D, D]
  rms_ffn [L, D]   w1 [L, F, D]   w2 [L, D, F]   w3 [L, F, D]   rms_final [D]
  freq_cis_real, freq_cis_imag [seq_len, head_size / 2]   (unused: RoPE is recomputed)
  wcls [V, D]                                             (unshared classifier only)

Matrices are PyTorch Linear weights ([out, in]) and are transposed into the [in, out] layout of
`spec_jax.models.transformer`. llama2.c rotates interleaved pairs (GPT-J style RoPE); q and k
output rows are permuted per head into the Hugging Face rotate_half layout, exactly as
transformers' convert_llama_weights_to_hf.py does, so one RoPE serves every family.
"""

from __future__ import annotations

import pathlib

import numpy as np

from spec_jax.models.config import ModelConfig

HEADER_INTS = 7


def permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
  """[out, in] q/k weight with interleaved RoPE pairs -> rotate_half layout (HF's `permute`)."""
  dim1, dim2 = w.shape
  return w.reshape(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(0, 2, 1, 3).reshape(dim1, dim2)


def read_header(path: pathlib.Path) -> tuple:
  with open(path, "rb") as f:
    raw = f.read(HEADER_INTS * 4)
  if len(raw) < HEADER_INTS * 4:
    raise ValueError(f"{path}: too short for a llama2.c checkpoint header "
                     f"({len(raw)} bytes, need {HEADER_INTS * 4})")
  return tuple(int(x) for x in np.frombuffer(raw, "<i4", HEADER_INTS))


def _config_from_header(path, header) -> ModelConfig:
  dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len = header
  shared = vocab > 0
  vocab = abs(vocab)
  for name, value in zip(("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                          "seq_len"), (dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len)):
    if value <= 0:
      raise ValueError(f"{path}: llama2.c header has {name}={value}; is this a legacy (v0) "
                       f"llama2.c .bin checkpoint?")
  if dim % n_heads or n_heads % n_kv_heads or (dim // n_heads) % 2:
    raise ValueError(f"{path}: llama2.c header is inconsistent (dim={dim}, n_heads={n_heads}, "
                     f"n_kv_heads={n_kv_heads})")
  return ModelConfig(
      vocab_size=vocab, hidden_size=dim, intermediate_size=hidden, num_layers=n_layers,
      num_heads=n_heads, num_kv_heads=n_kv_heads, head_dim=dim // n_heads, rope_theta=10000.0,
      rms_norm_eps=1e-5, tie_embeddings=shared, max_position_embeddings=seq_len,
      model_type="llama", bos_token_id=1, eos_token_ids=(1,), dtype="float32")


def _sections(config: ModelConfig) -> list:
  d, f, l, v = config.hidden_size, config.intermediate_size, config.num_layers, config.vocab_size
  kv = config.num_kv_heads * config.head_dim
  half = config.head_dim // 2
  s = config.max_position_embeddings
  sections = [("embed", (v, d)), ("rms_att", (l, d)), ("wq", (l, d, d)), ("wk", (l, kv, d)),
              ("wv", (l, kv, d)), ("wo", (l, d, d)), ("rms_ffn", (l, d)), ("w1", (l, f, d)),
              ("w2", (l, d, f)), ("w3", (l, f, d)), ("rms_final", (d,)),
              ("freq_cis_real", (s, half)), ("freq_cis_imag", (s, half))]
  if not config.tie_embeddings:
    sections.append(("wcls", (v, d)))
  return sections


def read_llama2c(path) -> tuple:
  """Reads a llama2.c v0 checkpoint -> (ModelConfig, numpy params in the llama family's layout)."""
  path = pathlib.Path(path)
  config = _config_from_header(path, read_header(path))
  sections = _sections(config)
  expected = HEADER_INTS * 4 + 4 * sum(int(np.prod(shape)) for _, shape in sections)
  actual = path.stat().st_size
  if actual != expected:
    what = "truncated" if actual < expected else "longer than its header implies"
    raise ValueError(f"{path}: llama2.c checkpoint is {what}: the header "
                     f"(dim={config.hidden_size}, hidden_dim={config.intermediate_size}, "
                     f"n_layers={config.num_layers}, vocab={config.vocab_size}, "
                     f"seq_len={config.max_position_embeddings}) implies {expected} bytes, "
                     f"the file has {actual}")
  flat = np.fromfile(path, dtype="<f4", offset=HEADER_INTS * 4)
  arrays, offset = {}, 0
  for name, shape in sections:
    size = int(np.prod(shape))
    arrays[name] = flat[offset:offset + size].reshape(shape)
    offset += size

  hq, hkv = config.num_heads, config.num_kv_heads
  t = lambda w: np.ascontiguousarray(np.swapaxes(w, -1, -2))  # [L, out, in] -> [L, in, out]
  layers = {
      "attn_norm": arrays["rms_att"].copy(),
      "mlp_norm": arrays["rms_ffn"].copy(),
      "wq": t(np.stack([permute_rotary(w, hq) for w in arrays["wq"]])),
      "wk": t(np.stack([permute_rotary(w, hkv) for w in arrays["wk"]])),
      "wv": t(arrays["wv"]),
      "wo": t(arrays["wo"]),
      "w_gate": t(arrays["w1"]),
      "w_up": t(arrays["w3"]),
      "w_down": t(arrays["w2"]),
  }
  params = {"embed": arrays["embed"].copy(), "layers": layers,
            "final_norm": arrays["rms_final"].copy()}
  if not config.tie_embeddings:
    params["lm_head"] = t(arrays["wcls"])
  return config, params
