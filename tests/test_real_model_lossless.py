"""Losslessness on the real chat model (SmolLM2-135M-Instruct, float32): speculative greedy equals
plain greedy on chat prompts, and the T = 1 chi-square of the first three new tokens against
their exact joint, with drafters whose draft vocabulary cannot propose most tokens.

Heads here are freshly initialised (CI has no trained run): they draft the real model's shapes
and reduced vocabulary, and accept little. The same checks with trained heads, at the issue's
size (16 prompts x 64 tokens, 4000 samples), are `python -m tests.real_model_lossless`.
"""

import numpy as np
import pytest

import spec_jax as sj
from tests.conftest import need_shared
from tests.real_model_lossless import (exact_top_triples, greedy_equality, sample_triples,
                                       triple_chi_square)

SMOL = ("models", "smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf")
# BPE ids are in merge order, most frequent first: the first 8192 of 49,152 stand in for a
# draft vocabulary chosen by frequency (a sixth of the vocabulary).
DRAFT_VOCAB = list(range(8192))


@pytest.fixture(scope="module")
def smol():
  return sj.load(need_shared(*SMOL), dtype="float32")


@pytest.fixture(scope="module")
def eagle3(smol):
  return sj.drafters.EAGLE3.init(smol, draft_tokens=DRAFT_VOCAB)


def test_greedy_speculation_equals_plain_greedy_on_chat_prompts(smol, eagle3):
  from train.evaluate import heldout_prompts
  prompts = heldout_prompts(smol, "spec_bench", 4, 0)
  # (n-gram drafts on SmolLM2: tests/test_gguf.py and tests/test_constraints.py)
  drafters = {"eagle3": eagle3, "dflash": sj.drafters.DFlash.init(smol, block_size=4)}
  report = greedy_equality(smol, drafters, prompts, max_new_tokens=32, num_draft=3)
  for name, r in report.items():
    assert r["equal_rows"] == r["rows"], (name, r)


def test_t1_joint_of_the_first_three_tokens_is_exact_with_a_reduced_draft_vocabulary(smol, eagle3):
  """800 decodes of 3 tokens (one batch) with EAGLE-3 drafting K = 2 from 8192 of 49,152
  tokens, against the exact probabilities of the 24 x 12 x 8 likeliest triples and one bin for
  the rest (small for CI: 2000 rows took 340 s on this CPU; the full size is the module's
  command line)."""
  prompt = smol.encode("My favourite thing to do on a rainy day is")
  sampling = sj.Sampling(temperature=1.0)
  triples, probs = exact_top_triples(smol, prompt, sampling)
  observed, alpha = sample_triples(smol, eagle3, prompt, sampling, samples=800, num_draft=2,
                                   chunk=800)
  stat, dof, p_value, mass = triple_chi_square(triples, probs, observed)
  assert 0.2 < mass < 0.99 and dof >= 5, (mass, dof)     # the test has bins to fail in
  assert p_value > 1e-3, (stat, dof, p_value, alpha)
  # A sampler that ignored the target beyond the draft vocabulary would be caught: the bins
  # whose tokens the draft cannot propose hold a real share of the mass.
  outside = ~np.isin(triples, DRAFT_VOCAB).all(axis=1)
  assert probs[outside].sum() > 0.01
