"""python -m spec_jax.bench: the honest side-by-side benchmark.

Two suites, each one run that prints one table and writes one JSON file (atomically):

  --suite spec (default)  plain decoding (K=0) and every drafter of every (target, drafter) pair,
      at several K and batch sizes and temperatures, on the SAME prompts, in ONE run: tokens/s
      (median of repeats, min/max), speedup over plain decoding at the same batch and
      temperature in that run, alpha, tau, the measured cost ratios c_draft and c_verify, the
      analytic bound tau / (K c_draft + c_verify) and efficiency = speedup / bound
      (../shared/DESIGN.md, "Performance model"). Ends with one verdict line per pair and
      temperature: the best K per batch and whether it beats plain decoding there.
  --suite plain  plain greedy decoding of spec_jax against transformers' PyTorch `generate`
      (same prompts, same number of new tokens, greedy tokens checked equal before timing), and
      the verify cost ratio c(T) = t(forward over T new tokens at fill F) / t(forward over 1).

    python -m spec_jax.bench                                   # spec suite, default pairs
    python -m spec_jax.bench --quick                           # small smoke run
    python -m spec_jax.bench --suite plain
    python -m spec_jax.bench --config configs/bench_default.yaml
    python -m spec_jax.bench --pairs ../shared/models/stories260K@ngram --num-draft 2 4 \\
        --batch 1 8 --prompts ../shared/data/prompts/spec_bench.jsonl

Models (`TARGET` in a pair, `--plain-models`): a Hugging Face folder, a llama2.c folder or .bin
(anything `sj.load` reads), or `random:100m` / `random:tiny` / `random:tiny-draft` (random
weights, see RANDOM_MODELS; no tokenizer: prompts become seeded random token ids).
Drafters (`DRAFTER`): `ngram`, `ngram:MAX[:MIN]`, `draft:MODEL` (a DraftModel), `heads:PATH`.
A pair is written `TARGET@DRAFTER`; `--pairs default` is DEFAULT_PAIRS.

Timing rules: every configuration gets one warm-up call first (compilation is excluded:
generate() compiles ahead of time and times only the compiled call); every configuration of one
(target, batch, temperature) cell is then run round-robin, `repeats` times, with plain decoding
measured at the start AND at the end of every round, so slow phases of a shared machine hit
all configurations alike; stop_tokens=[] so every row of every configuration produces exactly
max_new_tokens new tokens; same prompts and same PRNG key everywhere. The spread (max-min)/median
of the plain baseline is reported as the machine's noise.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED = pathlib.Path(os.environ.get("SPEC_JAX_SHARED", ROOT.parent / "shared"))
SCHEMA_VERSION = 1

DEFAULT_PAIRS = (
    "../shared/models/stories260K@draft:../shared/models/salty279K",
    "../shared/models/stories260K@ngram",
    "../shared/models/tinystories656K@ngram",
)
DEFAULT_PLAIN_MODELS = ("../shared/models/stories260K", "../shared/models/tinystories656K",
                        "random:100m")
PROMPT_SETS = {  # short names for --prompts
    "tinystories": "../shared/data/tinystories/heldout.txt",
    "spec_bench": "../shared/data/prompts/spec_bench.jsonl",
    "mt_bench": "../shared/data/prompts/mt_bench.jsonl",
    "humaneval": "../shared/data/prompts/HumanEval.jsonl.gz",
    "gsm8k": "../shared/data/prompts/gsm8k_test.jsonl",
}

# Random llama shapes. "100m": 100,092,672 params (tied embeddings; kv 4 heads).
RANDOM_MODELS = {
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12,
                 num_heads=12, num_kv_heads=4, tie_embeddings=True,
                 max_position_embeddings=4096, rms_norm_eps=1e-5),
    "tiny": dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2,
                 num_heads=4, num_kv_heads=2, tie_embeddings=False, max_position_embeddings=512,
                 rms_norm_eps=1e-5),
    "tiny-draft": dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1,
                       num_heads=4, num_kv_heads=2, tie_embeddings=False,
                       max_position_embeddings=512, rms_norm_eps=1e-5),
}

QUICK = dict(num_draft=[2, 4], batch=[1, 4], max_new_tokens=32, repeats=2, cost_repeats=5)

SPEC_DEFINITIONS = {
    "tokens_per_s": "new tokens over all rows / wall seconds of one compiled generate() call "
                    "(prefill + decode loop, compile excluded); median, min, max over `n` repeats",
    "speedup": "median tokens/s of this row / median tokens/s of plain decoding (K=0) of the same "
               "target, batch and temperature, measured in this same run on the same prompts; "
               "< 1 means speculation is SLOWER than plain decoding at that batch",
    "alpha": "acceptance_rate = accepted draft tokens / drafted tokens (SpecStats), averaged "
             "over repeats; null for plain decoding",
    "alpha_token": "accepted / (accepted + rounds that ended in a rejection), averaged over "
                   "repeats: the per-token acceptance a of tau = (1 - a^(K+1)) / (1 - a); "
                   "SpecStats' alpha also counts the drafts after a round's first rejection, "
                   "never judged, as not accepted. null unless every round drafted K tokens",
    "tau": "mean_accepted_length = tokens emitted per target forward, bonus included "
           "((accepted + rounds) / rounds); 1 for plain decoding",
    "t_target_1_ms": "time of one jitted target forward over 1 new token at batch B, cache fill F "
                     "(F = longest prompt + max_new_tokens // 2, capacity = the run's capacity), "
                     "inside a jitted fori_loop (cache carried in place, argmax fed back), by "
                     "differencing: (t(2n forwards) - t(n forwards)) / n, so per-call costs "
                     "(dispatch, work hoisted out of the loop) cancel as in the engine's "
                     "while_loop; median of cost_repeats pairs",
    "c_verify": "t(target forward over K+1 new tokens) / t(target forward over 1 new token), "
                "same batch, fill and capacity; all timers of a batch run round-robin and the "
                "ratio is the median over rounds of the per-round ratio; 1 for K=0",
    "c_draft": "drafting cost of one round / K, in units of t_target_1. DraftModel: t(draft-model "
               "forward over 1 token, same batch, fill, capacity) / t_target_1 (so K*c_draft is K "
               "draft forwards; the sampling of q and the 2-token first step are not included). "
               "NGram and heads: t(jitted propose() of K tokens + commit() of the round) / K / "
               "t_target_1 (commit is where EAGLE/MTP heads run their layer over the K+1 verified "
               "features; free for n-gram). 0 for K=0",
    "bound": "tau / (K * c_draft + c_verify): the analytic speedup with the measured tau and cost "
             "ratios and no other overhead (Leviathan et al. with c_verify = 1)",
    "efficiency": "speedup / bound: the fraction of the analytic speedup the engine realises",
    "c_verify_rounds_min_max": "the smallest and largest per-round ratio behind c_verify (its "
                               "noise); t_target_1_spread_pct: (max-min)/median of t_target_1",
    "c_draft_propose, bound_propose, t_propose_ms": "the drafter's WHOLE propose() of one round "
        "(DraftModel: 2-token first step, K-1 more steps, sampling of q at temperature 1; NGram: "
        "same as c_draft) / K / t_target_1, and the bound with it: what drafting really costs",
    "noise_pct": "(max - min) / median of all plain-decoding repeats of a cell, in percent: the "
                 "machine's noise during that cell",
}
PLAIN_DEFINITIONS = {
    "ours_tokens_per_s": "sj.generate(drafter=None, greedy, stop_tokens=[]): new tokens / seconds "
                         "(stats.seconds: prefill + decode, compile excluded); median/min/max",
    "hf_tokens_per_s": "transformers `generate` (PyTorch, do_sample=False, min_new_tokens = "
                       "max_new_tokens, EOS disabled, torch threads = hf_threads, the CPU core "
                       "count by default): new tokens / wall seconds of the call; median/min/max",
    "hf_tokens_per_s_by_threads": "the same at every --hf-threads count (on a shared, "
                                  "oversubscribed machine torch's OpenMP threads can collapse; "
                                  "1 thread is shown beside the core count)",
    "greedy_match": "both produced exactly the same greedy tokens on the timed prompts",
    "c": "verify cost ratio: t(forward over T new tokens at fill F) / t(forward over 1 token at "
         "fill F), batch 1, capacity F + 16; t = (t(2n) - t(n)) / n for a jitted fori_loop of n "
         "forwards (cache carried in place, argmax fed back); T = 1..9 timed round-robin, c = "
         "median over rounds of the per-round ratio",
    "c_call": "the same ratio from single jitted forward calls (params as arguments, cache "
              "donated, block_until_ready), round-robin: includes the per-call dispatch overhead "
              "and per-call work",
}


# ============================================================================ small helpers

def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def resolve_path(p: str) -> pathlib.Path:
  """'../shared/...' resolves against the repository root when not found from the cwd."""
  path = pathlib.Path(p).expanduser()
  if path.exists() or path.is_absolute():
    return path
  parts = path.parts
  if parts and parts[0] == ".." and len(parts) > 1 and parts[1] == "shared":
    alt = SHARED.joinpath(*parts[2:])
    if alt.exists():
      return alt
  alt = ROOT / path
  return alt if alt.exists() else path


def model_label(spec: str) -> str:
  if spec.startswith("random:"):
    return spec
  return pathlib.Path(spec).name or spec


def drafter_label(spec: str) -> str:
  if spec in ("none", "", None):
    return "none"
  kind, _, arg = spec.partition(":")
  if kind == "heads" and arg:
    # train.distill_heads saves to OUT_DIR/heads: the run's folder names the heads.
    path = pathlib.Path(arg.rstrip("/"))
    name = path.parent.name if path.name == "heads" and path.parent.name else path.name
    return f"heads:{name}"
  if kind == "draft" and arg:
    return f"{kind}:{model_label(arg)}"
  return spec


def summarize(values: Sequence[float]) -> dict:
  vals = [float(v) for v in values]
  med = statistics.median(vals)
  return {"median": med, "min": min(vals), "max": max(vals), "n": len(vals),
          "spread_pct": 100.0 * (max(vals) - min(vals)) / med if med else 0.0}


def atomic_write_json(path, data) -> None:
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(data, f, indent=1, default=_json_default)
      f.write("\n")
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def _json_default(x):
  if hasattr(x, "tolist"):
    return x.tolist()
  if dataclasses.is_dataclass(x):
    return dataclasses.asdict(x)
  return str(x)


def machine_info() -> dict:
  import jax
  info = {"platform": platform.platform(), "python": platform.python_version(),
          "cpu_count": os.cpu_count(), "jax": jax.__version__,
          "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()]}
  try:
    info["loadavg_start"] = os.getloadavg()
  except OSError:
    pass
  import subprocess
  try:
    info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True,
                                        capture_output=True, timeout=10).stdout.strip()
    info["git_dirty"] = subprocess.run(
        ["git", "status", "--porcelain", "--", "spec_jax", "kernels_pallas"], cwd=ROOT,
        text=True, capture_output=True, timeout=10).stdout.split("\n")
    info["git_dirty"] = [x for x in info["git_dirty"] if x.strip()]
  except (OSError, subprocess.SubprocessError):
    pass
  return info


# ============================================================================ models, drafters

def load_model(spec: str, seed: int = 0):
  """A model spec -> sj.Model (see the module docstring)."""
  import jax
  import spec_jax as sj
  if spec.startswith("random:"):
    name = spec.partition(":")[2]
    if name not in RANDOM_MODELS:
      raise ValueError(f"unknown random model {spec!r}; known: "
                       f"{', '.join('random:' + k for k in RANDOM_MODELS)}")
    config = sj.ModelConfig(**RANDOM_MODELS[name])
    # Distinct seeds per shape so a random draft is not a copy of the target.
    return sj.init_model(config, jax.random.key(seed + sorted(RANDOM_MODELS).index(name)))
  path = resolve_path(spec)
  if not path.exists():
    raise ValueError(f"model {spec!r} not found (tried {path}); give a HF folder, a llama2.c "
                     f"folder or .bin, or random:NAME")
  return sj.load(path)


def make_drafter(spec: str, target, seed: int = 0):
  """'none' | 'ngram' | 'ngram:MAX[:MIN]' | 'draft:MODEL' | 'heads:PATH' -> drafter or None."""
  import spec_jax as sj
  if spec in (None, "", "none"):
    return None
  kind, _, arg = spec.partition(":")
  if kind == "ngram":
    parts = [int(x) for x in arg.split(":") if x] if arg else []
    return sj.drafters.NGram(*parts)
  if kind == "draft":
    if not arg:
      raise ValueError("drafter draft:MODEL needs the draft model (path or random:NAME)")
    return sj.drafters.DraftModel(load_model(arg, seed))
  if kind == "heads":
    if not arg:
      raise ValueError("drafter heads:PATH needs the trained heads' directory")
    if not hasattr(sj.drafters, "load"):
      raise ValueError("this spec_jax has no sj.drafters.load for trained heads")
    return sj.drafters.load(str(resolve_path(arg)), target)
  raise ValueError(f"unknown drafter {spec!r}; use none, ngram, ngram:MAX[:MIN], draft:MODEL "
                   f"or heads:PATH")


def parse_pairs(pairs) -> list:
  """['default'] | ['TARGET@DRAFTER', {'target':..., 'drafter':...}, ...] -> [(target, drafter)]."""
  if pairs is None or pairs == "default":
    pairs = ["default"]
  if isinstance(pairs, str):
    pairs = [pairs]
  out = []
  for p in pairs:
    if p == "default":
      out.extend(tuple(x.split("@", 1)) for x in DEFAULT_PAIRS)
    elif isinstance(p, dict):
      if "target" not in p or "drafter" not in p:
        raise ValueError(f"a pair given as a mapping needs 'target' and 'drafter' keys: {p}")
      out.append((str(p["target"]), str(p["drafter"])))
    elif isinstance(p, str) and "@" in p:
      t, d = p.split("@", 1)
      out.append((t, d))
    else:
      raise ValueError(f"bad pair {p!r}: write TARGET@DRAFTER (e.g. "
                       f"../shared/models/stories260K@ngram) or 'default'")
  seen, uniq = set(), []
  for p in out:
    if p not in seen:
      seen.add(p)
      uniq.append(p)
  return uniq


def draft_model_of(drafter):
  return getattr(drafter, "model", None)


# ============================================================================ prompts

def _paragraph_openings(path: pathlib.Path, words: int) -> list:
  text = path.read_text(encoding="utf-8")
  out, seen = [], set()
  for para in text.split("\n\n"):
    w = para.split()
    if len(w) < words:
      continue
    opening = " ".join(w[:words])
    if opening not in seen:
      seen.add(opening)
      out.append(opening)
  return out


def _jsonl_prompts(path: pathlib.Path) -> list:
  opener = gzip.open if path.suffix == ".gz" else open
  out = []
  with opener(path, "rt", encoding="utf-8") as f:
    for line_no, line in enumerate(f, 1):
      line = line.strip()
      if not line:
        continue
      rec = json.loads(line)
      if isinstance(rec.get("turns"), list) and rec["turns"]:
        out.append(str(rec["turns"][0]))          # Spec-Bench / MT-bench
      elif "prompt" in rec:
        out.append(str(rec["prompt"]))            # HumanEval
      elif "question" in rec:
        out.append(str(rec["question"]))          # GSM8K
      elif "text" in rec:
        out.append(str(rec["text"]))
      else:
        raise ValueError(f"{path}:{line_no}: no 'turns', 'prompt', 'question' or 'text' field")
  return out


def read_prompt_texts(source: str, words: int = 8) -> list:
  """--prompts: a PROMPT_SETS name, a .txt (paragraph openings), .jsonl or .jsonl.gz file."""
  path = resolve_path(PROMPT_SETS.get(source, source))
  if not path.exists():
    raise ValueError(f"prompt source {source!r} not found (tried {path}); use one of "
                     f"{', '.join(PROMPT_SETS)} or a .txt / .jsonl / .jsonl.gz path")
  if path.name.endswith((".jsonl", ".jsonl.gz", ".json")):
    texts = _jsonl_prompts(path)
  else:
    texts = _paragraph_openings(path, words)
  if not texts:
    raise ValueError(f"no prompts found in {path}")
  return texts


def prompt_token_lists(model, source: str, n: int, words: int, max_prompt_tokens: int,
                       seed: int) -> tuple:
  """n prompts as token-id lists for `model` -> (ids, texts or None).

  Models with a tokenizer encode the texts of `source` (BOS as the tokenizer adds it), each cut
  to its first max_prompt_tokens tokens. Random models (no tokenizer) get seeded random ids of
  8..15 tokens (the same for a given seed).
  """
  import numpy as np
  if model.tokenizer is None:
    rng = np.random.default_rng(seed)
    v = model.config.vocab_size
    ids = [rng.integers(3, v, size=int(rng.integers(8, 16))).tolist() for _ in range(n)]
    return ids, None
  texts = read_prompt_texts(source, words)
  if len(texts) < n:
    texts = (texts * (n // len(texts) + 1))
  texts = texts[:n]
  ids = [model.encode(t)[:max_prompt_tokens] for t in texts]
  return ids, texts


# ============================================================================ cost timing

_FN_CACHE: dict = {}


def _as_engine_prepares(params):
  """The target params as generate() hands them to its loop: on CPU the engine unstacks the
  per-layer weights once per call (XLA:CPU would otherwise copy each layer's weight slices
  before every dot, every step). Timers do the same, before their loop."""
  import jax
  try:
    from spec_jax.models.transformer import unstack_layers
  except ImportError:          # an engine without it slices inside the loop; so do we
    return params
  return unstack_layers(params) if jax.default_backend() == "cpu" else params


def _forward_loop_fn(config):
  """jit(params, tokens [B,T], cache, offsets, n) -> (tokens, cache): n forwards in a fori_loop,
  the argmax of every position fed back as the next inputs (so the LM head is not dead code),
  the cache carried and updated in place at the same offsets (the fill stays F)."""
  key = ("fwd", config)
  if key not in _FN_CACHE:
    import jax
    import jax.numpy as jnp
    from spec_jax.models.transformer import forward

    def run(params, tokens, cache, offsets, n):
      params = _as_engine_prepares(params)

      def body(_, carry):
        toks, c = carry
        out = forward(params, config, toks, c, offsets)
        return jnp.argmax(out.logits, axis=-1).astype(jnp.int32), out.cache
      return jax.lax.fori_loop(0, n, body, (tokens, cache))

    _FN_CACHE[key] = jax.jit(run, donate_argnums=(2,))
  return _FN_CACHE[key]


def _propose_loop_fn(drafter, k):
  """jit(params, state, tokens [B,S], lengths, rng, sampling, target_params, n) -> (tokens,
  state): n rounds of the drafter's own work in a fori_loop — propose() and then commit() with
  a synthetic verify result (zero target features, nothing accepted), the drafter state carried
  as in the engine. commit is free for draft models and n-gram; feature heads (EAGLE, MTP) run
  their layer over the K+1 verified features there, which is drafting cost too. The first draft
  is written back into the buffer so no call is loop-invariant."""
  key = ("propose", drafter, k)
  if key not in _FN_CACHE:
    import jax
    import jax.numpy as jnp
    from spec_jax.drafters.base import DraftContext, VerifyInfo

    def run(params, state, tokens, lengths, rng, sampling, target_params, n):
      b = tokens.shape[0]
      # What generate() does once per call, outside its loop.
      params = drafter.prepare(params) if hasattr(drafter, "prepare") else params
      target_params = _as_engine_prepares(target_params)
      width = target_params["embed"].shape[1]
      hidden = jnp.zeros((b, k + 1, width), target_params["embed"].dtype)

      def body(i, carry):
        toks, st = carry
        ctx = DraftContext(key=jax.random.fold_in(rng, i), tokens=toks, lengths=lengths,
                           sampling=sampling, target_params=target_params, num_draft=k)
        drafts, _, st = drafter.propose(params, st, ctx)
        drafts = jnp.maximum(drafts, 0).astype(jnp.int32)
        emitted = jnp.concatenate([drafts[:, :1], jnp.full((b, k), -1, jnp.int32)], axis=1)
        verify = VerifyInfo(input_tokens=jnp.concatenate([drafts[:, :1], drafts], axis=1),
                            hidden=hidden, layer_hidden=tuple(hidden for _ in drafter.target_layers),
                            lengths_before=lengths, lengths=lengths, target_params=target_params)
        st = drafter.commit(params, st, emitted, jnp.zeros((b,), jnp.int32), verify)
        toks = jax.lax.dynamic_update_slice(
            toks, jnp.maximum(drafts[:, :1], 0).astype(toks.dtype), (0, 0))
        return toks, st
      return jax.lax.fori_loop(0, n, body, (tokens, state))

    _FN_CACHE[key] = jax.jit(run, donate_argnums=(1,))
  return _FN_CACHE[key]


def _initial_drafter_state(drafter, target, tokens, fill: int, sampling):
  """The drafter's state after a (fake) prefill of the first min(16, fill) tokens of `tokens`:
  zero target features, real prompt tokens; enough for timing propose()."""
  import jax
  import jax.numpy as jnp
  from spec_jax.drafters.base import PrefillInfo
  b = tokens.shape[0]
  p = max(1, min(16, fill))
  d = target.config.hidden_size
  dtype = jnp.dtype(target.config.dtype)
  hidden = jnp.zeros((b, p, d), dtype)
  prefill = PrefillInfo(tokens=tokens, prompt_tokens=tokens[:, :p],
                        prompt_lens=jnp.full((b,), p, jnp.int32), hidden=hidden,
                        layer_hidden=tuple(hidden for _ in drafter.target_layers),
                        target_params=target.params, sampling=sampling)
  return jax.jit(drafter.init_state)(drafter.params, prefill)


def _calibrate(call, min_loop_s: float = 0.03, max_inner: int = 512) -> int:
  """Compiles and warms call, then picks n so that the loop part of call(n) is long against
  both timer noise (n * per_iteration >= min_loop_s) and the per-call part (>= 2x what a call
  pays once, e.g. the engine-like unstacking of the weights): per_iteration and the per-call
  part are estimated from the fastest of 3 calls at n=1 and 2 at n=4. Warms call(2n)."""
  def fastest(n, reps):
    best = float("inf")
    for _ in range(reps):
      t0 = time.perf_counter()
      call(n)
      best = min(best, time.perf_counter() - t0)
    return best
  call(1)                                   # compile + warm
  t1 = fastest(1, 3)
  t4 = fastest(4, 2)
  per_iter = max((t4 - t1) / 3, t1 / 50, 1e-7)
  fixed = max(t1 - per_iter, 0.0)
  n = int(min(max_inner, max(1, math.ceil(max(min_loop_s, 2 * fixed) / per_iter))))
  call(2 * n)
  return n


def time_interleaved(calls: dict, repeats: int) -> dict:
  """Per-iteration times of several timers measured round-robin, so that a slow phase of a
  shared machine hits all of them alike (ratios are then taken per round, see ratio_of).

  calls: name -> call(n), which runs n inner iterations (a jitted fori_loop) and blocks.
  Per iteration by differencing: (t(2n) - t(n)) / n, which cancels what a call pays once
  whatever n is (dispatch; work XLA hoists out of the loop or does before it, e.g.
  materialising per-layer weight slices), as the engine's long while_loop amortises it.
  -> name -> {'samples': [seconds per iteration, one per round], 'per_iter_s' (median),
  'min_s', 'max_s', 'spread_pct', 'n_inner', 'repeats', 'method'}.
  """
  ns = {name: _calibrate(c) for name, c in calls.items()}
  samples = {name: [] for name in calls}
  for _ in range(repeats):
    for name, c in calls.items():
      n = ns[name]
      t0 = time.perf_counter()
      c(n)
      t_n = time.perf_counter() - t0
      t0 = time.perf_counter()
      c(2 * n)
      t_2n = time.perf_counter() - t0
      samples[name].append(max(t_2n - t_n, 1e-9) / n)
  out = {}
  for name, vals in samples.items():
    s = summarize(vals)
    out[name] = {"samples": vals, "per_iter_s": s["median"], "min_s": s["min"], "max_s": s["max"],
                 "spread_pct": s["spread_pct"], "n_inner": ns[name], "repeats": repeats,
                 "method": "(t(2n) - t(n)) / n, round-robin"}
  return out


def ratio_of(a: dict, b: dict, scale: float = 1.0) -> float:
  """Median over rounds of a/b (both from one time_interleaved call), divided by scale."""
  return statistics.median(x / y for x, y in zip(a["samples"], b["samples"])) / scale


def _time_calls(call, repeats: int, single_call: bool = False) -> dict:
  """One timer: time_interleaved({call}), or, with single_call, `repeats` single calls (n = 1,
  per-call overheads included)."""
  if not single_call:
    return time_interleaved({"t": call}, repeats)["t"]
  call(1)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    call(1)
    times.append(time.perf_counter() - t0)
  s = summarize(times)
  return {"samples": times, "per_iter_s": s["median"], "min_s": s["min"], "max_s": s["max"],
          "spread_pct": s["spread_pct"], "n_inner": 1, "repeats": repeats,
          "method": "single call"}


def time_forward(model, batch: int, t: int, fill: int, capacity: int, repeats: int = 0,
                 single_call: bool = False, tokens=None, call_only: bool = False):
  """Seconds per forward of `model` over t new tokens per row at cache fill `fill`."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from spec_jax.models.transformer import KVCache
  if fill + t > capacity:
    raise ValueError(f"fill {fill} + T {t} exceeds the capacity {capacity}")
  config = model.config
  fn = _forward_loop_fn(config)
  if tokens is None:
    tokens = np.random.default_rng(0).integers(3, config.vocab_size, size=(batch, t))
  state = {"tokens": jnp.asarray(tokens, jnp.int32).reshape(batch, t),
           "cache": KVCache.zeros(config, batch, capacity)}
  offsets = jnp.full((batch,), fill, jnp.int32)

  def call(n):
    toks, cache = fn(model.params, state["tokens"], state["cache"], offsets, jnp.int32(n))
    jax.block_until_ready(toks)
    state["cache"] = cache
  if call_only:
    return call
  return _time_calls(call, repeats, single_call=single_call)


