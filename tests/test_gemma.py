"""Gemma 3 / Gemma 4 targets against transformers' PyTorch models (fp32, eager attention).

Tiny random instances (tests/gemma_helpers.py) written with save_pretrained and read by
sj.load: the CausalLM prefix `model.`, and the ConditionalGeneration checkpoints' prefixes
(`language_model.model.` as Gemma 3 saves it, `model.language_model.` as Gemma 4 does).
Prompts are longer than the sliding window (4) so the window and the per-type RoPE matter.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import spec_jax as sj
from spec_jax.models import hf, hf_export
from spec_jax.models.gemma import plan as gemma_layout
from tests import gemma_helpers as gh
from tests.test_tree import assert_tree_nodes_match_their_paths

T = 12                   # > sliding_window (4)
ATOL = 1e-4
CASES = {
    "gemma3-causal": lambda: gh.causal_lm(gh.gemma3_text_config()),
    "gemma3-conditional": lambda: gh.conditional_generation(gh.gemma3_text_config(), seed=3),
    "gemma4-dense-conditional": lambda: gh.conditional_generation(gh.gemma4_dense_config()),
    "gemma4-e2b-causal": lambda: gh.causal_lm(gh.gemma4_e2b_config(), seed=2),
    "gemma4-untied-causal": lambda: gh.causal_lm(gh.gemma4_dense_config(
        tie_word_embeddings=False, attention_k_eq_v=False, num_global_key_value_heads=None),
        seed=4),
}
_forward = jax.jit(sj.forward, static_argnums=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """case -> (torch model, sj Model loaded from its save_pretrained folder, folder)."""
  out = {}
  for name, build in CASES.items():
    torch_model = build()
    folder = tmp_path_factory.mktemp(name)
    torch_model.save_pretrained(folder)
    out[name] = (torch_model, sj.load(folder), folder)
  return out


def tokens(batch=2, length=T, seed=0):
  return np.random.RandomState(seed).randint(3, 64, (batch, length)).astype(np.int32)


def torch_logits(torch_model, toks):
  with torch.no_grad():
    return torch_model(torch.tensor(toks, dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_on_every_position(models, case):
  torch_model, model, _ = models[case]
  cfg = model.config
  assert cfg.model_type == ("gemma3" if case.startswith("gemma3") else "gemma4")
  assert cfg.dtype == "float32" and "sliding_attention" in cfg.layer_types
  assert cfg.tie_embeddings == ("untied" not in case) and ("lm_head" in model.params) != \
      cfg.tie_embeddings
  toks = tokens()
  ref = torch_logits(torch_model, toks)
  cache = sj.KVCache.zeros(cfg, 2, 16)
  assert isinstance(cache, sj.KVCache) and isinstance(cache.k, tuple)
  out = _forward(model.params, cfg, jnp.asarray(toks), cache, jnp.zeros(2, jnp.int32))
  err = float(np.abs(np.asarray(out.logits) - ref).max())
  print(f"{case}: logits max abs diff {err:.2e} (|logits| up to {np.abs(ref).max():.2f})")
  assert err <= ATOL


@pytest.mark.parametrize("case", ["gemma3-causal", "gemma4-dense-conditional",
                                  "gemma4-e2b-causal"])
def test_cached_decoding_matches_transformers(models, case):
  """Prefill 5 tokens, then one token per forward (cache writes and reads, KV-shared layers
  reading an earlier layer's cache, the window sliding over it) == the full forward."""
  torch_model, model, _ = models[case]
  cfg = model.config
  toks = tokens(seed=1)
  ref = torch_logits(torch_model, toks)
  cache = sj.KVCache.zeros(cfg, 2, 16)
  out = _forward(model.params, cfg, jnp.asarray(toks[:, :5]), cache, jnp.zeros(2, jnp.int32))
  got = [np.asarray(out.logits)]
  for i in range(5, T):
    out = _forward(model.params, cfg, jnp.asarray(toks[:, i:i + 1]), out.cache,
                   jnp.full((2,), i, jnp.int32))
    got.append(np.asarray(out.logits))
  err = float(np.abs(np.concatenate(got, 1) - ref).max())
  print(f"{case}: cached decoding max abs diff {err:.2e}")
  assert err <= ATOL


def torch_greedy(torch_model, prompt, n):
  with torch.no_grad():
    out = torch_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
  return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("case", ["gemma3-causal", "gemma4-dense-conditional",
                                  "gemma4-e2b-causal"])
def test_32_greedy_tokens_match_transformers_generate(models, case):
  torch_model, model, _ = models[case]
  prompt = tokens(1, 9, seed=5)[0].tolist()
  ref = torch_greedy(torch_model, prompt, 32)
  assert len(set(ref)) >= 6, ref          # a varied continuation, not one repeated token
  out = sj.generate(model, [prompt], max_new_tokens=32, sampling=sj.Sampling(0.0),
                    stop_tokens=[])
  assert out.tokens[0] == ref


def test_speculative_greedy_chains_and_trees_equal_plain_greedy(models):
  """A draft model of the same family (the target's first layers, so drafts are sometimes
  right), n-gram drafts, and trees (whose KV move is the Gemma cache's) change no token."""
  _, model, _ = models["gemma4-e2b-causal"]
  prompts = [tokens(1, 7, seed=6)[0].tolist(), tokens(1, 11, seed=7)[0].tolist()]
  kw = dict(max_new_tokens=20, sampling=sj.Sampling(0.0), stop_tokens=[])
  plain = sj.generate(model, prompts, **kw).tokens
  draft = sj.drafters.DraftModel(model)
  chain = sj.generate(model, prompts, drafter=draft, num_draft=3, **kw)
  assert chain.tokens == plain and chain.stats.acceptance_rate == 1.0
  tree = sj.generate(model, prompts, drafter=sj.drafters.NGram(), tree=sj.TreeSpec(3, 2, 6), **kw)
  assert tree.tokens == plain
  # The draft model's own trees: positions and a wide tree mask over its cache, past the window.
  draft_tree = sj.generate(model, prompts, drafter=draft, tree=sj.TreeSpec(3, 2, 6), **kw)
  assert draft_tree.tokens == plain and draft_tree.stats.mean_accepted_length > 2.0, \
      draft_tree.stats.summary()


def test_feature_head_drafters_on_a_gemma_target_equal_plain_greedy(models):
  """EAGLE, EAGLE-3 and MTP heads (a llama-style layer of their own, the target's embedding and
  soft-capped LM head, its hidden states) and Medusa draft for a Gemma target; chains and
  trees leave greedy output unchanged."""
  _, model, _ = models["gemma4-e2b-causal"]
  prompts = [tokens(1, 6, seed=11)[0].tolist(), tokens(1, 9, seed=12)[0].tolist()]
  kw = dict(max_new_tokens=12, sampling=sj.Sampling(0.0), stop_tokens=[])
  plain = sj.generate(model, prompts, **kw).tokens
  for drafter in (sj.drafters.EAGLE.init(model, jax.random.key(0)),
                  sj.drafters.EAGLE3.init(model, jax.random.key(1)),
                  sj.drafters.MTP.init(model, jax.random.key(2)),
                  sj.drafters.Medusa.init(model, num_heads=2, key=jax.random.key(3))):
    assert sj.generate(model, prompts, drafter=drafter, num_draft=2, **kw).tokens == plain
    if drafter.supports_tree:
      tree = sj.generate(model, prompts, drafter=drafter, tree=sj.TreeSpec(2, 2, 4), **kw)
      assert tree.tokens == plain, type(drafter).__name__


@pytest.mark.parametrize("case", ["gemma3-causal", "gemma4-e2b-causal"])
def test_tree_forward_past_the_window_equals_each_path_alone(models, case):
  """Tree nodes sit at cache slots past their RoPE positions; the sliding window must count
  positions (a node at depth 2 and index 3 sees one prefix key more than its slot says).
  Stage 1: tokens [r, a, b, c] (a, b <- r; c <- a) with the square ancestor mask; stage 2 (a
  draft model's next frontier): [d, e] (d <- c, e <- b) at the following slots, with a wide
  mask over the last 6 cache entries. Every node's logits == its path forwarded alone."""
  _, model, _ = models[case]
  assert_tree_nodes_match_their_paths(model.params, model.config, tokens(1, 9, seed=8)[0].tolist())


def test_pallas_attention_matches_the_reference():
  """Decode steps with attention_impl="pallas" (the GPU kernel, interpret mode on CPU) on the
  full layers equal the jnp reference (sliding layers take the reference in both)."""
  tc = gh.gemma4_e2b_config(head_dim=16, global_head_dim=32)
  cfg = hf.config_from_hf(tc)
  model = sj.init_model(cfg, jax.random.key(0))
  toks = tokens(2, 8, seed=9)
  outs = {}
  for impl in ("reference", "pallas"):
    c = cfg.replace(attention_impl=impl)
    cache = sj.KVCache.zeros(c, 2, 32)
    o = _forward(model.params, c, jnp.asarray(toks[:, :6]), cache, jnp.zeros(2, jnp.int32))
    o = _forward(model.params, c, jnp.asarray(toks[:, 6:]), o.cache, jnp.full((2,), 6, jnp.int32))
    outs[impl] = np.asarray(o.logits)
  np.testing.assert_allclose(outs["pallas"], outs["reference"], atol=1e-5)


# ----------------------------------------------------------------------------- bf16

def _bf16_dots_with_bf16_results(jaxpr) -> list:
  """dot_general equations with a bfloat16 operand whose result is bfloat16 (no f32
  accumulation), through every sub-jaxpr."""
  bad = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      ins = [v.aval.dtype for v in eqn.invars]
      if jnp.bfloat16 in ins and eqn.outvars[0].aval.dtype == jnp.bfloat16:
        bad.append(str(eqn))
  for sub in jax.extend.core.subjaxprs(jaxpr):
    bad += _bf16_dots_with_bf16_results(sub)
  return bad


@pytest.mark.parametrize("case", ["gemma3-causal", "gemma4-e2b-causal"])
def test_bf16_forward_is_close_to_fp32_and_accumulates_in_fp32(models, case):
  """bf16 weights and activations vs our fp32 forward, measured against transformers' own bf16
  forward vs its fp32 one on the same checkpoint (8 x 12 positions): max abs logit error <= 2x
  and mean abs error <= 1.5x transformers' (measured, Gemma 3 / E2B-like: max 0.067 / 0.24 vs
  its 0.087 / 0.26, mean 0.0083 / 0.019 vs 0.0093 / 0.017; these random models amplify
  rounding, |logits| up to ~1.7); and every dot with bf16 operands accumulates in float32 (no
  dot_general with bf16 operands has a bf16 result)."""
  torch_model, model, folder = models[case]
  bf = sj.load(folder, dtype="bfloat16")
  assert bf.config.dtype == "bfloat16"
  toks = tokens(batch=8, seed=10)
  ref = torch_logits(torch_model, toks)
  torch_bf16 = transformers.AutoModelForCausalLM.from_pretrained(
      folder, dtype=torch.bfloat16, attn_implementation="eager").eval()
  with torch.no_grad():
    torch_err = np.abs(torch_bf16(torch.tensor(toks, dtype=torch.long)).logits.float().numpy()
                       - ref)
  cache = sj.KVCache.zeros(bf.config, 8, 16)
  got = np.asarray(_forward(bf.params, bf.config, jnp.asarray(toks), cache,
                            jnp.zeros(8, jnp.int32)).logits)
  err = np.abs(got - ref)
  print(f"{case}: bf16 vs fp32 logits max abs diff {err.max():.3e} mean {err.mean():.3e} "
        f"(transformers bf16: {torch_err.max():.3e} / {torch_err.mean():.3e}; |logits| up to "
        f"{np.abs(ref).max():.2f})")
  assert err.max() <= 2 * torch_err.max() and err.mean() <= 1.5 * torch_err.mean()
  jaxpr = jax.make_jaxpr(lambda p, t, c: sj.forward(p, bf.config, t, c, jnp.zeros(8, jnp.int32)))(
      bf.params, jnp.asarray(toks), cache)
  assert _bf16_dots_with_bf16_results(jaxpr.jaxpr) == []


# ----------------------------------------------------------------------------- refusals

def _edit(folder, tmp_path, **changes):
  dst = tmp_path / "edited"
  shutil.copytree(folder, dst)
  raw = json.loads((dst / "config.json").read_text())
  raw.update(changes)
  (dst / "config.json").write_text(json.dumps(raw))
  return dst


def test_unsupported_gemma_configs_raise_one_line_value_errors(models, tmp_path):
  _, model, folder = models["gemma4-e2b-causal"]
  moe = _edit(folder, tmp_path / "moe", enable_moe_block=True, num_experts=4, top_k_experts=2,
              moe_intermediate_size=16)
  with pytest.raises(ValueError, match="enable_moe_block") as e:
    sj.load(moe)
  assert "\n" not in str(e.value)
  layer_types = list(model.config.layer_types)
  layer_types[1] = "chunked_attention"
  unknown = _edit(folder, tmp_path / "unknown", layer_types=layer_types)
  with pytest.raises(ValueError, match="chunked_attention") as e:
    sj.load(unknown)
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="unsupported layer type"):
    model.config.replace(layer_types=("sliding_attention", "local") + tuple(layer_types[2:]))
  bad_rope = tuple((t, th, (("rope_type", "yarn"),)) for t, th, _ in model.config.rope_by_type)
  with pytest.raises(ValueError, match="unsupported rope_type 'yarn'"):
    model.config.replace(rope_by_type=bad_rope)
  with pytest.raises(ValueError, match="save_hf writes llama-family folders"):
    hf_export.save_hf(model, tmp_path / "out")
  with pytest.raises(ValueError, match="widen: gemma4 models are not supported"):
    sj.models.widen(model, 64, 96, 6)
  with pytest.raises(ValueError, match="apply to model_type gemma3 / gemma4 only"):
    sj.ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                   num_heads=1, num_kv_heads=1, layer_types=("full_attention",))


