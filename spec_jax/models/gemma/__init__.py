"""The Gemma family: Gemma 3 and Gemma 4 text decoders (per-layer KV shapes, KV sharing,
per-layer embeddings; one KV buffer per attention type).

  plan.py      the static per-layer plan of a config (attention type, KV shape and source,
               cache groups, RoPE per type), the config checks, the parameter count
  forward.py   params layout, layers, forward, cache, init_params
  hf.py        Hugging Face config fields (CausalLM and multimodal folders) and tensors
"""

from spec_jax.models.family import Family
from spec_jax.models.gemma import forward, hf, plan

FAMILY = Family(
    name="gemma",
    model_types=("gemma3", "gemma4"),
    hf_model_types=hf.HF_MODEL_TYPES,
    init_params=forward.init_params,
    forward=forward.forward,
    init_cache=forward.init_cache,
    num_params=plan.num_params,
    config_from_hf=hf.config_fields,
    read_params=hf.read_params,
    check_config=plan.check_gemma_config,
    config_fields=plan.GEMMA_ONLY,
    llama_view=plan.llama_view,
)
