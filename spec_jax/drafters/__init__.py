"""Draft sources. Each module implements the interface of spec_jax.drafters.base."""

from spec_jax.drafters.base import DraftContext, Drafter, PrefillInfo, VerifyInfo
from spec_jax.drafters.draft_model import DraftModel
from spec_jax.drafters.ngram import NGram

__all__ = ["Drafter", "DraftContext", "PrefillInfo", "VerifyInfo", "DraftModel", "NGram"]
