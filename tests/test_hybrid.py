"""The hybrid family (models/qwen3_next: Qwen3-Next with MoE, Qwen3.5 dense) against transformers
on tiny random folders: logits over several prefill chunks, greedy generate, 200 decoded tokens
keep the recurrent state, malformed configs and folders refused, the verify buffers' commit, the
native MTP head against transformers' modules, the family on a mesh. Speculation (rollback,
losslessness): tests/test_hybrid_speculation.py.

Shapes: hidden 64, 4 layers (3 Gated DeltaNet + 1 gated attention), vocab 256; prompts of 150
tokens (> the 64-token chunk of the chunked delta rule)."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import spec_jax as sj
from spec_jax.models.qwen3_next import cache as hybrid_cache
from tests.hybrid_helpers import (REL_TOL, REPEAT_PROMPTS, SIZES, TINY_QWEN3_NEXT, build_models,
                                  build_mtp_models, prompt, torch_mtp_logits)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  return build_models(tmp_path_factory)


@pytest.fixture(scope="module")
def mtp_models(models, tmp_path_factory):
  return build_mtp_models(models, tmp_path_factory)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_text"])
def test_logits_match_transformers_over_several_chunks(models, kind):
  """One forward over 150 tokens (three chunks of the chunked delta rule) and 8 more tokens
  decoded one at a time through the recurrent form: transformers' logits within 1e-4 of their
  scale, float32."""
  tm, model, _ = models[kind]
  assert model.config.model_type == kind and model.config.layer_types[3] == "full_attention"
  toks = prompt(158)
  with torch.no_grad():
    ref = tm(torch.tensor(toks, dtype=torch.long)).logits.numpy()
  cfg = model.config
  cache = sj.KVCache.zeros(cfg, 2, 192)
  out = sj.forward(model.params, cfg, jnp.asarray(toks[:, :150]), cache, jnp.zeros(2, jnp.int32))
  logits = [np.asarray(out.logits)]
  step = jax.jit(lambda c, t, o: sj.forward(model.params, cfg, t, c, o))
  cache = out.cache
  for i in range(150, 158):
    o = step(cache, jnp.asarray(toks[:, i:i + 1]), jnp.full((2,), i, jnp.int32))
    logits.append(np.asarray(o.logits))
    cache = o.cache
  got = np.concatenate(logits, axis=1)
  scale = np.abs(ref).max()
  diff = np.abs(got - ref).max()
  print(f"{kind}: max logit diff {diff:.2e}, scale {scale:.2f}, relative {diff / scale:.2e}")
  assert diff <= REL_TOL * scale, (diff, scale)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_text"])
def test_greedy_tokens_match_transformers_generate(models, kind):
  """32 greedy tokens after prompts of 64 (one prefill chunk exactly: the next chunk is all
  padding for that row) and 100 tokens, batched: each identical to transformers' generate."""
  tm, model, _ = models[kind]
  toks = prompt(100, seed=3, batch=2)
  rows = [toks[0, :64].tolist(), toks[1].tolist()]
  refs = []
  for row in rows:
    with torch.no_grad():
      refs.append(tm.generate(torch.tensor([row], dtype=torch.long), max_new_tokens=32,
                              do_sample=False, min_new_tokens=32)[0, len(row):].tolist())
  out = sj.generate(model, rows, max_new_tokens=32, sampling=sj.Sampling(temperature=0.0),
                    stop_tokens=[], capacity=160)
  assert out.tokens == refs


def test_a_multimodal_qwen3_5_folder_loads_its_text_model(tmp_path):
  """A Qwen3_5ForConditionalGeneration folder (model_type qwen3_5: the text model under
  model.language_model., a vision tower beside it): its text part, logits as transformers'."""
  cfg = transformers.Qwen3_5Config(
      text_config=dict(SIZES), vision_config=dict(depth=1, hidden_size=32, intermediate_size=64,
                                                   num_heads=2, out_hidden_size=64))
  torch.manual_seed(3)
  tm = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
  with torch.no_grad():
    for name, p in tm.named_parameters():
      if "A_log" not in name:
        p.add_(0.1 * torch.randn_like(p))
  tm.save_pretrained(tmp_path)
  model = sj.load(tmp_path)
  assert model.config.model_type == "qwen3_5_text"
  toks = prompt(80, seed=4, batch=1)
  with torch.no_grad():
    ref = tm(input_ids=torch.tensor(toks, dtype=torch.long)).logits.numpy()
  cache = sj.KVCache.zeros(model.config, 1, 96)
  out = sj.forward(model.params, model.config, jnp.asarray(toks), cache, jnp.zeros(1, jnp.int32))
  assert np.abs(np.asarray(out.logits) - ref).max() <= REL_TOL * np.abs(ref).max()


