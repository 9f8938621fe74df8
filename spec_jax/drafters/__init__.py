"""Draft sources. Each module implements the interface of spec_jax.drafters.base."""

from spec_jax.drafters.base import DraftContext, Drafter, PrefillInfo, VerifyInfo
from spec_jax.drafters.dflash import DFlash
from spec_jax.drafters.draft_model import DraftModel
from spec_jax.drafters.eagle import EAGLE, EAGLE3, EAGLE3Fused
from spec_jax.drafters.gemma4_assistant import Gemma4Assistant
from spec_jax.drafters.heads_io import HEAD_KINDS, load
from spec_jax.drafters.medusa import Medusa
from spec_jax.drafters.mtp import MTP
from spec_jax.drafters.ngram import NGram
from spec_jax.drafters.published import export
from spec_jax.drafters.widening import widen_heads

__all__ = ["Drafter", "DraftContext", "PrefillInfo", "VerifyInfo", "DraftModel", "NGram",
           "Medusa", "Gemma4Assistant", "EAGLE", "EAGLE3", "EAGLE3Fused", "MTP", "DFlash",
           "HEAD_KINDS", "load", "export", "widen_heads"]
