"""sampling.probs against a numpy oracle, per-row settings, and every bad-input path."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj


def oracle(logits, t, k, p):
  """Plain numpy: logits/T -> top-k -> top-p -> softmax, one row [V]."""
  logits = np.asarray(logits, np.float64)
  if t == 0:
    out = np.zeros_like(logits)
    out[np.argmax(logits)] = 1.0
    return out
  x = logits / t
  order = np.argsort(-x, kind="stable")
  keep = np.ones_like(x, bool)
  if k > 0:
    keep[:] = x >= x[order[min(k, len(x)) - 1]]
  probs = np.where(keep, np.exp(x - x.max()), 0.0)
  probs /= probs.sum()
  if p < 1:
    sorted_p = probs[order]
    before = np.cumsum(sorted_p) - sorted_p
    kept = order[before < p]
    mask = np.zeros_like(keep)
    mask[kept] = True
    probs = np.where(mask, probs, 0.0)
    probs /= probs.sum()
  return probs


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8),
                                   (0.7, 3, 0.9), (2.0, 50, 0.5), (0.0, 4, 0.3), (1.0, 0, 1e-6)])
def test_probs_matches_oracle(t, k, p):
  logits = jax.random.normal(jax.random.key(0), (4, 37)) * 3
  got = np.asarray(sj.sampling.probs(logits, sj.Sampling(t, k, p)))
  want = np.stack([oracle(row, t, k, p) for row in np.asarray(logits)])
  np.testing.assert_allclose(got, want, atol=1e-6)
  np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5)


def test_per_row_settings_apply_along_the_first_axis():
  logits = jax.random.normal(jax.random.key(1), (3, 5, 23)) * 2      # [B, K, V]
  t = np.array([0.0, 1.0, 0.5], np.float32)
  k = np.array([0, 4, 0], np.int32)
  p = np.array([1.0, 1.0, 0.7], np.float32)
  got = np.asarray(sj.sampling.probs(logits, sj.Sampling(t, k, p)))
  for b in range(3):
    for i in range(5):
      np.testing.assert_allclose(got[b, i], oracle(np.asarray(logits)[b, i], t[b], k[b], p[b]),
                                 atol=1e-6)


def test_greedy_is_one_hot_at_the_first_argmax():
  logits = jnp.asarray([[1.0, 3.0, 3.0, 0.0]])
  np.testing.assert_array_equal(sj.sampling.probs(logits, sj.Sampling(0.0)), [[0, 1, 0, 0]])


def test_probs_is_jittable_with_traced_settings():
  logits = jax.random.normal(jax.random.key(2), (2, 11))
  s = sj.Sampling(0.8, 3, 0.9).as_arrays(2)
  got = jax.jit(sj.sampling.probs)(logits, s)
  np.testing.assert_allclose(got, sj.sampling.probs(logits, s), atol=1e-7)


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(temperature=np.ones((2, 2))), "scalar or a"),
    # values the checks passed, then the cast broke: OverflowError, or an infinite temperature
    (dict(top_k=2**31), "top_k = 2147483648 does not fit its int32"),
    (dict(top_k=[5, 2**33]), r"top_k = \[5, 8589934592\] does not fit its int32"),
    (dict(temperature=1e39), "temperature = 1e.39 does not fit its float32"),
    (dict(temperature=1 + 1j), "temperature must be finite"),
])
def test_bad_sampling_values_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    sj.Sampling(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.1), dict(temperature=float("inf")), dict(top_p=0.0), dict(top_p=1.5),
    dict(top_k=-1), dict(top_k=2.5)])
def test_scalar_and_array_settings_are_checked_alike(kwargs):
  """Host scalars take a numpy-free path (generate() checks on every call): the same errors
  with the same messages as the 0-d and 1-row array forms, and the same per-row arrays."""
  messages = set()
  for wrap in (lambda v: v, np.asarray, lambda v: np.asarray([v])):
    with pytest.raises(ValueError) as err:
      sj.Sampling(**{k: wrap(v) for k, v in kwargs.items()})
    messages.add(str(err.value).replace("[", "").replace("]", ""))
  assert len(messages) == 1, messages
  for settings in ((0.7, 5, 0.9), (0, 0, 1), (np.float32(1.5), np.int64(3), 0.5)):
    scalar = sj.Sampling(*settings).as_arrays(3)
    array = sj.Sampling(*(np.asarray(v) for v in settings)).as_arrays(3)
    for a, b in zip((scalar.temperature, scalar.top_k, scalar.top_p),
                    (array.temperature, array.top_k, array.top_p)):
      assert a.dtype == b.dtype and a.shape == (3,)
      np.testing.assert_array_equal(a, b)
    assert sj.Sampling(*settings).is_greedy == (settings[0] == 0)


def test_every_option_is_declared_once_and_drives_checks_rows_and_the_cli(capsys):
  """sampling.OPTIONS (one Option per Sampling field) gives the per-row arrays' dtypes and
  defaults, its "off" values leave the distribution as it is, and the command line has one
  flag per option."""
  options = sj.sampling.OPTIONS
  assert list(options) == [f.name for f in dataclasses.fields(sj.Sampling)]
  rows = sj.Sampling().as_arrays(3)
  for name, opt in options.items():
    col = getattr(rows, name)
    if isinstance(opt, sj.sampling.BiasOption):     # a sparse map: LogitBias [B, M], M = 0
      assert col.ids.shape == col.values.shape == (3, 0), name
      continue
    assert col.dtype == opt.dtype and col.shape == (3,), name
    np.testing.assert_array_equal(col, opt.default)
  logits = jax.random.normal(jax.random.key(3), (2, 19)) * 3
  off = sj.Sampling(**{name: opt.off for name, opt in options.items()})
  np.testing.assert_allclose(sj.sampling.probs(logits, off), jax.nn.softmax(logits), atol=1e-6)
  assert sj.Sampling(0.5, 3, 0.9).scalars() == (0.5, 3, 0.9, 0.0, 1.0, 0.0, 0.0, (), 1.0)
  assert sj.Sampling(np.ones(2), 3, 0.9).scalars() is None
  from spec_jax.__main__ import main
  with pytest.raises(SystemExit):
    main(["generate", "--help"])
  text = capsys.readouterr().out
  assert all(f"--{name.replace('_', '-')}" in text for name in options)


def test_wrong_number_of_rows_raises():
  with pytest.raises(ValueError, match="2 entries but the batch has 3"):
    sj.Sampling(temperature=np.array([1.0, 0.5])).as_arrays(3)


# ----------------------------------------------------------------------------- top-p edges

def _long_tail_logits(lo, hi):
  """[1, 512] logits: one head token at 0, then 511 tail tokens from lo down to hi (e^-22 ..
  e^-30 is ~1e-10 .. 1e-13 of mass each: no exp underflow, but tiny next to the head)."""
  return np.concatenate([[0.0], np.linspace(lo, hi, 511)]).astype(np.float32)[None]


def test_top_p_one_keeps_every_token_whatever_the_neighbours():
  """top_p = 1 disables the nucleus filter per row, exactly: alone, beside a row that asks for
  top_p = 0.5, and together with a top_k that keeps 400 tokens."""
  # The tail's total mass (~2e-8) is below float32's resolution at 1: a running sum from the
  # top reaches 1.0 at the head token.
  logits = jnp.asarray(_long_tail_logits(-22.0, -30.0))
  plain = np.asarray(jax.nn.softmax(logits, axis=-1))[0]
  assert np.count_nonzero(plain) == 512
  alone = np.asarray(sj.sampling.probs(logits, sj.Sampling(1.0, 0, 1.0)))[0]
  np.testing.assert_array_equal(alone, plain)
  pair = jnp.concatenate([logits, logits])
  beside = np.asarray(sj.sampling.probs(pair, sj.Sampling(np.float32([1, 1]), np.int32([0, 0]),
                                                          np.float32([1.0, 0.5]))))
  np.testing.assert_array_equal(beside[0], plain)            # untouched by its neighbour
  assert np.count_nonzero(beside[1]) == 1                    # the neighbour did filter
  k400 = np.asarray(sj.sampling.probs(logits, sj.Sampling(1.0, 400, 1.0)))[0]
  assert np.count_nonzero(k400) == 400
  np.testing.assert_allclose(k400, oracle(np.asarray(logits)[0], 1.0, 400, 1.0), rtol=1e-5,
                             atol=0)


def test_top_p_below_one_is_exact_in_a_long_float32_tail():
  """0.9999999 (float32 0.99999988) keeps exactly the tokens whose exact mass-before is below
  it (a float64 oracle): here most, not all, of a tail of 511 tokens of ~1e-9 each, whose
  increments a float32 running sum from the top (stuck near 1 - 7e-7) cannot resolve."""
  logits = _long_tail_logits(-20.0, -21.0)
  top_p = float(np.float32(0.9999999))
  want = oracle(logits[0], 1.0, 0, top_p)
  kept = np.count_nonzero(want)
  assert 100 < kept < 500, kept
  got = np.asarray(sj.sampling.probs(jnp.asarray(logits), sj.Sampling(1.0, 0, top_p)))[0]
  assert np.count_nonzero(got) == kept
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)


def _sorted_top_k_top_p(scaled, top_k, top_p):
  """The filter by a descending sort (main's before the bisection), as the reference: the
  k-th largest logit and the nucleus' smallest kept logit read off the sorted row, every
  token at or above them kept; top-p's mass summed from the smallest probability up."""
  vocab = scaled.shape[-1]
  sorted_logits = -jnp.sort(-scaled, axis=-1)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  kth = jnp.take_along_axis(sorted_logits, k - 1, axis=-1)
  masked = jnp.where(scaled < kth, -jnp.inf, scaled)
  sorted_masked = jnp.where(sorted_logits < kth, -jnp.inf, sorted_logits)
  mass_from = jax.lax.cumsum(jax.nn.softmax(sorted_masked, axis=-1), axis=1, reverse=True)
  keep = (mass_from > 1.0 - top_p) | (top_p >= 1.0)
  n_keep = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True), 1)
  cutoff = jnp.take_along_axis(sorted_masked, n_keep - 1, axis=-1)
  return jnp.where(masked < cutoff, -jnp.inf, masked)