def test_200_decoded_tokens_keep_the_state_exact(models):
  """Prefill 80 tokens, decode 200 greedily one token at a time (recurrent form, state carried
  through 200 forwards): the final logits and every greedy token equal one fresh forward over
  the whole sequence (chunked form), and so do the final recurrent states and conv windows."""
  _, model, _ = models["qwen3_5_text"]
  cfg, params = model.config, model.params
  toks = jnp.asarray(prompt(80, seed=5))
  cap = 288

  @jax.jit
  def run(toks):
    pre = sj.forward(params, cfg, toks, sj.KVCache.zeros(cfg, 2, cap), jnp.zeros(2, jnp.int32))
    first = jnp.argmax(pre.logits[:, -1], -1).astype(jnp.int32)

    def step(carry, i):
      cache, tok = carry
      out = sj.forward(params, cfg, tok[:, None], cache, jnp.full((2,), 80, jnp.int32) + i)
      nxt = jnp.argmax(out.logits[:, 0], -1).astype(jnp.int32)
      return (out.cache, nxt), (tok, out.logits[:, 0])

    (cache, _), (fed, logits) = jax.lax.scan(step, (pre.cache, first), jnp.arange(200))
    return cache, fed.T, logits[-1]

  cache, fed, last_logits = run(toks)
  seq = jnp.concatenate([toks, fed], axis=1)                             # 280 tokens
  full = sj.forward(params, cfg, seq, sj.KVCache.zeros(cfg, 2, cap), jnp.zeros(2, jnp.int32))
  ref = np.asarray(full.logits)
  np.testing.assert_array_equal(np.asarray(fed[:, 1:]), ref[:, 80:279].argmax(-1))
  scale = np.abs(ref[:, -1]).max()
  diff = np.abs(np.asarray(last_logits) - ref[:, -1]).max()
  print(f"after 200 decoded tokens: final logit diff {diff:.2e} (scale {scale:.2f})")
  assert diff <= REL_TOL * scale
  np.testing.assert_allclose(np.asarray(cache.state), np.asarray(full.cache.state),
                             atol=1e-4 * float(np.abs(full.cache.state).max()))
  np.testing.assert_allclose(np.asarray(cache.conv), np.asarray(full.cache.conv),
                             atol=1e-5 * float(np.abs(full.cache.conv).max()))


# ----------------------------------------------------------------------------- refusals

def base_fields(**changes):
  fields = dict(vocab_size=16, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=2,
                num_kv_heads=1, head_dim=16, model_type="qwen3_5_text",
                layer_types=("linear_attention",) * 3 + ("full_attention",),
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=4,
                linear_value_head_dim=4, linear_conv_kernel_dim=4, partial_rotary_factor=0.25)
  fields.update(changes)
  return fields


