"""train.distill_heads: a short run learns, a killed run resumes exactly, configs are checked.

Runs use the real stories260K (260K params) as the frozen target with tiny data and few steps.
"""

import json
import pathlib

import jax
import numpy as np
import pytest
import yaml

import spec_jax as sj
from tests.conftest import SHARED, need_shared
from train import distill_heads
from train.config import load_config, parse_set


def write_config(tmp_path, **sections) -> pathlib.Path:
  need_shared("models", "stories260K")
  cfg = {
      "target": str(SHARED / "models" / "stories260K"),
      "out_dir": str(tmp_path / "run"),
      "seed": 0,
      "head": {"kind": "medusa", "num_draft": 2},
      "data": {"sources": ["text"], "dev_path": str(SHARED / "data" / "tinystories" / "dev.txt"),
               "text_paragraphs": 40, "window": 16, "cache_dir": str(tmp_path / "cache")},
      "train": {"steps": 30, "batch_size": 8, "lr": 1e-2, "warmup_steps": 2,
                "checkpoint_every": 10, "log_every": 10},
      "eval": {"enabled": False, "path": str(SHARED / "data" / "tinystories" / "heldout.txt"),
               "num_prompts": 2, "prompt_tokens": 6, "max_new_tokens": 8,
               "temperatures": [0.0]},
  }
  for name, values in sections.items():
    if isinstance(values, dict):
      cfg[name].update(values)
    else:
      cfg[name] = values
  tmp_path.mkdir(parents=True, exist_ok=True)
  path = tmp_path / "config.yaml"
  path.write_text(yaml.safe_dump(cfg))
  return path


