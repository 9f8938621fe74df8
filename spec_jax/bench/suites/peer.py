"""The peer suite: spec_jax against the implementations people already use, on the same model
and prompts, side by side in one run: transformers' PyTorch `generate` (plain decoding,
assisted generation with `assistant_model=` the same draft model, prompt lookup with
`prompt_lookup_num_tokens`) and, with `--peers hf llamacpp`, llama.cpp through
llama-cpp-python (plain decoding and its prompt-lookup drafter) on the GGUF file.

    python -m spec_jax.bench --suite peer \\
        --pairs /work/widened/stories260K-78M@draft:/work/widened/salty279K \\
                /work/widened/stories260K-78M@ngram --num-draft 2 4 6 --peer-batch 1 8
    python -m spec_jax.bench --suite peer --peers hf llamacpp --prompts chat:spec_bench \\
        --pairs ../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf@ngram \\
        --num-draft 2 4 6 8 --peer-lookup-tokens 2 4 10 --peer-batch 1      # docs/peers.md

Each library runs in its own process (spec_jax.bench.peer_worker; one per thread count), so one
library's thread pools never slow the other's timed calls; the processes alternate,
`peer_rounds` times, each timing `repeats` round-robin rounds of its configurations after a
warm-up. Greedy, the same prompt token ids, exactly max_new_tokens new tokens per row, no early
stop; greedy tokens of every configuration are checked against spec_jax's plain decoding.
Prompts of a plain set are cut to equal lengths (no padding on either side); `chat:SET` prompts
(spec_jax.bench.chat_prompts) are whole chat-template encodings of differing lengths, run at
batch 1. llama.cpp runs at batch 1 only. Ratios compare medians over all timed rounds; the
spread of each side's plain decoding is the noise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from spec_jax.bench.chat_prompts import chat_prompt_token_lists, is_chat_source
from spec_jax.bench.metrics import common_prefix_fraction, first_difference
from spec_jax.bench.peer_llamacpp import gguf_info, import_llama_cpp
from spec_jax.bench.prompts import prompt_token_lists
from spec_jax.bench.results import ROOT, cpu_info, log
from spec_jax.bench.specs import (check_measured_pairs, drafter_label, load_model,
                                  model_label, parse_pairs,
                                  resolve_path)
from spec_jax.bench.suites.peer_report import HF, LLAMACPP, OURS, summarize_batch
from spec_jax.timing import decode_roofline, memory_bandwidth, summarize

PEERS = ("hf", "llamacpp")

PEER_DEFINITIONS = {
    "tokens_per_s": "new tokens / wall seconds of the library's generate calls (median, min, max "
                    "over every timed round of every process); every call evaluates its prompt",
    "vs_ours_plain": "tokens/s / spec_jax plain decoding's tokens/s (same batch)",
    "vs_hf_plain": "tokens/s / transformers plain decoding's tokens/s at its best thread count",
    "vs_llamacpp_plain": "tokens/s / llama.cpp plain decoding's tokens/s at its best thread count",
    "greedy_match": "the configuration's greedy tokens equal spec_jax plain decoding's (llama.cpp "
                    "multiplies Q4_1 weights with activations quantised to Q8_1, so its greedy "
                    "tokens may part from a dequantised float model's at a near-tie)",
    "first_difference": "(prompt, position) of the first token that differs from spec_jax plain "
                        "decoding, or null",
    "greedy_prefix": "mean over prompts of the share of tokens before the first one that "
                     "differs from spec_jax plain decoding (1 = identical)",
    "reads_per_token_bytes": "bytes of weights a plain decode step streams: the parameters in the "
                             "row's dtype (spec_jax, transformers: dequantised from the same "
                             "weights; the tied embedding once) or every tensor of the GGUF file "
                             "as stored (llama.cpp: Q4_1 projections, Q8_0 embedding)",
    "roofline": "tokens/s if a plain step only read its bytes (weights once + each row's KV up "
                "to the mean fill) at the measured read bandwidth (a jitted sum over 512 MB); "
                "vs_roofline = ours plain / roofline; llama.cpp's counts its GGUF bytes and an "
                "f16 KV cache",
}
def _drafter_config(drafter_spec: str, k: int) -> dict:
  if drafter_spec == "ngram":
    return {"mode": "ngram", "draft": None, "k": k}
  if drafter_spec.startswith("draft:"):
    return {"mode": "draft", "draft": str(resolve_path(drafter_spec[len("draft:"):])), "k": k}
  raise ValueError(f"the peer suite compares drafters transformers has: draft:MODEL (assisted "
                   f"generation) and ngram (prompt lookup); got {drafter_spec!r}")


def _run_worker(job: dict, cache_dir: str) -> dict:
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache_dir)
  proc = subprocess.run([sys.executable, "-m", "spec_jax.bench.peer_worker"],
                        input=json.dumps(job), capture_output=True, text=True, env=env,
                        cwd=str(ROOT))
  if proc.returncode != 0:
    hint = ""
    if job["side"] == "llamacpp" and proc.returncode == -11:
      hint = ("\nllama.cpp segfaulted. A build with AMX on (GGML_NATIVE=ON on an AMX CPU) "
              "crashes in ggml_backend_amx_mul_mat on this repository's CPU: rebuild "
              "llama-cpp-python with AMX off (docs/peers.md)")
    elif job["side"] == "llamacpp" and proc.returncode == -4:
      hint = (f"\nllama.cpp hit an illegal instruction: it was built for instructions this CPU "
              f"lacks (it has {' '.join(cpu_info()['features']) or 'none of the listed ones'}; "
              f"GGML_AVX_VNNI=ON on an AMD EPYC, for one): rebuild llama-cpp-python with "
              f"only the flags /proc/cpuinfo lists (docs/peers.md)")
    raise RuntimeError(f"peer worker ({job['side']}) failed (exit {proc.returncode}):\n"
                       f"{proc.stderr[-4000:]}{hint}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _thread_counts(values) -> list:
  return sorted({(os.cpu_count() or 1) if int(n) == 0 else int(n) for n in values})


def _peers(opts) -> list:
  peers = list(dict.fromkeys(getattr(opts, "peers", None) or ["hf"]))
  bad = [p for p in peers if p not in PEERS]
  if bad:
    raise ValueError(f"--peers: unknown {', '.join(bad)}; choose from {', '.join(PEERS)}")
  return peers


def gguf_of(target_spec: str, peer_gguf) -> "str | None":
  """The GGUF file llama.cpp reads for a target: --peer-gguf, else the target itself when it is
  a .gguf file, else None. ValueError for a --peer-gguf that is not an existing .gguf file."""
  if peer_gguf:
    path = resolve_path(peer_gguf)
    if not (path.is_file() and path.suffix == ".gguf"):
      raise ValueError(f"--peer-gguf {peer_gguf!r} is not a .gguf file (tried {path})")
    return str(path.resolve())
  path = resolve_path(target_spec)
  return str(path.resolve()) if path.is_file() and path.suffix == ".gguf" else None


def _prompt_ids(opts, model, target_spec: str, n: int) -> tuple:
  """(ids, equal_lengths): chat prompts whole (batch 1), a plain set's cut to equal lengths."""
  if is_chat_source(opts.prompts):
    if max(opts.peer_batch) > 1:
      raise ValueError(f"--prompts {opts.prompts}: chat prompts differ in length and are never "
                       f"cut or padded; run them at --peer-batch 1")
    ids, _, _ = chat_prompt_token_lists(target_spec, opts.prompts, n, opts.max_prompt_tokens)
    return ids, False
  ids, _ = prompt_token_lists(model, opts.prompts, n, opts.prompt_words,
                              opts.max_prompt_tokens, opts.seed)
  plen = min(len(r) for r in ids)
  return [r[:plen] for r in ids], True         # equal lengths: no padding on either side