@pytest.mark.parametrize("vocab", [5, 37, 700])
def test_bisected_top_k_top_p_keeps_what_a_sort_keeps(vocab):
  """The filter's cut-offs, found by bisection over the logits' order keys, keep exactly the
  tokens a sort-based filter keeps, row by row (96 rows per vocabulary, per-row settings):
  many ties (rounded logits, ties at the cut-offs all kept), -inf entries, -0.0 beside +0.0,
  top_k 0 (off), within and beyond the vocabulary, top_p from 1e-7 to 1 (off), scales from
  flat to peaked rows."""
  rng = np.random.default_rng(vocab)
  rows = 96
  scale = rng.choice([0.5, 3.0, 20.0], size=(rows, 1))
  x = rng.normal(size=(rows, vocab)) * scale
  x[::3] = np.round(x[::3])                                  # ties (and -0.0 from rounding)
  x[1::5, ::7] = -np.inf
  x[2::7, ::3] = -0.0
  x = x.astype(np.float32)
  top_k = rng.integers(0, vocab + 3, size=(rows, 1)).astype(np.int32)
  top_k[::3] = 0
  top_p = rng.uniform(1e-7, 1.0, size=(rows, 1)).astype(np.float32)
  top_p[::4] = 1.0
  top_p[5::11] = 1e-7
  got = np.asarray(jax.jit(sj.sampling._top_k_top_p)(x, top_k, top_p))
  want = np.asarray(jax.jit(_sorted_top_k_top_p)(x, top_k, top_p))
  # The two sum the tail in different orders (float32): a row whose 1 - top_p lies within
  # 1e-5 of one of its exact (float64) tail masses could be cut differently on another CPU;
  # such rows are left out (here none or a few), every other row must match exactly.
  clear = np.ones(rows, bool)
  for r in range(rows):
    kept_k = np.asarray(jax.jit(_sorted_top_k_top_p)(x[r:r + 1], top_k[r:r + 1],
                                                     np.ones((1, 1), np.float32)))[0]
    finite = kept_k[np.isfinite(kept_k)].astype(np.float64)
    if top_p[r, 0] < 1.0 and finite.size:
      p = np.exp(finite - finite.max())
      p /= p.sum()
      values = np.unique(finite)
      # below the largest value only: at it (whole-row mass 1 against 1 - top_p, e.g. top_p
      # 1e-7) both ways keep the likeliest token(s), whichever way the comparison goes
      tails = np.array([p[finite <= v].sum() for v in values[:-1]] + [np.inf])
      clear[r] = np.min(np.abs(tails - (1.0 - np.float64(top_p[r, 0])))) > 1e-5
  assert clear.sum() >= rows - 3, clear.sum()
  np.testing.assert_array_equal(got[clear], want[clear])
  filtered = np.sum(want == -np.inf, axis=-1) > np.sum(x == -np.inf, axis=-1)
  assert filtered[clear].sum() > rows // 3                   # the filters did cut


