"""python -m spec_jax.bench: runs the entry point on tiny random models and checks the JSON.

No assertion here looks at a measured timing: only the schema, the bookkeeping (K=0 speedup 1,
one row per configuration), the option handling, and the derived fields (speedup, bound,
efficiency, breakdown) computed from hand-picked inputs with their values worked out by hand.
"""

import dataclasses
import gzip
import json
import math

import numpy as np
import pytest

import spec_jax as sj
from spec_jax import timing
from spec_jax.bench import cli, metrics, report
from spec_jax.bench.definitions import SPEC_DEFINITIONS
from spec_jax.bench.prompts import read_prompt_texts
from spec_jax.bench.results import ROOT, SCHEMA_VERSION, cpu_info, describe_cpu
from spec_jax.bench.specs import parse_pairs
from spec_jax.bench.suites.breakdown import breakdown_row
from spec_jax.bench.suites.spec import spec_row
from spec_jax.stats import SpecStats

from .conftest import need_shared

ROW_FIELDS = {"target", "drafter", "K", "batch", "temperature", "max_new_tokens", "tokens_per_s",
              "speedup", "alpha", "tau", "c_draft", "c_verify", "bound", "efficiency",
              "t_target_1_ms", "t_verify_ms", "t_draft_round_ms", "noise_pct", "capacity"}


def test_spec_suite_tiny_writes_consistent_json(tmp_path, capsys):
  out = tmp_path / "spec.json"
  rc = cli.main(["--pairs", "random:tiny@ngram", "random:tiny@draft:random:tiny-draft",
                   "-K", "1", "-B", "1", "--max-new-tokens", "8", "--repeats", "1",
                   "--cost-repeats", "1", "--temperatures", "0", "--out", str(out)])
  assert rc == 0
  data = json.loads(out.read_text())
  assert data["suite"] == "spec" and data["schema_version"] == SCHEMA_VERSION
  assert set(SPEC_DEFINITIONS) <= set(data["definitions"])
  rows = data["rows"]
  assert sorted((r["drafter"], r["K"]) for r in rows) == [
      ("draft:random:tiny-draft", 1), ("ngram", 1), ("none", 0)]
  for r in rows:
    assert ROW_FIELDS <= set(r), ROW_FIELDS - set(r)
    assert r["batch"] == 1 and r["temperature"] == 0.0 and r["max_new_tokens"] == 8
    assert set(r["tokens_per_s"]) >= {"median", "min", "max", "n"}
    assert r["tokens_per_s"]["min"] <= r["tokens_per_s"]["median"] <= r["tokens_per_s"]["max"]
    if r["K"] == 0:
      assert r["speedup"] == 1.0 and r["alpha"] is None and r["tau"] == 1.0
      assert r["c_draft"] == 0.0 and r["c_verify"] == 1.0 and r["bound"] == 1.0
      assert r["tokens_per_s"]["n"] == 2  # plain runs at the start and the end of the round
    else:
      assert 0.0 <= r["alpha"] <= 1.0 and 1.0 <= r["tau"] <= r["K"] + 1
      assert r["c_draft"] > 0 and r["c_verify"] > 0 and r["speedup"] > 0
  assert len(data["baselines"]) == 1 and "noise_pct" in data["baselines"][0]
  verdicts = {v["drafter"]: v for v in data["verdicts"]}
  assert set(verdicts) == {"ngram", "draft:random:tiny-draft"}
  for v in verdicts.values():
    (p,) = v["per_batch"]
    assert p["batch"] == 1 and p["best_K"] == 1 and isinstance(p["beats_plain"], bool)
  printed = capsys.readouterr().out
  assert "legend" in printed and printed.count("verdict ") == 2
  assert data["table"] in printed
  # The host's CPU is recorded and named: speedups move with its bf16 kernels.
  assert set(data["machine"]["cpu"]) == {"model", "features"}
  assert f"s on {describe_cpu(data['machine'])}; JSON" in printed
  assert data["partial"] is False

  # --resume keeps the finished cells of a partial file written with the same options.
  data["partial"] = True
  out.write_text(json.dumps(data))
  argv = ["--pairs", "random:tiny@ngram", "random:tiny@draft:random:tiny-draft", "-K", "1", "-B",
          "1", "--max-new-tokens", "8", "--repeats", "1", "--cost-repeats", "1",
          "--temperatures", "0", "--out", str(out), "--resume"]
  assert cli.main(argv) == 0
  again = json.loads(out.read_text())
  assert again["rows"] == rows and again["partial"] is False


