"""python -m spec_jax.aot: the whole decode compiled for a TPU or exported for CUDA from this
host, with the compiler's memory figures per device (see spec_jax.aot.cli and
docs/accelerators.md). shapes: abstract targets and drafters from config.json files; program:
the compile / export and its report; check: the small CI check."""