def _text_like_buffer(batch: int, capacity: int, vocab: int):
  """[B, capacity] int32 tokens repeating a random 32-token phrase, so n-grams do match."""
  import numpy as np
  base = np.random.default_rng(0).integers(3, vocab, size=(batch, 32))
  reps = -(-capacity // 32)
  return np.tile(base, (1, reps))[:, :capacity].astype(np.int32)


def time_propose(drafter, target, batch: int, k: int, fill: int, capacity: int, repeats: int = 0,
                 temperature: float = 0.0, call_only: bool = False):
  """Seconds per jitted drafter.propose() of K tokens (the whole draft of one round, sampling
  of q included) on a [B, capacity] buffer with `fill` committed tokens per row."""
  import jax
  import jax.numpy as jnp
  import spec_jax as sj
  fn = _propose_loop_fn(drafter, k)
  tokens = jnp.asarray(_text_like_buffer(batch, capacity, target.config.vocab_size))
  lengths = jnp.full((batch,), fill, jnp.int32)
  sampling = sj.Sampling(temperature=temperature).as_arrays(batch)
  st = {"state": _initial_drafter_state(drafter, target, tokens, fill, sampling)}
  key = jax.random.key(0)

  def call(n):
    toks, st["state"] = fn(drafter.params, st["state"], tokens, lengths, key, sampling,
                           target.params, jnp.int32(n))
    jax.block_until_ready(toks)
  if call_only:
    return call
  return _time_calls(call, repeats)


def _verify_loop_fn(config):
  """jit(params, tokens [B,T], cache, offsets, sampling, n): n engine verify_steps (target
  forward + sampling.probs over the T positions), argmax fed back."""
  key = ("verify", config)
  if key not in _FN_CACHE:
    import jax
    import jax.numpy as jnp
    from spec_jax import engine

    def run(params, tokens, cache, offsets, sampling, n):
      params = _as_engine_prepares(params)

      def body(_, carry):
        toks, c = carry
        probs, out = engine.verify_step(params, config, c, toks[:, 0], toks[:, 1:], offsets + 1,
                                        sampling)
        return jnp.argmax(probs, axis=-1).astype(jnp.int32), out.cache
      return jax.lax.fori_loop(0, n, body, (tokens, cache))

    _FN_CACHE[key] = jax.jit(run, donate_argnums=(2,))
  return _FN_CACHE[key]


def time_verify_step(model, batch: int, t: int, fill: int, capacity: int, repeats: int,
                     temperature: float) -> dict:
  """Seconds per engine.verify_step over t tokens (forward + the probs transform)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import spec_jax as sj
  from spec_jax.models.transformer import KVCache
  fn = _verify_loop_fn(model.config)
  sampling = sj.Sampling(temperature=temperature).as_arrays(batch)
  toks = jnp.asarray(np.random.default_rng(0).integers(3, model.config.vocab_size,
                                                       size=(batch, t)), jnp.int32)
  st = {"cache": KVCache.zeros(model.config, batch, capacity)}
  offsets = jnp.full((batch,), fill, jnp.int32)

  def call(n):
    out, st["cache"] = fn(model.params, toks, st["cache"], offsets, sampling, jnp.int32(n))
    jax.block_until_ready(out)
  return _time_calls(call, repeats)


def time_accept(batch: int, k: int, vocab: int, with_draft_probs: bool, temperature: float,
                repeats: int) -> dict:
  """Seconds per engine.accept_step (rejection sampling of K drafts, [B,K+1,V] target probs)."""
  import jax
  import jax.numpy as jnp
  import spec_jax as sj
  from spec_jax import engine
  key = ("accept", k, with_draft_probs)
  if key not in _FN_CACHE:
    def run(rng, drafts, q, p, n):
      def body(i, carry):
        d, acc = carry
        emitted, n_acc = engine.accept_step(jax.random.fold_in(rng, i), d, q, p,
                                            jnp.full((d.shape[0],), k, jnp.int32))
        d = (d + jnp.maximum(emitted[:, :k], 0) + n_acc[:, None]) % vocab
        return d, acc + jnp.sum(emitted) + jnp.sum(n_acc)
      return jax.lax.fori_loop(0, n, body, (drafts, jnp.int32(0)))
    _FN_CACHE[key] = jax.jit(run)
  fn = _FN_CACHE[key]
  r = jax.random.key(1)
  s = sj.Sampling(temperature=temperature)
  p = sj.sampling.probs(jax.random.normal(r, (batch, k + 1, vocab)) * 3, s)
  q = sj.sampling.probs(jax.random.normal(jax.random.key(2), (batch, k, vocab)) * 3, s) \
      if with_draft_probs else None
  drafts = jax.random.randint(jax.random.key(3), (batch, k), 0, vocab, jnp.int32)
  return _time_calls(lambda n: jax.block_until_ready(fn(r, drafts, q, p, jnp.int32(n))),
                     repeats)


# ============================================================================ spec suite

@dataclasses.dataclass
class CellResult:
  stats: list
  tokens_per_s: list


def run_generate(target, prompts, drafter, k: int, max_new: int, temperature: float, seed: int):
  import jax
  import spec_jax as sj
  out = sj.generate(target, prompts, drafter=drafter, num_draft=k if drafter is not None else 4,
                    max_new_tokens=max_new, sampling=sj.Sampling(temperature=temperature),
                    key=jax.random.key(seed), stop_tokens=[])
  counts = {len(t) for t in out.tokens}
  if counts != {max_new}:
    raise RuntimeError(f"expected exactly {max_new} new tokens per row with stop_tokens=[], got "
                       f"{sorted(counts)}")
  return out


def _engine_capacity(longest: int, max_new: int, k: int) -> int:
  from spec_jax import engine
  return engine._round_up(longest + max_new + k + 1, engine.CAPACITY_BUCKET)


def alpha_per_verified_token(stats) -> Optional[float]:
  """accepted / (accepted + rejections): the per-token acceptance of the i.i.d. model
  tau = (1 - a^(K+1)) / (1 - a). SpecStats.acceptance_rate divides by every drafted token,
  including the drafts after a round's first rejection that were never judged, so it equals
  (tau - 1) / K and falls with K. Exact only when every round drafted all K tokens (a draft
  model); None otherwise (an n-gram round may draft fewer)."""
  k, rounds = stats.num_draft, stats.rounds
  if k == 0 or rounds == 0 or stats.drafted != rounds * k:
    return None
  rejections = rounds * (1.0 - stats.accepted_at[k - 1])
  judged = stats.accepted + rejections
  return stats.accepted / judged if judged else None


def bound_of(tau: float, k: int, c_draft: float, c_verify: float) -> float:
  return tau / (k * c_draft + c_verify)


def run_spec_suite(opts, checkpoint=None, previous=None) -> dict:
  """The spec suite. checkpoint(partial_result) is called after every finished cell (target,
  batch, temperature); cells found in `previous` (a partial result of the same options, see
  --resume) are taken from it instead of being measured again."""
  import numpy as np
  pairs = parse_pairs(opts.pairs)
  ks = sorted(set(int(k) for k in opts.num_draft))
  if any(k < 1 for k in ks):
    raise ValueError(f"--num-draft values must be >= 1 (K=0, plain decoding, is always run), "
                     f"got {ks}")
  batches = sorted(set(int(b) for b in opts.batch))
  temps = [float(t) for t in opts.temperatures]
  by_target: dict = {}
  for t, d in pairs:
    by_target.setdefault(t, []).append(d)

  rows, baselines, notes = [], [], []
  done = set()
  if previous:
    rows = list(previous.get("rows", []))
    baselines = list(previous.get("baselines", []))
    notes = list(previous.get("notes", []))
    done = {(b["target"], b["batch"], b["temperature"]) for b in baselines}
    log(f"[bench] resuming: {len(done)} cells taken from the previous partial run")

  def partial():
    return {"suite": "spec", "rows": rows, "baselines": baselines,
            "verdicts": make_verdicts(rows, baselines), "notes": notes,
            "definitions": SPEC_DEFINITIONS}

  for target_spec, drafter_specs in by_target.items():
    if all((model_label(target_spec), b, t) in done for b in batches for t in temps):
      continue
    log(f"[bench] loading target {target_spec}")
    target = load_model(target_spec, opts.seed)
    drafters = {d: make_drafter(d, target, opts.seed) for d in drafter_specs}
    for dspec, dr in drafters.items():
      cap = getattr(dr, "max_draft", None)
      if cap is not None and max(ks) > cap:
        raise ValueError(f"drafter {dspec} proposes at most {cap} tokens per round; drop the "
                         f"K values above {cap} from --num-draft (got {ks})")
    ids, texts = prompt_token_lists(target, opts.prompts, max(batches), opts.prompt_words,
                                    opts.max_prompt_tokens, opts.seed)
    context = target.config.max_position_embeddings
    for d in drafters.values():
      dm = draft_model_of(d)
      if dm is not None:
        context = min(context, dm.config.max_position_embeddings)
    longest = max(len(r) for r in ids)
    max_new = min(int(opts.max_new_tokens), context - longest - 1)
    if max_new < int(opts.max_new_tokens) and not any(
        n.startswith(model_label(target_spec) + ": max_new_tokens") for n in notes):
      notes.append(f"{model_label(target_spec)}: max_new_tokens capped from "
                   f"{opts.max_new_tokens} to {max_new} by the context of {context} positions "
                   f"(longest prompt {longest} tokens)")
      log("[bench] note: " + notes[-1])
    if max_new < 1:
      raise ValueError(f"prompts of {longest} tokens leave no room in a context of {context}")
    fill = longest + max_new // 2
    cost_capacity = _engine_capacity(longest, max_new, max(ks))
    configs = [("none", 0)] + [(d, k) for d in drafter_specs for k in ks]
    cost_cache: dict = {}

    for batch in batches:
      if all((model_label(target_spec), batch, t) in done for t in temps):
        continue
      prompts = ids[:batch]
      lb = max(len(r) for r in prompts)
      # ----- cost ratios (independent of temperature) for this batch
      log(f"[bench] {model_label(target_spec)} B={batch}: timing cost ratios "
          f"(fill {fill}, capacity {cost_capacity})")
      calls = {"t1": time_forward(target, batch, 1, fill, cost_capacity, call_only=True)}
      for k in ks:
        calls[("verify", k)] = time_forward(target, batch, k + 1, fill, cost_capacity,
                                            call_only=True)
      for dspec, dr in drafters.items():
        if draft_model_of(dr) is not None:
          calls[("draft_fwd", dspec)] = time_forward(draft_model_of(dr), batch, 1, fill,
                                                     cost_capacity, call_only=True)
        for k in ks:
          # The whole propose() of a round (draft model: 2-token first step, K-1 more, the
          # sampling of q at temperature 1; n-gram: the search).
          calls[("propose", dspec, k)] = time_propose(
              dr, target, batch, k, fill, cost_capacity,
              temperature=1.0 if draft_model_of(dr) is not None else 0.0, call_only=True)
      timed = time_interleaved(calls, opts.cost_repeats)
      t1 = timed["t1"]
      tv = {k: timed[("verify", k)] for k in ks}
      td = {}
      for dspec, dr in drafters.items():
        td[dspec] = {}
        for k in ks:
          prop = timed[("propose", dspec, k)]
          if draft_model_of(dr) is not None:
            one = timed[("draft_fwd", dspec)]
            td[dspec][k] = {"per_round_s": k * one["per_iter_s"],
                            "c_draft": ratio_of(one, t1), "propose_s": prop["per_iter_s"],
                            "c_propose": ratio_of(prop, t1, k)}
          else:
            td[dspec][k] = {"per_round_s": prop["per_iter_s"],
                            "c_draft": ratio_of(prop, t1, k), "propose_s": prop["per_iter_s"],
                            "c_propose": ratio_of(prop, t1, k)}
      cost_cache[batch] = (t1, tv, td)

      for temp in temps:
        if (model_label(target_spec), batch, temp) in done:
          continue
        cell = f"{model_label(target_spec)} B={batch} T={temp:g}"
        log(f"[bench] {cell}: warm-up (compiles {len(configs)} configurations)")
        for dspec, k in configs:
          t0 = time.perf_counter()
          run_generate(target, prompts, drafters.get(dspec), k, max_new, temp, opts.seed)
          log(f"[bench]   warm {drafter_label(dspec)} K={k}: {time.perf_counter() - t0:.1f} s")
        results = {c: CellResult([], []) for c in configs}
        for rep in range(opts.repeats):
          order = [configs[0]] + configs[1:] + [configs[0]]
          for c in order:
            out = run_generate(target, prompts, drafters.get(c[0]), c[1], max_new, temp,
                               opts.seed)
            results[c].stats.append(out.stats)
            results[c].tokens_per_s.append(out.stats.tokens_per_second)
          plain = results[configs[0]].tokens_per_s
          log(f"[bench] {cell}: round {rep + 1}/{opts.repeats}: plain "
              f"{plain[-2]:.0f}/{plain[-1]:.0f} tok/s; " + ", ".join(
                  f"{drafter_label(c[0])} K={c[1]} {results[c].tokens_per_s[-1]:.0f}"
                  for c in configs[1:]))
        base = summarize(results[configs[0]].tokens_per_s)
        baselines.append({"target": model_label(target_spec), "batch": batch,
                          "temperature": temp, "tokens_per_s": base,
                          "noise_pct": base["spread_pct"]})
        for dspec, k in configs:
          res = results[(dspec, k)]
          tps = summarize(res.tokens_per_s)
          alphas = [s.acceptance_rate for s in res.stats]
          taus = [s.mean_accepted_length for s in res.stats]
          tau = float(np.mean(taus))
          tok_alphas = [alpha_per_verified_token(s) for s in res.stats]
          alpha_token = (None if k == 0 or any(a is None for a in tok_alphas)
                         else float(np.mean(tok_alphas)))
          if k == 0:
            c_draft, c_verify, alpha = 0.0, 1.0, None
            t_draft = t_propose = 0.0
            c_propose = 0.0
          else:
            c_verify = ratio_of(tv[k], t1)          # median over rounds of per-round ratios
            cv_rounds = [a / b for a, b in zip(tv[k]["samples"], t1["samples"])]
            t_draft = td[dspec][k]["per_round_s"]
            c_draft = td[dspec][k]["c_draft"]
            t_propose = td[dspec][k]["propose_s"]
            c_propose = td[dspec][k]["c_propose"]
            alpha = float(np.mean(alphas))
          bound = bound_of(tau, k, c_draft, c_verify)
          speedup = tps["median"] / base["median"] if k else 1.0
          last = res.stats[-1]
          rows.append({
              "target": model_label(target_spec), "target_spec": target_spec,
              "target_params": target.config.num_params,
              "drafter": drafter_label(dspec), "drafter_spec": dspec, "K": k,
              "batch": batch, "temperature": temp, "max_new_tokens": max_new,
              "new_tokens_per_run": batch * max_new, "prompt_tokens_longest": lb,
              "capacity": _engine_capacity(lb, max_new, k),
              "tokens_per_s": tps, "seconds_median": statistics.median(
                  s.seconds for s in res.stats),
              "speedup": speedup, "alpha": alpha, "tau": tau,
              "alpha_per_repeat": alphas if k else None,
              "alpha_token": alpha_token,
              "accepted_at": list(last.accepted_at), "rounds": last.rounds,
              "iterations": last.iterations,
              "c_draft": c_draft, "c_verify": c_verify, "bound": bound,
              "efficiency": speedup / bound,
              "c_verify_rounds_min_max": ([min(cv_rounds), max(cv_rounds)] if k else None),
              "t_target_1_spread_pct": t1["spread_pct"],
              "c_draft_propose": c_propose,
              "bound_propose": bound_of(tau, k, c_propose, c_verify),
              "t_propose_ms": 1e3 * t_propose,
              "t_target_1_ms": 1e3 * t1["per_iter_s"],
              "t_verify_ms": 1e3 * (tv[k]["per_iter_s"] if k else t1["per_iter_s"]),
              "t_draft_round_ms": 1e3 * t_draft,
              "cost_fill": fill, "cost_capacity": cost_capacity,
              "noise_pct": base["spread_pct"],
          })
        if checkpoint is not None:
          checkpoint(partial())
    # Bound the memory of a long run: drop this target's compiled executables (generate()'s
    # AOT cache and the cost-timing functions) before the next target.
    from spec_jax import engine
    import jax
    getattr(engine, "_COMPILED", {}).clear()
    _FN_CACHE.clear()
    jax.clear_caches()
  return partial()


def make_verdicts(rows, baselines) -> list:
  """Per (target, drafter, temperature): the best K at every batch and how it compares with
  plain decoding there. 'within noise' when |speedup - 1| is under half the plain baseline's
  spread (max-min)/median in that cell."""
  noise = {(b["target"], b["batch"], b["temperature"]): b["noise_pct"] for b in baselines}
  groups: dict = {}
  for r in rows:
    if r["K"] == 0:
      continue
    groups.setdefault((r["target"], r["drafter"], r["temperature"]), {}).setdefault(
        r["batch"], []).append(r)
  out = []
  for (target, drafter, temp), per_batch in groups.items():
    parts = []
    for batch in sorted(per_batch):
      best = max(per_batch[batch], key=lambda r: r["speedup"])
      nz = noise.get((target, batch, temp), 0.0)
      s = best["speedup"]
      within = abs(s - 1.0) * 100 <= nz / 2
      judgement = ("beats plain" if s > 1 else "LOSES to plain") + (", within noise" if within
                                                                    else "")
      parts.append({"batch": batch, "best_K": best["K"], "speedup": s, "beats_plain": s > 1.0,
                    "clear": not within, "noise_pct": nz, "judgement": judgement})
    out.append({"target": target, "drafter": drafter, "temperature": temp, "per_batch": parts,
                "beats_plain_at_batches": [p["batch"] for p in parts if p["beats_plain"]],
                "clearly_beats_plain_at_batches": [p["batch"] for p in parts
                                                   if p["beats_plain"] and p["clear"]]})
  return out


# ============================================================================ breakdown suite

def run_breakdown_suite(opts) -> dict:
  """Where a speculative round's time goes, per (target, drafter, K, batch, temperature).

  t_round = (seconds of generate(max_new) - seconds of generate(max_new=1), same compiled
  executable) / loop iterations: the engine's real per-round time, prefill excluded. It is set
  against the pieces timed alone in jitted fori_loops at the run's batch, fill and capacity:
  propose (the whole draft of one round), verify_step (target forward over K+1 + probs),
  accept_step (rejection sampling) and the bare target forwards over 1 and K+1 tokens. `other`
  = t_round - propose - verify_step - accept: commit, drafter.commit, loop bookkeeping and
  whatever the fusion of the whole loop body costs or saves.
  """
  import numpy as np
  pairs = parse_pairs(opts.pairs)
  ks = sorted(set(int(k) for k in opts.num_draft))
  batches = sorted(set(int(b) for b in opts.batch))
  temps = [float(t) for t in opts.temperatures]
  by_target: dict = {}
  for t, d in pairs:
    by_target.setdefault(t, []).append(d)
  rows, notes = [], []
  reps = max(opts.repeats, 3)
  for target_spec, drafter_specs in by_target.items():
    target = load_model(target_spec, opts.seed)
    drafters = {d: make_drafter(d, target, opts.seed) for d in drafter_specs}
    for dspec, dr in drafters.items():
      cap = getattr(dr, "max_draft", None)
      if cap is not None and max(ks) > cap:
        raise ValueError(f"drafter {dspec} proposes at most {cap} tokens per round; drop the "
                         f"K values above {cap} from --num-draft (got {ks})")
    ids, _ = prompt_token_lists(target, opts.prompts, max(batches), opts.prompt_words,
                                opts.max_prompt_tokens, opts.seed)
    context = min([target.config.max_position_embeddings] + [
        draft_model_of(d).config.max_position_embeddings for d in drafters.values()
        if draft_model_of(d) is not None])
    longest = max(len(r) for r in ids)
    max_new = min(int(opts.max_new_tokens), context - longest - 1)
    fill = longest + max_new // 2
    for batch in batches:
      prompts = ids[:batch]
      for temp in temps:
        def engine_round(dspec, k):
          import jax
          import spec_jax as sj
          cap = _engine_capacity(max(len(r) for r in prompts), max_new, k)
          dr = drafters.get(dspec)
          kw = dict(drafter=dr, num_draft=k if dr is not None else 4,
                    sampling=sj.Sampling(temperature=temp), key=jax.random.key(opts.seed),
                    stop_tokens=[], capacity=cap)
          sj.generate(target, prompts, max_new_tokens=max_new, **kw)      # warm-up
          sj.generate(target, prompts, max_new_tokens=1, **kw)
          full, pre, iters, stats = [], [], 0, None
          for _ in range(reps):                                           # interleaved
            o = sj.generate(target, prompts, max_new_tokens=max_new, **kw).stats
            full.append(o.seconds)
            pre.append(sj.generate(target, prompts, max_new_tokens=1, **kw).stats.seconds)
            iters, stats = o.iterations, o
          t_round = (statistics.median(full) - statistics.median(pre)) / iters
          return t_round, statistics.median(pre), iters, stats, cap

        log(f"[bench] breakdown {model_label(target_spec)} B={batch} T={temp:g}: plain")
        plain_round, plain_pre, plain_iters, _, cap0 = engine_round("none", 0)
        t1 = time_forward(target, batch, 1, fill, cap0, opts.cost_repeats)["per_iter_s"]
        v1 = time_verify_step(target, batch, 1, fill, cap0, opts.cost_repeats, temp)["per_iter_s"]
        a0 = time_accept(batch, 0, target.config.vocab_size, False, temp,
                         opts.cost_repeats)["per_iter_s"]
        rows.append({"target": model_label(target_spec), "drafter": "none", "K": 0,
                     "batch": batch, "temperature": temp, "max_new_tokens": max_new,
                     "capacity": cap0, "fill": fill, "iterations": plain_iters, "tau": 1.0,
                     "t_round_ms": 1e3 * plain_round, "t_prefill_ms": 1e3 * plain_pre,
                     "t_fwd_1_ms": 1e3 * t1, "t_fwd_k1_ms": 1e3 * t1,
                     "t_propose_ms": 0.0, "t_draft_fwd_ms": 0.0, "t_verify_step_ms": 1e3 * v1,
                     "t_accept_ms": 1e3 * a0,
                     "t_other_ms": 1e3 * (plain_round - v1 - a0)})
        for dspec, dr in drafters.items():
          for k in ks:
            log(f"[bench] breakdown {model_label(target_spec)} B={batch} T={temp:g}: "
                f"{drafter_label(dspec)} K={k}")
            t_round, t_pre, iters, stats, cap = engine_round(dspec, k)
            tk = time_forward(target, batch, k + 1, fill, cap, opts.cost_repeats)["per_iter_s"]
            t1k = time_forward(target, batch, 1, fill, cap, opts.cost_repeats)["per_iter_s"]
            vk = time_verify_step(target, batch, k + 1, fill, cap, opts.cost_repeats,
                                  temp)["per_iter_s"]
            pr = time_propose(dr, target, batch, k, fill, cap, opts.cost_repeats,
                              temp)["per_iter_s"]
            dm = draft_model_of(dr)
            dfwd = (time_forward(dm, batch, 1, fill, cap, opts.cost_repeats)["per_iter_s"]
                    if dm is not None else pr / k)
            stochastic_q = dm is not None and not getattr(dr, "greedy_drafts", False)
            ak = time_accept(batch, k, target.config.vocab_size, stochastic_q, temp,
                             opts.cost_repeats)["per_iter_s"]
            tau = stats.mean_accepted_length
            speed_loop = tau * plain_round / t_round
            bound = tau / ((k * dfwd + tk) / t1k)
            rows.append({
                "target": model_label(target_spec), "drafter": drafter_label(dspec), "K": k,
                "batch": batch, "temperature": temp, "max_new_tokens": max_new,
                "capacity": cap, "fill": fill, "iterations": iters, "tau": tau,
                "alpha": stats.acceptance_rate,
                "t_round_ms": 1e3 * t_round, "t_prefill_ms": 1e3 * t_pre,
                "t_fwd_1_ms": 1e3 * t1k, "t_fwd_k1_ms": 1e3 * tk,
                "t_propose_ms": 1e3 * pr, "t_draft_fwd_ms": 1e3 * dfwd,
                "t_verify_step_ms": 1e3 * vk, "t_accept_ms": 1e3 * ak,
                "t_other_ms": 1e3 * (t_round - pr - vk - ak),
                "plain_round_ms": 1e3 * plain_round,
                "speedup_loop": speed_loop, "bound": bound,
                "efficiency_loop": speed_loop / bound,
                # efficiency = [(K t_draft + t_verify) / t_round] * [t_plain_round / t_fwd_1]
                "eff_spec_overhead_factor": (k * dfwd + tk) / t_round,
                "eff_plain_overhead_factor": plain_round / t1k,
            })
  return {"suite": "breakdown", "rows": rows, "notes": notes,
          "definitions": {"t_round_ms": "engine time per loop iteration, prefill excluded",
                          "speedup_loop": "tau * t_round(plain) / t_round(spec): the decode-loop "
                                          "speedup, prefill excluded",
                          "efficiency_loop": "speedup_loop / bound = eff_spec_overhead_factor * "
                                             "eff_plain_overhead_factor",
                          "t_other_ms": "t_round - t_propose - t_verify_step - t_accept"}}


def format_breakdown(result: dict) -> str:
  table = []
  for r in result["rows"]:
    table.append([r["target"], r["drafter"], f"{r['temperature']:g}", r["batch"], r["K"],
                  f"{r['tau']:.2f}", f"{r['t_round_ms']:.3f}", f"{r['t_fwd_1_ms']:.3f}",
                  f"{r['t_fwd_k1_ms']:.3f}", f"{r['t_verify_step_ms']:.3f}",
                  f"{r['t_draft_fwd_ms']:.3f}", f"{r['t_propose_ms']:.3f}",
                  f"{r['t_accept_ms']:.3f}", f"{r['t_other_ms']:.3f}",
                  _fmt(r.get("speedup_loop")), _fmt(r.get("bound")),
                  "-" if "efficiency_loop" not in r else f"{100 * r['efficiency_loop']:.0f}%"])
  out = [_table(["target", "drafter", "T", "B", "K", "tau", "round", "fwd(1)", "fwd(K+1)",
                 "verify", "draft fwd", "propose", "accept", "other", "speedup", "bound", "eff"],
                table)]
  out.append("")
  out.append("legend (ms per round): round = engine loop time per iteration (prefill excluded); "
             "fwd(1), fwd(K+1) = bare target forwards; verify = engine.verify_step (forward over "
             "K+1 + probs); draft fwd = one 1-token draft-model forward (ngram: propose/K); "
             "propose = the drafter's whole propose() of one round; accept = engine.accept_step; "
             "other = round - propose - verify - accept. speedup = tau * round(plain) / round; "
             "bound = tau / ((K draft fwd + fwd(K+1)) / fwd(1)); eff = speedup / bound.")
  return "\n".join(out)


# ============================================================================ plain suite

def hf_model_from(model, spec: str):
  """A transformers LlamaForCausalLM with exactly `model`'s weights (HF folders load directly)."""
  import numpy as np
  import torch
  import transformers
  path = None if spec.startswith("random:") else resolve_path(spec)
  if path is not None and path.is_dir() and (path / "config.json").is_file():
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32).eval()
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
  import jax
  import numpy as np
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
      match = ours.tokens == theirs
      first_diff = None
      if not match:
        for b in range(batch):
          for i, (a, c) in enumerate(zip(ours.tokens[b], theirs[b])):
            if a != c:
              first_diff = (b, i) if first_diff is None or i < first_diff[1] else first_diff
              break
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
      single = {t: [] for t in ts}        # single jitted calls, also round-robin
      for _ in range(opts.cost_repeats):
        for t in ts:
          t0 = time.perf_counter()
          calls[t](1)
          single[t].append(time.perf_counter() - t0)
      single = {t: dict(summarize(v), samples=v) for t, v in single.items()}
      for t in ts:
        c = ratio_of(loop[t], loop[1])
        c_call = ratio_of(single[t], single[1])
        cost_rows.append({"model": label, "params": n_params, "batch": 1, "fill": fill,
                          "capacity": capacity, "T": t, "t_ms": 1e3 * loop[t]["per_iter_s"],
                          "t_spread_pct": loop[t]["spread_pct"], "n_inner": loop[t]["n_inner"],
                          "c": c, "t_call_ms": 1e3 * single[t]["median"],
                          "t_call_spread_pct": single[t]["spread_pct"], "c_call": c_call,
                          "note": note})
        log(f"[bench] cost {label} F={fill} T={t}: {cost_rows[-1]['t_ms']:.3f} ms (c={c:.2f}), "
            f"single call {cost_rows[-1]['t_call_ms']:.3f} ms (c_call={c_call:.2f})")
    del model
    jax.clear_caches()
    _FN_CACHE.clear()
  return {"suite": "plain", "generate": gen_rows, "cost": cost_rows, "notes": notes,
          "definitions": PLAIN_DEFINITIONS}


