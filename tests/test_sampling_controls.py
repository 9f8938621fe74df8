"""min-p, logit bias and repetition / presence / frequency penalties (issue 32): bad input,
parity with transformers' logits processors, greedy speculation equal to plain greedy, and
losslessness under speculation (chi-square against the exact processed target joint), with a
lossy variant (the penalties' history without the drafted prefix) shown to fail.

The history argument (docs/sampling.md): verify position i must be processed with the row's
committed history plus the drafts before i; the exact joint below conditions every factor on
its own prefix, so a round that got the history wrong is caught at its second draft.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from spec_jax.decoding import rounds
from spec_jax.decoding.compiled import clear_compiled
from spec_jax.decoding.strategies import tree as tree_strategy
from spec_jax.models.transformer import KVCache, forward
from spec_jax.sampling import History
from tests.conftest import need_shared
from tests.stats_helpers import assert_same_distribution, chi_square, chi2_sf
from tests.test_lossless import N, PROMPT, V, _models, joint_counts

# Every control at once: strong enough that a wrong history changes the joint visibly.
ALL = dict(min_p=0.05, repetition_penalty=1.8, presence_penalty=0.7, frequency_penalty=0.4,
           logit_bias={5: 1.5, 2: -0.5})


# ------------------------------------------------------------------------------ bad input

@pytest.mark.parametrize("kwargs,field", [
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=-0.5), "presence_penalty"),
    (dict(frequency_penalty=-0.5), "frequency_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=np.array([0.1, 2.0])), "min_p"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={3: float("nan")}), "logit_bias"),
    (dict(logit_bias="3:1"), "logit_bias"),
    # Biases that are not numbers: a TypeError, a message without the field, or (text that
    # float() reads) accepted before.
    (dict(logit_bias={1: None}), "the bias of token 1 must be a finite number"),
    (dict(logit_bias={1: "x"}), "the bias of token 1 must be a finite number"),
    (dict(logit_bias={1: "1.0"}), "the bias of token 1 must be a finite number"),
    (dict(logit_bias={1: b"1"}), "the bias of token 1 must be a finite number"),
])
def test_bad_values_raise_naming_the_field(kwargs, field):
  with pytest.raises(ValueError, match=field):
    sj.Sampling(**kwargs)


def test_bias_outside_the_vocabulary_raises_before_any_compile(monkeypatch):
  target, _ = _models()

  def no_compile(*a, **k):
    raise AssertionError("compiled before the check")

  monkeypatch.setattr("spec_jax.decoding.generate.compiled_decode_call", no_compile)
  for bias in ({V + 2: 1.0}, [{1: 1.0}, {V + 3: -1.0}]):
    with pytest.raises(ValueError, match=f"logit_bias: token id 1[01] .*in \\[0, {V}\\)"):
      sj.generate(target, [PROMPT, PROMPT], max_new_tokens=2,
                  sampling=sj.Sampling(logit_bias=bias))
  with pytest.raises(ValueError, match="logit_bias"):
    sj.decode(target.params, jnp.asarray([PROMPT]), jnp.asarray([3]), jax.random.key(0),
              config=target.config, max_new_tokens=2, capacity=16,
              sampling=sj.Sampling(logit_bias={V: 1.0}))
  with pytest.raises(ValueError, match="2 entries but the batch has 3|3 rows"):
    sj.Sampling(logit_bias=[{1: 1.0}, None]).as_arrays(3)


def test_repeated_ids_in_bias_pairs_add_up_as_in_a_logit_bias():
  """[(3, 1.0), (3, 2.0)] kept the last pair (2.0) where LogitBias(ids=[3, 3]) adds (3.0)."""
  logits = jnp.zeros((1, V))
  pairs = sj.sampling.probs(logits, sj.Sampling(1.0, logit_bias=[(3, 1.0), (3, 2.0)]))
  arrays = sj.sampling.probs(logits, sj.Sampling(1.0, logit_bias=sj.sampling.LogitBias(
      ids=jnp.asarray([3, 3]), values=jnp.asarray([1.0, 2.0]))))
  np.testing.assert_allclose(pairs, arrays, rtol=1e-6)
  assert float(pairs[0, 3] / pairs[0, 0]) == pytest.approx(np.exp(3.0), rel=1e-5)


def test_decode_checks_every_field_when_one_is_text():
  """A text field made Sampling look unreadable, so decode skipped every check (a bias on id
  99 of a 16-token vocabulary ran, dropped by the scatter): now the text is refused."""
  target, _ = _models()
  with pytest.raises(ValueError, match="Sampling.temperature must be"):
    sj.decode(target.params, jnp.asarray([PROMPT]), jnp.asarray([3]), jax.random.key(0),
              config=target.config, max_new_tokens=2, capacity=16,
              sampling=sj.Sampling(temperature="0.7", logit_bias={99: 1.0}))


def test_off_values_cost_nothing_and_change_nothing():
  """Every new control at its off value: no history in the program (static), the same
  distribution as before; a per-row bias map pads with zero entries."""
  assert not sj.Sampling(0.7, 3, 0.9).needs_history
  assert not sj.Sampling(min_p=0.2, logit_bias={1: 1.0}).needs_history
  assert sj.Sampling(presence_penalty=np.array([0.0, 0.1])).needs_history
  logits = jax.random.normal(jax.random.key(0), (2, 3, 11)) * 3
  hist = History.of_prompt(jnp.asarray([[1, 2], [3, 0]]), jnp.asarray([2, 1]), 11)
  off = sj.Sampling(0.8).as_arrays(2)
  np.testing.assert_array_equal(sj.sampling.probs(logits, off, hist),
                                sj.sampling.probs(logits, off))
  rows = sj.Sampling(logit_bias=[{4: 2.0, 1: -1.0}, None]).as_arrays(2).logit_bias
  pad = [0] * (sj.sampling_options.BIAS_BUCKET - 2)    # padded to a bucket: one executable
  np.testing.assert_array_equal(rows.ids, [[1, 4] + pad, [0, 0] + pad])
  np.testing.assert_array_equal(rows.values, [[-1.0, 2.0] + pad, [0.0, 0.0] + pad])


# ------------------------------------------------------------- parity with transformers

@pytest.fixture(scope="module")
def real():
  """(sj model, transformers model) of ../shared/models/tinystories656K, float32."""
  transformers = pytest.importorskip("transformers")
  folder = need_shared("models", "tinystories656K")
  hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                         dtype="float32")
  return sj.load(folder, dtype="float32"), hf.eval()


class _OpenAIPenalties:
  """presence / frequency as OpenAI defines them, over the output (input_ids past the prompt),
  a transformers LogitsProcessor (transformers has none)."""

  def __init__(self, prompt_len, presence, frequency):
    self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

  def __call__(self, input_ids, scores):
    import torch
    out = input_ids[:, self.prompt_len:]
    counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
    return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def _hf_processors(prompt_len, t, top_k, top_p, min_p, rep, pres, freq, bias):
  from transformers.generation import logits_process as lp
  procs = [lp.SequenceBiasLogitsProcessor([[[k], v] for k, v in bias.items()])] if bias else []
  procs += [lp.RepetitionPenaltyLogitsProcessor(rep), _OpenAIPenalties(prompt_len, pres, freq),
            lp.TemperatureLogitsWarper(t)]
  if top_k:
    procs.append(lp.TopKLogitsWarper(top_k))
  if top_p < 1:
    procs.append(lp.TopPLogitsWarper(top_p))
  if min_p:
    procs.append(lp.MinPLogitsWarper(min_p))
  return lp.LogitsProcessorList(procs)


@pytest.mark.parametrize("case", [
    dict(min_p=0.1), dict(min_p=0.3, t=0.7), dict(rep=1.3), dict(rep=0.8), dict(pres=0.9),
    dict(freq=0.6), dict(bias={7: 3.0, 100: -2.0, 13: float("-inf")}),
    dict(t=0.8, top_k=40, top_p=0.9, min_p=0.05, rep=1.2, pres=0.3, freq=0.2, bias={7: 1.0}),
])
def test_next_token_distribution_matches_transformers(real, case):
  """sj.sampling.probs of the sj model's logits with the row's History equals transformers'
  processors applied to its own model's logits (max abs difference <= 1e-5, float32), after a
  prompt and an output with repeated tokens."""
  import torch
  model, hf = real
  c = dict(t=1.0, top_k=0, top_p=1.0, min_p=0.0, rep=1.0, pres=0.0, freq=0.0, bias={})
  c.update(case)
  prompt = [1, 415, 931, 7, 42, 7]
  output = [42, 88, 88, 13, 88, 300]
  seq = prompt + output
  with torch.no_grad():
    hf_logits = hf(torch.tensor([seq])).logits[:, -1].float()
    ids = torch.tensor([seq])
    want = torch.softmax(_hf_processors(len(prompt), **c)(ids, hf_logits), -1).numpy()[0]
  cfg = model.config
  logits = forward(model.params, cfg, jnp.asarray([seq]), KVCache.zeros(cfg, 1, 32),
                   jnp.zeros((1,), jnp.int32)).logits[:, -1]
  hist = History.of_prompt(jnp.asarray([prompt]), jnp.asarray([len(prompt)]), cfg.vocab_size)
  hist = hist.add(jnp.asarray([output]), jnp.asarray([len(output)]))
  s = sj.Sampling(c["t"], c["top_k"], c["top_p"], min_p=c["min_p"],
                  repetition_penalty=c["rep"], presence_penalty=c["pres"],
                  frequency_penalty=c["freq"], logit_bias=c["bias"] or None)
  got = np.asarray(sj.sampling.probs(logits, s.as_arrays(1), hist))[0]
  assert np.max(np.abs(got - want)) <= 1e-5, np.max(np.abs(got - want))
  assert (got > 0).sum() == (want > 0).sum()


def test_greedy_generate_matches_transformers(real):
  """Plain greedy decoding with a repetition penalty, presence / frequency penalties and a
  logit bias: the same tokens as transformers' generate with those processors."""
  import torch
  from transformers.generation import logits_process as lp
  model, hf = real
  prompt = [1, 415, 931, 7, 42]
  new = 16
  bias = {13: 2.0, 11: -3.0}
  with torch.no_grad():
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                      repetition_penalty=1.4, sequence_bias=[[[k], v] for k, v in bias.items()],
                      logits_processor=lp.LogitsProcessorList(
                          [_OpenAIPenalties(len(prompt), 0.5, 0.8)]),
                      eos_token_id=None, pad_token_id=0)
  want = out[0, len(prompt):].tolist()
  got = sj.generate(model, [prompt], max_new_tokens=new, stop_tokens=[], sampling=sj.Sampling(
      0.0, repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.8,
      logit_bias=bias)).tokens[0]
  plain = sj.generate(model, [prompt], max_new_tokens=new, stop_tokens=[],
                      sampling=sj.Sampling(0.0)).tokens[0]
  assert got == want
  assert got != plain                       # the controls did change the greedy path


