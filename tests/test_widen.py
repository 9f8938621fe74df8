"""spec_jax.models.widen, save_hf, widen_heads and the `python -m spec_jax.tools.widen` CLI.

The real target is stories260K (D 64, 8 x 8 heads, 4 kv heads, F 172, 5 layers), widened small
to keep CI fast: hidden 128, head_dim 16 (8 heads, 4 kv heads), F 256, 7 layers (two identity
blocks); and once larger (hidden 256, head_dim 32). Prompts are real TinyStories text.
"""

import dataclasses
import functools
import importlib
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from spec_jax.drafters import EAGLE, EAGLE3, EAGLE3Fused, MTP, Medusa, widen_heads
from spec_jax.drafters.formats import heads_folder
from spec_jax.models import widen
from spec_jax.models.hf_export import llama2c_tokenizer_json, save_hf
from spec_jax.tools import widen as cli
from tests.conftest import need_shared
from tests.numerics import f32_atol

widen_module = importlib.import_module("spec_jax.models.widen")   # the name `widen` is the function
GREEDY = sj.Sampling(temperature=0.0)
SMALL = dict(hidden_size=128, intermediate_size=256, num_layers=7, head_dim=16)
# Widening is exact in real arithmetic; in float32 the widened model sums the same terms in
# another order (and many zeros). Measured: 9-13 ulps of the logits' scale (~21) for the three
# widenings; the weakest broken recipe ("eps") is off by ~1180 ulps. tol() allows 64.
WIDEN_ULPS = 64


def tol(reference) -> float:
  """The absolute tolerance for logits against `reference` (tests/numerics.py)."""
  return f32_atol(reference, WIDEN_ULPS)


@functools.lru_cache(None)
def source():
  return sj.load(need_shared("models", "stories260K"))


@functools.lru_cache(None)
def small():
  return widen(source(), **SMALL)


@functools.lru_cache(None)
def prompt_tokens(n=4, length=24):
  """[n, length] ids of real TinyStories paragraphs (BOS first)."""
  text = need_shared("data", "tinystories", "dev.txt").read_text()
  paras = [p for p in text.split("\n\n") if len(p) > 200][:n]
  return np.asarray([source().encode(p)[:length] for p in paras], np.int32)


def run(model, tokens, layers=()):
  toks = jnp.asarray(tokens, jnp.int32)
  cache = sj.KVCache.zeros(model.config, toks.shape[0], toks.shape[1])
  return sj.forward(model.params, model.config, toks, cache,
                    jnp.zeros((toks.shape[0],), jnp.int32), return_layers=layers)


@functools.lru_cache(None)
def source_logits():
  return np.asarray(run(source(), prompt_tokens()).logits)


def max_diff(a, b):
  a, b = np.asarray(a), np.asarray(b)
  same_inf = np.isinf(a) & (a == b)      # -inf outside an EAGLE-3 draft vocabulary, in both
  return float(np.abs(np.where(same_inf, 0.0, a) - np.where(same_inf, 0.0, b)).max())


# ----------------------------------------------------------------------------- the target

def test_small_widening_has_the_new_shape_and_scaled_eps():
  c, w = source().config, small().config
  assert (w.hidden_size, w.intermediate_size, w.num_layers) == (128, 256, 7)
  assert (w.num_heads, w.num_kv_heads, w.head_dim) == (8, 4, 16)
  assert w.rms_norm_eps == pytest.approx(c.rms_norm_eps * 64 / 128)
  assert w.tie_embeddings and "lm_head" not in small().params
  shapes = jax.tree.map(np.shape, small().params)
  assert shapes["layers"]["wq"] == (7, 128, 128) and shapes["embed"] == (512, 128)


WIDENINGS = {
    "small": SMALL,
    # 12 q heads over 4 kv heads: a GQA group of 3 (source 2), 4 extra heads between them
    "extra-heads": dict(hidden_size=192, intermediate_size=200, num_layers=5, head_dim=16,
                        num_heads=12, num_kv_heads=4),
    "large": dict(hidden_size=256, intermediate_size=512, num_layers=6, head_dim=32),
}