# ============================================================================ printing

def _fmt(x, nd=2, none="-"):
  if x is None:
    return none
  return f"{x:.{nd}f}"


def _table(headers, rows) -> str:
  widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
            for i, h in enumerate(headers)]
  line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))
  return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def format_spec(result: dict) -> str:
  rows = sorted(result["rows"], key=lambda r: (r["target"], r["temperature"], r["batch"],
                                               r["K"] > 0, r["drafter"], r["K"]))
  table = []
  for r in rows:
    t = r["tokens_per_s"]
    flag = "" if r["K"] == 0 else ("LOSS" if r["speedup"] < 1 else "")
    table.append([r["target"], r["drafter"], f"{r['temperature']:g}", r["batch"], r["K"],
                  f"{t['median']:.0f}", f"{t['min']:.0f}-{t['max']:.0f}",
                  f"{r['speedup']:.2f}x", flag, _fmt(r["alpha"]), _fmt(r.get("alpha_token")),
                  _fmt(r["tau"]),
                  _fmt(r["c_draft"], 3), _fmt(r["c_verify"]), _fmt(r["bound"]),
                  f"{100 * r['efficiency']:.0f}%"])
  out = [_table(["target", "drafter", "T", "B", "K", "tok/s", "min-max", "speedup", "",
                 "alpha", "a_tok", "tau", "c_draft", "c_verify", "bound", "eff"], table)]
  out.append("")
  out.append("legend: tok/s = new tokens (all rows) / s of one compiled generate() call (prefill + "
             "decode, compile excluded), median of repeats; min-max over repeats. Every row "
             "generates exactly max_new_tokens per prompt (stop_tokens=[]), same prompts and key.")
  out.append("  speedup = tok/s / tok/s of plain decoding (K=0, drafter none) of the SAME target, "
             "batch B and temperature T in this run (LOSS = slower than plain). alpha = accepted/"
             "drafted (SpecStats.acceptance_rate = (tau-1)/K); a_tok = accepted/(accepted + "
             "rejections), the per-token acceptance of tau = (1-a^(K+1))/(1-a) (draft models "
             "only); tau = tokens per target forward (bonus included).")
  out.append("  c_verify = t(target fwd over K+1 tokens)/t(target fwd over 1), c_draft = draft "
             "cost per round / K / t(target fwd over 1) (draft model: one 1-token draft forward; "
             "ngram, heads: (propose()+commit())/K), both at the row's batch, fill = prompt + max_new/2; "
             "bound = tau/(K*c_draft + c_verify); eff = speedup/bound.")
  noise = [b["noise_pct"] for b in result["baselines"]]
  if noise:
    out.append(f"  noise: plain-baseline spread (max-min)/median per cell: median "
               f"{statistics.median(noise):.0f}%, range {min(noise):.0f}%-{max(noise):.0f}% "
               f"over {len(noise)} cells ({result['baselines'][0]['tokens_per_s']['n']} plain "
               f"runs each, interleaved)")
  for n in result.get("notes", []):
    out.append("  note: " + n)
  out.append("")
  for v in result["verdicts"]:
    parts = []
    for p in v["per_batch"]:
      parts.append(f"B={p['batch']}: best K={p['best_K']} {p['speedup']:.2f}x "
                   f"({p['judgement']}, noise {p['noise_pct']:.0f}%)")
    clear = v.get("clearly_beats_plain_at_batches", [])
    pays = v["beats_plain_at_batches"]
    if clear:
      tail = f"speculation pays (beyond noise) at B in {clear}"
      if set(pays) - set(clear):
        tail += f"; faster but within noise at B in {sorted(set(pays) - set(clear))}"
    elif pays:
      tail = f"faster only within noise (B in {pays}): no clear win at any batch measured"
    else:
      tail = "speculation does not beat plain decoding at any batch measured"
    losses = [p["batch"] for p in v["per_batch"] if not p["beats_plain"]]
    if losses:
      tail += f"; slower than plain at B in {losses}"
    out.append(f"verdict {v['target']} + {v['drafter']} T={v['temperature']:g}: "
               + "; ".join(parts) + f" -> {tail}")
  return "\n".join(out)


