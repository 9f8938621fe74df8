"""Tiny GGUF files written as llama.cpp's convert_hf_to_gguf.py writes them (tests only)."""

import numpy as np

Q = None


def _q():
  import gguf
  return gguf.GGMLQuantizationType


def llama_cpp_permute(w, n_head):
  """convert_hf_to_gguf.py's `permute`: Hugging Face q/k rows -> llama.cpp's interleaved RoPE
  pairs (the loader must undo it)."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def write_tiny_gguf(path, arch="llama", qtype="Q4_1", tied=True, vocab=128, hidden=64,
                    ffn=96, layers=2, heads=4, kv_heads=2, head_dim=16, bias=False,
                    qk_norm=False, extra_tensor=None, context=256, seed=0, floats=None,
                    head_count=None):
  """A random model of `arch` with its projections stored as `qtype` (the embedding Q8_0, norms
  F32) and no tokenizer. extra_tensor: (name, array, qtype name) added at the end; floats:
  {metadata key: float} added (or, for the keys written here, written instead); head_count:
  the metadata's head count, when it should differ from the tensors' `heads`."""
  import gguf
  q = _q()
  qtype = q[qtype]
  rng = np.random.default_rng(seed)
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(layers)
  w.add_context_length(context)
  w.add_embedding_length(hidden)
  w.add_feed_forward_length(ffn)
  w.add_head_count(heads if head_count is None else head_count)
  w.add_head_count_kv(kv_heads)
  floats = dict(floats or {})
  w.add_rope_freq_base(floats.pop(f"{arch}.rope.freq_base", 10000.0))
  w.add_layer_norm_rms_eps(floats.pop(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5))
  for key, value in floats.items():
    w.add_float32(key, value)
  w.add_key_length(head_dim)
  w.add_value_length(head_dim)
  w.add_vocab_size(vocab)
  w.add_rope_dimension_count(head_dim)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)

  def put(name, arr, kind=None):
    arr = np.asarray(arr, np.float32)
    if kind is None or arr.ndim == 1 or kind == q.F32:
      w.add_tensor(name, arr)
    elif kind == q.F16:
      w.add_tensor(name, arr.astype(np.float16))
    else:
      w.add_tensor(name, gguf.quants.quantize(arr, kind), raw_dtype=kind)

  normal = lambda *shape, std=0.3: rng.normal(0, std, shape)
  put("token_embd.weight", normal(vocab, hidden, std=0.5), q.Q8_0)
  if not tied:
    put("output.weight", normal(vocab, hidden, std=0.5), qtype)
  put("output_norm.weight", 1 + 0.1 * rng.normal(size=hidden))
  for i in range(layers):
    p = f"blk.{i}."
    put(p + "attn_norm.weight", 1 + 0.1 * rng.normal(size=hidden))
    put(p + "ffn_norm.weight", 1 + 0.1 * rng.normal(size=hidden))
    wq, wk = normal(heads * head_dim, hidden), normal(kv_heads * head_dim, hidden)
    if arch == "llama":
      wq, wk = llama_cpp_permute(wq, heads), llama_cpp_permute(wk, kv_heads)
    put(p + "attn_q.weight", wq, qtype)
    put(p + "attn_k.weight", wk, qtype)
    put(p + "attn_v.weight", normal(kv_heads * head_dim, hidden), qtype)
    put(p + "attn_output.weight", normal(hidden, heads * head_dim), qtype)
    if bias:
      bq, bk = normal(heads * head_dim, std=0.1), normal(kv_heads * head_dim, std=0.1)
      if arch == "llama":                       # permuted as the weights' rows are
        bq, bk = llama_cpp_permute(bq, heads), llama_cpp_permute(bk, kv_heads)
      put(p + "attn_q.bias", bq)
      put(p + "attn_k.bias", bk)
      put(p + "attn_v.bias", normal(kv_heads * head_dim, std=0.1))
    if qk_norm:
      put(p + "attn_q_norm.weight", 1 + 0.1 * rng.normal(size=head_dim))
      put(p + "attn_k_norm.weight", 1 + 0.1 * rng.normal(size=head_dim))
    put(p + "ffn_gate.weight", normal(ffn, hidden), qtype)
    put(p + "ffn_up.weight", normal(ffn, hidden), qtype)
    put(p + "ffn_down.weight", normal(hidden, ffn), qtype)
  if extra_tensor is not None:
    name, arr, kind = extra_tensor
    put(name, arr, q[kind])
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path