@pytest.mark.parametrize("name", list(WIDENINGS))
def test_widened_logits_equal_the_source(name):
  model = small() if name == "small" else widen(source(), **WIDENINGS[name])
  out = run(model, prompt_tokens(), layers=(4,))
  assert max_diff(out.logits, source_logits()) <= tol(source_logits())
  d = source().config.hidden_size
  assert not np.any(np.asarray(out.hidden)[..., d:])          # the padding stays exactly zero
  assert not np.any(np.asarray(out.layer_hidden[0])[..., d:])


def _mutant(monkeypatch, what):
  """widen() with one piece of the recipe broken."""
  real_plan = widen_module.plan

  def plan(src, new):
    p = real_plan(src, new)
    if what == "norm-scale":
      return p._replace(scales={**p.scales, "norm": 1.0})
    if what == "q-scale":
      return p._replace(scales={**p.scales, "q": 1.0})
    if what == "rope-pairs":     # source dims packed at the front of each half, not spread
      dh, dh2 = src.head_dim, new.head_dim
      dims = np.concatenate([np.arange(dh // 2), dh2 // 2 + np.arange(dh // 2)])
      index = dict(p.index, dh=dims)
      for axis, heads in (("q", p.index["q"].reshape(-1, dh)[:, 0] // dh2),
                          ("kv", p.index["kv"].reshape(-1, dh)[:, 0] // dh2)):
        index[axis] = (heads[:, None] * dh2 + dims[None]).reshape(-1)
      return p._replace(index=index)
    return p

  monkeypatch.setattr(widen_module, "plan", plan)
  model = widen(source(), **SMALL)
  if what == "eps":
    model.config = model.config.replace(rms_norm_eps=source().config.rms_norm_eps)
  return model


@pytest.mark.parametrize("what", ["norm-scale", "eps", "q-scale", "rope-pairs"])
def test_the_logits_check_catches_a_broken_recipe(monkeypatch, what):
  """The tolerance of the test above is tight enough to see each piece of the recipe."""
  model = _mutant(monkeypatch, what)
  assert max_diff(run(model, prompt_tokens()).logits, source_logits()) > 10 * tol(source_logits())


@functools.lru_cache(None)
def plain_greedy(which):
  model = source() if which == "source" else small()
  prompts = [list(map(int, p[:12])) for p in prompt_tokens()[:2]]
  return sj.generate(model, prompts, max_new_tokens=16, sampling=GREEDY, stop_tokens=[])


def test_widened_greedy_tokens_are_identical():
  assert plain_greedy("small").tokens == plain_greedy("source").tokens


FAMILIES = {
    "qwen2-bias": sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                 num_layers=2, num_heads=4, num_kv_heads=2, qkv_bias=True,
                                 model_type="qwen2", rms_norm_eps=1e-6),
    "qwen3-qk-norm": sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                    num_layers=2, num_heads=4, num_kv_heads=2, qk_norm=True,
                                    model_type="qwen3", rms_norm_eps=1e-6),
    "llama3-rope-untied": sj.ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
        num_kv_heads=4, rope_theta=500000.0, rope_scaling=(
            ("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
            ("original_max_position_embeddings", 16), ("rope_type", "llama3"))),
}


@functools.lru_cache(None)
def family_model(name):
  model = sj.init_model(FAMILIES[name], jax.random.key(3))
  keys = iter(jax.random.split(jax.random.key(4), 8))
  layers = model.params["layers"]
  for leaf in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):   # non-trivial norms
    if leaf in layers:
      layers[leaf] = 1 + 0.3 * jax.random.normal(next(keys), layers[leaf].shape)
  model.params["embed"] = model.params["embed"] * 30
  if "lm_head" in model.params:
    model.params["lm_head"] = model.params["lm_head"] * 30
  return model


@pytest.mark.parametrize("name", list(FAMILIES))
def test_widening_other_families_is_exact(name):
  model = family_model(name)
  wide = widen(model, hidden_size=64, intermediate_size=64, num_layers=3, head_dim=16)
  toks = np.asarray([[1, 5, 9, 2, 33, 7, 60, 11, 4, 3]], np.int32)
  a, b = run(model, toks).logits, run(wide, toks).logits
  assert float(np.abs(np.asarray(a)).max()) > 1.0            # not a trivially flat model
  assert max_diff(a, b) <= tol(a)


# ----------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("kwargs,match", [
    (dict(hidden_size=32), r"hidden_size=32 is smaller than the source's 64; allowed: >= 64"),
    (dict(intermediate_size=100), r"intermediate_size=100 is smaller .* allowed: >= 172"),
    (dict(num_layers=4), r"num_layers=4 is smaller .* allowed: >= 5"),
    (dict(head_dim=12), r"head_dim=12 is not a multiple of the source's head_dim 8; allowed: "
                        r"8, 16, 24"),
    (dict(hidden_size=256, head_dim=64), r"num_heads defaults to hidden_size // head_dim = "
                                         r"256 // 64 = 4, fewer than the source's 8 heads; "
                                         r"allowed: a head_dim <= 32"),
    (dict(num_heads=4), r"num_heads=4 is smaller than the source's 8; allowed: >= 8"),
    (dict(num_heads=8, num_kv_heads=2), r"num_kv_heads=2 is smaller than the source's 4"),
    (dict(num_heads=8, num_kv_heads=8), r"GQA group of 1, smaller than the source's 2 .*"
                                        r"allowed: groups >= 2"),
    (dict(num_heads=9), r"num_heads=9 is not a multiple of the source's GQA group size 2"),
    (dict(num_heads=12, num_kv_heads=8), r"num_heads=12 must be a multiple of num_kv_heads=8"),
    (dict(num_layers=0), r"num_layers must be a positive integer, got 0"),
])
def test_widen_refuses_shapes_that_cannot_hold_the_source(kwargs, match):
  args = dict(SMALL, **kwargs)
  with pytest.raises(ValueError, match=match):
    widen(source(), **args)


def test_widen_refuses_qk_norm_unless_head_dim_grows_like_hidden():
  model = family_model("qwen3-qk-norm")                   # D 32, head_dim 8
  with pytest.raises(ValueError, match=r"qk_norm.*head_dim = 8 \* 64 / 32"):
    widen(model, hidden_size=64, intermediate_size=64, num_layers=2, head_dim=8)


def test_plan_refuses_an_unscaled_eps():
  bad = widen_module.widened_config(source().config, **SMALL).replace(rms_norm_eps=1e-5)
  with pytest.raises(ValueError, match=r"rms_norm_eps=1e-05 is not the source's 1e-05 \* 64 / 128"):
    widen_module.plan(source().config, bad)


def test_widen_refuses_native_mtp_weights():
  model = sj.init_model(FAMILIES["qwen3-qk-norm"])
  model.mtp_params = {"mtp.fc.weight": np.zeros((32, 64), np.float32)}
  with pytest.raises(ValueError, match="native MTP weights.*widen_heads"):
    widen(model, hidden_size=64, intermediate_size=64, num_layers=2, head_dim=16)


# ----------------------------------------------------------------------------- save_hf

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  return save_hf(small(), tmp_path_factory.mktemp("export") / "stories-wide")


def test_save_hf_round_trip_is_identical(exported):
  back = sj.load(exported)
  assert back.config == small().config.replace(attention_impl=back.config.attention_impl)
  same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
                      back.params, small().params)
  assert all(jax.tree.leaves(same))
  text = "Once upon a time, there was a little girl named Lily. She said: \"héllo 🙂\""
  assert type(back.tokenizer) is type(source().tokenizer)
  assert back.tokenizer.pieces() == source().tokenizer.pieces()
  assert back.encode(text) == source().encode(text)


