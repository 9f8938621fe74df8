"""Decoder-only transformer, KV cache, checkpoint loaders and tokenizers."""

from spec_jax.models.config import ModelConfig, SUPPORTED_MODEL_TYPES
from spec_jax.models.families import FAMILIES, family_of
from spec_jax.models.family import Family
from spec_jax.models.model import Model, init_model
from spec_jax.models.transformer import ForwardOutput, KVCache, forward, init_params
# The function shadows its module's name here: `spec_jax.models.widen` is the function (the
# public contract); the module is `sys.modules["spec_jax.models.widen"]`.
from spec_jax.models.widen import widen
