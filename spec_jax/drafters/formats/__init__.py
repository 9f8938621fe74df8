"""Drafter folders on disk: `sj.drafters.load` reads every format, `sj.drafters.export` writes
the published ones. Each format is one module over the shared Hugging Face reader
(`spec_jax.models.hf_reader`: config.json, safetensors, the per-layer name map):

  heads_folder       the library's own trained heads (heads.json + orbax params), any
                     registry kind (train.distill_heads writes them)
  eagle3             public EAGLE-3 folders (LlamaForCausalLMEagle3): load and export
  dflash             published DFlash folders (DFlashDraftModel): load and export
  dspark             DeepSpec's DSpark / DFlash folders (Qwen3DSparkModel): load and export
  gemma4_assistant   Gemma 4 assistant folders (model_type gemma4_assistant): load
  native MTP         a Hugging Face folder whose checkpoint carries MTP weights (mtp.*)

    drafter = sj.drafters.load(path, target)
    sj.drafters.export(drafter, out_dir, format="eagle3" | "dflash" | "dspark", target=...)
"""

from __future__ import annotations

import os
import pathlib
from typing import Optional

from spec_jax.drafters.formats import dflash, dspark, eagle3, gemma4_assistant, heads_folder
from spec_jax.drafters import hybrid_mtp
from spec_jax.drafters.hybrid_mtp import HybridMTP
from spec_jax.drafters.mtp import MTP
from spec_jax.models.loading import load as load_model

EXPORT_FORMATS = ("eagle3", "dflash", "dspark")


def load(path, target, greedy_drafts: bool = False):
  """The drafter stored at `path`, for `target` (a Model).

  `path` is a heads folder (heads.json + its params folder) or a training out_dir holding one in
  `heads/`; or a public EAGLE-3 folder (config.json with architectures
  ["LlamaForCausalLMEagle3"]); or a published DFlash folder (architectures
  ["DFlashDraftModel"]); or a DeepSpec DSpark folder (["Qwen3DSparkModel"]); or a Gemma 4
  assistant folder (model_type "gemma4_assistant"); or a
  Hugging Face folder whose checkpoint carries MTP weights (its native head).
  Raises ValueError when `target` differs from the model the heads were trained on, or the
  folder is none of these.
  """
  path = pathlib.Path(os.fspath(path)).expanduser().absolute()
  if not heads_folder.is_heads_folder(path) and heads_folder.is_heads_folder(path / "heads"):
    path = path / "heads"
  if heads_folder.is_heads_folder(path):
    return heads_folder.load(path, target, greedy_drafts=greedy_drafts)
  if not (path / "config.json").is_file():
    raise ValueError(f"{path}: no {heads_folder.META} (not a folder saved by "
                     "train.distill_heads) and no config.json (not a public EAGLE-3 or DFlash "
                     "folder nor a Hugging Face folder with MTP weights)")
  if gemma4_assistant.is_assistant_folder(path):
    return gemma4_assistant.load(path, target, greedy_drafts=greedy_drafts)
  if eagle3.is_eagle3_folder(path):
    return eagle3.load_eagle3(path, target, greedy_drafts=greedy_drafts)
  if dflash.is_dflash_folder(path):
    return dflash.load_dflash(path, target, greedy_drafts=greedy_drafts)
  if dspark.is_dspark_folder(path):
    return dspark.load_dspark(path, target, greedy_drafts=greedy_drafts)
  return load_native_mtp(path, target, greedy_drafts)


def load_native_mtp(path: pathlib.Path, target, greedy_drafts: bool = False):
  """The MTP module of the Hugging Face folder `path` (the target's own when it was loaded
  from there), checked to belong to `target`."""
  # A hybrid target (Qwen3-Next / Qwen3.5) has its own MTP module: gated attention, MoE.
  native = HybridMTP if hybrid_mtp.is_hybrid(target.config) else MTP
  if getattr(target, "mtp_params", None) and target.source and \
      pathlib.Path(target.source).absolute() == path:
    return native.from_model(target, greedy_drafts=greedy_drafts)
  model = load_model(path, dtype=target.config.dtype)
  heads_folder.check_fingerprint(heads_folder.fingerprint(model), target,
                                 what=f"the MTP module of {path}")
  return native.from_model(model, greedy_drafts=greedy_drafts)


def export(drafter, out_dir, format: Optional[str] = None,
           overwrite: bool = False, target=None) -> pathlib.Path:
  """Writes `drafter` to `out_dir` (config.json + model.safetensors, atomically) in `format`
  ("eagle3": LlamaForCausalLMEagle3 for EAGLE3 heads; "dflash": DFlashDraftModel; "dspark":
  DeepSpec's Qwen3DSparkModel, which carries copies of the target's embedding and LM head, so
  it needs `target`; None: the drafter's own, dflash / dspark for those drafters, eagle3
  otherwise).

  Raises ValueError for an unknown format, a drafter the format cannot hold, or an existing
  non-empty out_dir without overwrite=True. Returns the folder's path."""
  if format is None:
    kind = getattr(drafter, "kind", None)
    format = kind if kind in ("dflash", "dspark") else "eagle3"
  if format not in EXPORT_FORMATS:
    raise ValueError(f"export: unknown format {format!r}; allowed: {', '.join(EXPORT_FORMATS)}")
  if format == "dflash":
    return dflash.export(drafter, out_dir, overwrite=overwrite)
  if format == "dspark":
    if target is None:
      raise ValueError("export: format 'dspark' needs target= (DeepSpec's folders carry the "
                       "target's embedding and LM head, which the drafter does not hold)")
    return dspark.export(drafter, out_dir, target, overwrite=overwrite)
  return eagle3.export(drafter, out_dir, format="eagle3", overwrite=overwrite)