# ---------------------------------------------------------- greedy speculation == plain

def _per_row_controls():
  """One row per control (and one with all of them) as per-row settings: one compile."""
  rows = [dict(), dict(min_p=0.3), dict(repetition_penalty=6.0), dict(repetition_penalty=0.7),
          dict(presence_penalty=1.5), dict(frequency_penalty=0.9), dict(logit_bias={5: 4.0}),
          dict(min_p=0.1, repetition_penalty=1.6, presence_penalty=0.8, frequency_penalty=0.5,
               logit_bias={2: 2.0, 7: -1.0})]
  col = lambda name, off: np.asarray([r.get(name, off) for r in rows], np.float32)
  return len(rows), sj.Sampling(
      np.zeros(len(rows), np.float32), min_p=col("min_p", 0.0),
      repetition_penalty=col("repetition_penalty", 1.0),
      presence_penalty=col("presence_penalty", 0.0),
      frequency_penalty=col("frequency_penalty", 0.0),
      logit_bias=[r.get("logit_bias") for r in rows])


def test_greedy_speculation_equals_plain_greedy_with_every_control():
  """Chain (a draft model, sampled and greedy drafts), tree: the same tokens as plain greedy
  decoding with each control, float32; the controls do change the path."""
  target, draft = _models()
  b, s = _per_row_controls()
  prompts = [PROMPT + [3, 3, 5]] * b
  run = lambda **kw: np.asarray(sj.generate(target, prompts, max_new_tokens=10, sampling=s,
                                            stop_tokens=[], **kw).tokens)
  plain = run()
  for row in (4, 5, 6, 7):          # the controls change the path (logits ~0.1: r barely does)
    assert (plain[row] != plain[0]).any(), (row, plain)
  chain = sj.generate(target, prompts, max_new_tokens=10, sampling=s, stop_tokens=[],
                      drafter=sj.drafters.DraftModel(draft), num_draft=3)
  np.testing.assert_array_equal(np.asarray(chain.tokens), plain)
  assert chain.stats.accepted > 0
  np.testing.assert_array_equal(
      run(drafter=sj.drafters.DraftModel(draft), tree=sj.TreeSpec(depth=2, top_k=2,
                                                                   num_nodes=4)), plain)
  # The governor (num_draft="auto": plain rounds between chains of several K), via sj.decode.
  drafter, gov = sj.drafters.DraftModel(draft), sj.Governor()
  ks = gov.candidates(drafter)
  res = sj.decode(target.params, jnp.asarray(prompts), jnp.full((b,), len(prompts[0])),
                  jax.random.key(0), config=target.config, drafter=drafter, num_draft="auto",
                  governor=gov, round_costs=jnp.asarray([1.0 + 0.05 * k for k in ks]),
                  max_new_tokens=10, capacity=32, sampling=s, stop_tokens=())
  np.testing.assert_array_equal(np.asarray(sj.new_tokens(res)), plain)
  assert int(res.k_rounds[0]) > 0 and int(res.k_rounds[1:].sum()) > 0    # both kinds ran


