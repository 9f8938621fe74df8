"""bfloat16 numerics: every dot accumulates in float32; a bf16 forward tracks the f32 one.

The first tests trace whole decodes (jax.make_jaxpr: no compile) of a bf16 target with every
drafter kind, chains, trees, the governor, sampled and greedy, the jnp and the Pallas attention,
and walk every equation of the jaxpr, sub-jaxprs included (while bodies, conds, the Pallas
kernel): a `dot_general` whose operands are bfloat16 or float16 must carry
preferred_element_type=float32 (spec_jax.models.matmul). A control shows the walk finds a bare
bf16 dot.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from spec_jax.decoding.prompts import prepare_batch
from spec_jax.drafters.eagle import EAGLE, EAGLE3, EAGLE3Fused
from spec_jax.drafters.medusa import Medusa
from spec_jax.drafters.mtp import MTP
from spec_jax.models import matmul

LOW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
CFG = sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, max_position_embeddings=256, eos_token_ids=(),
                     dtype="bfloat16")
PROMPTS = [[1, 5, 7, 9, 5, 7], [1, 3]]


def _sub_jaxprs(value):
  """The jaxprs inside an equation parameter (a Jaxpr, a ClosedJaxpr, or tuples of them)."""
  if hasattr(value, "eqns"):
    yield value
  elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
    yield value.jaxpr
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from _sub_jaxprs(v)


def dot_report(jaxpr) -> tuple:
  """(dots seen, descriptions of the dots with low-precision operands that do not accumulate
  in float32), over jaxpr and every jaxpr nested in it."""
  seen, bad = 0, []
  stack = [jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr]
  while stack:
    j = stack.pop()
    for eqn in j.eqns:
      if eqn.primitive.name == "dot_general":
        seen += 1
        dtypes = [jnp.dtype(v.aval.dtype) for v in eqn.invars]
        preferred = eqn.params.get("preferred_element_type")
        if any(d in LOW for d in dtypes) and (preferred is None or
                                             jnp.dtype(preferred) != jnp.float32):
          shapes = [tuple(v.aval.shape) for v in eqn.invars]
          bad.append(f"dot_general {dtypes} {shapes} -> {preferred}")
      for value in eqn.params.values():
        stack.extend(_sub_jaxprs(value))
  return seen, bad


@functools.lru_cache(None)
def target(attention_impl="auto"):
  """The bf16 target; with "pallas", head_dim 16 (a size the kernels take)."""
  cfg = CFG if attention_impl == "auto" else CFG.replace(attention_impl=attention_impl,
                                                         head_dim=16)
  return sj.init_model(cfg, jax.random.key(0))


def make_drafter(kind):
  t = target()
  key = jax.random.key(3)
  if kind == "draft_model":
    return sj.drafters.DraftModel(sj.init_model(CFG.replace(num_layers=1), jax.random.key(1)))
  if kind == "ngram":
    return sj.drafters.NGram(3, 1)
  if kind == "medusa":
    return Medusa.init(t, num_heads=3, key=key)
  cls = {"eagle": EAGLE, "eagle3": EAGLE3, "eagle3_fused": EAGLE3Fused, "mtp": MTP}[kind]
  return cls.init(t, key=key)


def decode_jaxpr(model, drafter=None, *, greedy=True, num_draft=3, tree=None, governor=None):
  prompts, lens, capacity = prepare_batch(model, PROMPTS, 8, 8)
  sampling = sj.Sampling(temperature=0.0 if greedy else 1.0, top_p=1.0 if greedy else 0.9)
  run = functools.partial(
      sj.decode, config=model.config, drafter=drafter, num_draft=num_draft, max_new_tokens=8,
      capacity=capacity, sampling=sampling.as_arrays(len(PROMPTS)), greedy=greedy, tree=tree,
      governor=governor)
  dparams = None if drafter is None else drafter.params
  return jax.make_jaxpr(run)(model.params, prompts, lens, jax.random.key(0),
                             drafter_params=dparams)


KINDS = ["draft_model", "ngram", "medusa", "eagle", "eagle3", "eagle3_fused", "mtp"]


def test_the_walk_finds_a_bf16_dot_without_f32_accumulation():
  x = jnp.ones((2, 8), jnp.bfloat16)
  w = jnp.ones((8, 4), jnp.bfloat16)
  nested = jax.make_jaxpr(lambda x, w: jax.lax.while_loop(
      lambda c: c[1] < 2, lambda c: (c[0] + x @ w, c[1] + 1), (x @ w, 0))[0])(x, w)
  seen, bad = dot_report(nested)
  assert seen == 2 and len(bad) == 2, bad              # top level and inside the while body
  seen, bad = dot_report(jax.make_jaxpr(lambda x, w: matmul.dense(x, w))(x, w))
  assert seen == 1 and bad == []
  y = matmul.dense(x, w)
  assert y.dtype == jnp.bfloat16 and matmul.dense(x, w, out_dtype=jnp.float32).dtype == jnp.float32


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["plain"] + KINDS)
def test_every_dot_of_a_bf16_decode_accumulates_in_float32(kind, greedy):
  drafter = None if kind == "plain" else make_drafter(kind)
  seen, bad = dot_report(decode_jaxpr(target(), drafter, greedy=greedy))
  assert seen >= 2 * CFG.num_layers * 4, seen          # projections, attention, LM head
  assert bad == [], "\n".join(sorted(set(bad)))


@pytest.mark.parametrize("kind", ["draft_model", "eagle3"])
def test_every_dot_of_a_bf16_tree_decode_accumulates_in_float32(kind):
  tree = sj.TreeSpec(depth=3, top_k=2, num_nodes=5)
  seen, bad = dot_report(decode_jaxpr(target(), make_drafter(kind), tree=tree))
  assert seen > 0 and bad == [], "\n".join(sorted(set(bad)))


def test_every_dot_of_a_bf16_governed_decode_accumulates_in_float32():
  gov = sj.Governor(ks=(0, 1, 3), costs={0: 1.0, 1: 1.2, 3: 1.5})
  seen, bad = dot_report(decode_jaxpr(target(), make_drafter("draft_model"), num_draft="auto",
                                      governor=gov, greedy=False))
  assert seen > 0 and bad == [], "\n".join(sorted(set(bad)))


def test_every_dot_of_the_pallas_attention_path_accumulates_in_float32():
  """attention_impl="pallas" (interpret mode here): the kernel's own jaxpr is walked too."""
  with warnings.catch_warnings():
    warnings.simplefilter("error")                     # no fallback to the jnp reference
    jaxpr = decode_jaxpr(target("pallas"), sj.drafters.NGram(3, 1))
  assert "pallas_call" in str(jaxpr)
  seen, bad = dot_report(jaxpr)
  assert seen > 0 and bad == [], "\n".join(sorted(set(bad)))


