"""Draft heads (Medusa, EAGLE, EAGLE-3, MTP): lossless, greedy-exact, saved/loaded, native MTP.

Losslessness reuses tests/test_lossless.py's exact-joint check: a vocabulary-8 random target,
40k rows of one prompt in one generate() call, the joint of the first three tokens against
the exact target joint (chi-square, alpha 1e-3). Heads get random non-zero weights so their
drafts vary, and the acceptance must lie strictly inside (0.05, 0.98).
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from spec_jax.drafters.formats import heads_folder
from spec_jax.drafters.base import PrefillInfo
from spec_jax.drafters.eagle import EAGLE, EAGLE3, EAGLE3Fused
from spec_jax.drafters.medusa import Medusa
from spec_jax.drafters.mtp import MTP
from tests.numerics import MODEL_ULPS, assert_f32_close
from tests.stats_helpers import assert_same_distribution
from tests.test_lossless import (N, NEW, PROMPT, TARGET_CFG, exact_joint, joint_counts,
                                 _peaky)

GREEDY = sj.Sampling(temperature=0.0)


@functools.lru_cache(None)
def small_target():
  return _peaky(sj.init_model(TARGET_CFG, jax.random.key(11)), 60.0)


def make_head(kind, target, greedy_drafts=False, scale=0.5):
  key = jax.random.key(5)
  if kind == "medusa":
    return Medusa.init(target, num_heads=3, key=key, init_scale=4.0, greedy_drafts=greedy_drafts)
  if kind == "eagle3-reduced":
    # A draft vocabulary without some tokens the target emits: q is 0 there, p is not.
    v = target.config.vocab_size
    ids = [i for i in range(v) if i % 3 != 1]
    return EAGLE3.init(target, key=key, init_std=scale, greedy_drafts=greedy_drafts,
                       draft_tokens=ids)
  if kind.startswith("lookup+"):     # prompt lookup first, the head where it finds nothing
    head = make_head(kind[len("lookup+"):], target, greedy_drafts, scale)
    return sj.drafters.LookupFirst(head, sj.drafters.NGram(2, 1))
  cls = {"eagle": EAGLE, "eagle3": EAGLE3, "eagle3_fused": EAGLE3Fused, "mtp": MTP}[kind]
  return cls.init(target, key=key, init_std=scale, greedy_drafts=greedy_drafts)


LOSSLESS_CASES = [("medusa", False), ("eagle", False), ("eagle3", False), ("mtp", False),
                  ("eagle", True), ("eagle3-reduced", False), ("eagle3-reduced", True),
                  ("eagle3_fused", False), ("lookup+eagle3-reduced", False)]


@pytest.mark.slow   # ~20-40 s each on a shared 2-core CPU (40k rows)
@pytest.mark.parametrize("kind,greedy_drafts", LOSSLESS_CASES,
                         ids=[f"{k}-{'argmax' if g else 'sampled'}" for k, g in LOSSLESS_CASES])
def test_heads_are_lossless(kind, greedy_drafts):
  target = small_target()
  drafter = make_head(kind, target, greedy_drafts)
  sampling = sj.Sampling(temperature=1.0)
  if kind == "eagle3-reduced":      # the excluded tokens carry real target mass
    joint = exact_joint(target, PROMPT, sampling)
    excluded = np.setdiff1d(np.arange(target.config.vocab_size), drafter.draft_tokens)
    assert joint[excluded].sum() > 0.1 and joint[:, :, excluded].sum() > 0.1
  out = sj.generate(target, [PROMPT] * N, drafter=drafter, num_draft=2, max_new_tokens=NEW,
                    sampling=sampling, key=jax.random.key(7), stop_tokens=[], capacity=16,
                    prompt_bucket=len(PROMPT))
  toks = np.asarray(out.tokens)
  assert toks.shape == (N, NEW)
  assert 0.05 < out.stats.acceptance_rate < 0.98, out.stats.summary()
  assert_same_distribution(joint_counts(toks), exact_joint(target, PROMPT, sampling), alpha=1e-3)


# ----------------------------------------------------------------------------- greedy equality

CFG = sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                     num_heads=4, num_kv_heads=2, max_position_embeddings=256)
PROMPTS = [[1, 5, 7, 9, 5, 7], [1, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]


@functools.lru_cache(None)
def greedy_target():
  target = sj.init_model(CFG, jax.random.key(1))
  target.params["embed"] = target.params["embed"] * 40
  return target


@functools.lru_cache(None)
def plain_greedy():
  return sj.generate(greedy_target(), PROMPTS, max_new_tokens=20, sampling=GREEDY, stop_tokens=[])


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3", "mtp", "eagle3-reduced",
                                  "eagle3_fused"])
def test_greedy_with_heads_equals_plain(kind):
  target = greedy_target()
  drafter = make_head(kind, target, scale=0.3)
  spec = sj.generate(target, PROMPTS, drafter=drafter, num_draft=3, max_new_tokens=20,
                     sampling=GREEDY, stop_tokens=[])
  assert spec.tokens == plain_greedy().tokens
  assert spec.stats.drafted > 0


@pytest.mark.parametrize("kind", ["eagle3", "eagle3_fused"])
def test_feature_head_state_matches_a_fresh_unroll(kind):
  """The cached drafting path (init_state / commit / propose) and the training forward
  (unroll, step 1) compute the same head outputs: the training loss trains what drafts."""
  target = greedy_target()
  head = make_head(kind, target, scale=0.3)
  toks = jnp.asarray([PROMPTS[2][:12]], jnp.int32)
  cache = sj.KVCache.zeros(CFG, 1, 32)
  out = sj.forward(target.params, CFG, toks, cache, jnp.zeros(1, jnp.int32),
                   return_layers=head.target_layers)
  feats = head.target_feature(head.params, out.hidden, out.layer_hidden)
  o_train = head.unroll(head.params, target.params, toks, feats, steps=1)[0]       # [1, 11, D]
  k, v = head._empty_cache(1, 32)
  o_cached, _, _ = head._step(head.params, target.params, toks[:, 1:], feats[:, :-1], k, v,
                              jnp.zeros(1, jnp.int32))
  assert_f32_close(o_train, o_cached, MODEL_ULPS)


@pytest.mark.parametrize("kind", ["eagle", "eagle3-reduced", "eagle3_fused", "mtp"])
def test_heads_draft_in_the_cpu_execution_layout(kind):
  """FeatureHead.prepare stores the head's layer as the target's CPU layout does (q|k|v and
  gate|up fused, every projection [out, in]) and its fc / fuse / lm_head [out, in]: the same
  outputs to float32 rounding, idempotent, and what generate() decodes with (made once per
  drafter outside the jit: decoding.compiled.execution_drafter_params)."""
  from spec_jax.decoding.compiled import execution_drafter_params
  target = greedy_target()
  head = make_head(kind, target, scale=0.3)
  prepared = jax.jit(head.prepare)(head.params)
  assert {"wqkv_t", "w_gu_t", "wo_t", "w_down_t"} <= set(prepared["layer"])
  assert not {"wq", "wk", "wv", "w_gate", "w_up", "w_down", "wo"} & set(prepared["layer"])
  dense = [n for n in ("fc", "fuse", "lm_head") if n in head.params]
  assert dense and all(n + "_t" in prepared and n not in prepared for n in dense)
  again = head.prepare(prepared)
  assert jax.tree.structure(again) == jax.tree.structure(prepared)
  assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(prepared)))

  toks = jnp.asarray([PROMPTS[2][:12]], jnp.int32)
  out = sj.forward(target.params, CFG, toks, sj.KVCache.zeros(CFG, 1, 32),
                   jnp.zeros(1, jnp.int32), return_layers=head.target_layers)
  outputs = []
  for params in (head.params, prepared):
    feats = head.target_feature(params, out.hidden, out.layer_hidden)
    k, v = head._empty_cache(1, 32)
    o, k, v = head._step(params, target.params, toks[:, 1:], feats[:, :-1], k, v,
                         jnp.zeros(1, jnp.int32))
    outputs.append((o, k, head.logits(params, target.params, o)))
  for a, b in zip(*outputs):
    assert_f32_close(a, b, MODEL_ULPS)

  first = execution_drafter_params(head)
  assert "wqkv_t" in first["layer"] and execution_drafter_params(head) is first


@pytest.mark.parametrize("kind", ["eagle", "eagle3-reduced", "eagle3_fused", "mtp"])
def test_init_state_in_chunks_equals_one_forward(kind, monkeypatch):
  """init_state over the prompt in chunks of C positions (the memory bound of an 8B head's
  prefill) gives the state of one forward over it: the cache at every prompt slot and the
  first draft's feature, for ragged prompts ending inside, at the end of, and after a chunk
  (P = 14 is not a multiple of C = 4: the last chunk reads padding, and would write past the
  cache's 14 slots)."""
  target = greedy_target()
  head = make_head(kind, target, scale=0.3)
  seqs = [PROMPTS[2][:14], PROMPTS[2][:5], [1, 9, 4, 4, 2, 8]]
  lengths = [len(s) for s in seqs]
  # A fresh function per call: the chunk is a class attribute, outside jit's cache key.
  fresh = lambda: jax.jit(lambda *a: _init_from_prompt.__wrapped__(*a), static_argnums=(0, 1))
  one = state_from_scratch(head, target, seqs, lengths, capacity=14, init=fresh())
  monkeypatch.setattr(type(head), "prefill_chunk", 4)
  chunked = state_from_scratch(head, target, seqs, lengths, capacity=14, init=fresh())
  assert_f32_close(chunked.next_feature, one.next_feature, MODEL_ULPS)
  for b, n in enumerate(lengths):                       # slots < prompt_lens = n - 1
    for got, want in ((chunked.k, one.k), (chunked.v, one.v)):
      got, want = (x[b, :, :n - 1] if head.head_major_cache else x[b, :n - 1]
                   for x in (got, want))
      assert_f32_close(got, want, MODEL_ULPS)


@pytest.mark.parametrize("kind", ["eagle3", "eagle3_fused"])
def test_training_time_test_unroll_matches_drafting(kind):
  """Step s of the unroll at slot j equals the s-th draft when the real prefix ends at slot
  j-s+1 and the data tokens are the drafted ones."""
  target = greedy_target()
  head = make_head(kind, target, scale=0.3)
  toks = jnp.asarray([PROMPTS[2][:10]], jnp.int32)
  cache = sj.KVCache.zeros(CFG, 1, 32)
  out = sj.forward(target.params, CFG, toks, cache, jnp.zeros(1, jnp.int32),
                   return_layers=head.target_layers)
  feats = head.target_feature(head.params, out.hidden, out.layer_hidden)
  outs = head.unroll(head.params, target.params, toks, feats, steps=3)
  j = 7
  real_end = j - 2                              # slots <= real_end hold target features
  k, v = head._empty_cache(1, 32)
  o, k, v = head._step(head.params, target.params, toks[:, 1:real_end + 2],
                       feats[:, :real_end + 1], k, v, jnp.zeros(1, jnp.int32))
  feature = o[:, -1]
  for step in (2, 3):
    slot = real_end + step - 1
    o, k, v = head._step(head.params, target.params, toks[:, slot + 1:slot + 2],
                         feature[:, None], k, v, jnp.full((1,), slot, jnp.int32))
    feature = o[:, 0]
  assert_f32_close(outs[2][0, j], feature[0], MODEL_ULPS)


# ----------------------------------------------------------------------------- heads that agree

# A one-layer target whose decoder layer a head can copy. Embedding rows have unit RMS (so MTP's
# enorm is the identity on them) and the layer's weights are large enough that attention
# matters, so a head that copies the layer (but, by the slot convention, never sees token 0)
# agrees with the target often but not always: rounds run through partial and full acceptance.
CFG1 = sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, max_position_embeddings=256,
                      tie_embeddings=False)