# ------------------------------------------------------------------------- losslessness

def exact_joint_processed(model, prompt, sampling, processors=()):
  """P(x1, x2, x3) [V, V, V] of plain sampling under `sampling` (scalars) with its penalties
  and `processors` (spec_jax.processors): every factor is sampling.probs with the History of
  its own prefix (the prompt, then the tokens before it)."""
  seqs = np.array([[a, b] for a in range(V) for b in range(V)], np.int32)      # [V*V, 2]
  m = len(seqs)
  tokens = np.concatenate([np.tile(prompt, (m, 1)), seqs], axis=1)
  logits = forward(model.params, model.config, jnp.asarray(tokens),
                   KVCache.zeros(model.config, m, 16), jnp.zeros(m, jnp.int32)).logits
  n = len(prompt)
  hist = History.of_prompt(jnp.asarray(tokens), jnp.full((m,), n), V, processors=processors,
                           params=tuple(p.params for p in processors))
  rows = sampling.as_arrays(m)
  h2 = hist.add(jnp.asarray(seqs[:, :1]), jnp.ones(m, jnp.int32))
  h3 = hist.add(jnp.asarray(seqs), jnp.full((m,), 2, jnp.int32))
  p1 = np.asarray(sj.sampling.probs(logits[:, n - 1], rows, hist), np.float64)[0]
  p2 = np.asarray(sj.sampling.probs(logits[:, n], rows, h2), np.float64)[::V]     # [x1, x2]
  p3 = np.asarray(sj.sampling.probs(logits[:, n + 1], rows, h3), np.float64).reshape(V, V, V)
  joint = p1[:, None, None] * p2[:, :, None] * p3
  return joint / joint.sum()