def format_plain(result: dict) -> str:
  out = []
  table = []
  extra = []
  for r in result["generate"]:
    for n in r.get("hf_tokens_per_s_by_threads", {}):
      if int(n) != r["hf_threads"] and n not in extra:
        extra.append(n)
  for r in result["generate"]:
    o, h = r["ours_tokens_per_s"], r["hf_tokens_per_s"]
    cells = [r["model"], f"{r['params']:,}", r["batch"], r["prompt_tokens"],
             r["max_new_tokens"], f"{o['median']:.1f}", f"{o['min']:.1f}-{o['max']:.1f}",
             f"{h['median']:.1f}", f"{h['min']:.1f}-{h['max']:.1f}",
             f"{r['ratio_ours_over_hf']:.2f}x"]
    for n in extra:
      e = r.get("hf_tokens_per_s_by_threads", {}).get(n)
      cells += [f"{e['median']:.1f}" if e else "-", f"{e['min']:.1f}-{e['max']:.1f}" if e else "-",
                f"{o['median'] / e['median']:.2f}x" if e else "-"]
    cells.append("yes" if r["greedy_match"] else "NO")
    table.append(cells)
  thr = result["generate"][0]["hf_threads"] if result["generate"] else "?"
  out.append("plain greedy decoding: spec_jax vs transformers generate (tokens/s, all rows)")
  headers = ["model", "params", "B", "prompt", "new", "spec_jax", "min-max",
             f"hf {thr}thr", "min-max", "ours/hf"]
  for n in extra:
    headers += [f"hf {n}thr", "min-max", "ours/hf"]
  out.append(_table(headers + ["same tokens"], table))
  out.append("")
  out.append("verify cost ratio c(T) = t(forward over T new tokens at fill F) / t(forward over 1), "
             "batch 1, capacity F+16")
  models = []
  for r in result["cost"]:
    if (r["model"], r["fill"]) not in models:
      models.append((r["model"], r["fill"]))
  ts = sorted({r["T"] for r in result["cost"]})
  table = []
  for m, f in models:
    rs = {r["T"]: r for r in result["cost"] if r["model"] == m and r["fill"] == f}
    table.append([m, f, f"{rs[1]['t_ms']:.3f}"] + [f"{rs[t]['c']:.2f}" for t in ts]
                 + [f"{rs[1]['t_call_ms']:.3f}", " ".join(f"{rs[t]['c_call']:.2f}" for t in ts)])
  out.append(_table(["model", "F", "t(1) ms"] + [f"c({t})" for t in ts]
                    + ["call t(1) ms", "c_call(1..)"], table))
  out.append("")
  out.append("legend: tokens/s = new tokens / s, median of repeats (min-max), compile excluded, "
             "one warm-up; both produce exactly max_new_tokens per row (transformers: "
             "min_new_tokens = max_new_tokens, EOS disabled; spec_jax: stop_tokens=[]); "
             "'same tokens' = identical greedy tokens. c(T): t from a jitted fori_loop of forwards "
             "(cache carried in place) by differencing, (t(2n) - t(n)) / n, median of repeats; "
             "c_call: single jitted calls (dispatch and per-call work included).")
  spreads = [r["ours_tokens_per_s"]["spread_pct"] for r in result["generate"]] + \
      [r["hf_tokens_per_s"]["spread_pct"] for r in result["generate"]]
  if spreads:
    out.append(f"  noise: repeat spread (max-min)/median of tokens/s: median "
               f"{statistics.median(spreads):.0f}%, range {min(spreads):.0f}%-"
               f"{max(spreads):.0f}%")
  for n in result.get("notes", []):
    out.append("  note: " + n)
  return "\n".join(out)


