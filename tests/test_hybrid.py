"""The hybrid family (models/qwen3_next: Qwen3-Next with MoE, Qwen3.5 dense) against transformers
on tiny random folders, its recurrent state through long decodes and speculative rounds, the
state rollback (and a wrong variant that fails), trees refused, malformed configs refused.

Shapes: hidden 64, 4 layers (3 Gated DeltaNet + 1 gated attention), vocab 256; prompts of 150
tokens (> the 64-token chunk of the chunked delta rule)."""

import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import spec_jax as sj
from spec_jax.decoding import target as target_lib
from spec_jax.models.qwen3_next import cache as hybrid_cache
from tests.stats_helpers import assert_same_distribution

V = 256
SIZES = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
             linear_conv_kernel_dim=4, max_position_embeddings=1024)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48, decoder_sparse_step=1)
REL_TOL = 1e-4


def hf_model(kind: str, seed: int = 0):
  """A random transformers model of `kind`, every weight perturbed (non-trivial norms, gates,
  biases of dt; A_log kept in its initialised range), float32, eval mode."""
  if kind == "qwen3_next":
    cfg = transformers.Qwen3NextConfig(**SIZES, **MOE)
    cls = transformers.Qwen3NextForCausalLM
  else:
    cfg = transformers.Qwen3_5TextConfig(**SIZES)
    cls = transformers.Qwen3_5ForCausalLM
  torch.manual_seed(seed)
  model = cls(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "A_log" not in name:
        p.add_(0.1 * torch.randn_like(p))
    model.lm_head.weight.mul_(8.0)          # peaky logits: a non-trivial greedy path
    model.model.embed_tokens.weight.mul_(4.0)   # the current token weighs: some n-gram hits
  return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """kind -> (torch model, sj model, folder)."""
  out = {}
  for i, kind in enumerate(("qwen3_next", "qwen3_5_text")):
    tm = hf_model(kind, seed=i)
    folder = tmp_path_factory.mktemp(kind)
    tm.save_pretrained(folder)
    out[kind] = (tm, sj.load(folder), folder)
  return out


def prompt(n: int, seed: int = 0, batch: int = 2):
  return np.random.RandomState(seed).randint(0, V, (batch, n)).astype(np.int32)


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


# ----------------------------------------------------------------------------- speculation

REPEAT_PROMPTS = [[5, 9, 17, 33, 5, 9, 17, 33, 5, 9, 17, 33, 5, 9],
                  [7, 7, 8, 100, 7, 7, 8, 100, 7, 7, 8, 42, 7, 7, 8, 100, 1, 2]]


@pytest.fixture(scope="module")
def draft_model():
  """A smaller random llama of the same vocabulary (another family as the draft model)."""
  cfg = sj.ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=1,
                       num_heads=2, num_kv_heads=1)
  return sj.init_model(cfg, jax.random.key(7))


from spec_jax.drafters.base import FrozenDrafter, frozen_drafter, params_field


