"""Figures as PNG bytes, with matplotlib (the optional `plot` extra) on its Agg backend.

Each function takes plain data (labels -> points), draws one figure with labelled axes, units
and a legend, and writes it atomically. Without matplotlib, have_matplotlib() is False and
callers say PLOTS_HINT instead of drawing.
"""

from __future__ import annotations

import io

from spec_jax.files import atomic_write_bytes

PLOTS_HINT = ("plots need matplotlib: pip install 'spec_jax[plot]' (or pip install matplotlib), "
              "then rerun the same command: finished measurements are reused")
_STYLES = {"p50": "-", "p90": "--", "p99": ":"}


def have_matplotlib() -> bool:
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    return False
  return True


def _pyplot():
  import matplotlib
  matplotlib.use("Agg", force=True)
  import matplotlib.pyplot as plt
  return plt


def _save(fig, path) -> None:
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
  _pyplot().close(fig)
  atomic_write_bytes(path, buf.getvalue())


def _batch_axis(ax, batches) -> None:
  """x axis over batch sizes: log2-spaced, ticks at the measured sizes."""
  if len(batches) > 1 and min(batches) > 0:
    ax.set_xscale("log", base=2)
  ax.set_xticks(batches)
  ax.set_xticklabels([str(b) for b in batches])
  ax.set_xlabel("batch size (concurrent requests)")


def speedup_vs_batch(series: dict, title: str, path) -> None:
  """series: drafter label -> [(batch, speedup over plain decoding)]; plain decoding is drawn
  as the 1.0x line."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(7, 4.2))
  batches = sorted({b for pts in series.values() for b, _ in pts})
  ax.axhline(1.0, color="black", linestyle="--", linewidth=1.2, label="plain decoding (1.0×)")
  top = 1.0
  for label, pts in series.items():
    pts = sorted(pts)
    ax.plot([b for b, _ in pts], [s for _, s in pts], marker="o", linewidth=2, label=label)
    for b, s in pts:
      ax.annotate(f"{s:.2f}×", (b, s), textcoords="offset points", xytext=(0, 7),
                  ha="center", fontsize=8)
      top = max(top, s)
  _batch_axis(ax, batches)
  ax.set_ylabel("speedup over plain decoding (×, wall time)")
  ax.set_ylim(0, top * 1.2)
  ax.set_title(title, fontsize=10)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8, loc="lower left")
  _save(fig, path)


def bars_per_category(values: dict, categories: list, title: str, ylabel: str, path,
                      baseline: float = None, baseline_label: str = None,
                      band: tuple = None, band_label: str = None) -> None:
  """values: series label -> {category: value}; grouped bars, one group per category; an
  optional horizontal reference line (e.g. tau = 1 for plain decoding) and an optional shaded
  band (lo, hi) around it (plain decoding's own noise)."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(max(7, 0.7 * len(categories) * max(1, len(values))), 4.2))
  width = 0.8 / max(1, len(values))
  for i, (label, per_cat) in enumerate(values.items()):
    xs = [c + (i - (len(values) - 1) / 2) * width for c in range(len(categories))]
    ys = [per_cat.get(cat, float("nan")) for cat in categories]
    bars = ax.bar(xs, ys, width=width * 0.95, label=label)
    ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
  if baseline is not None:
    ax.axhline(baseline, color="black", linestyle="--", linewidth=1.2, label=baseline_label)
  if band is not None:
    ax.axhspan(band[0], band[1], color="grey", alpha=0.25, label=band_label)
  ax.set_xticks(range(len(categories)))
  ax.set_xticklabels(categories, rotation=30, ha="right")
  ax.set_xlabel("prompt category")
  ax.set_ylabel(ylabel)
  ax.set_ylim(0, max([baseline or 0] + [v for d in values.values() for v in d.values()]) * 1.2)
  ax.set_title(title, fontsize=10)
  ax.grid(True, axis="y", alpha=0.3)
  ax.legend(fontsize=8)
  _save(fig, path)


def percentiles_vs_batch(series: dict, title: str, ylabel: str, path) -> None:
  """series: label -> {'p50': [(batch, value)], 'p90': [...], 'p99': [...]}; one colour per
  label, one line style per percentile."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(7, 4.2))
  batches = set()
  for i, (label, per_q) in enumerate(series.items()):
    color = f"C{i}"
    for q, pts in per_q.items():
      pts = sorted(pts)
      batches |= {b for b, _ in pts}
      ax.plot([b for b, _ in pts], [v for _, v in pts], color=color,
              linestyle=_STYLES.get(q, "-"), marker="o", markersize=4, label=f"{label} {q}")
  _batch_axis(ax, sorted(batches))
  ax.set_ylabel(ylabel)
  ax.set_ylim(bottom=0)
  ax.set_title(title, fontsize=10)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  _save(fig, path)
