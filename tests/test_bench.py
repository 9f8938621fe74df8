"""python -m spec_jax.bench: runs the entry point on tiny random models and checks the JSON.

No assertion here looks at a timing: only the schema, the bookkeeping (K=0 speedup 1, the bound
and efficiency formulas, one row per configuration) and the option handling.
"""

import gzip
import json
import math

import jax
import pytest

import spec_jax as sj
from spec_jax import bench

from .conftest import need_shared

ROW_FIELDS = {"target", "drafter", "K", "batch", "temperature", "max_new_tokens", "tokens_per_s",
              "speedup", "alpha", "tau", "c_draft", "c_verify", "bound", "efficiency",
              "t_target_1_ms", "t_verify_ms", "t_draft_round_ms", "noise_pct", "capacity"}


def test_spec_suite_tiny_writes_consistent_json(tmp_path, capsys):
  out = tmp_path / "spec.json"
  rc = bench.main(["--pairs", "random:tiny@ngram", "random:tiny@draft:random:tiny-draft",
                   "-K", "1", "-B", "1", "--max-new-tokens", "8", "--repeats", "1",
                   "--cost-repeats", "1", "--temperatures", "0", "--out", str(out)])
  assert rc == 0
  data = json.loads(out.read_text())
  assert data["suite"] == "spec" and data["schema_version"] == bench.SCHEMA_VERSION
  assert set(bench.SPEC_DEFINITIONS) <= set(data["definitions"])
  rows = data["rows"]
  assert sorted((r["drafter"], r["K"]) for r in rows) == [
      ("draft:random:tiny-draft", 1), ("ngram", 1), ("none", 0)]
  for r in rows:
    assert ROW_FIELDS <= set(r), ROW_FIELDS - set(r)
    assert r["batch"] == 1 and r["temperature"] == 0.0 and r["max_new_tokens"] == 8
    assert set(r["tokens_per_s"]) >= {"median", "min", "max", "n"}
    assert r["tokens_per_s"]["min"] <= r["tokens_per_s"]["median"] <= r["tokens_per_s"]["max"]
    assert r["bound"] > 0 and r["efficiency"] > 0 and r["speedup"] > 0
    if r["K"] == 0:
      assert r["speedup"] == 1.0 and r["alpha"] is None and r["tau"] == 1.0
      assert r["c_draft"] == 0.0 and r["c_verify"] == 1.0 and r["bound"] == 1.0
      assert r["tokens_per_s"]["n"] == 2  # plain runs at the start and the end of the round
    else:
      assert 0.0 <= r["alpha"] <= 1.0 and 1.0 <= r["tau"] <= r["K"] + 1
      assert r["c_draft"] > 0 and r["c_verify"] > 0
      # alpha and tau are those of an independent sj.generate run of the same pair: the bench's
      # random target and drafter, its seeded prompt, greedy, K = 1, 8 new tokens.
      target = bench.load_model("random:tiny", 0)
      drafter = bench.make_drafter(r["drafter_spec"], target, 0)
      ids, _ = bench.prompt_token_lists(target, "tinystories", 1, 8, 128, 0)
      ref = sj.generate(target, ids, drafter=drafter, num_draft=1, max_new_tokens=8,
                        sampling=sj.Sampling(0.0), key=jax.random.key(0), stop_tokens=[]).stats
      assert r["tau"] == pytest.approx(ref.mean_accepted_length)
      assert r["alpha"] == pytest.approx(ref.acceptance_rate)
  assert len(data["baselines"]) == 1 and "noise_pct" in data["baselines"][0]
  verdicts = {v["drafter"]: v for v in data["verdicts"]}
  assert set(verdicts) == {"ngram", "draft:random:tiny-draft"}
  for v in verdicts.values():
    (p,) = v["per_batch"]
    assert p["batch"] == 1 and p["best_K"] == 1 and isinstance(p["beats_plain"], bool)
  printed = capsys.readouterr().out
  assert "legend" in printed and printed.count("verdict ") == 2
  assert data["table"] in printed
  assert data["partial"] is False

  # --resume keeps the finished cells of a partial file written with the same options.
  data["partial"] = True
  out.write_text(json.dumps(data))
  argv = ["--pairs", "random:tiny@ngram", "random:tiny@draft:random:tiny-draft", "-K", "1", "-B",
          "1", "--max-new-tokens", "8", "--repeats", "1", "--cost-repeats", "1",
          "--temperatures", "0", "--out", str(out), "--resume"]
  assert bench.main(argv) == 0
  again = json.loads(out.read_text())
  assert again["rows"] == rows and again["partial"] is False


