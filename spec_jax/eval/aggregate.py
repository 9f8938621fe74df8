"""From measured units to the tables of an evaluation (see EVAL_DEFINITIONS for every field)."""

from __future__ import annotations

import statistics

from spec_jax.bench.metrics import alpha_per_verified_token
from spec_jax.timing import percentiles
from spec_jax.eval.latency import request_latencies
from spec_jax.eval.runner import PLAIN
from spec_jax.stats import SpecStats

ALL = "all"

EVAL_DEFINITIONS = {
    "tau": "tokens emitted per target forward, bonus included: the rounds' tokens (each "
           "request's new tokens but the prefill's first) / rounds over the group's "
           "requests; 1 for plain decoding",
    "alpha": "accepted draft tokens / drafted tokens over the group's requests",
    "alpha_token": "accepted / (accepted + rounds with a rejection), the rejections counted by "
                   "the engine: the per-token acceptance a of tau = (1 - a^(K+1)) / (1 - a) over "
                   "the drafts that were judged, exact whatever the rounds' lengths (a cut last "
                   "round, an n-gram miss); null for trees and the governor (K = auto), and for "
                   "units stored by an older version when a round drafted fewer than K",
    "tokens_per_s": "summary: new tokens of the group's requests / the sum of their end-to-end "
                    "latencies (per-request speed; at batch 1 the plain throughput); "
                    "throughput: new tokens of all requests / wall seconds of all batches",
    "speedup": "tokens_per_s of the drafter / tokens_per_s of plain decoding (the target's "
               "dtype) on the same requests and batch size, measured interleaved in the same "
               "run",
    "speedup_vs_fastest_plain": "tokens_per_s / the highest tokens_per_s of plain decoding in "
                                "any dtype timed in the run (--plain-dtypes), same requests and "
                                "batch size; fastest_plain names it",
    "accepted_at": "per draft position i: rounds that accepted at least i + 1 drafts / all "
                   "rounds, over the group's requests",
    "plain_noise": "per batch size: the median over its batches of (max - min) / median of "
                   "plain decoding's seconds over the timed repeats (null with one repeat): "
                   "speedups within it of 1.0 are not distinguishable from plain decoding",
    "compile_s": "seconds spent tracing and compiling decodes (never inside a timed call), "
                 "with the number of compiled decodes",
    "ttft_ms": "time to first token: seconds of generate(max_new_tokens=1) on the same batch "
               "and cache capacity (prefill + drafter init; every row's first token comes from "
               "the prefill); p50/p90/p99 over requests",
    "tpot_ms": "per-request time per output token after the first: (e2e - ttft) / (new tokens "
               "- 1), e2e = ttft + rounds[b] * (full-call seconds - ttft) / loop iterations, "
               "rounds[b] = the round at which row b finished; p50/p90/p99 over requests with "
               "at least 2 new tokens",
    "e2e_ms": "per-request end-to-end latency inside its batch (see tpot_ms); p50/p90/p99",
    "filler rows": "the last batch of a turn is filled up to B rows by repeating its last "
                   "prompt: those rows run (the concurrency stays B) but are never counted",
}


def request_rows(units, configs) -> list:
  """One row per (configuration, request) of every unit: counts, tokens and latencies."""
  rows = []
  for u in units:
    for c in configs:
      m = u["configs"][c.key]
      lat = request_latencies(m["seconds_median"], m["ttft_median_s"], m["iterations"],
                              m["rounds"], m["new_tokens"])
      for i, req in enumerate(u["requests"]):
        rows.append({"config": c.key, "drafter": c.label, "batch": u["batch"],
                     "id": req["id"], "category": req["category"], "turn": req["turn"],
                     "prompt_tokens": req["prompt_tokens"], "new_tokens": m["new_tokens"][i],
                     "rounds": m["rounds"][i], "drafted": m["drafted"][i],
                     "accepted": m["accepted"][i], "accepted_at": m["accepted_at"][i],
                     # absent from units an older version stored
                     "rejected": m["rejected"][i] if "rejected" in m else None,
                     **lat[i]})
  return rows


def group_stats(rows, k) -> dict:
  """tau, alpha, alpha_token, tokens/s (tokens / summed e2e) of a group of request rows."""
  rounds = sum(r["rounds"] for r in rows)
  drafted = sum(r["drafted"] for r in rows)
  accepted = sum(r["accepted"] for r in rows)
  tokens = sum(r["new_tokens"] for r in rows)
  e2e = sum(r["e2e_s"] for r in rows)
  alpha_token = None
  width = len(rows[0]["accepted_at"]) if rows else 0
  if isinstance(k, int) and k > 0 and width == k:
    at = [sum(r["accepted_at"][i] for r in rows) for i in range(k)]
    rejected = [r.get("rejected") for r in rows]
    stats = SpecStats.from_counts(rounds=[rounds], drafted=[drafted], accepted=[accepted],
                                  accepted_at=[at], seconds=1.0, new_tokens=0, iterations=0,
                                  num_draft=k, rejected=None if None in rejected else
                                  [sum(rejected)])
    alpha_token = alpha_per_verified_token(stats)
  width = len(rows[0]["accepted_at"]) if rows else 0
  accepted_at = [sum(r["accepted_at"][i] for r in rows) / rounds for i in range(width)] \
      if rounds else []
  # The rounds emitted every new token but the first (the prefill's). Not accepted + rounds:
  # a round cut by max_new_tokens or a stop token counts its emitted drafts as accepted but
  # emits no correction or bonus after them.
  emitted = sum(max(r["new_tokens"] - 1, 0) for r in rows)
  return {"requests": len(rows), "new_tokens": tokens, "e2e_s": e2e,
          "tau": emitted / rounds if rounds else None, "accepted_at": accepted_at,
          "alpha": accepted / drafted if drafted else None, "alpha_token": alpha_token,
          "tokens_per_s": tokens / e2e if e2e > 0 else None}