# ============================================================================ CLI

def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m spec_jax.bench", description=__doc__.split("\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", help="YAML file whose keys are these flags (dashes or "
                 "underscores); flags given on the command line win")
  p.add_argument("--suite", choices=("spec", "plain", "breakdown", "all"), default="spec",
                 help="spec (default) | plain | breakdown (where a round's time goes) | all "
                 "(plain then spec)")
  p.add_argument("--pairs", nargs="+", default=["default"],
                 help="TARGET@DRAFTER ... or 'default' (%s)" % ", ".join(DEFAULT_PAIRS))
  p.add_argument("--num-draft", "-K", type=int, nargs="+", default=[1, 2, 4, 6, 8],
                 help="K values (plain K=0 is always measured)")
  p.add_argument("--batch", "-B", type=int, nargs="+", default=[1, 4, 16])
  p.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")],
                 default=[0.0, 1.0], help="comma-separated, e.g. 0,1 (0 = greedy)")
  p.add_argument("--max-new-tokens", type=int, default=128,
                 help="new tokens per row (capped by the context of target and draft model)")
  p.add_argument("--repeats", type=int, default=3, help="timed rounds per configuration")
  p.add_argument("--cost-repeats", type=int, default=20, help="timed calls per cost ratio")
  p.add_argument("--prompts", default="tinystories",
                 help=f"{' | '.join(PROMPT_SETS)} | a .txt / .jsonl / .jsonl.gz path")
  p.add_argument("--prompt-words", type=int, default=8,
                 help="words of each paragraph used as a prompt (.txt sources)")
  p.add_argument("--max-prompt-tokens", type=int, default=128)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--quick", action="store_true",
                 help="smoke run: K 2 4, batch 1 4, 32 new tokens, 2 repeats, 5 cost repeats")
  p.add_argument("--out", help="JSON output (default bench_results/bench_<suite>.json); the "
                 "spec suite rewrites it (marked partial) after every finished cell")
  p.add_argument("--resume", action="store_true",
                 help="spec suite: keep the finished cells of a partial --out file written with "
                 "the same options and measure only the rest")
  p.add_argument("--plain-models", nargs="+", default=list(DEFAULT_PLAIN_MODELS))
  p.add_argument("--plain-batch", type=int, nargs="+", default=[1, 8])
  p.add_argument("--plain-max-new-tokens", type=int, default=128)
  p.add_argument("--hf-threads", type=int, nargs="+", default=[0, 1],
                 help="torch thread counts for transformers (0 = the CPU core count); the first "
                 "is the headline, the others are extra columns")
  p.add_argument("--fills", type=int, nargs="+", default=[256, 2048])
  p.add_argument("--max-verify-tokens", type=int, default=9, help="c(T) for T = 1..this")
  return p


