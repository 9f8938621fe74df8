"""One side of the peer comparison, in a process of its own: spec_jax, transformers or llama.cpp.

    python -m spec_jax.bench.peer_worker < job.json      # prints one JSON line on stdout

The peer suite (suites/peer.py) starts one worker per library (and per torch thread count) and
alternates them, so one library's thread pools never slow the other's timed calls. A job:

  {"side": "ours" | "hf" | "llamacpp", "threads": int (hf, llamacpp), "target": MODEL,
   "gguf": PATH (llamacpp only), "prompts": [[ids], ...],
   "batch": B, "max_new": N, "repeats": R, "seed": 0, "dtype": "float32" | "bfloat16" | null
   (the weights of target and draft model: spec_jax's Model.astype, torch's .to(bfloat16);
   null: as stored; llama.cpp computes with the GGUF's own quantised weights),
   "configs": [{"name": str, "mode": "plain" | "draft" | "ngram", "draft": MODEL | null,
                "k": int}, ...]}

MODEL is what spec_jax.bench.specs.load_model reads (ours: the only path our side takes, so a
GGUF target works wherever `sj.load` reads GGUF); transformers loads a HF folder directly and a
`.gguf` file with `from_pretrained(folder, gguf_file=name)` (dequantised, then cast to dtype).
The llama.cpp side (spec_jax.bench.peer_llamacpp) reads the GGUF file itself.

Every configuration is warmed up (compiled) once, then the R timed rounds run the configurations
round-robin. A timed call decodes all prompts, B rows at a time (transformers' assisted
generation and prompt lookup take one row at a time, so B must be 1 for them), exactly N new
tokens per row, greedy, no early stop on either side: ours with stop_tokens=[], transformers
with eos_token_id=None (min_new_tokens would suppress the end-of-text logit and change the
greedy tokens). Wall-clock time around each library's own generate call. The output holds, per
configuration, the tokens/s of every round, the tokens of the warm-up call (for the greedy
agreement check) and, for ours and llama.cpp, tau.
"""

from __future__ import annotations

import json
import sys
import time


def _groups(prompts, batch):
  return [prompts[i:i + batch] for i in range(0, len(prompts), batch)]


def run_ours(job: dict) -> dict:
  import jax
  import spec_jax as sj
  from spec_jax.bench.specs import load_model, make_drafter
  target = load_model(job["target"], job.get("seed", 0), dtype=job.get("dtype"))
  groups = _groups(job["prompts"], job["batch"])
  key = jax.random.key(job.get("seed", 0))
  # One KV capacity per prompt group for every configuration (plain and speculative decoding
  # read equally long caches): generate()'s bucket for the widest K of the job.
  from spec_jax.decoding.prompts import capacity_bucket
  kmax = max([0] + [cfg["k"] for cfg in job["configs"] if cfg["mode"] != "plain"])
  capacity = [capacity_bucket(max(len(p) for p in g) + job["max_new"] + kmax + 1,
                              target.config.max_position_embeddings) for g in groups]
  calls = {}
  for cfg in job["configs"]:
    if cfg["mode"] == "plain":
      drafter, k = None, 1
    else:
      spec = "ngram" if cfg["mode"] == "ngram" else f"draft:{cfg['draft']}"
      drafter, k = make_drafter(spec, target, job.get("seed", 0)), cfg["k"]

    def call(drafter=drafter, k=k):
      tokens, seconds, rounds, emitted = [], 0.0, 0, 0
      for g, cap in zip(groups, capacity):
        t0 = time.perf_counter()
        out = sj.generate(target, g, drafter=drafter, num_draft=k, max_new_tokens=job["max_new"],
                          sampling=sj.Sampling(temperature=0.0), key=key, stop_tokens=[],
                          capacity=cap)
        seconds += time.perf_counter() - t0
        tokens += out.tokens
        rounds += out.stats.rounds
        emitted += out.stats.new_tokens - len(g)
      return tokens, seconds, (emitted / rounds if rounds else 1.0)
    calls[cfg["name"]] = call
  return _rounds(calls, job)


def run_hf(job: dict) -> dict:
  import torch
  from spec_jax.bench.suites.plain import hf_load
  torch.set_num_threads(int(job["threads"]))
  dtype = torch.bfloat16 if job.get("dtype") == "bfloat16" else torch.float32
  target = hf_load(job["target"], job.get("seed", 0)).to(dtype)
  groups = _groups(job["prompts"], job["batch"])
  calls = {}
  for cfg in job["configs"]:
    extra = {}
    if cfg["mode"] == "draft":
      extra["assistant_model"] = hf_load(cfg["draft"], job.get("seed", 0)).to(dtype)
    elif cfg["mode"] == "ngram":
      extra["prompt_lookup_num_tokens"] = int(cfg["k"])
    if extra and job["batch"] != 1:
      raise ValueError("transformers' assisted generation and prompt lookup take batch 1")

    def call(extra=extra):
      tokens, seconds = [], 0.0
      for g in groups:
        ids = torch.tensor(g, dtype=torch.long)
        t0 = time.perf_counter()
        with torch.inference_mode():
          out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=job["max_new"], eos_token_id=None, pad_token_id=0,
                                num_beams=1, temperature=None, top_p=None, top_k=None, **extra)
        seconds += time.perf_counter() - t0
        tokens += out[:, ids.shape[1]:].tolist()
      return tokens, seconds, None
    calls[cfg["name"]] = call
  return _rounds(calls, job)


def _rounds(calls: dict, job: dict) -> dict:
  """Warm-up of every configuration, then `repeats` round-robin timed rounds."""
  n_tokens = len(job["prompts"]) * job["max_new"]
  out = {}
  for name, call in calls.items():
    tokens, _, tau = call()
    out[name] = {"tokens": tokens, "tau": tau, "tokens_per_s": []}
  for _ in range(job["repeats"]):
    for name, call in calls.items():
      _, seconds, _ = call()
      out[name]["tokens_per_s"].append(n_tokens / seconds)
  return {"configs": out}


def main() -> int:
  import faulthandler
  faulthandler.enable()           # a native crash (e.g. in llama.cpp) leaves a trace on stderr
  job = json.loads(sys.stdin.read())
  if job["side"] == "llamacpp":
    from spec_jax.bench.peer_llamacpp import run_llamacpp
    result = run_llamacpp(job, _rounds)
  elif job["side"] in ("ours", "hf"):
    result = run_ours(job) if job["side"] == "ours" else run_hf(job)
  else:
    raise ValueError(f"unknown peer side {job['side']!r}: ours, hf or llamacpp")
  print(json.dumps(result))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