def test_transformers_reads_the_export_with_the_same_logits_and_tokens(exported):
  import torch
  import transformers
  hf = transformers.AutoModelForCausalLM.from_pretrained(exported)
  with torch.no_grad():
    theirs = hf(torch.tensor(prompt_tokens(), dtype=torch.long)).logits.numpy()
  assert max_diff(theirs, source_logits()) <= tol(source_logits())
  tok = transformers.AutoTokenizer.from_pretrained(exported)
  text = need_shared("data", "tinystories", "dev.txt").read_text()
  for para in [p for p in text.split("\n\n") if p.strip()][:40] + ["a  b\n\nc 日本 🙂"]:
    ids = source().encode(para)
    assert tok.encode(para) == ids
    assert tok.decode(ids, skip_special_tokens=True) == source().decode(ids)


def test_save_hf_is_atomic_and_refuses_a_non_empty_folder(tmp_path, exported):
  with pytest.raises(ValueError, match="already exists and is not empty; pass overwrite=True"):
    save_hf(small(), exported)
  out = save_hf(source(), tmp_path / "m")
  (out / "stale.txt").write_text("x")
  save_hf(source(), out, overwrite=True)
  assert not (out / "stale.txt").exists()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]   # no temp folders left behind


def test_save_hf_round_trip_of_a_hugging_face_source(tmp_path):
  """tinystories656K: tied embedding stored as lm_head, a transformers tokenizer."""
  src = sj.load(need_shared("models", "tinystories656K"))
  back = sj.load(save_hf(src, tmp_path / "m"))
  assert back.config == src.config
  assert all(jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(a, b), back.params,
                                          src.params)))
  text = "Once upon a time there was a dog."
  assert back.encode(text) == src.encode(text) and back.tokenizer.eos_ids == src.tokenizer.eos_ids


