"""DFlash block drafters: the published forward, the training mask, losslessness, trained use.

The reference below is an independent forward of the published DFlashDraftModel written from its
description (z-lab/dflash `dflash/model.py`: context = hidden_norm(fc(concat of
hidden_states[id + 1])), keys/values [context ; block] through the same k/v projections with the
per-head k norm, queries from the block, bidirectional full layers, causal sliding layers,
norm then the target's LM head), in float64 numpy over PyTorch target features from
transformers' own LlamaForCausalLM. It imports nothing from spec_jax's drafters.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from spec_jax.drafters import dflash_layers as dflash_lib
from spec_jax.drafters.formats import heads_folder
from spec_jax.drafters.base import DraftContext, PrefillInfo, VerifyInfo
from spec_jax.drafters.dflash import DFlash
from tests.conftest import SHARED, need_shared
from tests.stats_helpers import assert_same_distribution, chi2_critical, chi_square
from tests.test_lossless import NEW6, PROMPT, TARGET_CFG, _peaky, counts3, exact_joint6

GREEDY = sj.Sampling(temperature=0.0)
V, D, L = 96, 32, 6
TARGET = sj.ModelConfig(vocab_size=V, hidden_size=D, intermediate_size=64, num_layers=L,
                        num_heads=4, num_kv_heads=2, max_position_embeddings=256,
                        rms_norm_eps=1e-5)
BLOCK, MASK_ID, WINDOW = 5, V - 1, 3
HEAD = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
            rms_norm_eps=1e-6, rope_theta=5000.0)
LAYER_IDS = [1, 3, 4]
LAYER_TYPES = ["full_attention", "sliding_attention"]


@pytest.fixture(scope="module")
def target():
  model = sj.init_model(TARGET, jax.random.key(3))
  model.params["embed"] = model.params["embed"] * 30
  model.params["lm_head"] = model.params["lm_head"] * 30       # logits of a few units
  return model


def public_config(**over) -> dict:
  cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": BLOCK,
         "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": LAYER_IDS},
         "num_target_layers": L, "num_hidden_layers": 2, "layer_types": LAYER_TYPES,
         "sliding_window": WINDOW, "use_sliding_window": True, "hidden_size": D,
         "vocab_size": V, "hidden_act": "silu", "max_position_embeddings": 2048,
         "tie_word_embeddings": False, "torch_dtype": "float32", **HEAD}
  cfg.update(over)
  return cfg


def public_tensors(seed=0, layers=2) -> dict:
  """Random weights under the published names, torch's [out, in] layout."""
  rng = np.random.default_rng(seed)
  hq, hkv, dh, f = (HEAD["num_attention_heads"], HEAD["num_key_value_heads"], HEAD["head_dim"],
                    HEAD["intermediate_size"])

  def w(*shape, scale=0.2):
    return (scale * rng.standard_normal(shape)).astype(np.float32)

  out = {"fc.weight": w(D, len(LAYER_IDS) * D, scale=0.1), "hidden_norm.weight": 1 + w(D),
         "norm.weight": 1 + w(D)}
  for i in range(layers):
    p = f"layers.{i}."
    out.update({p + "input_layernorm.weight": 1 + w(D),
                p + "post_attention_layernorm.weight": 1 + w(D),
                p + "self_attn.q_proj.weight": w(hq * dh, D),
                p + "self_attn.k_proj.weight": w(hkv * dh, D),
                p + "self_attn.v_proj.weight": w(hkv * dh, D),
                p + "self_attn.o_proj.weight": w(D, hq * dh),
                p + "self_attn.q_norm.weight": 1 + w(dh), p + "self_attn.k_norm.weight": 1 + w(dh),
                p + "mlp.gate_proj.weight": w(f, D), p + "mlp.up_proj.weight": w(f, D),
                p + "mlp.down_proj.weight": w(D, f)})
  return out


def write_folder(folder, config=None, tensors=None):
  from safetensors.numpy import save_file
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "config.json").write_text(json.dumps(public_config() if config is None else config))
  save_file(public_tensors() if tensors is None else tensors, str(folder / "model.safetensors"))
  return folder


@pytest.fixture(scope="module")
def public_folder(tmp_path_factory):
  return write_folder(tmp_path_factory.mktemp("dflash") / "public")


# ----------------------------------------------------------------------------- the reference