# ----------------------------------------------------------------------------- the cache

def test_cache_holds_each_layer_type_at_its_own_shape(models):
  _, model, _ = models["gemma4-e2b-causal"]
  cfg = model.config
  cache = sj.KVCache.zeros(cfg, 3, 16, head_major=False)
  plan = gemma_layout.layout(cfg)
  # Layers 0-3 (sliding, sliding, full, sliding) have their own KV; the shared layers 4
  # (sliding) and 5 (full) read layers 3 and 2 and have no slot.
  assert [(g.layer_type, g.num_layers) for g in plan.groups] == [
      ("sliding_attention", 3), ("full_attention", 1)]
  assert [b.shape for b in cache.k] == [(3, 3, 16, 2, 8), (1, 3, 16, 2, 16)]
  assert [(p.kv_shared, p.kv_layer) for p in plan.layers] == [
      (False, 0), (False, 1), (False, 2), (False, 3), (True, 3), (True, 2)]
  assert cache.capacity == 16


def test_move_accepted_moves_every_buffer_like_the_llama_move_kv(models):
  from spec_jax.decoding.target import as_target
  _, model, _ = models["gemma4-e2b-causal"]
  for head_major in (False, True):
    cache = sj.KVCache.zeros(model.config, 2, 16, head_major=head_major)
    axis = cache.seq_axis
    fill = lambda b: b + jnp.arange(16, dtype=b.dtype).reshape(
        [16 if i == axis else 1 for i in range(b.ndim)])
    cache = cache.replace(k=tuple(map(fill, cache.k)), v=tuple(map(fill, cache.v)))
    lengths, path, n_acc = jnp.asarray([5, 9]), jnp.asarray([[2, 4], [1, 3]]), jnp.asarray([2, 1])
    moved = as_target(model.config).move_kv(cache, lengths, path, n_acc)
    for buf in moved.k + moved.v:
      seq = np.asarray(jnp.moveaxis(buf, axis, -1))      # [L_g, B, ..., S]: slot ids
      row0, row1 = seq[0, 0].reshape(-1, 16)[0], seq[0, 1].reshape(-1, 16)[0]
      # row 0: path nodes 2, 4 (slots 6, 8) -> slots 5, 6; row 1: node 1 (slot 9) -> slot 9
      assert row0[5] == 6 and row0[6] == 8 and row0[7] == 7, row0
      assert row1[9] == 9 and row1[10] == 10, row1


