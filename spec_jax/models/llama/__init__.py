"""The llama family: llama, mistral, qwen2, qwen3 (one stacked KV buffer, fused execution layout).

  forward.py   params layout, decoder layer, forward, cache, init_params, num_params
  layout.py    the execution layout (fused / transposed / unstacked weights per platform)
  hf.py        Hugging Face config fields and tensors
  export.py    save_hf's writer (config.json and tensors)
"""

from spec_jax.models.family import Family
from spec_jax.models.llama import export, forward, hf, layout

FAMILY = Family(
    name="llama",
    model_types=hf.MODEL_TYPES,
    hf_model_types={t: t for t in hf.MODEL_TYPES},
    init_params=forward.init_params,
    forward=forward.forward,
    init_cache=forward.init_cache,
    num_params=forward.num_params,
    config_from_hf=hf.config_fields,
    read_params=hf.read_params,
    prepare=layout.prepare_params,
    execution_layout=layout.execution_layout,
    prepare_model=layout.prepare_model,
    hf_export=export.hf_export,
)
