"""The hybrid family: Qwen3-Next and Qwen3.5 text decoders (Gated DeltaNet linear-attention
layers and gated full-attention layers; Qwen3-Next's MoE, Qwen3.5's dense MLP).

  plan.py      config checks, the per-layer plan, partial RoPE, parameter count
  deltanet.py  the gated delta rule (chunked prefill, recurrent verify), conv, gated norm
  cache.py     HybridCache (KV + recurrent state + per-position verify buffers), commit_cache
  forward.py   params layout, layers, forward, init_params
  hf.py        Hugging Face config fields and tensors (mtp.* kept raw for the MTP drafter)

Trees are refused (tree_capable False): a recurrent state follows one sequence. Chain rounds
keep the accepted prefix's state through commit_cache (docs/hybrid.md).
"""

from spec_jax.models.family import Family
from spec_jax.models.qwen3_next import cache, forward, hf, plan

FAMILY = Family(
    name="qwen3_next",
    model_types=plan.MODEL_TYPES,
    hf_model_types=hf.HF_MODEL_TYPES,
    init_params=forward.init_params,
    forward=forward.forward,
    init_cache=cache.init_cache,
    num_params=plan.num_params,
    config_from_hf=hf.config_fields,
    read_params=hf.read_params,
    check_config=plan.check_config,
    config_fields=plan.HYBRID_ONLY,
    tree_capable=False,
    commit_cache=cache.commit_cache,
    max_verify=cache.VERIFY_SLOTS,
    constrain_cache=cache.constrain_cache,
    llama_view=plan.llama_view,
)