def _sample(target, drafter, sampling, seed, **kw):
  out = sj.generate(target, [PROMPT] * N, drafter=drafter, max_new_tokens=3, sampling=sampling,
                    key=jax.random.key(seed), stop_tokens=[], capacity=16,
                    prompt_bucket=len(PROMPT), **kw)
  toks = np.asarray(out.tokens)
  assert toks.shape == (N, 3)
  return toks, out.stats


SETTINGS = {"T1": sj.Sampling(1.0, **ALL), "T0.7": sj.Sampling(0.7, **ALL)}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_chain_with_every_control_is_lossless(setting):
  """A draft model drafting K=2 from its own processed q (its own prefix): the first three
  tokens (the prefill's, then the two of the first speculative round) have the exact joint."""
  target, draft = _models()
  sampling = SETTINGS[setting]
  toks, stats = _sample(target, sj.drafters.DraftModel(draft), sampling, seed=1, num_draft=2)
  assert 0.05 < stats.acceptance_rate < 0.98, stats.summary()
  assert_same_distribution(joint_counts(toks), exact_joint_processed(target, PROMPT, sampling),
                           alpha=1e-3)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_tree_with_every_control_is_lossless(setting):
  target, draft = _models()
  sampling = SETTINGS[setting]
  toks, stats = _sample(target, sj.drafters.DraftModel(draft), sampling, seed=2,
                        tree=sj.TreeSpec(depth=2, top_k=2, num_nodes=4))
  assert 0.05 < stats.acceptance_rate < 0.98, stats.summary()
  assert_same_distribution(joint_counts(toks), exact_joint_processed(target, PROMPT, sampling),
                           alpha=1e-3)


