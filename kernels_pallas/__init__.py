"""Verify attention: K+1 new queries per row against a KV cache. See dispatch.verify_attention."""

from kernels_pallas.dispatch import verify_attention
from kernels_pallas.pallas_gpu import verify_attention_pallas_gpu
from kernels_pallas.pallas_tpu import verify_attention_pallas_tpu
from kernels_pallas.reference import verify_attention_reference

__all__ = ["verify_attention", "verify_attention_pallas_gpu", "verify_attention_pallas_tpu",
           "verify_attention_reference"]