# ----------------------------------------------------------------------------- greedy in bf16

from spec_jax.eval.greedy import BF16_ARGMAX_TOL  # noqa: E402 (2^-6 of the logits' scale)


def _reference_logits(model16, pairs):
  """float32 logits of the bf16 weights (no bf16 rounding of activations: what the bf16 model
  computes up to its own rounding) at the positions that predict `new`, [len(new), V] for
  each (prompt, new) of `pairs`: one jitted forward over the batch, each sequence padded at its
  end (causal: padding after a position never changes its logits)."""
  ref = model16.astype("float32")
  seqs = [list(prompt) + list(new) for prompt, new in pairs]
  width = max(map(len, seqs))
  batch = jnp.asarray([s + [0] * (width - len(s)) for s in seqs], jnp.int32)
  forward = jax.jit(sj.forward, static_argnums=1)
  out = forward(ref.params, ref.config, batch, sj.KVCache.zeros(ref.config, len(seqs), width),
                jnp.zeros((len(seqs),), jnp.int32))
  logits = np.asarray(out.logits, np.float64)
  return [logits[i, len(p) - 1:len(p) - 1 + len(n)] for i, (p, n) in enumerate(pairs)]


def test_bf16_greedy_tokens_are_argmaxes_within_a_stated_tolerance():
  """In bfloat16 a verify over K+1 rows and a one-row step may round differently, so greedy
  speculative output may leave plain greedy output at a near-tie. What must hold: every token
  either emits is the argmax of the bf16 model's logits (computed in float32 from the bf16
  weights) within BF16_ARGMAX_TOL of their scale, so where the two part, both tokens are within
  it of the maximum. (In float32 the equality is exact: test_engine, test_real_speculative.)"""
  from tests.conftest import need_shared
  from spec_jax.bench.prompts import prompt_token_lists
  target = sj.load(need_shared("models", "stories260K"), dtype="bfloat16")
  draft = sj.drafters.DraftModel(sj.load(need_shared("models", "salty279K"), dtype="bfloat16"))
  ids, _ = prompt_token_lists(target, "tinystories", 16, 8, 128, 0)
  new = 48
  plain = sj.generate(target, ids, max_new_tokens=new, sampling=sj.Sampling(0.0),
                      stop_tokens=[]).tokens
  spec = sj.generate(target, ids, drafter=draft, num_draft=4, max_new_tokens=new,
                     sampling=sj.Sampling(0.0), stop_tokens=[])
  assert spec.stats.accepted > 0
  pairs = [(prompt, toks) for prompt, a, b in zip(ids, plain, spec.tokens) for toks in (a, b)]
  reference = _reference_logits(target, pairs)
  checked, decisive = 0, []
  for (prompt, toks), logits in zip(pairs, reference):
    tol = BF16_ARGMAX_TOL * float(np.abs(logits).max())
    gap = logits.max(-1) - logits[np.arange(len(toks)), toks]
    assert gap.max() <= tol, (gap.max(), tol)
    top2 = np.sort(logits, axis=-1)[:, -2:]
    decisive.append(top2[:, 1] - top2[:, 0] > tol)   # where another token would fail
    checked += len(toks)
  for i, (a, b) in enumerate(zip(plain, spec.tokens)):
    j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if j is not None:               # a near-tie: both tokens within the tolerance there
      logits = reference[2 * i][j]  # the position that predicts a[j] (and b[j]: same prefix)
      tol = BF16_ARGMAX_TOL * float(np.abs(logits).max())
      assert logits.max() - logits[a[j]] <= tol and logits.max() - logits[b[j]] <= tol
  assert checked == 2 * len(ids) * new
  assert np.mean(np.concatenate(decisive)) > 0.75      # the tolerance has teeth (84 %)