@frozen_drafter
class Oracle(FrozenDrafter):
  """Test drafter: proposes a known continuation (params: tokens [B, S], the plain greedy
  output in place) with every `every`-th position wrong (token + 1): accepted prefixes of every
  length 0..K, so each round commits a different verify position."""
  params: object = params_field()
  every: int = 3
  reads_prompt_hidden = False

  def propose(self, params, state, ctx):
    k = ctx.num_draft
    pos = ctx.lengths[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    toks = jnp.take_along_axis(params, jnp.clip(pos, 0, params.shape[1] - 1), axis=1)
    wrong = (pos % self.every) == 0
    return jnp.where(wrong, (toks + 1) % V, toks).astype(jnp.int32), None, state


def oracle_for(plain_tokens, every=3):
  ref = np.zeros((2, 80), np.int32)
  for i, (p, new) in enumerate(zip(REPEAT_PROMPTS, plain_tokens)):
    ref[i, :len(p) + len(new)] = p + new
  return Oracle(jnp.asarray(ref), every=every)


def greedy_run(model, drafter, k, new=40):
  return sj.generate(model, REPEAT_PROMPTS, drafter=drafter, num_draft=k, max_new_tokens=new,
                     sampling=sj.Sampling(temperature=0.0), stop_tokens=[], capacity=80)


def ngram_run(model, k):
  return sj.generate(model, REPEAT_PROMPTS, drafter=sj.drafters.NGram(max_ngram=3) if k else None,
                     num_draft=k, max_new_tokens=100, sampling=sj.Sampling(temperature=0.0),
                     stop_tokens=[], capacity=140)


@pytest.fixture(scope="module")
def plain(models):
  return {kind: greedy_run(models[kind][1], None, 0).tokens for kind in models}


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_text"])
def test_greedy_speculation_with_ngram_equals_plain_greedy(models, kind):
  model = models[kind][1]
  out = ngram_run(model, 4)
  assert out.tokens == ngram_run(model, 0).tokens
  assert 0 < out.stats.accepted < out.stats.drafted, out.stats.summary()   # partial accepts
  print(f"{kind} n-gram K=4: {out.stats.summary()}")


def test_greedy_speculation_with_a_draft_model_equals_plain_greedy(models, plain, draft_model):
  model = models["qwen3_next"][1]
  out = greedy_run(model, sj.drafters.DraftModel(draft_model), 3)
  assert out.tokens == plain["qwen3_next"]
  assert out.stats.drafted > out.stats.accepted       # rejections: the rollback is exercised


@pytest.mark.parametrize("k", [2, 5])
def test_greedy_speculation_with_partial_acceptances_equals_plain_greedy(models, plain, k):
  """A drafter right except at every third position: rounds accept 0..K drafts (each verify
  position committed some time), output equal to plain greedy."""
  model = models["qwen3_next"][1]
  out = greedy_run(model, oracle_for(plain["qwen3_next"]), k)
  assert out.tokens == plain["qwen3_next"]
  hist = np.asarray(out.stats.accepted_at)
  assert 0 < out.stats.acceptance_rate < 1 and hist[1] > 0, out.stats.summary()


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_greedy_speculation_with_feature_heads_equals_plain_greedy(models, plain, kind):
  """EAGLE-3 (three target layers' features) and DFlash (a block drafter) heads, random, on the
  hybrid target: its layer features feed them; output equal to plain greedy."""
  model = models["qwen3_next"][1]
  if kind == "eagle3":
    drafter = sj.drafters.EAGLE3.init(model, key=jax.random.key(4), init_std=0.3)
  else:
    drafter = sj.drafters.DFlash.init(model, key=jax.random.key(4), block_size=4, init_std=0.3)
  out = greedy_run(model, drafter, 3)
  assert out.tokens == plain["qwen3_next"]
  assert out.stats.drafted > 0


def test_committing_every_verified_position_fails_greedy_equality(models, plain, monkeypatch):
  """The wrong variant: keep the state after all K+1 verified tokens (no commit_cache). Its
  greedy output departs from plain greedy: the rollback is what makes the rounds exact."""
  model = models["qwen3_5_text"][1]
  monkeypatch.setattr(target_lib.ModelTarget, "commit_cache",
                      lambda self, cache, lengths, n_accepted: cache)
  target = target_lib.ModelTarget(model.config)
  prompts = np.zeros((2, 18), np.int32)
  lens = np.array([len(p) for p in REPEAT_PROMPTS], np.int32)
  for i, p in enumerate(REPEAT_PROMPTS):
    prompts[i, :len(p)] = p
  run = jax.jit(lambda params: sj.decode(
      params, prompts, lens, jax.random.key(0), config=target,
      drafter=oracle_for(plain["qwen3_5_text"]), num_draft=4, max_new_tokens=40, capacity=80,
      sampling=sj.Sampling(temperature=0.0), stop_tokens=()))
  res = run(model.params)
  wrong = [np.asarray(res.tokens)[i, lens[i]:lens[i] + 40].tolist() for i in range(2)]
  assert wrong != plain["qwen3_5_text"]


def test_a_hybrid_draft_model_is_refused(models):
  with pytest.raises(ValueError, match="recurrent state"):
    sj.drafters.DraftModel(models["qwen3_5_text"][1])


def test_trees_are_refused_with_a_clear_error(models):
  model = models["qwen3_5_text"][1]
  with pytest.raises(ValueError, match="qwen3_5_text.*chain|tree=None"):
    sj.generate(model, REPEAT_PROMPTS, drafter=sj.drafters.NGram(), tree=sj.TreeSpec(2, 2, 4),
                max_new_tokens=4, sampling=sj.Sampling(temperature=0.0), capacity=80)


# ----------------------------------------------------------------------------- losslessness

SMALL_V = 8


@functools.lru_cache(maxsize=None)
def small_target():
  """A hybrid of vocabulary 8 (Qwen3-Next MoE), peaky: the exact joint of three tokens is 512
  bins."""
  cfg = sj.ModelConfig(vocab_size=SMALL_V, hidden_size=32, intermediate_size=48, num_layers=4,
                       num_heads=2, num_kv_heads=1, head_dim=16, model_type="qwen3_next",
                       partial_rotary_factor=0.5, bos_token_id=None, eos_token_ids=(),
                       layer_types=("linear_attention",) * 3 + ("full_attention",),
                       linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=4,
                       linear_value_head_dim=4, linear_conv_kernel_dim=4, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=16)
  model = sj.init_model(cfg, jax.random.key(11))
  params = dict(model.params, lm_head=model.params["lm_head"] * 60.0,
                embed=model.params["embed"] * 30.0)
  return sj.Model(config=cfg, params=params)


CHI_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]


