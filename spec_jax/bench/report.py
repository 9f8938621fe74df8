"""The text reports of the bench's suites (tables from spec_jax.bench.tables)."""

from __future__ import annotations

import statistics

from spec_jax.bench.suites.peer_report import format_peer
from spec_jax.bench.suites.spec import vs_fastest_plain
from spec_jax.bench.tables import fmt, table

DTYPE_TAG = {"bfloat16": "bf16", "float32": "f32"}

def format_spec(result: dict) -> str:
  """The spec suite's table, legend, noise line, notes and one verdict line per pair."""
  def k_order(k):                        # plain, then fixed K, then the governor
    return (2, 0) if k == "auto" else (int(k > 0), k)
  rows = sorted(result["rows"], key=lambda r: (r["target"], r["temperature"], r["batch"],
                                               k_order(r["K"])[0], r["drafter"],
                                               bool(r.get("tree")), k_order(r["K"])[1],
                                               r.get("tree") or ""))
  cells_rows = []
  for r in rows:
    t = r["tokens_per_s"]
    flag = "" if r["K"] == 0 else ("LOSS" if vs_fastest_plain(r) < 1 else "")
    cells_rows.append([r["target"], r["drafter"], f"{r['temperature']:g}", r["batch"],
                       f"tree {r['tree']}" if r.get("tree") else r["K"],
                       f"{t['median']:.0f}", f"{t['min']:.0f}-{t['max']:.0f}",
                       f"{r['speedup']:.2f}x",
                       "-" if r.get("speedup_vs_fastest_plain") is None else
                       f"{r['speedup_vs_fastest_plain']:.2f}x ({DTYPE_TAG.get(r['fastest_plain_dtype'], '?')})",
                       flag, fmt(r["alpha"]), fmt(r.get("alpha_token")),
                       fmt(r["tau"]),
                       fmt(r["c_draft"], 3), fmt(r["c_verify"]), fmt(r["bound"]),
                       "-" if r["efficiency"] is None else f"{100 * r['efficiency']:.0f}%"])
  out = [table(["target", "drafter", "T", "B", "K", "tok/s", "min-max", "speedup", "vs best",
                "",
                "alpha", "a_tok", "tau", "c_draft", "c_verify", "bound", "eff"], cells_rows)]
  out.append("")
  out.append("legend: tok/s = new tokens (all rows) / s of one compiled generate() call (prefill + "
             "decode, compile excluded), median of repeats; min-max over repeats. Every row "
             "generates exactly max_new_tokens per prompt (stop_tokens=[]), same prompts and key.")
  out.append("  speedup = tok/s / tok/s of plain decoding (K=0, drafter none) of the SAME target, "
             "dtype, batch B and temperature T in this run; vs best = tok/s / the fastest plain "
             "decoding of any dtype timed in the same cell (none@DTYPE rows: plain in another "
             "dtype; --plain-dtypes), and which dtype that was (LOSS = slower than it; the "
             "verdicts judge it too). alpha = accepted/"
             "drafted (SpecStats.acceptance_rate = (tau-1)/K); a_tok = accepted/(accepted + "
             "rejections), the per-token acceptance of tau = (1-a^(K+1))/(1-a) over the judged "
             "drafts (the engine counts the rejections: exact at any B, with cut last rounds and "
             "n-gram misses; '-' for trees and the governor); tau = tokens per target forward "
             "(bonus included).")
  out.append("  c_verify = t(target fwd over K+1 tokens)/t(target fwd over 1), c_draft = draft "
             "cost per round / K / t(target fwd over 1) (draft model: one 1-token draft forward; "
             "ngram, heads: (propose()+commit())/K), both at the row's batch, fill = prompt + max_new/2; "
             "bound = tau/(K*c_draft + c_verify); eff = speedup/bound.")
  if any(r.get("tree") for r in rows):
    out.append("  tree D,k,N rows (sj.TreeSpec(depth=D, top_k=k, num_nodes=N), ',sampled' = i.i.d. "
               "candidates): alpha = accepted / verified tree nodes; tau = tokens per verify; "
               "c_verify = t(fwd over N+1)/t(fwd over 1); c_draft = (propose_tree + commit_tree) "
               "/ D / t(fwd over 1); bound = tau/(D*c_draft + c_verify).")
  noise = [b["noise_pct"] for b in result["baselines"]]
  if noise:
    out.append(f"  noise: plain-baseline spread (max-min)/median per cell: median "
               f"{statistics.median(noise):.0f}%, range {min(noise):.0f}%-{max(noise):.0f}% "
               f"over {len(noise)} cells ({result['baselines'][0]['tokens_per_s']['n']} plain "
               f"runs each, interleaved)")
  if result.get("governor"):
    out.append("  K=auto: the governor (num_draft='auto') picks K per round from its cost table "
               "and live alpha; c_draft/c_verify/bound do not apply (K varies).")
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
  gov = result.get("governor") or []
  if gov:
    out.append("")
    out.append("governor (K=auto) per cell: speedup over plain; share of the best fixed K's "
               "speedup in the same cell; K histogram (loop iterations per K); goals of issue 9")
    for g in gov:
      share = ("-" if g["share_of_best_fixed"] is None else
               f"{g['share_of_best_fixed']:.2f} of K={g['best_fixed_K']} "
               f"({g['best_fixed_speedup']:.2f}x)")
      hist = "{" + ", ".join(f"{k}: {n}" for k, n in g["k_histogram"].items()) + "}"
      goals = ", ".join(f"{name} {'met' if ok else 'MISSED'}" for name, ok in
                        g["goals"].items()) or "-"
      out.append(f"governor {g['target']} + {g['drafter']} T={g['temperature']:g} "
                 f"B={g['batch']}: {g['speedup']:.2f}x plain, "
                 f"{g.get('speedup_vs_fastest_plain', g['speedup']):.2f}x the fastest plain; "
                 f"{share}; K {hist}; goals: "
                 f"{goals} (noise {g['noise_pct']:.0f}%)")
  return "\n".join(out)


