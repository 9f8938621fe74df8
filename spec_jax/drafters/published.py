"""sj.drafters.export: write a drafter as a published folder other engines load.

    sj.drafters.export(eagle3_heads, "out/eagle3-hf")                  # LlamaForCausalLMEagle3
    sj.drafters.export(dflash_drafter, "out/dflash-hf", format="dflash")   # DFlashDraftModel

`format` None picks the drafter's own (dflash for DFlash drafters, eagle3 otherwise). The
formats live in `spec_jax.drafters.eagle3_format` and `spec_jax.drafters.dflash_format`, each
beside its loader (`sj.drafters.load` reads both).
"""

from __future__ import annotations

import pathlib
from typing import Optional

FORMATS = ("eagle3", "dflash")


def export(drafter, out_dir, format: Optional[str] = None,
           overwrite: bool = False) -> pathlib.Path:
  """Writes `drafter` to `out_dir` (config.json + model.safetensors, atomically) in `format`.

  Raises ValueError for an unknown format, a drafter the format cannot hold, or an existing
  non-empty out_dir without overwrite=True. Returns the folder's path."""
  if format is None:
    format = "dflash" if getattr(drafter, "kind", None) == "dflash" else "eagle3"
  if format not in FORMATS:
    raise ValueError(f"export: unknown format {format!r}; allowed: {', '.join(FORMATS)}")
  if format == "dflash":
    from spec_jax.drafters import dflash_format
    return dflash_format.export(drafter, out_dir, overwrite=overwrite)
  from spec_jax.drafters import eagle3_format
  return eagle3_format.export(drafter, out_dir, format="eagle3", overwrite=overwrite)