def small_joint(model, sampling):
  """P(x1, x2, x3) [V, V, V] of plain sampling after CHI_PROMPT: one forward over every
  prompt + x1 x2."""
  v = SMALL_V
  seqs = np.array([[a, b] for a in range(v) for b in range(v)], np.int32)
  toks = np.concatenate([np.tile(CHI_PROMPT, (len(seqs), 1)), seqs], axis=1)
  cache = sj.KVCache.zeros(model.config, len(seqs), 16)
  logits = sj.forward(model.params, model.config, jnp.asarray(toks), cache,
                      jnp.zeros(len(seqs), jnp.int32)).logits
  p = np.asarray(sj.sampling.probs(logits, sampling), np.float64)
  n = len(CHI_PROMPT)
  joint = p[0, n - 1][:, None, None] * p[::v, n].reshape(v, v)[:, :, None] * \
      p[:, n + 1].reshape(v, v, v)
  return joint / joint.sum()


def test_sampled_speculation_keeps_the_exact_joint_of_new_tokens():
  """T = 1, n-gram drafts K = 2: the first new token from the prefill, tokens 2 and 3 from one
  speculative round (verify, accept, commit): the joint of (x1, x2, x3) over 6000 rows is the
  exact one (chi-square p > 1e-3)."""
  model = small_target()
  sampling = sj.Sampling(temperature=1.0)
  joint = small_joint(model, sampling)
  out = sj.generate(model, [CHI_PROMPT] * 6000, drafter=sj.drafters.NGram(max_ngram=2),
                    num_draft=2, max_new_tokens=3, sampling=sampling, key=jax.random.key(3),
                    stop_tokens=[], capacity=16)
  toks = np.asarray(out.tokens)
  v = SMALL_V
  counts = np.bincount(toks[:, 0] * v * v + toks[:, 1] * v + toks[:, 2], minlength=v ** 3)
  assert 0.05 < out.stats.acceptance_rate < 0.98, out.stats.summary()
  stat, dof, p_value = assert_same_distribution(counts, joint, alpha=1e-3)
  print(f"hybrid, n-gram K=2 at T=1: chi-square {stat:.1f} (dof {dof}), p = {p_value:.3f}, "
        f"acceptance {out.stats.acceptance_rate:.2f}")


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

def torch_mtp_modules(tm, seed: int):
  """The MTP module of tm's kind in transformers' own classes (a full-attention decoder layer
  of the target's kind, its MoE or dense MLP, three zero-centred norms, fc), random weights."""
  import copy
  cfg = copy.deepcopy(tm.config)
  cfg.layer_types = ["full_attention"] + list(cfg.layer_types[1:])
  cfg._attn_implementation = "eager"
  d = cfg.hidden_size
  norm_cls = type(tm.model.norm)
  torch.manual_seed(seed)
  mods = torch.nn.ModuleDict(dict(
      fc=torch.nn.Linear(2 * d, d, bias=False), layer=type(tm.model.layers[0])(cfg, 0),
      pre_fc_norm_embedding=norm_cls(d, eps=cfg.rms_norm_eps),
      pre_fc_norm_hidden=norm_cls(d, eps=cfg.rms_norm_eps), norm=norm_cls(d, eps=cfg.rms_norm_eps)))
  with torch.no_grad():
    for name, p in mods.named_parameters():
      p.copy_((0.1 if p.ndim == 1 else 0.15) * torch.randn_like(p))
  return mods.eval()