def _list_field(v):
  if isinstance(v, str) and "," in v:
    return [x.strip() for x in v.split(",") if x.strip()]
  return v if isinstance(v, list) else [v]


def parse_args(argv) -> argparse.Namespace:
  parser = build_parser()
  first = argparse.ArgumentParser(add_help=False)
  first.add_argument("--config")
  known, _ = first.parse_known_args(argv)
  if known.config:
    import yaml
    path = resolve_path(known.config)
    if not path.is_file():
      raise ValueError(f"config file {known.config!r} not found")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
      raise ValueError(f"{path}: expected a mapping of flag names to values")
    dests = {a.dest: a for a in parser._actions}
    defaults = {}
    for key, value in data.items():
      dest = str(key).replace("-", "_")
      if dest not in dests or dest in ("help", "config"):
        raise ValueError(f"{path}: unknown key {key!r}; allowed: "
                         f"{', '.join(sorted(d for d in dests if d not in ('help', 'config')))}")
      action = dests[dest]
      if dest == "temperatures":
        value = [float(x) for x in _list_field(value)]
      elif action.nargs == "+":
        value = _list_field(value) if dest != "pairs" else (
            value if isinstance(value, list) else [value])
        if action.type is int:
          value = [int(x) for x in value]
      elif action.type is int:
        value = int(value)
      defaults[dest] = value
    parser.set_defaults(**defaults)
  args = parser.parse_args(argv)
  if args.quick:
    for k, v in QUICK.items():
      setattr(args, k, v)
  for name in ("repeats", "cost_repeats", "max_new_tokens", "plain_max_new_tokens"):
    if getattr(args, name) < 1:
      raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
  if any(b < 1 for b in args.batch) or any(b < 1 for b in args.plain_batch):
    raise ValueError("batch sizes must be >= 1")
  if any(t < 0 for t in args.temperatures):
    raise ValueError("temperatures must be >= 0")
  return args


