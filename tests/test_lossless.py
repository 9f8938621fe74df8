"""Losslessness of the whole engine, tested statistically against the exact target joint.

A tiny random target (vocabulary 8) lets us enumerate every continuation: the exact joint
distribution of the first three generated tokens, P(x1, x2, x3) = p(x1) p(x2|x1) p(x3|x1,x2),
each factor from the same `sampling.probs` transform plain sampling uses. One generate() call
with N rows of the same prompt (independent fold_in(key, row) streams) gives N samples of that
joint through the speculative path (prefill token + drafted/verified rounds with rejections,
corrections and bonus tokens). A Pearson chi-square test (tests/stats_helpers.py) with
alpha = 1e-3 and fixed seeds compares the counts with the exact joint over the 512 outcomes.

The same test, run with a deliberately wrong sampler (accept a draft whenever it lies in the
target's top-p set, a shortcut that silently changes the distribution), must fail: that shows
the test has the power to catch a lossy engine.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from spec_jax.decoding import rounds
from spec_jax.decoding.compiled import clear_compiled
from spec_jax.models.transformer import KVCache, forward
from tests.stats_helpers import chi_square, chi2_critical, assert_same_distribution

V = 8
NEW = 3
N = 40_000
PROMPT = [1, 4, 2]
TARGET_CFG = sj.ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1,
                            num_heads=2, num_kv_heads=1, max_position_embeddings=64)
DRAFT_CFG = TARGET_CFG.replace(hidden_size=8, intermediate_size=16)


def _peaky(model, scale):
  """Random tiny models are near-uniform; scale the embedding so distributions have shape."""
  model.params["embed"] = model.params["embed"] * scale
  return model


@functools.lru_cache(None)
def _models():
  target = _peaky(sj.init_model(TARGET_CFG, jax.random.key(11)), 60.0)
  draft = _peaky(sj.init_model(DRAFT_CFG, jax.random.key(12)), 60.0)
  return target, draft


def exact_joint(model, prompt, sampling):
  """P(x1..x3) [V, V, V] of plain sampling under `sampling` (scalars)."""
  seqs = np.array([[a, b] for a in range(V) for b in range(V)], np.int32)     # [V*V, 2]
  tokens = np.concatenate([np.tile(prompt, (len(seqs), 1)), seqs], axis=1)
  cache = KVCache.zeros(model.config, len(seqs), 16)
  logits = forward(model.params, model.config, jnp.asarray(tokens), cache,
                   jnp.zeros(len(seqs), jnp.int32)).logits
  p = np.asarray(sj.sampling.probs(logits, sampling), np.float64)            # [V*V, P+2, V]
  n = len(prompt)
  p1 = p[0, n - 1]                                                            # [V]
  p2 = p[::V, n].reshape(V, V)                                                # [x1, x2]
  p3 = p[:, n + 1].reshape(V, V, V)                                           # [x1, x2, x3]
  joint = p1[:, None, None] * p2[:, :, None] * p3
  return joint / joint.sum()


def sample_joint(target, drafter, sampling, k, seed=0):
  out = sj.generate(target, [PROMPT] * N, drafter=drafter, num_draft=k, max_new_tokens=NEW,
                    sampling=sampling, key=jax.random.key(seed), stop_tokens=[], capacity=16,
                    prompt_bucket=len(PROMPT))
  toks = np.asarray(out.tokens)
  assert toks.shape == (N, NEW)
  return toks, out.stats


def joint_counts(toks):
  return np.bincount(toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2], minlength=V ** 3)


SETTINGS = {
    "T1": sj.Sampling(temperature=1.0),
    "T0.7_topk3": sj.Sampling(temperature=0.7, top_k=3),
    "T1.3_topp0.8": sj.Sampling(temperature=1.3, top_p=0.8),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("drafter_kind,k", [("sampled", 2), ("deterministic", 1)])
@pytest.mark.optimized
def test_speculative_joint_matches_target(setting, drafter_kind, k):
  target, draft = _models()
  sampling = SETTINGS[setting]
  drafter = sj.drafters.DraftModel(draft, greedy_drafts=(drafter_kind == "deterministic"))
  toks, stats = sample_joint(target, drafter, sampling, k)
  # The drafts must actually be rejected sometimes, or the test would prove little.
  assert 0.05 < stats.acceptance_rate < 0.98, stats.summary()
  assert_same_distribution(joint_counts(toks), exact_joint(target, PROMPT, sampling), alpha=1e-3)


def test_ngram_drafts_are_lossless():
  target, _ = _models()
  sampling = SETTINGS["T1"]
  prompt_rep = [1, 4, 2, 1, 4, 2, 1, 4]   # n-gram proposals fire on this prompt
  out = sj.generate(target, [prompt_rep] * N, drafter=sj.drafters.NGram(2, 1), num_draft=2,
                    max_new_tokens=NEW, sampling=sampling, key=jax.random.key(3),
                    stop_tokens=[], capacity=24, prompt_bucket=len(prompt_rep))
  toks = np.asarray(out.tokens)
  assert out.stats.drafted > N // 2, out.stats.summary()
  assert_same_distribution(joint_counts(toks), exact_joint(target, prompt_rep, sampling))


def test_mixed_greedy_and_sampled_rows():
  """Even rows greedy, odd rows T=1: the greedy rows follow the argmax path exactly and the
  sampled rows still have the exact joint."""
  target, draft = _models()
  temps = np.where(np.arange(N) % 2 == 0, 0.0, 1.0).astype(np.float32)
  toks, _ = sample_joint(target, sj.drafters.DraftModel(draft), sj.Sampling(temperature=temps), 2)
  greedy = sj.generate(target, [PROMPT], max_new_tokens=NEW, sampling=sj.Sampling(0.0),
                       stop_tokens=[]).tokens[0]
  assert (toks[0::2] == np.asarray(greedy)[None]).all()
  assert_same_distribution(joint_counts(toks[1::2]),
                           exact_joint(target, PROMPT, sj.Sampling(temperature=1.0)))


def _wrong_top_p_sampler(key, draft_tokens, draft_probs, target_probs, draft_lengths=None):
  """The classic lossy shortcut: accept a draft whenever the target gives it any mass after
  top-p (it lies in the top-p set), otherwise resample from p."""
  b, k = draft_tokens.shape
  lengths = jnp.full((b,), k) if draft_lengths is None else draft_lengths
  p_draft = jnp.take_along_axis(target_probs[:, :k], jnp.maximum(draft_tokens, 0)[..., None],
                                axis=-1)[..., 0]
  ok = (p_draft > 0) & (jnp.arange(k)[None] < lengths[:, None])
  n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
  final = jax.random.categorical(key, jnp.log(jnp.take_along_axis(
      target_probs, n[:, None, None], axis=1)[:, 0]))
  pos = jnp.arange(k + 1)[None]
  toks = jnp.where(pos < n[:, None], jnp.pad(draft_tokens, ((0, 0), (0, 1))), -1)
  toks = jnp.where(pos == n[:, None], final[:, None], toks)
  return toks.astype(jnp.int32), n.astype(jnp.int32)


def test_the_check_catches_a_lossy_sampler(monkeypatch):
  target, draft = _models()
  sampling = SETTINGS["T1.3_topp0.8"]
  monkeypatch.setattr(rounds, "rejection_sample", _wrong_top_p_sampler)
  clear_compiled()
  try:
    toks, _ = sample_joint(target, sj.drafters.DraftModel(draft), sampling, 2)
  finally:
    clear_compiled()
  stat, dof = chi_square(joint_counts(toks), exact_joint(target, PROMPT, sampling))
  assert stat > 3 * chi2_critical(dof, 1e-3), (stat, dof)


# ---------------------------------------------------------------- drafts at another temperature

SHARP = 0.5


@functools.lru_cache(None)
def _shaped_models():
  """The tiny pair with their logits scaled 10x (final norm): first-token distributions of
  shape (target ~[.21 .21 .17 .02 .17 .09 .06 .07], acceptance 0.73 at T = 1; 0.66 with the
  draft at T = 0.5), so that a draft's temperature changes what it proposes."""
  def shaped(cfg, seed):
    model = sj.init_model(cfg, jax.random.key(seed))
    model.params["final_norm"] = model.params["final_norm"] * 10.0
    return model
  return shaped(TARGET_CFG, 11), shaped(DRAFT_CFG, 12)


