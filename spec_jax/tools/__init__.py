"""Model utilities run as `python -m spec_jax.tools.NAME` (widen: widened / converted targets;
export_eagle3: EAGLE-3 heads as a public folder for vLLM / SGLang)."""
