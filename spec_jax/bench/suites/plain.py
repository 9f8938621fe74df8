"""The plain suite: plain greedy decoding of spec_jax against transformers' PyTorch `generate`
(same prompts, same number of new tokens, greedy tokens checked equal before timing), and the
verify cost ratio c(T) = t(forward over T new tokens at fill F) / t(forward over 1)
(see spec_jax.bench.definitions.PLAIN_DEFINITIONS).
"""

from __future__ import annotations

import os
import time

from spec_jax.bench.definitions import PLAIN_DEFINITIONS
from spec_jax.bench.metrics import first_difference
from spec_jax.bench.prompts import prompt_token_lists
from spec_jax.bench.results import log
from spec_jax.bench.specs import load_model, model_label, resolve_path
from spec_jax.bench.suites.targets import release_compiled, run_generate
from spec_jax.bench.timers import time_forward
from spec_jax.timing import ratio_of, summarize, time_interleaved, time_single_calls


def hf_direct_path(spec: str):
  """The path transformers loads `spec` from by itself (a HF folder or a .gguf file), or None
  (random:, widened:, llama2.c: built from spec_jax's weights by hf_model_from)."""
  if spec.startswith(("random:", "widened:")):
    return None
  path = resolve_path(spec)
  if path.is_dir() and (path / "config.json").is_file():
    return path
  if path.is_file() and path.suffix == ".gguf":
    return path
  return None


def hf_load(spec: str, seed: int = 0):
  """A transformers causal LM (float32, eval mode) for a model spec: HF folders and GGUF files
  (dequantised by transformers' own GGUF loader) directly, anything else from spec_jax's
  weights."""
  if hf_direct_path(spec) is not None:
    return hf_model_from(None, spec)
  return hf_model_from(load_model(spec, seed), spec)


def hf_model_from(model, spec: str):
  """A transformers LlamaForCausalLM with exactly `model`'s weights (HF folders and GGUF files
  load directly; `model` may then be None)."""
  import numpy as np
  import torch
  import transformers
  path = hf_direct_path(spec)
  if path is not None and path.suffix == ".gguf":
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
  if path is not None:
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32).eval()
  if model is None:
    raise ValueError(f"{spec}: transformers cannot load it directly; pass spec_jax's model")
  c = model.config
  if c.qkv_bias or c.qk_norm or c.sliding_window or c.rope_scaling:
    raise ValueError(f"{spec}: only plain llama shapes are converted to transformers here")
  hf_config = transformers.LlamaConfig(
      vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
      num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
      max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
      rope_theta=c.rope_theta, tie_word_embeddings=c.tie_embeddings, attention_bias=False,
      bos_token_id=c.bos_token_id, eos_token_id=list(c.eos_token_ids) or None)
  hf = transformers.LlamaForCausalLM(hf_config).eval()
  p = model.params
  lay = p["layers"]
  t = lambda a: torch.from_numpy(np.array(a, dtype=np.float32, copy=True))
  with torch.no_grad():
    hf.model.embed_tokens.weight.copy_(t(p["embed"]))
    hf.model.norm.weight.copy_(t(p["final_norm"]))
    if not c.tie_embeddings:
      hf.lm_head.weight.copy_(t(np.asarray(p["lm_head"]).T))
    for i, layer in enumerate(hf.model.layers):
      at, mlp = layer.self_attn, layer.mlp
      layer.input_layernorm.weight.copy_(t(lay["attn_norm"][i]))
      layer.post_attention_layernorm.weight.copy_(t(lay["mlp_norm"][i]))
      at.q_proj.weight.copy_(t(np.asarray(lay["wq"][i]).T))
      at.k_proj.weight.copy_(t(np.asarray(lay["wk"][i]).T))
      at.v_proj.weight.copy_(t(np.asarray(lay["wv"][i]).T))
      at.o_proj.weight.copy_(t(np.asarray(lay["wo"][i]).T))
      mlp.gate_proj.weight.copy_(t(np.asarray(lay["w_gate"][i]).T))
      mlp.up_proj.weight.copy_(t(np.asarray(lay["w_up"][i]).T))
      mlp.down_proj.weight.copy_(t(np.asarray(lay["w_down"][i]).T))
  if c.tie_embeddings:
    hf.tie_weights()
  return hf


def hf_generate(hf, prompts, max_new: int):
  """Greedy HF generate of exactly max_new tokens per row (equal-length prompts, no padding)
  -> (new tokens [B, max_new] list, seconds)."""
  import torch
  ids = torch.tensor(prompts, dtype=torch.long)
  mask = torch.ones_like(ids)
  t0 = time.perf_counter()
  with torch.inference_mode():
    out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                      min_new_tokens=max_new, eos_token_id=None, pad_token_id=0,
                      num_beams=1, temperature=None, top_p=None, top_k=None)
  seconds = time.perf_counter() - t0
  return out[:, ids.shape[1]:].tolist(), seconds


