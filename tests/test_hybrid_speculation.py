"""Speculation on the hybrid family (models/qwen3_next): greedy speculative output equals plain
greedy with n-gram drafts, a draft model, a drafter with accepted prefixes of every length,
EAGLE-3 and DFlash heads; the wrong variant (the state after all K+1 verified tokens kept) fails;
T = 1 sampling keeps the exact joint of the new tokens (chi-square); trees and hybrid draft
models refused."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import spec_jax as sj
from spec_jax.decoding import target as target_lib
from tests.hybrid_helpers import (REPEAT_PROMPTS, V, build_models, greedy_run, oracle_for)
from tests.stats_helpers import assert_same_distribution, chi2_sf, chi_square


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  return build_models(tmp_path_factory)


@pytest.fixture(scope="module")
def draft_model():
  """A smaller random llama of the same vocabulary (another family as the draft model)."""
  cfg = sj.ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=1,
                       num_heads=2, num_kv_heads=1)
  return sj.init_model(cfg, jax.random.key(7))


@pytest.fixture(scope="module")
def plain(models):
  return {kind: greedy_run(models[kind][1], None, 0).tokens for kind in models}


@pytest.mark.parametrize("kind", ["qwen3_next"])
def test_greedy_speculation_with_ngram_equals_plain_greedy(models, plain, kind):
  # 40 new tokens at capacity 80 (greedy_run): plain greedy is the `plain` fixture's program,
  # not one more compile at another capacity; the rounds still accept some n-gram drafts and
  # reject most (2 of 53 accepted, measured).
  model = models[kind][1]
  out = greedy_run(model, sj.drafters.NGram(max_ngram=3), 4)
  assert out.tokens == plain[kind]
  assert 0 < out.stats.accepted < out.stats.drafted, out.stats.summary()   # partial accepts
  print(f"{kind} n-gram K=4: {out.stats.summary()}")


def test_greedy_speculation_with_a_draft_model_equals_plain_greedy(models, plain, draft_model):
  model = models["qwen3_next"][1]
  out = greedy_run(model, sj.drafters.DraftModel(draft_model), 3)
  assert out.tokens == plain["qwen3_next"]
  assert out.stats.drafted > out.stats.accepted       # rejections: the rollback is exercised


@pytest.mark.parametrize("k", [2, 5])
def test_greedy_speculation_with_partial_acceptances_equals_plain_greedy(models, plain, k):
  """A drafter right except at every third position: rounds accept 0..K drafts (each verify
  position committed some time), output equal to plain greedy."""
  model = models["qwen3_next"][1]
  out = greedy_run(model, oracle_for(plain["qwen3_next"]), k)
  assert out.tokens == plain["qwen3_next"]
  hist = np.asarray(out.stats.accepted_at)
  assert 0 < out.stats.acceptance_rate < 1 and hist[1] > 0, out.stats.summary()


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_greedy_speculation_with_feature_heads_equals_plain_greedy(models, plain, kind):
  """EAGLE-3 (three target layers' features) and DFlash (a block drafter) heads, random, on the
  hybrid target: its layer features feed them; output equal to plain greedy."""
  model = models["qwen3_next"][1]
  if kind == "eagle3":
    drafter = sj.drafters.EAGLE3.init(model, key=jax.random.key(4), init_std=0.3)
  else:
    drafter = sj.drafters.DFlash.init(model, key=jax.random.key(4), block_size=4, init_std=0.3)
  out = greedy_run(model, drafter, 3)
  assert out.tokens == plain["qwen3_next"]
  assert out.stats.drafted > 0


def test_committing_every_verified_position_fails_greedy_equality(models, plain, monkeypatch):
  """The wrong variant: keep the state after all K+1 verified tokens (no commit_cache). Its
  greedy output departs from plain greedy: the rollback is what makes the rounds exact."""
  model = models["qwen3_5_text"][1]
  monkeypatch.setattr(target_lib.ModelTarget, "commit_cache",
                      lambda self, cache, lengths, n_accepted: cache)
  target = target_lib.ModelTarget(model.config)
  prompts = np.zeros((2, 18), np.int32)
  lens = np.array([len(p) for p in REPEAT_PROMPTS], np.int32)
  for i, p in enumerate(REPEAT_PROMPTS):
    prompts[i, :len(p)] = p
  run = jax.jit(lambda params: sj.decode(
      params, prompts, lens, jax.random.key(0), config=target,
      drafter=oracle_for(plain["qwen3_5_text"]), num_draft=4, max_new_tokens=40, capacity=80,
      sampling=sj.Sampling(temperature=0.0), stop_tokens=()))
  res = run(model.params)
  wrong = [np.asarray(res.tokens)[i, lens[i]:lens[i] + 40].tolist() for i in range(2)]
  assert wrong != plain["qwen3_5_text"]


def test_a_hybrid_draft_model_is_refused(models):
  with pytest.raises(ValueError, match="recurrent state"):
    sj.drafters.DraftModel(models["qwen3_5_text"][1])


def test_chains_longer_than_the_verify_buffers_are_refused(models):
  with pytest.raises(ValueError, match="at most 16 tokens per round"):
    sj.generate(models["qwen3_5_text"][1], REPEAT_PROMPTS, drafter=sj.drafters.NGram(),
                num_draft=16, max_new_tokens=4, sampling=sj.Sampling(temperature=0.0),
                capacity=80)


def test_trees_are_refused_with_a_clear_error(models):
  model = models["qwen3_5_text"][1]
  with pytest.raises(ValueError, match="qwen3_5_text.*chain|tree=None"):
    sj.generate(model, REPEAT_PROMPTS, drafter=sj.drafters.NGram(), tree=sj.TreeSpec(2, 2, 4),
                max_new_tokens=4, sampling=sj.Sampling(temperature=0.0), capacity=80)


# ----------------------------------------------------------------------------- losslessness

SMALL_V = 8


@functools.lru_cache(maxsize=None)
def small_target():
  """A hybrid of vocabulary 8 (Qwen3-Next MoE), peaky: the exact joint of three tokens is 512
  bins."""
  cfg = sj.ModelConfig(vocab_size=SMALL_V, hidden_size=32, intermediate_size=48, num_layers=4,
                       num_heads=2, num_kv_heads=1, head_dim=16, model_type="qwen3_next",
                       partial_rotary_factor=0.5, bos_token_id=None, eos_token_ids=(),
                       layer_types=("linear_attention",) * 3 + ("full_attention",),
                       linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=4,
                       linear_value_head_dim=4, linear_conv_kernel_dim=4, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=16)
  model = sj.init_model(cfg, jax.random.key(11))
  # Weights of std 0.3 in the layers (0.02 in init_params): the recurrent state and the
  # attention weigh in the logits, so a wrong state shows in the samples.
  layers = [{k: w * 15.0 if w.ndim >= 2 and k != "conv_w" else w for k, w in lp.items()}
            for lp in model.params["layers"]]
  params = dict(model.params, layers=layers, lm_head=model.params["lm_head"] * 25.0,
                embed=model.params["embed"] * 3.0)
  return sj.Model(config=cfg, params=params)


CHI_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]


# One compile of the whole forward (both tests' exact joints reuse it) instead of ~270
# single-op compiles of the hybrid MoE layers run eagerly.
_forward = jax.jit(sj.forward, static_argnums=1)


def small_joint(model, sampling):
  """P(x1, x2, x3) [V, V, V] of plain sampling after CHI_PROMPT: one forward over every
  prompt + x1 x2."""
  v = SMALL_V
  seqs = np.array([[a, b] for a in range(v) for b in range(v)], np.int32)
  toks = np.concatenate([np.tile(CHI_PROMPT, (len(seqs), 1)), seqs], axis=1)
  cache = sj.KVCache.zeros(model.config, len(seqs), 16)
  logits = _forward(model.params, model.config, jnp.asarray(toks), cache,
                    jnp.zeros(len(seqs), jnp.int32)).logits
  p = np.asarray(sj.sampling.probs(logits, sampling), np.float64)
  n = len(CHI_PROMPT)
  joint = p[0, n - 1][:, None, None] * p[::v, n].reshape(v, v)[:, :, None] * \
      p[:, n + 1].reshape(v, v, v)
  return joint / joint.sum()


def sampled_counts(model, n: int = 4000, drafter=None):
  """Counts [V^3] of (x1, x2, x3) from n rows of T = 1 sampling with n-gram drafts (or
  `drafter`), K = 2 (a fresh jit of sj.decode: a monkeypatched commit is traced, not taken from
  a compile cache), and the rows' total accepted and drafted tokens."""
  drafter = sj.drafters.NGram(max_ngram=2) if drafter is None else drafter
  prompts = np.tile(np.asarray(CHI_PROMPT, np.int32), (n, 1))
  lens = np.full((n,), len(CHI_PROMPT), np.int32)
  run = jax.jit(lambda params: sj.decode(
      params, prompts, lens, jax.random.key(3), config=target_lib.ModelTarget(model.config),
      drafter=drafter, num_draft=2, max_new_tokens=3, capacity=16,
      sampling=sj.Sampling(temperature=1.0), stop_tokens=()))
  res = run(model.params)
  p, v = len(CHI_PROMPT), SMALL_V
  toks = np.asarray(res.tokens)[:, p:p + 3]
  counts = np.bincount(toks[:, 0] * v * v + toks[:, 1] * v + toks[:, 2], minlength=v ** 3)
  return counts, int(np.asarray(res.accepted).sum()), int(np.asarray(res.drafted).sum())


def test_sampled_speculation_keeps_the_exact_joint_of_new_tokens(monkeypatch):
  """T = 1, n-gram drafts K = 2: the first new token from the prefill, tokens 2 and 3 from
  speculative rounds (a rejection in the first round makes the second round's verify start
  from the committed state): the joint of (x1, x2, x3) over 4000 rows is the exact one
  (chi-square p > 1e-3). The no-rollback variant (the state after all K+1 verified tokens
  kept) is far outside it (p < 1e-6)."""
  model = small_target()
  joint = small_joint(model, sj.Sampling(temperature=1.0))
  counts, accepted, drafted = sampled_counts(model)
  assert 0.02 * drafted < accepted < 0.98 * drafted, (accepted, drafted)   # both paths taken
  stat, dof, p_value = assert_same_distribution(counts, joint, alpha=1e-3)
  print(f"hybrid, n-gram K=2 at T=1: chi-square {stat:.1f} (dof {dof}), p = {p_value:.3f}, "
        f"acceptance {accepted / drafted:.2f}")
  monkeypatch.setattr(target_lib.ModelTarget, "commit_cache",
                      lambda self, cache, lengths, n_accepted: cache)
  counts, _, _ = sampled_counts(model)
  stat, dof = chi_square(counts, joint)
  print(f"no rollback: chi-square {stat:.1f} (dof {dof}), p = {chi2_sf(stat, dof):.1e}")
  assert chi2_sf(stat, dof) < 1e-6, (stat, dof)


def random_mtp(model, seed: int = 5):
  """A random native MTP head for `model` (the layout sj.drafters.load builds from mtp.*):
  its sampled drafts' q overlap the target's p at T = 1, so rounds accept and reject."""
  from spec_jax.drafters import hybrid_mtp
  from spec_jax.models.qwen3_next import forward as hforward
  cfg = model.config
  lcfg = hybrid_mtp.layer_config(cfg, sparse=cfg.num_experts > 0)
  d = cfg.hidden_size
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  layer = jax.tree.map(lambda w: w * 15.0 if w.ndim >= 2 else w,
                       hforward.init_params(lcfg, k1)["layers"][0])
  params = {"fc": 0.3 * jax.random.normal(k2, (2 * d, d)), "layer": layer,
            "enorm": 0.1 * jax.random.normal(k3, (d,)), "hnorm": jnp.zeros((d,)),
            "norm": jnp.zeros((d,))}
  return hybrid_mtp.HybridMTP(params, cfg, lcfg, ())


def test_sampled_mtp_drafts_keep_the_exact_joint_of_new_tokens():
  """The native MTP head drafting by sampling (draft_probs q) at T = 1, chained for K = 2:
  accepted and rejected drafts (rejection with the residual max(p - q, 0)), the head's own
  commit, the target's rollback: the joint of (x1, x2, x3) is the exact one (p > 1e-3)."""
  model = small_target()
  joint = small_joint(model, sj.Sampling(temperature=1.0))
  counts, accepted, drafted = sampled_counts(model, drafter=random_mtp(model))
  assert 0.05 * drafted < accepted < 0.95 * drafted, (accepted, drafted)
  stat, dof, p_value = assert_same_distribution(counts, joint, alpha=1e-3)
  print(f"hybrid, sampled MTP drafts K=2 at T=1: chi-square {stat:.1f} (dof {dof}), "
        f"p = {p_value:.3f}, acceptance {accepted / drafted:.2f}")
