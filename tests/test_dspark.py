"""DSpark drafters: the sequential Markov head's exact q, losslessness, confidence, training.

The Markov head makes the drafts an autoregressive chain: slot k's q_k conditions on the token
drawn at slot k - 1. The checks: the reported q of every slot against a numpy reference of the
chain (DeepSpec `markov_head.py`, VanillaMarkov), greedy speculative output equal to plain
greedy for every head type and for trees, the exact joint (tests/test_lossless.py) by
chi-square at T = 1 and with top-p, and a lossy variant (q of the greedy-conditioned chain
reported beside drafts of the sampled chain) that the same check rejects.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from spec_jax import sampling as sampling_lib
from spec_jax.drafters.dspark import DSpark
from tests.conftest import SHARED
from tests.stats_helpers import chi2_critical, chi_square
from tests.test_dflash import GREEDY, _train_config, ctx_of, drafter_state, target  # noqa: F401
from tests.test_lossless import NEW6, PROMPT, TARGET_CFG, _peaky, counts3, exact_joint6

N = 12_000          # rows per joint check (as tests/test_dflash.py; here the exact
                    # drafter's statistic stays below the 1e-3 critical value and the lossy
                    # one's is 8-17x above it)


def small(target, head="vanilla", key=5, **kw):
  opts = dict(block_size=4, num_layers=2, target_layers=(1, 3), init_std=0.3, markov_rank=8,
              markov_head=head)
  opts.update(kw)
  return DSpark.init(target, key=jax.random.key(key), **opts)


def greedy_outputs(d, state, ctx):
  """One jitted call: the greedy drafts [B, K], confidence [B, K], and the corrected logits
  [B, K, V] and confidence logits [B, K] of the chain they form (teacher-forced on them)."""
  def run(params, state, ctx):
    drafts, _, conf, _ = d.propose_with_confidence(params, state, ctx)
    hidden, base, last = d.block_outputs(params, state, ctx, ctx.num_draft)
    prev = jnp.concatenate([last[:, None], drafts[:, :-1]], axis=1)
    logits, conf_logits = d.teacher_forced(params, base, prev, hidden)
    return drafts, conf, logits, conf_logits, base
  return [np.asarray(x) for x in jax.jit(run)(d.params, state, ctx.replace(greedy=True))]


# ----------------------------------------------------------------------------- the chain's q

def test_sampled_chain_reports_the_exact_q_of_each_draw(target):
  """q_k = softmax(z_k + w1[x_(k-1)] w2) with x_(k-1) the DRAWN previous token (x_p for slot
  0), checked against numpy; the teacher-forced training path gives the same logits."""
  d = small(target, init_std=0.5)
  prompt, first = [1, 5, 9, 22, 40, 7, 3, 80], 11
  state, buf, sampling = drafter_state(d, target, prompt, first)
  ctx = ctx_of(buf, 9, sampling, target, 4)

  def run(params, state, ctx):        # one compile for the sampled, teacher-forced and greedy
    drafts, q, conf, state2 = d.propose_with_confidence(params, state, ctx)
    hidden, base, _ = d.block_outputs(params, state, ctx, 4)
    prev = jnp.concatenate([jnp.full((1, 1), first, jnp.int32), drafts[:, :-1]], axis=1)
    logits, conf_tf = d.teacher_forced(params, base, prev, hidden)
    return (drafts, q, conf, state2, base, logits, conf_tf,
            d.propose(params, state, ctx.replace(greedy=True)))

  drafts, q, conf, state2, base, logits, conf_tf, greedy = jax.jit(run)(d.params, state, ctx)
  w1, w2 = (np.asarray(d.params["markov"][n], np.float64) for n in ("w1", "w2"))
  prev = [first] + list(np.asarray(drafts)[0, :-1])
  z = np.asarray(base, np.float64)[0] + np.stack([w1[t] @ w2 for t in prev])
  ref = np.exp(z - z.max(-1, keepdims=True))
  ref /= ref.sum(-1, keepdims=True)
  assert np.abs(np.asarray(q)[0] - ref).max() <= 1e-5
  assert np.abs(w1[prev[1]] @ w2 - w1[prev[2]] @ w2).max() > 0.1     # the head matters
  # The teacher-forced path on those drawn tokens (prev).
  assert np.abs(np.asarray(logits)[0] - z).max() <= 1e-4
  # The confidence: a probability per slot, kept in the state for a scheduler to read.
  c = np.asarray(conf)[0]
  assert c.shape == (4,) and np.all((c > 0) & (c < 1))
  np.testing.assert_allclose(np.asarray(state2.confidence)[0], c, rtol=1e-6)
  np.testing.assert_allclose(c, 1 / (1 + np.exp(-np.asarray(conf_tf)[0])), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(DSpark.survival(conf))[0], np.cumprod(c), rtol=1e-6)
  # Greedy: the argmax chain, q None.
  g, g_q, _ = greedy
  assert g_q is None
  prev, want = first, []
  for k in range(4):
    want.append(int(np.argmax(np.asarray(base)[0, k] + w1[prev] @ w2)))
    prev = want[-1]
  assert np.asarray(g)[0].tolist() == want


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_greedy_speculation_equals_plain_greedy(target, head):
  # rnn with DFlash's readout (slots 1 .. b-1: 3 drafts of a 4-slot block).
  d = small(target, head, readout="mask" if head == "rnn" else "next")
  prompts = [[1, 5, 9, 22, 40, 7, 3, 80, 11], [1, 3], [1, 60, 61, 62, 63, 2, 2, 9, 33, 17]]
  # 16 tokens: test_dflash.py::test_published_greedy_speculation_equals_plain_greedy's plain call
  # (the same target, prompts and shapes: one compile in a suite run).
  plain = sj.generate(target, prompts, max_new_tokens=16, sampling=GREEDY, stop_tokens=[])
  # Chains for vanilla and rnn, trees for gated (the expand that reads h_d).
  runs = {"vanilla": [dict(num_draft=4)],
          "gated": [dict(tree=sj.TreeSpec(4, 3, 10))], "rnn": [dict(num_draft=3)]}[head]
  for kw in runs:
    spec = sj.generate(target, prompts, drafter=d, max_new_tokens=16, sampling=GREEDY,
                       stop_tokens=[], **kw)
    assert spec.tokens == plain.tokens and spec.stats.drafted > 0, kw


def test_bad_configurations_raise_before_anything_compiles(target, tmp_path):
  d = small(target)
  with pytest.raises(ValueError, match=r"at most 4 tokens per round; num_draft=5"):
    sj.generate(target, [[1, 2, 3]], drafter=d, num_draft=5, max_new_tokens=4)
  with pytest.raises(ValueError, match=r"rnn Markov head cannot build trees"):
    sj.generate(target, [[1, 2, 3]], drafter=small(target, "rnn"), tree=sj.TreeSpec(3, 2, 6),
                max_new_tokens=4)
  with pytest.raises(ValueError, match=r"markov_head='bogus'; allowed: vanilla, gated, rnn"):
    small(target, "bogus")
  with pytest.raises(ValueError, match=r"readout='own'; allowed: next, mask"):
    small(target, readout="own")
  with pytest.raises(ValueError, match=r"at most 3 tokens per round; num_draft=4"):
    sj.generate(target, [[1, 2, 3]], drafter=small(target, readout="mask"), num_draft=4,
                max_new_tokens=4)
  with pytest.raises(ValueError, match=r"DeepSpec's format reads every block slot"):
    sj.drafters.export(small(target, readout="mask"), tmp_path / "x", target=target)
  with pytest.raises(ValueError, match=r"confidence_with_markov needs"):
    small(target, markov_rank=0, confidence_with_markov=True)
  with pytest.raises(ValueError, match=r"dflash: params have shapes"):
    d.replace(markov_rank=4)
  from train.config import load_config
  dspark = {"kind": "dspark", "block_size": 4, "num_draft": 5}
  with pytest.raises(ValueError, match=r"a DSpark block of 4 drafts at most block_size = 4"):
    load_config(_train_config(tmp_path / "a", head=dspark))
  with pytest.raises(ValueError, match=r"DSpark block of 4 drafts at most block_size - 1 = 3"):
    load_config(_train_config(tmp_path / "m", head=dict(dspark, num_draft=4, readout="mask")))
  with pytest.raises(ValueError, match=r"head.markov_head='lstm'"):
    load_config(_train_config(tmp_path / "b", head=dict(dspark, num_draft=4,
                                                        markov_head="lstm")))
  with pytest.raises(ValueError, match=r"train.l1_weight / train.confidence_weight apply to"):
    load_config(_train_config(tmp_path / "c", head={"kind": "eagle"},
                              train={"l1_weight": 0.5}))


# ----------------------------------------------------------------------------- losslessness

@functools.lru_cache(None)
def tiny():
  """test_lossless's vocabulary-8 target and a DSpark drafter whose Markov head dominates:
  slot k's q depends strongly on the token drawn at slot k - 1."""
  t = _peaky(sj.init_model(TARGET_CFG, jax.random.key(11)), 60.0)
  d = DSpark.init(t, key=jax.random.key(5), block_size=3, num_layers=1, target_layers=(0,),
                  init_std=0.5, markov_rank=4)
  params = dict(d.params, norm=d.params["norm"] * 3.0,
                markov=jax.tree.map(lambda x: x * 3.0, d.params["markov"]))
  return t, d.with_params(params)