AGREE_K, AGREE_NEW = 3, 24


@functools.lru_cache(None)
def agreeing_target():
  target = sj.init_model(CFG1, jax.random.key(1))
  e = target.params["embed"]
  target.params["embed"] = e / jnp.sqrt(jnp.mean(e ** 2, axis=-1, keepdims=True))
  target.params["layers"] = jax.tree.map(lambda w: w * 15 if w.ndim == 3 else w,
                                         target.params["layers"])
  target.params["lm_head"] = target.params["lm_head"] * 40
  return target


@functools.lru_cache(None)
def agreeing_plain():
  return sj.generate(agreeing_target(), PROMPTS, max_new_tokens=AGREE_NEW, sampling=GREEDY,
                     stop_tokens=[])


def _copy_layer_head(kind, target):
  """EAGLE / EAGLE-3 / MTP built to act as the target: fc selects the next token's embedding
  (the feature is ignored), the head's layer is the target's layer, its output norm the
  target's final norm. o at slot j then approximates the target's state after token j+1."""
  d = CFG1.hidden_size
  head = make_head(kind, target)
  params = dict(head.params)
  params["fc"] = jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))], axis=0)
  params["layer"] = jax.tree.map(lambda w: w[0], target.params["layers"])
  if "fc_b" in params:
    params["fc_b"] = jnp.zeros((d,))
  if "out_norm" in params:
    params["out_norm"] = target.params["final_norm"]
  return head.with_params(params)


