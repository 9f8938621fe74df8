"""Model utilities run as `python -m spec_jax.tools.NAME` (widen: widened / converted targets)."""