def test_ngram_drafts_with_every_control_are_lossless():
  """Deterministic drafts (q one-hot) need no processing on the drafter's side."""
  target, _ = _models()
  sampling = SETTINGS["T1"]
  prompt = [1, 4, 2, 1, 4, 2, 1, 4]
  out = sj.generate(target, [prompt] * N, drafter=sj.drafters.NGram(2, 1), num_draft=2,
                    max_new_tokens=3, sampling=sampling, key=jax.random.key(3), stop_tokens=[],
                    capacity=24, prompt_bucket=len(prompt))
  assert out.stats.drafted > N // 2, out.stats.summary()
  assert_same_distribution(joint_counts(np.asarray(out.tokens)),
                           exact_joint_processed(target, prompt, sampling))


def test_eagle3_head_with_every_control_is_lossless():
  """An EAGLE-3 head with a reduced draft vocabulary (a biased token outside it): it keeps no
  history, so its q is probs(logits) with bias and min-p but no penalty; lossless all the
  same, because that q is what its drafts are drawn from."""
  from spec_jax.drafters import EAGLE3
  target, _ = _models()
  sampling = SETTINGS["T0.7"]
  head = EAGLE3.init(target, key=jax.random.key(5), init_std=0.5,
                     draft_tokens=[i for i in range(V) if i != 5])
  toks, stats = _sample(target, head, sampling, seed=4, num_draft=2)
  assert 0.05 < stats.acceptance_rate < 0.98, stats.summary()
  assert_same_distribution(joint_counts(toks), exact_joint_processed(target, PROMPT, sampling),
                           alpha=1e-3)


def _lossy_p_value(monkeypatch, module, name, draft, **kw):
  """p-value of the chain / tree test with the penalties' history of every verify position
  taken as the committed one (the drafted prefix left out)."""
  target, _ = _models()
  sampling = SETTINGS["T1"]
  committed = lambda history, n: history.replace(counts=jnp.broadcast_to(
      history.counts[:, None], (history.counts.shape[0], n, history.counts.shape[-1])))
  if name == "chain_history":
    lossy = lambda history, drafts: committed(history, drafts.shape[1] + 1)
  else:
    lossy = lambda history, tree, depth: committed(history, tree.tokens.shape[1])
  monkeypatch.setattr(module, name, lossy)
  clear_compiled()
  try:
    toks, _ = _sample(target, sj.drafters.DraftModel(draft), sampling, seed=1, **kw)
  finally:
    clear_compiled()
  stat, dof = chi_square(joint_counts(toks), exact_joint_processed(target, PROMPT, sampling))
  return chi2_sf(stat, dof)


def test_history_without_the_drafted_prefix_fails_the_same_test(monkeypatch):
  """The lossy variant: verify positions penalised with the committed history only. The same
  chi-square rejects it, for a chain and for a tree: the test has the power to catch it."""
  _, draft = _models()
  assert _lossy_p_value(monkeypatch, rounds, "chain_history", draft, num_draft=2) < 1e-6
  assert _lossy_p_value(monkeypatch, tree_strategy, "tree_history", draft,
                        tree=sj.TreeSpec(depth=2, top_k=2, num_nodes=4)) < 1e-6


# ----------------------------------------------------------------------------- the CLIs