def _trained_medusa(target):
  """Medusa heads fitted in a few seconds to the target's greedy continuations of PROMPTS (the
  text the test then generates): heads 1 and 2 on every row, head 3 on row 0 only, so the third
  draft is right on some rounds and wrong on others."""
  import optax
  from spec_jax.drafters.medusa import medusa_logits
  k = AGREE_K
  seqs = [p + t for p, t in zip(PROMPTS, agreeing_plain().tokens)]
  width = max(map(len, seqs))
  toks = np.zeros((len(seqs), width), np.int32)
  mask = np.zeros((len(seqs), width), bool)
  for i, s in enumerate(seqs):
    toks[i, :len(s)], mask[i, :len(s)] = s, True
  hidden = sj.forward(target.params, CFG1, jnp.asarray(toks), sj.KVCache.zeros(CFG1, 3, 64),
                      jnp.zeros(3, jnp.int32)).hidden
  # Head i at position j predicts token j + i + 2 (position j's own logits predict j + 1).
  labels = np.stack([np.pad(toks[:, i + 2:], ((0, 0), (0, i + 2))) for i in range(k)], -1)
  weight = np.stack([np.pad(mask[:, i + 2:], ((0, 0), (0, i + 2))) for i in range(k)], -1)
  weight[1:, :, k - 1] = False
  opt = optax.adam(3e-2)

  def loss_fn(p):
    logp = jax.nn.log_softmax(medusa_logits(p, hidden), -1)
    nll = -jnp.take_along_axis(logp, jnp.asarray(labels)[..., None], -1)[..., 0]
    return jnp.sum(nll * weight) / weight.sum()

  @jax.jit
  def step(p, s):
    loss, g = jax.value_and_grad(loss_fn)(p)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  head = Medusa.init(target, num_heads=k, key=jax.random.key(0))
  params, state = head.params, opt.init(head.params)
  for _ in range(150):
    params, state, loss = step(params, state)
  assert float(loss) < 0.2, float(loss)
  return head.with_params(params)


_COMMITS: list = []


def recording(drafter):
  """The same drafter, recording (lengths before, lengths after, n_accepted, state) after every commit
  through a host callback inside the engine's jitted loop."""
  base = type(drafter)

  class Recording(base):
    def _static_key(self):
      return ("Recording",) + super()._static_key()

    def commit(self, params, state, tokens, n_accepted, verify):
      state = super().commit(params, state, tokens, n_accepted, verify)
      jax.debug.callback(lambda *a: _COMMITS.append(jax.tree.map(np.asarray, a)),
                         verify.lengths_before, verify.lengths, n_accepted, state)
      return state

  out = Recording.__new__(Recording)
  out.__dict__.update(drafter.__dict__)
  return out