def test_probs_over_a_subset_of_columns_are_the_whole_rows_there():
  """probs(logits over V_c target ids, columns=ids) equals probs of the whole row (-inf at
  every other id) read at those ids: a logit bias naming ids inside and outside the columns
  (repeated ids add up), repetition / frequency / presence penalties from a history, greedy
  and sampled rows with top-k / top-p / min-p. Processors need the whole row (ValueError)."""
  from spec_jax.sampling import History
  vocab, b = 40, 3
  cols = jnp.asarray([2, 5, 6, 11, 17, 23, 31, 39], jnp.int32)
  logits = 2.0 * jax.random.normal(jax.random.key(7), (b, vocab))
  whole = jnp.full((b, vocab), -jnp.inf).at[:, cols].set(logits[:, cols])
  sampling = sj.Sampling(temperature=np.float32([0.0, 1.0, 0.8]), top_k=np.int32([0, 5, 0]),
                         top_p=np.float32([1.0, 0.9, 0.95]), min_p=np.float32([0.0, 0.0, 0.05]),
                         repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1,
                         logit_bias={5: 2.0, 11: -1.0, 3: 50.0})
  rows = sampling.as_arrays(b)
  prompt = jnp.asarray([[5, 6, 0], [17, 17, 2], [1, 39, 39]], jnp.int32)
  hist = History.of_prompt(prompt, jnp.asarray([3, 3, 3]), vocab, penalties=True)
  hist = hist.add(jnp.asarray([[11], [5], [31]], jnp.int32), jnp.ones((b,), jnp.int32))
  want = np.asarray(sj.sampling.probs(whole, rows, hist))[:, np.asarray(cols)]
  got = np.asarray(sj.sampling.probs(logits[:, cols], rows, hist, columns=cols))
  # (the top-p cut-offs sit >= 0.01 of mass from the nearest tail sum: no float32 reduction
  # order on any CPU moves them)
  assert np.count_nonzero(want[1]) < len(cols)                # the filters cut something
  np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
  np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-6)


