"""Training data for head distillation: the target's own continuations and/or dev text.

- generated (self-distillation): the first `prompt_tokens` tokens of dev.txt paragraphs are
  continued by the target itself with sj.generate (batched, temperatures cycled over rows).
- self_generated: an instruct target's own conversations, user turns included (the Magpie
  recipe, train.self_generate; resumable shards under cache_dir): for chat targets, whose
  drafters must never see an evaluation prompt set.
- text: dev.txt paragraphs (teacher forcing; labels are the target's soft predictions anyway).
  With `regenerate: true` each paragraph keeps its first `prompt_tokens` tokens and the target
  rewrites the rest, as many tokens as the paragraph had (or fewer, where it ends its story),
  at `temperatures` cycled over the paragraphs: the regenerated responses EAGLE and DFlash are
  trained on (the same prompts and token budget as the written text, in the target's words).

Sequences are packed into one token stream and cut into non-overlapping windows [N, T]. The
generated tokens are cached on disk (npz, written atomically) under a key that hashes the
target's fingerprint and the data config, so a restart reuses them. The held-out split is never
read here (it is for evaluation only).

Batch order is a pure function of (seed, step): a restarted run sees the same batches. On a
mesh (train.distill_heads' `mesh:`) that global batch is split over the "data" axis, and each
process places the rows its own devices hold (spec_jax.sharding.shard_rows): a process's rows
are a function of (seed, step, process), and a run resumed on another mesh or another number
of processes trains on the same global batches.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys

import jax
import numpy as np

import spec_jax as sj
from spec_jax.bench.specs import resolve_path
from train.self_generate import self_generate


def read_paragraphs(path) -> list[str]:
  """The blank-line-separated paragraphs of a text file ('../shared/...' found from any cwd,
  as the config check finds it: spec_jax.bench.specs.resolve_path)."""
  text = resolve_path(str(path)).read_text()
  return [p.strip() for p in text.split("\n\n") if p.strip()]


def data_key(fingerprint_sha: str, data_cfg: dict) -> str:
  blob = json.dumps({"target": fingerprint_sha, "data": data_cfg}, sort_keys=True)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _save_npz_atomic(path: pathlib.Path, **arrays) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + f".tmp{os.getpid()}.npz")
  np.savez(tmp, **arrays)
  os.replace(tmp, path)


def generate_sequences(target, prompts: list, gen_tokens: int, temperatures, batch: int,
                       seed: int, log=None) -> list:
  """The target's continuations of token-id prompts (prompt + new tokens per row)."""
  temps = np.asarray([temperatures[i % len(temperatures)] for i in range(len(prompts))],
                     np.float32)
  out = []
  for start in range(0, len(prompts), batch):
    rows = prompts[start:start + batch]
    t = temps[start:start + batch]
    if len(rows) < batch:  # keep one compiled shape: pad with repeats, drop them after
      pad = batch - len(rows)
      rows = rows + [rows[0]] * pad
      t = np.concatenate([t, np.full((pad,), t[0], np.float32)])
    res = sj.generate(target, rows, max_new_tokens=gen_tokens, sampling=sj.Sampling(t),
                      key=jax.random.fold_in(jax.random.key(seed), start))
    n = min(batch, len(prompts) - start)
    out += [list(p) + list(new) for p, new in zip(rows[:n], res.tokens[:n])]
    if log:
      log(f"generated {start + n}/{len(prompts)} continuations")
  return out


