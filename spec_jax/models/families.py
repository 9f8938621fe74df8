"""The one table of model families: a family is a folder and a line here.

ModelConfig.model_type picks the family (`config.family`, `family_of`); a Hugging Face
folder's config.json model_type picks it when loading (`family_for_hf`).
"""

from __future__ import annotations

from typing import Optional

from spec_jax.models import gemma, llama, qwen3_next
from spec_jax.models.family import Family

FAMILIES = {f.name: f for f in (
    llama.FAMILY,
    gemma.FAMILY,
    qwen3_next.FAMILY,
)}

SUPPORTED_MODEL_TYPES = tuple(t for f in FAMILIES.values() for t in f.model_types)
HF_MODEL_TYPES = tuple(t for f in FAMILIES.values() for t in f.hf_model_types)
_BY_TYPE = {t: f for f in FAMILIES.values() for t in f.model_types}
_BY_HF_TYPE = {t: f for f in FAMILIES.values() for t in f.hf_model_types}


def family_of(model_type: str) -> Family:
  """The family of a ModelConfig.model_type; ValueError naming the supported ones."""
  family = _BY_TYPE.get(model_type)
  if family is None:
    raise ValueError(f"unsupported model_type {model_type!r}; supported: "
                     f"{', '.join(SUPPORTED_MODEL_TYPES)}")
  return family


def family_for_hf(hf_model_type) -> Optional[Family]:
  """The family that reads a config.json of this model_type, None when none does."""
  return _BY_HF_TYPE.get(hf_model_type)