def state_from_scratch(drafter, target, seqs, lengths, capacity, init=None):
  """The drafter's state for committed rows seqs[b][:lengths[b]], computed by init_state from a
  fresh target forward over all but the last committed token (what a prefill of that prompt
  would give): no commit involved."""
  b = len(seqs)
  prompt = np.zeros((b, capacity), np.int32)
  buf = np.zeros((b, capacity), np.int32)
  for i, (s, n) in enumerate(zip(seqs, lengths)):
    prompt[i, :n - 1] = s[:n - 1]
    buf[i, :n] = s[:n]
  return (init or _init_from_prompt)(drafter, target.config, drafter.params, target.params,
                                     jnp.asarray(prompt), jnp.asarray(buf),
                                     jnp.asarray(lengths, jnp.int32) - 1)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_from_prompt(drafter, config, params, target_params, prompt, buf, prompt_lens):
  b, p = prompt.shape
  out = sj.forward(target_params, config, prompt, sj.KVCache.zeros(config, b, p),
                   jnp.zeros(b, jnp.int32), return_layers=drafter.target_layers)
  info = PrefillInfo(tokens=buf, prompt_tokens=prompt, prompt_lens=prompt_lens, hidden=out.hidden,
                     layer_hidden=out.layer_hidden, target_params=target_params,
                     sampling=GREEDY.as_arrays(b))
  return drafter.init_state(params, info)


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3_fused", "mtp"])
def test_agreeing_heads_through_the_engine(kind):
  """Greedy output equals plain greedy with heads that are right most of the time (mean
  acceptance >= 0.5, some rounds fully and some partly accepted), and after every round the
  state commit() produced equals the state recomputed from scratch for the committed text.

  (The public EAGLE-3 architecture cannot copy a target layer — its residual starts from the
  fused feature, not the embedding —; tests/test_eagle3.py checks it against an independent
  PyTorch forward and through the engine instead.)"""
  target = agreeing_target()
  head = _trained_medusa(target) if kind == "medusa" else _copy_layer_head(kind, target)
  _COMMITS.clear()
  out = sj.generate(target, PROMPTS, drafter=recording(head), num_draft=AGREE_K,
                    max_new_tokens=AGREE_NEW, sampling=GREEDY, stop_tokens=[])
  assert out.tokens == agreeing_plain().tokens
  s = out.stats
  assert s.acceptance_rate >= 0.5, s.summary()
  assert s.accepted_at[-1] > 0 and s.accepted < s.drafted, s.summary()  # full and partial
  seqs = [p + t for p, t in zip(PROMPTS, out.tokens)]
  checked = 0
  for before, after, n_accepted, state in _COMMITS:
    # Rows that emitted their whole block this round (finished rows emit nothing and a block
    # cut by max_new_tokens ends its row: neither state is used again).
    rows = np.flatnonzero(after - before == n_accepted + 1)
    if rows.size == 0:
      continue
    leaves = jax.tree.leaves(state)
    head_major = kind != "medusa" and head.head_major_cache    # KV [B, Hkv, S, Dh]
    capacity = 64 if kind == "medusa" else leaves[0].shape[2 if head_major else 1]
    want = jax.tree.leaves(state_from_scratch(head, target, seqs, after, capacity))
    for got_leaf, want_leaf in zip(leaves, want):
      for r in rows:
        g, w = np.asarray(got_leaf[r]), np.asarray(want_leaf[r])
        if g.ndim == 3:                                # head KV cache: slots < lengths - 1
          slots = (slice(None), slice(0, after[r] - 1)) if head_major else slice(0, after[r] - 1)
          g, w = g[slots], w[slots]
        assert_f32_close(g, w, MODEL_ULPS, err_msg=f"{kind} row {r}")
    checked += rows.size
  assert checked >= s.rounds - len(PROMPTS), (checked, s.rounds)   # one cut round per row at most


def test_lookup_first_with_an_agreeing_head_equals_plain_greedy():
  """LookupFirst(head) at B = 1 on a prompt that repeats itself: rounds whose last tokens match
  earlier text draft the lookup's continuation, the others the head's; the tokens equal plain
  greedy's, and the counts differ from the head alone's (the lookup's drafts were taken)."""
  target = agreeing_target()
  head = _copy_layer_head("eagle", target)
  kw = dict(num_draft=AGREE_K, max_new_tokens=AGREE_NEW, sampling=GREEDY, stop_tokens=[])
  both = sj.generate(target, PROMPTS[:1],
                     drafter=sj.drafters.LookupFirst(head, sj.drafters.NGram(2, 1)), **kw)
  alone = sj.generate(target, PROMPTS[:1], drafter=head, **kw)
  assert both.tokens == alone.tokens == agreeing_plain().tokens[:1]
  counts = lambda s: (s.rounds, s.drafted, s.accepted, s.accepted_at)
  assert counts(both.stats) != counts(alone.stats)
  assert both.stats.drafted > 0


@sj.drafters.base.frozen_drafter
class _FixedDrafts(sj.drafters.FrozenDrafter):
  """Token 7 at every slot, drawn from the uniform q over 8 tokens."""
  params = None
  reads_prompt_hidden = False

  def propose(self, params, state, ctx):
    b, k = ctx.tokens.shape[0], ctx.num_draft
    q = None if ctx.greedy else jnp.full((b, k, 8), 1 / 8, jnp.float32)
    return jnp.full((b, k), 7, jnp.int32), q, state


@pytest.mark.parametrize("greedy", [False, True])
def test_lookup_first_takes_each_rows_match_else_the_model(greedy):
  """Row 0 ends with a 2-gram seen earlier: the lookup's continuation, q one-hot there. Row 1
  has no match and row 2 only a 1-gram one (the default lookup NGram(3, 2) needs 2): the
  model's drafts and q."""
  tokens = jnp.asarray([[1, 2, 3, 1, 2, 0], [1, 2, 3, 4, 5, 0], [1, 2, 3, 2, 0, 0]], jnp.int32)
  ctx = sj.drafters.DraftContext(key=jax.random.key(0), tokens=tokens,
                                 lengths=jnp.asarray([5, 5, 4], jnp.int32),
                                 sampling=sj.Sampling(temperature=1.0).as_arrays(3),
                                 target_params=None, num_draft=3, greedy=greedy)
  drafts, q, state = sj.drafters.LookupFirst(_FixedDrafts()).propose(None, (), ctx)
  np.testing.assert_array_equal(drafts, [[3, 1, 2], [7, 7, 7], [7, 7, 7]])
  assert state == ()
  if greedy:
    assert q is None
  else:
    np.testing.assert_array_equal(q[0], jax.nn.one_hot(jnp.asarray([3, 1, 2]), 8))
    np.testing.assert_array_equal(q[1:], jnp.full((2, 3, 8), 1 / 8))


def test_lookup_first_is_checked():
  with pytest.raises(ValueError, match="fallback must be a model drafter"):
    sj.drafters.LookupFirst(sj.drafters.NGram())
  with pytest.raises(ValueError, match="lookup must be a spec_jax.drafters.NGram"):
    sj.drafters.LookupFirst(_FixedDrafts(), lookup=_FixedDrafts())
  head = make_head("eagle3", greedy_target())
  both = sj.drafters.LookupFirst(head)
  assert both.target_layers == head.target_layers and both.params is head.params
  assert both == sj.drafters.LookupFirst(head.with_params(jax.tree.map(jnp.zeros_like,
                                                                       head.params)))
  assert both != sj.drafters.LookupFirst(head, sj.drafters.NGram(4, 2))