class GreedyChainQ(DSpark):
  """LOSSY: draws the sampled chain but reports the q of the greedy-conditioned chain (slot k
  conditioned on the ARGMAX of slot k - 1): the mistake the Markov head invites."""

  def _static_key(self):
    return ("GreedyChainQ",) + super()._static_key()

  def propose(self, params, state, ctx):
    drafts, q, state = super().propose(params, state, ctx)
    if q is None:
      return drafts, q, state
    hidden, base, last = self.block_outputs(params, state, ctx, ctx.num_draft)
    argmax, _, _ = self.draft_chain(params, base, hidden, last, ctx.key, ctx.sampling, True)
    prev = jnp.concatenate([last[:, None], argmax[:, :-1]], axis=1)
    logits, _ = self.teacher_forced(params, base, prev, hidden)
    return drafts, sampling_lib.probs(logits, ctx.sampling), state


@functools.lru_cache(None)
def exact_joint(setting):
  return exact_joint6(tiny()[0], PROMPT, SETTINGS[setting])


def joint_stats(drafter, setting, seed=3, **kw):
  """Chi-square of tokens 1-3 and 4-6 of N rows against the exact joint's marginals."""
  t = tiny()[0]
  out = sj.generate(t, [PROMPT] * N, drafter=drafter, max_new_tokens=NEW6,
                    sampling=SETTINGS[setting], key=jax.random.key(seed), stop_tokens=[],
                    capacity=20, prompt_bucket=len(PROMPT), **kw)
  toks = np.asarray(out.tokens)
  joint = exact_joint(setting)
  return (chi_square(counts3(toks[:, :3]), joint.sum(axis=(3, 4, 5))),
          chi_square(counts3(toks[:, 3:]), joint.sum(axis=(0, 1, 2))), out.stats)