# ----------------------------------------------------------------------------- the mesh

MESH_SCRIPT = textwrap.dedent("""
    import sys, tempfile, jax
    import spec_jax as sj
    from tests import gemma_helpers as gh
    assert jax.device_count() == 8
    root = tempfile.mkdtemp()
    torch_target = gh.causal_lm(gh.gemma4_e2b_config(), seed=2)
    torch_target.save_pretrained(root + "/target")
    gh.assistant(torch_target.config).save_pretrained(root + "/assistant")
    target = sj.load(root + "/target")
    assistant = sj.drafters.load(root + "/assistant", target)
    prompts = [[5, 7, 9, 5, 7, 3], [9, 3], [4, 5, 6, 7, 8], [9, 9, 9], [4, 4, 4, 2, 1, 4, 4, 6],
               [3], [6, 6, 6], [2, 2, 2, 2, 2, 2, 2, 2, 2, 3]]
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    kw = dict(max_new_tokens=12, stop_tokens=[], sampling=sj.Sampling(0.0))
    one = sj.generate(target, prompts, **kw)
    many = sj.generate(target, prompts, mesh=mesh, **kw)
    assert many.tokens == one.tokens, (many.tokens, one.tokens)
    # The assistant's chain only: an n-gram chain would run the same target rounds on this
    # sharded Gemma cache (one more SPMD compile); n-gram drafts on a mesh are
    # tests/test_sharding.py::test_generate_on_eight_cpu_devices_matches_one_device's.
    spec = sj.generate(target, prompts, drafter=assistant, num_draft=3, mesh=mesh, **kw)
    assert spec.tokens == one.tokens
    tree = sj.generate(target, prompts, drafter=assistant, tree=sj.TreeSpec(2, 2, 4), mesh=mesh,
                       **kw)
    assert tree.tokens == one.tokens
    print("MESH OK")
""")


