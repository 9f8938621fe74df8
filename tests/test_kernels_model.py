"""generate() through the Pallas verify-attention kernel (interpret mode on CPU) gives the same
greedy tokens as through the jnp reference, for plain and speculative decoding."""

import dataclasses

import jax
import pytest

import spec_jax as sj

CFG = sj.ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128,
                     attention_impl="reference")


@pytest.mark.parametrize("use_drafter", [False, True])
def test_generate_with_pallas_attention_matches_reference(use_drafter):
  ref_model = sj.init_model(CFG, jax.random.key(7))
  ref_model.params["embed"] = ref_model.params["embed"] * 40
  pallas_model = dataclasses.replace(ref_model, config=CFG.replace(attention_impl="pallas"))
  prompts = [[1, 5, 9, 5, 9, 3], [1, 2], [1, 7, 7, 7, 7, 7, 7, 7, 7, 2, 4]]
  kwargs = dict(max_new_tokens=12, sampling=sj.Sampling(0.0), stop_tokens=[])
  if use_drafter:
    kwargs.update(drafter=sj.drafters.NGram(), num_draft=3)
  ref = sj.generate(ref_model, prompts, **kwargs)
  pal = sj.generate(pallas_model, prompts, **kwargs)
  assert pal.tokens == ref.tokens