@pytest.mark.parametrize("changes, field", [
    (dict(layer_types=None), "layer_types"),
    (dict(layer_types=("linear_attention",) * 3), "layer_types"),
    (dict(layer_types=("linear_attention",) * 3 + ("sliding_attention",)), "layer_types"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads"),
    (dict(linear_key_head_dim=0), "linear_key_head_dim"),
    (dict(partial_rotary_factor=0.1), "partial_rotary_factor"),
])
def test_malformed_configs_are_refused_naming_the_field(changes, field):
  sj.ModelConfig(**base_fields())                          # the base is fine
  with pytest.raises(ValueError, match=field):
    sj.ModelConfig(**base_fields(**changes))


@pytest.mark.parametrize("edit, field", [
    (lambda c: c.update(layer_types=c["layer_types"][:3]), "layer_types"),
    (lambda c: c.update(linear_conv_kernel_dim=0), "linear_conv_kernel_dim"),
    (lambda c: c.update(linear_value_head_dim=4),          # every tensor shape, before reading
     r"tensor model.layers.0.linear_attn.\S+ has shape"),
    (lambda c: c.update(linear_num_value_heads=3), "linear_num_value_heads"),
])
def test_load_refuses_malformed_folders_naming_the_field(models, tmp_path, edit, field):
  _, _, folder = models["qwen3_5_text"]
  bad = tmp_path / "bad"
  shutil.copytree(folder, bad)
  cfg = json.loads((bad / "config.json").read_text())
  edit(cfg)
  (bad / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match=field):
    sj.load(bad)


def test_commit_cache_selects_the_accepted_position():
  """commit_cache picks the state after position n_accepted[b] of each row and the conv window
  ending there (a unit check of the buffers' indexing)."""
  cfg = sj.ModelConfig(**base_fields())
  cache = hybrid_cache.init_cache(cfg, 2, 8)
  steps = jnp.arange(cache.state_steps.size, dtype=jnp.float32).reshape(cache.state_steps.shape)
  conv = jnp.arange(cache.conv_steps.size, dtype=jnp.float32).reshape(cache.conv_steps.shape)
  cache = cache.replace(state_steps=steps, conv_steps=conv.astype(cache.conv_steps.dtype))
  n = jnp.array([0, 3], jnp.int32)
  out = hybrid_cache.commit_cache(cache, jnp.array([5, 5]), n)
  for b in range(2):
    np.testing.assert_array_equal(out.state[:, b], steps[:, b, int(n[b])])
    np.testing.assert_array_equal(out.conv[:, b], conv[:, b, int(n[b]) + 1:int(n[b]) + 4])


# ----------------------------------------------------------------------------- native MTP

@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_text"])
def test_mtp_draft_logits_match_an_independent_torch_forward(mtp_models, kind):
  """sj.drafters.load(folder, target) finds mtp.* in the target's own folder; its first draft's
  logits and the chained second and third drafts' equal transformers' modules run by hand."""
  tm, mods, model, folder = mtp_models[kind]
  drafter = sj.drafters.load(folder, model)
  assert isinstance(drafter, sj.drafters.HybridMTP) and drafter.kind == "mtp"
  assert ("router" in drafter.params["layer"]) == (kind == "qwen3_next")    # MoE vs dense
  toks = prompt(41, seed=9, batch=1)[0].tolist()          # prompt of 40, then token P
  drafts = [17, 200]
  ref = torch_mtp_logits(tm, mods, toks, drafts)
  p = 40
  cfg, params = model.config, model.params
  buf = jnp.zeros((1, 64), jnp.int32).at[0, :p + 1].set(jnp.asarray(toks))
  pre = sj.forward(params, cfg, buf[:, :p], sj.KVCache.zeros(cfg, 1, 64), jnp.zeros(1, jnp.int32))
  info = sj.drafters.PrefillInfo(tokens=buf, prompt_tokens=buf[:, :p],
                                 prompt_lens=jnp.array([p], jnp.int32), hidden=pre.hidden,
                                 layer_hidden=(), target_params=params,
                                 sampling=sj.Sampling(temperature=1.0).rows(1))
  state = drafter.init_state(drafter.params, info)
  got = [drafter.logits(drafter.params, params, state.next_feature)[0]]
  feature, k, v = state.next_feature, state.k, state.v
  for i, d in enumerate(drafts):
    o, k, v = drafter._step(drafter.params, params, jnp.array([[d]], jnp.int32), feature[:, None],
                            k, v, jnp.array([p + i], jnp.int32))
    feature = o[:, 0]
    got.append(drafter.logits(drafter.params, params, feature)[0])
  got = np.stack([np.asarray(g) for g in got])
  scale = np.abs(ref).max()
  diff = np.abs(got - ref).max()
  print(f"{kind} MTP: max draft-logit diff {diff:.2e} (scale {scale:.2f})")
  assert diff <= REL_TOL * scale, (diff, scale)


@pytest.mark.parametrize("k", [3])
def test_greedy_speculation_with_the_native_mtp_head_equals_plain_greedy(models, mtp_models, k):
  _, _, model, folder = mtp_models["qwen3_next"]
  drafter = sj.drafters.load(folder, model)
  # Capacity 160 and plain greedy of the same weights loaded without the mtp.* tensors (the
  # MTP folder copies the target's): the plain decode is then the program
  # test_greedy_tokens_match_transformers_generate[qwen3_next] compiled, not one more compile
  # for a config that differs only in num_mtp_layers.
  kw = dict(max_new_tokens=40, sampling=sj.Sampling(temperature=0.0), stop_tokens=[],
            capacity=160)
  out = sj.generate(model, REPEAT_PROMPTS, drafter=drafter, num_draft=k, **kw)
  assert out.tokens == sj.generate(models["qwen3_next"][1], REPEAT_PROMPTS, **kw).tokens
  assert out.stats.drafted > 0
  print(f"native MTP K={k}: {out.stats.summary()}")


def test_cli_drafter_mtp_reads_the_targets_own_folder(mtp_models):
  from spec_jax.bench.specs import make_drafter
  _, _, model, _ = mtp_models["qwen3_5_text"]
  drafter = make_drafter("mtp", model)
  assert isinstance(drafter, sj.drafters.HybridMTP)
  with pytest.raises(ValueError, match="mtp"):
    make_drafter("mtp", mtp_models["qwen3_5_text"][2].replace(source=None)
                 if hasattr(mtp_models["qwen3_5_text"][2], "replace") else
                 sj.Model(config=model.config, params=model.params))


# ----------------------------------------------------------------------------- sharding

# The config travels as its repr: importing tests.hybrid_helpers would import torch and
# transformers in the subprocess (~2 CPU-s), which it never uses.
MESH_SCRIPT = """
import jax, numpy as np
import spec_jax as sj
from spec_jax.sharding import param_shardings
assert jax.device_count() == 4, jax.devices()
cfg = sj.ModelConfig(**%r)
target = sj.init_model(cfg, jax.random.key(1))
target.params["embed"] = target.params["embed"] * 40
mesh = jax.make_mesh((2, 2), ("data", "model"))
specs = param_shardings(mesh, target.params)
lay = specs["layers"]
assert lay[0]["w_qkv"].spec[-1] == "model" and lay[0]["w_out"].spec[0] == "model"
assert lay[0]["experts_gate"].spec[0] == "model" and lay[3]["wq"].spec[-1] == "model"
prompts = [[1, 5, 7, 9, 5, 7], [1, 3], [1, 2, 3, 4, 5], [1, 9, 9, 9, 9]]
kw = dict(max_new_tokens=12, stop_tokens=[], sampling=sj.Sampling(0.0))
one = sj.generate(target, prompts, **kw)
for drafter, k in [(None, 0), (sj.drafters.NGram(), 3)]:
  many = sj.generate(target, prompts, drafter=drafter, num_draft=k, mesh=mesh, **kw)
  assert many.tokens == one.tokens, (k, many.tokens, one.tokens)
print("OK")
""" % (TINY_QWEN3_NEXT,)


def test_generate_on_a_mesh_matches_one_device():
  """The hybrid family's weights by their leaf-name rules and its cache (KV heads, recurrent
  rows) on a (data 2, model 2) mesh of 4 fake CPU devices: greedy tokens as on one device."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      " --xla_force_host_platform_device_count=4").strip()
  env["JAX_PLATFORMS"] = "cpu"
  res = subprocess.run([sys.executable, "-c", MESH_SCRIPT], env=env, capture_output=True,
                       text=True, timeout=600, cwd=str(pathlib.Path(__file__).parents[1]))
  assert res.returncode == 0 and "OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def test_pallas_attention_and_bfloat16_run_the_hybrid_layers(models):
  """The attention layers go through kernels_pallas (interpret mode on CPU): a 4-token verify
  with attention_impl="pallas" gives the reference's logits. A bfloat16 copy runs the prefill
  (chunked) and a verify within bf16 rounding of float32 (the state stays float32)."""
  _, model, _ = models["qwen3_5_text"]
  toks = jnp.asarray(prompt(74, seed=6))
  outs = {}
  for name, cfg, params in [
      ("reference", model.config.replace(attention_impl="reference"), model.params),
      ("pallas", model.config.replace(attention_impl="pallas"), model.params),
      ("bf16", model.config.replace(dtype="bfloat16", attention_impl="reference"),
       jax.tree.map(lambda x: x.astype(jnp.bfloat16), model.params))]:
    cache = sj.KVCache.zeros(cfg, 2, 96)
    pre = sj.forward(params, cfg, toks[:, :70], cache, jnp.zeros(2, jnp.int32))
    ver = sj.forward(params, cfg, toks[:, 70:], pre.cache, jnp.full((2,), 70, jnp.int32))
    assert ver.cache.state.dtype == jnp.float32
    outs[name] = np.asarray(ver.logits, np.float32)
  scale = np.abs(outs["reference"]).max()
  np.testing.assert_allclose(outs["pallas"], outs["reference"], atol=1e-5 * scale)
  assert np.abs(outs["bf16"] - outs["reference"]).max() < 0.1 * scale
