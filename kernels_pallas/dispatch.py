"""verify_attention: validates inputs and picks the kernel for the backend."""

from __future__ import annotations

from kernels_pallas.reference import verify_attention_reference

IMPLS = ("auto", "pallas", "reference")


def verify_attention(q, k_cache, v_cache, kv_lengths, tree_mask=None, impl="auto"):
  """See ../shared/DESIGN.md. q [B,T,Hq,D]; k_cache, v_cache [B,S,Hkv,D]; kv_lengths int32[B]."""
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  return verify_attention_reference(q, k_cache, v_cache, kv_lengths, tree_mask)