@pytest.mark.parametrize("scale", [SHARP, 0.0])
@pytest.mark.optimized
def test_drafts_at_another_temperature_keep_the_target_joint(scale):
  """Sampling.draft_temperature_scale: the draft model draws at scale x the row's temperature
  (0: greedy drafts) and reports the q it drew from, so the joint stays the target's; the
  acceptance must move against scale 1 (the same key), or the knob never reached the drafter."""
  target, draft = _shaped_models()
  base = SETTINGS["T1"]
  sampling = base.replace(draft_temperature_scale=scale)
  toks, stats = sample_joint(target, sj.drafters.DraftModel(draft), sampling, 2)
  _, same = sample_joint(target, sj.drafters.DraftModel(draft), base, 2)
  assert abs(stats.acceptance_rate - same.acceptance_rate) > 0.02, (stats.summary(),
                                                                     same.summary())
  assert stats.accepted > 5000 and stats.acceptance_rate < 0.98, stats.summary()  # both paths
  assert_same_distribution(joint_counts(toks), exact_joint(target, PROMPT, sampling), alpha=1e-3)


class _QAtTargetTemperature(sj.drafters.DraftModel):
  """Lossy on purpose: draws its draft at the draft temperature but reports the q of the
  target's temperature (one draft: q at position 0 depends on the context alone)."""

  def propose(self, params, state, ctx):
    drafts, _, new_state = super().propose(params, state, ctx)
    target_t = ctx.replace(sampling=ctx.sampling.replace(
        temperature=ctx.sampling.temperature / SHARP))
    _, q, _ = super().propose(params, state, target_t)
    return drafts, q, new_state


