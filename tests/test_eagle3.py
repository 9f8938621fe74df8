"""EAGLE-3 in the public format (vLLM / SGLang's LlamaForCausalLMEagle3): load, draft, export.

The reference below is an independent PyTorch implementation of the public forward, written
from the sources' description (SGLang `llama_eagle3.py`, vLLM `llama_eagle3.py`, EAGLE
`traineagle3/cnets.py`), that imports nothing from spec_jax's drafters. Its target features
come from transformers' own LlamaForCausalLM (output_hidden_states[k] = the residual stream
entering layer k, what vLLM captures for aux layer id k), so the layer choice is checked too.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from spec_jax.drafters import EAGLE3
from spec_jax.drafters.base import DraftContext, PrefillInfo
from spec_jax.drafters.eagle import default_eagle3_layers, public_default_layers

GREEDY = sj.Sampling(temperature=0.0)
V, D, L = 96, 32, 7
TARGET_CFG = sj.ModelConfig(vocab_size=V, hidden_size=D, intermediate_size=64, num_layers=L,
                            num_heads=4, num_kv_heads=2, max_position_embeddings=256,
                            rms_norm_eps=1e-5)
PROMPTS = [[1, 5, 9, 22, 40, 7, 3, 80, 11], [1, 3], [1, 60, 61, 62, 63, 2, 2, 9, 33, 17]]
# The draft head's own shape: heads, MLP width, eps and RoPE theta differ from the target's.
HEAD = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=4, intermediate_size=48,
            rms_norm_eps=1e-6, rope_theta=5000.0)
DRAFT_IDS = np.sort(np.random.default_rng(7).choice(V, 40, replace=False))


@pytest.fixture(scope="module")
def target():
  model = sj.init_model(TARGET_CFG, jax.random.key(3))
  model.params["embed"] = model.params["embed"] * 30
  return model


def public_config(**over) -> dict:
  cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": D,
         "num_hidden_layers": 1, "vocab_size": V, "draft_vocab_size": len(DRAFT_IDS),
         "hidden_act": "silu", "max_position_embeddings": 2048, "tie_word_embeddings": False,
         "torch_dtype": "float32", **HEAD}
  cfg.update(over)
  return cfg


def public_tensors(seed=0) -> dict:
  """Random weights under the public names, torch's [out, in] layout."""
  rng = np.random.default_rng(seed)
  hq, hkv, dh, f = (HEAD["num_attention_heads"], HEAD["num_key_value_heads"], HEAD["head_dim"],
                    HEAD["intermediate_size"])

  def w(*shape, scale=0.15):
    return (scale * rng.standard_normal(shape)).astype(np.float32)

  d2t = (DRAFT_IDS - np.arange(len(DRAFT_IDS))).astype(np.int64)
  t2d = np.zeros(V, bool)
  t2d[DRAFT_IDS] = True
  return {
      "fc.weight": w(D, 3 * D, scale=0.1),
      "midlayer.input_layernorm.weight": 1 + w(D, scale=0.2),
      "midlayer.hidden_norm.weight": 1 + w(D, scale=0.2),
      "midlayer.self_attn.q_proj.weight": w(hq * dh, 2 * D),
      "midlayer.self_attn.k_proj.weight": w(hkv * dh, 2 * D),
      "midlayer.self_attn.v_proj.weight": w(hkv * dh, 2 * D),
      "midlayer.self_attn.o_proj.weight": w(D, hq * dh),
      "midlayer.post_attention_layernorm.weight": 1 + w(D, scale=0.2),
      "midlayer.mlp.gate_proj.weight": w(f, D),
      "midlayer.mlp.up_proj.weight": w(f, D),
      "midlayer.mlp.down_proj.weight": w(D, f),
      "norm.weight": 1 + w(D, scale=0.2),
      "lm_head.weight": w(len(DRAFT_IDS), D, scale=0.5),
      "d2t": d2t,
      "t2d": t2d,
  }