def _speedup(x, base):
  return x / base if x and base else None


def summary_table(rows, configs, batches, categories) -> list:
  """Per (configuration, batch, category and 'all'): group_stats and the speedup over plain."""
  out = []
  for b in batches:
    for cat in list(categories) + [ALL]:
      sel = [r for r in rows if r["batch"] == b and (cat == ALL or r["category"] == cat)]
      if not sel:
        continue
      stats = {c.key: group_stats([r for r in sel if r["config"] == c.key], c.num_draft)
               for c in configs}
      base = stats[PLAIN]["tokens_per_s"]
      fastest = _fastest_plain(configs, {k: s["tokens_per_s"] for k, s in stats.items()})
      for c in configs:
        rate = stats[c.key]["tokens_per_s"]
        out.append(dict({"drafter": c.label, "config": c.key, "num_draft": c.num_draft,
                         "batch": b, "category": cat}, **stats[c.key],
                        speedup=_speedup(rate, base),
                        speedup_vs_fastest_plain=_speedup(rate, fastest[1]),
                        fastest_plain=fastest[0]))
  return out


def _fastest_plain(configs, rates: dict) -> tuple:
  """(label, tokens/s) of the fastest plain configuration (any dtype) among `rates`."""
  plain = [(rates[c.key], c.label) for c in configs if c.is_plain and rates.get(c.key)]
  if not plain:
    return None, None
  rate, label = max(plain)
  return label, rate


def plain_noise(units, batch: int):
  """The median relative spread (max - min) / median of plain decoding's timed seconds over the
  batches of this size; None with a single repeat."""
  spreads = []
  for u in units:
    secs = u["configs"][PLAIN]["seconds"] if u["batch"] == batch else []
    if len(secs) > 1:
      spreads.append((max(secs) - min(secs)) / statistics.median(secs))
  return statistics.median(spreads) if spreads else None


def compile_summary(units, configs) -> dict:
  """Seconds spent compiling (tracing included) by this run's configurations, and how many of
  their decodes compiled (a stored unit also holds configurations of earlier runs: left out)."""
  per = [u["configs"][c.key].get("compile_s", 0.0) for u in units for c in configs
         if c.key in u["configs"]]
  return {"seconds": sum(per), "units_that_compiled": sum(1 for s in per if s > 0)}


def throughput_table(units, configs, batches) -> list:
  """Per (configuration, batch): all counted tokens / the wall seconds of all batches."""
  out = []
  for b in batches:
    us = [u for u in units if u["batch"] == b]
    tps = {}
    for c in configs:
      tokens = sum(sum(u["configs"][c.key]["new_tokens"]) for u in us)
      seconds = sum(u["configs"][c.key]["seconds_median"] for u in us)
      tps[c.key] = (tokens, seconds, tokens / seconds if seconds > 0 else None)
    fastest = _fastest_plain(configs, {k: v[2] for k, v in tps.items()})
    noise = plain_noise(us, b)
    for c in configs:
      tokens, seconds, rate = tps[c.key]
      out.append({"drafter": c.label, "config": c.key, "batch": b, "batches": len(us),
                  "requests": sum(len(u["requests"]) for u in us), "new_tokens": tokens,
                  "seconds": seconds, "tokens_per_s": rate,
                  "speedup": _speedup(rate, tps[PLAIN][2]),
                  "speedup_vs_fastest_plain": _speedup(rate, fastest[1]),
                  "fastest_plain": fastest[0], "plain_noise": noise})
  return out


def _ms_percentiles(values):
  return {q: 1e3 * v for q, v in percentiles(values).items()} if values else None


def latency_table(rows, configs, batches) -> list:
  """Per (configuration, batch): TTFT, TPOT and end-to-end latency percentiles in ms."""
  out = []
  for b in batches:
    for c in configs:
      sel = [r for r in rows if r["batch"] == b and r["config"] == c.key]
      if not sel:
        continue
      out.append({"drafter": c.label, "config": c.key, "batch": b, "requests": len(sel),
                  "ttft_ms": _ms_percentiles([r["ttft_s"] for r in sel]),
                  "tpot_ms": _ms_percentiles([r["tpot_s"] for r in sel
                                              if r["tpot_s"] is not None]),
                  "e2e_ms": _ms_percentiles([r["e2e_s"] for r in sel])})
  return out


def answers_of(units) -> list:
  """Plain decoding's answers, from the smallest batch size measured."""
  if not units:
    return []
  b = min(u["batch"] for u in units)
  out = []
  for u in units:
    if u["batch"] != b:
      continue
    texts = u["answers"]["text"] or [None] * len(u["requests"])
    for req, tokens, text in zip(u["requests"], u["answers"]["tokens"], texts):
      out.append({"id": req["id"], "category": req["category"], "turn": req["turn"],
                  "new_tokens": len(tokens), "text": text})
  return out