def test_the_check_catches_a_draft_q_from_another_temperature():
  target, draft = _shaped_models()
  sampling = SETTINGS["T1"].replace(draft_temperature_scale=SHARP)
  clear_compiled()                    # compiled programs are keyed by the drafter's fields
  try:
    toks, _ = sample_joint(target, _QAtTargetTemperature(draft), sampling, 1)
  finally:
    clear_compiled()
  stat, dof = chi_square(joint_counts(toks), exact_joint(target, PROMPT, sampling))
  assert stat > 3 * chi2_critical(dof, 1e-3), (stat, dof)


@pytest.mark.parametrize("setting", ["T1", "T1.3_topp0.8"])
def test_drafts_at_a_tuned_temperature_keep_the_target_joint(setting):
  """sj.strategies.TunedDraftTemperature: each row's later rounds draft at the scale its
  earlier rounds scored best (here 0.5 or 2.5, starting at 0.5), so the draft distribution
  changes between rounds; the joint of the first three tokens stays the target's, with top-p
  too (where the scores are approximate). The acceptance must differ from drafting at 0.5
  throughout (the same key), or no row moved (T = 1: 0.597 against 0.551; top-p: 0.513
  against 0.453)."""
  target, draft = _shaped_models()
  sampling = SETTINGS[setting]
  tuned = sj.strategies.TunedDraftTemperature(1, scales=(0.5, 2.5))
  out = sj.generate(target, [PROMPT] * N, drafter=sj.drafters.DraftModel(draft),
                    strategy=tuned, max_new_tokens=NEW, sampling=sampling,
                    key=jax.random.key(0), stop_tokens=[], capacity=16,
                    prompt_bucket=len(PROMPT))
  _, fixed = sample_joint(target, sj.drafters.DraftModel(draft),
                          sampling.replace(draft_temperature_scale=0.5), 1)
  assert abs(out.stats.acceptance_rate - fixed.acceptance_rate) > 0.02, (
      out.stats.summary(), fixed.summary())
  assert_same_distribution(joint_counts(np.asarray(out.tokens)),
                           exact_joint(target, PROMPT, sampling), alpha=1e-3)


# ----------------------------------------------------------------------------- longer, ragged

NEW6 = 6
PROMPT_B = [1, 6, 3, 5, 2, 7]


