"""Draft heads (Medusa, EAGLE, EAGLE-3, MTP): lossless, greedy-exact, saved/loaded, native MTP.

Losslessness reuses tests/test_lossless.py's exact-joint check: a vocabulary-8 random target,
40k rows of one prompt in one generate() call, the joint of the first three tokens against
the exact target joint (chi-square, alpha 1e-3). Heads get random non-zero weights so their
drafts vary, and the acceptance must lie strictly inside (0.05, 0.98).
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from spec_jax.drafters import heads_io
from spec_jax.drafters.eagle import EAGLE, EAGLE3, EAGLE3Fused
from spec_jax.drafters.medusa import Medusa
from spec_jax.drafters.mtp import MTP
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
  cls = {"eagle": EAGLE, "eagle3": EAGLE3, "eagle3_fused": EAGLE3Fused, "mtp": MTP}[kind]
  return cls.init(target, key=key, init_std=scale, greedy_drafts=greedy_drafts)


LOSSLESS_CASES = [("medusa", False), ("eagle", False), ("eagle3", False), ("mtp", False),
                  ("eagle", True), ("eagle3-reduced", False), ("eagle3-reduced", True),
                  ("eagle3_fused", False)]


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
                    sampling=sampling, key=jax.random.key(7), stop_tokens=[], capacity=16)
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
  np.testing.assert_allclose(np.asarray(o_train), np.asarray(o_cached), atol=1e-4, rtol=1e-4)


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
  np.testing.assert_allclose(np.asarray(outs[2][0, j]), np.asarray(feature[0]), atol=1e-4,
                             rtol=1e-4)


# ----------------------------------------------------------------------------- save / load

@pytest.mark.parametrize("kind", ["eagle3", "mtp", "eagle3-reduced", "eagle3_fused"])
def test_feature_heads_save_and_reload(tmp_path, kind):
  target = greedy_target()
  head = make_head(kind, target)
  heads_io.save(tmp_path / "heads", head, target, num_draft=3)
  back = sj.drafters.load(tmp_path / "heads", target)
  assert type(back) is type(head) and back == head       # same static config (hash / eq)
  for a, b in zip(jax.tree.leaves(head.params), jax.tree.leaves(back.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_saved_heads_reload_and_refuse_another_target(tmp_path):
  target = greedy_target()
  head = make_head("medusa", target)
  heads_io.save(tmp_path / "heads", head, target, num_draft=3)
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


def test_model_without_mtp_weights_is_refused():
  with pytest.raises(ValueError, match="carries no MTP weights"):
    MTP.from_model(greedy_target())


def test_eagle3_heads_saved_before_the_public_architecture_load_as_eagle3_fused(tmp_path):
  target = greedy_target()
  head = make_head("eagle3_fused", target)
  heads_io.save(tmp_path / "h", head, target, num_draft=3)
  meta_path = tmp_path / "h" / "heads.json"
  meta = json.loads(meta_path.read_text())
  meta["kind"] = "eagle3"                       # what such a folder says
  meta_path.write_text(json.dumps(meta))
  back = sj.drafters.load(tmp_path / "h", target)
  assert back == head and back.kind == "eagle3_fused"
