"""The execution layout of a model's weights, whichever its family: the hooks decode and the
command lines call (each family's record says what its layout is; the llama family's is
spec_jax.models.llama.layout, the Gemma family keeps its canonical params).

  prepare_params    inside decode's jit, once per call before the loop
  execution_layout  the same, jittable, for ahead-of-time lowering
  prepare_model     outside any jit, once (accelerators: the canonical buffers donated)
"""

from __future__ import annotations


def prepare_params(params, config, mesh=None):
  """decode's in-jit hook: config's family's execution layout for this platform."""
  return config.family.prepare(params, config, mesh)


def execution_layout(params, config, mesh=None):
  """The execution layout of `params` for the platform being lowered for (jittable)."""
  return config.family.execution_layout(params, config, mesh)


def prepare_model(model, mesh=None, donate: bool = True):
  """`model` with its params in the execution layout, built once outside any jit (the model
  passed in must not be used afterwards when donate; the model itself when nothing to do)."""
  return model.config.family.prepare_model(model, mesh, donate)