@pytest.mark.parametrize("name", list(FAMILIES))
def test_save_hf_families_read_by_transformers(tmp_path, name):
  import torch
  import transformers
  model = family_model(name)
  out = save_hf(model, tmp_path / name)
  back = sj.load(out)
  assert back.config == model.config
  hf = transformers.AutoModelForCausalLM.from_pretrained(out)
  toks = np.asarray([[1, 5, 9, 2, 33, 7]], np.int32)
  with torch.no_grad():
    theirs = hf(torch.tensor(toks, dtype=torch.long)).logits.numpy()
  assert max_diff(theirs, run(model, toks).logits) <= tol(theirs)


def test_save_hf_refuses_what_transformers_cannot_express(tmp_path):
  llama_qk = sj.init_model(FAMILIES["qwen2-bias"].replace(model_type="llama", qk_norm=True))
  with pytest.raises(ValueError, match="qk_norm only with model_type 'qwen3'"):
    save_hf(llama_qk, tmp_path / "a")
  mistral = sj.init_model(FAMILIES["qwen2-bias"].replace(model_type="mistral"))
  with pytest.raises(ValueError, match="Mistral has no q/k/v biases"):
    save_hf(mistral, tmp_path / "b")
  windowed = sj.init_model(FAMILIES["qwen2-bias"].replace(model_type="llama", qkv_bias=False,
                                                          sliding_window=4))
  with pytest.raises(ValueError, match="transformers' Llama has no sliding window"):
    save_hf(windowed, tmp_path / "w")        # it was written without one: other logits
  odd = sj.init_model(FAMILIES["qwen2-bias"])
  odd.tokenizer = object()
  with pytest.raises(ValueError, match="cannot write a tokenizer of type object"):
    save_hf(odd, tmp_path / "c")
  assert not any(tmp_path.iterdir())


def test_llama2c_tokenizer_json_ranks_merges_by_score():
  tj = llama2c_tokenizer_json(source().tokenizer)
  vocab, merges = tj["model"]["vocab"], tj["model"]["merges"]
  assert len(vocab) == 512 and vocab["<s>"] == 1 and vocab["\u2581the"] > 258
  scores = source().tokenizer.scores()
  ranked = [scores[vocab[a + b]] for a, b in merges]
  assert ranked == sorted(ranked, reverse=True)


# ----------------------------------------------------------------------------- heads

def make_heads(kind, target):
  key = jax.random.key(8)
  if kind == "medusa":
    return Medusa.init(target, num_heads=3, key=key, init_scale=1.0)
  if kind == "eagle3-own-shape":   # its own head count and MLP width: kept, head_dim grows
    return EAGLE3.init(target, key=key, init_std=0.1, num_heads=4, intermediate_size=96)
  if kind == "eagle3-reduced":     # a draft vocabulary (own lm_head columns) and its own eps
    return EAGLE3.init(target, key=key, init_std=0.1, draft_tokens=list(range(3, 512, 2)),
                       rms_norm_eps=3e-6)
  return {"eagle": EAGLE, "eagle3": EAGLE3, "eagle3_fused": EAGLE3Fused,
          "mtp": MTP}[kind].init(target, key=key, init_std=0.1)