def test_cpu_model_and_features_are_read_from_cpuinfo():
  x86 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14\n"
         "flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 amx_tile\n\nprocessor\t: 1\n"
         "model name\t: AMD EPYC 9R14\nflags\t\t: fpu sse2 avx2\n")
  assert cpu_info(x86) == {"model": "AMD EPYC 9R14",
                           "features": ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"]}
  assert (describe_cpu({"cpu": cpu_info(x86)})
          == "AMD EPYC 9R14; avx2 fma avx512f avx512_bf16 amx_tile")
  arm = "processor\t: 0\nFeatures\t: fp asimd aes sve bf16 i8mm\nCPU part\t: 0xd40\n"
  assert cpu_info(arm)["features"] == ["asimd", "sve", "bf16", "i8mm"]
  avx2_only = "model name\t: AMD EPYC 7B12\nflags\t\t: sse2 avx avx2 fma\n"
  assert describe_cpu({"cpu": cpu_info(avx2_only)}) == "AMD EPYC 7B12; avx2 fma"
  assert describe_cpu({"platform": "Linux"}) == "CPU model not recorded"   # older runs
  assert set(cpu_info()) == {"model", "features"}                          # this host


def test_spec_suite_governor_column_and_mixed_prompts(tmp_path, monkeypatch, capsys):
  """-K 1 auto: the governor is one more row per drafter, with its K histogram, cost table and
  share of the best fixed K; --prompts mixed gives half random-token rows. The cost table's
  timing is replaced by fixed numbers (calibration is tested in tests/test_governor.py)."""
  from spec_jax.decoding import calibration
  from spec_jax.bench.prompts import prompt_token_lists
  from spec_jax.bench.specs import load_model
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  calibration.clear_memory()
  measured = []

  def fake_measure(target, drafter, batch, capacity, greedy, ks, repeats=3, **kw):
    measured.append(capacity)
    return {k: {"per_iter_s": 1e-3 * (1 + 0.2 * k), "spread_pct": 0.0} for k in ks}
  monkeypatch.setattr(calibration, "measure_round_costs", fake_measure)
  out = tmp_path / "gov.json"
  rc = cli.main(["--pairs", "random:tiny@ngram", "-K", "1", "auto", "-B", "2",
                 "--max-new-tokens", "8", "--repeats", "1", "--cost-repeats", "1",
                 "--temperatures", "0", "--prompts", "mixed", "--out", str(out)])
  assert rc == 0
  data = json.loads(out.read_text())
  rows = {r["K"]: r for r in data["rows"]}
  assert set(rows) == {0, 1, "auto"}
  auto = rows["auto"]
  assert sum(auto["k_histogram"].values()) == auto["iterations"] > 0
  assert auto["best_fixed_K"] == 1 and auto["share_of_best_fixed"] == pytest.approx(
      auto["speedup"] / rows[1]["speedup"])
  assert auto["governor_costs"]["ks"] == [0, 1, 2, 4, 6, 8]
  assert len(measured) == 1, measured     # the bench's table is the one generate() runs with
  assert auto["bound"] is None and auto["c_verify"] is None
  (g,) = data["governor"]
  assert g["batch"] == 2 and g["k_histogram"] == auto["k_histogram"]
  assert "governor random:tiny + ngram T=0 B=2" in capsys.readouterr().out
  ids, _ = prompt_token_lists(load_model("random:tiny"), "mixed", 4, 8, 128, 0)
  assert len(ids) == 4 and ids[0] != ids[1] and len(ids[0]) == len(ids[1])
  assert cli.parse_args(["-K", "2", "auto"]).num_draft == [2, "auto"]
  calibration.clear_memory()


def test_plain_suite_tiny(tmp_path):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  out = tmp_path / "plain.json"
  rc = cli.main(["--suite", "plain", "--plain-models", "random:tiny", "--plain-batch", "1", "2",
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
  args = cli.parse_args(["--config", str(cfg), "--repeats", "4"])
  assert args.num_draft == [3, 5] and args.batch == [2] and args.temperatures == [0.0, 0.5]
  assert args.max_new_tokens == 40 and args.repeats == 4
  assert parse_pairs(args.pairs) == [("random:tiny", "ngram"), ("random:tiny", "ngram:2")]
  args = cli.parse_args(["--config", str(cfg), "--max-new-tokens", "9"])  # flags win
  assert args.max_new_tokens == 9
  quick = cli.parse_args(["--quick"])
  assert quick.num_draft == [2, 4] and quick.batch == [1, 4] and quick.max_new_tokens == 32
  assert quick.repeats == 2
  assert len(parse_pairs(["default"])) == 3
  bad = tmp_path / "bad.yaml"
  bad.write_text("no_such_flag: 1\n")
  assert cli.main(["--config", str(bad)]) == 2
  with pytest.raises(ValueError, match="TARGET@DRAFTER"):
    parse_pairs(["stories260K"])


@pytest.mark.parametrize("name", ["bench_default.yaml", "bench_widened.yaml"])
def test_config_files_parse(name):
  args = cli.parse_args(["--config", str(ROOT / "configs" / name)])
  assert args.suite == "spec" and parse_pairs(args.pairs)


def test_prompt_readers(tmp_path):
  (tmp_path / "mt.jsonl").write_text(json.dumps({"turns": ["first turn", "second"]}) + "\n" +
                                     json.dumps({"question": "a question"}) + "\n")
  with gzip.open(tmp_path / "he.jsonl.gz", "wt") as f:
    f.write(json.dumps({"prompt": "def f():"}) + "\n")
  assert read_prompt_texts(str(tmp_path / "mt.jsonl")) == ["first turn", "a question"]
  assert read_prompt_texts(str(tmp_path / "he.jsonl.gz")) == ["def f():"]
  (tmp_path / "s.txt").write_text("one two three four five\n\nsix seven\n\nnine ten eleven twelve")
  assert read_prompt_texts(str(tmp_path / "s.txt"), words=3) == [
      "one two three", "nine ten eleven"]
  (tmp_path / "bad.jsonl").write_text(json.dumps({"other": 1}) + "\n")
  with pytest.raises(ValueError, match="no 'turns'"):
    read_prompt_texts(str(tmp_path / "bad.jsonl"))


def test_real_prompt_sets_read():
  for name in ("spec_bench", "mt_bench", "humaneval", "gsm8k"):
    need_shared("data", "prompts")
    texts = read_prompt_texts(name)
    assert len(texts) > 50 and all(isinstance(t, str) and t for t in texts)
  need_shared("data", "tinystories", "heldout.txt")
  openings = read_prompt_texts("tinystories", words=8)
  assert len(openings) > 16 and all(len(o.split()) == 8 for o in openings)


def test_breakdown_suite_tiny(tmp_path):
  out = tmp_path / "bd.json"
  rc = cli.main(["--suite", "breakdown", "--pairs", "random:tiny@ngram", "-K", "1", "-B", "1",
                   "--max-new-tokens", "8", "--repeats", "1", "--cost-repeats", "1",
                   "--temperatures", "0", "--out", str(out)])
  assert rc == 0
  rows = json.loads(out.read_text())["rows"]
  assert [(r["drafter"], r["K"]) for r in rows] == [("none", 0), ("ngram", 1)]
  assert rows[0]["tau"] == 1.0 and "speedup_loop" not in rows[0]
  r = rows[1]
  # Times come from differencing (t(2n) - t(n)) / n, which load on a shared machine can push
  # below zero: only that a time was measured is checked here, never its value.
  assert 1.0 <= r["tau"] <= 2.0 and r["iterations"] >= 1
  if r.get("unresolved"):          # the round's difference came out <= 0: no speedup from it
    assert r["t_round_ms"] is None and "speedup_loop" not in r
  else:
    assert math.isfinite(r["t_round_ms"]) and r["t_round_ms"] > 0
    assert {"speedup_loop", "bound", "efficiency_loop", "t_other_ms"} <= set(r)
  assert r["tau_loop"] == rows[0]["iterations"] / r["iterations"]


def test_alpha_per_verified_token():
  from spec_jax.stats import SpecStats
  s = SpecStats.from_counts(rounds=[10], drafted=[20], accepted=[12], accepted_at=[[7, 5]],
                            seconds=1.0, new_tokens=22, iterations=10, num_draft=2)
  assert s.acceptance_rate == 12 / 20                       # counts never-judged drafts
  assert math.isclose(metrics.alpha_per_verified_token(s), 12 / (12 + 5))  # 5 rounds rejected
  k1 = SpecStats.from_counts(rounds=[10], drafted=[10], accepted=[6], accepted_at=[[6]],
                             seconds=1.0, new_tokens=16, iterations=10, num_draft=1)
  assert math.isclose(metrics.alpha_per_verified_token(k1), k1.acceptance_rate)
  short = SpecStats.from_counts(rounds=[10], drafted=[15], accepted=[5], accepted_at=[[4, 1]],
                                seconds=1.0, new_tokens=15, iterations=10, num_draft=2)
  assert metrics.alpha_per_verified_token(short) is None      # an n-gram round drafted < K
  # With the engine's count of rejections the estimate needs no full rounds.
  counted = dataclasses.replace(short, rejected=3)
  assert math.isclose(metrics.alpha_per_verified_token(counted), 5 / (5 + 3))
  tree = dataclasses.replace(counted, tree=(2, 2, 4, "topk"))
  assert metrics.alpha_per_verified_token(tree) is None       # no i.i.d. chain describes it


def _timer(samples):
  return {"samples": samples, "per_iter_s": sorted(samples)[len(samples) // 2],
          "spread_pct": 0.0}


def test_spec_row_from_known_inputs():
  meta = {"target": "t", "target_spec": "random:tiny", "target_params": 100, "batch": 2,
          "temperature": 0.0, "max_new_tokens": 8, "prompt_tokens_longest": 10, "cost_fill": 14,
          "cost_capacity": 64}
  # 10 rounds of K=4: 30 accepted, position 4 accepted in 4 rounds -> 6 rounds had a rejection.
  spec = SpecStats.from_counts(rounds=[10], drafted=[40], accepted=[30],
                               accepted_at=[[10, 9, 7, 4]], seconds=0.5, new_tokens=40,
                               iterations=10, num_draft=4)
  plain = SpecStats.from_counts(rounds=[8], drafted=[0], accepted=[0], accepted_at=[],
                                seconds=1.0, new_tokens=16, iterations=8, num_draft=0)
  base = timing.summarize([50.0, 50.0])
  t1 = _timer([1e-3, 2e-3, 1e-3])
  tv = _timer([1.5e-3, 3e-3, 1.5e-3])                       # 1.5x t1 in every round
  td = {"per_round_s": 0.5e-3, "c_draft": 0.125, "propose_s": 0.6e-3, "c_propose": 0.25}
  r = spec_row(meta, "ngram", 4, [spec, spec, spec], [90.0, 110.0, 100.0], base, t1, tv, td)
  assert r["tau"] == 4.0 and r["alpha"] == 0.75
  assert math.isclose(r["alpha_token"], 30 / 36)
  assert r["speedup"] == 2.0                               # median 100 tok/s over 50
  assert math.isclose(r["c_verify"], 1.5) and r["c_verify_rounds_min_max"] == [1.5, 1.5]
  assert math.isclose(r["bound"], 2.0)                     # 4 / (4 * 0.125 + 1.5)
  assert math.isclose(r["efficiency"], 1.0)
  assert math.isclose(r["bound_propose"], 1.6)             # 4 / (4 * 0.25 + 1.5)
  assert r["capacity"] == 64 and r["new_tokens_per_run"] == 16 and r["drafter"] == "ngram"
  assert math.isclose(r["t_target_1_ms"], 1.0) and math.isclose(r["t_verify_ms"], 1.5)
  p = spec_row(meta, "none", 0, [plain], [50.0], base, t1)
  assert (p["speedup"], p["tau"], p["bound"], p["c_verify"], p["alpha"]) == (1.0, 1.0, 1.0, 1.0,
                                                                              None)


def test_breakdown_row_from_known_inputs():
  ms = 1e-3
  t = {"round": 2 * ms, "prefill": 5 * ms, "fwd_1": 0.5 * ms, "fwd_k1": 1 * ms,
       "propose": 0.5 * ms, "draft_fwd": 0.25 * ms, "verify_step": 1 * ms, "accept": 0.25 * ms}
  r = breakdown_row({"drafter": "ngram"}, 2, 3.0, t, plain_round=1 * ms)
  assert math.isclose(r["t_other_ms"], 0.25)               # 2 - 0.5 - 1 - 0.25
  assert math.isclose(r["speedup_loop"], 1.5)              # 3 tokens per 2 ms vs 1 per 1 ms
  assert math.isclose(r["bound"], 1.0)                     # 3 / ((2 * 0.25 + 1) / 0.5)
  assert math.isclose(r["efficiency_loop"], 1.5)
  assert math.isclose(r["eff_spec_overhead_factor"], 0.75)
  assert math.isclose(r["eff_plain_overhead_factor"], 2.0)
  assert math.isclose(r["t_round_ms"], 2.0) and math.isclose(r["t_prefill_ms"], 5.0)
  # At B > 1 the loop runs until its slowest row is done: plain took 2 iterations per
  # speculative one although the pooled tau is 3; the loop's speedup and bound follow the 2.
  r = breakdown_row({"drafter": "ngram"}, 2, 3.0, t, plain_round=1 * ms, tau_loop=2.0)
  assert r["tau"] == 3.0 and r["tau_loop"] == 2.0
  assert math.isclose(r["speedup_loop"], 1.0) and math.isclose(r["bound"], 2 / 3)


def test_timing_helpers():
  assert timing.percentiles([4, 1, 3, 2]) == pytest.approx({"p50": 2.5, "p90": 3.7, "p99": 3.97})
  assert timing.percentiles([7]) == {"p50": 7.0, "p90": 7.0, "p99": 7.0}
  calls = []
  runs = {name: (lambda name=name: calls.append(name) or len(calls)) for name in "pab"}
  res = timing.interleaved_rounds(runs, 2, baseline="p")
  assert calls == ["p", "a", "b", "p"] * 2
  assert res == {"p": [1, 4, 5, 8], "a": [2, 6], "b": [3, 7]}
  assert metrics.first_difference([[1, 2, 3], [1, 2]], [[1, 2, 3], [1, 2]]) is None
  assert metrics.first_difference([[1, 2, 3], [1, 5]], [[1, 9, 3], [1, 2]]) == (0, 1)
  assert metrics.first_difference([[1, 2, 3]], [[1, 2]]) == (0, 2)


def test_tables():
  rows = [["a", 1], ["bb|c", 22]]
  assert report.table(["x", "y"], rows) == "   x   y\n----  --\n   a   1\nbb|c  22"
  assert report.table(["x", "y"], rows, markdown=True) == (
      "| x | y |\n| --- | --- |\n| a | 1 |\n| bb\\|c | 22 |")


def test_widened_model_spec_has_the_source_logits():
  import jax.numpy as jnp
  import spec_jax as sj
  from spec_jax.bench import specs
  src = specs.load_model("../shared/models/stories260K")
  spec = "widened:../shared/models/stories260K:128,256,6,16"
  assert specs.parse_widened(spec) == ("../shared/models/stories260K", (128, 256, 6, 16))
  assert specs.model_label(spec) == "stories260K-wide-128x256x6x16"
  wide = specs.load_model(spec)
  assert wide.config.hidden_size == 128 and wide.config.num_layers == 6
  toks = jnp.asarray([[1, 403, 407, 261, 378, 10]])
  a = sj.forward(src.params, src.config, toks, sj.KVCache.zeros(src.config, 1, 8),
                 jnp.zeros((1,), jnp.int32)).logits
  b = sj.forward(wide.params, wide.config, toks, sj.KVCache.zeros(wide.config, 1, 8),
                 jnp.zeros((1,), jnp.int32)).logits
  assert float(jnp.max(jnp.abs(a - b))) < 1e-4
  with pytest.raises(ValueError, match="H,F,L"):
    specs.parse_widened("widened:../shared/models/stories260K:128,256")


def test_decode_roofline_counts_weights_once_and_kv_per_row():
  import spec_jax as sj
  cfg = sj.ModelConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2,
                       num_heads=2, num_kv_heads=1)
  weight_bytes = cfg.num_params * 4
  kv_bytes_per_row = 2 * 2 * 10 * 1 * 4 * 4            # k and v, L=2, fill 10, Hkv=1, Dh=4
  bw = 1e9
  assert math.isclose(timing.decode_roofline(cfg, 1, 10, bw), bw / (weight_bytes + kv_bytes_per_row))
  assert math.isclose(timing.decode_roofline(cfg, 4, 10, bw),
                      4 * bw / (weight_bytes + 4 * kv_bytes_per_row))


@pytest.mark.slow
def test_peer_suite_compares_with_transformers(tmp_path):
  out = tmp_path / "peer.json"
  rc = cli.main(["--suite", "peer", "--pairs",
                 "../shared/models/stories260K@draft:../shared/models/salty279K",
                 "../shared/models/stories260K@ngram", "-K", "2", "--peer-batch", "1",
                 "--peer-prompts", "1", "--max-new-tokens", "8", "--repeats", "1",
                 "--peer-rounds", "1", "--hf-threads", "1", "--dtype", "float32", "bfloat16",
                 "--hf-dtypes", "float32", "bfloat16", "--out", str(out)])
  assert rc == 0
  res = json.loads(out.read_text())
  configs = {(r["library"], r["dtype"], r["config"]) for r in res["rows"]}
  assert configs == {(lib, d, c) for d in ("float32", "bfloat16") for lib, c in [
      ("spec_jax", "plain"), ("spec_jax", "draft:salty279K K=2"), ("spec_jax", "ngram K=2"),
      ("transformers", "plain"), ("transformers", "assisted"),
      ("transformers", "prompt lookup 10")]}
  # Greedy in float32: every configuration of both libraries emits spec_jax plain decoding's
  # tokens (bf16 rows are compared with our bf16 plain; a near-tie may part them).
  assert all(r["greedy_match"] for r in res["rows"] if r["dtype"] == "float32"), res["notes"]
  s = res["summary"][0]
  assert s["ours_over_hf_draft"] > 0 and 0 < s["ours_plain_vs_roofline"]
  plain = lambda lib: max(r["tokens_per_s"]["median"] for r in res["rows"]
                          if r["library"] == lib and r["mode"] == "plain")
  assert s["ours_plain"] == plain("spec_jax") and s["hf_plain_best"] == plain("transformers")


def test_spec_stats_alpha_token_inverts_tau():
  """SpecStats.alpha_token solves tau = (1 - a^(K+1)) / (1 - a): hand values and edges."""
  from spec_jax.stats import SpecStats, alpha_from_tau
  assert alpha_from_tau(1.75, 2) == pytest.approx(0.5, abs=1e-12)       # 1 + .5 + .25
  assert alpha_from_tau(1.0, 4) == 0.0 and alpha_from_tau(5.0, 4) == 1.0
  assert alpha_from_tau(2.0, 1) == 1.0 and alpha_from_tau(1.5, 1) == pytest.approx(0.5)
  # Newton's root over a grid of alpha and K: tau_of_alpha(alpha_from_tau(tau)) = tau, and the
  # root is the alpha that made tau (unique on [0, 1]).
  from spec_jax.stats import tau_of_alpha
  for k in (1, 2, 4, 7, 16):
    for a in np.linspace(0.0, 1.0, 41):
      tau = tau_of_alpha(float(a), k)
      assert alpha_from_tau(tau, k) == pytest.approx(a, abs=1e-7), (k, a)
      assert tau_of_alpha(alpha_from_tau(tau, k), k) == pytest.approx(tau, abs=1e-12), (k, a)
  # 10 rounds of K = 2 that emitted 17 tokens: tau 1.7, a solves 1 + a + a^2 = 1.7.
  s = SpecStats.from_counts(rounds=[10], drafted=[20], accepted=[7], accepted_at=[[5, 2]],
                            seconds=1.0, new_tokens=18, iterations=10, num_draft=2,
                            emitted=[17])
  assert s.mean_accepted_length == pytest.approx(1.7)
  assert s.alpha_token == pytest.approx((-1 + math.sqrt(1 + 4 * 0.7)) / 2)
  assert "alpha_token=0." in s.summary()
  none = SpecStats.from_counts(rounds=[0], drafted=[0], accepted=[0], accepted_at=[[0, 0]],
                               seconds=1.0, new_tokens=1, iterations=0, num_draft=2, emitted=[0])
  assert (none.mean_accepted_length, none.acceptance_rate, none.alpha_token) == (1.0, 0.0, 0.0)


def test_batches_per_cell_merges_consecutive_batches(tmp_path, capsys):
  """--batches-per-cell 2 at B = 1: each measurement is two prompts; the merged statistics are
  the two calls' rows side by side (SpecStats.merge), tokens/s over both."""
  from spec_jax.stats import SpecStats
  a = SpecStats.from_counts(rounds=[4], drafted=[8], accepted=[5], accepted_at=[[3, 2]],
                            seconds=1.0, new_tokens=10, iterations=4, num_draft=2, emitted=[9])
  b = SpecStats.from_counts(rounds=[6], drafted=[12], accepted=[3], accepted_at=[[2, 1]],
                            seconds=3.0, new_tokens=10, iterations=6, num_draft=2, emitted=[9])
  m = SpecStats.merge([a, b])
  assert m.row_counts["rounds"] == [4, 6] and m.row_counts["accepted_at"] == [[3, 2], [2, 1]]
  assert (m.rounds, m.drafted, m.accepted, m.emitted) == (10, 20, 8, 18)
  assert m.tokens_per_second == pytest.approx(20 / 4.0) and m.iterations == 10
  assert m.mean_accepted_length == pytest.approx(1.8)
  assert m.accepted_at == pytest.approx((0.5, 0.3))
  with pytest.raises(ValueError, match="one configuration"):
    SpecStats.merge([a, SpecStats.from_counts(rounds=[1], drafted=[0], accepted=[0],
                                              accepted_at=[], seconds=1.0, new_tokens=1,
                                              iterations=1, num_draft=0)])

  out = tmp_path / "spec.json"
  argv = ["--pairs", "random:tiny@draft:random:tiny-draft", "-K", "2", "-B", "1",
          "--max-new-tokens", "8", "--repeats", "1", "--cost-repeats", "1",
          "--temperatures", "0", "--batches-per-cell", "2", "--out", str(out)]
  assert cli.main(argv) == 0
  rows = json.loads(out.read_text())["rows"]
  for r in rows:
    assert r["batches_per_cell"] == 2 and r["new_tokens_per_run"] == 16
  spec = next(r for r in rows if r["K"] == 2)
  # tau * rounds = the tokens the rounds emitted: 7 per prompt (the prefill gives the 8th),
  # over both prompts.
  assert spec["tau"] * spec["rounds"] == pytest.approx(2 * 7)
  assert cli.main(argv[:-4] + ["--batches-per-cell", "0", "--out", str(out)]) == 2
  assert "--batches-per-cell must be >= 1" in capsys.readouterr().err


def test_dtype_rows_and_the_fastest_plain_of_any_dtype(tmp_path, capsys):
  """--dtype bfloat16 --plain-dtypes float32: the target (and its draft model) run in bf16, and
  every cell also times plain decoding in float32, interleaved; each row's speedup is against
  plain in its own dtype AND against the faster of the two plains of the same cell."""
  out = tmp_path / "dt.json"
  rc = cli.main(["--pairs", "random:tiny@draft:random:tiny-draft", "-K", "2", "-B", "1",
                 "--dtype", "bfloat16", "--plain-dtypes", "float32", "--max-new-tokens", "8",
                 "--repeats", "2", "--cost-repeats", "1", "--temperatures", "0", "--out",
                 str(out)])
  assert rc == 0
  res = json.loads(out.read_text())
  rows = {r["drafter"]: r for r in res["rows"]}
  assert set(rows) == {"none", "none@float32", "draft:random:tiny-draft"}
  assert {r["target"] for r in rows.values()} == {"random:tiny bf16"}
  assert rows["none"]["dtype"] == "bfloat16" and rows["none@float32"]["dtype"] == "float32"
  assert rows["draft:random:tiny-draft"]["dtype"] == "bfloat16"
  base = res["baselines"][0]
  plains = {d: p["median"] for d, p in base["plain_by_dtype"].items()}
  assert set(plains) == {"bfloat16", "float32"}
  fastest = max(plains, key=plains.get)
  assert base["fastest_plain_dtype"] == fastest
  for r in rows.values():
    want = r["tokens_per_s"]["median"] / plains[fastest]
    assert math.isclose(r["speedup_vs_fastest_plain"], want, rel_tol=1e-9)
    assert math.isclose(r["speedup"], r["tokens_per_s"]["median"] / plains["bfloat16"],
                        rel_tol=1e-9)
  assert "vs best" in capsys.readouterr().out


def test_draft_temperature_scale_reaches_the_sampled_cells(tmp_path, monkeypatch):
  """--draft-temperature-scale: every timed generate() of a sampled cell carries it in its
  Sampling, and the rows record it."""
  from spec_jax.bench.suites import targets
  seen = []
  real = targets.sj.generate

  def spy(*args, **kw):
    seen.append(float(kw["sampling"].draft_temperature_scale))
    return real(*args, **kw)
  monkeypatch.setattr(targets.sj, "generate", spy)
  out = tmp_path / "spec.json"
  assert cli.main(["--pairs", "random:tiny@draft:random:tiny-draft", "-K", "2", "-B", "1",
                   "--max-new-tokens", "8", "--repeats", "1", "--cost-repeats", "1",
                   "--temperatures", "1", "--draft-temperature-scale", "0.5",
                   "--out", str(out)]) == 0
  assert seen and set(seen) == {0.5}
  rows = json.loads(out.read_text())["rows"]
  assert rows and all(r["draft_temperature_scale"] == 0.5 for r in rows)


def test_tuned_draft_temperature_runs_the_sampled_chains_tuned():
  """--draft-temperature-scale tuned: a sampled cell's chain K runs as
  sj.strategies.TunedDraftTemperature(K) at scale 1; greedy cells, plain decoding, the
  governor and trees run as they would; bad values are refused by the parser."""
  import argparse
  from spec_jax.bench.cli import scale_or_tuned
  from spec_jax.bench.suites import targets
  opts = argparse.Namespace(draft_temperature_scale=scale_or_tuned("tuned"))
  drafter, tree = sj.drafters.NGram(2, 1), sj.TreeSpec(2, 2, 4)
  assert targets.cell_config(4, 1.0, drafter, opts) == sj.strategies.TunedDraftTemperature(4)
  assert [targets.cell_config(k, t, d, opts) for k, t, d in [
      (4, 0.0, drafter), (0, 1.0, None), ("auto", 1.0, drafter), (tree, 1.0, drafter)]] == [
          4, 0, "auto", tree]
  assert targets.cell_sampling(1.0, opts).draft_temperature_scale == 1.0
  assert scale_or_tuned("0.5") == 0.5
  for bad in ["-1", "inf", "fast"]:
    with pytest.raises(argparse.ArgumentTypeError, match="a finite number >= 0 or 'tuned'"):
      scale_or_tuned(bad)
  # run_generate runs the strategy it is given.
  from tests.conftest import peaky_models
  target, draft = peaky_models(sj.ModelConfig(
      vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
      num_kv_heads=1, max_position_embeddings=64, eos_token_ids=()))
  out = targets.run_generate(target, [[1, 2, 3]], sj.drafters.DraftModel(draft),
                             targets.cell_config(2, 1.0, drafter, opts), 8, 1.0, 0)
  assert out.stats.strategy == "K=2,tuned-draft-T" and len(out.tokens[0]) == 8


def test_verdicts_and_the_loss_flag_judge_the_fastest_plain():
  """A bf16 drafter row at 1.08x of plain bf16, where plain float32 was 1.12x faster: 0.96x of
  the fastest plain decoding is a loss, flagged and judged so (it read "beats plain")."""
  from spec_jax.bench.report import format_spec
  from spec_jax.bench.suites.spec import governor_verdicts, make_verdicts
  cell = dict(target="t", temperature=0.0, batch=4)
  tps = dict(median=108.0, min=100.0, max=110.0)
  row = dict(cell, drafter="draft:x", drafter_spec="draft:x", K=2, tokens_per_s=tps,
             speedup=1.08, speedup_vs_fastest_plain=0.96, fastest_plain_dtype="float32",
             alpha=0.5, alpha_token=0.5, tau=1.5, c_draft=0.1, c_verify=1.1, bound=1.2,
             efficiency=0.9)
  verdict = make_verdicts([row], [dict(cell, noise_pct=2.0)])[0]["per_batch"][0]
  assert verdict["speedup"] == 0.96 and not verdict["beats_plain"]
  assert verdict["judgement"] == "LOSES to plain"
  result = {"rows": [row], "notes": [], "verdicts": [], "baselines": [
      dict(cell, noise_pct=2.0, tokens_per_s=dict(tps, median=112.5, n=3))]}
  line = next(ln for ln in format_spec(result).splitlines() if "draft:x" in ln)
  assert "LOSS" in line
  auto = dict(row, K="auto", batch=16, k_histogram={0: 10}, noise_pct=2.0,
              speedup=1.0, speedup_vs_fastest_plain=0.9)
  assert governor_verdicts([auto])[0]["goals"] == {"vs_plain>=0.97": False}


def test_breakdown_row_with_a_round_within_the_noise_computes_no_speedup():
  """t_round is a difference of medians: -0.28 ms printed a -1.8x speedup."""
  ms = 1e-3
  t = {"round": -0.3 * ms, "prefill": 5 * ms, "fwd_1": 0.5 * ms, "fwd_k1": 1 * ms,
       "propose": 0.5 * ms, "draft_fwd": 0.25 * ms, "verify_step": 1 * ms, "accept": 0.25 * ms}
  r = breakdown_row({"drafter": "ngram"}, 2, 3.0, t, plain_round=1 * ms, tau_loop=2.5)
  assert r["t_round_ms"] is None and "speedup_loop" not in r and "<= 0" in r["unresolved"]
  assert r["tau_loop"] == 2.5          # iterations' ratio: a count, reported whatever the noise
  ok = dict(t, round=2 * ms)
  r = breakdown_row({"drafter": "ngram"}, 2, 3.0, ok, plain_round=-1 * ms)   # plain's was
  assert "speedup_loop" not in r and r["unresolved"]


def test_spec_suite_runs_every_configuration_of_a_cell_at_one_capacity(tmp_path, monkeypatch):
  """generate() picks a power-of-two capacity that grows with K: plain ran at 512 beside K=2 at
  1024, and the cost ratios were timed at a third capacity. Every configuration now runs at the
  cell's capacity, which the row reports."""
  capacities = []
  real = sj.generate

  def recording(*a, **kw):
    capacities.append(kw.get("capacity"))
    return real(*a, **kw)
  monkeypatch.setattr(sj, "generate", recording)
  out = tmp_path / "cap.json"
  assert cli.main(["--pairs", "random:tiny@ngram", "-K", "2", "-B", "1", "--max-new-tokens",
                   "60", "--repeats", "1", "--cost-repeats", "1", "--temperatures", "0",
                   "--out", str(out)]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert len(set(capacities)) == 1 and capacities[0] is not None, capacities
  assert {r["capacity"] for r in rows} == {r["cost_capacity"] for r in rows} == {capacities[0]}


def test_bench_refuses_before_measuring(tmp_path, capsys):
  """Inputs that were accepted and then misused (or failed late, with a traceback)."""
  cfg = tmp_path / "c.yaml"
  base = ["--repeats", "1", "--cost-repeats", "1", "--max-new-tokens", "4", "--out",
          str(tmp_path / "o.json")]
  for config, message in (("suite: benchmark\n", "suite: 'benchmark' is not one of spec"),
                          ("dtype: [float16]\n", "dtype: 'float16' is not one of"),
                          ("hf_dtypes: [float16]\n", "hf_dtypes: 'float16' is not one of"),
                          ("draft_temperature_scale: -2\n", "expected a finite number >= 0"),
                          ("quick: 1\n", "quick: expected true or false")):
    cfg.write_text(config)
    assert cli.main(["--config", str(cfg)] + base) == 2, config
    assert message in capsys.readouterr().err, config
  for argv, message in (
      (["--pairs", "x/m@ngram", "y/m@ngram"], "share the table label 'm'"),
      (["--pairs", "random:tiny@draft:x/m", "random:tiny@draft:y/m"],
       "share the table label 'draft:m'"),
      (["--pairs", "random:tiny@none"], "give each pair a drafter"),
      (["--pairs", "random:tiny@ngram", "--max-prompt-tokens", "-3"],
       "--max-prompt-tokens must be >= 1"),
      (["--pairs", "random:tiny@ngram", "--prompt-words", "0"], "--prompt-words must be >= 1"),
      (["--suite", "peer", "--pairs", "random:tiny@ngram", "-K", "2", "auto"],
       "--num-draft values must be integers >= 1, got ['auto']")):
    assert cli.main(argv + base) == 2, argv
    assert message in capsys.readouterr().err, argv
