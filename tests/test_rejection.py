"""Tests of sj.rejection_sample: losslessness (chi-square, alpha = 1e-3, fixed seeds), exact
greedy matching, draft_lengths and padding, degenerate residuals, output format, and a wrong
sampler that the same checks reject."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from tests.stats_helpers import (assert_same_distribution, assert_same_samples, chi2_critical,
                                 chi2_sf, chi_square, counts_of, wilson_hilferty_critical)

V = 5
N = 200_000        # samples per statistical check (rows of one batched call)
ALPHA = 1e-3

# Target p at positions 0..3 (3 = the bonus position for K = 3) and draft q at positions 0..2.
# Zeros on purpose: q(3) = 0 < p(3) at position 0 (a token q cannot propose), p(4) = 0 < q(4)
# (a proposal that is always rejected).
P = np.array([[0.40, 0.25, 0.20, 0.15, 0.00],
              [0.05, 0.05, 0.30, 0.30, 0.30],
              [0.55, 0.10, 0.15, 0.10, 0.10],
              [0.10, 0.20, 0.30, 0.25, 0.15]], np.float32)
Q = np.array([[0.10, 0.40, 0.20, 0.00, 0.30],
              [0.30, 0.30, 0.20, 0.10, 0.10],
              [0.50, 0.20, 0.10, 0.10, 0.10]], np.float32)

rejection_sample = jax.jit(sj.rejection_sample)


def tile(x, n=N):
  return jnp.broadcast_to(jnp.asarray(x), (n,) + np.shape(x))


@jax.jit
def draw_drafts(key, q):
  """What a drafter does: one token per row and position from q [B, K, V]."""
  return jax.random.categorical(key, jnp.log(q), axis=-1).astype(jnp.int32)


def beta(p, q):
  """Acceptance probability of one position: sum_x min(p(x), q(x))."""
  return float(np.minimum(p, q).sum())


def check_format(tokens, n_accepted, draft_tokens, draft_lengths=None):
  tokens, n, drafts = np.asarray(tokens), np.asarray(n_accepted), np.asarray(draft_tokens)
  batch, k = drafts.shape
  assert tokens.shape == (batch, k + 1) and tokens.dtype == np.int32
  assert n.shape == (batch,) and n.dtype == np.int32
  lengths = np.full(batch, k) if draft_lengths is None else np.asarray(draft_lengths)
  assert np.all((n >= 0) & (n <= lengths))
  pos = np.arange(k + 1)[None]
  assert np.array_equal(tokens[:, :k][pos[:, :k] < n[:, None]], drafts[pos[:, :k] < n[:, None]])
  final = tokens[np.arange(batch), n]
  assert np.all((final >= 0) & (final < V)), "final token out of the vocabulary (NaN probs?)"
  assert np.all(tokens[pos > n[:, None]] == -1)


# ---------------------------------------------------------------- the statistical helpers


def test_stats_helpers():
  # Survival function: closed forms for dof 2 (exp(-x/2)) and dof 1 (erfc(sqrt(x/2))).
  for x in (0.5, 3.0, 13.8155):
    assert chi2_sf(x, 2) == pytest.approx(np.exp(-x / 2), rel=1e-10)
    assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-10)
  assert chi2_critical(1, 1e-3) == pytest.approx(10.8276, abs=1e-3)
  assert chi2_critical(4, 1e-3) == pytest.approx(18.4668, abs=1e-3)
  assert chi2_critical(24, 1e-3) == pytest.approx(51.1786, abs=1e-3)
  assert 1.0 < wilson_hilferty_critical(24, 1e-3) / 51.1786 < 1.01
  # Pooling: the bins expected 1, 1, 2 pool into one (4 < 5, so the next smallest, 6, joins).
  stat, dof = chi_square([0, 2, 3, 7, 88, 100], [0.005, 0.005, 0.01, 0.03, 0.45, 0.50])
  assert dof == 2 and stat == pytest.approx((88 - 90) ** 2 / 90 + (12 - 10) ** 2 / 10)
  # A count in a zero-probability bin is impossible.
  assert chi_square([1, 10, 10], [0.0, 0.5, 0.5])[0] == np.inf
  rng = np.random.default_rng(0)
  probs = np.array([0.5, 0.3, 0.15, 0.05])
  a = counts_of(rng.choice(4, 50_000, p=probs), 4)
  b = counts_of(rng.choice(4, 50_000, p=probs), 4)
  assert_same_distribution(a, probs)
  assert_same_samples(a, b)
  c = counts_of(rng.choice(4, 50_000, p=[0.48, 0.32, 0.15, 0.05]), 4)
  with pytest.raises(AssertionError):
    assert_same_distribution(c, probs)
  with pytest.raises(AssertionError):
    assert_same_samples(a, c)
  import scipy.stats    # the test extra installs it: the exact survival function's oracle
  for dof in (1, 3, 10, 57):
    for x in (0.3, dof, 2.5 * dof + 5):
      assert chi2_sf(x, dof) == pytest.approx(scipy.stats.chi2.sf(x, dof), rel=1e-9)


# ---------------------------------------------------------------- 1. known p and q


@pytest.mark.parametrize("k", [1, 2, 3])
def test_lossless_against_known_p_q(k):
  key_draft, key_verify = jax.random.split(jax.random.key(100 + k))
  q = tile(Q[:k])
  drafts = draw_drafts(key_draft, q)
  tokens, n_acc = rejection_sample(key_verify, drafts, q, tile(P[:k + 1]))
  check_format(tokens, n_acc, drafts)
  tokens, n_acc, drafts = np.asarray(tokens), np.asarray(n_acc), np.asarray(drafts)

  # (a) the first emitted token follows p_0.
  assert_same_distribution(counts_of(tokens[:, 0], V), P[0], ALPHA, label="tokens[:, 0]")

  # (b) the acceptance rate of position 0 is beta_0 = sum min(p_0, q_0), within 4 SE.
  b0 = beta(P[0], Q[0])
  rate = np.mean(n_acc >= 1)
  assert abs(rate - b0) < 4 * np.sqrt(b0 * (1 - b0) / N), (rate, b0)
  # ... and n_accepted follows the product of independent per-position acceptances.
  betas = [beta(P[i], Q[i]) for i in range(k)]
  reach = np.cumprod([1.0] + betas)                       # P(n >= j), j = 0..k
  expected_n = np.append(reach[:-1] * (1 - np.array(betas)), reach[-1])
  assert_same_distribution(counts_of(n_acc, k + 1), expected_n, ALPHA, label="n_accepted")

  # Emitting the draft token means it was accepted: a correction never repeats the rejected
  # token (the residual is 0 there).
  assert np.array_equal(tokens[:, 0] == drafts[:, 0], n_acc >= 1)

  # (c) every emitted token, given the sequence reached its position, follows p at that
  # position (here p_j does not depend on the prefix); for j = k that is the bonus token.
  for j in range(1, k + 1):
    reached = n_acc >= j
    assert_same_distribution(counts_of(tokens[reached, j], V), P[j], ALPHA,
                             label=f"tokens[:, {j}] | n_accepted >= {j}")
  # Joint of the first two tokens over accepted-at-0 rows: the accepted draft x0 has law
  # min(p0, q0) / beta0, and the next token is independent of it with law p_1.
  acc = n_acc >= 1
  joint = counts_of(tokens[acc, 0] * V + tokens[acc, 1], V * V)
  expected = np.outer(np.minimum(P[0], Q[0]) / b0, P[1])
  assert_same_distribution(joint, expected, ALPHA, label="(tokens[:, 0], tokens[:, 1]) | accepted")


# ---------------------------------------------------------------- 2. deterministic drafts


def test_lossless_deterministic_drafts():
  # Fixed drafts: a likely token, one with p = 0 at position 1 (always rejected), a varied one.
  drafts = jnp.asarray(np.tile(np.array([[0, 4, 2]], np.int32), (N, 1)))
  drafts = drafts.at[: N // 2, 1].set(2)         # half the rows draft a likely token instead
  p = P.copy()
  p[1] = [0.05, 0.05, 0.60, 0.30, 0.00]
  tokens, n_acc = rejection_sample(jax.random.key(2), drafts, None, tile(p))
  check_format(tokens, n_acc, drafts)
  tokens, n_acc, drafts = np.asarray(tokens), np.asarray(n_acc), np.asarray(drafts)
  assert_same_distribution(counts_of(tokens[:, 0], V), p[0], ALPHA, label="tokens[:, 0]")
  rate = np.mean(n_acc >= 1)
  assert abs(rate - p[0, 0]) < 4 * np.sqrt(p[0, 0] * (1 - p[0, 0]) / N), rate
  assert not np.any((n_acc >= 2) & (drafts[:, 1] == 4)), "a p = 0 draft was accepted"
  for j in (1, 2):
    reached = n_acc >= j
    assert_same_distribution(counts_of(tokens[reached, j], V), p[j], ALPHA,
                             label=f"tokens[:, {j}] | n_accepted >= {j}")
  assert np.array_equal(tokens[:, 0] == drafts[:, 0], n_acc >= 1)


# ---------------------------------------------------------------- 3. greedy


def _greedy_drafts(rng, argmax, batch, k):
  """Drafts equal to the target argmax up to a per-row mismatch position m (k = none)."""
  m = rng.integers(0, k + 1, batch)
  drafts = argmax[:, :k].copy()
  rows = np.flatnonzero(m < k)
  drafts[rows, m[rows]] = (drafts[rows, m[rows]] + 1 + rng.integers(0, V - 1, rows.size)) % V
  after = np.arange(k)[None] > m[:, None]
  drafts[after] = rng.integers(0, V, after.sum())   # anything after the mismatch
  return drafts.astype(np.int32), m


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_greedy_is_exact_matching_in_mixed_batch(with_draft_probs):
  rng = np.random.default_rng(3)
  batch, k = 256, 4
  temperature = np.where(np.arange(batch) % 2 == 0, 0.0, 1.0).astype(np.float32)  # even: greedy
  sampling = sj.Sampling(temperature=temperature)
  logits = jnp.asarray(3 * rng.standard_normal((batch, k + 1, V)), jnp.float32)
  p = sj.sampling.probs(logits, sampling)
  draft_logits = logits + jnp.asarray(rng.standard_normal((batch, k + 1, V)), jnp.float32)
  q_sampled = sj.sampling.probs(draft_logits, sampling)[:, :k]
  argmax = np.asarray(jnp.argmax(logits, axis=-1))
  greedy_drafts, m = _greedy_drafts(rng, argmax, batch, k)
  sampled_drafts = np.asarray(draw_drafts(jax.random.key(30), q_sampled))
  greedy = temperature == 0
  drafts = np.where(greedy[:, None], greedy_drafts, sampled_drafts)
  # A greedy drafter's q is one-hot at its token; a sampling drafter's q is its distribution.
  q = jnp.where(jnp.asarray(greedy)[:, None, None], jax.nn.one_hot(drafts, V), q_sampled)
  for seed in range(3):   # the randomness must not matter for greedy rows
    tokens, n_acc = rejection_sample(jax.random.key(seed), jnp.asarray(drafts),
                                     q if with_draft_probs else None, p)
    check_format(tokens, n_acc, drafts)
    tokens, n_acc = np.asarray(tokens), np.asarray(n_acc)
    assert np.array_equal(n_acc[greedy], m[greedy])
    for b in np.flatnonzero(greedy):
      assert np.array_equal(tokens[b, :m[b] + 1], argmax[b, :m[b] + 1])  # prefix + argmax
  assert not np.array_equal(n_acc[~greedy], np.full((~greedy).sum(), k))  # sampled rows vary


# ---------------------------------------------------------------- 4. draft_lengths


def test_draft_lengths_cap_acceptance_and_padding_is_safe():
  rng = np.random.default_rng(4)
  batch, k = 64, 3
  # Greedy target, drafts that match it everywhere: only draft_lengths stops acceptance.
  argmax = rng.integers(0, V, (batch, k + 1))
  p = jax.nn.one_hot(argmax, V)
  lengths = (np.arange(batch) % (k + 1)).astype(np.int32)
  drafts = argmax[:, :k].astype(np.int32)
  tokens, n_acc = rejection_sample(jax.random.key(0), jnp.asarray(drafts), p[:, :k],
                                   p, jnp.asarray(lengths))
  check_format(tokens, n_acc, drafts, lengths)
  assert np.array_equal(np.asarray(n_acc), lengths)
  # The token after the valid drafts is the bonus from p at that position.
  assert np.array_equal(np.asarray(tokens)[np.arange(batch), lengths], argmax[np.arange(batch),
                                                                              lengths])

  # Padding: -1 or huge tokens and NaN draft probabilities at invalid positions.
  invalid = np.arange(k)[None] >= lengths[:, None]
  padded = np.where(invalid, np.where(np.arange(batch)[:, None] % 2 == 0, -1, 10**6), drafts)
  q = np.where(invalid[..., None], np.nan, np.asarray(p[:, :k]))
  for q_arg in (jnp.asarray(q, jnp.float32), None):
    tokens, n_acc = rejection_sample(jax.random.key(1), jnp.asarray(padded, jnp.int32), q_arg,
                                     p, jnp.asarray(lengths))
    check_format(tokens, n_acc, padded, lengths)
    assert np.array_equal(np.asarray(n_acc), lengths)


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_bonus_after_fewer_than_k_drafts_follows_p_there(with_draft_probs):
  """Rows with draft_lengths 1 or 2 of K = 3 whose valid drafts are all accepted (q = p there,
  drafts drawn from it) get the bonus token from p at position draft_lengths, whatever the
  invalid positions hold: here valid in-vocabulary tokens, and a q that differs from p. A
  sampler that took n == draft_lengths < K for a rejection (and drew from the residual of
  that invalid q) fails the chi-square."""
  k = 3
  lengths = np.where(np.arange(N) % 2 == 0, 1, 2).astype(np.int32)
  valid = np.arange(k)[None] < lengths[:, None]
  q = np.where(valid[..., None], P[None, :k], Q[None, :k]).astype(np.float32)
  drafts = np.asarray(draw_drafts(jax.random.key(80), jnp.asarray(q)))
  tokens, n_acc = rejection_sample(jax.random.key(81), jnp.asarray(drafts),
                                   jnp.asarray(q) if with_draft_probs else None, tile(P),
                                   jnp.asarray(lengths))
  check_format(tokens, n_acc, drafts, lengths)
  tokens, n_acc = np.asarray(tokens), np.asarray(n_acc)
  for length in (1, 2):
    done = (lengths == length) & (n_acc == length)
    if with_draft_probs:
      assert np.array_equal(done, lengths == length)      # q = p: every valid draft accepted
    assert done.sum() > N // 50
    assert_same_distribution(counts_of(tokens[done, length], V), P[length], ALPHA,
                             label=f"bonus at draft_lengths = {length}")


def test_draft_length_zero_samples_from_p0():
  """draft_lengths 0: the first token is plain p_0, whatever q_0 and the draft say (here
  q_0 = Q_0, which p_0's residual would differ from)."""
  k = 2
  q = tile(Q[:k])
  drafts = draw_drafts(jax.random.key(40), q)
  for q_arg in (q, None):
    tokens, n_acc = rejection_sample(jax.random.key(41), drafts, q_arg, tile(P[:k + 1]),
                                     jnp.zeros((N,), jnp.int32))
    check_format(tokens, n_acc, drafts, np.zeros(N))
    assert np.all(np.asarray(n_acc) == 0)
    assert_same_distribution(counts_of(np.asarray(tokens)[:, 0], V), P[0], ALPHA,
                             label="dl = 0")


# ---------------------------------------------------------------- 5. p == q


def test_p_equals_q_accepts_everything_without_nan():
  k = 3
  p = tile(P[:k + 1]).at[:, :, 0].set(0.0)   # zeros in p (and so in q) at token 0
  p = p / p.sum(-1, keepdims=True)
  q = p[:, :k]
  drafts = draw_drafts(jax.random.key(50), q)
  tokens, n_acc = rejection_sample(jax.random.key(51), drafts, q, p)
  check_format(tokens, n_acc, drafts)
  assert np.all(np.asarray(n_acc) == k)
  assert_same_distribution(counts_of(np.asarray(tokens)[:, k], V), np.asarray(p[0, k]), ALPHA,
                           label="bonus")
  # Forcing the zero-residual branch: a draft of a token with p = q = 0 is rejected and the
  # residual max(p - q, 0) is all zero; the sampler falls back to p (no NaN, no -1).
  bad = jnp.zeros_like(drafts)          # token 0 has p = q = 0 everywhere
  tokens, n_acc = rejection_sample(jax.random.key(52), bad, q, p)
  check_format(tokens, n_acc, bad)
  assert np.all(np.asarray(n_acc) == 0)
  assert_same_distribution(counts_of(np.asarray(tokens)[:, 0], V), np.asarray(p[0, 0]), ALPHA,
                           label="fallback")


# ---------------------------------------------------------------- 6. format, jit, K = 0


def test_output_format_and_k0():
  tokens, n_acc = rejection_sample(jax.random.key(6), jnp.zeros((N, 0), jnp.int32), None,
                                   tile(P[:1]))
  assert tokens.shape == (N, 1) and tokens.dtype == jnp.int32
  assert n_acc.shape == (N,) and np.all(np.asarray(n_acc) == 0)
  assert_same_distribution(counts_of(np.asarray(tokens)[:, 0], V), P[0], ALPHA, label="K = 0")
  # K = 0 with draft_probs [B, 0, V] and draft_lengths zeros, under jit.
  tokens, n_acc = rejection_sample(jax.random.key(7), jnp.zeros((4, 0), jnp.int32),
                                   jnp.zeros((4, 0, V)), tile(P[:1], 4), jnp.zeros(4, jnp.int32))
  assert tokens.shape == (4, 1) and np.all(np.asarray(n_acc) == 0)

  # Eager and jitted agree for the same key; -1 after the final token.
  q = tile(Q[:3], 32)
  drafts = draw_drafts(jax.random.key(8), q)
  eager = sj.rejection_sample(jax.random.key(9), drafts, q, tile(P, 32))
  jitted = rejection_sample(jax.random.key(9), drafts, q, tile(P, 32))
  for a, b in zip(eager, jitted):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  check_format(*jitted, drafts)
  # bfloat16 probabilities are accepted.
  tokens, n_acc = rejection_sample(jax.random.key(9), drafts, q.astype(jnp.bfloat16),
                                   tile(P, 32).astype(jnp.bfloat16))
  check_format(tokens, n_acc, drafts)


def test_bad_inputs_raise_value_error():
  d = jnp.zeros((2, 3), jnp.int32)
  p = jnp.full((2, 4, V), 1.0 / V)
  q = jnp.full((2, 3, V), 1.0 / V)
  key = jax.random.key(0)
  with pytest.raises(ValueError, match="draft_tokens must be"):
    sj.rejection_sample(key, jnp.zeros((2,), jnp.int32), q, p)
  with pytest.raises(ValueError, match="integer"):
    sj.rejection_sample(key, d.astype(jnp.float32), q, p)
  with pytest.raises(ValueError, match="target_probs"):
    sj.rejection_sample(key, d, q, p[:, :3])
  with pytest.raises(ValueError, match="draft_probs"):
    sj.rejection_sample(key, d, q[:, :2], p)
  with pytest.raises(ValueError, match="draft_lengths"):
    sj.rejection_sample(key, d, q, p, jnp.array([1, 4]))
  with pytest.raises(ValueError, match="draft_lengths"):
    sj.rejection_sample(key, d, q, p, jnp.array([1, 2, 3]))


# ---------------------------------------------------------------- 7. the checks can fail


@jax.jit
def _wrong_top_p_shortcut(key, draft_tokens, draft_probs, target_probs, top_p=0.8):
  """WRONG, first token only: accept the draft whenever it lies in the top-p set of p, else
  resample from p. Emits q(x) + (1 - q(S)) p(x) on the top-p set S: not p."""
  del draft_probs
  p0 = target_probs[:, 0]
  order = jnp.argsort(-p0, axis=-1)
  sorted_p = jnp.take_along_axis(p0, order, axis=-1)
  keep_sorted = jnp.cumsum(sorted_p, axis=-1) - sorted_p < top_p
  keep = jnp.zeros_like(keep_sorted).at[jnp.arange(p0.shape[0])[:, None], order].set(keep_sorted)
  accepted = jnp.take_along_axis(keep, draft_tokens[:, :1], axis=-1)[:, 0]
  resampled = sj.sampling.sample(key, p0)
  return jnp.where(accepted, draft_tokens[:, 0], resampled)


@jax.jit
def _wrong_resample_from_p(key, draft_tokens, draft_probs, target_probs):
  """WRONG, first token only: the right acceptance test, but a rejection resamples from p
  instead of the residual max(p - q, 0). Emits min(p, q)(x) + (1 - beta) p(x): not p."""
  key_u, key_c = jax.random.split(key)
  x = draft_tokens[:, 0]
  p0, q0 = target_probs[:, 0], draft_probs[:, 0]
  px = jnp.take_along_axis(p0, x[:, None], axis=-1)[:, 0]
  qx = jnp.take_along_axis(q0, x[:, None], axis=-1)[:, 0]
  accepted = jax.random.uniform(key_u, x.shape) * qx < px
  return jnp.where(accepted, x, sj.sampling.sample(key_c, p0))


@pytest.mark.parametrize("wrong", [_wrong_top_p_shortcut, _wrong_resample_from_p])
def test_chi_square_rejects_wrong_samplers(wrong):
  q, p = tile(Q[:1]), tile(P[:2])
  key_draft, key_verify = jax.random.split(jax.random.key(70))
  drafts = draw_drafts(key_draft, q)
  # The right sampler passes the check with these drafts and this key ...
  tokens, _ = rejection_sample(key_verify, drafts, q, p)
  assert_same_distribution(counts_of(np.asarray(tokens)[:, 0], V), P[0], ALPHA)
  # ... and the wrong one fails it by a wide margin.
  wrong_tokens = np.asarray(wrong(key_verify, drafts, q, p))
  counts = counts_of(wrong_tokens, V)
  stat, dof = chi_square(counts, P[0])
  assert stat > 100 * chi2_critical(dof, ALPHA), stat
  with pytest.raises(AssertionError, match="do not follow"):
    assert_same_distribution(counts, P[0], ALPHA)


@pytest.mark.parametrize("dtype,vocab", [(jnp.uint8, 300), (jnp.int16, 40000), (jnp.int8, 200)])
def test_narrow_integer_drafts_are_judged_like_int32_ones(dtype, vocab):
  """V - 1 compared in the drafts' own dtype wrapped around (uint8 with V = 300): every valid
  draft counted as out of vocabulary and rejected."""
  draft = 100
  p = jnp.zeros((1, 2, vocab)).at[0, 0, draft].set(1.0).at[0, 1, 7].set(1.0)
  tokens, n = sj.rejection_sample(jax.random.key(0), jnp.asarray([[draft]], dtype), None, p)
  assert n.tolist() == [1] and tokens.tolist() == [[draft, 7]]


def test_an_out_of_vocabulary_draft_is_replaced_from_p_with_draft_probs_too():
  """A draft outside the vocabulary was never judged: its replacement must follow p. With
  draft_probs it came from norm(max(p - q, 0)) ([.75, .25, 0, 0] here, p = [.4, .3, .2, .1])."""
  n = 20000
  p = jnp.asarray([0.4, 0.3, 0.2, 0.1])
  q = jnp.asarray([0.1, 0.2, 0.3, 0.4])
  target = jnp.broadcast_to(p, (n, 2, 4))
  for draft_probs in (None, jnp.broadcast_to(q, (n, 1, 4))):
    tokens, accepted = sj.rejection_sample(jax.random.key(1), jnp.full((n, 1), 4, jnp.int32),
                                           draft_probs, target)
    assert not np.any(np.asarray(accepted))
    freq = np.bincount(np.asarray(tokens[:, 0]), minlength=4) / n
    np.testing.assert_allclose(freq, p, atol=0.015)      # 3 sigma of 20k draws: 0.011