def run_plain_suite(opts) -> dict:
  """The plain suite (see the module docstring)."""
  import torch
  threads = []
  for n in opts.hf_threads:
    n = (os.cpu_count() or 1) if n == 0 else int(n)
    if n not in threads:
      threads.append(n)
  torch.set_num_threads(threads[0])
  gen_rows, cost_rows, notes = [], [], []
  for spec in opts.plain_models:
    log(f"[bench] plain: loading {spec}")
    model = load_model(spec, opts.seed)
    label = model_label(spec)
    hf = hf_model_from(model, spec)
    n_params = model.config.num_params
    hf_params = sum(p.numel() for p in hf.parameters())
    nb = max(opts.plain_batch)
    ids, _ = prompt_token_lists(model, opts.prompts, nb, opts.prompt_words,
                                opts.max_prompt_tokens, opts.seed)
    plen = min(len(r) for r in ids)
    ids = [r[:plen] for r in ids]          # equal lengths: no padding on either side
    max_new = min(int(opts.plain_max_new_tokens),
                  model.config.max_position_embeddings - plen)
    for batch in sorted(set(opts.plain_batch)):
      prompts = ids[:batch]
      # Greedy agreement first (also the warm-up of both).
      ours = run_generate(model, prompts, None, 0, max_new, 0.0, opts.seed)
      theirs, _ = hf_generate(hf, prompts, max_new)
      first_diff = first_difference(ours.tokens, theirs)
      match = first_diff is None
      if not match:
        notes.append(f"{label} B={batch}: greedy tokens DIFFER from transformers (first "
                     f"difference row {first_diff[0]} position {first_diff[1]})")
        log("[bench] WARNING " + notes[-1])
      ours_tps, hf_tps = [], {n: [] for n in threads}
      for n in threads[1:]:               # warm-up at the other thread counts
        torch.set_num_threads(n)
        hf_generate(hf, prompts, min(max_new, 4))
      for rep in range(opts.repeats):     # interleaved
        out = run_generate(model, prompts, None, 0, max_new, 0.0, opts.seed)
        ours_tps.append(out.stats.tokens_per_second)
        for n in threads:
          torch.set_num_threads(n)
          _, sec = hf_generate(hf, prompts, max_new)
          hf_tps[n].append(batch * max_new / sec)
        torch.set_num_threads(threads[0])
        log(f"[bench] plain {label} B={batch} rep {rep + 1}: ours {ours_tps[-1]:.1f} tok/s, "
            "transformers " + ", ".join(f"{hf_tps[n][-1]:.1f} tok/s ({n} threads)"
                                        for n in threads))
      o = summarize(ours_tps)
      h = {n: summarize(v) for n, v in hf_tps.items()}
      gen_rows.append({"model": label, "model_spec": spec, "params": n_params,
                       "hf_params": hf_params, "batch": batch, "prompt_tokens": plen,
                       "max_new_tokens": max_new, "ours_tokens_per_s": o,
                       "hf_threads": threads[0], "hf_tokens_per_s": h[threads[0]],
                       "ratio_ours_over_hf": o["median"] / h[threads[0]]["median"],
                       "hf_tokens_per_s_by_threads": {str(n): v for n, v in h.items()},
                       "greedy_match": match, "first_difference": first_diff})
    del hf
    # ----- verify cost ratio c(T)
    for fill in opts.fills:
      capacity = fill + 16
      note = None
      if capacity > model.config.max_position_embeddings:
        note = (f"capacity {capacity} > max_position_embeddings "
                f"{model.config.max_position_embeddings} (RoPE positions past the trained "
                f"context; irrelevant for timing)")
        notes.append(f"{label} F={fill}: {note}")
      ts = list(range(1, int(opts.max_verify_tokens) + 1))
      calls = {t: time_forward(model, 1, t, fill, capacity, call_only=True) for t in ts}
      loop = time_interleaved(calls, opts.cost_repeats)
      single = time_single_calls(calls, opts.cost_repeats, warm=False)   # also round-robin
      for t in ts:
        c = ratio_of(loop[t], loop[1])
        c_call = ratio_of(single[t], single[1])
        cost_rows.append({"model": label, "params": n_params, "batch": 1, "fill": fill,
                          "capacity": capacity, "T": t, "t_ms": 1e3 * loop[t]["per_iter_s"],
                          "t_spread_pct": loop[t]["spread_pct"], "n_inner": loop[t]["n_inner"],
                          "c": c, "t_call_ms": 1e3 * single[t]["per_iter_s"],
                          "t_call_spread_pct": single[t]["spread_pct"], "c_call": c_call,
                          "note": note})
        log(f"[bench] cost {label} F={fill} T={t}: {cost_rows[-1]['t_ms']:.3f} ms (c={c:.2f}), "
            f"single call {cost_rows[-1]['t_call_ms']:.3f} ms (c_call={c_call:.2f})")
    del model
    release_compiled()
  return {"suite": "plain", "generate": gen_rows, "cost": cost_rows, "notes": notes,
          "definitions": PLAIN_DEFINITIONS}