def exact_joint6(model, prompt, sampling):
  """P(x1..x6) [V]*6 of plain sampling: one forward over every prompt + x1..x5 (V^5 rows)."""
  n = len(prompt)
  seqs = np.stack(np.meshgrid(*[np.arange(V)] * 5, indexing="ij"), -1).reshape(-1, 5)
  tokens = np.concatenate([np.tile(prompt, (len(seqs), 1)), seqs], axis=1).astype(np.int32)
  cache = KVCache.zeros(model.config, len(seqs), 16)
  logits = jax.jit(forward, static_argnums=1)(model.params, model.config, jnp.asarray(tokens),
                                              cache, jnp.zeros(len(seqs), jnp.int32)).logits
  p = np.asarray(sj.sampling.probs(logits, sampling), np.float64)      # [V^5, n+5, V]
  joint = np.ones([1] * 6)
  for j in range(6):                 # x_{j+1} given x_1..x_j: rows that vary x_1..x_j only
    cond = p[::V ** (5 - j), n - 1 + j].reshape([V] * (j + 1))
    joint = joint * cond.reshape([V] * (j + 1) + [1] * (5 - j))
  return joint / joint.sum()


def counts3(toks):
  return np.bincount(toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2], minlength=V ** 3)


@pytest.mark.slow   # one 40k-row generate of 6 tokens (~20-40 s on a shared 2-core CPU)
def test_lossless_past_the_first_three_tokens_with_ragged_prompts():
  """Rows alternate a 3-token and a 6-token prompt in one batch (ragged: padding, per-row
  offsets); 6 new tokens each. Per prompt, both the joint of tokens 1-3 and the joint of tokens
  4-6 (reached through several rounds: rejections, corrections and bonus tokens at every
  block offset) match the exact target distribution."""
  target, draft = _models()
  sampling = SETTINGS["T1"]
  prompts = [PROMPT if i % 2 == 0 else PROMPT_B for i in range(N)]
  out = sj.generate(target, prompts, drafter=sj.drafters.DraftModel(draft), num_draft=2,
                    max_new_tokens=NEW6, sampling=sampling, key=jax.random.key(21),
                    stop_tokens=[], capacity=16)
  toks = np.asarray(out.tokens)
  assert toks.shape == (N, NEW6)
  assert 0.05 < out.stats.acceptance_rate < 0.98, out.stats.summary()
  for parity, prompt in ((0, PROMPT), (1, PROMPT_B)):
    joint = exact_joint6(target, prompt, sampling)
    rows = toks[parity::2]
    assert_same_distribution(counts3(rows[:, :3]), joint.sum(axis=(3, 4, 5)), alpha=1e-3,
                             label=f"tokens 1-3 after {prompt}")
    assert_same_distribution(counts3(rows[:, 3:]), joint.sum(axis=(0, 1, 2)), alpha=1e-3,
                             label=f"tokens 4-6 after {prompt}")


class ShortDrafts(sj.drafters.DraftModel):
  """A sampling draft model that keeps only a random prefix of its K drafts (0..K per row and
  round, -1 after it) but still returns all K distributions: the q at invalid positions is real
  and differs from p, so a verifier that looked at it would be lossy."""

  def _static_key(self):
    return ("ShortDrafts",) + super()._static_key()

  def propose(self, params, cache, ctx):
    drafts, q, cache = super().propose(params, cache, ctx)
    b, k = drafts.shape
    keep = jax.random.randint(jax.random.fold_in(ctx.key, 7), (b, 1), 0, k + 1)
    return jnp.where(jnp.arange(k)[None] < keep, drafts, -1), q, cache


@pytest.mark.slow   # one 40k-row generate (~20-30 s on a shared 2-core CPU)
def test_lossless_when_the_drafter_proposes_fewer_than_k_with_draft_probs():
  target, draft = _models()
  sampling = SETTINGS["T1"]
  toks, stats = sample_joint(target, ShortDrafts(draft), sampling, 3, seed=4)
  assert 0 < stats.drafted < 3 * stats.rounds, stats.summary()      # fewer than K drafted
  assert 0.05 < stats.acceptance_rate < 0.98, stats.summary()
  assert_same_distribution(joint_counts(toks), exact_joint(target, PROMPT, sampling), alpha=1e-3)