def test_plain_suite_tiny(tmp_path):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  out = tmp_path / "plain.json"
  rc = bench.main(["--suite", "plain", "--plain-models", "random:tiny", "--plain-batch", "1", "2",
                   "--plain-max-new-tokens", "6", "--repeats", "1", "--cost-repeats", "1",
                   "--fills", "16", "--max-verify-tokens", "2", "--out", str(out)])
  assert rc == 0
  data = json.loads(out.read_text())
  assert data["suite"] == "plain"
  gen = data["generate"]
  assert [r["batch"] for r in gen] == [1, 2]
  for r in gen:
    assert r["greedy_match"] is True, r  # same weights, same greedy tokens as transformers
    assert r["params"] == r["hf_params"]
    assert r["max_new_tokens"] == 6
  cost = data["cost"]
  assert [(r["fill"], r["T"]) for r in cost] == [(16, 1), (16, 2)]
  assert cost[0]["c"] == 1.0 and cost[0]["c_call"] == 1.0 and cost[1]["capacity"] == 32


def test_config_file_and_quick(tmp_path):
  cfg = tmp_path / "b.yaml"
  cfg.write_text("num-draft: [3, 5]\nbatch: 2\ntemperatures: [0, 0.5]\nmax_new_tokens: 40\n"
                 "pairs:\n  - random:tiny@ngram\n  - {target: random:tiny, drafter: ngram:2}\n")
  args = bench.parse_args(["--config", str(cfg), "--repeats", "4"])
  assert args.num_draft == [3, 5] and args.batch == [2] and args.temperatures == [0.0, 0.5]
  assert args.max_new_tokens == 40 and args.repeats == 4
  assert bench.parse_pairs(args.pairs) == [("random:tiny", "ngram"), ("random:tiny", "ngram:2")]
  args = bench.parse_args(["--config", str(cfg), "--max-new-tokens", "9"])  # flags win
  assert args.max_new_tokens == 9
  quick = bench.parse_args(["--quick"])
  assert quick.num_draft == [2, 4] and quick.batch == [1, 4] and quick.max_new_tokens == 32
  assert quick.repeats == 2
  assert len(bench.parse_pairs(["default"])) == 3
  bad = tmp_path / "bad.yaml"
  bad.write_text("no_such_flag: 1\n")
  assert bench.main(["--config", str(bad)]) == 2
  with pytest.raises(ValueError, match="TARGET@DRAFTER"):
    bench.parse_pairs(["stories260K"])


def test_default_config_file_parses():
  args = bench.parse_args(["--config", str(bench.ROOT / "configs" / "bench_default.yaml")])
  assert args.suite == "spec" and bench.parse_pairs(args.pairs)


def test_prompt_readers(tmp_path):
  (tmp_path / "mt.jsonl").write_text(json.dumps({"turns": ["first turn", "second"]}) + "\n" +
                                     json.dumps({"question": "a question"}) + "\n")
  with gzip.open(tmp_path / "he.jsonl.gz", "wt") as f:
    f.write(json.dumps({"prompt": "def f():"}) + "\n")
  assert bench.read_prompt_texts(str(tmp_path / "mt.jsonl")) == ["first turn", "a question"]
  assert bench.read_prompt_texts(str(tmp_path / "he.jsonl.gz")) == ["def f():"]
  (tmp_path / "s.txt").write_text("one two three four five\n\nsix seven\n\nnine ten eleven twelve")
  assert bench.read_prompt_texts(str(tmp_path / "s.txt"), words=3) == [
      "one two three", "nine ten eleven"]
  (tmp_path / "bad.jsonl").write_text(json.dumps({"other": 1}) + "\n")
  with pytest.raises(ValueError, match="no 'turns'"):
    bench.read_prompt_texts(str(tmp_path / "bad.jsonl"))


def test_real_prompt_sets_read():
  for name in ("spec_bench", "mt_bench", "humaneval", "gsm8k"):
    need_shared("data", "prompts")
    texts = bench.read_prompt_texts(name)
    assert len(texts) > 50 and all(isinstance(t, str) and t for t in texts)
  need_shared("data", "tinystories", "heldout.txt")
  openings = bench.read_prompt_texts("tinystories", words=8)
  assert len(openings) > 16 and all(len(o.split()) == 8 for o in openings)


