"""The peer suite: spec_jax against transformers' PyTorch `generate` on the same pair, side by
side in one run — plain decoding, assisted generation (`assistant_model=` the same draft model)
and prompt lookup (`prompt_lookup_num_tokens`) — the implementation people already use.

    python -m spec_jax.bench --suite peer \\
        --pairs /work/widened/stories260K-78M@draft:/work/widened/salty279K \\
                /work/widened/stories260K-78M@ngram --num-draft 2 4 6 --peer-batch 1 8

Each library runs in its own process (spec_jax.bench.peer_worker; one per torch thread count),
so one library's thread pools never slow the other's timed calls; the processes alternate,
`peer_rounds` times, each timing `repeats` round-robin rounds of its configurations after a
warm-up. Greedy, the same prompts (equal lengths, no padding on either side), exactly
max_new_tokens new tokens per row, no early stop; greedy tokens of every configuration are
checked equal to spec_jax's plain decoding. Ratios compare medians over all timed rounds; the
spread of each side's plain decoding is the noise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from spec_jax.bench.metrics import first_difference
from spec_jax.bench.prompts import prompt_token_lists
from spec_jax.bench.results import ROOT, log
from spec_jax.bench.specs import (drafter_label, load_model, model_label, parse_pairs,
                                  resolve_path)
from spec_jax.bench.tables import fmt, table
from spec_jax.timing import decode_roofline, memory_bandwidth, summarize

PEER_DEFINITIONS = {
    "tokens_per_s": "new tokens / wall seconds of the library's generate calls (median, min, max "
                    "over every timed round of every process)",
    "vs_ours_plain": "tokens/s / spec_jax plain decoding's tokens/s (same batch)",
    "vs_hf_plain": "tokens/s / transformers plain decoding's tokens/s at its best thread count",
    "greedy_match": "the configuration's greedy tokens equal spec_jax plain decoding's",
    "noise": "(max - min) / median of a side's plain decoding over the timed rounds",
    "roofline": "tokens/s if a plain step only read its bytes (weights once + each row's KV up "
                "to the mean fill) at the measured read bandwidth (a jitted sum over 512 MB); "
                "vs_roofline = ours plain / roofline",
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
    raise RuntimeError(f"peer worker ({job['side']}) failed:\n{proc.stderr[-4000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def run_peer_suite(opts) -> dict:
  """The peer suite (see the module docstring) -> {"rows", "summary", "notes", ...}."""
  pairs = parse_pairs(opts.pairs)
  by_target: dict = {}
  for target_spec, drafter_spec in pairs:
    by_target.setdefault(target_spec, []).append(drafter_spec)
  threads = sorted({(os.cpu_count() or 1) if n == 0 else int(n) for n in opts.hf_threads})
  ours_dtypes = list(dict.fromkeys(getattr(opts, "dtype", None) or [None]))
  hf_dtypes = list(dict.fromkeys(getattr(opts, "hf_dtypes", None) or ["float32"]))
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
    ids, _ = prompt_token_lists(model, opts.prompts, n_max, opts.prompt_words,
                                opts.max_prompt_tokens, opts.seed)
    plen = min(len(r) for r in ids)
    ids = [r[:plen] for r in ids]          # equal lengths: no padding on either side
    max_new = min(int(opts.max_new_tokens), model.config.max_position_embeddings - plen - 16)
    del model
    for batch in sorted(set(opts.peer_batch)):
      n = -(-max(opts.peer_prompts, batch) // batch) * batch
      prompts = (ids * (n // len(ids) + 1))[:n]
      ours = [{"name": "plain", "mode": "plain", "draft": None, "k": 0}]
      hf = [{"name": "plain", "mode": "plain", "draft": None, "k": 0}]
      for d in drafter_specs:
        for k in opts.num_draft:
          c = _drafter_config(d, int(k))
          ours.append(dict(c, name=f"{drafter_label(d)} K={k}"))
        if batch == 1:
          c = _drafter_config(d, int(opts.peer_lookup_tokens))
          hf.append(dict(c, name="assisted" if c["mode"] == "draft" else
                         f"prompt lookup {opts.peer_lookup_tokens}"))
      base = {"target": target_spec if target_spec.startswith(("random:", "widened:"))
              else str(resolve_path(target_spec)), "prompts": prompts, "batch": batch, "max_new": max_new,
              "repeats": opts.repeats, "seed": opts.seed}
      workers = [("spec_jax", None, d, dict(base, side="ours", configs=ours, dtype=d))
                 for d in ours_dtypes]
      workers += [("transformers", t, d, dict(base, side="hf", threads=t, configs=hf, dtype=d))
                  for d in hf_dtypes for t in threads]
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
      # part at a near-tie; docs/speed.md measures how often), else in our first dtype.
      references = {d: measured[("spec_jax", None, d, "plain")]["tokens"] for d in ours_dtypes}
      cfg_of = {("spec_jax", None, c["name"]): c for c in ours}
      cfg_of.update({("transformers", t, c["name"]): c for t in threads for c in hf})
      batch_rows = []
      for (lib, t, d, name), m in measured.items():
        reference = references.get(d, references[ours_dtypes[0]])
        diff = first_difference(m["tokens"], reference)
        if diff is not None:
          notes.append(f"{label} B={batch} {lib} {name} {d or ''}: greedy tokens differ from "
                       f"spec_jax plain (row {diff[0]}, position {diff[1]})")
        c = cfg_of[(lib, t, name)]
        batch_rows.append({"target": label, "batch": batch, "library": lib, "threads": t,
                           "dtype": d or "float32",
                           "config": name, "mode": c["mode"], "K": c["k"],
                           "prompts": n, "prompt_tokens": plen, "max_new_tokens": max_new,
                           "tokens_per_s": summarize(m["tokens_per_s"]), "tau": m["tau"],
                           "greedy_match": diff is None})
      s = _summarize_batch(label, batch, batch_rows)
      # The roofline of the bytes our fastest plain decoding reads: its dtype's weights.
      s["roofline_tokens_per_s"] = decode_roofline(config.replace(dtype=s["ours_plain_dtype"]),
                                                   batch, plen + max_new // 2,
                                                   bandwidth["read_bytes_per_s"])
      s["ours_plain_vs_roofline"] = s["ours_plain"] / s["roofline_tokens_per_s"]
      summary.append(s)
      rows += batch_rows
  return {"suite": "peer", "rows": rows, "summary": summary, "notes": notes,
          "bandwidth": bandwidth, "definitions": PEER_DEFINITIONS}


def _summarize_batch(label: str, batch: int, rows: list) -> dict:
  """Headline ratios of one (target, batch): ours vs transformers, plain and speculative."""
  med = lambda r: r["tokens_per_s"]["median"]
  spread = lambda r: (r["tokens_per_s"]["max"] - r["tokens_per_s"]["min"]) / med(r)
  ours = [r for r in rows if r["library"] == "spec_jax"]
  theirs = [r for r in rows if r["library"] == "transformers"]
  ours_plain = max((r for r in ours if r["mode"] == "plain"), key=med)       # fastest dtype
  hf_plain = max((r for r in theirs if r["mode"] == "plain"), key=med)     # dtype, threads
  for r in rows:
    r["vs_ours_plain"] = med(r) / med(ours_plain)
    r["vs_hf_plain"] = med(r) / med(hf_plain)
  out = {"target": label, "batch": batch, "ours_plain": med(ours_plain),
         "ours_plain_dtype": ours_plain["dtype"], "hf_plain_best_dtype": hf_plain["dtype"],
         "hf_plain_best": med(hf_plain), "hf_plain_best_threads": hf_plain["threads"],
         "ours_over_hf_plain": med(ours_plain) / med(hf_plain),
         "noise_ours_plain": spread(ours_plain),
         "noise_hf_plain": spread(hf_plain)}
  for mode in ("draft", "ngram"):
    o = [r for r in ours if r["mode"] == mode]
    h = [r for r in theirs if r["mode"] == mode]
    if o:
      best = max(o, key=med)
      out[f"ours_{mode}_best"] = {"config": best["config"], "tokens_per_s": med(best),
                                  "speedup": med(best) / med(ours_plain), "tau": best["tau"],
                                  "dtype": best["dtype"]}
    if o and h:
      hb = max(h, key=med)
      out[f"hf_{mode}_best"] = {"config": hb["config"], "threads": hb["threads"],
                                "tokens_per_s": med(hb), "dtype": hb["dtype"]}
      out[f"ours_over_hf_{mode}"] = med(max(o, key=med)) / med(hb)
  return out


def format_peer(result: dict) -> str:
  """The peer suite's table and headline lines."""
  rows = sorted(result["rows"], key=lambda r: (r["target"], r["batch"], r["library"],
                                               r.get("dtype", ""), r["threads"] or 0,
                                               r["mode"] != "plain", r["K"]))
  cells = [[r["target"], r["batch"], r["library"], r.get("dtype", "float32"), r["threads"] or "-",
            r["config"],
            f"{r['tokens_per_s']['median']:.1f}",
            f"{r['tokens_per_s']['min']:.1f}-{r['tokens_per_s']['max']:.1f}",
            f"{r['vs_ours_plain']:.2f}x", f"{r['vs_hf_plain']:.2f}x", fmt(r["tau"]),
            "yes" if r["greedy_match"] else "NO"] for r in rows]
  lines = [table(["target", "B", "library", "dtype", "threads", "config", "tok/s", "min-max",
                  "vs ours plain", "vs hf plain", "tau", "greedy ="], cells), ""]
  for s in result["summary"]:
    line = (f"{s['target']} B={s['batch']}: ours plain {s['ours_plain']:.1f} tok/s "
            f"({s.get('ours_plain_dtype', 'float32')}, our fastest) vs transformers plain "
            f"{s['hf_plain_best']:.1f} ({s['hf_plain_best_threads']} threads, "
            f"{s.get('hf_plain_best_dtype', 'float32')}): "
            f"{s['ours_over_hf_plain']:.2f}x; noise ours {100 * s['noise_ours_plain']:.0f} %, "
            f"transformers {100 * s['noise_hf_plain']:.0f} %")
    lines.append(line)
    lines.append(f"  plain vs memory roofline: {s['ours_plain']:.1f} / "
                 f"{s['roofline_tokens_per_s']:.1f} tok/s = "
                 f"{100 * s['ours_plain_vs_roofline']:.0f} %")
    for mode, name in (("draft", "assisted generation"), ("ngram", "prompt lookup")):
      if f"ours_over_hf_{mode}" in s:
        o, h = s[f"ours_{mode}_best"], s[f"hf_{mode}_best"]
        lines.append(f"  {name}: ours {o['config']} {o.get('dtype', '')} "
                     f"{o['tokens_per_s']:.1f} tok/s ({o['speedup']:.2f}x our fastest plain, "
                     f"tau {fmt(o['tau'])}) vs transformers {h['tokens_per_s']:.1f} "
                     f"({h['threads']} threads, {h.get('dtype', 'float32')}; its best): "
                     f"{s[f'ours_over_hf_{mode}']:.2f}x")
  lines += [f"note: {n}" for n in result["notes"]]
  return "\n".join(lines)