def test_medusa_with_more_drafts_than_heads_is_refused():
  target = greedy_target()
  with pytest.raises(ValueError, match="at most 3 tokens per round"):
    sj.generate(target, PROMPTS, drafter=make_head("medusa", target), num_draft=4)


# ----------------------------------------------------------------------------- save / load

@pytest.mark.parametrize("kind", ["eagle3", "mtp", "eagle3-reduced", "eagle3_fused"])
def test_feature_heads_save_and_reload(tmp_path, kind):
  target = greedy_target()
  head = make_head(kind, target)
  heads_folder.save(tmp_path / "heads", head, target, num_draft=3)
  back = sj.drafters.load(tmp_path / "heads", target)
  assert type(back) is type(head) and back == head       # same static config (hash / eq)
  for a, b in zip(jax.tree.leaves(head.params), jax.tree.leaves(back.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_saved_heads_reload_and_refuse_another_target(tmp_path):
  target = greedy_target()
  head = make_head("medusa", target)
  heads_folder.save(tmp_path / "heads", head, target, num_draft=3)
  meta = json.loads((tmp_path / "heads" / "heads.json").read_text())
  assert meta["kind"] == "medusa" and meta["num_draft"] == 3
  assert meta["target"]["config"]["hidden_size"] == CFG.hidden_size
  back = sj.drafters.load(tmp_path, target)       # the out_dir form: finds heads/
  for a, b in zip(jax.tree.leaves(head.params), jax.tree.leaves(back.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  other = sj.init_model(CFG, jax.random.key(2))
  with pytest.raises(ValueError, match="weights differ"):
    sj.drafters.load(tmp_path / "heads", other)
  bigger = sj.init_model(CFG.replace(num_layers=4), jax.random.key(1))
  with pytest.raises(ValueError, match="config differs.*num_layers"):
    sj.drafters.load(tmp_path / "heads", bigger)
  with pytest.raises(ValueError, match="not a folder saved by train.distill_heads"):
    sj.drafters.load(tmp_path / "nothing", target)
  # A damaged folder is a ValueError naming what is wrong (KeyError, AttributeError and
  # orbax's FileNotFoundError before), and weights of other shapes than heads.json says (an
  # edited file, or a save killed between params/ and heads.json) are refused, not loaded.
  import shutil
  good = json.loads((tmp_path / "heads" / "heads.json").read_text())
  for change, message in [(lambda m: [m], "must be a JSON object, got list"),
                          (lambda m: {k: v for k, v in m.items() if k != "target"},
                           "head metadata lacks target"),
                          (lambda m: dict(m, hyper_params=dict(m["hyper_params"], num_heads=2)),
                           r"stored weights do not match heads.json's hyper-parameters: "
                           r"\['b'\] \(3, 1, 32\) \(expected \(2, 1, 32\)\)")]:
    (tmp_path / "heads" / "heads.json").write_text(json.dumps(change(good)))
    with pytest.raises(ValueError, match=message):
      sj.drafters.load(tmp_path / "heads", target)
  (tmp_path / "heads" / "heads.json").write_text(json.dumps(good))
  for name in ("../elsewhere", "params-x.tmp", 3):
    (tmp_path / "heads" / "heads.json").write_text(json.dumps(dict(good, params=name)))
    with pytest.raises(ValueError, match="is not a params folder of this heads folder"):
      sj.drafters.load(tmp_path / "heads", target)
  (tmp_path / "heads" / "heads.json").write_text(json.dumps(good))
  shutil.rmtree(tmp_path / "heads" / good["params"])
  with pytest.raises(ValueError, match="params-[0-9a-f]+: the heads' weights could not be read"):
    sj.drafters.load(tmp_path / "heads", target)


def test_a_save_killed_before_its_metadata_keeps_the_old_pair(tmp_path, monkeypatch):
  """A save killed between the weights and heads.json leaves the old head whole: before, the
  new weights replaced params/ first, and the old heads.json (another target's fingerprint,
  the same shapes) loaded them."""
  target = greedy_target()
  old = make_head("medusa", target)
  new = Medusa.init(target, num_heads=3, key=jax.random.key(7), init_scale=4.0)
  assert not all(np.array_equal(np.asarray(a), np.asarray(b))
                 for a, b in zip(jax.tree.leaves(old.params), jax.tree.leaves(new.params)))
  heads_folder.save(tmp_path / "heads", old, target, num_draft=3)

  def killed(path, obj):
    raise KeyboardInterrupt("killed before heads.json")
  monkeypatch.setattr(heads_folder, "write_json_atomic", killed)
  with pytest.raises(KeyboardInterrupt):
    heads_folder.save(tmp_path / "heads", new, target, num_draft=3)
  monkeypatch.undo()
  back = sj.drafters.load(tmp_path / "heads", target)
  for a, b in zip(jax.tree.leaves(old.params), jax.tree.leaves(back.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))       # the old weights, whole
  # The next save commits and removes every other params folder (the torn one included).
  heads_folder.save(tmp_path / "heads", new, target, num_draft=3)
  assert len([p for p in (tmp_path / "heads").iterdir() if p.name.startswith("params")]) == 1
  back = sj.drafters.load(tmp_path / "heads", target)
  for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(back.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))




def test_heads_load_on_the_bf16_cast_of_their_target_and_nowhere_else(tmp_path):
  """The same checkpoint in bfloat16 is the same target (compared at bf16 precision); another
  model's bf16 weights, or an older heads.json without the bf16 checksum, are refused."""
  target = greedy_target()
  head = make_head("medusa", target)
  heads_folder.save(tmp_path / "heads", head, target, num_draft=3)
  bf16 = target.astype("bfloat16")
  back = sj.drafters.load(tmp_path / "heads", bf16)
  # The heads follow the target's dtype: their weights rounded to bf16, nothing else changed.
  for a, b in zip(jax.tree.leaves(head.params), jax.tree.leaves(back.params)):
    assert b.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16), np.float32),
                                  np.asarray(b, np.float32))
  greedy = sj.Sampling(temperature=0.0)
  plain = sj.generate(bf16, PROMPTS, max_new_tokens=12, sampling=greedy, stop_tokens=[])
  spec = sj.generate(bf16, PROMPTS, drafter=back, num_draft=3, max_new_tokens=12,
                     sampling=greedy, stop_tokens=[])
  assert spec.tokens == plain.tokens
  other = sj.init_model(CFG, jax.random.key(2)).astype("bfloat16")
  with pytest.raises(ValueError, match="weights differ"):
    sj.drafters.load(tmp_path / "heads", other)
  # One weight moved by more than bf16 rounding: refused at bf16 precision.
  nudged = target.astype("bfloat16")
  nudged = dataclasses.replace(
      nudged, params=dict(nudged.params, embed=nudged.params["embed"].at[0, 0].add(1.0)))
  with pytest.raises(ValueError, match="weights differ"):
    sj.drafters.load(tmp_path / "heads", nudged)
  meta_path = tmp_path / "heads" / "heads.json"
  meta = json.loads(meta_path.read_text())
  del meta["target"]["sha256_bfloat16"]
  meta_path.write_text(json.dumps(meta))
  with pytest.raises(ValueError, match="without a bfloat16 checksum"):
    sj.drafters.load(tmp_path / "heads", target.astype("bfloat16"))
  sj.drafters.load(tmp_path / "heads", target)          # the float32 target still loads them


