"""Markdown memory table from `python -m spec_jax.aot ... --json FILE` lines (docs/accelerators.md).

    python scripts/aot_table.py docs/measurements/aot/results.jsonl
"""

import json
import sys

G = 2 ** 30


def row(r: dict) -> str:
  c = r.get("compiled") or {}
  base = r["weights"] + r["kv_cache"]
  resident = base + r["drafter_weights"] + r["state"]
  temps = c.get("temporaries")
  dev = r.get("device_bytes")
  cells = [r["label"], r["platform"] + (f" {r['mesh']}" if r["mesh"] else ""),
           f"{r['weights'] / G:.2f}", f"{r['kv_cache'] / G:.2f}",
           f"{(r['drafter_weights'] + r['state']) / G:.2f}",
           "—" if temps is None else f"{temps / G:.2f} ({100 * temps / base:.0f} %)",
           "—" if temps is None else f"{(r['peak'] - resident) / G:.2f} "
                                     f"({100 * (r['peak'] - resident) / base:.0f} %)",
           "—" if temps is None else f"{r['peak'] / G:.2f}",
           "—" if not dev else f"{dev / G:.1f}",
           "—" if temps is None else ("yes" if r["fits"] else "NO"),
           str(r["kernel_calls"])]
  return "| " + " | ".join(cells) + " |"


def main(path: str) -> None:
  print("| decode | platform, mesh | weights | KV | drafter + state | temporaries (% of W+KV) "
        "| beyond W, KV, state (%) | peak | HBM | fits | kernel calls |")
  print("|" + "---|" * 11)
  for line in open(path):
    print(row(json.loads(line)))


if __name__ == "__main__":
  main(sys.argv[1])