def options_dict(args) -> dict:
  return {k: v for k, v in vars(args).items()}


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  try:
    args = parse_args(argv)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  suites = ["plain", "spec"] if args.suite == "all" else [args.suite]
  status = 0
  for suite in suites:
    out_path = pathlib.Path(args.out) if args.out and len(suites) == 1 else (
        pathlib.Path(args.out).with_name(f"{pathlib.Path(args.out).stem}_{suite}.json")
        if args.out else ROOT / "bench_results" / f"bench_{suite}.json")
    started = time.time()
    info = machine_info()
    def checkpoint(res, suite=suite, out_path=out_path, info=info, started=started):
      res = dict(res, partial=True, schema_version=SCHEMA_VERSION, machine=info,
                 options=options_dict(args), wall_seconds=time.time() - started)
      atomic_write_json(out_path, res)

    previous = None
    if suite == "spec" and args.resume and out_path.is_file():
      old = json.loads(out_path.read_text())
      if old.get("partial") and old.get("options", {}) | {"resume": args.resume} == \
          options_dict(args) | {"resume": args.resume}:
        previous = old
      else:
        log(f"[bench] --resume: {out_path} is not a partial run of the same options; "
            "starting afresh")
    try:
      if suite == "spec":
        result = run_spec_suite(args, checkpoint=checkpoint, previous=previous)
      else:
        result = {"plain": run_plain_suite, "breakdown": run_breakdown_suite}[suite](args)
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    try:
      info["loadavg_end"] = os.getloadavg()
    except OSError:
      pass
    result.update({"schema_version": SCHEMA_VERSION, "partial": False,
                   "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                   "wall_seconds": time.time() - started, "machine": info,
                   "options": options_dict(args), "command": ["python", "-m", "spec_jax.bench"]
                   + argv})
    text = {"spec": format_spec, "plain": format_plain, "breakdown": format_breakdown}[suite](
        result)
    result["table"] = text
    atomic_write_json(out_path, result)
    print(text)
    print(f"\n[{suite} suite: {result['wall_seconds']:.0f} s; JSON written to {out_path}]")
  return status


if __name__ == "__main__":
  sys.exit(main())
