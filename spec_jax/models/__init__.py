"""Decoder-only transformers (model families behind one table), KV cache, loaders, tokenizers.

  families.py, family.py   the table of families and the Family record (what a family provides)
  llama/, gemma/           one folder per family: forward, cache layout, params, HF reading
  config.py                ModelConfig (model_type picks the family: config.family)
  transformer.py           sj.forward / init_params of any family; cache.py: sj.KVCache
  blocks.py                the building blocks families and draft heads share
  hf_reader.py, hf.py      the one Hugging Face reader; folders of any family -> config, params
  loading.py, gguf_file.py, llama2c.py, hf_export.py, layout.py, widen.py, model.py, prefill.py,
  matmul.py, tokenizers.py, chat.py
"""

from spec_jax.models.config import ModelConfig, SUPPORTED_MODEL_TYPES
from spec_jax.models.families import FAMILIES, family_of
from spec_jax.models.family import Family
from spec_jax.models.model import Model, init_model
from spec_jax.models.transformer import ForwardOutput, KVCache, forward, init_params
# The function shadows its module's name here: `spec_jax.models.widen` is the function (the
# public contract); the module is `sys.modules["spec_jax.models.widen"]`.
from spec_jax.models.widen import widen