def test_short_training_lowers_loss_and_raises_agreement(tmp_path, capsys):
  path = write_config(tmp_path, eval={"enabled": True, "num_prompts": 4, "max_new_tokens": 16},
                      train={"steps": 80, "checkpoint_every": 40})
  out = distill_heads.main(["--config", str(path)])
  assert out["final"]["loss"] < out["initial"]["loss"] - 0.3, (out["initial"], out["final"])
  assert np.mean(out["final"]["agree"]) > np.mean(out["initial"]["agree"]) + 0.05
  printed = capsys.readouterr().out
  assert "before" in printed and "after" in printed and "tau" in printed
  report = json.loads((tmp_path / "run" / "eval.json").read_text())
  assert set(report["eval"]) == {"before", "after"}
  # The measured acceptance on held-out prompts rises (measured: tau 1.02 -> 1.33 greedy).
  before, after = report["eval"]["before"]["0.0"], report["eval"]["after"]["0.0"]
  assert after["tau"] > before["tau"] + 0.15, (before, after)
  assert after["alpha"] > before["alpha"] + 0.07, (before, after)
  assert f"{after['tau']:.2f}" in printed
  target = sj.load(SHARED / "models" / "stories260K")
  drafter = sj.drafters.load(tmp_path / "run", target)
  assert isinstance(drafter, sj.drafters.Medusa) and drafter.num_heads == 2
  for a, b in zip(jax.tree.leaves(drafter.params), jax.tree.leaves(out["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow   # three trainer runs (~50 s on a shared 2-core CPU)
def test_killed_run_resumes_to_the_same_params(tmp_path):
  """EAGLE-3 with the training-time-test unroll on self-distilled (generated, cached) data:
  8 steps straight vs 4 steps, 'killed', then the same command again."""
  common = dict(head={"kind": "eagle3", "num_draft": 2},
                data={"sources": ["generated", "text"], "num_prompts": 8, "prompt_tokens": 4,
                      "gen_tokens": 12, "gen_batch": 8, "text_paragraphs": 8},
                train={"steps": 8, "checkpoint_every": 2, "ttt_steps": 2, "feature_noise": 0.1})
  straight = distill_heads.main(["--config", str(write_config(tmp_path / "a", **common))])
  path_b = write_config(tmp_path / "b", **common)
  first = distill_heads.main(["--config", str(path_b), "--set", "train.stop_after=4"])
  assert first["stopped"] and first["end_step"] == 4
  caches = list((tmp_path / "b" / "cache").glob("generated_*.npz"))
  assert len(caches) == 1
  # Other captured layers keep every shape: the checkpoint restored and trained on before.
  with pytest.raises(ValueError, match="written by a run with another hyper_params.target_layers"):
    distill_heads.main(["--config", str(path_b), "--set", "head.target_layers=[1,2,3]"])
  resumed = distill_heads.main(["--config", str(path_b)])
  assert resumed["start_step"] == 4 and resumed["end_step"] == 8
  for a, b in zip(jax.tree.leaves(straight["params"]), jax.tree.leaves(resumed["params"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
def test_feature_head_losses_train(tmp_path, kind):
  path = write_config(tmp_path, head={"kind": kind, "num_draft": 2},
                      train={"steps": 12, "feature_weight": 1.0 if kind == "eagle" else 0.0,
                             "ttt_steps": 2, "checkpoint_every": 12})
  out = distill_heads.main(["--config", str(path)])
  # Measured: eagle 22.3 -> 13.2, mtp 12.3 -> 8.0 after 12 steps.
  assert out["final"]["loss"] < 0.8 * out["initial"]["loss"], (out["initial"], out["final"])
  assert np.mean(out["final"]["agree"]) > np.mean(out["initial"]["agree"]) + 0.02


def test_eagle3_reduced_draft_vocabulary_trains_and_saves(tmp_path):
  """head.draft_vocab_size: the most frequent tokens of the training windows, saved with the
  heads; the loss over that vocabulary falls; train.frozen keeps the LM head at its init (the
  target's rows for those tokens)."""
  from train import data as data_lib
  path = write_config(tmp_path, head={"kind": "eagle3", "num_draft": 2, "draft_vocab_size": 48,
                                      "target_layers": [1, 2, 4]},
                      train={"steps": 12, "ttt_steps": 2, "checkpoint_every": 12,
                             "frozen": ["lm_head"]})
  out = distill_heads.main(["--config", str(path)])
  assert out["final"]["loss"] < out["initial"]["loss"]
  target = sj.load(SHARED / "models" / "stories260K")
  drafter = sj.drafters.load(tmp_path / "run", target)
  assert drafter.kind == "eagle3" and drafter.draft_vocab_size == 48
  cfg = load_config(path)
  windows = data_lib.build_windows(target, cfg["data"], "unused", 0, lambda m: None)
  counts = np.bincount(windows.ravel(), minlength=512)
  np.testing.assert_array_equal(drafter.draft_tokens, np.sort(np.argsort(-counts, kind="stable")[:48]))
  assert np.asarray(drafter.params["lm_head"]).shape == (64, 48)
  np.testing.assert_array_equal(np.asarray(drafter.params["lm_head"]),
                                np.asarray(target.params["embed"]).T[:, drafter.draft_tokens])
  # Larger than the vocabulary: refused before the data is built (it was refused after).
  build = data_lib.build_windows
  data_lib.build_windows = lambda *a: pytest.fail("built the data first")
  try:
    with pytest.raises(ValueError, match=r"draft_vocab_size=600 must lie in \[1, 512\]"):
      distill_heads.main(["--config", str(path), "--set", "head.draft_vocab_size=600",
                          "--set", f"out_dir={tmp_path / 'too_big'}"])
  finally:
    data_lib.build_windows = build
  with pytest.raises(ValueError, match=r"train.frozen names \['lm_hed'\], which these heads do "
                                       r"not have; allowed: embed_norm, fc"):
    distill_heads.main(["--config", str(path), "--set", "train.frozen=[lm_hed]",
                        "--set", f"out_dir={tmp_path / 'other'}"])


@pytest.mark.parametrize("head", [
    {"kind": "eagle3", "num_draft": 2, "draft_vocab_size": 48, "target_layers": [1, 2, 4]},
    {"kind": "medusa", "num_draft": 2},
    {"kind": "dflash", "num_draft": 3, "block_size": 4, "num_layers": 1},
    {"kind": "dspark", "num_draft": 3, "block_size": 3, "num_layers": 1},
])
def test_precomputed_target_features_give_the_online_loss(tmp_path, head):
  """train.features: the loss from precomputed features (then only the LM head runs) equals the
  loss with the whole target in the step, for every loss family (fresh heads); features of
  other windows do not (the check can fail)."""
  from train import data as data_lib
  from train import features as features_lib
  extra = {"ttt_steps": 2} if head["kind"] == "eagle3" else {}
  cfg = load_config(write_config(tmp_path, head=head, train=extra))
  target = sj.load(cfg["target"])
  windows = data_lib.build_windows(target, cfg["data"], "unused", 0, lambda m: None)[:12]
  draft_tokens = (data_lib.frequent_tokens(windows, 48, 512)
                  if head.get("draft_vocab_size") else None)
  drafter = distill_heads.build_head(cfg, target, draft_tokens)
  loss_fn = jax.jit(distill_heads.make_loss_fn(drafter, target.config, cfg["train"]))
  feats = features_lib.precompute(target, windows, drafter.target_layers, batch=5)
  assert feats.hidden.shape == windows.shape + (target.config.hidden_size,)
  assert len(feats.layer_hidden) == len(drafter.target_layers)
  idx = np.array([7, 2, 11, 0])
  key = jax.random.key(3)
  online, m_online = loss_fn(drafter.params, target.params, windows[idx], key)
  offline, m_offline = loss_fn(drafter.params, target.params, windows[idx], key, feats.rows(idx))
  # Bit-equal on the CPU that wrote this (one function of one hidden state); rtol leaves room
  # for another CPU's fusion. Other windows move the loss by 3-8 %.
  np.testing.assert_allclose(float(offline), float(online), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(m_offline["agree"]), np.asarray(m_online["agree"]))
  other, _ = loss_fn(drafter.params, target.params, windows[idx], key,
                     feats.rows((idx + 1) % len(windows)))
  assert abs(float(other) - float(online)) > 1e-3 * abs(float(online))   # 100x the tolerance


def test_a_run_with_precomputed_features_trains_as_the_online_one(tmp_path):
  """train.precompute_features: the same steps, the same losses and heads (up to float
  rounding) as a run whose every step runs the target; killed and resumed, it precomputes
  again and ends where the straight run does."""
  common = dict(head={"kind": "eagle3", "num_draft": 2, "draft_vocab_size": 48},
                train={"steps": 6, "ttt_steps": 2, "checkpoint_every": 3})
  online = distill_heads.main(["--config", str(write_config(tmp_path / "a", **common))])
  path = write_config(tmp_path / "b", **common)
  first = distill_heads.main(["--config", str(path), "--set", "train.precompute_features=true",
                              "--set", "train.stop_after=3"])
  assert first["stopped"]
  offline = distill_heads.main(["--config", str(path), "--set",
                                "train.precompute_features=true"])
  assert offline["start_step"] == 3
  losses_a = json.loads((tmp_path / "a" / "run" / "losses.json").read_text())["losses"]
  losses_b = json.loads((tmp_path / "b" / "run" / "losses.json").read_text())["losses"]
  assert losses_a.keys() == losses_b.keys() and len(losses_a) == 6
  np.testing.assert_allclose([losses_b[k] for k in losses_a], list(losses_a.values()),
                             rtol=1e-5)
  for a, b in zip(jax.tree.leaves(online["params"]), jax.tree.leaves(offline["params"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
  with pytest.raises(ValueError, match="train.precompute_features must be true or false"):
    load_config(path, ["train.precompute_features=1"])


def test_frequent_tokens_fill_with_unused_ids():
  from train.data import frequent_tokens
  windows = np.array([[5, 5, 5, 9, 9, 2], [9, 7, 7, 7, 7, 5]])
  assert frequent_tokens(windows, 2, 10).tolist() == [5, 7]        # 7 x4, 5 x4 (lower id), 9 x3
  assert frequent_tokens(windows, 3, 10).tolist() == [5, 7, 9]
  assert frequent_tokens(windows, 6, 10).tolist() == [0, 1, 2, 5, 7, 9]   # four seen; 0, 1 fill
  with pytest.raises(ValueError, match=r"draft_vocab_size=11 must lie in \[1, 10\]"):
    frequent_tokens(windows, 11, 10)


def test_config_errors(tmp_path):
  path = write_config(tmp_path)
  raw = yaml.safe_load(path.read_text())
  raw["train"]["stepz"] = 3
  path.write_text(yaml.safe_dump(raw))
  with pytest.raises(ValueError, match="unknown config key 'train.stepz'"):
    load_config(path)
  path = write_config(tmp_path)
  with pytest.raises(ValueError, match="dotted.key=value"):
    distill_heads.main(["--config", str(path), "--set", "train.steps"])
  with pytest.raises(ValueError, match="unknown key 'train.nope'"):
    load_config(path, ["train.nope=1"])
  with pytest.raises(ValueError, match="unknown head kind 'hydra'"):
    load_config(path, ["head.kind=hydra"])
  with pytest.raises(ValueError, match="evaluation only"):
    load_config(path, ["data.dev_path=../shared/data/tinystories/heldout.txt"])
  with pytest.raises(ValueError, match="is a section"):
    load_config(path, ["train=3"])
  with pytest.raises(ValueError, match="ttt_steps applies to EAGLE"):
    load_config(path, ["train.ttt_steps=2"])
  with pytest.raises(ValueError, match="draft_vocab_size applies to EAGLE-3 heads, not medusa"):
    load_config(path, ["head.draft_vocab_size=64"])
  with pytest.raises(ValueError, match="draft_vocab_size must be None or an integer >= 1"):
    load_config(path, ["head.kind=eagle3", "head.draft_vocab_size=0"])
  # Evaluation data as training text, by name, by content or as the evaluation's own file.
  heldout = SHARED / "data" / "tinystories" / "heldout.txt"
  (tmp_path / "split.txt").write_bytes(heldout.read_bytes())
  dev = SHARED / "data" / "tinystories" / "dev.txt"
  for sets in ([f"data.dev_path={tmp_path / 'split.txt'}"],
               [f"data.dev_path={dev}", f"eval.path={dev}", "eval.enabled=true"]):
    with pytest.raises(ValueError, match="is the evaluation text"):
      load_config(path, sets)
  with pytest.raises(ValueError, match="looks like evaluation data"):
    load_config(path, [f"data.dev_path={SHARED / 'data' / 'prompts' / 'mt_bench.jsonl'}"])
  with pytest.raises(ValueError, match="data.dev_path .* is not a file"):
    load_config(path, [f"data.dev_path={tmp_path / 'dev.tx'}"])
  with pytest.raises(ValueError, match="eval.path .* is not a file"):
    load_config(path, ["eval.enabled=true", f"eval.path={tmp_path / 'heldout.tx'}"])
  # Another kind's head options (ignored before: an EAGLE head built with one layer anyway).
  with pytest.raises(ValueError, match="head.num_layers applies to DFlash / DSpark heads, not EAGLE"):
    load_config(path, ["head.kind=eagle", "head.num_layers=3"])
  with pytest.raises(ValueError, match="head.medusa_layers applies to Medusa heads, not EAGLE"):
    load_config(path, ["head.kind=eagle", "head.medusa_layers=3"])
  # Evaluation settings checked before training (they failed after it, losing the table).
  with pytest.raises(ValueError, match="Medusa heads cannot build draft trees"):
    load_config(path, ['eval.trees=["2,2,4"]'])
  with pytest.raises(ValueError, match="2 Medusa heads draft at most 2 tokens"):
    load_config(path, ["eval.num_draft=6"])
  with pytest.raises(ValueError, match="eval.num_draft must be an integer >= 1"):
    load_config(path, ["eval.num_draft=0"])
  # Numbers: checked, and YAML 1.1's text "1e-3" read as the number it spells.
  assert load_config(path, ["train.lr=1e-3"])["train"]["lr"] == 1e-3
  assert load_config(path, ["data.temperatures=0.7"])["data"]["temperatures"] == [0.7]
  with pytest.raises(ValueError, match="train.lr must be a number > 0"):
    load_config(path, ["train.lr=-1"])
  with pytest.raises(ValueError, match="train.warmup_steps must be an integer >= 0"):
    load_config(path, ["train.warmup_steps=-5"])
  with pytest.raises(ValueError, match="eval.temperatures.0 must be a number >= 0"):
    load_config(path, ["eval.temperatures=[hot]"])
  with pytest.raises(SystemExit):
    distill_heads.main([])                     # argparse: --config is required
  assert parse_set("eval.temperatures=[0, 1]") == (["eval", "temperatures"], [0, 1])


def test_the_generated_source_takes_its_own_temperatures(tmp_path, monkeypatch):
  """data.gen_temperatures: the generated source's temperatures (None: data.temperatures), in
  its cache key; with regenerate at [0, 1] and generated at [1, 0], each paragraph gets the
  temperature it did not get in the other source (rows that add data, not repeats)."""
  from train import data as data_lib
  calls = []

  def fake_generate(target, prompts, gen_tokens, temperatures, batch, seed, log):
    calls.append(list(temperatures))
    return [list(p) + [7] * gen_tokens for p in prompts]

  monkeypatch.setattr(data_lib, "generate_sequences", fake_generate)
  target = sj.load(need_shared("models", "stories260K"))
  base = {"sources": ["generated"], "num_prompts": 4, "gen_tokens": 8,
          "temperatures": [0.0, 1.0]}
  for gen_temps, want in ((None, [0.0, 1.0]), ([1.0, 0.0], [1.0, 0.0])):
    cfg = load_config(write_config(tmp_path, data=dict(base, gen_temperatures=gen_temps)))
    data_lib.build_windows(target, cfg["data"], "sha", 0, lambda m: None)
    assert calls[-1] == want
  assert len(calls) == 2                          # the second did not read the first's cache
  assert len(list((tmp_path / "cache").glob("generated_*.npz"))) == 2


def test_a_config_states_only_what_it_changes_over_its_base(tmp_path):
  """`base:` merges a config under another (mappings key by key, lists replaced); the shipped
  long-budget configs equal the shipped ones with their overrides set."""
  root = pathlib.Path(__file__).resolve().parents[1] / "configs"
  for kind in ("dflash", "dspark"):
    sets = [f"out_dir=runs/{kind}12k", "data.sources=[text, generated]", "data.num_prompts=3441",
            "data.gen_tokens=96", "data.gen_temperatures=[1.0, 0.0]", "train.steps=12000"]
    assert load_config(root / f"distill_{kind}_long.yaml") == load_config(
        root / f"distill_{kind}.yaml", sets)
  (tmp_path / "a.yaml").write_text("base: b.yaml\n")
  (tmp_path / "b.yaml").write_text("base: a.yaml\n")
  with pytest.raises(ValueError, match="cycle of configs"):
    load_config(tmp_path / "a.yaml")
  (tmp_path / "c.yaml").write_text("base: missing.yaml\n")
  with pytest.raises(ValueError, match="cannot read config"):
    load_config(tmp_path / "c.yaml")
  (tmp_path / "d.yaml").write_text("base: 3\n")
  with pytest.raises(ValueError, match="base must be a config's path"):
    load_config(tmp_path / "d.yaml")


def test_a_killed_run_keeps_its_losses_up_to_the_last_checkpoint(tmp_path, monkeypatch):
  """losses.json was written only after the loop: a run killed (not stop_after) past a
  checkpoint lost those steps' losses, and the resumed run's file began at the checkpoint."""
  from train import data as data_lib
  path = write_config(tmp_path, train={"steps": 6, "checkpoint_every": 2})
  real = data_lib.batch_indices

  def killed_at_step_5(n, batch, seed, step):
    if step == 4:
      raise KeyboardInterrupt("killed")
    return real(n, batch, seed, step)

  monkeypatch.setattr(data_lib, "batch_indices", killed_at_step_5)
  with pytest.raises(KeyboardInterrupt):
    distill_heads.main(["--config", str(path)])
  losses = tmp_path / "run" / "losses.json"
  assert list(json.loads(losses.read_text())["losses"]) == ["1", "2", "3", "4"]
  monkeypatch.setattr(data_lib, "batch_indices", real)
  assert distill_heads.main(["--config", str(path)])["start_step"] == 4
  assert list(json.loads(losses.read_text())["losses"]) == [str(s) for s in range(1, 7)]