def mtp_tensors(mods) -> dict:
  out = {}
  for name, value in mods.state_dict().items():
    name = name.replace("layer.", "layers.0.", 1) if name.startswith("layer.") else name
    out["mtp." + name] = value.detach().clone().contiguous()
  return out


@pytest.fixture(scope="module")
def mtp_models(models, tmp_path_factory):
  """kind -> (torch target, torch MTP modules, sj target loaded from a folder with mtp.*)."""
  from safetensors.torch import load_file, save_file
  out = {}
  for i, kind in enumerate(models):
    tm, _, folder = models[kind]
    mods = torch_mtp_modules(tm, seed=10 + i)
    new = tmp_path_factory.mktemp(f"{kind}_mtp")
    for f in folder.iterdir():
      shutil.copy(f, new / f.name)
    tensors = load_file(new / "model.safetensors")
    tensors.update(mtp_tensors(mods))
    save_file(tensors, new / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((new / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (new / "config.json").write_text(json.dumps(cfg))
    out[kind] = (tm, mods, sj.load(new), new)
  return out


def torch_mtp_logits(tm, mods, toks, drafts):
  """Reference: slot j holds (target hidden after its final norm at j, token j+1), RoPE position
  j; the chained slots hold (the module's previous normed output, the draft). Returns the
  logits at the last prompt slot and after each chained draft [1 + len(drafts), V]."""
  with torch.no_grad():
    ids = torch.tensor([toks], dtype=torch.long)
    feats = tm.model(ids[:, :-1]).last_hidden_state[0]                  # [P, D]
    emb = tm.model.embed_tokens
    x = mods["fc"](torch.cat([mods["pre_fc_norm_embedding"](emb(ids[0, 1:])),
                              mods["pre_fc_norm_hidden"](feats)], -1))
    logits = []
    for step in range(len(drafts) + 1):
      t = x.shape[0]
      pos = torch.arange(t)[None]
      cos, sin = tm.model.rotary_emb(x[None], pos)
      mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
      o = mods["layer"](x[None], position_embeddings=(cos, sin), attention_mask=mask,
                        position_ids=pos)
      o = o[0] if isinstance(o, tuple) else o
      n = mods["norm"](o[0])
      logits.append(tm.lm_head(n[-1]))
      if step < len(drafts):
        nxt = mods["fc"](torch.cat([mods["pre_fc_norm_embedding"](emb(torch.tensor([drafts[step]]))),
                                    mods["pre_fc_norm_hidden"](n[-1:])], -1))
        x = torch.cat([x, nxt], 0)
    return torch.stack(logits).numpy()


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


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculation_with_the_native_mtp_head_equals_plain_greedy(mtp_models, plain, k):
  _, _, model, folder = mtp_models["qwen3_next"]
  drafter = sj.drafters.load(folder, model)
  out = greedy_run(model, drafter, k)
  assert out.tokens == plain["qwen3_next"]
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

MESH_SCRIPT = """
import jax, numpy as np
import spec_jax as sj
from spec_jax.sharding import param_shardings
assert jax.device_count() == 4, jax.devices()
cfg = sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4,
                     num_heads=2, num_kv_heads=2, head_dim=16, model_type="qwen3_next",
                     partial_rotary_factor=0.5, eos_token_ids=(),
                     layer_types=("linear_attention",) * 3 + ("full_attention",),
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=4,
                     linear_value_head_dim=4, linear_conv_kernel_dim=4, num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=16,
                     shared_expert_intermediate_size=16)
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
"""


def test_generate_on_a_mesh_matches_one_device():
  """The hybrid family's weights by their leaf-name rules and its cache (KV heads, recurrent
  rows) on a (data 2, model 2) mesh of 4 fake CPU devices: greedy tokens as on one device."""
  import os
  import subprocess
  import sys
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
  env["JAX_PLATFORMS"] = "cpu"
  res = subprocess.run([sys.executable, "-c", MESH_SCRIPT], env=env, capture_output=True,
                       text=True, timeout=600, cwd=str(__import__("pathlib").Path(__file__).parents[1]))
  assert res.returncode == 0 and "OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
