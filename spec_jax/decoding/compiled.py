"""Ahead-of-time compiled decode calls, cached once per shapes and static configuration, and
the CPU execution-layout cache of the weights: what generate() and the governor's calibration
time (compilation is never inside a timed call)."""

from __future__ import annotations

import functools
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import platform
from spec_jax import sharding as sharding_lib
from spec_jax.decoding.loop import decode
from spec_jax.decoding.prompts import padded_stops
from spec_jax.decoding.state import DecodeResult
from spec_jax.decoding.strategies import Strategy
from spec_jax.decoding.target import as_target, model_config
from spec_jax.drafters.base import Drafter
from spec_jax.models.layout import prepare_params
from spec_jax.sampling import Sampling

_DECODE_STATIC = ("config", "drafter", "num_draft", "capacity", "tree", "mesh", "greedy",
                  "governor", "strategy", "history", "processors")

_COMPILED: dict = {}   # tree signature -> PackedDecode (see _compiled_decode)


def clear_compiled() -> None:
  """Drops generate()'s compiled executables: the next call traces decode afresh (tests that
  patch the engine; long benchmarks bounding their memory)."""
  _COMPILED.clear()


def _as_int32(x):
  """Counts and token ids as int32 (exact); float32 fields bit for bit (unpacked by a view)."""
  if x.dtype == jnp.float32:
    return jax.lax.bitcast_convert_type(x, jnp.int32)
  assert jnp.issubdtype(x.dtype, jnp.integer) and jnp.iinfo(x.dtype).bits <= 32, x.dtype
  return x.astype(jnp.int32)


def _packed_decode(layout: list, *args, **kwargs) -> jax.Array:
  """decode, its DecodeResult packed into one int32 vector, so that generate() copies it to the
  host in one transfer (a copy per field cost ~0.2 ms a call in place, ~1 % of a 128-token
  stories260K decode; measured). layout receives (treedef, [(shape, dtype)]) at trace time."""
  leaves, treedef = jax.tree.flatten(decode(*args, **kwargs))
  layout[:] = [treedef, [(x.shape, x.dtype) for x in leaves]]
  return jnp.concatenate([jnp.ravel(_as_int32(x)) for x in leaves])


class PackedDecode:
  """An AOT-compiled decode whose call returns its DecodeResult as one int32 vector [N];
  `unpack` turns the host copy of that vector back into a DecodeResult of numpy arrays."""

  def __init__(self, compiled, treedef, shapes: list, compile_seconds: float = 0.0):
    self.compiled, self._treedef = compiled, treedef
    # Seconds spent tracing + compiling it (a persistent-cache hit still traces), and the part
    # no generate() has reported yet (take_compile_seconds): the governor's calibration
    # fetches it several times before generate runs it, and the compile is generate's.
    self.compile_seconds = self._unreported = compile_seconds
    self._layout, start = [], 0
    for shape, dtype in shapes:
      size = int(np.prod(shape, dtype=np.int64))
      self._layout.append((start, start + size, shape, np.dtype(dtype)))
      start += size

  def __call__(self, *args, **kwargs) -> jax.Array:
    return self.compiled(*args, **kwargs)

  def take_compile_seconds(self) -> float:
    """The compile seconds not yet reported (0.0 once taken: an executable in memory)."""
    seconds, self._unreported = self._unreported, 0.0
    return seconds

  def unpack(self, flat) -> DecodeResult:
    flat = np.asarray(flat)
    return jax.tree.unflatten(self._treedef, [
        (flat[a:b].astype(np.int32, copy=False).view(np.float32) if dtype == np.float32
         else flat[a:b].astype(dtype, copy=False)).reshape(shape)
        for a, b, shape, dtype in self._layout])


def _compiled_decode(args, static, params_signature=None) -> PackedDecode:
  """AOT-compiles once per (shapes, static config) so that timings exclude compilation.

  params_signature: tree_signature(args[0][0]), the target params, when the caller has it
  cached (execution_params); they are then not walked again."""
  positional, keywords = args
  if params_signature is None:
    params_signature = tree_signature(positional[0])
  # static items in the caller's (fixed) order; shapes and dtypes as they are (hashable). A
  # processor whose arrays are arguments is keyed by its shapes (a grammar's shape_key):
  # grammars of equal table sizes share one executable.
  keyed = {k: (tuple(getattr(p, "shape_key", lambda p=p: p)() for p in v)
               if k == "processors" else v) for k, v in static.items()}
  sig = (tuple(keyed.items()), params_signature, tree_signature((positional[1:], keywords)))
  hit = _COMPILED.get(sig)
  if hit is None:
    layout = []
    start = time.perf_counter()
    packed = jax.jit(functools.partial(_packed_decode, layout), static_argnames=_DECODE_STATIC)
    compiled = packed.lower(*positional, **keywords, **static).compile()
    hit = _COMPILED[sig] = PackedDecode(compiled, *layout,
                                        compile_seconds=time.perf_counter() - start)
  return hit