def regenerate_responses(target, seqs: list, prompt_tokens: int, temperatures, batch: int,
                         seed: int, log=None) -> list:
  """Each sequence's first prompt_tokens tokens, then the target's own continuation of them
  for as many tokens as the sequence had after them (cut at the target's end of text).

  Sequences no longer than the prompt are kept as they are. Rows are generated longest first
  in batches of `batch`, each batch to its longest response rounded up to 32 tokens (few
  compiled shapes), temperatures cycled over the sequences in their given order."""
  temps = [float(temperatures[i % len(temperatures)]) for i in range(len(seqs))]
  out = [list(s) for s in seqs]
  todo = sorted((i for i, s in enumerate(seqs) if len(s) > prompt_tokens),
                key=lambda i: -len(seqs[i]))
  for start in range(0, len(todo), batch):
    idx = todo[start:start + batch]
    rows = [list(seqs[i][:prompt_tokens]) for i in idx]
    t = [temps[i] for i in idx]
    want = [len(seqs[i]) - prompt_tokens for i in idx]
    pad = batch - len(rows)
    rows, t = rows + [rows[0]] * pad, t + [t[0]] * pad
    new = -(-max(want) // 32) * 32
    res = sj.generate(target, rows, max_new_tokens=new,
                      sampling=sj.Sampling(np.asarray(t, np.float32)),
                      key=jax.random.fold_in(jax.random.key(seed), start))
    for j, i in enumerate(idx):
      out[i] = rows[j] + list(res.tokens[j][:want[j]])
    if log:
      log(f"regenerated {min(start + batch, len(todo))}/{len(todo)} responses")
  return out


def _cached(path: pathlib.Path, make, log, what: str) -> list:
  """The token sequences cached at `path` (npz: tokens + offsets), or make() them and cache."""
  if path.is_file():
    z = np.load(path)
    tokens, offsets = z["tokens"], z["offsets"]
    seqs = [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    log(f"data: {len(seqs)} cached {what} from {path}")
    return seqs
  seqs = make()
  offsets = np.cumsum([0] + [len(s) for s in seqs])
  _save_npz_atomic(path, tokens=np.concatenate([np.asarray(s, np.int32) for s in seqs]),
                   offsets=offsets)
  log(f"data: {len(seqs)} {what} cached in {path}")
  return seqs


def pack_windows(seqs: list, window: int) -> np.ndarray:
  stream = np.concatenate([np.asarray(s, np.int32) for s in seqs])
  n = len(stream) // window
  if n == 0:
    raise ValueError(f"only {len(stream)} training tokens: fewer than one window of {window}")
  return stream[:n * window].reshape(n, window)


def build_windows(target, data_cfg: dict, fingerprint_sha: str, seed: int,
                  log=lambda m: print(m, file=sys.stderr)) -> np.ndarray:
  """int32 [N, window] training windows (cached for the generated source)."""
  if target.tokenizer is None:
    raise ValueError("training data is text: the target needs a tokenizer")
  seqs = []
  if "self_generated" in data_cfg["sources"]:
    knobs = dict(data_cfg["self_generate"])
    conversations = knobs.pop("conversations")
    # The shard directory's key leaves `conversations` out: asking for more extends it. An
    # unset answer_temperature or system_prompts (added later) is left out too, so earlier
    # caches keep their key.
    unset = {"answer_temperature": None, "system_prompts": []}
    key_knobs = {k: v for k, v in knobs.items() if not (k in unset and v == unset[k])}
    out = pathlib.Path(data_cfg["cache_dir"]) / \
        f"selfgen_{data_key(fingerprint_sha, dict(key_knobs, seed=seed))}"
    seqs += self_generate(target, conversations, out, seed=seed, log=log, **knobs)
    if data_cfg["sources"] == ["self_generated"]:
      return _windows(seqs, data_cfg, log)
  paragraphs = read_paragraphs(data_cfg["dev_path"])
  if "generated" in data_cfg["sources"]:
    gen_cfg = {k: data_cfg[k] for k in ("dev_path", "num_prompts", "prompt_tokens", "gen_tokens",
                                        "temperatures", "gen_batch")}
    gen_cfg["seed"] = seed
    if data_cfg.get("gen_temperatures") is not None:
      gen_cfg["temperatures"] = list(data_cfg["gen_temperatures"])
    key = data_key(fingerprint_sha, gen_cfg)
    path = pathlib.Path(data_cfg["cache_dir"]) / f"generated_{key}.npz"

    def make():
      prompts = [target.encode(p)[:data_cfg["prompt_tokens"]]
                 for p in paragraphs[:data_cfg["num_prompts"]]]
      return generate_sequences(target, prompts, data_cfg["gen_tokens"],
                                gen_cfg["temperatures"], data_cfg["gen_batch"], seed, log)

    gen = _cached(path, make, log, "continuations")
    seqs += gen
  if "text" in data_cfg["sources"]:
    n = data_cfg["text_paragraphs"] or len(paragraphs)
    text = [target.encode(p) for p in paragraphs[:n]]
    if data_cfg.get("regenerate"):
      regen_cfg = {k: data_cfg[k] for k in ("dev_path", "text_paragraphs", "prompt_tokens",
                                            "temperatures", "gen_batch")}
      regen_cfg.update(seed=seed, regenerate=True)
      path = pathlib.Path(data_cfg["cache_dir"]) / \
          f"regenerated_{data_key(fingerprint_sha, regen_cfg)}.npz"
      text = _cached(path, lambda: regenerate_responses(
          target, text, data_cfg["prompt_tokens"], list(data_cfg["temperatures"]),
          data_cfg["gen_batch"], seed, log), log, "regenerated paragraphs")
    seqs += text
  return _windows(seqs, data_cfg, log)


def _windows(seqs, data_cfg, log) -> np.ndarray:
  windows = pack_windows(seqs, data_cfg["window"])
  log(f"data: {windows.shape[0]} windows of {windows.shape[1]} tokens "
      f"({windows.size} tokens)")
  return windows


def batch_indices(num_windows: int, batch_size: int, seed: int, step: int) -> np.ndarray:
  """Row indices of step `step`'s batch: a function of (seed, step) only. Each epoch is a
  fresh permutation of the windows, of which the first (num_windows // batch_size) *
  batch_size are used: each window at most once per epoch, the few left over (fewer than one
  batch) skipped that epoch and not the next. With fewer windows than one batch, rows are drawn
  with replacement."""
  per_epoch = max(num_windows // batch_size, 1)
  epoch, within = divmod(step, per_epoch)
  perm = np.random.default_rng([seed, epoch]).permutation(num_windows)
  idx = perm[within * batch_size:(within + 1) * batch_size]
  if len(idx) < batch_size:  # fewer windows than one batch: sample with replacement
    idx = np.random.default_rng([seed, epoch, step]).integers(0, num_windows, batch_size)
  return idx


def frequent_tokens(windows: np.ndarray, n: int, vocab_size: int) -> np.ndarray:
  """The n most frequent token ids of the training windows, sorted ascending: an EAGLE-3 draft
  vocabulary (SpecForge `process_token_dict_to_mappings`: top-n by count; when fewer than n
  distinct ids occur, the lowest unused ids fill it). Ties go to the lower id.

  Returns int32 [n]; d2t = ids - arange(n) and t2d = isin(arange(V), ids) are derived from it.
  """
  if not 1 <= n <= vocab_size:
    raise ValueError(f"head.draft_vocab_size={n} must lie in [1, {vocab_size}] (the target's "
                     f"vocabulary)")
  counts = np.bincount(np.asarray(windows, np.int64).ravel(), minlength=vocab_size)[:vocab_size]
  order = np.lexsort((np.arange(vocab_size), -counts))      # by count desc, then id asc
  seen = order[counts[order] > 0][:n]
  if len(seen) < n:
    unused = np.setdiff1d(np.arange(vocab_size), seen)[:n - len(seen)]
    seen = np.concatenate([seen, unused])
  return np.sort(seen).astype(np.int32)