def _weights_with_zeros_and_a_tail(vocab: int, seed: int) -> np.ndarray:
  """Unnormalised weights over `vocab` tokens: a few heavy ones, a long light tail, zeros (whole
  blocks of them and scattered ones), so both levels of `sample` are exercised."""
  rng = np.random.default_rng(seed)
  w = rng.gamma(0.3, size=vocab) * 3.0
  w[rng.choice(vocab, vocab // 4, replace=False)] = 0.0
  b = sj.sampling.SAMPLE_BLOCK
  w[:b] = 0.0                                            # a first block without any mass
  w[b:2 * b] *= 0.25                                     # blocks of unequal mass
  w[-5:] = [0.0, 40.0, 0.0, 1e-3, 0.0]                   # the padded last block holds a heavy token
  return w.astype(np.float32)


@pytest.mark.parametrize("vocab", [6, 700, 4800])
@pytest.mark.optimized
def test_sample_draws_the_normalised_weights_and_never_a_zero(vocab):
  """sample(key, w) against w / sum(w): chi-square over 60k draws (p > 1e-3), batched rows with
  one key and vmapped rows with a key each; a zero-weight token is never drawn. 4,800 tokens
  are drawn as 16 parts of 300, each padded to two blocks of 256 (`sample_layout`)."""
  if vocab == 4800:
    assert sj.sampling.sample_layout(vocab) == (16, 2, 256)
  from tests.stats_helpers import assert_same_distribution, counts_of
  w = (np.array([0.0, 1.0, 2.5, 0.0, 3.0, 0.2], np.float32) if vocab == 6 else
       _weights_with_zeros_and_a_tail(vocab, 0))
  n = 30_000
  rows = jnp.broadcast_to(jnp.asarray(w), (n, vocab))
  batched = jax.jit(sj.sampling.sample)(jax.random.key(1), rows)
  keys = jax.random.split(jax.random.key(2), n)
  per_row = jax.jit(jax.vmap(sj.sampling.sample))(keys, rows)
  draws = np.concatenate([np.asarray(batched), np.asarray(per_row)])
  assert draws.min() >= 0 and draws.max() < vocab
  assert not np.any(w[draws] == 0.0), "a zero-weight token was drawn"
  assert_same_distribution(counts_of(draws, vocab), w / w.sum(), alpha=1e-3)


def test_sample_never_draws_a_zero_weight_token_where_the_blocks_cumsum_is_not_monotone():
  """Llama 3's 128,256 tokens are 512 blocks. XLA computes their cumsum as a blocked tree, not
  in sequence, and an empty block's cdf can come out one ulp above its predecessor's: a uniform
  landing in that gap chose the empty block, and its last token (weight 0) was drawn. Half the
  blocks empty here; keys are scanned for one whose block-level uniform lands in such a gap
  (~2M on jaxlib 0.10: 1.3 s), and `sample` must still draw a token of positive weight."""
  vocab = 128_256
  parts, blocks_per_part, block = sj.sampling.sample_layout(vocab)
  rng = np.random.default_rng(253)
  masses = (rng.random(parts * blocks_per_part) ** 2 * 0.01).astype(np.float32)
  masses[::2] = 0.0
  masses[0] = 1.0
  w = np.zeros((parts, blocks_per_part, block), np.float32)
  w[..., 0] = masses.reshape(parts, blocks_per_part)          # one token carries each block
  w = w.reshape(parts, -1)[:, :vocab // parts].reshape(vocab)
  cdf = np.asarray(jax.jit(lambda x: jnp.cumsum(x, axis=-1))(jnp.asarray(masses[None])))[0]
  before = np.concatenate([[0.0], cdf[:-1]]).astype(np.float32)
  rising = (masses == 0) & (cdf > before)
  if not rising.any():
    pytest.skip("this XLA's cumsum of these masses is monotone: no gap to land in")
  lo, hi = before[rising], cdf[rising]
  block_uniform = jax.jit(jax.vmap(lambda k: jax.random.uniform(jax.random.split(k)[0], (1,))[0]))
  chunk, key = 1 << 20, None
  for start in range(0, 32 * chunk, chunk):
    keys = jax.vmap(jax.random.key)(jnp.arange(start, start + chunk, dtype=jnp.uint32))
    u = (np.asarray(block_uniform(keys)) * cdf[-1]).astype(np.float32)
    j = np.maximum(np.searchsorted(lo, u, side="right") - 1, 0)
    hit = (u >= lo[j]) & (u < hi[j])
    if hit.any():
      key = start + int(np.argmax(hit))
      break
  assert key is not None, "no key in 32M landed in a gap: the test needs other masses"
  for draw in (sj.sampling.sample(jax.random.key(key), jnp.asarray(w)),
               jax.jit(sj.sampling.sample)(jax.random.key(key), jnp.asarray(w)[None])[0]):
    assert w[int(draw)] > 0, f"key {key} drew token {int(draw)} of weight 0"


def test_sample_inverts_the_cdf_among_positive_weights_only():
  """The rule itself, on a cdf rounded upwards across two zero weights: the first positive
  weight whose cdf exceeds u, else the last positive one (u beyond every positive cdf can only
  come from rounding)."""
  first = sj.sampling.first_positive_above
  w = jnp.asarray([1.0, 0.0, 0.0, 1.0, 0.0])
  up = np.nextafter(np.float32(1.0), np.float32(2.0))
  cdf = jnp.asarray([1.0, up, up, 2.0, 2.0])
  assert int(first(w, cdf, jnp.asarray([1.0]))) == 3      # u in the rounding gap: not 1
  assert int(first(w, cdf, jnp.asarray([0.5]))) == 0
  assert int(first(w, cdf, jnp.asarray([2.0]))) == 3      # beyond the positive cdfs: the last


def test_sample_rows_are_independent_draws_from_their_own_weights():
  """Row 0 one-hot, row 1 uniform over two tokens far apart (different blocks): the batched
  draw respects each row's weights."""
  vocab = 3 * sj.sampling.SAMPLE_BLOCK
  w = np.zeros((2, vocab), np.float32)
  w[0, 17] = 1.0
  w[1, [3, vocab - 2]] = 0.5
  draws = np.asarray(jax.vmap(lambda k: sj.sampling.sample(k, jnp.asarray(w)))(
      jax.random.split(jax.random.key(0), 4000)))
  assert np.all(draws[:, 0] == 17)
  assert set(np.unique(draws[:, 1])) == {3, vocab - 2}
  assert abs(np.mean(draws[:, 1] == 3) - 0.5) < 0.03        # 4000 draws: sd 0.008


def test_sample_layout_cuts_the_vocabulary_where_a_mesh_would():
  """Parts of gcd(V, 16) equal runs, blocks never straddling one; vocabularies whose blocks
  were whole parts already keep the one-part blocks (the same draws as before the parts)."""
  layout = sj.sampling.sample_layout
  assert layout(128_256) == (16, 32, 256)          # Llama 3: 8,016 tokens a part
  assert layout(151_936) == (16, 38, 256)          # Qwen 2/3
  assert layout(49_152) == (16, 12, 256)           # SmolLM2: 192 blocks, as in one part
  assert layout(512) == (1, 2, 256) and layout(700) == (1, 3, 256) and layout(6) == (1, 1, 6)

