"""spec_jax: lossless speculative decoding in pure JAX.

    import spec_jax as sj
    model = sj.load("../shared/models/stories260K")
    out = sj.generate(model, ["Once upon a time"], drafter=sj.drafters.NGram(), num_draft=4)
"""

from spec_jax import constraints, processors, sampling
from spec_jax.models import ForwardOutput, KVCache, Model, ModelConfig, forward, init_model
from spec_jax.models.loading import load
from spec_jax.rejection import rejection_sample
from spec_jax.sampling import Sampling

__all__ = ["ModelConfig", "Model", "KVCache", "ForwardOutput", "forward", "init_model", "load",
           "Sampling", "sampling", "rejection_sample", "constraints", "processors"]

from spec_jax import drafters
from spec_jax.decoding import strategies
from spec_jax.decoding.calibration import calibrate
from spec_jax.decoding.generate import GenerateOutput, generate, new_tokens
from spec_jax.decoding.loop import decode
from spec_jax.decoding.prompts import prepare_batch
from spec_jax.decoding.state import DecodeResult
from spec_jax.decoding.strategies import Chain, Governed, Strategy, Tree
from spec_jax.decoding.target import ModelTarget, Target
from spec_jax.governor import CostTable, Governor
from spec_jax.stats import SpecStats
from spec_jax.tree import DraftTree, TreeSpec

__all__ += ["drafters", "decode", "DecodeResult", "new_tokens", "generate", "GenerateOutput",
            "prepare_batch", "Target", "ModelTarget", "SpecStats", "Governor", "calibrate",
            "CostTable", "TreeSpec", "DraftTree", "strategies", "Strategy", "Chain", "Tree",
            "Governed"]