SETTINGS = {"T1": sj.Sampling(temperature=1.0),
            "T1.3_topp0.8": sj.Sampling(temperature=1.3, top_p=0.8)}
LOSSLESS = [("chain", "T1"), ("chain", "T1.3_topp0.8"), ("tree-distinct", "T1")]


# Not `optimized`: at 12k rows the O1 compile costs more than it saves in the run (chain-T1,
# chain-T1.3_topp0.8 and tree-distinct-T1 in one process: 18.7 CPU-s at O1, 17.2 s at O0).
@pytest.mark.parametrize("mode,setting", LOSSLESS, ids=[f"{m}-{s}" for m, s in LOSSLESS])
def test_dspark_is_lossless(mode, setting):
  """The exact joint of six tokens (several rounds: every slot, rejections, corrections and
  bonus tokens at every block offset) with the Markov chain's drafts (K = b = 3)."""
  _, d = tiny()
  kw = {"num_draft": 3} if mode == "chain" else {"tree": sj.TreeSpec(3, 2, 8, "distinct")}
  (s1, dof1), (s2, dof2), stats = joint_stats(d, setting, **kw)
  assert 0.02 < stats.acceptance_rate < 0.98, stats.summary()
  assert stats.accepted_at[1] > 0.005, stats.summary()
  assert s1 < chi2_critical(dof1, 1e-3) and s2 < chi2_critical(dof2, 1e-3), (s1, dof1, s2, dof2)


