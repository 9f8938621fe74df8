"""Aligned text tables (the terminal) and Markdown tables (reports): what every report prints
with (the bench's suites, eval)."""

from __future__ import annotations


def fmt(x, nd=2, none="-") -> str:
  """x with nd decimals, or `none` for None."""
  if x is None:
    return none
  return f"{x:.{nd}f}"


def table(headers, rows, markdown: bool = False) -> str:
  """Rows of cells under headers: right-aligned columns with a dashed rule (text), or a
  GitHub-flavoured Markdown table (markdown=True; '|' in a cell is escaped)."""
  if markdown:
    cell = lambda c: str(c).replace("|", "\\|")
    line = lambda cells: "| " + " | ".join(cell(c) for c in cells) + " |"
    return "\n".join([line(headers), "|" + "|".join(" --- " for _ in headers) + "|"]
                     + [line(r) for r in rows])
  widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
            for i, h in enumerate(headers)]
  line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))
  return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])
