"""The execution layout of the weights: how a forward wants them stored on this backend.

`prepare_params` turns the canonical params (spec_jax.models.transformer's docstring: stacked
[L] axes, [in, out] projections) into the layout the forward runs fastest on, inside the
caller's jit, once per call and outside any decode loop; forward, decoder_layer and lm_head
accept both layouts.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from spec_jax.models.config import ModelConfig


def unstack_layers(params):
  """The same params with `layers` as a list of per-layer dicts (forward accepts both).

  XLA:CPU materialises a static slice of a stacked weight that feeds a dot: inside a decode
  loop every step would copy every layer's weights before reading them again (measured: about
  half the speed of a weight-streaming loop). Unstacking once per generate() call, outside the
  loop, costs one copy of the weights per call instead of one per token.
  """
  layers = params["layers"]
  if isinstance(layers, (list, tuple)):
    return params
  num_layers = jax.tree.leaves(layers)[0].shape[0]
  out = dict(params)
  out["layers"] = [jax.tree.map(lambda w: w[i], layers) for i in range(num_layers)]
  return out


def fuse_layers(layers, transpose, chunks: int = 1):
  """Stacked canonical layer weights -> the fused execution layout (same math).

  wq|wk|wv -> wqkv [L, D, (Hq+2Hkv)Dh] (bq|bk|bv -> bqkv), w_gate|w_up -> w_gu [L, D, 2F].
  transpose: False keeps every projection [in, out] (wqkv, wo, w_gu, w_down); True stores it
  [out, in] under a `_t` name (wqkv_t, wo_t, w_gu_t, w_down_t); "both" keeps both copies (twice
  the projection memory): the forward then reads [in, out] for one-row steps and [out, in] for
  more rows (pick_weight), the orientation XLA:CPU's dot is fastest with at each size
  (ORIENTATIONS). chunks > 1 (with transpose): each `_t` weight becomes a tuple of `chunks`
  row blocks [L, out/chunks, in] (fewer where out does not divide): XLA:CPU runs one small-M
  dot on one thread, but independent dots concurrently, so a projection split into row blocks
  streams its weights on every core (cpu_weight_chunks).
  """
  out = {k: v for k, v in layers.items()
         if k not in ("wq", "wk", "wv", "bq", "bk", "bv", "wo", "w_gate", "w_up", "w_down")}
  wqkv = jnp.concatenate([layers["wq"], layers["wk"], layers["wv"]], axis=-1)
  w_gu = jnp.concatenate([layers["w_gate"], layers["w_up"]], axis=-1)
  if "bq" in layers:
    out["bqkv"] = jnp.concatenate([layers["bq"], layers["bk"], layers["bv"]], axis=-1)
  if transpose is not True:
    out.update(wqkv=wqkv, wo=layers["wo"], w_gu=w_gu, w_down=layers["w_down"])
  if transpose:
    t = lambda w: _row_chunks(jnp.swapaxes(w, -1, -2), chunks)
    out.update(wqkv_t=t(wqkv), wo_t=t(layers["wo"]), w_gu_t=t(w_gu), w_down_t=t(layers["w_down"]))
  return out


def _row_chunks(w, chunks: int):
  """w [..., out, in] -> w itself (chunks 1) or a tuple of row blocks [..., out_i, in]."""
  n = w.shape[-2]
  chunks = max(1, min(int(chunks), n // 64))
  while n % chunks:
    chunks -= 1
  if chunks == 1:
    return w
  return tuple(jnp.split(w, chunks, axis=-2))


def cpu_weight_chunks() -> int:
  """Row blocks per projection weight in the CPU execution layout: $SPEC_JAX_CPU_WEIGHT_CHUNKS,
  default 1 (whole weights). A matmul-only microbenchmark on the 2-core machine (48 fp32
  weights, 302 MB) ran 25-40 % faster with 2-4 row blocks at T = 1..9, but whole decode and
  verify forwards of the 78M widened model showed no gain (T = 1: 19.9 / 23.2 / 21.9 ms with
  1 / 2 / 4 blocks, noisy), so the option stays off until a quiet measurement says otherwise."""
  env = os.environ.get("SPEC_JAX_CPU_WEIGHT_CHUNKS")
  return max(1, int(env)) if env else 1


ORIENTATIONS = ("out_in", "in_out", "both")



def cpu_orientation(config: ModelConfig) -> str:
  """How projections are stored on CPU: $SPEC_JAX_CPU_LAYOUT (one of ORIENTATIONS), else
  [out, in], the fastest in the whole model for both dtypes at every row count of decode and
  verify but two (scripts/step_layouts.py; docs/speed.md "the one-token step": for the 78M
  widened model in bf16 15.6 / 15.0 / 18.9 ms at T = 1 / 2 / 5 against 23.7 / 27.2 / 28.4 for
  [in, out]; in float32 [in, out] is ~10 % faster at T = 1-2 only)."""
  env = os.environ.get("SPEC_JAX_CPU_LAYOUT")
  if env:
    if env not in ORIENTATIONS:
      raise ValueError(f"SPEC_JAX_CPU_LAYOUT must be one of {ORIENTATIONS}, got {env!r}")
    return env
  del config
  return "out_in"


def prepare_params(params, config: ModelConfig, mesh=None):
  """The execution layout of `params` for this backend: computed inside the caller's jit once
  per call, outside any decode loop (forward, decoder_layer and lm_head accept both layouts).

  Without a mesh: q/k/v and gate/up fused into one matmul each (fuse_layers); on CPU also the
  projections stored as cpu_orientation says ([out, in], [in, out] or both) and the layers
  unstacked (see unstack_layers). With a mesh the canonical weights are kept (their partition
  table splits whole heads), unstacked on CPU. Already-prepared params are returned unchanged.
  Gemma configs: gemma.prepare_params.
  """
  if config.is_gemma:
    from spec_jax.models import gemma
    return gemma.prepare_params(params, config, mesh)
  layers = params["layers"]
  if isinstance(layers, (list, tuple)) or "wqkv" in layers or "wqkv_t" in layers:
    return params
  cpu = jax.default_backend() == "cpu"
  if mesh is None:
    out = dict(params)
    orientation = cpu_orientation(config) if cpu else "in_out"
    transpose = {"out_in": True, "in_out": False, "both": "both"}[orientation]
    out["layers"] = fuse_layers(layers, transpose=transpose,
                                chunks=cpu_weight_chunks() if cpu else 1)
    if transpose and "lm_head" in out:
      out["lm_head_t"] = jnp.swapaxes(out["lm_head"], 0, 1)
      if transpose is True:
        del out["lm_head"]
    params = out
  return unstack_layers(params) if cpu else params
