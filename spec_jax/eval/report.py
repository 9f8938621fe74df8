"""The evaluation's report.md and PNG plots, drawn from results.json's tables with the bench's
table and plot functions."""

from __future__ import annotations

import json
import pathlib

from spec_jax.bench import plots
from spec_jax.bench.results import describe_cpu
from spec_jax.bench.tables import fmt, table
from spec_jax.eval.aggregate import ALL

PLOT_FILES = {"category": "speedup_per_category.png", "speedup": "speedup_vs_batch.png",
              "tau": "tau_per_category.png", "tpot": "tpot_vs_batch.png"}


_FORMATS = {"chat_template": "prompts through the tokenizer's chat template",
            "raw": "raw-text prompts (the tokenizer has no chat template)"}


def mixed_hosts_note(hosts) -> str:
  """What a run resumed on another host means for its numbers."""
  return (f"this run's units were measured on {len(hosts)} hosts ({' | '.join(hosts)}): every "
          f"speedup compares configurations timed side by side in one unit, on one host, but "
          f"the tok/s totals and the speedups pooled over units mix the hosts; rerun into a "
          f"fresh --out for numbers of one host")


def _x(v, nd=2):
  return f"{v:.{nd}f}×" if v is not None else "-"


def _pcts(d, nd=1):
  return " / ".join(f"{d[q]:.{nd}f}" for q in ("p50", "p90", "p99")) if d else "-"


def _title(res) -> str:
  o = res["options"]
  return (f"{res['target']['label']}, {o['prompts']}, K={o['num_draft']}, "
          f"T={o['temperature']:g}")


def write_plots(res: dict, out_dir) -> list:
  """The three PNGs into out_dir -> their file names ([] without matplotlib)."""
  if not plots.have_matplotlib():
    return []
  out_dir = pathlib.Path(out_dir)
  drafters = [d["label"] for d in res["drafters"]]
  speed = {d: [(r["batch"], r["speedup_vs_fastest_plain"]) for r in res["throughput"]
               if r["drafter"] == d and r["speedup_vs_fastest_plain"] is not None]
           for d in drafters}
  plots.speedup_vs_batch(speed, f"speedup over the fastest plain decoding vs batch size — "
                         f"{_title(res)}", out_dir / PLOT_FILES["speedup"])
  b0 = min(res["options"]["batch"])
  cats = [c for c in res["prompts"]["categories"]
          if any(r["category"] == c for r in res["summary"])]
  _category_plot(res, drafters, cats, b0, out_dir / PLOT_FILES["category"])
  tau = {d: {r["category"]: r["tau"] for r in res["summary"]
             if r["drafter"] == d and r["batch"] == b0 and r["category"] != ALL
             and r["tau"] is not None} for d in drafters}
  plots.bars_per_category(tau, cats, f"tokens per target forward (τ) per category, batch "
                          f"{b0} — {_title(res)}", "τ: tokens per target forward",
                          out_dir / PLOT_FILES["tau"], baseline=1.0,
                          baseline_label="plain decoding (τ = 1)")
  tpot = {}
  for r in res["latency"]:
    if r["tpot_ms"]:
      per_q = tpot.setdefault(r["drafter"], {"p50": [], "p90": [], "p99": []})
      for q in per_q:
        per_q[q].append((r["batch"], r["tpot_ms"][q]))
  plots.percentiles_vs_batch(tpot, f"time per output token per request — {_title(res)}",
                             "TPOT (ms per output token)", out_dir / PLOT_FILES["tpot"])
  return [PLOT_FILES[k] for k in ("category", "speedup", "tau", "tpot")]


def _category_plot(res, drafters, cats, batch, path) -> None:
  """What a reader looks at first: each drafter's speedup over the fastest plain decoding per
  category at the smallest batch, the 1.0x line and plain decoding's noise band around it."""
  speed = {d: {r["category"]: r["speedup_vs_fastest_plain"] for r in res["summary"]
               if r["drafter"] == d and r["batch"] == batch and r["category"] != ALL
               and r.get("speedup_vs_fastest_plain") is not None} for d in drafters}
  noise = next((r.get("plain_noise") for r in res["throughput"] if r["batch"] == batch), None)
  band = None if not noise else (1 - noise / 2, 1 + noise / 2)
  fastest = next((r.get("fastest_plain") for r in res["throughput"] if r["batch"] == batch),
                 "plain")
  plots.bars_per_category(
      speed, cats, f"speedup over the fastest plain decoding ({fastest}) per category, batch "
      f"{batch} — {_title(res)}", "speedup (×, per-request tokens/s)", path, baseline=1.0,
      baseline_label=f"{fastest} (1.0×)", band=band,
      band_label=f"plain noise ±{noise / 2:.0%} (spread over repeats)" if noise else None)