def write_folder(folder, config=None, tensors=None, fmt="safetensors"):
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "config.json").write_text(json.dumps(public_config() if config is None else config))
  tensors = public_tensors() if tensors is None else tensors
  if fmt == "safetensors":
    from safetensors.numpy import save_file
    save_file(tensors, str(folder / "model.safetensors"))
  else:
    import torch
    torch.save({k: torch.from_numpy(np.array(x)) for k, x in tensors.items()},
               folder / "pytorch_model.bin")
  return folder


@pytest.fixture(scope="module")
def public_folder(tmp_path_factory):
  return write_folder(tmp_path_factory.mktemp("eagle3") / "public")


# ----------------------------------------------------------------------------- the reference

class TorchEagle3:
  """The public EAGLE-3 forward in PyTorch (float64 is not used: float32 like the engines)."""

  def __init__(self, tensors: dict, config: dict, hf_target):
    import torch
    self.torch = torch
    self.w = {k: torch.from_numpy(np.asarray(v)) for k, v in tensors.items()}
    self.cfg = config
    self.hf = hf_target
    n = hf_target.config.num_hidden_layers
    self.aux_ids = sorted({2, n // 2, n - 3})        # vLLM's default boundaries
    self.ids = torch.arange(config["draft_vocab_size"]) + self.w["d2t"]

  def rms(self, x, weight):
    t = self.torch
    return weight * (x * t.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"]))

  def target_features(self, tokens):
    """fc(concat of the hidden states entering layers 2, L//2, L-3) [T, D]; embeddings [T, D]."""
    t = self.torch
    with t.no_grad():
      out = self.hf(t.tensor([tokens]), output_hidden_states=True)
      aux = t.cat([out.hidden_states[i][0] for i in self.aux_ids], dim=-1)
    return aux @ self.w["fc.weight"].T

  def embed(self, tokens):
    return self.hf.get_input_embeddings().weight.detach()[self.torch.tensor(tokens)]

  def rope(self, x, positions):
    t = self.torch
    dh = x.shape[-1]
    inv = 1.0 / (self.cfg["rope_theta"] ** (t.arange(0, dh, 2, dtype=t.float64) / dh))
    ang = (positions[:, None].double() * inv[None]).float()
    cos = t.cat([ang.cos(), ang.cos()], -1)[:, None]
    sin = t.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x[..., :dh // 2], x[..., dh // 2:]
    return x * cos + t.cat([-x2, x1], -1) * sin

  def layer(self, emb, feat):
    """The midlayer over T pairs (causal): emb, feat [T, D] -> pre-norm residual [T, D]."""
    t, w, c = self.torch, self.w, self.cfg
    hq, hkv, dh = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    n = emb.shape[0]
    h = t.cat([self.rms(emb, w["midlayer.input_layernorm.weight"]),
               self.rms(feat, w["midlayer.hidden_norm.weight"])], -1)
    q = (h @ w["midlayer.self_attn.q_proj.weight"].T).view(n, hq, dh)
    k = (h @ w["midlayer.self_attn.k_proj.weight"].T).view(n, hkv, dh)
    v = (h @ w["midlayer.self_attn.v_proj.weight"].T).view(n, hkv, dh)
    pos = t.arange(n)
    q, k = self.rope(q, pos), self.rope(k, pos)
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = t.einsum("qhd,khd->hqk", q, k) / dh ** 0.5
    scores = scores.masked_fill(t.triu(t.ones(n, n, dtype=t.bool), 1), float("-inf"))
    attn = t.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, hq * dh)
    r = feat + attn @ w["midlayer.self_attn.o_proj.weight"].T
    x = self.rms(r, w["midlayer.post_attention_layernorm.weight"])
    mlp = (t.nn.functional.silu(x @ w["midlayer.mlp.gate_proj.weight"].T) *
           (x @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
    return r + mlp

  def logits(self, residual):
    """Draft logits scattered into the full vocabulary, -inf elsewhere [.., V]."""
    t = self.torch
    dl = self.rms(residual, self.w["norm.weight"]) @ self.w["lm_head.weight"].T
    full = t.full(dl.shape[:-1] + (self.cfg["vocab_size"],), float("-inf"))
    full[..., self.ids] = dl
    return full

  def teacher_forced(self, tokens):
    """[T-1, V]: slot j pairs the target feature at j with token j+1."""
    feats = self.target_features(tokens)
    return self.logits(self.layer(self.embed(tokens[1:]), feats[:-1])).numpy()

  def chain(self, tokens, drafts):
    """Logits of each draft step after `tokens` (the last one sampled by the target), the
    head's own outputs fed back with the given drafts: [len(drafts), V]."""
    t = self.torch
    feats = list(self.target_features(tokens[:-1]))
    toks = list(tokens[1:])
    out = []
    for i in range(len(drafts)):
      r = self.layer(self.embed(toks), t.stack(feats))
      out.append(self.logits(r[-1]))
      feats.append(r[-1])
      toks.append(int(drafts[i]))
    return t.stack(out).numpy()


def finite_max_diff(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert np.array_equal(np.isinf(a), np.isinf(b)), "the -inf pattern (draft vocabulary) differs"
  fin = np.isfinite(a)
  return float(np.abs(a[fin] - b[fin]).max())


def test_default_layers_are_the_inputs_of_2_half_and_minus_3():
  assert public_default_layers(32) == (1, 15, 28)         # Llama-3.1-8B: inputs of 2, 16, 29
  assert public_default_layers(36) == (1, 17, 32)         # Qwen3-8B
  assert public_default_layers(7) == (1, 2, 3)
  assert public_default_layers(5) is None                  # (2, 2, 2): one layer, not three
  assert default_eagle3_layers(5) == (0, 2, 4) and default_eagle3_layers(3) == (0, 1, 2)


def test_public_folder_matches_the_pytorch_reference(public_folder, target, hf_target):
  drafter = sj.drafters.load(public_folder, target)
  assert isinstance(drafter, EAGLE3) and drafter.target_layers == (1, 2, 3)
  assert drafter.draft_vocab_size == len(DRAFT_IDS)
  assert (drafter.layer_config.num_heads, drafter.layer_config.head_dim) == (8, 4)
  ref = TorchEagle3(public_tensors(), public_config(), hf_target)
  tokens = PROMPTS[2] + [5, 70, 71, 4]
  # Teacher-forced logits over every slot (the training forward).
  toks = jnp.asarray([tokens], jnp.int32)
  out = sj.forward(target.params, target.config, toks, sj.KVCache.zeros(target.config, 1, 16),
                   jnp.zeros(1, jnp.int32), return_layers=drafter.target_layers)
  feats = drafter.target_feature(drafter.params, out.hidden, out.layer_hidden)
  o = drafter.unroll(drafter.params, target.params, toks, feats, steps=1)[0]
  ours = np.asarray(drafter.logits(drafter.params, target.params, o))[0]
  theirs = ref.teacher_forced(tokens)
  assert float(np.abs(theirs[np.isfinite(theirs)]).max()) > 1.0     # not a trivially flat head
  assert finite_max_diff(ours, theirs) <= 1e-5

  # The drafting path (init_state + propose, its own features fed back), T = 1: q is the
  # softmax of the reference's logits given the same drafts, 0 outside the draft vocabulary.
  prompt, first = tokens[:8], tokens[8]
  capacity, k = 16, 3
  buf = jnp.zeros((1, capacity), jnp.int32).at[0, :9].set(jnp.asarray(prompt + [first]))
  pre_out = sj.forward(target.params, target.config, jnp.asarray([prompt], jnp.int32),
                       sj.KVCache.zeros(target.config, 1, capacity), jnp.zeros(1, jnp.int32),
                       return_layers=drafter.target_layers)
  sampling = sj.Sampling(temperature=1.0).as_arrays(1)
  state = drafter.init_state(drafter.params, PrefillInfo(
      tokens=buf, prompt_tokens=jnp.asarray([prompt], jnp.int32),
      prompt_lens=jnp.asarray([8], jnp.int32), hidden=pre_out.hidden,
      layer_hidden=pre_out.layer_hidden, target_params=target.params, sampling=sampling))
  ctx = DraftContext(key=jax.random.key(1), tokens=buf, lengths=jnp.asarray([9], jnp.int32),
                     sampling=sampling, target_params=target.params, num_draft=k)
  drafts, q, _ = drafter.propose(drafter.params, state, ctx)
  drafts = np.asarray(drafts)[0]
  assert np.isin(drafts, DRAFT_IDS).all()
  ref_logits = ref.chain(prompt + [first], drafts)
  ref_q = jax.nn.softmax(jnp.asarray(ref_logits), -1)
  assert float(np.abs(np.asarray(q)[0] - np.asarray(ref_q)).max()) <= 1e-5
  assert not np.asarray(q)[0][:, np.setdiff1d(np.arange(V), DRAFT_IDS)].any()
  # Greedy: the mapped argmax, no probabilities.
  g_ctx = ctx.replace(sampling=GREEDY.as_arrays(1), greedy=True)
  g_drafts, g_q, _ = drafter.propose(drafter.params, state, g_ctx)
  assert g_q is None
  g_drafts = np.asarray(g_drafts)[0]
  np.testing.assert_array_equal(g_drafts, ref.chain(prompt + [first], g_drafts).argmax(-1))


def test_public_folder_greedy_speculation_equals_plain_greedy(public_folder, target):
  drafter = sj.drafters.load(public_folder, target)
  plain = sj.generate(target, PROMPTS, max_new_tokens=16, sampling=GREEDY, stop_tokens=[])
  spec = sj.generate(target, PROMPTS, drafter=drafter, num_draft=3, max_new_tokens=16,
                     sampling=GREEDY, stop_tokens=[])
  assert spec.tokens == plain.tokens and spec.stats.drafted > 0


def test_pytorch_bin_with_sglang_names_loads_the_same_head(tmp_path, public_folder, target):
  """pytorch_model.bin, "model."-prefixed names (SGLang's modules), embed_tokens = the target's
  own table (dropped: the target's is read)."""
  tensors = {("model." + k if k != "lm_head.weight" else k): v
             for k, v in public_tensors().items()}
  tensors["model.embed_tokens.weight"] = np.asarray(target.params["embed"], np.float32)
  folder = write_folder(tmp_path / "bin", tensors=tensors, fmt="bin")
  a = sj.drafters.load(public_folder, target)
  b = sj.drafters.load(folder, target)
  assert a == b and "embed" not in b.params
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _mutate(tensors, config, what):
  if what == "missing":
    del tensors["midlayer.hidden_norm.weight"]
  elif what == "shape":
    tensors["fc.weight"] = tensors["fc.weight"][:, :2 * D]
  elif what == "lm_head":
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:-1]
  elif what == "d2t-range":
    tensors["d2t"][-1] = V - len(DRAFT_IDS) + 1          # the last draft id -> target id V
  elif what == "d2t-repeat":
    tensors["d2t"][1] = tensors["d2t"][0] - 1           # draft 1 -> the same target as draft 0
  elif what == "d2t-missing":
    del tensors["d2t"]
  elif what == "t2d":
    tensors["t2d"][int(np.setdiff1d(np.arange(V), DRAFT_IDS)[0])] = True
  elif what == "unknown":
    tensors["midlayer.self_attn.q_norm.weight"] = np.ones(4, np.float32)
  elif what == "hidden":
    config["hidden_size"] = 48
  elif what == "target-hidden":
    config["target_hidden_size"] = 64
  elif what == "vocab":
    config["vocab_size"] = 100
  elif what == "draft-vocab":
    config["draft_vocab_size"] = V + 1
  elif what == "layers":
    config["eagle_aux_hidden_state_layer_ids"] = [2, 4, 9]
  elif what == "layers-sglang":              # SGLang's output indices: 8 is the boundary 9
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [2, 4, 8]}
  elif what == "layers-disagree":
    config["eagle_aux_hidden_state_layer_ids"] = [2, 4, 6]
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}
  elif what == "bias":
    config["attention_bias"] = True
  elif what == "two-layers":
    config["num_hidden_layers"] = 2
  elif what == "duplicate":                # two spellings of one tensor: which won was undefined
    tensors["model.fc.weight"] = np.zeros_like(tensors["fc.weight"])
  elif what == "string-field":             # int() raised without naming the file or field
    config["intermediate_size"] = "abc"
  elif what == "null-required":            # int(None): a TypeError
    config["num_attention_heads"] = None
  elif what == "depth":                    # exported for a 9-layer target (ours has 7)
    config["num_target_layers"] = 9


MALFORMED = {
    "missing": r"lacks 1 tensor\(s\): midlayer.hidden_norm.weight",
    "shape": r"fc.weight has shape \(32, 64\); config.json and the target imply \(32, 96\)",
    "lm_head": r"lm_head.weight has shape \(39, 32\).*\(40, 32\) \(draft_vocab_size rows\)",
    "d2t-range": r"d2t maps draft ids to target ids \[96\] outside the target's vocabulary",
    "d2t-repeat": r"d2t maps two draft ids to the same target id",
    "d2t-missing": r"lacks 1 tensor\(s\): d2t",
    "t2d": r"t2d disagrees with d2t",
    "unknown": r"tensor\(s\) that a one-layer LlamaForCausalLMEagle3 does not have: "
               r"midlayer.self_attn.q_norm.weight",
    "hidden": r"hidden_size=48 but the target's hidden size is 32",
    "target-hidden": r"target_hidden_size=64 but the target's hidden size is 32",
    "vocab": r"vocab_size=100 but the target's vocabulary has 96 tokens",
    "draft-vocab": r"draft_vocab_size=97; allowed: 1 <= draft_vocab_size <= vocab_size 96",
    "layers": r"eagle_aux_hidden_state_layer_ids \[2, 4, 9\] name boundaries \[9\] outside",
    "layers-sglang": r"eagle_aux_hidden_state_layer_ids \[3, 5, 9\] name boundaries \[9\] outside",
    "layers-disagree": r"\[2, 4, 6\] \(vLLM: the input of layer id\) and eagle_config.*\[2, 4, 6\] "
                       r"\(SGLang: the output of layer id\) name different layers",
    "bias": r"attention_bias=true is not supported",
    "two-layers": r"num_hidden_layers=2",
    "duplicate": r"tensors fc.weight and model.fc.weight are both fc.weight",
    "string-field": r"config.json: intermediate_size='abc'; allowed: a positive integer",
    "null-required": r"config.json lacks 'num_attention_heads'",
    "depth": r"num_target_layers=9 but the target has 7 layers",
}


@pytest.mark.parametrize("what", list(MALFORMED))
def test_malformed_folders_are_refused(tmp_path, target, what):
  tensors, config = public_tensors(), public_config()
  _mutate(tensors, config, what)
  folder = write_folder(tmp_path / what, config=config, tensors=tensors)
  with pytest.raises(ValueError, match=MALFORMED[what]):
    sj.drafters.load(folder, target)


def test_null_optional_fields_take_their_defaults(tmp_path, target, public_folder):
  """A null num_hidden_layers / rms_norm_eps / num_key_value_heads is absent (int(None) and
  float(None) raised TypeErrors)."""
  config = public_config(num_hidden_layers=None, rms_norm_eps=None)
  folder = write_folder(tmp_path / "nulls", config=config, tensors=public_tensors())
  head, ref = sj.drafters.load(folder, target), sj.drafters.load(public_folder, target)
  assert head.layer_config.rms_norm_eps == 1e-6
  assert head.layer_config.num_kv_heads == ref.layer_config.num_kv_heads


def test_shallow_target_without_layer_ids_is_refused(tmp_path):
  five = sj.init_model(TARGET_CFG.replace(num_layers=5), jax.random.key(0))
  folder = write_folder(tmp_path / "f")
  with pytest.raises(ValueError, match=r"public default \(2, L//2, L-3\) is not three distinct"):
    sj.drafters.load(folder, five)


# ----------------------------------------------------------------------------- export

def test_export_round_trip_drafts_identically(tmp_path, target):
  head = EAGLE3.init(target, key=jax.random.key(2), init_std=0.3, target_layers=(0, 3, 6),
                     draft_tokens=DRAFT_IDS, intermediate_size=40)
  out = sj.drafters.export(head, tmp_path / "exported")
  config = json.loads((out / "config.json").read_text())
  assert config["architectures"] == ["LlamaForCausalLMEagle3"]
  assert config["draft_vocab_size"] == 40 and config["vocab_size"] == V
  # Non-default layers travel in both engines' spellings: vLLM's boundary ids (input of layer
  # id) at the top level, SGLang's output indices (it adds 1) under eagle_config.
  assert config["eagle_aux_hidden_state_layer_ids"] == [1, 4, 7]
  assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3, 6]
  assert config["num_target_layers"] == L     # ours: checked on load (the "depth" case above)
  back = sj.drafters.load(out, target)
  assert back == head
  # Each spelling alone names the same layers (a vLLM-only or an SGLang-only folder).
  for drop in ("top", "nested"):
    alone = json.loads(json.dumps(config))
    if drop == "top":
      del alone["eagle_aux_hidden_state_layer_ids"]
    else:
      del alone["eagle_config"]
    (out / "config.json").write_text(json.dumps(alone))
    assert sj.drafters.load(out, target).target_layers == (0, 3, 6), drop
  for a, b in zip(jax.tree.leaves(head.params), jax.tree.leaves(back.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for sampling in (GREEDY, sj.Sampling(temperature=1.0)):
    a = sj.generate(target, PROMPTS, drafter=head, num_draft=3, max_new_tokens=12,
                    sampling=sampling, stop_tokens=[], key=jax.random.key(4))
    b = sj.generate(target, PROMPTS, drafter=back, num_draft=3, max_new_tokens=12,
                    sampling=sampling, stop_tokens=[], key=jax.random.key(4))
    assert a.tokens == b.tokens and a.stats.accepted_at == b.stats.accepted_at


def test_export_reads_in_torch_safetensors_with_the_public_names(tmp_path, target):
  from safetensors.torch import load_file
  head = EAGLE3.init(target, key=jax.random.key(2), init_std=0.3, draft_tokens=DRAFT_IDS)
  out = sj.drafters.export(head, tmp_path / "e")
  config = json.loads((out / "config.json").read_text())
  assert "eagle_config" not in config          # the default layers: vLLM / SGLang's own default
  tensors = load_file(str(out / "model.safetensors"))
  want = {name: tuple(x.shape) for name, x in public_tensors().items()}
  want["midlayer.self_attn.q_proj.weight"] = (D, 2 * D)        # the target's head shape
  want["midlayer.self_attn.k_proj.weight"] = want["midlayer.self_attn.v_proj.weight"] = (16, 2 * D)
  want["midlayer.self_attn.o_proj.weight"] = (D, D)
  for name in ("gate", "up"):
    want[f"midlayer.mlp.{name}_proj.weight"] = (64, D)
  want["midlayer.mlp.down_proj.weight"] = (D, 64)
  assert {k: tuple(v.shape) for k, v in tensors.items()} == want
  assert str(tensors["d2t"].dtype) == "torch.int64" and str(tensors["t2d"].dtype) == "torch.bool"
  np.testing.assert_array_equal(tensors["d2t"].numpy() + np.arange(40), DRAFT_IDS)
  np.testing.assert_array_equal(tensors["lm_head.weight"].numpy(),
                                np.asarray(head.params["lm_head"]).T)


def test_export_refusals_and_atomic_overwrite(tmp_path, target):
  head = EAGLE3.init(target, draft_tokens=DRAFT_IDS)
  with pytest.raises(ValueError, match="unknown format 'medusa'; allowed: eagle3"):
    sj.drafters.export(head, tmp_path / "x", format="medusa")
  with pytest.raises(ValueError, match="writes EAGLE-3 heads; got a EAGLE"):
    sj.drafters.export(sj.drafters.EAGLE.init(target), tmp_path / "x")
  with pytest.raises(ValueError, match="must be strictly increasing"):
    sj.drafters.export(EAGLE3.init(target, target_layers=(2, 2, 4)), tmp_path / "x")
  out = sj.drafters.export(head, tmp_path / "e")
  with pytest.raises(ValueError, match="already exists and is not empty; pass overwrite=True"):
    sj.drafters.export(head, out)
  (out / "stale.txt").write_text("x")
  sj.drafters.export(head, out, overwrite=True)
  assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]      # no temp folders left


def test_orbax_save_of_a_loaded_public_head_keeps_its_own_shape(tmp_path, public_folder, target):
  """A public head's own eps / RoPE / head shape survive heads_folder.save -> load."""
  from spec_jax.drafters.formats import heads_folder
  head = sj.drafters.load(public_folder, target)
  heads_folder.save(tmp_path / "h", head, target, num_draft=3)
  back = sj.drafters.load(tmp_path / "h", target)
  assert back == head and back.layer_config.rope_theta == 5000.0
  assert back.layer_config.rms_norm_eps == 1e-6


def test_export_cli(tmp_path, capsys):
  from spec_jax.drafters.formats import heads_folder
  from spec_jax.tools import export_eagle3
  from tests.conftest import need_shared
  path = need_shared("models", "stories260K")
  stories = sj.load(path)
  head = EAGLE3.init(stories, init_std=0.1, target_layers=(1, 2, 4), draft_tokens=range(0, 512, 2))
  heads_folder.save(tmp_path / "run" / "heads", head, stories, num_draft=4)
  rc = export_eagle3.main([str(path), str(tmp_path / "run"), str(tmp_path / "out")])
  printed = capsys.readouterr().out
  assert rc == 0, printed
  assert "draft_vocab_size 256 of 512" in printed and "inputs of layers [2, 3, 5]" in printed
  assert "max |draft logit diff| over 16 prompt tokens: 0" in printed
  heads_folder.save(tmp_path / "mtp", sj.drafters.MTP.init(stories), stories, num_draft=2)
  assert export_eagle3.main([str(path), str(tmp_path / "mtp"), str(tmp_path / "o2")]) == 2
  assert "writes EAGLE-3 heads; got a MTP" in capsys.readouterr().err
  assert not (tmp_path / "o2").exists()


def test_an_own_embedding_survives_export_unless_it_is_the_targets(tmp_path, target):
  """A head's own embedding table 0.5 % away from the target's is its own (rtol 1e-2 dropped
  it on load); a bf16 copy of the target's (2^-9 relative) is the target's and is not kept."""
  head = EAGLE3.init(target, key=jax.random.key(2), init_std=0.3, own_embedding=True)
  for scale, kept in ((1.005, True), (1.0 + 2**-9, False)):
    params = dict(head.params, embed=head.params["embed"] * scale)
    out = sj.drafters.export(head.replace(params=params), tmp_path / f"e{scale}")
    assert ("embed" in sj.drafters.load(out, target).params) == kept, scale