def test_command_lines_take_every_control(capsys):
  """python -m spec_jax generate and python -m spec_jax.eval: one flag per Sampling option
  (the eval's reach generate() as (name, value) pairs); bad values name the field."""
  from spec_jax.__main__ import main
  from spec_jax.eval import cli
  args = cli.build_parser().parse_args(
      ["--target", "t", "--drafter", "ngram", "--out", "o", "--min-p", "0.1",
       "--repetition-penalty", "1.2", "--presence-penalty", "0.5", "--frequency-penalty",
       "0.25", "--logit-bias", "5:2,7:-1.5", "--draft-temperature-scale", "0.8"])
  opts = cli.options_from(args)
  assert dict(opts.sampling) == {"min_p": 0.1, "repetition_penalty": 1.2,
                                 "presence_penalty": 0.5, "frequency_penalty": 0.25,
                                 "logit_bias": ((5, 2.0), (7, -1.5)),
                                 "draft_temperature_scale": np.float32(0.8)}
  s = opts.sampling_of()
  assert s.needs_history and s.scalars()[-2:] == (((5, 2.0), (7, -1.5)), np.float32(0.8))
  import dataclasses
  with pytest.raises(ValueError, match="min_p"):
    dataclasses.replace(opts, sampling=(("min_p", 2.0),)).sampling_of()
  model = need_shared("models", "stories260K")
  assert main(["generate", "--model", str(model), "--repetition-penalty", "-1"]) == 2
  assert "Sampling.repetition_penalty must be finite and > 0" in capsys.readouterr().err


def test_a_greedy_row_beside_a_sampled_one_takes_the_argmax_of_its_processed_logits():
  """In a batch of mixed temperatures, a greedy row is one-hot at the argmax after its bias
  (and penalties, and a grammar's mask): taking the raw logits' argmax passed every test."""
  logits = jnp.asarray([[3.0, 1.0, 0.0, -1.0], [3.0, 1.0, 0.0, -1.0]])
  rows = sj.Sampling(temperature=np.float32([0.0, 1.0]),
                     logit_bias=[{2: 10.0}, {2: 10.0}]).as_arrays(2)
  p = np.asarray(sj.sampling.probs(logits, rows))
  np.testing.assert_array_equal(p[0], [0.0, 0.0, 1.0, 0.0])
  assert np.asarray(sj.sampling.greedy_tokens(logits, rows))[0] == 2
  hist = History.of_prompt(jnp.asarray([[0, 0], [0, 0]]), jnp.asarray([2, 2]), 4)
  pen = sj.Sampling(temperature=np.float32([0.0, 1.0]),
                    repetition_penalty=np.float32([5.0, 1.0])).as_arrays(2)
  assert np.asarray(sj.sampling.probs(logits, pen, hist))[0].argmax() == 1   # 3 / 5 < 1


def test_top_p_where_the_kept_mass_is_exactly_top_p_matches_transformers():
  """Probabilities 0.5 / 0.25 / 0.125 / 0.125 are exact in float32: a nucleus reaching top_p
  exactly stops there, as transformers' TopPLogitsWarper does (a >= for > kept one more)."""
  logits = jnp.log(jnp.asarray([[4.0, 2.0, 1.0, 1.0]], jnp.float32))
  torch = pytest.importorskip("torch")
  from transformers.generation import logits_process as lp
  exact = [0.5, 0.25, 0.125, 0.125]
  # The premise is float32 arithmetic: a CPU whose exp rounds log(2) a ulp off puts the kept
  # mass a ulp beside top_p, where either side of the boundary is right.
  if (np.asarray(jax.nn.softmax(logits, -1))[0].tolist() != exact or
      torch.softmax(torch.tensor(np.asarray(logits)), -1).numpy()[0].tolist() != exact):
    pytest.skip("this CPU's float32 softmax of log([4, 2, 1, 1]) is not exactly dyadic")
  for top_p, want in ((0.75, [2 / 3, 1 / 3, 0.0, 0.0]), (0.5, [1.0, 0.0, 0.0, 0.0])):
    got = np.asarray(sj.sampling.probs(logits, sj.Sampling(top_p=top_p).as_arrays(1)))[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    theirs = torch.softmax(lp.TopPLogitsWarper(top_p)(None, torch.tensor(np.asarray(logits))),
                           -1).numpy()[0]
    np.testing.assert_allclose(got, theirs, rtol=1e-6, atol=1e-7)