def tree_signature(tree) -> tuple:
  """(treedef, ((shape, dtype) of every leaf)): what a compiled call depends on."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple(map(_leaf_signature, leaves))


def _leaf_signature(x) -> tuple:
  """(shape, dtype) of an array leaf; ((), type) of a Python scalar."""
  try:
    return x.shape, x.dtype
  except AttributeError:
    return np.shape(x), type(x)


def _host(x, dtype):
  """A numpy array of dtype, unless x is already a jax array (then as it is)."""
  return x if isinstance(x, jax.Array) else np.asarray(x, dtype)


# _leaves_key(params) -> (weakrefs to every leaf, prepared params, their tree_signature)
_EXECUTION_PARAMS: dict = {}
_prepare_jit = jax.jit(prepare_params, static_argnums=(1,))


def execution_params(target, mesh=None):
  """target.params in the execution layout (models.layout.prepare_params), made once per model
  and cached while its weights live: on CPU without a mesh, where that layout is a transposed,
  unstacked copy of every weight. decode() prepares canonical params itself, inside its jit,
  once per call: for the 78M widened model that copy is ~0.3 s, a quarter of a 64-token
  generate() (measured; README Speed section). Costs a second copy of the weights in host
  memory. Elsewhere (accelerators, meshes) the params are returned as they are: decode reads
  canonical params directly (no second copy in HBM); models.layout.prepare_model builds the
  fused layout once, outside the jit, donating the canonical buffers.

  The cache is keyed by the identity of every leaf (arrays are immutable, so a params dict
  changed in place is a miss) and dropped when any of them is freed (_leaves_key)."""
  return _signed_execution_params(target, mesh)[0]


def _signed_execution_params(target, mesh=None) -> tuple:
  """(execution_params(target, mesh), their tree_signature or None when not cached): the
  cache hit that checks every leaf also saves generate() a second walk of the weights."""
  params = target.params
  config = model_config(as_target(target.config))
  if config is None or mesh is not None or not platform.is_cpu():
    return params, None
  layers = params.get("layers") if isinstance(params, dict) else None
  if not isinstance(layers, dict) or "wq" not in layers:     # already prepared, or not ours
    return params, None
  leaves = jax.tree.leaves(params)
  key = _leaves_key(params, leaves)
  hit = _EXECUTION_PARAMS.get(key)
  if hit is not None and all(r() is x for r, x in zip(hit[0], leaves)):
    return hit[1], hit[2]
  # Waited for here: otherwise the first timed decode would wait for this copy (~0.7 s for a
  # 135M model) and count it as decoding.
  prepared = jax.block_until_ready(_prepare_jit(params, config))
  _EXECUTION_PARAMS[key] = ([weakref.ref(x) for x in leaves], prepared, tree_signature(prepared))
  _drop_with_any_leaf(_EXECUTION_PARAMS, key, leaves)
  return prepared, _EXECUTION_PARAMS[key][2]


def _leaves_key(params, leaves) -> tuple:
  """A cache key of params by what they hold: the tree's structure and every leaf's identity.
  A new container of the same leaves (jax.tree.map(lambda x: x, p)) hits; one with a leaf
  replaced ({**p, "lm_head": new}) misses, and its entry goes with that leaf. (Keyed by the
  container's id and freed with one leaf, each such container kept a whole prepared copy of
  the weights alive as long as the model: +53 MiB per step of a loop tuning a head.)"""
  return jax.tree.structure(params), tuple(map(id, leaves))


def _drop_with_any_leaf(cache: dict, key, leaves) -> None:
  """Removes cache[key] as soon as any of `leaves` is freed."""
  for x in leaves:
    weakref.finalize(x, cache.pop, key, None)


# _leaves_key(drafter params) -> (weakrefs to every leaf, prepared params)
_DRAFTER_PARAMS: dict = {}


def static_drafter(drafter):
  """The drafter as a compiled program's static argument: its configuration with shape-only
  params (jax.ShapeDtypeStruct leaves). Executables are keyed by it (drafters compare by
  their static fields), and jax's caches keep their static arguments: with the drafter
  itself, a DraftModel's weights and their prepared copy stayed alive after the caller
  dropped it. decode reads the weights from its drafter_params argument only. A drafter that
  cannot be rebuilt so (a hand-written one) is used as it is."""
  if drafter is None or not hasattr(drafter, "with_params"):
    return drafter
  try:
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), drafter.params)
    stripped = drafter.with_params(shapes)
  except Exception:  # noqa: BLE001 - a drafter whose checks need real arrays: keep it whole
    return drafter
  return stripped if stripped == drafter else drafter


# One jitted prepare per drafter configuration (keyed by the static drafter), not one per
# params: a new jax.jit(drafter.prepare) compiled again for every new set of weights.
_prepare_drafter_jit = jax.jit(lambda drafter, params: drafter.prepare(params),
                               static_argnums=(0,))


def execution_drafter_params(drafter, mesh=None):
  """drafter.params after drafter.prepare (its execution layout: unstacked, and on CPU the
  projections stored [out, in] like the target's), made once per drafter outside the jit and
  cached while its weights live, as execution_params does for the target; decode's in-jit
  prepare then finds them prepared (every prepare is idempotent). Elsewhere (accelerators,
  meshes), and for drafters without a prepare of their own, drafter.params as they are."""
  if drafter is None:
    return None
  params = drafter.params
  leaves = jax.tree.leaves(params)
  if (mesh is not None or not platform.is_cpu() or not leaves
      or type(drafter).prepare is Drafter.prepare
      or not all(isinstance(x, jax.Array) for x in leaves)):
    return params
  key = _leaves_key(params, leaves)
  hit = _DRAFTER_PARAMS.get(key)
  if hit is not None and all(r() is x for r, x in zip(hit[0], leaves)):
    return hit[1]
  prepared = jax.block_until_ready(_prepare_drafter_jit(static_drafter(drafter), params))
  _DRAFTER_PARAMS[key] = ([weakref.ref(x) for x in leaves], prepared)
  _drop_with_any_leaf(_DRAFTER_PARAMS, key, leaves)
  return prepared


def compiled_decode_call(target, drafter, prompt_tokens, prompt_lens, key, *, max_new_tokens,
                         sampling: Sampling, stop, capacity: int, greedy: bool, mesh=None,
                         strategy: Strategy, round_costs=None, acceptance_prior=None,
                         history: bool = False, processors: tuple = ()) -> tuple:
  """(compiled decode, args, kwargs) of one call as generate() makes it: inputs placed for the
  mesh, max_new_tokens traced (one executable for every length), compiled ahead of time once
  per shapes and static configuration. The governor's calibration times this same executable.
  compiled(*args, **kwargs) returns the DecodeResult packed into one int32 vector;
  compiled.unpack(np.asarray(it)) is the DecodeResult (PackedDecode).

  prompt_tokens int32 [B, P], prompt_lens [B] (numpy or jax); sampling: per-row arrays [B];
  stop: int32 [N] (padded to a STOP_BUCKET multiple with -1s: one executable for any short
  list); strategy: the bound Strategy (strategies.strategy_for); round_costs: float32
  [len(candidates)] or None; acceptance_prior: float32 [W] or None (the governor's learned
  prior; generate passes -1s for none, so both share one executable); history: (static) carry the penalties' token history
  (Sampling.needs_history of the host settings); processors: (static) LogitsProcessors, their
  params passed as arguments (one executable per processors' shapes)."""
  drafter_params = execution_drafter_params(drafter, mesh)
  # Host arrays stay numpy: the compiled call transfers them itself (an eager jnp op per input
  # would cost a dispatch each; generate()'s overhead over a bare decode is measured).
  params, params_signature = _signed_execution_params(target, mesh)
  args = (sharding_lib.shard_params(mesh, params),
          *sharding_lib.shard_rows(mesh, (_host(prompt_tokens, np.int32),
                                          _host(prompt_lens, np.int32))),
          sharding_lib.replicate(mesh, key))
  kwargs = dict(drafter_params=sharding_lib.shard_params(mesh, drafter_params),
                max_new_tokens=sharding_lib.replicate(mesh, np.asarray(max_new_tokens, np.int32)),
                sampling=sharding_lib.shard_rows(mesh, sampling),
                stop_tokens=sharding_lib.replicate(mesh, padded_stops(stop)))
  static = dict(config=target.config, drafter=static_drafter(drafter), strategy=strategy,
                capacity=capacity,
                mesh=mesh, greedy=greedy, history=bool(history), processors=tuple(processors))
  if processors:
    kwargs["processor_params"] = sharding_lib.replicate(
        mesh, tuple(jax.tree.map(lambda x: x if isinstance(x, jax.Array) else np.asarray(x),
                                 p.params) for p in processors))
  if round_costs is not None:
    kwargs["round_costs"] = sharding_lib.replicate(mesh, np.asarray(round_costs, np.float32))
  if acceptance_prior is not None:
    kwargs["acceptance_prior"] = sharding_lib.replicate(
        mesh, np.asarray(acceptance_prior, np.float32))
  return _compiled_decode((args, kwargs), static, params_signature), args, kwargs
