"""Draft sources. Each module implements the interface of spec_jax.drafters.base; the registry
(spec_jax.drafters.registry) lists them and the trainable head kinds; formats/ reads and
writes them on disk."""

from spec_jax.drafters.base import DraftContext, Drafter, FrozenDrafter, PrefillInfo, VerifyInfo
from spec_jax.drafters.dflash import DFlash
from spec_jax.drafters.draft_model import DraftModel
from spec_jax.drafters.dspark import DSpark
from spec_jax.drafters.eagle import EAGLE, EAGLE3, EAGLE3Fused
from spec_jax.drafters.formats import export, load
from spec_jax.drafters.gemma4_assistant import Gemma4Assistant
from spec_jax.drafters.hybrid_mtp import HybridMTP
from spec_jax.drafters.lookup_first import LookupFirst
from spec_jax.drafters.medusa import Medusa
from spec_jax.drafters.mtp import MTP
from spec_jax.drafters.ngram import NGram
from spec_jax.drafters.registry import HEAD_KINDS, TREE_DRAFTERS
from spec_jax.drafters.widening import widen_heads

__all__ = ["Drafter", "FrozenDrafter", "DraftContext", "PrefillInfo", "VerifyInfo", "DraftModel",
           "NGram", "LookupFirst", "Medusa", "Gemma4Assistant", "EAGLE", "EAGLE3", "EAGLE3Fused",
           "MTP", "HybridMTP", "DFlash", "DSpark", "HEAD_KINDS", "TREE_DRAFTERS", "load", "export", "widen_heads"]
