"""Multi-device generation: batch over a "data" mesh axis, weights and KV heads over "model".

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    out = sj.generate(target, prompts, drafter=..., mesh=mesh)

Megatron-style tensor parallelism expressed as GSPMD annotations: q/k/v and gate/up projections
are split along their output features (whole heads), o and down projections along their input
features, the KV cache along its kv heads, the vocabulary of the embedding and LM head along
"model". Rows of the batch live on their "data" shard. XLA inserts the collectives; results are
the same as on one device (tests/test_sharding.py checks greedy tokens on 8 CPU devices).
A weight whose split axis does not divide evenly by the "model" size stays replicated.
"""

from __future__ import annotations

from typing import Optional

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA, MODEL = "data", "model"

# Param leaf name -> which axis is split on "model", counted from the END of the leaf's shape,
# so that one table serves the target's stacked layers ([L, D, H*Dh]), a draft head's single
# layer ([D, H*Dh]: EAGLE / EAGLE-3 / MTP) and Medusa's per-head LM heads ([K, D, V]).
_MODEL_AXIS = {
    "wq": -1, "wk": -1, "wv": -1, "bq": -1, "bk": -1, "bv": -1, "wo": -2,
    "w_gate": -1, "w_up": -1, "w_down": -2, "embed": -2, "lm_head": -1,
}


def check_mesh(mesh: Optional[Mesh], batch: int) -> None:
  """Raises ValueError unless mesh has "data" and "model" axes and the batch divides "data"."""
  if mesh is None:
    return
  if not isinstance(mesh, Mesh):
    raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  missing = {DATA, MODEL} - set(mesh.axis_names)
  if missing:
    raise ValueError(f"mesh needs axes named 'data' and 'model' (size 1 is fine); it has "
                     f"{mesh.axis_names}, missing {sorted(missing)}")
  if batch % mesh.shape[DATA]:
    raise ValueError(f"the batch of {batch} rows does not divide over the mesh's data axis of "
                     f"size {mesh.shape[DATA]}: pad the batch or change the mesh")


def as_auto(mesh: Optional[Mesh]) -> Optional[Mesh]:
  """The same devices and axis names with Auto axis types: the engine annotates shardings for
  GSPMD to propagate (jax.make_mesh defaults to Explicit axes, which ask for explicit reshards)."""
  if mesh is None:
    return None
  auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
  if tuple(getattr(mesh, "axis_types", auto)) == auto:
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def _spec_for(name: str, shape, model_size: int) -> P:
  """The PartitionSpec of a param leaf named `name` with `shape`: one axis on "model" (see
  _MODEL_AXIS) when it divides, else replicated. Leaves of unexpected rank stay replicated."""
  axis = _MODEL_AXIS.get(name)
  if axis is None or len(shape) < -axis or shape[axis] % model_size:
    return P()
  spec = [None] * len(shape)
  spec[axis] = MODEL
  return P(*spec)


def param_shardings(mesh: Mesh, params):
  """NamedSharding per leaf of a model param tree (see the module docstring)."""
  model_size = mesh.shape[MODEL]

  def leaf(path, x):
    name = getattr(path[-1], "key", str(path[-1]))
    return NamedSharding(mesh, _spec_for(name, x.shape, model_size))
  return jax.tree_util.tree_map_with_path(leaf, params)


def shard_params(mesh: Optional[Mesh], params):
  if mesh is None or params is None:
    return params
  return jax.device_put(params, param_shardings(mesh, params))


def shard_rows(mesh: Optional[Mesh], tree):
  """Puts every array whose leading axis is the batch on the "data" axis; scalars replicated."""
  if mesh is None:
    return tree

  def leaf(x):
    spec = P(DATA) if getattr(x, "ndim", 0) >= 1 else P()
    return jax.device_put(x, NamedSharding(mesh, spec))
  return jax.tree.map(leaf, tree)


def replicate(mesh: Optional[Mesh], tree):
  if mesh is None:
    return tree
  return jax.device_put(tree, NamedSharding(mesh, P()))


def constrain_cache(mesh: Optional[Mesh], cache):
  """KV cache [L, B, S, Hkv, Dh]: rows on "data", kv heads on "model" (when they divide)."""
  if mesh is None:
    return cache
  heads_split = cache.k.shape[3] % mesh.shape[MODEL] == 0
  spec = P(None, DATA, None, MODEL if heads_split else None, None)
  sharding = NamedSharding(mesh, spec)
  return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, sharding), cache)