def _header(res) -> list:
  o, m, p = res["options"], res["machine"], res["prompts"]
  limit = (f"the first {o['limit_per_category']} per category"
           if o["limit_per_category"] else "all")
  lines = [f"# Evaluation: {res['target']['label']} — "
           f"{', '.join(d['label'] for d in res['drafters'])} vs plain decoding", "",
           f"- prompts: `{o['prompts']}`, {limit}: {p['selected']} questions, "
           f"{p['requests']} requests (turns) asked, {len(res['skipped'])} skipped; "
           f"{_FORMATS[res['target']['prompt_format']]}" + (
               f" with options `{json.dumps(o['chat_template_kwargs'])}`"
               if o.get("chat_template_kwargs") is not None else ""),
           f"- K = {o['num_draft']}" + (
               f" (chains); trees D,k,N {', '.join(o['trees'])} beside them"
               if o.get("trees") else "") +
           f", temperature {o['temperature']:g}, max {o['max_new_tokens']} "
           f"new tokens (stop at end-of-text), batch sizes {o['batch']}, {o['repeats']} timed "
           f"round(s) per batch, interleaved",
           f"- machine: {m.get('backend')} backend, {len(m.get('devices', []))} device(s) "
           f"({', '.join(m.get('device_kind', [])) or '?'}), {m.get('cpu_count')} CPUs "
           f"({describe_cpu(m)}), load "
           f"average at start {fmt((m.get('loadavg_start') or [None])[0], 1)}; commit "
           f"`{m.get('git_commit', '?')[:12]}`; {res['created'][:19]} UTC; "
           f"wall {res['wall_seconds']:.0f} s", ""]
  hosts = res.get("run", {}).get("hosts") or []
  if len(hosts) > 1:
    lines += [f"**Mixed hosts:** {mixed_hosts_note(hosts)}.", ""]
  g = res["greedy_check"]
  ties = g.get("near_tie_divergences") or []
  if g["checked"] and not ties:
    lines.append(f"**Greedy check passed**: every drafter's output equals plain decoding's, "
                 f"token for token, on all {g['requests_compared']} (request, batch size) pairs.")
  elif g["checked"]:
    worst = max(max(d["gap_plain"], d["gap_drafter"]) / d["tol"] for d in ties)
    lines.append(f"**Greedy check passed** on all {g['requests_compared']} (request, batch "
                 f"size) pairs: equal token for token except {len(ties)} (request, drafter) "
                 f"output(s) that part from plain decoding at a near-tie of the "
                 f"{res['options'].get('dtype') or 'stored'}-precision model (both tokens within "
                 f"{worst:.0%} of the tolerance 2^-6 of the logits' scale from the maximum; a "
                 f"verify over K+1 rows rounds differently from a one-row step: spec_jax/eval/"
                 f"greedy.py); every statistic after such a position compares different text.")
  else:
    lines.append("Greedy check: not applicable at temperature > 0 (outputs are samples).")
  return lines + [""]


def render_markdown(res: dict) -> str:
  """report.md: throughput, per-category, latency and skipped-prompt sections, definitions."""
  out = _header(res)
  if PLOT_FILES["category"] in res["plots"]:
    out += [f"![speedup per category]({PLOT_FILES['category']})", ""]
  out += ["## Throughput and speedup over plain decoding", ""]
  out.append(table(["drafter", "B", "requests", "new tokens", "seconds", "tok/s", "speedup",
                    "vs fastest plain", "plain noise"],
                   [[r["drafter"], r["batch"], r["requests"], r["new_tokens"],
                     fmt(r["seconds"]), fmt(r["tokens_per_s"], 1), _x(r["speedup"]),
                     _x(r.get("speedup_vs_fastest_plain")),
                     f"{r['plain_noise']:.0%}" if r.get("plain_noise") is not None else "-"]
                    for r in res["throughput"]],
                   markdown=True))
  comp = res.get("compile")
  if comp:
    reused = res.get("run", {}).get("units_reused", 0)
    out += ["", f"Compiling (never timed): {comp['seconds']:.0f} s over "
                f"{comp['units_that_compiled']} (configuration, batch) measurements that "
                f"compiled a decode" + (f", including those of the {reused} units reused from "
                                        f"an earlier run (their compiles happened then)."
                                        if reused else ".")]
  if PLOT_FILES["speedup"] in res["plots"]:
    out += ["", f"![speedup vs batch size]({PLOT_FILES['speedup']})"]
  for b in res["options"]["batch"]:
    out += ["", f"## Per category, batch {b}", ""]
    rows = [r for r in res["summary"] if r["batch"] == b]
    out.append(table(["category", "drafter", "requests", "tau", "alpha", "a_tok",
                      "accepted at 1..K", "tok/s per request", "speedup", "vs fastest plain"],
                     [[r["category"], r["drafter"], r["requests"], fmt(r["tau"]),
                       fmt(r["alpha"]), fmt(r["alpha_token"]),
                       " ".join(f"{a:.2f}" for a in r.get("accepted_at") or []) or "-",
                       fmt(r["tokens_per_s"], 1), _x(r["speedup"]),
                       _x(r.get("speedup_vs_fastest_plain"))] for r in rows], markdown=True))
  if PLOT_FILES["tau"] in res["plots"]:
    out += ["", f"![tau per category]({PLOT_FILES['tau']})"]
  out += ["", "## Latency per batch size (ms; p50 / p90 / p99 over requests)", ""]
  out.append(table(["drafter", "B", "requests", "TTFT", "TPOT", "end-to-end"],
                   [[r["drafter"], r["batch"], r["requests"], _pcts(r["ttft_ms"]),
                     _pcts(r["tpot_ms"], 2), _pcts(r["e2e_ms"])] for r in res["latency"]],
                   markdown=True))
  if PLOT_FILES["tpot"] in res["plots"]:
    out += ["", f"![TPOT percentiles vs batch size]({PLOT_FILES['tpot']})"]
  if not res["plots"]:
    out += ["", f"No plots: {plots.PLOTS_HINT}."]
  out += ["", f"## Skipped prompts ({len(res['skipped'])})", ""]
  if res["skipped"]:
    out += [f"- `{s['id']}` ({s['category']}, turn {s['turn']}): {s['reason']}"
            for s in res["skipped"]]
  else:
    out.append("None: every prompt fit the context.")
  out += ["", "## Definitions", ""]
  out += [f"- **{k}**: {v}" for k, v in res["definitions"].items()]
  return "\n".join(out) + "\n"