HEAD_CASES = ["medusa", "eagle", "eagle3", "mtp", "eagle3-own-shape", "eagle3-reduced",
              "eagle3_fused"]


@functools.lru_cache(None)
def heads_pair(kind):
  heads = make_heads(kind, source())
  return heads, widen_heads(heads, source(), small())


@pytest.mark.parametrize("kind", HEAD_CASES)
def test_widened_heads_draft_the_same_logits(kind):
  heads, wide = heads_pair(kind)
  toks = prompt_tokens(1, 20)[0]
  a = cli.head_logits(heads, source(), toks)
  b = cli.head_logits(wide, small(), toks)
  assert a.shape == b.shape and max_diff(a, b) <= tol(np.where(np.isinf(a), 0, a))
  if kind == "eagle3-own-shape":
    assert (wide.layer_config.num_heads, wide.layer_config.head_dim) == (4, 32)
    assert wide.layer_config.intermediate_size == 96
  elif kind != "medusa":
    assert wide.layer_config.num_heads == 8 and wide.layer_config.intermediate_size == 256


# Medusa and one feature head (EAGLE / EAGLE-3 / MTP share FeatureHead's drafting code; their
# widened logits are all checked above).
@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_greedy_with_widened_heads_equals_plain_greedy(kind):
  _, wide = heads_pair(kind)
  prompts = [list(map(int, p[:12])) for p in prompt_tokens()[:2]]
  out = sj.generate(small(), prompts, drafter=wide, num_draft=3, max_new_tokens=16,
                    sampling=GREEDY, stop_tokens=[])
  assert out.tokens == plain_greedy("small").tokens and out.stats.drafted > 0


def test_widened_heads_save_with_the_widened_fingerprint(tmp_path):
  heads, wide = heads_pair("eagle3")
  heads_folder.save(tmp_path / "h", wide, small(), num_draft=3)
  back = sj.drafters.load(tmp_path / "h", small())
  assert back == wide
  with pytest.raises(ValueError, match="different target"):
    sj.drafters.load(tmp_path / "h", source())


def test_widen_heads_refusals():
  with pytest.raises(ValueError, match="cannot widen a NGram.*allowed kinds: medusa"):
    widen_heads(sj.drafters.NGram(), source(), small())
  heads = EAGLE3.init(source(), num_heads=4, init_std=0.1)            # head_dim 16
  odd = widen(source(), hidden_size=96, intermediate_size=256, num_layers=5, head_dim=8,
              num_heads=12, num_kv_heads=6)                            # 96 / 4 = 24 per head
  with pytest.raises(ValueError, match="eagle3 head's decoder layer: .*head_dim=24 is not a "
                                       "multiple of the source's head_dim 16"):
    widen_heads(heads, source(), odd)
  other = family_model("qwen2-bias")
  with pytest.raises(ValueError, match="built for a target with hidden_size=64"):
    widen_heads(heads, other, small())
  bad = heads.with_params({**heads.params, "extra": jnp.zeros((3,))})
  with pytest.raises(ValueError, match="no widening rule for eagle3 param 'extra'.*HEAD_RULES"):
    widen_heads(bad, source(), small())


# ----------------------------------------------------------------------------- the CLI

def test_cli_widens_a_model_and_its_heads(tmp_path, capsys):
  heads, _ = heads_pair("mtp")
  heads_folder.save(tmp_path / "run" / "heads", heads, source(), num_draft=4)
  out = tmp_path / "wide"
  rc = cli.main([str(need_shared("models", "stories260K")), str(out), "--hidden-size", "128",
                 "--intermediate-size", "256", "--num-layers", "7", "--head-dim", "16",
                 "--heads", str(tmp_path / "run")])
  printed = capsys.readouterr().out
  assert rc == 0, printed
  assert "params: 1,099,648 (source 260,032)" in printed
  diffs = [float(x) for x in
           re.findall(r"max \|(?:draft )?logit diff\|[^:]*: ([0-9.e+-]+)", printed)]
  assert len(diffs) == 2 and max(diffs) <= tol(source_logits()), printed
  wide = sj.load(out)
  assert wide.config == small().config.replace(attention_impl=wide.config.attention_impl)
  back = sj.drafters.load(out, wide)                  # OUT/heads, bound to the widened target
  assert back.kind == "mtp" and back.trained_num_draft == 4
  meta = json.loads((out / "heads" / "heads.json").read_text())
  assert meta["extra"]["widened_from"]["heads"] == str(tmp_path / "run")


