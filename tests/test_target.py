"""The target protocol: a model written here, not in spec_jax.models — its own params, its own
cache layout [B, S, 2, D] — speculated through sj.decode (and sj.generate) by wrapping it in a
few lines: greedy speculative == greedy plain (chains and trees), and the exact joint of the
first three sampled tokens at T = 1 (chi-square, p > 1e-3, fixed seeds)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from tests.stats_helpers import assert_same_distribution

V, D, MAX_POS = 8, 16, 64
PROMPT = [1, 4, 2]
NEW = 3
N = 40_000


def toy_params(key, scale=3.0):
  """One attention layer with a single head, learned positions, a tanh readout."""
  ks = jax.random.split(key, 7)
  normal = lambda k, shape, std: std * jax.random.normal(k, shape, jnp.float32)
  return {"embed": normal(ks[0], (V, D), 1.0), "pos": normal(ks[1], (MAX_POS, D), 0.5),
          "wq": normal(ks[2], (D, D), 0.4), "wk": normal(ks[3], (D, D), 0.4),
          "wv": normal(ks[4], (D, D), 0.4), "wo": normal(ks[5], (D, D), 0.4),
          "out": normal(ks[6], (D, V), scale)}


@dataclasses.dataclass(frozen=True)
class ToyTarget(sj.Target):
  """The wrapper: the protocol's four methods around the toy model's own functions."""
  vocab_size: int = V
  max_position_embeddings: int = MAX_POS
  eos_token_ids: tuple = ()
  tree_capable: bool = True

  def init_cache(self, batch, capacity):
    return {"kv": jnp.zeros((batch, capacity, 2, D), jnp.float32)}

  def forward(self, params, tokens, cache, offsets, *, positions=None, tree_mask=None,
              return_layers=()):
    b, t = tokens.shape
    new = jnp.arange(t, dtype=jnp.int32)
    if positions is None:
      positions = offsets[:, None] + new[None]
    x = params["embed"][tokens] + params["pos"][positions]
    q, k, v = x @ params["wq"], x @ params["wk"], x @ params["wv"]
    rows = jnp.arange(b)[:, None]
    kv = cache["kv"].at[rows, offsets[:, None] + new[None]].set(jnp.stack([k, v], axis=2))
    slot = jnp.arange(kv.shape[1], dtype=jnp.int32)[None, None, :]
    rel = slot - offsets[:, None, None]                     # index among the new tokens
    if tree_mask is None:
      among_new = rel <= new[None, :, None]
    else:
      among_new = jnp.take_along_axis(tree_mask, jnp.clip(rel, 0, t - 1).repeat(t, 1), axis=2)
    visible = (rel < 0) | ((rel < t) & among_new)
    scores = jnp.einsum("btd,bsd->bts", q, kv[:, :, 0]) / np.sqrt(D)
    weights = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    h = jnp.tanh(x + jnp.einsum("bts,bsd->btd", weights, kv[:, :, 1]) @ params["wo"])
    return sj.ForwardOutput(h @ params["out"], h, (), {"kv": kv})

  def move_kv(self, cache, lengths, path, n_accepted):
    kv = cache["kv"]
    s, d = kv.shape[1], path.shape[1]
    rows = jnp.arange(path.shape[0])[:, None]
    j = jnp.arange(d, dtype=jnp.int32)[None]
    src = jnp.minimum(lengths[:, None] - 1 + jnp.maximum(path, 0), s - 1)
    dst = jnp.where(j < n_accepted[:, None], lengths[:, None] + j, s)
    return {"kv": kv.at[rows, dst].set(kv[rows, src], mode="drop")}


TARGET = ToyTarget()


@functools.lru_cache(None)
def params():
  return toy_params(jax.random.key(7))


@functools.lru_cache(None)
def drafter():
  """A spec_jax model of the same vocabulary as the draft."""
  cfg = sj.ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1,
                       num_heads=2, num_kv_heads=1, max_position_embeddings=MAX_POS)
  model = sj.init_model(cfg, jax.random.key(12))
  model.params["embed"] = model.params["embed"] * 60.0
  return sj.drafters.DraftModel(model)


def run(prompts, drafter=None, sampling=sj.Sampling(0.0), key=0, new=12, tree=None):
  prompt_tokens, lens, capacity = sj.prepare_batch(sj.Model(TARGET, params()), prompts, new, 8)
  b = len(prompts)
  res = jax.jit(functools.partial(
      sj.decode, config=TARGET, drafter=drafter, num_draft=3, max_new_tokens=new,
      capacity=capacity, sampling=sampling.as_arrays(b), stop_tokens=(), tree=tree,
      greedy=sampling.is_greedy))(params(), prompt_tokens, lens, jax.random.key(key),
                                  drafter_params=None if drafter is None else drafter.params)
  return res


PROMPTS = [[1, 4, 2, 7, 7, 3], [5], [2, 2, 6, 1]]


def test_plain_greedy_is_the_argmax_of_a_full_forward():
  """The wrapper itself is right: plain decoding through the core equals re-running the whole
  sequence through the toy model and taking the argmax."""
  res = run(PROMPTS)
  for b, prompt in enumerate(PROMPTS):
    seq = list(prompt)
    for _ in range(12):
      x = jnp.asarray([seq], jnp.int32)
      out = TARGET.forward(params(), x, TARGET.init_cache(1, 32), jnp.zeros((1,), jnp.int32))
      seq.append(int(jnp.argmax(out.logits[0, -1])))
    assert sj.new_tokens(res)[b] == seq[len(prompt):]


@pytest.mark.parametrize("tree", [None, sj.TreeSpec(depth=3, top_k=2, num_nodes=6)],
                         ids=["chain", "tree"])
def test_greedy_speculative_equals_plain_on_a_target_of_our_own(tree):
  plain = sj.new_tokens(run(PROMPTS))
  res = run(PROMPTS, drafter(), tree=tree)
  assert sj.new_tokens(res) == plain
  assert int(np.sum(res.drafted)) > 0 and 0 < int(np.sum(res.accepted)) < int(np.sum(res.drafted))


def exact_joint(sampling):
  """P(x1, x2, x3) [V, V, V] of plain sampling from the toy model, by enumeration."""
  seqs = np.array([[a, b] for a in range(V) for b in range(V)], np.int32)
  tokens = np.concatenate([np.tile(PROMPT, (len(seqs), 1)), seqs], axis=1)
  out = TARGET.forward(params(), jnp.asarray(tokens), TARGET.init_cache(len(seqs), 16),
                       jnp.zeros(len(seqs), jnp.int32))
  p = np.asarray(sj.sampling.probs(out.logits, sampling), np.float64)
  n = len(PROMPT)
  joint = p[0, n - 1][:, None, None] * p[::V, n].reshape(V, V)[:, :, None] * \
      p[:, n + 1].reshape(V, V, V)
  return joint / joint.sum()


def test_sampled_speculation_keeps_the_exact_joint_on_a_target_of_our_own():
  sampling = sj.Sampling(temperature=1.0)
  res = run([PROMPT] * N, drafter(), sampling, key=3, new=NEW)
  toks = np.asarray(sj.new_tokens(res))
  assert toks.shape == (N, NEW)
  rate = float(np.sum(res.accepted)) / float(np.sum(res.drafted))
  assert 0.05 < rate < 0.98, rate                       # drafts are rejected sometimes
  counts = np.bincount(toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2], minlength=V ** 3)
  assert_same_distribution(counts, exact_joint(sampling), alpha=1e-3)


def test_generate_runs_a_model_of_our_own_and_trees_need_move_kv():
  model = sj.Model(TARGET, params())
  out = sj.generate(model, PROMPTS, drafter=drafter(), num_draft=3, max_new_tokens=12,
                    sampling=sj.Sampling(0.0), stop_tokens=[])
  assert out.tokens == sj.new_tokens(run(PROMPTS)) and out.text is None
  chain_only = sj.Model(dataclasses.replace(TARGET, tree_capable=False), params())
  with pytest.raises(ValueError, match="tree drafting needs a target with move_kv"):
    sj.generate(chain_only, PROMPTS, drafter=drafter(), tree=sj.TreeSpec(3, 2, 6))
