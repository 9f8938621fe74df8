"""The llama family's execution layout of the weights: how its forward wants them stored on
this platform (the family record's prepare / prepare_model / execution_layout).

`execution_layout` turns the canonical params (spec_jax.models.llama.forward's docstring: stacked
[L] axes, [in, out] projections) into the layout the forward runs fastest on; forward,
decoder_layer and lm_head accept both layouts. Two entry points:

  prepare_params  the hook decode calls inside its jit, once per call, before the loop. On CPU
                  it builds the CPU layout there (transposed, unstacked: the host has the
                  memory); on an accelerator it leaves canonical params as they are, since a
                  fused copy built inside the jit lives beside the originals in HBM (issue 35:
                  w_gate|w_up alone is 7 GiB of temporaries for an 8B model).
  prepare_model   outside any jit, once: a Model whose params ARE the execution layout (fused
                  q|k|v and gate|up on accelerators), the canonical buffers donated so that the
                  fused ones replace them rather than sit beside them. The CLI and
                  `python -m spec_jax.aot` decode with these; prepare_params then returns them
                  unchanged.

Which platform: kernels_pallas.platform.current() (the backend, or the one an ahead-of-time
lowering sets), never jax.default_backend().
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import jax
import jax.numpy as jnp

from kernels_pallas import platform


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



def cpu_orientation(config) -> str:
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


def head_layer_layout(lp):
  """One drafter layer's params (an unstacked llama-style layer: wq, wk, wv, wo, w_gate,
  w_up, w_down [in, out]) in the target's CPU execution layout: fused q|k|v and gate|up,
  stored as cpu_orientation says. The same math; blocks.qkv_projections, swiglu_mlp and
  out_projection read either layout. On accelerators, and for a layer already prepared (or
  not of this form), lp as it is: a fused copy built inside the decode jit would sit beside
  the originals in HBM (prepare_params' docstring).

  Measured on this CPU (docs/speed.md, "The heads' weights in the target's CPU layout"): the
  78M widened target's EAGLE-3 head read its [768, 2048] bf16 weights at half the bytes per
  second of the target's [out, in] ones in the same decode."""
  if not platform.is_cpu() or not isinstance(lp, dict) or not all(
      k in lp for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")):
    return lp
  transpose = {"out_in": True, "in_out": False, "both": "both"}[cpu_orientation(None)]
  return fuse_layers(lp, transpose=transpose, chunks=cpu_weight_chunks())


def dense_layout(params, names):
  """params with each 2-D weight in `names` ([in, out], read through matmul.dense_named) stored as
  cpu_orientation says on CPU (`name_t` [out, in]); as they are elsewhere or when a name is
  absent or already prepared."""
  if not platform.is_cpu():
    return params
  orientation = cpu_orientation(None)
  out = dict(params)
  for name in names:
    w = out.get(name)
    if w is None or getattr(w, "ndim", 0) != 2 or orientation == "in_out":
      continue
    out[name + "_t"] = jnp.swapaxes(w, 0, 1)
    if orientation == "out_in":
      del out[name]
  return out


def is_prepared(params) -> bool:
  """Whether params are already in an execution layout (unstacked or fused)."""
  layers = params["layers"] if isinstance(params, dict) else None
  return isinstance(layers, (list, tuple)) or (
      isinstance(layers, dict) and ("wqkv" in layers or "wqkv_t" in layers))


def execution_layout(params, config, mesh=None):
  """The execution layout of `params` for the platform being lowered for (jittable; the
  weights' math is unchanged). Already-prepared params are returned as they are.

  Without a mesh: q/k/v and gate/up fused into one matmul each (fuse_layers); on CPU also the
  projections stored as cpu_orientation says ([out, in], [in, out] or both). With a mesh the
  canonical weights are kept (their partition table splits whole heads). On every platform the
  layers unstacked (unstack_layers): a static slice of a stacked weight inside the decode loop
  is materialised by XLA (CPU: per step; TPU: the slices of all layers live at once, measured
  at 6.5 GiB of temporaries for an 8B decode on v6e).
  """
  if is_prepared(params):
    return params
  cpu = platform.is_cpu()
  if mesh is None:
    layers = params["layers"]
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
  return unstack_layers(params)


def prepare_params(params, config, mesh=None):
  """decode's in-jit hook (module docstring): execution_layout on CPU; on accelerators the
  params as they are (canonical params are read directly, prepared ones stay prepared)."""
  if not platform.is_cpu():
    return params
  return execution_layout(params, config, mesh)


def prepare_model(model, mesh=None, donate: bool = True):
  """`model` with its params in the execution layout for this platform, built once outside
  any jit. On an accelerator the stacked canonical buffers are donated to the programs that
  fuse and unstack them, one weight group at a time (q|k|v, gate|up, then each other stacked
  leaf), so the peak is the weights plus the largest group, and the result replaces the
  originals rather than sitting beside them: the model passed in must not be used afterwards.
  On CPU (host memory) one jitted execution_layout. Returns the model itself when there is
  nothing to do (already prepared)."""
  params, config = model.params, model.config
  if is_prepared(params):
    return model
  if platform.is_cpu():
    params = jax.jit(execution_layout, static_argnums=(1, 2))(params, config, mesh)
  else:
    params = _unstack_in_groups(params, fuse=mesh is None, donate=donate)
  return dataclasses.replace(model, params=params)


_GROUPS = (("wqkv", ("wq", "wk", "wv")), ("bqkv", ("bq", "bk", "bv")),
           ("w_gu", ("w_gate", "w_up")))


def _unstack_in_groups(params, fuse: bool, donate: bool):
  """The accelerator layout (fused when `fuse`, [in, out], one dict per layer), one group of
  stacked weights at a time, each group donated to the program that rebuilds it."""
  layers = dict(params["layers"])
  num_layers = jax.tree.leaves(layers)[0].shape[0]
  groups = [g for g in _GROUPS if g[1][0] in layers] if fuse else []
  groups += [(name, (name,)) for name in sorted(layers) if not any(name in g[1] for g in groups)]

  def split(ws):
    return [jnp.concatenate([w[i] for w in ws], axis=-1) if len(ws) > 1 else ws[0][i]
            for i in range(num_layers)]

  run = jax.jit(split, donate_argnums=(0,) if donate else ())
  per_layer = [dict() for _ in range(num_layers)]
  for fused, parts in groups:
    with warnings.catch_warnings():       # donated buffers of another shape are freed, not reused
      warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
      for i, w in enumerate(run(tuple(layers.pop(p) for p in parts))):
        per_layer[i][fused] = w
  return dict(params, layers=per_layer)