def test_cli_plain_conversion_and_bad_sizes(tmp_path, capsys):
  src = str(need_shared("models", "stories260K"))
  assert cli.main([src, str(tmp_path / "plain")]) == 0
  printed = capsys.readouterr().out
  assert "converted" in printed and "max |logit diff| vs the source over 16 prompt tokens: 0;" \
      in printed
  assert cli.main([src, str(tmp_path / "bad"), "--hidden-size", "32"]) == 2
  assert "hidden_size=32 is smaller than the source's 64" in capsys.readouterr().err
  assert not (tmp_path / "bad").exists()


def test_cli_checks_fail_on_nan_and_take_zero_as_a_size(tmp_path, capsys, monkeypatch):
  """A NaN logit difference passed --max-diff (nan > x is False: exit 0); a size flag of 0 meant
  "the source's" (exit 0, the model unchanged)."""
  src = str(need_shared("models", "stories260K"))
  assert cli.main([src, str(tmp_path / "zero"), "--num-layers", "0"]) == 2
  assert "num_layers" in capsys.readouterr().err and not (tmp_path / "zero").exists()
  real = cli.widen

  def nan_recipe(*a, **k):          # a recipe bug that makes NaN logits
    model = real(*a, **k)
    return dataclasses.replace(model, params={
        **model.params, "final_norm": model.params["final_norm"].at[0].set(jnp.nan)})
  monkeypatch.setattr(cli, "widen", nan_recipe)
  assert cli.main([src, str(tmp_path / "nan"), "--hidden-size", "128", "--head-dim", "16"]) == 1
  assert "differ by more than --max-diff" in capsys.readouterr().err


def test_cli_heads_out_and_unwidenable_heads_are_refused_before_writing(tmp_path, capsys):
  src = str(need_shared("models", "stories260K"))
  heads, _ = heads_pair("mtp")
  run_dir = tmp_path / "run"
  heads_folder.save(run_dir / "heads", heads, source(), num_draft=4)
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "notes.txt").write_text("mine")
  sizes = ["--hidden-size", "128", "--intermediate-size", "256", "--head-dim", "16"]
  for extra, message in (
      (["--heads-out", str(tmp_path / "x")], "give --heads too"),
      (["--heads", str(run_dir), "--heads-out", str(run_dir)], "is the source heads' folder"),
      (["--heads", str(run_dir), "--heads-out", str(tmp_path / "full")],
       "exists and is not empty; pass --overwrite")):
    assert cli.main([src, str(tmp_path / "out"), *sizes, *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
  assert sj.drafters.load(run_dir, source()).kind == "mtp"      # the source heads untouched
  dflash = sj.drafters.DFlash.init(source(), key=jax.random.key(0), num_layers=1, block_size=4)
  heads_folder.save(tmp_path / "df", dflash, source(), num_draft=3)
  # head_dim 8 cannot hold the DFlash head's widened heads: refused before OUT is written.
  assert cli.main([src, str(tmp_path / "out"), "--hidden-size", "96", "--head-dim", "8",
                   "--heads", str(tmp_path / "df")]) == 2
  assert "head_dim" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_save_hf_overwrites_through_a_symlink(tmp_path):
  model = small()
  save_hf(model, tmp_path / "v1")
  (tmp_path / "latest").symlink_to(tmp_path / "v1")
  save_hf(model, tmp_path / "latest", overwrite=True)        # rmtree refused the link after
  assert (tmp_path / "latest").is_symlink() and (tmp_path / "v1" / "config.json").is_file()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "v1"]