def test_the_lossless_check_catches_the_greedy_chain_q():
  _, d = tiny()
  lossy = GreedyChainQ(**{f.name: getattr(d, f.name) for f in dataclasses.fields(d) if f.init})
  (s1, dof1), _, _ = joint_stats(lossy, "T1", num_draft=3)
  assert s1 > 3 * chi2_critical(dof1, 1e-3), (s1, dof1)


# ----------------------------------------------------------------------------- training

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  from train import distill_heads
  tmp = tmp_path_factory.mktemp("train_dspark")
  head = {"kind": "dspark", "block_size": 5, "num_draft": 5, "num_layers": 1,
          "target_layers": [1, 4], "intermediate_size": 96, "markov_rank": 16}
  train = {"steps": 20, "checkpoint_every": 20, "log_every": 10, "lr": 1e-2,
           "ce_weight": 0.1, "l1_weight": 0.9, "confidence_weight": 1.0}
  out = distill_heads.main(["--config", str(_train_config(tmp, head=head, train=train))])
  stories = sj.load(SHARED / "models" / "stories260K")
  return out, sj.drafters.load(tmp / "run", stories), stories


def test_training_lowers_the_loss_and_saves_a_dspark_drafter(trained):
  out, drafter, _ = trained
  assert out["kind"] == "dspark" and len(out["final"]["agree"]) == 5
  assert out["final"]["loss"] < 0.8 * out["initial"]["loss"], (out["initial"], out["final"])
  assert isinstance(drafter, DSpark) and drafter.block_size == 5 and drafter.markov_rank == 16
  assert drafter.confidence_head and drafter.confidence_with_markov
  for a, b in zip(jax.tree.leaves(drafter.params), jax.tree.leaves(out["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert drafter.hyper_params()["markov_head"] == "vanilla"


def test_dspark_loss_terms_and_confidence_target():
  """The loss's confidence target is the exact acceptance probability sum_v min(p, q) of a
  draft from q against p; with every weight on the confidence term only its head moves."""
  from train import losses
  t, d = tiny()
  toks = jnp.asarray([[1, 4, 2, 5, 3, 7, 6, 0, 2, 1]], jnp.int32)
  out = jax.jit(sj.forward, static_argnums=(1,), static_argnames="return_layers")(
      t.params, t.config, toks, sj.KVCache.zeros(t.config, 1, 10), jnp.zeros(1, jnp.int32),
      return_layers=d.target_layers)
  p = jax.nn.softmax(out.logits, -1)
  cfg = {"num_anchors": 4, "loss_gamma": None, "ce_weight": 0.0, "l1_weight": 0.0,
         "confidence_weight": 1.0}
  grads, m = jax.jit(jax.grad(lambda prm: losses.dspark_loss(
      d, prm, t.params, toks, out.layer_hidden, p, cfg, jax.random.key(0)), has_aux=True))(
          d.params)
  assert float(jnp.abs(grads["confidence"]["w_h"]).sum()) > 0
  assert float(jnp.abs(grads["markov"]["w2"]).sum()) == 0.0          # alpha is detached
  anchors = losses.sample_anchors(jax.random.key(0), 1, 10, 4)
  logits, _ = jax.jit(d.training_outputs)(d.params, t.params, toks, out.layer_hidden, anchors)
  q = jax.nn.softmax(logits, -1)
  pos = jnp.minimum(anchors[0, :, None] + jnp.arange(3)[None], 9)
  alpha = jnp.minimum(q[0], p[0][pos]).sum(-1)
  valid = anchors[0, :, None] + jnp.arange(3)[None] + 1 < 10
  want = (alpha * valid).sum(0) / valid.sum(0)
  np.testing.assert_allclose(np.asarray(m["alpha"]), np.asarray(want), rtol=1e-4, atol=1e-6)


def test_training_config_is_shipped_and_valid():
  from train.config import load_config
  from tests.conftest import ROOT
  cfg = load_config(ROOT / "configs" / "distill_dspark.yaml")
  dflash = load_config(ROOT / "configs" / "distill_dflash.yaml")
  assert cfg["head"]["kind"] == "dspark" and cfg["head"]["num_draft"] == 7
  for key in ("block_size", "num_layers", "intermediate_size", "target_layers", "mask_token_id"):
    assert cfg["head"][key] == dflash["head"][key], key
  for key in ("steps", "batch_size", "num_anchors", "lr"):
    assert cfg["train"][key] == dflash["train"][key], key
  assert cfg["data"] == dflash["data"]


# ----------------------------------------------------------------------------- DeepSpec's format

# The state_dict names of DeepSpec's Qwen3DSparkModel (deepspec/modeling/dspark/qwen3/
# modeling.py, markov_head.py, common.py AcceptRatePredictor) for N = 2 layers.
DEEPSPEC_LAYER = ["input_layernorm.weight", "post_attention_layernorm.weight",
                  "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                  "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
DEEPSPEC_NAMES = ({"embed_tokens.weight", "lm_head.weight", "norm.weight", "fc.weight",
                   "hidden_norm.weight", "markov_head.markov_w1.weight",
                   "markov_head.markov_w2.weight", "confidence_head.proj.weight",
                   "confidence_head.proj.bias"} |
                  {f"layers.{i}.{n}" for i in range(2) for n in DEEPSPEC_LAYER})


@pytest.mark.parametrize("head,mask", [("gated", None), ("rnn", 95)])
def test_deepspec_folder_round_trips(tmp_path, target, head, mask):
  import json
  from safetensors.numpy import load_file
  d = small(target, head, mask_token_id=mask)
  d = d.with_params(jax.tree.map(lambda x: x + 0.01, d.params))      # no zero leaves
  out = sj.drafters.export(d, tmp_path / "ds", target=target)
  cfg = json.loads((out / "config.json").read_text())
  assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["markov_head_type"] == head
  assert (cfg["block_size"], cfg["markov_rank"], cfg["target_layer_ids"]) == (4, 8, [1, 3])
  assert cfg["enable_confidence_head"] and cfg["confidence_head_with_markov"]
  names = set(load_file(str(out / "model.safetensors")))
  extra = {"gated": {"markov_head.gate_proj.weight", "markov_head.gate_proj.bias"},
           "rnn": {"markov_head.joint_proj.weight", "markov_head.joint_proj.bias"}}[head]
  assert names == DEEPSPEC_NAMES | extra | ({"mask_embedding"} if mask is None else set())
  back = sj.drafters.load(out, target)
  assert isinstance(back, DSpark) and back == d and back.trained_num_draft == 4
  for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(d.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match=r"format 'dspark' needs target="):
    sj.drafters.export(d, tmp_path / "again")


def test_malformed_deepspec_folders_are_refused(tmp_path, target):
  import json
  d = small(target, mask_token_id=95)
  out = sj.drafters.export(d, tmp_path / "ds", target=target)
  cfg = json.loads((out / "config.json").read_text())
  for change, msg in [({"target_layer_ids": [-1, 3]}, r"include -1 \(the embedding output\)"),
                      ({"markov_head_type": "lstm"}, r"markov_head_type='lstm'; allowed"),
                      ({"markov_rank": 4}, r"has shape \(\S+, \S+\); config.json and the "
                                           r"target imply"),
                      ({"enable_confidence_head": False}, r"does not have: confidence_head")]:
    (out / "config.json").write_text(json.dumps(dict(cfg, **change)))
    with pytest.raises(ValueError, match=msg):
      sj.drafters.load(out, target)


def _deepspec_source():
  """DeepSpec's python package (deepseek-ai/DeepSpec `deepspec/`), from $DEEPSPEC_SRC (the
  folder holding `deepspec/`) or an installed one; None without it (the test is skipped)."""
  import importlib
  import os
  import sys
  src = os.environ.get("DEEPSPEC_SRC")
  if src and src not in sys.path:
    sys.path.insert(0, src)
  try:
    return importlib.import_module("deepspec.modeling.dspark.qwen3.modeling")
  except ImportError:
    return None


@pytest.mark.skipif(_deepspec_source() is None,
                    reason="DeepSpec's source is not importable (set DEEPSPEC_SRC to a checkout)")
@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_exported_folder_drafts_what_deepspec_drafts(tmp_path, target, hf_target, head):
  """DeepSpec's own Qwen3DSparkModel (torch, from_pretrained of our export) over transformers'
  target features: its backbone + Markov head's corrected logits, greedy drafts
  (`sample_draft_tokens`) and confidence logits (`predict_confidence_step`) at every slot,
  against ours (`DSpark.propose_with_confidence` / `teacher_forced`)."""
  import torch
  modeling = _deepspec_source()
  from deepspec.modeling.dspark.common import extract_context_feature
  d = small(target, head, mask_token_id=95, init_std=0.4)
  folder = sj.drafters.export(d, tmp_path / "ds", target=target)
  ref = modeling.Qwen3DSparkModel.from_pretrained(folder, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
  prompt, first = [1, 5, 9, 22, 40, 7, 3, 80], 11
  with torch.no_grad():
    hs = hf_target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    ctx = extract_context_feature(hs, ref.target_layer_ids)
    ids = torch.full((1, 4), 95, dtype=torch.long)
    ids[0, 0] = first
    block = ref._forward_backbone(target_hidden_states=ctx, noise_embedding=ref.embed_tokens(ids),
                                  position_ids=torch.arange(len(prompt) + 4)[None],
                                  attention_mask=None, is_causal=False)
    toks, logits = ref.sample_draft_tokens(ref.compute_logits(block),
                                           first_prev_token_ids=ids[:, 0], temperature=0.0,
                                           hidden_states=block)
    prev = torch.cat([ids[:, :1], toks[:, :-1]], dim=1)
    conf = ref.predict_confidence_step(block, prev_token_ids=prev)
  state, buf, sampling = drafter_state(d, target, prompt, first)
  drafts, confidence, ours, conf_ours, base = greedy_outputs(
      d, state, ctx_of(buf, len(prompt) + 1, sampling, target, 4))
  assert np.abs(ours - base).max() > 0.1                                # the head matters
  assert drafts[0].tolist() == toks[0].tolist()                        # so prev is theirs
  assert np.abs(ours[0] - logits[0].numpy()).max() <= 1e-4
  assert np.abs(conf_ours[0] - conf[0].numpy()).max() <= 1e-4
  np.testing.assert_allclose(confidence[0], torch.sigmoid(conf[0]).numpy(), rtol=1e-4)


def test_widened_dspark_drafts_the_same(trained):
  """`widen_heads` on a trained DSpark (gated head here: its gate reads h): the widened
  drafter's corrected logits, greedy drafts and confidence equal the source's."""
  from spec_jax.models import widen
  _, drafter, stories = trained
  gated = DSpark.init(stories, key=jax.random.key(1), markov_head="gated", init_std=0.3,
                      **{k: v for k, v in drafter.hyper_params().items() if k != "markov_head"})
  # The trained backbone and confidence head, a random gated Markov head.
  gated = gated.with_params(dict(drafter.params, markov=gated.params["markov"]))
  wide = widen(stories, hidden_size=128, intermediate_size=256, num_layers=5, head_dim=16)
  prompt = stories.encode("Once upon a time there was")
  outs = []
  for model, dr in ((stories, gated), (wide, sj.drafters.widen_heads(gated, stories, wide))):
    state, buf, sampling = drafter_state(dr, model, prompt[:-1], prompt[-1], capacity=32)
    outs.append(greedy_outputs(dr, state, ctx_of(buf, len(prompt), sampling, model, 5)))
  np.testing.assert_array_equal(outs[0][0], outs[1][0])
  assert np.abs(outs[0][1] - outs[1][1]).max() <= 1e-4
  assert np.abs(outs[0][2] - outs[1][2]).max() <= 1e-3
