"""Model: a config, its params and (optionally) its tokenizer, bundled for the public API."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from spec_jax.models.config import ModelConfig
from spec_jax.models.transformer import init_params


@dataclasses.dataclass
class Model:
  """config: ModelConfig (hashable); params: pytree (its family's layout); tokenizer: a
  `spec_jax.models.tokenizers.Tokenizer` or None; mtp_params: native MTP module weights or None."""
  config: ModelConfig
  params: Any
  tokenizer: Optional[Any] = None
  mtp_params: Optional[Any] = None
  source: Optional[str] = None

  def encode(self, text: str) -> list[int]:
    """Text -> ids with the model's BOS convention. Needs a tokenizer."""
    if self.tokenizer is None:
      raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
    return self.tokenizer.encode(text, add_bos=True)

  def decode(self, ids) -> str:
    if self.tokenizer is None:
      raise ValueError("this model has no tokenizer to decode with")
    return self.tokenizer.decode(list(ids))

  def astype(self, dtype) -> "Model":
    """The same model with its floating params (and native MTP weights) in `dtype` ("float32"
    or "bfloat16") and config.dtype set to it (activations and KV cache follow); the model
    itself when it already is. ValueError for another dtype."""
    name = jnp.dtype(dtype).name
    if name not in ("float32", "bfloat16"):
      raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if name == self.config.dtype:
      return self
    cast = lambda tree: None if tree is None else jax.tree.map(
        lambda x: x.astype(name) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)
    return dataclasses.replace(self, config=self.config.replace(dtype=name),
                               params=cast(self.params), mtp_params=cast(self.mtp_params))


def init_model(config: ModelConfig, key=None) -> Model:
  """Random weights with the same structure a loaded checkpoint has."""
  if key is None:
    key = jax.random.key(0)
  return Model(config=config, params=init_params(config, key), tokenizer=None)