def test_breakdown_suite_tiny(tmp_path):
  out = tmp_path / "bd.json"
  rc = bench.main(["--suite", "breakdown", "--pairs", "random:tiny@ngram", "-K", "1", "-B", "1",
                   "--max-new-tokens", "8", "--repeats", "1", "--cost-repeats", "1",
                   "--temperatures", "0", "--out", str(out)])
  assert rc == 0
  rows = json.loads(out.read_text())["rows"]
  assert [(r["drafter"], r["K"]) for r in rows] == [("none", 0), ("ngram", 1)]
  r = rows[1]
  assert min(r["t_propose_ms"], r["t_verify_step_ms"], r["t_accept_ms"]) > 0
  assert r["t_round_ms"] > r["t_verify_step_ms"]
  assert math.isclose(r["efficiency_loop"],
                      r["eff_spec_overhead_factor"] * r["eff_plain_overhead_factor"])


def test_bound_on_hand_values():
  """bound = tau / (K c_draft + c_verify); with c_verify = 1 it is Leviathan et al.'s
  (1 - a^(K+1)) / ((1 - a)(K c + 1)). Values worked out by hand."""
  assert bench.bound_of(3.0, 2, 0.25, 1.5) == pytest.approx(1.5)
  assert bench.bound_of(1.0, 0, 0.0, 1.0) == 1.0
  # a = 0.5, K = 2, c = 0.1: tau = 1 + 0.5 + 0.25 = 1.75, bound = 1.75 / 1.2.
  assert bench.bound_of(1.75, 2, 0.1, 1.0) == pytest.approx(1.4583333333)


def test_spec_stats_alpha_token_inverts_tau():
  """SpecStats.alpha_token solves tau = (1 - a^(K+1)) / (1 - a): hand values and edges."""
  from spec_jax.stats import SpecStats, alpha_from_tau
  assert alpha_from_tau(1.75, 2) == pytest.approx(0.5, abs=1e-12)       # 1 + .5 + .25
  assert alpha_from_tau(1.0, 4) == 0.0 and alpha_from_tau(5.0, 4) == 1.0
  assert alpha_from_tau(2.0, 1) == 1.0 and alpha_from_tau(1.5, 1) == pytest.approx(0.5)
  # 10 rounds of K = 2 that emitted 17 tokens: tau 1.7, a solves 1 + a + a^2 = 1.7.
  s = SpecStats.from_counts(rounds=[10], drafted=[20], accepted=[7], accepted_at=[[5, 2]],
                            seconds=1.0, new_tokens=18, iterations=10, num_draft=2,
                            emitted=[17])
  assert s.mean_accepted_length == pytest.approx(1.7)
  assert s.alpha_token == pytest.approx((-1 + math.sqrt(1 + 4 * 0.7)) / 2)
  none = SpecStats.from_counts(rounds=[0], drafted=[0], accepted=[0], accepted_at=[[0, 0]],
                               seconds=1.0, new_tokens=1, iterations=0, num_draft=2, emitted=[0])
  assert (none.mean_accepted_length, none.acceptance_rate, none.alpha_token) == (1.0, 0.0, 0.0)


def test_alpha_per_verified_token():
  from spec_jax.stats import SpecStats
  s = SpecStats.from_counts(rounds=[10], drafted=[20], accepted=[12], accepted_at=[[7, 5]],
                            seconds=1.0, new_tokens=22, iterations=10, num_draft=2)
  assert s.acceptance_rate == 12 / 20                       # counts never-judged drafts
  assert math.isclose(bench.alpha_per_verified_token(s), 12 / (12 + 5))  # 5 rounds rejected
  k1 = SpecStats.from_counts(rounds=[10], drafted=[10], accepted=[6], accepted_at=[[6]],
                             seconds=1.0, new_tokens=16, iterations=10, num_draft=1)
  assert math.isclose(bench.alpha_per_verified_token(k1), k1.acceptance_rate)
  short = SpecStats.from_counts(rounds=[10], drafted=[15], accepted=[5], accepted_at=[[4, 1]],
                                seconds=1.0, new_tokens=15, iterations=10, num_draft=2)
  assert bench.alpha_per_verified_token(short) is None      # an n-gram round drafted < K