def test_heads_saved_before_a_config_field_existed_load_when_it_holds_its_default(tmp_path):
  target = greedy_target()
  heads_folder.save(tmp_path / "heads", make_head("medusa", target), target, num_draft=3)
  meta_path = tmp_path / "heads" / "heads.json"
  meta = json.loads(meta_path.read_text())
  assert meta["target"]["config"]["norm_plus_one"] is False        # Gemma's field, default off
  del meta["target"]["config"]["norm_plus_one"]
  meta_path.write_text(json.dumps(meta))
  sj.drafters.load(tmp_path / "heads", target)
  # A missing field is read as its default, not ignored: a target that differs from the
  # default there is refused.
  default_eps = sj.ModelConfig.__dataclass_fields__["rms_norm_eps"].default
  assert target.config.rms_norm_eps == default_eps
  del meta["target"]["config"]["rms_norm_eps"]
  meta_path.write_text(json.dumps(meta))
  other_eps = dataclasses.replace(target, config=target.config.replace(rms_norm_eps=default_eps * 10))
  with pytest.raises(ValueError, match="config differs.*rms_norm_eps"):
    sj.drafters.load(tmp_path / "heads", other_eps)
# ----------------------------------------------------------------------------- native MTP

def _write_qwen3_with_mtp(folder, layout="qwen3_next"):
  """A small random qwen3 checkpoint with one MTP module, in HF's tensor layout."""
  from safetensors.numpy import save_file
  rng = np.random.default_rng(0)
  d, f, v, hq, hkv, dh, layers = 32, 64, 64, 4, 2, 8, 2
  cfg = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": v,
         "hidden_size": d, "intermediate_size": f, "num_hidden_layers": layers,
         "num_attention_heads": hq, "num_key_value_heads": hkv, "head_dim": dh,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
         "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1,
         "eos_token_id": 2, "torch_dtype": "float32"}
  cfg["mtp_num_hidden_layers" if layout == "qwen3_next" else "num_nextn_predict_layers"] = 1

  def w(*shape, scale=0.2):
    return (scale * rng.standard_normal(shape)).astype(np.float32)

  def layer(prefix):
    return {f"{prefix}.input_layernorm.weight": 1 + w(d, scale=0.1),
            f"{prefix}.post_attention_layernorm.weight": 1 + w(d, scale=0.1),
            f"{prefix}.self_attn.q_proj.weight": w(hq * dh, d),
            f"{prefix}.self_attn.k_proj.weight": w(hkv * dh, d),
            f"{prefix}.self_attn.v_proj.weight": w(hkv * dh, d),
            f"{prefix}.self_attn.o_proj.weight": w(d, hq * dh),
            f"{prefix}.self_attn.q_norm.weight": 1 + w(dh, scale=0.1),
            f"{prefix}.self_attn.k_norm.weight": 1 + w(dh, scale=0.1),
            f"{prefix}.mlp.gate_proj.weight": w(f, d),
            f"{prefix}.mlp.up_proj.weight": w(f, d),
            f"{prefix}.mlp.down_proj.weight": w(d, f)}

  tensors = {"model.embed_tokens.weight": w(v, d, scale=1.0), "lm_head.weight": w(v, d),
             "model.norm.weight": np.ones(d, np.float32)}
  for i in range(layers):
    tensors.update(layer(f"model.layers.{i}"))
  if layout == "qwen3_next":
    tensors.update({"mtp.fc.weight": w(d, 2 * d), "mtp.pre_fc_norm_embedding.weight": 1 + w(d),
                    "mtp.pre_fc_norm_hidden.weight": 1 + w(d), "mtp.norm.weight": 1 + w(d)})
    tensors.update(layer("mtp.layers.0"))
  else:
    n = f"model.layers.{layers}"
    tensors.update({f"{n}.eh_proj.weight": w(d, 2 * d), f"{n}.enorm.weight": 1 + w(d),
                    f"{n}.hnorm.weight": 1 + w(d), f"{n}.shared_head.norm.weight": 1 + w(d)})
    tensors.update(layer(n))
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "config.json").write_text(json.dumps(cfg))
  save_file(tensors, str(folder / "model.safetensors"))
  return tensors


