"""The peer suite's headline ratios and its table: spec_jax against transformers and llama.cpp
(whichever ran), per (target, batch)."""

from __future__ import annotations

from spec_jax.bench.tables import fmt, table

OURS, HF, LLAMACPP = "spec_jax", "transformers", "llama.cpp"
PEER_KEYS = {HF: "hf", LLAMACPP: "llamacpp"}        # summary key prefixes
LIBRARY_ORDER = {OURS: 0, HF: 1, LLAMACPP: 2}

_med = lambda r: r["tokens_per_s"]["median"]


def _spread(r) -> float:
  return (r["tokens_per_s"]["max"] - r["tokens_per_s"]["min"]) / _med(r)


def summarize_batch(label: str, batch: int, rows: list) -> dict:
  """Headline ratios of one (target, batch): ours vs each peer that ran, plain and speculative.
  Sets each row's vs_ours_plain / vs_hf_plain / vs_llamacpp_plain (None when that side did not
  run). A peer's best is over its dtypes and thread counts."""
  ours = [r for r in rows if r["library"] == OURS]
  ours_plain = max((r for r in ours if r["mode"] == "plain"), key=_med)      # fastest dtype
  out = {"target": label, "batch": batch, "ours_plain": _med(ours_plain),
         "ours_plain_dtype": ours_plain["dtype"], "noise_ours_plain": _spread(ours_plain)}
  plain_of = {}
  for lib, key in PEER_KEYS.items():
    theirs = [r for r in rows if r["library"] == lib]
    plains = [r for r in theirs if r["mode"] == "plain"]
    if not plains:
      continue
    best = plain_of[lib] = max(plains, key=_med)
    out.update({f"{key}_plain_best": _med(best), f"{key}_plain_best_dtype": best["dtype"],
                f"{key}_plain_best_threads": best["threads"],
                f"ours_over_{key}_plain": _med(ours_plain) / _med(best),
                f"noise_{key}_plain": _spread(best)})
    for mode in ("draft", "ngram"):
      o = [r for r in ours if r["mode"] == mode]
      h = [r for r in theirs if r["mode"] == mode]
      if o and h:
        hb = max(h, key=_med)
        out[f"{key}_{mode}_best"] = {"config": hb["config"], "threads": hb["threads"],
                                     "tokens_per_s": _med(hb), "dtype": hb["dtype"],
                                     "tau": hb.get("tau")}
        out[f"ours_over_{key}_{mode}"] = _med(max(o, key=_med)) / _med(hb)
  for mode in ("draft", "ngram"):
    o = [r for r in ours if r["mode"] == mode]
    if o:
      best = max(o, key=_med)
      out[f"ours_{mode}_best"] = {"config": best["config"], "tokens_per_s": _med(best),
                                  "speedup": _med(best) / _med(ours_plain), "tau": best["tau"],
                                  "dtype": best["dtype"]}
  for r in rows:
    r["vs_ours_plain"] = _med(r) / _med(ours_plain)
    for lib, key in PEER_KEYS.items():
      r[f"vs_{key}_plain"] = _med(r) / _med(plain_of[lib]) if lib in plain_of else None
  return out


def _agreement(r) -> str:
  if r["greedy_match"]:
    return "yes"
  prefix = r.get("greedy_prefix")
  return "NO" if prefix is None else f"NO ({100 * prefix:.0f} % before)"


def _ratio(x) -> str:
  return "-" if x is None else f"{x:.2f}x"


def format_peer(result: dict) -> str:
  """The peer suite's table and headline lines."""
  rows = sorted(result["rows"], key=lambda r: (r["target"], r["batch"],
                                               LIBRARY_ORDER.get(r["library"], 9),
                                               r.get("dtype", ""), r["threads"] or 0,
                                               r["mode"] != "plain", r["K"]))
  cells = [[r["target"], r["batch"], r["library"], r.get("dtype", "float32"), r["threads"] or "-",
            r["config"], fmt((r.get("reads_per_token_bytes") or 0) / 1e6, 1),
            f"{_med(r):.1f}",
            f"{r['tokens_per_s']['min']:.1f}-{r['tokens_per_s']['max']:.1f}",
            _ratio(r["vs_ours_plain"]), _ratio(r.get("vs_hf_plain")),
            _ratio(r.get("vs_llamacpp_plain")), fmt(r["tau"]),
            _agreement(r)] for r in rows]
  lines = [table(["target", "B", "library", "weights", "threads", "config", "MB read/token",
                  "tok/s", "min-max", "vs ours plain", "vs hf plain", "vs llama.cpp plain",
                  "tau", "greedy ="], cells), ""]
  names = {HF: "transformers", LLAMACPP: "llama.cpp"}
  for s in result["summary"]:
    lines.append(f"{s['target']} B={s['batch']}: ours plain {s['ours_plain']:.1f} tok/s "
                 f"({s.get('ours_plain_dtype', 'float32')}, our fastest; noise "
                 f"{100 * s['noise_ours_plain']:.0f} %)")
    for lib, key in PEER_KEYS.items():
      if f"{key}_plain_best" in s:
        lines.append(f"  vs {names[lib]} plain {s[f'{key}_plain_best']:.1f} "
                     f"({s[f'{key}_plain_best_threads']} threads, "
                     f"{s[f'{key}_plain_best_dtype']}; its best): "
                     f"{s[f'ours_over_{key}_plain']:.2f}x; noise "
                     f"{100 * s[f'noise_{key}_plain']:.0f} %")
    lines.append(f"  plain vs memory roofline: {s['ours_plain']:.1f} / "
                 f"{s['roofline_tokens_per_s']:.1f} tok/s = "
                 f"{100 * s['ours_plain_vs_roofline']:.0f} %")
    if "llamacpp_roofline_tokens_per_s" in s:
      lines.append(f"  llama.cpp plain vs the roofline of its GGUF bytes: "
                   f"{s['llamacpp_plain_best']:.1f} / {s['llamacpp_roofline_tokens_per_s']:.1f}"
                   f" tok/s = {100 * s['llamacpp_plain_vs_roofline']:.0f} %")
    for mode, name in (("draft", "assisted generation"), ("ngram", "prompt lookup")):
      if f"ours_{mode}_best" not in s:
        continue
      o = s[f"ours_{mode}_best"]
      for lib, key in PEER_KEYS.items():
        if f"ours_over_{key}_{mode}" in s:
          h = s[f"{key}_{mode}_best"]
          lines.append(f"  {name}: ours {o['config']} {o.get('dtype', '')} "
                       f"{o['tokens_per_s']:.1f} tok/s ({o['speedup']:.2f}x our fastest plain, "
                       f"tau {fmt(o['tau'])}) vs {names[lib]} {h['config']} "
                       f"{h['tokens_per_s']:.1f} ({h['threads']} threads, {h['dtype']}; its "
                       f"best): {s[f'ours_over_{key}_{mode}']:.2f}x")
  lines += [f"note: {n}" for n in result["notes"]]
  return "\n".join(lines)