def format_plain(result: dict) -> str:
  """The plain suite's two tables (tokens/s against transformers; c(T)) and legend."""
  out = []
  cells_rows = []
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
    cells_rows.append(cells)
  thr = result["generate"][0]["hf_threads"] if result["generate"] else "?"
  out.append("plain greedy decoding: spec_jax vs transformers generate (tokens/s, all rows)")
  headers = ["model", "params", "B", "prompt", "new", "spec_jax", "min-max",
             f"hf {thr}thr", "min-max", "ours/hf"]
  for n in extra:
    headers += [f"hf {n}thr", "min-max", "ours/hf"]
  out.append(table(headers + ["same tokens"], cells_rows))
  out.append("")
  out.append("verify cost ratio c(T) = t(forward over T new tokens at fill F) / t(forward over 1), "
             "batch 1, capacity F+16")
  models = []
  for r in result["cost"]:
    if (r["model"], r["fill"]) not in models:
      models.append((r["model"], r["fill"]))
  ts = sorted({r["T"] for r in result["cost"]})
  cells_rows = []
  for m, f in models:
    rs = {r["T"]: r for r in result["cost"] if r["model"] == m and r["fill"] == f}
    cells_rows.append([m, f, f"{rs[1]['t_ms']:.3f}"] + [f"{rs[t]['c']:.2f}" for t in ts]
                       + [f"{rs[1]['t_call_ms']:.3f}", " ".join(f"{rs[t]['c_call']:.2f}" for t in ts)])
  out.append(table(["model", "F", "t(1) ms"] + [f"c({t})" for t in ts]
                   + ["call t(1) ms", "c_call(1..)"], cells_rows))
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


def format_breakdown(result: dict) -> str:
  """The breakdown suite's table (ms per round) and legend."""
  cells_rows = []
  for r in result["rows"]:
    cells_rows.append([r["target"], r["drafter"], f"{r['temperature']:g}", r["batch"], r["K"],
                       f"{r['tau']:.2f}", fmt(r["t_round_ms"], 3), f"{r['t_fwd_1_ms']:.3f}",
                       f"{r['t_fwd_k1_ms']:.3f}", f"{r['t_verify_step_ms']:.3f}",
                       f"{r['t_draft_fwd_ms']:.3f}", f"{r['t_propose_ms']:.3f}",
                       f"{r['t_accept_ms']:.3f}", fmt(r["t_other_ms"], 3),
                       fmt(r.get("speedup_loop")), fmt(r.get("bound")),
                       "-" if "efficiency_loop" not in r else f"{100 * r['efficiency_loop']:.0f}%"])
  out = [table(["target", "drafter", "T", "B", "K", "tau", "round", "fwd(1)", "fwd(K+1)",
                "verify", "draft fwd", "propose", "accept", "other", "speedup", "bound", "eff"],
                cells_rows)]
  out.append("")
  out.append("legend (ms per round): round = engine loop time per iteration (prefill excluded); "
             "fwd(1), fwd(K+1) = bare target forwards; verify = engine.verify_step (forward over "
             "K+1 + probs); draft fwd = one 1-token draft-model forward (ngram: propose/K); "
             "propose = the drafter's whole propose() of one round; accept = engine.accept_step; "
             "other = round - propose - verify - accept. speedup = tau * round(plain) / round; "
             "bound = tau / ((K draft fwd + fwd(K+1)) / fwd(1)); eff = speedup / bound. A round of "
             "'-': the difference of the two calls came out <= 0, within their noise (the row's "
             "'unresolved' field says so); no speedup is computed from it.")
  return "\n".join(out)


FORMATTERS = {"spec": format_spec, "plain": format_plain, "breakdown": format_breakdown,
              "peer": format_peer}
