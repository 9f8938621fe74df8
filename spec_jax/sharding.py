"""Multi-device generation: batch over a "data" mesh axis, weights and KV heads over "model".

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    out = sj.generate(target, prompts, drafter=..., mesh=mesh)

Megatron-style tensor parallelism expressed as GSPMD annotations: q/k/v and gate/up projections
are split along their output features, o and down projections along their input features,
the KV cache along its kv heads, the vocabulary of the embedding and LM head along "model".
Rows of the batch live on their "data" shard. XLA inserts the collectives; results are the same
as on one device (tests/test_sharding.py checks greedy tokens on 8 CPU devices).
A weight whose split axis does not divide evenly by the "model" size stays replicated. The
split is by features, so it keeps whole heads only where the heads divide by "model" (6 heads
of 16 over model=4 put 1.5 heads on each device: still exact, XLA gathers what a head needs,
but the KV cache of those 3 kv heads stays whole).

A mesh may span several processes (a TPU pod slice, several GPU hosts, or
`python -m spec_jax.launch`): build it after `spec_jax.distributed.initialize()` from all of
jax.devices(), e.g. with `make_mesh(data=8, model=1)` or `parse_mesh("data=8,model=1")`; the
placement functions below then take each host's identical copy of an array and keep the slices
its own devices hold (see spec_jax.global_batch for the rows every process feeds).
"""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA, MODEL = "data", "model"

# Param leaf name -> which axis is split on "model", counted from the end, so that stacked [L, ...]
# layer weights and the single-layer 2-D weights of EAGLE / EAGLE-3 / MTP heads both resolve.
_MODEL_AXIS = {
    "wq": -1, "wk": -1, "wv": -1, "bq": -1, "bk": -1, "bv": -1, "wo": -2,
    "w_gate": -1, "w_up": -1, "w_down": -2, "embed": -2, "lm_head": -1,
    "embed_per_layer": -2,          # Gemma 4 per-layer embeddings [V, L*P]: split like embed
    # Hybrid (models.qwen3_next): Gated DeltaNet projections by output features (w_z, w_b, w_a
    # by value heads; w_qkv by conv channels, which GSPMD regathers where q | k | v split),
    # w_out by its input (value heads); the MoE's experts [E, ...] on "model" (expert
    # parallelism: each shard computes its experts, the weighted sum reduces); the shared
    # expert like a dense MLP. conv_w, dt_bias, A_log, gnorm, router stay replicated (small).
    "w_qkv": -1, "w_z": -1, "w_b": -1, "w_a": -1, "w_out": -2,
    "experts_gate": -3, "experts_up": -3, "experts_down": -3,
    "shared_gate": -1, "shared_up": -1, "shared_down": -2,
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


def parse_mesh_spec(text: str) -> dict:
  """'data=8,model=1' -> {'data': 8, 'model': 1} (a missing axis is 1); ValueError on anything
  else. Only the syntax is checked here: make_mesh checks the sizes against the devices."""
  sizes = {}
  for part in str(text).split(","):
    name, eq, value = part.strip().partition("=")
    if not eq or name not in (DATA, MODEL) or name in sizes:
      raise ValueError(f"a mesh is written data=N,model=M (each at most once, model optional), "
                       f"got {text!r}")
    try:
      sizes[name] = int(value)
    except ValueError:
      sizes[name] = 0
    if sizes[name] < 1 or value.strip() != str(sizes[name]):
      raise ValueError(f"mesh axis sizes must be integers >= 1, got {name}={value.strip()!r} "
                       f"in {text!r}")
  return {DATA: sizes.get(DATA, 1), MODEL: sizes.get(MODEL, 1)}


def make_mesh(data: int = 1, model: int = 1) -> Mesh:
  """A ("data", "model") mesh over every device of every process (jax.devices()), Auto axes.

  data * model must equal jax.device_count() (ValueError otherwise, naming the count)."""
  for name, n in ((DATA, data), (MODEL, model)):
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
      raise ValueError(f"mesh axis {name} must be an integer >= 1, got {n!r}")
  count = jax.device_count()
  if data * model != count:
    raise ValueError(f"a mesh of data={data} x model={model} needs {data * model} devices; "
                     f"there are {count} ({jax.process_count()} process(es) x "
                     f"{jax.local_device_count()} local device(s)): make data x model = {count}")
  auto = (jax.sharding.AxisType.Auto,) * 2
  return jax.make_mesh((int(data), int(model)), (DATA, MODEL), axis_types=auto)


def parse_mesh(text: Optional[str]) -> Optional[Mesh]:
  """The command lines' --mesh data=N,model=M -> a Mesh over all devices (None -> None)."""
  if text is None:
    return None
  return make_mesh(**parse_mesh_spec(text))


def spans_processes(mesh: Optional[Mesh]) -> bool:
  """Whether the mesh holds devices of more than one process (then every process must make
  the same calls, in the same order, with its own rows: see spec_jax.global_batch)."""
  if mesh is None:
    return False
  return len({d.process_index for d in mesh.devices.flat}) > 1


def _put(x, sharding: NamedSharding):
  """device_put that also takes typed PRNG keys onto a multi-process sharding (jax refuses a
  key array there; its raw key data is fine)."""
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    data = jax.device_put(np.asarray(jax.random.key_data(x)), sharding)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  return jax.device_put(x, sharding)


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
    return _put(x, NamedSharding(mesh, spec))
  return jax.tree.map(leaf, tree)


def replicate(mesh: Optional[Mesh], tree):
  """Every leaf whole on every device of the mesh (PRNG keys included)."""
  if mesh is None:
    return tree
  sharding = NamedSharding(mesh, P())
  return jax.tree.map(lambda x: _put(x, sharding), tree)


def constrain_features(mesh: Optional[Mesh], x):
  """Sharding annotation of a prompt-feature buffer [B, P, D] (the prefill's hidden states kept
  for a drafter): rows on "data", D on "model" where they divide. Under tensor parallelism the
  residual stream is whole on every device, so without it each [B, P, D] buffer that outlives
  the prefill (EAGLE-3 keeps three) is whole on every device too (8B, B = 8, P = 512: 32 MiB
  each); split on D, a chunk's write is each device's own slice (no communication)."""
  if mesh is None:
    return x
  rows = DATA if x.shape[0] % mesh.shape[DATA] == 0 else None
  feats = MODEL if x.shape[-1] % mesh.shape[MODEL] == 0 else None
  spec = P(rows, *([None] * (x.ndim - 2)), feats)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