class Reference:
  """The published DFlash forward in float64 numpy (module docstring)."""

  def __init__(self, tensors: dict, config: dict, hf_target, mask_embedding=None):
    self.w = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    self.cfg = config
    self.hf = hf_target
    self.embed = hf_target.get_input_embeddings().weight.detach().numpy().astype(np.float64)
    self.lm = hf_target.get_output_embeddings().weight.detach().numpy().astype(np.float64)
    mask_id = config["dflash_config"]["mask_token_id"]
    self.mask = mask_embedding if mask_id is None else self.embed[mask_id]

  def rms(self, x, weight):
    return weight * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + self.cfg["rms_norm_eps"])

  def rope(self, x, pos):
    dh = x.shape[-1]
    inv = 1.0 / (self.cfg["rope_theta"] ** (np.arange(0, dh, 2) / dh))
    ang = pos[:, None] * inv[None]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None]
    return x * cos + np.concatenate([-x[..., dh // 2:], x[..., :dh // 2]], -1) * sin

  def context(self, tokens):
    """hidden_norm(fc(concat(hidden_states[id + 1]))) [T, D] from transformers' target."""
    import torch
    with torch.no_grad():
      hs = self.hf(torch.tensor([list(tokens)]), output_hidden_states=True).hidden_states
    cat = np.concatenate([hs[i + 1][0].double().numpy()
                          for i in self.cfg["dflash_config"]["target_layer_ids"]], -1)
    return self.rms(cat @ self.w["fc.weight"].T, self.w["hidden_norm.weight"])

  def block_logits(self, context_tokens, first):
    """Logits [b-1, V] of block slots 1..b-1 after the committed `context_tokens` + `first`."""
    c, w = self.cfg, self.w
    hq, hkv, dh = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    b = c["block_size"]
    ctx = self.context(context_tokens) if len(context_tokens) else np.zeros((0, D))
    p = len(context_tokens)
    x = np.concatenate([self.embed[first][None], np.tile(self.mask, (b - 1, 1))])
    pos_q = p + np.arange(b)
    pos_k = np.concatenate([np.arange(p), pos_q])
    for i, kind in enumerate(c["layer_types"]):
      g = lambda n: w[f"layers.{i}.{n}"]
      h = self.rms(x, g("input_layernorm.weight"))
      q = self.rms((h @ g("self_attn.q_proj.weight").T).reshape(b, hq, dh),
                   g("self_attn.q_norm.weight"))
      kv_in = np.concatenate([ctx, h])
      k = self.rms((kv_in @ g("self_attn.k_proj.weight").T).reshape(-1, hkv, dh),
                   g("self_attn.k_norm.weight"))
      v = (kv_in @ g("self_attn.v_proj.weight").T).reshape(-1, hkv, dh)
      q, k = self.rope(q, pos_q), self.rope(k, pos_k)
      k, v = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)
      scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(dh)
      if kind == "sliding_attention":
        seen = (pos_k[None] <= pos_q[:, None]) & (pos_k[None] > pos_q[:, None] - c["sliding_window"])
        scores = np.where(seen[None], scores, -np.inf)
      scores = np.exp(scores - scores.max(-1, keepdims=True))
      attn = np.einsum("hqk,khd->qhd", scores / scores.sum(-1, keepdims=True), v)
      x = x + attn.reshape(b, hq * dh) @ g("self_attn.o_proj.weight").T
      h = self.rms(x, g("post_attention_layernorm.weight"))
      gate = h @ g("mlp.gate_proj.weight").T
      x = x + ((gate / (1 + np.exp(-gate))) * (h @ g("mlp.up_proj.weight").T)) @ \
          g("mlp.down_proj.weight").T
    return (self.rms(x, w["norm.weight"]) @ self.lm.T)[1:]


def drafter_state(drafter, target, prompt, first, capacity=24):
  """init_state after a prefill of `prompt`, with `first` the first committed token."""
  layers = drafter.target_layers
  buf = jnp.zeros((1, capacity), jnp.int32).at[0, :len(prompt) + 1].set(
      jnp.asarray(list(prompt) + [first]))
  pre = sj.forward(target.params, target.config, jnp.asarray([prompt], jnp.int32),
                   sj.KVCache.zeros(target.config, 1, capacity), jnp.zeros(1, jnp.int32),
                   return_layers=layers)
  sampling = sj.Sampling(temperature=1.0).as_arrays(1)
  state = drafter.init_state(drafter.params, PrefillInfo(
      tokens=buf, prompt_tokens=jnp.asarray([prompt], jnp.int32),
      prompt_lens=jnp.asarray([len(prompt)], jnp.int32), hidden=pre.hidden,
      layer_hidden=pre.layer_hidden, target_params=target.params, sampling=sampling))
  return state, buf, sampling


def ctx_of(buf, length, sampling, target, k, **kw):
  return DraftContext(key=jax.random.key(1), tokens=buf, lengths=jnp.asarray([length], jnp.int32),
                      sampling=sampling, target_params=target.params, num_draft=k, **kw)


# ----------------------------------------------------------------------------- the format

def test_published_folder_matches_the_reference_at_every_slot(public_folder, target, hf_target):
  drafter = sj.drafters.load(public_folder, target)
  assert isinstance(drafter, DFlash) and drafter.target_layers == tuple(LAYER_IDS)
  assert (drafter.block_size, drafter.max_draft, drafter.mask_token_id) == (BLOCK, 4, MASK_ID)
  assert drafter.layer_types == tuple(LAYER_TYPES) and drafter.sliding_window == WINDOW
  ref = Reference(public_tensors(), public_config(), hf_target)
  prompt, first = [1, 5, 9, 22, 40, 7, 3, 80], 11
  state, buf, sampling = drafter_state(drafter, target, prompt, first)
  ctx = ctx_of(buf, 9, sampling, target, BLOCK - 1)
  ours = np.asarray(drafter.block_logits(drafter.params, state, ctx))[0]
  theirs = ref.block_logits(prompt, first)
  assert np.abs(theirs).max() > 2.0                     # not a trivially flat drafter
  assert np.abs(ours - theirs).max() <= 1e-5, np.abs(ours - theirs).max(axis=-1)
  # Sampled drafts carry q = softmax(logits) per slot; greedy drafts are the argmax, q None.
  drafts, q, _ = drafter.propose(drafter.params, state, ctx)
  ref_q = np.exp(theirs - theirs.max(-1, keepdims=True))
  ref_q /= ref_q.sum(-1, keepdims=True)
  assert np.abs(np.asarray(q)[0] - ref_q).max() <= 1e-5
  g_drafts, g_q, _ = drafter.propose(drafter.params, state, ctx.replace(greedy=True))
  assert g_q is None
  np.testing.assert_array_equal(np.asarray(g_drafts)[0], theirs.argmax(-1))

  # After a verify of [first, d1, d2, d3] that accepted d1 (correction c): the context is
  # prompt + first + d1; the stale slots of d2, d3 must not be seen.
  d1, d2, d3, c = 30, 31, 32, 33
  seq = prompt + [first, d1, d2, d3]
  full = sj.forward(target.params, target.config, jnp.asarray([seq], jnp.int32),
                    sj.KVCache.zeros(target.config, 1, 16), jnp.zeros(1, jnp.int32),
                    return_layers=drafter.target_layers)
  verify = VerifyInfo(input_tokens=jnp.asarray([[first, d1, d2, d3]]), hidden=full.hidden[:, 8:],
                      layer_hidden=tuple(h[:, 8:] for h in full.layer_hidden),
                      lengths_before=jnp.asarray([9]), lengths=jnp.asarray([11]),
                      target_params=target.params)
  state = drafter.commit(drafter.params, state, jnp.asarray([[d1, c, -1, -1]]),
                         jnp.asarray([1]), verify)
  buf = buf.at[0, 9:11].set(jnp.asarray([d1, c]))
  ours = np.asarray(drafter.block_logits(drafter.params, state, ctx_of(buf, 11, sampling, target,
                                                                       4)))[0]
  theirs = ref.block_logits(prompt + [first, d1], c)
  assert np.abs(ours - theirs).max() <= 1e-5, np.abs(ours - theirs).max(axis=-1)


def test_published_greedy_speculation_equals_plain_greedy(public_folder, target):
  drafter = sj.drafters.load(public_folder, target)
  prompts = [[1, 5, 9, 22, 40, 7, 3, 80, 11], [1, 3], [1, 60, 61, 62, 63, 2, 2, 9, 33, 17]]
  plain = sj.generate(target, prompts, max_new_tokens=16, sampling=GREEDY, stop_tokens=[])
  for kw in (dict(num_draft=4), dict(num_draft=2), dict(tree=sj.TreeSpec(4, 3, 10))):
    spec = sj.generate(target, prompts, drafter=drafter, max_new_tokens=16, sampling=GREEDY,
                       stop_tokens=[], **kw)
    assert spec.tokens == plain.tokens and spec.stats.drafted > 0, kw


def _mutate(tensors, config, what):
  dc = config["dflash_config"]
  if what == "layer-id":
    dc["target_layer_ids"] = [1, 3, L]
  elif what == "num-target-layers":
    config["num_target_layers"] = L + 2
  elif what == "width":
    config["hidden_size"] = 48
  elif what == "mask-id":
    dc["mask_token_id"] = V
  elif what == "no-mask":
    dc["mask_token_id"] = None
  elif what == "missing":
    del tensors["layers.1.self_attn.k_norm.weight"]
  elif what == "shape":
    tensors["fc.weight"] = tensors["fc.weight"][:, :2 * D]
  elif what == "unknown":
    tensors["layers.0.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
  elif what == "layer-types":
    config["layer_types"] = ["full_attention"]
  elif what == "window":
    config["sliding_window"] = None
  elif what == "vocab":
    config["vocab_size"] = V + 4
  elif what == "block":
    config["block_size"] = 1
  elif what == "embed-copy":
    tensors["embed_tokens.weight"] = np.ones((V, D), np.float32)


MALFORMED = {
    "layer-id": r"target_layer_ids \[1, 3, 6\] name layers \[6\] outside this 6-layer target",
    "num-target-layers": r"num_target_layers=8 but the target has 6 layers",
    "width": r"hidden_size=48 but the target's hidden size is 32",
    "mask-id": r"mask_token_id=96 outside the target's vocabulary \[0, 96\)",
    "no-mask": r"mask_token_id is null and there is no mask_embedding tensor",
    "missing": r"lacks 1 tensor\(s\): layers.1.self_attn.k_norm.weight",
    "shape": r"fc.weight has shape \(32, 64\); config.json and the target imply \(32, 96\)",
    "unknown": r"tensor\(s\) that a 2-layer DFlashDraftModel does not have: "
               r"layers.0.self_attn.q_proj.bias",
    "layer-types": r"layer_types must list one entry per layer \(num_hidden_layers=2\)",
    "window": r"sliding_window=None with sliding_attention layers",
    "vocab": r"vocab_size=100 but the target's vocabulary has 96 tokens",
    "block": r"block_size=1; allowed: an integer >= 2",
    "embed-copy": r"embed_tokens.weight differs from the target's",
}


@pytest.mark.parametrize("what", list(MALFORMED))
def test_malformed_folders_are_refused_naming_the_field(tmp_path, target, what):
  tensors, config = public_tensors(), public_config()
  config["dflash_config"] = dict(config["dflash_config"])
  _mutate(tensors, config, what)
  folder = write_folder(tmp_path / what, config=config, tensors=tensors)
  with pytest.raises(ValueError, match=MALFORMED[what]):
    sj.drafters.load(folder, target)


def test_export_round_trips_both_mask_kinds(tmp_path, target, hf_target):
  from safetensors.numpy import load_file
  for mask_id in (MASK_ID, None):
    d = DFlash.init(target, key=jax.random.key(2), block_size=4, num_layers=2,
                    target_layers=(0, 2, 4), init_std=0.3, mask_token_id=mask_id,
                    layer_types=LAYER_TYPES, sliding_window=2, intermediate_size=40)
    out = sj.drafters.export(d, tmp_path / f"e{mask_id}", format="dflash")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    assert config["dflash_config"] == {"mask_token_id": mask_id, "target_layer_ids": [0, 2, 4]}
    assert config["num_target_layers"] == L and config["layer_types"] == LAYER_TYPES
    tensors = load_file(str(out / "model.safetensors"))
    assert ("mask_embedding" in tensors) == (mask_id is None)
    assert tensors["layers.1.self_attn.q_proj.weight"].shape == (D, D)          # [out, in]
    np.testing.assert_array_equal(tensors["layers.1.mlp.down_proj.weight"],
                                  np.asarray(d.params["layers"]["w_down"][1]).T)
    back = sj.drafters.load(out, target)
    assert back == d
    for a, b in zip(jax.tree.leaves(d.params), jax.tree.leaves(back.params)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The exported folder is what the reference reads: the same logits.
    ref_cfg = dict(config, rms_norm_eps=d.layer_config.rms_norm_eps,
                   rope_theta=d.layer_config.rope_theta)
    ref = Reference(tensors, ref_cfg, hf_target, mask_embedding=tensors.get("mask_embedding"))
    state, buf, sampling = drafter_state(back, target, [1, 4, 7, 9, 2], 6)
    ours = np.asarray(back.block_logits(back.params, state, ctx_of(buf, 6, sampling, target, 3)))
    assert np.abs(ours[0] - ref.block_logits([1, 4, 7, 9, 2], 6)).max() <= 1e-5
  with pytest.raises(ValueError, match="already exists and is not empty; pass overwrite=True"):
    sj.drafters.export(d, out)
  with pytest.raises(ValueError, match="format 'dflash' writes DFlash drafters; got a EAGLE"):
    sj.drafters.export(sj.drafters.EAGLE.init(target), tmp_path / "x", format="dflash")
  with pytest.raises(ValueError, match="unknown format 'dflash2'; allowed: eagle3, dflash"):
    sj.drafters.export(d, tmp_path / "x", format="dflash2")


def test_bad_drafter_options_are_refused(target):
  with pytest.raises(ValueError, match=r"target_layers \[6\] outside the target's 6 layers"):
    DFlash.init(target, target_layers=(1, 6))
  with pytest.raises(ValueError, match=r"mask_token_id=96 outside the target's vocabulary"):
    DFlash.init(target, mask_token_id=V)
  with pytest.raises(ValueError, match=r"block_size must be an integer >= 2"):
    DFlash.init(target, block_size=1)
  with pytest.raises(ValueError, match=r"sliding_attention layers need a sliding_window"):
    DFlash.init(target, num_layers=2, layer_types=LAYER_TYPES)
  d = DFlash.init(target, block_size=4)
  with pytest.raises(ValueError, match=r"proposes at most 3 tokens per round; num_draft=4 is "):
    sj.generate(target, [[1, 2]], drafter=d, num_draft=4, max_new_tokens=4)
  with pytest.raises(ValueError, match=r"drafts at most 3 tokens ahead; TreeSpec.depth=4"):
    sj.generate(target, [[1, 2]], drafter=d, tree=sj.TreeSpec(4, 2, 8), max_new_tokens=4)


def test_bf16_drafter_accumulates_every_dot_in_float32(public_folder, target):
  """A bf16 target and drafter: every dot_general with a bf16 operand produces float32."""
  bf16 = sj.Model(config=target.config.replace(dtype="bfloat16"),
                  params=jax.tree.map(lambda x: x.astype(jnp.bfloat16), target.params),
                  tokenizer=None, mtp_params=None, source=None)
  drafter = dflash_lib_load(public_folder, bf16)
  assert jax.tree.leaves(drafter.params)[0].dtype == jnp.bfloat16
  state, buf, sampling = drafter_state(drafter, bf16, [1, 5, 9, 22], 7)
  ctx = ctx_of(buf, 5, sampling, bf16, 4)
  jaxpr = jax.make_jaxpr(lambda p, s: drafter.propose(p, s, ctx)[:2])(drafter.params, state)
  dots = [e for e in _equations(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
  assert dots
  for e in dots:
    if any(v.aval.dtype == jnp.bfloat16 for v in e.invars):
      assert e.outvars[0].aval.dtype == jnp.float32, e


def dflash_lib_load(folder, target):
  from spec_jax.drafters.formats.dflash import load_dflash
  return load_dflash(folder, target)


def _equations(jaxpr):
  for e in jaxpr.eqns:
    yield e
    for sub in jax.extend.core.jaxprs_in_params(e.params):
      yield from _equations(sub)


# ----------------------------------------------------------------------------- the training mask

def _leaky_own_anchor(anchors, seq_len, block_size, window):
  ctx, blk = REAL_VISIBILITY(anchors, seq_len, block_size, window)
  j = jnp.arange(seq_len)[None, None]
  return ctx | (j == jnp.repeat(anchors, block_size, axis=1)[:, :, None]), blk


def _leaky_future_context(anchors, seq_len, block_size, window):
  ctx, blk = REAL_VISIBILITY(anchors, seq_len, block_size, window)
  j = jnp.arange(seq_len)[None, None]
  a = jnp.repeat(anchors, block_size, axis=1)[:, :, None]
  return ctx | ((j > a) & (j < a + block_size)), blk


def _leaky_neighbour(x, num_blocks):
  """Each block attends to the previous block's keys (block 0 to the last's)."""
  return jnp.roll(REAL_BLOCK_KEYS(x, num_blocks), 1, axis=1)


REAL_VISIBILITY = dflash_lib.training_visibility
REAL_BLOCK_KEYS = dflash_lib.block_keys


@pytest.fixture(scope="module")
def mask_setup(public_folder, target, hf_target):
  drafter = sj.drafters.load(public_folder, target)
  tokens = [1, 5, 9, 22, 40, 7, 3, 80, 11, 30, 31, 2, 44, 45]
  anchors = [0, 3, 4, 9, 12]
  ref = Reference(public_tensors(), public_config(), hf_target)
  theirs = np.stack([ref.block_logits(tokens[:a], tokens[a]) for a in anchors])
  return drafter, tokens, anchors, theirs


def _training_logits(drafter, target, tokens, anchors):
  toks = jnp.asarray([tokens], jnp.int32)
  out = sj.forward(target.params, target.config, toks,
                   sj.KVCache.zeros(target.config, 1, len(tokens)), jnp.zeros(1, jnp.int32),
                   return_layers=drafter.target_layers)
  hidden = drafter.training_hidden(drafter.params, target.params, toks, out.layer_hidden,
                                   jnp.asarray([anchors], jnp.int32))
  return np.asarray(drafter.logits(drafter.params, target.params, hidden[:, :, 1:]))[0]


def test_training_mask_equals_a_per_block_loop(mask_setup, target):
  """All anchors' blocks in one pass (the training block mask) against the reference run block
  by block, each with only its context j < a and itself; anchor 0 has no context at all."""
  drafter, tokens, anchors, theirs = mask_setup
  ours = _training_logits(drafter, target, tokens, anchors)
  assert np.abs(ours - theirs).max() <= 1e-5, np.abs(ours - theirs).max(axis=(1, 2))


@pytest.mark.parametrize("leak", [_leaky_own_anchor, _leaky_future_context, _leaky_neighbour],
                         ids=["own-anchor-hidden", "future-context", "neighbour-block"])
def test_the_mask_check_catches_a_leaky_mask(mask_setup, target, monkeypatch, leak):
  drafter, tokens, anchors, theirs = mask_setup
  name = "block_keys" if leak is _leaky_neighbour else "training_visibility"
  monkeypatch.setattr(dflash_lib, name, leak)
  ours = _training_logits(drafter, target, tokens, anchors)
  assert np.abs(ours - theirs).max() > 1e-2


# ----------------------------------------------------------------------------- losslessness

@functools.lru_cache(None)
def tiny():
  """test_lossless's vocabulary-8 target and a DFlash drafter (learned mask, no spare id)."""
  t = _peaky(sj.init_model(TARGET_CFG, jax.random.key(11)), 60.0)
  d = DFlash.init(t, key=jax.random.key(5), block_size=4, num_layers=1, target_layers=(0,),
                  init_std=0.5)
  # Peaky. One layer gives every slot the same q: the slots' own q is checked in
  # test_sampled_block_reports_the_q_of_each_slot_it_drew_from.
  params = dict(d.params, norm=d.params["norm"] * 40.0)
  return t, d.with_params(params)


# Rows per joint check here (tests/test_lossless.py's N = 40k; tests/test_dspark.py uses 12k,
# tests/test_ddtree.py 20k). At 12k every exact drafter below stays
# under the 1e-3 critical value (chain-T1: 549 and 520 on 511 dof against 615) and
# test_the_lossless_check_catches_a_wrong_q's statistic is ~135 times its 3 x critical bound
# (249,748 on 511 dof).
ROWS = 12_000


def sample_joint(drafter, sampling, seed=0, rows=ROWS, **kw):
  """`rows` rows of PROMPT, 6 new tokens each (several rounds: every slot, rejections,
  corrections and bonus tokens at every block offset)."""
  target = tiny()[0]
  out = sj.generate(target, [PROMPT] * rows, drafter=drafter, max_new_tokens=NEW6,
                    sampling=sampling, key=jax.random.key(seed), stop_tokens=[], capacity=20,
                    prompt_bucket=len(PROMPT),
                    **kw)
  toks = np.asarray(out.tokens)
  assert toks.shape == (rows, NEW6)
  return toks, out.stats


def assert_exact_joint(toks, sampling):
  """Tokens 1-3 and tokens 4-6 against the marginals of the exact joint of all six."""
  joint = exact_joint6(tiny()[0], PROMPT, sampling)
  assert_same_distribution(counts3(toks[:, :3]), joint.sum(axis=(3, 4, 5)), alpha=1e-3,
                           label="tokens 1-3")
  assert_same_distribution(counts3(toks[:, 3:]), joint.sum(axis=(0, 1, 2)), alpha=1e-3,
                           label="tokens 4-6")


SETTINGS = {
    "T1": sj.Sampling(temperature=1.0),
    "T0.7_topk3": sj.Sampling(temperature=0.7, top_k=3),
    "T1.3_topp0.8": sj.Sampling(temperature=1.3, top_p=0.8),
}
LOSSLESS = [("chain", "T1"), ("chain", "T0.7_topk3"), ("chain", "T1.3_topp0.8"),
            ("tree-sampled", "T1"), ("tree-distinct", "T1.3_topp0.8"), ("argmax", "T1")]


@pytest.mark.parametrize("mode,setting", LOSSLESS, ids=[f"{m}-{s}" for m, s in LOSSLESS])
@pytest.mark.optimized
def test_dflash_is_lossless(mode, setting):
  """The exact joint (tests/test_lossless.py) with sampled per-slot drafts (K = b - 1 = 3),
  sampled / distinct trees over the slots, and argmax drafts."""
  _, drafter = tiny()
  sampling = SETTINGS[setting]
  kw = {"num_draft": 3}
  if mode.startswith("tree"):
    kw = {"tree": sj.TreeSpec(3, 2, 8, mode.split("-")[1])}      # depth-3 nodes kept
  if mode == "argmax":
    drafter = drafter.with_params(drafter.params, greedy_drafts=True)
  toks, stats = sample_joint(drafter, sampling, seed=3, **kw)
  # Drafts are accepted and rejected, and accepted past the first slot.
  assert 0.02 < stats.acceptance_rate < 0.98, stats.summary()
  assert stats.accepted_at[1] > 0.005, stats.summary()
  assert_exact_joint(toks, sampling)


class WrongSlotQ(DFlash):
  """Reports slot k+1's distribution as slot k's q (the last slot's: slot 1's), shifted by one
  token (drafts still drawn from the true q_k): a verifier fed that q accepts with the wrong
  ratio, and the check must see it."""

  def _static_key(self):
    return ("WrongSlotQ",) + super()._static_key()

  def propose(self, params, state, ctx):
    drafts, q, state = super().propose(params, state, ctx)
    return drafts, jnp.roll(jnp.roll(q, -1, axis=1), 1, axis=-1), state


@pytest.mark.slow   # one more 12k-row generate
def test_the_lossless_check_catches_a_wrong_q():
  target, d = tiny()
  wrong = WrongSlotQ(d.params, d.target_config, d.layer_config, d.target_layers, d.block_size)
  toks, _ = sample_joint(wrong, SETTINGS["T1"], seed=3, num_draft=3)
  joint = exact_joint6(target, PROMPT, SETTINGS["T1"])
  stat, dof = chi_square(counts3(toks[:, :3]), joint.sum(axis=(3, 4, 5)))
  assert stat > 3 * chi2_critical(dof, 1e-3), (stat, dof)


def test_dflash_stays_in_sync_across_plain_rounds(tmp_path, monkeypatch):
  """tests/test_governor.py's check: greedy tokens through the governed loop with K forced to
  0, 3, 1, 0, 0, 2, ... equal plain greedy, and the drafter then proposes what a drafter freshly
  initialised on the committed tokens proposes (plain rounds commit [B, 1] verifies)."""
  from spec_jax.decoding import calibration
  from tests import test_governor as tg
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  calibration.clear_memory()
  d = DFlash.init(tg.greedy_target(), key=jax.random.key(5), block_size=4, num_layers=2,
                  target_layers=(0, 2), init_std=0.3)
  tokens, lengths, carried, fresh, k_hist, _, drafted = tg.rounds_then_drafts(d, tg.SCHEDULE, 11)
  np.testing.assert_array_equal(k_hist, [6, 2, 1, 2])
  np.testing.assert_allclose(carried, fresh, atol=2e-5, rtol=1e-4)
  plain = tg.plain_greedy()
  for b, prompt in enumerate(tg.PROMPTS):
    new = tokens[b, len(prompt):lengths[b]].tolist()
    assert new == plain[b][:len(new)], (b, new, plain[b])
  assert drafted.sum() > 0


def test_context_is_written_chunk_by_chunk_over_the_real_prompt_only():
  """init_state writes the prompt's context K/V 64 positions at a time, only over the chunks
  the longest prompt reaches: every slot below a row's prompt length equals the one-shot write
  over the whole buffer (generate pads prompts to the capacity), slots past the last chunk are
  left zero."""
  from tests import test_governor as tg
  target = tg.greedy_target()
  d = DFlash.init(target, key=jax.random.key(5), block_size=4, num_layers=2,
                  target_layers=(0, 2), init_std=0.3)
  b, p, s = 2, 200, 256
  lens = jnp.asarray([70, 100], jnp.int32)
  prompts = jax.random.randint(jax.random.key(3), (b, p), 1, target.config.vocab_size)
  pre = sj.forward(target.params, target.config, prompts, sj.KVCache.zeros(target.config, b, s),
                   jnp.zeros((b,), jnp.int32), return_layers=d.target_layers)
  info = PrefillInfo(tokens=jnp.zeros((b, s), jnp.int32), prompt_tokens=prompts,
                     prompt_lens=lens, hidden=pre.hidden, layer_hidden=pre.layer_hidden,
                     target_params=target.params,
                     sampling=sj.Sampling(temperature=1.0).as_arrays(b))
  params = d.prepare(d.params)
  chunked = jax.jit(d.init_state)(params, info)
  c = d.layer_config
  zeros = jnp.zeros((c.num_layers, b, c.num_kv_heads, s, c.head_dim), jnp.float32)
  empty = chunked.replace(k=zeros, v=zeros)
  whole = d._write_context(params, empty, pre.layer_hidden, jnp.zeros((b,), jnp.int32))
  for got, want in ((chunked.k, whole.k), (chunked.v, whole.v)):
    for row in range(b):
      np.testing.assert_allclose(got[:, row, :, :int(lens[row])],
                                 want[:, row, :, :int(lens[row])], rtol=1e-5, atol=1e-6)
    assert not np.any(np.asarray(got[:, :, :, 128:]))         # two chunks ran, not four
    assert np.any(np.asarray(got[:, :, :, 100:128]))


# ----------------------------------------------------------------------------- trained on stories

def _train_config(tmp_path, **sections):
  import yaml
  need_shared("models", "stories260K")
  cfg = {
      "target": str(SHARED / "models" / "stories260K"), "out_dir": str(tmp_path / "run"),
      "seed": 0,
      "head": {"kind": "dflash", "block_size": 6, "num_draft": 5, "num_layers": 1,
               "target_layers": [1, 4], "intermediate_size": 96},
      "data": {"sources": ["text"], "dev_path": str(SHARED / "data" / "tinystories" / "dev.txt"),
               "text_paragraphs": 60, "window": 24, "cache_dir": str(tmp_path / "cache")},
      "train": {"steps": 150, "batch_size": 8, "lr": 1e-2, "warmup_steps": 2,
                "num_anchors": 6, "checkpoint_every": 150, "log_every": 50},
      "eval": {"enabled": False, "path": str(SHARED / "data" / "tinystories" / "heldout.txt"),
               "num_prompts": 2, "prompt_tokens": 6, "max_new_tokens": 8,
               "temperatures": [0.0]},
  }
  for name, values in sections.items():
    cfg[name].update(values)
  tmp_path.mkdir(parents=True, exist_ok=True)
  path = tmp_path / "config.yaml"
  path.write_text(yaml.safe_dump(cfg))
  return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  from train import distill_heads
  tmp = tmp_path_factory.mktemp("train")
  out = distill_heads.main(["--config", str(_train_config(tmp))])
  stories = sj.load(SHARED / "models" / "stories260K")
  return out, sj.drafters.load(tmp / "run", stories), stories, tmp


def test_training_lowers_the_loss_and_saves_a_dflash_drafter(trained):
  out, drafter, stories, _ = trained
  assert out["kind"] == "dflash" and len(out["final"]["agree"]) == 5
  assert out["final"]["loss"] < 0.5 * out["initial"]["loss"], (out["initial"], out["final"])
  assert out["final"]["agree"][0] > out["initial"]["agree"][0] + 0.1
  assert isinstance(drafter, DFlash) and drafter.block_size == 6
  assert drafter.mask_token_id is None and "mask_embed" in drafter.params
  for a, b in zip(jax.tree.leaves(drafter.params), jax.tree.leaves(out["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


STORY_PROMPTS = ["Once upon a time", "Tom and his dog", "The sun was hot and Lily"]


def test_trained_greedy_equals_plain_greedy_on_stories(trained):
  _, drafter, stories, _ = trained
  prompts = STORY_PROMPTS
  plain = sj.generate(stories, prompts, max_new_tokens=40, sampling=GREEDY)
  # A chain shorter than the block (the first slots of the same block) is
  # test_published_greedy_speculation_equals_plain_greedy's num_draft=2.
  for kw in (dict(num_draft=5), dict(tree=sj.TreeSpec(5, 3, 12))):
    spec = sj.generate(stories, prompts, drafter=drafter, max_new_tokens=40, sampling=GREEDY,
                       **kw)
    assert spec.tokens == plain.tokens, kw
    assert spec.stats.accepted > 0, (kw, spec.stats.summary())


def test_widened_drafter_drafts_the_same(trained):
  from spec_jax.models import widen
  _, drafter, stories, _ = trained
  wide = widen(stories, hidden_size=128, intermediate_size=256, num_layers=7, head_dim=16)
  wide_d = sj.drafters.widen_heads(drafter, stories, wide)
  assert wide_d.layer_config.num_heads == drafter.layer_config.num_heads
  assert wide_d.layer_config.head_dim == 2 * drafter.layer_config.head_dim
  prompt = stories.encode("Once upon a time there was")
  logits = []
  for model, d in ((stories, drafter), (wide, wide_d)):
    state, buf, sampling = drafter_state(d, model, prompt[:-1], prompt[-1], capacity=32)
    logits.append(np.asarray(d.block_logits(d.params, state, ctx_of(buf, len(prompt), sampling,
                                                                    model, 5))))
  assert np.abs(logits[0] - logits[1]).max() <= 1e-3
  # The call of test_trained_greedy_equals_plain_greedy_on_stories's num_draft=5 chain: its
  # compiled program serves the narrow side here.
  a = sj.generate(stories, STORY_PROMPTS, drafter=drafter, num_draft=5, max_new_tokens=40,
                  sampling=GREEDY)
  b = sj.generate(wide, STORY_PROMPTS, drafter=wide_d, num_draft=5, max_new_tokens=40,
                  sampling=GREEDY)
  assert a.tokens == b.tokens and a.stats.accepted_at == b.stats.accepted_at


def test_widen_cli_widens_a_dflash_drafter_with_its_target(trained, tmp_path, capsys):
  from spec_jax.tools import widen as cli
  _, drafter, stories, tmp = trained
  out = tmp_path / "wide"
  rc = cli.main([str(SHARED / "models" / "stories260K"), str(out), "--hidden-size", "128",
                 "--intermediate-size", "256", "--num-layers", "6", "--head-dim", "16",
                 "--heads", str(tmp / "run")])
  printed = capsys.readouterr().out
  assert rc == 0, printed
  assert "dflash heads for" in printed and "max |draft logit diff| vs the source heads" in printed
  wide = sj.load(out)
  back = sj.drafters.load(out / "heads", wide)
  assert back.kind == "dflash" and back.layer_config.head_dim == 16


def test_bench_spec_loads_dflash_drafters(trained):
  from spec_jax.bench import specs
  _, drafter, stories, tmp = trained
  assert specs.make_drafter(f"dflash:{tmp / 'run'}", stories) == drafter
  assert specs.drafter_label(f"dflash:{tmp / 'run' / 'heads'}") == "dflash:run"
  heads_folder.save(tmp / "medusa", sj.drafters.Medusa.init(stories, num_heads=2), stories, 2)
  with pytest.raises(ValueError, match="holds medusa heads, not a DFlash drafter"):
    specs.make_drafter(f"dflash:{tmp / 'medusa'}", stories)
  with pytest.raises(ValueError, match=r"dflash:PATH needs the DFlash drafter's directory"):
    specs.check_drafter_spec("dflash:")
  # LOOKUP+MODEL: sj.drafters.LookupFirst, prompt lookup first.
  both = specs.make_drafter(f"ngram:4:2+dflash:{tmp / 'run'}", stories)
  assert both == sj.drafters.LookupFirst(drafter, sj.drafters.NGram(4, 2))
  assert specs.draft_model_of(both) is None        # the eval's context limit reads draft models
  assert specs.draft_model_of(sj.drafters.LookupFirst(sj.drafters.DraftModel(stories))) is stories
  assert specs.drafter_label(f"ngram:4:2+dflash:{tmp / 'run'}") == "ngram:4:2+dflash:run"
  for bad in ("dflash:x+ngram", "ngram+ngram:3", "ngram+", "ngram:x+dflash:y"):
    with pytest.raises(ValueError, match="bad drafter"):
      specs.check_drafter_spec(bad)


@pytest.mark.slow   # three short trainer runs
def test_killed_training_run_resumes_to_the_same_params(tmp_path):
  from train import distill_heads
  common = dict(train={"steps": 8, "checkpoint_every": 2})
  straight = distill_heads.main(["--config", str(_train_config(tmp_path / "a", **common))])
  path_b = _train_config(tmp_path / "b", **common)
  first = distill_heads.main(["--config", str(path_b), "--set", "train.stop_after=4"])
  assert first["stopped"] and first["end_step"] == 4
  resumed = distill_heads.main(["--config", str(path_b)])
  assert resumed["start_step"] == 4 and resumed["end_step"] == 8
  for a, b in zip(jax.tree.leaves(straight["params"]), jax.tree.leaves(resumed["params"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)


def test_regenerated_text_keeps_prompts_and_lengths(tmp_path):
  """data.regenerate: each paragraph's prompt kept, the rest rewritten by the target (greedy
  here: exactly its greedy continuation), no longer than the paragraph; cached."""
  from train import data as data_lib
  from train.config import load_config
  stories = sj.load(need_shared("models", "stories260K"))
  cfg = load_config(_train_config(tmp_path, data={"text_paragraphs": 5, "regenerate": True,
                                                  "temperatures": [0.0], "gen_batch": 4,
                                                  "window": 8}))
  logs = []
  windows = data_lib.build_windows(stories, cfg["data"], "sha", 0, logs.append)
  text = [stories.encode(p) for p in data_lib.read_paragraphs(cfg["data"]["dev_path"])[:5]]
  regen = data_lib.regenerate_responses(stories, text, 8, [0.0], 4, 0)
  for orig, new in zip(text, regen):
    assert new[:8] == orig[:8] and 8 < len(new) <= len(orig)
  greedy = sj.generate(stories, [text[0][:8]], max_new_tokens=len(text[0]) - 8,
                       sampling=GREEDY).tokens[0]
  assert regen[0][8:] == greedy[:len(regen[0]) - 8]
  assert regen != text
  stream = np.concatenate([np.asarray(s) for s in regen])
  np.testing.assert_array_equal(windows.reshape(-1), stream[:windows.size])
  assert any("regenerated paragraphs cached" in m for m in logs)
  logs.clear()
  again = data_lib.build_windows(stories, cfg["data"], "sha", 0, logs.append)
  np.testing.assert_array_equal(again, windows)
  assert any("cached regenerated paragraphs from" in m for m in logs)
  with pytest.raises(ValueError, match="data.regenerate rewrites the text source"):
    load_config(_train_config(tmp_path / "x", data={"sources": ["generated"],
                                                    "regenerate": True}))


def test_sampled_block_reports_the_q_of_each_slot_it_drew_from(target):
  """Each slot's reported q is probs of that slot's logits, and the slots differ (with one
  layer, the lossless tests' drafter gives every slot the same q, so a q reported from the
  wrong slot passed them: the drafts still came from the right one)."""
  d = DFlash.init(target, key=jax.random.key(5), block_size=4, num_layers=2,
                  target_layers=(0,), init_std=0.5)        # two layers: the slots differ
  prompt, first = [1, 5, 9, 22, 40, 7, 3, 80], 11
  state, buf, sampling = drafter_state(d, target, prompt, first)
  ctx = ctx_of(buf, 9, sampling, target, 3)
  drafts, q, _ = jax.jit(d.propose)(d.params, state, ctx)
  logits = jax.jit(d.block_logits, static_argnums=3)(d.params, state, ctx, 3)
  want = np.asarray(sj.sampling.probs(logits, sampling))
  np.testing.assert_allclose(np.asarray(q), want, rtol=1e-5, atol=1e-7)
  tv = 0.5 * np.abs(want[0, 1:] - want[0, :-1]).sum(-1)
  assert tv.min() > 1e-3, tv                          # the slots' q differ
  assert np.asarray(drafts).shape == (1, 3)
