"""Resumable training state with orbax: CheckpointManager over {params, opt_state, step}.

The pytree is saved as its flat list of leaves ({"0": leaf, "1": ...}) and rebuilt with the
treedef of a freshly initialised state, so optax's named-tuple states (and their empty nodes)
round-trip exactly. Saves are synchronous: after save() returns the step is on disk, so a run
killed later resumes from it.

Leaves are saved as the jax.Arrays they are and restored with the shardings of the `like`
state: on a mesh over several processes every process calls save and restore (orbax's
multi-host checkpointing; the directory must be shared), and a run restored on another mesh
gets its arrays placed for that mesh.
"""

from __future__ import annotations

import pathlib
from typing import Optional

import jax
import numpy as np
import orbax.checkpoint as ocp


class TrainCheckpoints:
  def __init__(self, directory, every: int, keep: int = 2):
    self.directory = pathlib.Path(directory).absolute()
    self.directory.mkdir(parents=True, exist_ok=True)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False)
    self.manager = ocp.CheckpointManager(self.directory, options=options)
    self.every = int(every)

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def save(self, step: int, state) -> None:
    leaves = jax.tree.leaves(state)
    flat = {str(i): x if isinstance(x, jax.Array) else np.asarray(x)
            for i, x in enumerate(leaves)}
    self.manager.save(step, args=ocp.args.StandardSave(flat), force=True)
    self.manager.wait_until_finished()

  def restore(self, step: int, like):
    """Restores step `step` into the structure (and dtypes) of `like`."""
    leaves, treedef = jax.tree.flatten(like)
    abstract = {str(i): jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=x.sharding)
                if isinstance(x, jax.Array) else
                jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
                for i, x in enumerate(leaves)}
    flat = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
    return jax.tree.unflatten(treedef, [flat[str(i)] if isinstance(flat[str(i)], jax.Array)
                                        else jax.numpy.asarray(flat[str(i)])
                                        for i in range(len(leaves))])

  def close(self):
    self.manager.close()