@pytest.mark.parametrize("layout", ["qwen3_next", "deepseek"])
def test_native_mtp_weights_load_and_draft(tmp_path, layout):
  folder = tmp_path / "ckpt"
  tensors = _write_qwen3_with_mtp(folder, layout)
  target = sj.load(folder)
  assert target.config.num_mtp_layers == 1 and target.mtp_params
  drafter = sj.drafters.MTP.from_model(target)
  fc_name = "mtp.fc.weight" if layout == "qwen3_next" else "model.layers.2.eh_proj.weight"
  np.testing.assert_array_equal(np.asarray(drafter.params["fc"]), tensors[fc_name].T)
  assert drafter.layer_config.qk_norm and drafter.target_layers == (1,)
  same = sj.drafters.load(folder, target)          # the HF folder form of sj.drafters.load
  assert isinstance(same, MTP)
  plain = sj.generate(target, PROMPTS, max_new_tokens=16, sampling=GREEDY, stop_tokens=[])
  spec = sj.generate(target, PROMPTS, drafter=drafter, num_draft=3, max_new_tokens=16,
                     sampling=GREEDY, stop_tokens=[])
  assert spec.tokens == plain.tokens and spec.stats.drafted > 0


def torch_mtp_logits(tensors, cfg, layout, tokens):
  """An independent PyTorch forward of the checkpoint's MTP module, written from vLLM's
  deepseek_mtp.py / qwen3_next_mtp.py (and transformers' Qwen3 decoder layer for the block).

  The target's hidden states come from transformers' Qwen3ForCausalLM (the output of its last
  decoder layer, before the final norm). MTP slot j reads (h_j, token_{j+1}) at position j:
    x_j = fc(concat(enorm(embed(token_{j+1})), hnorm(h_j)))    (eh_proj for DeepSeek)
    o_j = decoder_block(x)_j  (causal over slots, RoPE at position j)
    logits_j = lm_head(norm(o_j))                               (shared_head.norm for DeepSeek)
  Every norm is RMSNorm; Qwen3-Next's (the mtp.* layout) are zero-centred: x/rms(x) * (1 + w).
  vLLM's DeepSeek module also zeroes the embedding at position 0; that is a serving detail of
  theirs that the architecture does not have, and it is not reproduced here or in spec_jax.

  Everything runs in float64 (transformers' model included), so that the comparison measures
  only spec_jax's float32 error (tests/numerics.py).

  tokens: int [T] -> logits [T-1, V] for slots 0..T-2.
  """
  import torch
  t = {k: torch.tensor(np.asarray(v, np.float64)) for k, v in tensors.items()}
  eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
  hq, hkv, dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
  n = cfg["num_hidden_layers"]
  zero_centred = layout == "qwen3_next"
  if layout == "qwen3_next":
    pre, fc, enorm, hnorm, norm = ("mtp.layers.0.", "mtp.fc.weight", "mtp.pre_fc_norm_embedding",
                                   "mtp.pre_fc_norm_hidden", "mtp.norm")
  else:
    pre = f"model.layers.{n}."
    fc, enorm, hnorm, norm = (pre + "eh_proj.weight", pre + "enorm", pre + "hnorm",
                              pre + "shared_head.norm")

  def rms(x, name):
    w = t[name + ".weight"] if not name.endswith(".weight") else t[name]
    w = 1.0 + w if zero_centred else w
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

  # The target's last-layer output (pre-norm), from transformers.
  folder_model = _torch_target(tensors, cfg)
  captured = {}
  hook = folder_model.model.layers[-1].register_forward_hook(
      lambda m, i, o: captured.setdefault("h", o[0] if isinstance(o, tuple) else o))
  ids = torch.tensor(np.asarray(tokens, np.int64))[None]
  with torch.no_grad():
    folder_model(ids)
  hook.remove()
  h = captured["h"][0]                                              # [T, D]

  with torch.no_grad():
    e = t["model.embed_tokens.weight"][ids[0, 1:]]                  # token j+1 for slot j
    x = torch.cat([rms(e, enorm), rms(h[:-1], hnorm)], -1) @ t[fc].T
    steps = x.shape[0]
    a = rms(x, pre + "input_layernorm")
    q = (a @ t[pre + "self_attn.q_proj.weight"].T).view(steps, hq, dh)
    k = (a @ t[pre + "self_attn.k_proj.weight"].T).view(steps, hkv, dh)
    v = (a @ t[pre + "self_attn.v_proj.weight"].T).view(steps, hkv, dh)
    q, k = rms(q, pre + "self_attn.q_norm"), rms(k, pre + "self_attn.k_norm")
    inv_freq = 1.0 / theta ** (torch.arange(0, dh, 2, dtype=torch.float64) / dh)
    angles = torch.arange(steps, dtype=torch.float64)[:, None] * inv_freq[None]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None]

    def rope(u):
      u1, u2 = u[..., :dh // 2], u[..., dh // 2:]
      return u * cos + torch.cat([-u2, u1], -1) * sin

    q, k = rope(q), rope(k)
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / dh ** 0.5
    causal = torch.ones(steps, steps, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(steps, hq * dh)
    x = x + attn @ t[pre + "self_attn.o_proj.weight"].T
    m = rms(x, pre + "post_attention_layernorm")
    mlp = torch.nn.functional.silu(m @ t[pre + "mlp.gate_proj.weight"].T) * (
        m @ t[pre + "mlp.up_proj.weight"].T)
    x = x + mlp @ t[pre + "mlp.down_proj.weight"].T
    return (rms(x, norm) @ t["lm_head.weight"].T).numpy()


def _torch_target(tensors, cfg):
  """transformers' Qwen3ForCausalLM with the checkpoint's main-model weights, in float64."""
  import torch
  transformers = pytest.importorskip("transformers")
  config = transformers.Qwen3Config(**{k: v for k, v in cfg.items()
                                       if k not in ("architectures", "torch_dtype")})
  model = transformers.Qwen3ForCausalLM(config).double().eval()
  state = {k: torch.tensor(np.asarray(v, np.float64)) for k, v in tensors.items()
           if k in model.state_dict()}
  missing = set(model.state_dict()) - set(state)
  assert not missing, missing
  model.load_state_dict(state)
  return model


@pytest.mark.parametrize("layout", ["qwen3_next", "deepseek"])
def test_native_mtp_matches_an_independent_torch_forward(tmp_path, layout):
  """The MTP drafter loaded from a synthetic checkpoint computes, for every slot of a sequence,
  the logits of the float64 torch reference above (within MODEL_ULPS float32 ulps of the
  logits' scale, tests/numerics.py; a fixed 1e-5 failed on one machine at 1.68e-5): through the training unroll (all slots at
  once) and through the drafting path (init_state's first draft distribution)."""
  pytest.importorskip("torch")
  folder = tmp_path / "ckpt"
  tensors = _write_qwen3_with_mtp(folder, layout)
  cfg = json.loads((folder / "config.json").read_text())
  target = sj.load(folder)
  drafter = sj.drafters.MTP.from_model(target)
  tokens = np.asarray([1, 5, 9, 3, 17, 42, 8, 8, 30, 2, 61, 7], np.int32)
  want = torch_mtp_logits(tensors, cfg, layout, tokens)                # [T-1, V]
  assert want.shape == (len(tokens) - 1, cfg["vocab_size"]) and np.std(want) > 0.1

  toks = jnp.asarray(tokens[None])
  out = sj.forward(target.params, target.config, toks, sj.KVCache.zeros(target.config, 1, 16),
                   jnp.zeros(1, jnp.int32), return_layers=drafter.target_layers)
  feats = drafter.target_feature(drafter.params, out.hidden, out.layer_hidden)
  o = drafter.unroll(drafter.params, target.params, toks, feats, steps=1)[0]
  got = np.asarray(drafter.logits(drafter.params, target.params, o))[0]
  assert_f32_close(got, want, MODEL_ULPS)

  # Drafting path: a prefill of tokens[:-1] (last committed token tokens[-1]); the first draft's
  # logits are the last slot's.
  p = len(tokens) - 1
  pre = sj.forward(target.params, target.config, toks[:, :p], sj.KVCache.zeros(target.config, 1, p),
                   jnp.zeros(1, jnp.int32), return_layers=drafter.target_layers)
  buf = jnp.zeros((1, 32), jnp.int32).at[0, :len(tokens)].set(toks[0])
  state = drafter.init_state(drafter.params, PrefillInfo(
      tokens=buf, prompt_tokens=toks[:, :p], prompt_lens=jnp.asarray([p], jnp.int32),
      hidden=pre.hidden, layer_hidden=pre.layer_hidden, target_params=target.params,
      sampling=GREEDY.as_arrays(1)))
  first = np.asarray(drafter.logits(drafter.params, target.params, state.next_feature))[0]
  assert_f32_close(first, want[-1], MODEL_ULPS)


def test_model_without_mtp_weights_is_refused():
  with pytest.raises(ValueError, match="carries no MTP weights"):
    MTP.from_model(greedy_target())


def test_eagle3_heads_saved_before_the_public_architecture_load_as_eagle3_fused(tmp_path):
  target = greedy_target()
  head = make_head("eagle3_fused", target)
  heads_folder.save(tmp_path / "h", head, target, num_draft=3)
  meta_path = tmp_path / "h" / "heads.json"
  meta = json.loads(meta_path.read_text())
  meta["kind"] = "eagle3"                       # what such a folder says
  meta_path.write_text(json.dumps(meta))
  back = sj.drafters.load(tmp_path / "h", target)
  assert back == head and back.kind == "eagle3_fused"


def test_lookup_first_keeps_a_draft_models_cache_right():
  """LookupFirst(DraftModel): a DraftModel's propose feeds its own drafts into its cache, and
  its commit counted the accepted ones as fed. Where the lookup's drafts were verified instead,
  those slots held the draft model's tokens, and its later drafts attended to them (49 of 120
  fallback proposals differed from the draft model's own continuation). Every fallback
  proposal must be the draft model's greedy continuation of the committed tokens."""
  from spec_jax.drafters.draft_model import DraftModel
  cfg = sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8)
  target, draft = sj.init_model(cfg, jax.random.key(1)), sj.init_model(cfg, jax.random.key(2))
  seen = []

  @sj.drafters.base.frozen_drafter
  class Recorded(DraftModel):
    def propose(self, params, state, ctx):
      drafts, q, state = super().propose(params, state, ctx)
      jax.debug.callback(lambda *a: seen.append([np.asarray(x) for x in a]), ctx.tokens,
                         ctx.lengths, drafts, ordered=True)
      return drafts, q, state

  prompts = [[1, 5, 7, 9, 5, 7, 9, 5, 7, 9, 3, 11, 12, 13, 14, 9, 5, 7],
             [1, 3, 4, 3, 4, 3, 20, 21, 3, 4, 3, 4, 30]]
  k = 4
  out = sj.generate(target, prompts, num_draft=k, max_new_tokens=30, stop_tokens=[],
                    drafter=sj.drafters.LookupFirst(Recorded(draft, greedy_drafts=True)),
                    sampling=sj.Sampling(temperature=0.0))
  assert out.tokens == sj.generate(target, prompts, max_new_tokens=30, stop_tokens=[],
                                   sampling=sj.Sampling(temperature=0.0)).tokens
  fwd = jax.jit(lambda tokens: sj.forward(draft.params, cfg, tokens, sj.KVCache.zeros(cfg, 1, 64),
                                          jnp.zeros((1,), jnp.int32)).logits[0])
  wrong = 0
  for tokens, lengths, drafts in seen:
    for b, n in enumerate(lengths):
      row = np.zeros((1, 64), np.int32)
      row[0, :n] = tokens[b, :n]
      for j in range(k):                     # causal: the padding after n + j changes nothing
        row[0, n + j] = int(np.argmax(fwd(jnp.asarray(row))[n + j - 1]))
      wrong += row[0, n:n + k].tolist() != drafts[b].tolist()
  assert len(seen) > 4 and wrong == 0, (wrong, len(seen))