@pytest.mark.slow   # a fresh interpreter with 8 fake CPU devices (~1 min on the shared CPU)
def test_generate_on_a_mesh_equals_one_device():
  env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") +
             " --xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  res = subprocess.run([sys.executable, "-c", MESH_SCRIPT], env=env, capture_output=True,
                       text=True, timeout=900, cwd=root)
  assert "MESH OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def test_gemma4_vision_only_bidirectional_attention_loads_as_causal_text(tmp_path):
  """use_bidirectional_attention="vision" (Gemma 4 31B, 26B-A4B): only image-token blocks
  attend both ways, text stays causal (transformers: is_causal = value != "all"); it was
  refused. "all" is bidirectional text and stays refused."""
  torch_model = gh.causal_lm(gh.gemma4_dense_config(use_bidirectional_attention="vision"))
  torch_model.save_pretrained(tmp_path / "vision")
  model = sj.load(tmp_path / "vision")
  toks = tokens()
  out = _forward(model.params, model.config, jnp.asarray(toks), sj.KVCache.zeros(
      model.config, 2, 16), jnp.zeros(2, jnp.int32))
  assert float(np.abs(np.asarray(out.logits) - torch_logits(torch_model, toks)).max()) <= ATOL
  raw = json.loads((tmp_path / "vision" / "config.json").read_text())
  text = raw.get("text_config", raw)
  text["use_bidirectional_attention"] = "all"
  (tmp_path / "vision" / "config.json").write_text(json.dumps(raw))
  with pytest.raises(ValueError, match="use_bidirectional_attention='all'"):
    sj.load(tmp_path / "vision")
