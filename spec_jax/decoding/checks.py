"""Checks of a decode call's static arguments, shared by decode, generate and the strategies so
that their messages agree: each raises ValueError naming what was wrong and what is allowed,
before anything is traced or compiled."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

INT32_MAX = 2**31 - 1


def is_static_int(x) -> bool:
  return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, bool)


def check_key(key) -> None:
  """Raises ValueError unless `key` is one typed jax PRNG key (jax.random.key(seed)), traced
  or not."""
  if not (isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
          and key.shape == ()):
    raise ValueError(f"key must be a jax PRNG key (one jax.random.key(seed)), got "
                     f"{getattr(key, 'dtype', type(key).__name__)} of shape "
                     f"{getattr(key, 'shape', None)}")


def check_capacity(capacity, longest_prompt: int, max_new_tokens: int, k: int) -> None:
  """Raises ValueError unless the KV cache holds prompt + max_new_tokens + a K+1 verify block."""
  if not is_static_int(capacity) or not 1 <= capacity <= INT32_MAX:
    raise ValueError(f"capacity must be a positive integer below 2**31 (the KV-cache length "
                     f"S), got {capacity!r}")
  needed = longest_prompt + max_new_tokens + k + 1
  if capacity < needed:
    raise ValueError(f"capacity {capacity} is too small: the longest prompt ({longest_prompt}) + "
                     f"max_new_tokens ({max_new_tokens}) + K+1 ({k + 1}; a tree's cache_extent "
                     f"+ 1) needs {needed}")


def as_token_ids(values, what: str) -> list:
  """A 1-D sequence of integral values -> list[int]; ValueError on anything else (a bare
  integer too: `generate(t, [1, 403, 407])` would otherwise be three one-token prompts)."""
  arr = np.asarray(values)
  if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer) or
                                 np.issubdtype(arr.dtype, np.floating) or arr.dtype == bool):
    raise ValueError(f"{what} must hold integer token ids, got {values!r}")
  if arr.dtype == bool:
    raise ValueError(f"{what} must hold integer token ids, got booleans")
  if arr.ndim != 1:
    hint = ("; prompts is a list of prompts, so one prompt of token ids is [[1, 403, ...]]"
            if arr.ndim == 0 and what.startswith("prompt") else "")
    raise ValueError(f"{what} must be a flat list of token ids, got {values!r} ({arr.ndim} "
                     f"dimensions){hint}")
  if np.issubdtype(arr.dtype, np.floating) and not np.all(np.equal(np.mod(arr, 1), 0)):
    raise ValueError(f"{what} must hold integer token ids, got non-integral values "
                     f"{arr.reshape(-1)[np.mod(arr.reshape(-1), 1) != 0][:5].tolist()}")
  return [int(t) for t in arr.tolist()]