def _weight_bytes(config, dtype) -> int:
  import numpy as np
  return config.num_params * np.dtype(dtype or config.dtype).itemsize


def run_peer_suite(opts) -> dict:
  """The peer suite (see the module docstring) -> {"rows", "summary", "notes", ...}."""
  peers = _peers(opts)
  pairs = parse_pairs(opts.pairs)
  check_measured_pairs(pairs)
  bad = [k for k in opts.num_draft if isinstance(k, bool) or not isinstance(k, int) or k < 1]
  if bad:
    raise ValueError(f"the peer suite runs fixed K against transformers' fixed K: --num-draft "
                     f"values must be integers >= 1, got {bad} (the governor, 'auto', runs in "
                     f"the spec suite)")
  by_target: dict = {}
  for target_spec, drafter_spec in pairs:
    by_target.setdefault(target_spec, []).append(drafter_spec)
  threads = _thread_counts(opts.hf_threads)
  ll_threads = _thread_counts(getattr(opts, "llamacpp_threads", None) or [0])
  lookups = [int(k) for k in (opts.peer_lookup_tokens if isinstance(opts.peer_lookup_tokens, list)
                              else [opts.peer_lookup_tokens])]
  ours_dtypes = list(dict.fromkeys(getattr(opts, "dtype", None) or [None]))
  hf_dtypes = list(dict.fromkeys(getattr(opts, "hf_dtypes", None) or ["float32"]))
  ggufs = {t: gguf_of(t, getattr(opts, "peer_gguf", None)) for t in by_target}
  if "llamacpp" in peers:
    missing = [t for t, g in ggufs.items() if g is None]
    if missing:
      raise ValueError(f"--peers llamacpp needs a GGUF file: give a .gguf target or "
                       f"--peer-gguf PATH (targets without one: {', '.join(missing)})")
    import_llama_cpp()                           # ValueError with the install hint
  rows, summary, notes = [], [], []
  cache_dir = tempfile.mkdtemp(prefix="spec_jax_peer_jit_")
  bandwidth = memory_bandwidth()
  log(f"[bench] peer: read bandwidth {bandwidth['read_bytes_per_s'] / 1e9:.1f} GB/s, copy "
      f"{bandwidth['copy_bytes_per_s'] / 1e9:.1f} GB/s")
  for target_spec, drafter_specs in by_target.items():
    model = load_model(target_spec, opts.seed)
    config = model.config
    label = model_label(target_spec)
    n_max = max(max(opts.peer_batch), opts.peer_prompts)
    ids, equal = _prompt_ids(opts, model, target_spec, n_max)
    del model
    longest = max(len(r) for r in ids)
    max_new = min(int(opts.max_new_tokens), config.max_position_embeddings - longest - 16)
    gguf = gguf_info(ggufs[target_spec]) if ggufs[target_spec] else None
    for batch in sorted(set(opts.peer_batch)):
      n = -(-max(opts.peer_prompts, batch) // batch) * batch
      prompts = (ids * (n // len(ids) + 1))[:n]
      mean_plen = sum(len(r) for r in prompts) / n
      plain = {"name": "plain", "mode": "plain", "draft": None, "k": 0}
      ours, hf, ll = [dict(plain)], [dict(plain)], [dict(plain)]
      for d in drafter_specs:
        for k in opts.num_draft:
          c = _drafter_config(d, int(k))
          ours.append(dict(c, name=f"{drafter_label(d)} K={k}"))
        if batch != 1:
          continue
        c = _drafter_config(d, lookups[0])
        if c["mode"] == "draft":
          hf.append(dict(c, name="assisted"))
          continue
        for k in lookups:
          hf.append(dict(c, k=k, name=f"prompt lookup {k}"))
          ll.append(dict(c, k=k, name=f"prompt lookup {k}"))
      base = {"target": target_spec if target_spec.startswith(("random:", "widened:"))
              else str(resolve_path(target_spec)), "prompts": prompts, "batch": batch,
              "max_new": max_new, "repeats": opts.repeats, "seed": opts.seed}
      workers = [(OURS, None, d, dict(base, side="ours", configs=ours, dtype=d))
                 for d in ours_dtypes]
      if "hf" in peers:
        workers += [(HF, t, d, dict(base, side="hf", threads=t, configs=hf, dtype=d))
                    for d in hf_dtypes for t in threads]
      if "llamacpp" in peers and batch == 1:
        workers += [(LLAMACPP, t, gguf["type"], dict(base, side="llamacpp", threads=t,
                                                     configs=ll, gguf=ggufs[target_spec]))
                    for t in ll_threads]
      elif "llamacpp" in peers:
        notes.append(f"{label} B={batch}: llama.cpp not run (llama-cpp-python decodes one "
                     f"sequence at a time)")
      measured: dict = {}
      for rnd in range(opts.peer_rounds):
        for lib, t, d, job in workers:
          log(f"[bench] peer {label} B={batch} round {rnd + 1}/{opts.peer_rounds}: {lib}"
              + (f" ({t} threads)" if t else "") + (f" {d}" if d else ""))
          res = _run_worker(job, cache_dir)
          for name, r in res["configs"].items():
            m = measured.setdefault((lib, t, d, name), {"tokens_per_s": [],
                                                        "tokens": r["tokens"], "tau": r["tau"]})
            m["tokens_per_s"] += r["tokens_per_s"]
      # Greedy tokens are compared with ours plain in the same dtype (bf16 and f32 greedy may
      # part at a near-tie; docs/speed.md measures how often), else float32, else our first.
      references = {d: measured[(OURS, None, d, "plain")]["tokens"] for d in ours_dtypes}
      fallback = references.get("float32", references.get(None, references[ours_dtypes[0]]))
      cfg_of = {(OURS, None, c["name"]): c for c in ours}
      cfg_of.update({(HF, t, c["name"]): c for t in threads for c in hf})
      cfg_of.update({(LLAMACPP, t, c["name"]): c for t in ll_threads for c in ll})
      batch_rows = []
      for (lib, t, d, name), m in measured.items():
        reference = references.get(d, fallback)
        diff = first_difference(m["tokens"], reference)
        if diff is not None:
          notes.append(f"{label} B={batch} {lib} {name} {d or ''}: greedy tokens differ from "
                       f"spec_jax plain (row {diff[0]}, position {diff[1]})")
        c = cfg_of[(lib, t, name)]
        reads = gguf["bytes"] if lib == LLAMACPP else _weight_bytes(config, d)
        batch_rows.append({"target": label, "batch": batch, "library": lib, "threads": t,
                           "dtype": d or config.dtype, "config": name, "mode": c["mode"],
                           "K": c["k"], "prompts": n, "prompt_tokens": round(mean_plen),
                           "prompt_tokens_equal": equal, "max_new_tokens": max_new,
                           "tokens_per_s": summarize(m["tokens_per_s"]), "tau": m["tau"],
                           "reads_per_token_bytes": reads, "greedy_match": diff is None,
                           "first_difference": list(diff) if diff else None,
                           "greedy_prefix": common_prefix_fraction(m["tokens"], reference)})
      s = summarize_batch(label, batch, batch_rows)
      fill = int(mean_plen + max_new // 2)
      # The roofline of the bytes our fastest plain decoding reads: its dtype's weights.
      s["roofline_tokens_per_s"] = decode_roofline(config.replace(dtype=s["ours_plain_dtype"]),
                                                   batch, fill, bandwidth["read_bytes_per_s"])
      s["ours_plain_vs_roofline"] = s["ours_plain"] / s["roofline_tokens_per_s"]
      if "llamacpp_plain_best" in s:
        kv = 2 * config.num_layers * fill * config.num_kv_heads * config.head_dim * 2   # f16
        s["llamacpp_roofline_tokens_per_s"] = bandwidth["read_bytes_per_s"] / (gguf["bytes"] + kv)
        s["llamacpp_plain_vs_roofline"] = (s["llamacpp_plain_best"]
                                           / s["llamacpp_roofline_tokens_per_s"])
      summary.append(s)
      rows += batch_rows
  return {"suite": "peer", "rows": rows, "summary": summary, "notes": notes,
          "bandwidth": bandwidth, "gguf": {t: g for t, g in ggufs.items() if g},
          "definitions": PEER_DEFINITIONS}