def test_a_one_row_bf16_product_is_the_first_row_of_two():
  """On CPU a one-row bf16 product runs as two rows (XLA:CPU's one-row bf16 dot upcasts the
  whole weight to f32 every call): the same numbers as the direct dot, both orientations."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((1, 1, 64)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((64, 96)), jnp.bfloat16)
  assert matmul.two_rows_for_one(w) == (jax.default_backend() == "cpu")
  assert not matmul.two_rows_for_one(w.astype(jnp.float32))
  direct = jax.lax.dot_general(x, w, (((2,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(jnp.bfloat16)
  for got in (matmul.dense(x, w), matmul.dense(x, w.T, transposed=True)):
    assert got.shape == (1, 1, 96) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(direct, np.float32))
  hlo = jax.jit(matmul.dense).lower(x, w).compile().as_text()
  assert "f32[64,96]" not in hlo                       # no upcast copy of the weight


@pytest.mark.parametrize("orientation", ["out_in", "in_out", "both"])
def test_bf16_execution_layouts_give_the_canonical_logits(orientation, monkeypatch):
  """Every CPU orientation of the bf16 weights gives the canonical params' logits (one row and
  a verify block; bf16 rounding points are the same, so they agree to a few bf16 ulps)."""
  from spec_jax.models import layout
  monkeypatch.setenv("SPEC_JAX_CPU_LAYOUT", orientation)
  model = target()
  prepared = jax.jit(layout.prepare_params, static_argnums=1)(model.params, model.config)
  for tokens in ([[5]], [[5, 9, 1, 7]]):
    toks = jnp.asarray(tokens, jnp.int32)
    run = lambda p: sj.forward(p, model.config, toks, sj.KVCache.zeros(model.config, 1, 8),
                               jnp.zeros((1,), jnp.int32)).logits
    want, got = np.asarray(run(model.params)), np.asarray(run(prepared))
    np.testing.assert_allclose(got, want, atol=2 ** -6 * max(1.0, np.abs(want).max()))
