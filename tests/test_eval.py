"""python -m spec_jax.eval on tinystories656K with a few tiny prompts and 4 new tokens: the
files it writes, resuming, the greedy check, skipped prompts, chat templates, bad input.

No assertion looks at a measured time; latency arithmetic is checked on hand-picked numbers.
"""

import json

import numpy as np

import pytest

from spec_jax.bench.plots import have_matplotlib
from spec_jax.bench.prompts import PromptRecord, read_prompt_records
from spec_jax.bench.results import describe_cpu
from spec_jax.eval import EvalOptions, LossyOutputError, cli, evaluate, prompting, runner
from spec_jax.eval.latency import request_latencies
from spec_jax.eval.options import auto_supported
from spec_jax.eval.report import render_markdown

from .conftest import need_shared

TINY = "tinystories656K"
PROMPTS = [
    {"question_id": "a1", "category": "alpha", "turns": ["Once upon a time there was a cat."]},
    {"question_id": "a2", "category": "alpha", "turns": ["Beyond the limit per category."]},
    {"question_id": "b1", "category": "beta", "turns": ["Tom had a red ball.",
                                                        "What happened next?"]},
    {"question_id": "c1", "category": "gamma", "turns": ["word " * 600]},   # > 512 tokens
]


@pytest.fixture
def prompt_file(tmp_path):
  path = tmp_path / "prompts.jsonl"
  path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
  return path


def _argv(model, prompts, out, *extra):
  return ["--target", str(model), "--drafter", "ngram", "--prompts", str(prompts),
          "--limit-per-category", "1", "--max-new-tokens", "4", "--out", str(out),
          "--no-progress", *extra]


def test_eval_writes_results_report_plots_and_resumes(tmp_path, prompt_file, capsys,
                                                      monkeypatch):
  model = need_shared("models", TINY)
  out = tmp_path / "run"
  assert cli.main(_argv(model, prompt_file, out, "--batch", "1", "2")) == 0
  res = json.loads((out / "results.json").read_text())
  report = (out / "report.md").read_text()
  assert res["kind"] == "eval" and res["machine"]["git_commit"] is not None
  assert describe_cpu(res["machine"]) in report and "cpu" in res["machine"]
  assert res["target"]["prompt_format"] == "raw"
  # a2 is over the limit; c1 does not fit the context: skipped, listed, reported.
  assert [(s["id"], s["turn"]) for s in res["skipped"]] == [("c1", 1)]
  assert "`c1` (gamma, turn 1)" in report and "exceed the context of 512" in report
  asked = {(r["id"], r["turn"], r["batch"]) for r in res["requests"]}
  assert asked == {(i, t, b) for i, t in [("a1", 1), ("b1", 1), ("b1", 2)] for b in (1, 2)}
  assert res["greedy_check"]["checked"] and res["greedy_check"]["requests_compared"] == 6
  assert res["run"] == dict(res["run"], units=5, units_measured=5, units_reused=0)
  cats = {(r["category"], r["drafter"], r["batch"]) for r in res["summary"]}
  assert cats == {(c, d, b) for c in ("alpha", "beta", "all") for d in ("plain", "ngram")
                  for b in (1, 2)}
  for r in res["summary"]:
    if r["drafter"] == "plain":
      assert r["speedup"] == 1.0 and r["tau"] == 1.0 and r["alpha"] is None
      assert r["speedup_vs_fastest_plain"] == 1.0 and r["fastest_plain"] == "plain"
    else:                   # per-position acceptance: a non-increasing fraction of rounds
      at = r["accepted_at"]
      assert len(at) == 4 and all(1 >= a >= b >= 0 for a, b in zip(at, at[1:]))
  # Every (configuration, batch) compiled its decodes once, never inside a timed call.
  assert res["compile"]["seconds"] > 0 and res["compile"]["units_that_compiled"] >= 2
  for r in res["latency"]:
    assert set(r["ttft_ms"]) == {"p50", "p90", "p99"} and r["requests"] == 3
  turn2 = [a for a in res["answers"] if a["turn"] == 2]
  assert [a["id"] for a in turn2] == ["b1"] and isinstance(turn2[0]["text"], str)
  # matplotlib is in the test extra: the plots are always drawn and checked here.
  assert have_matplotlib()
  assert res["plots"] == ["speedup_per_category.png", "speedup_vs_batch.png",
                          "tau_per_category.png", "tpot_vs_batch.png"]
  for name in res["plots"]:
    assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({name})" in report
  assert "No plots: plots need matplotlib: pip install 'spec_jax[plot]'" in (
      render_markdown(dict(res, plots=[])))
  printed = capsys.readouterr().out
  assert "speedup" in printed and "results.json" in printed

  # The same command again measures nothing.
  def no_measuring(self, unit):
    raise AssertionError(f"measured {unit.key} again")
  monkeypatch.setattr(runner.UnitRunner, "measure", no_measuring)
  assert cli.main(_argv(model, prompt_file, out, "--batch", "1", "2")) == 0
  again = json.loads((out / "results.json").read_text())
  assert again["run"]["units_measured"] == 0 and again["run"]["units_reused"] == 5
  assert again["summary"] == res["summary"] and again["requests"] == res["requests"]
  monkeypatch.undo()

  # A run killed before its last batch: only that batch is measured. The other units here
  # were measured on another host (a VM moved): the report says the run mixes hosts.
  assert res["run"]["hosts"] == [describe_cpu(res["machine"])] and "Mixed hosts" not in report
  moved = out / "units" / "turn1-B1-00000.json"
  moved.write_text(json.dumps(dict(json.loads(moved.read_text()), host="Other CPU; avx2")))
  (out / "units" / "turn2-B2-00000.json").unlink()
  capsys.readouterr()
  assert cli.main(_argv(model, prompt_file, out, "--batch", "1", "2")) == 0
  third = json.loads((out / "results.json").read_text())
  assert third["run"]["units_measured"] == 1 and third["run"]["units_reused"] == 4
  assert third["run"]["hosts"] == sorted(["Other CPU; avx2", describe_cpu(third["machine"])])
  assert "**Mixed hosts:** this run's units were measured on 2 hosts" in (
      out / "report.md").read_text()
  assert "[eval] warning: this run's units were measured on 2 hosts" in capsys.readouterr().err

  # Other options in the same directory: a clear error, nothing overwritten.
  assert cli.main(_argv(model, prompt_file, out, "--batch", "1", "--temperature", "1")) == 2
  assert "other options (temperature: 0.0 there, 1.0 now)" in capsys.readouterr().err


def test_eval_num_draft_auto(tmp_path, prompt_file, monkeypatch):
  """--num-draft auto runs the governor (its cost table replaced by a flat one: calibration is
  tested in tests/test_governor.py) and passes the greedy check against plain decoding."""
  import numpy as np
  from spec_jax.decoding import calibration
  model = need_shared("models", TINY)
  assert auto_supported()
  monkeypatch.setattr(calibration, "round_costs_for",
                      lambda strategy, target, drafter, *a, **kw: None
                      if strategy.calibration_ks is None
                      else np.ones(len(strategy.calibration_ks), np.float32))
  out = tmp_path / "auto"
  assert cli.main(_argv(model, prompt_file, out, "--batch", "2", "--num-draft", "auto")) == 0
  res = json.loads((out / "results.json").read_text())
  assert res["options"]["num_draft"] == "auto" and res["greedy_check"]["checked"]
  unit = json.loads(next((out / "units").glob("turn1-B2-*.json")).read_text())
  hist = unit["configs"]["ngram"]["k_histogram"]
  assert sum(hist.values()) == unit["configs"]["ngram"]["iterations"] > 0


def test_greedy_mismatch_is_an_error(tmp_path, prompt_file, monkeypatch, capsys):
  model = need_shared("models", TINY)
  real = runner.generate_call

  def lossy(target, prompts, config, max_new_tokens, *args):
    out = real(target, prompts, config, max_new_tokens, *args)
    if config.drafter is None:
      return out
    return out._replace(tokens=[t[:-1] + [(t[-1] + 1) % 2048] for t in out.tokens])
  monkeypatch.setattr(runner, "generate_call", lossy)
  opts = EvalOptions(target=str(model), drafters=("ngram",), prompts=str(prompt_file),
                     out=str(tmp_path / "lossy"), batch=(1,), max_new_tokens=4,
                     limit_per_category=1, progress=False)
  with pytest.raises(LossyOutputError, match=r"drafter ngram .* prompt a1 \(alpha, turn 1"):
    evaluate(opts)
  assert not (tmp_path / "lossy" / "results.json").exists()
  assert cli.main(_argv(model, prompt_file, tmp_path / "lossy2", "--batch", "1")) == 1
  assert "error: greedy outputs differ" in capsys.readouterr().err


def test_strict_and_bad_input(tmp_path, prompt_file, capsys, monkeypatch):
  model = need_shared("models", TINY)
  assert cli.main(_argv(model, prompt_file, tmp_path / "s", "--strict")) == 2
  assert "--strict: 1 turn-1 prompt(s) do not fit the context" in capsys.readouterr().err
  assert not list((tmp_path / "s" / "units").glob("*.json"))      # nothing was measured
  base = dict(target=str(model), drafters=("ngram",), out=str(tmp_path / "o"),
              prompts=str(prompt_file))
  bad = [(dict(drafters=()), "at least one --drafter"),
         (dict(drafters=("bogus",)), "unknown drafter 'bogus'; use none, ngram"),
         (dict(drafters=("ngram", "ngram")), "given twice"),
         (dict(drafters=("none",)), "plain decoding always runs"),
         (dict(batch=(0, 4)), "--batch sizes must be integers >= 1"),
         (dict(num_draft="0"), "integer K >= 1 or 'auto'"),
         (dict(num_draft="four"), "integer K >= 1 or 'auto'"),
         (dict(temperature=-1.0), "--temperature must be >= 0"),
         (dict(max_new_tokens=0), "--max-new-tokens must be >= 1"),
         (dict(limit_per_category=0), "--limit-per-category must be >= 1"),
         (dict(prompts="no_such_set"), "prompt source 'no_such_set' not found")]
  if not auto_supported():
    bad.append((dict(num_draft="auto"), "not available yet"))
  for change, message in bad:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
      EvalOptions(**dict(base, **change)).validate()
  assert EvalOptions(**dict(base, num_draft="6", batch=(4, 1))).validate().batch == (1, 4)
  assert cli.main(_argv(model, prompt_file, tmp_path / "b", "--batch", "0")) == 2
  assert "error: --batch sizes must be integers >= 1" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli.main(["--drafter", "ngram", "--out", str(tmp_path)])          # no --target
  # A draft model of another vocabulary (stories260K: 512 tokens, this target 2,048) is refused
  # before plain decoding is compiled and measured, not after.
  other = need_shared("models", "stories260K")
  argv = _argv(model, prompt_file, tmp_path / "v", "--drafter", f"draft:{other}")
  monkeypatch.setattr(runner.sj, "generate", lambda *a, **kw: pytest.fail("decoded before refusing"))
  assert cli.main(argv) == 2
  assert "the draft model has a vocabulary of 512 tokens but the target has 2048" in (
      capsys.readouterr().err)
  assert not list((tmp_path / "v").glob("units/*.json"))


@pytest.fixture
def chat_tiny(tmp_path):
  """TINY with a chat template (role: content lines) that has one option, `brief`."""
  src = need_shared("models", TINY)
  folder = tmp_path / "chat"
  folder.mkdir()
  for name in ("config.json", "model.safetensors", "tokenizer.json", "special_tokens_map.json"):
    (folder / name).symlink_to(src / name)
  config = json.loads((src / "tokenizer_config.json").read_text())
  config["chat_template"] = ("{% for m in messages %}{{ bos_token }}{{ m['role'] }}: "
                             "{{ m['content'] }}\n{% endfor %}"
                             "{% if add_generation_prompt %}assistant:{% endif %}"
                             "{% if brief is defined and brief %} Be brief.{% endif %}")
  (folder / "tokenizer_config.json").write_text(json.dumps(config))
  return folder


def test_chat_template_is_used_when_the_tokenizer_has_one(chat_tiny):
  import spec_jax as sj
  chat, raw = sj.load(chat_tiny), sj.load(need_shared("models", TINY))
  assert prompting.prompt_format(chat) == "chat_template"
  assert prompting.prompt_format(raw) == "raw"
  rec = PromptRecord(id="q", category="c", turns=("Hi there", "And then?"))
  answers = {("q", 1): "A story."}
  ids = prompting.encode_conversation(chat, prompting.conversation(rec, 2, answers))
  text = chat.tokenizer.hf.decode(ids)
  assert text == ("<|start_story|>user: Hi there\n<|start_story|>assistant: A story.\n"
                  "<|start_story|>user: And then?\nassistant:")
  raw_ids = prompting.encode_conversation(raw, prompting.conversation(rec, 2, answers))
  assert raw_ids == raw.encode("Hi there\n\nA story.\n\nAnd then?")
  reqs, skipped = prompting.build_requests(chat, [rec], 2, answers, 512, 4)
  assert [r.ids for r in reqs] == [tuple(ids)] and skipped == []
  reqs, skipped = prompting.build_requests(chat, [rec], 2, {}, 512, 4)
  assert reqs == [] and skipped[0]["reason"] == "turn 1 was skipped"
  # The template's options (Qwen3's enable_thinking is one) reach every prompt.
  reqs, _ = prompting.build_requests(chat, [rec], 2, answers, 512, 4, {"brief": True})
  assert chat.tokenizer.hf.decode(reqs[0].ids) == text + " Be brief."
  with pytest.raises(ValueError, match="this target's tokenizer has no chat template"):
    prompting.build_requests(raw, [rec], 1, {}, 512, 4, {"brief": True})


def test_eval_takes_the_chat_templates_options_and_keys_the_run_by_them(
    chat_tiny, tmp_path, prompt_file, capsys, monkeypatch):
  out = tmp_path / "run"
  brief = ["--chat-template-kwargs", '{"brief": true}']
  assert cli.main(_argv(chat_tiny, prompt_file, out, *brief)) == 0
  res = json.loads((out / "results.json").read_text())
  assert res["options"]["chat_template_kwargs"] == {"brief": True}
  assert json.loads((out / "manifest.json").read_text())["fingerprint"][
      "chat_template_kwargs"] == {"brief": True}
  assert 'chat template with options `{"brief": true}`' in (out / "report.md").read_text()
  capsys.readouterr()
  # Stored units were measured on other prompt ids: a resume with other options is refused.
  assert cli.main(_argv(chat_tiny, prompt_file, out)) == 2
  assert "chat_template_kwargs: {'brief': True} there, None now" in capsys.readouterr().err
  # Refused before anything is decoded: not JSON, not template variables, no template.
  monkeypatch.setattr(runner.sj, "generate", lambda *a, **kw: pytest.fail("decoded"))
  for kwargs, message in [("{brief}", "--chat-template-kwargs '{brief}' is not JSON"),
                          ('["brief"]', "must be a dict of template variables"),
                          ('{"truncation": true}', "apply_chat_template's own options")]:
    assert cli.main(_argv(chat_tiny, prompt_file, tmp_path / "bad",
                          "--chat-template-kwargs", kwargs)) == 2
    assert message in capsys.readouterr().err, kwargs
  assert cli.main(_argv(need_shared("models", TINY), prompt_file, tmp_path / "raw", *brief)) == 2
  assert "this target's tokenizer has no chat template (its prompts are raw text)" in (
      capsys.readouterr().err)
  with pytest.raises(ValueError, match="must be JSON-serialisable"):
    EvalOptions(target=str(chat_tiny), drafters=("ngram",), out=str(tmp_path / "o"),
                prompts=str(prompt_file), chat_template_kwargs={"brief": object()}).validate()
  assert not (tmp_path / "bad").exists() and not (tmp_path / "raw").exists()


def test_prompt_records_units_and_latency_arithmetic():
  need_shared("data", "prompts")
  records = read_prompt_records("spec_bench")
  assert len(records) == 480 and records[0].id == "81" and records[0].category == "writing"
  assert len(records[0].turns) == 2
  picked = prompting.select_records(records, 2)
  assert len(picked) == 13 * 2 and [r.category for r in picked[:3]] == ["writing", "writing",
                                                                         "roleplay"]
  he = read_prompt_records("humaneval")
  assert he[0].id == "HumanEval/0" and he[0].category == "humaneval"
  reqs = [prompting.Request(id=str(i), category="c", turn=1, ids=(1, 2 + i)) for i in range(5)]
  units = runner.plan_units(reqs, 2, 1)
  assert [(len(u.requests), u.filler) for u in units] == [(2, 0), (2, 0), (1, 1)]
  assert units[2].prompts() == [[1, 6], [1, 6]] and units[2].key == "turn1-B2-00002"
  # 1.0 s call, 0.2 s prefill, 8 loop iterations -> 0.1 s per round.
  lat = request_latencies(1.0, 0.2, 8, rounds=[8, 4, 0], new_tokens=[17, 9, 1])
  assert [round(x["e2e_s"], 9) for x in lat] == [1.0, 0.6, 0.2]
  assert [x["tpot_s"] and round(x["tpot_s"], 9) for x in lat] == [0.05, 0.05, None]
  assert all(x["ttft_s"] == 0.2 for x in lat)



def test_eval_plain_in_other_dtypes(tmp_path, prompt_file):
  """--plain-dtypes times plain decoding in another dtype in every unit; every row also gets
  its speedup over the fastest plain of any dtype (and which one that was)."""
  model = need_shared("models", TINY)
  out = tmp_path / "dtypes"
  assert cli.main(_argv(model, prompt_file, out, "--dtype", "float32", "--plain-dtypes",
                        "bfloat16", "--repeats", "2")) == 0
  res = json.loads((out / "results.json").read_text())
  rows = {r["drafter"]: r for r in res["throughput"]}
  assert set(rows) == {"plain", "plain bfloat16", "ngram"}
  fastest = max(("plain", "plain bfloat16"), key=lambda d: rows[d]["tokens_per_s"])
  for r in rows.values():
    assert r["fastest_plain"] == fastest
    assert r["speedup_vs_fastest_plain"] == pytest.approx(
        r["tokens_per_s"] / rows[fastest]["tokens_per_s"])
    assert r["plain_noise"] is not None and r["plain_noise"] >= 0     # two repeats: a spread
  # the greedy check compares the drafter with plain decoding of its own dtype only
  assert res["greedy_check"]["checked"]
  with pytest.raises(ValueError, match="its plain decoding always runs"):
    cli.options_from(cli.build_parser().parse_args(_argv(
        model, prompt_file, out, "--dtype", "bfloat16", "--plain-dtypes", "bfloat16"))).validate()


def test_bf16_greedy_check_accepts_only_near_ties(monkeypatch):
  """In a low-precision target a drafter's greedy output may part from plain decoding's only
  where both tokens are argmaxes up to BF16_ARGMAX_TOL of the logits' scale (the divergence is
  returned and reported); anywhere else, and always in float32, it is a LossyOutputError."""
  from spec_jax.eval import greedy
  reqs = (prompting.Request(id="q1", category="c", turn=1, ids=(1, 2, 3)),)
  unit = runner.Unit(turn=1, batch=1, index=0, requests=reqs, filler=0)
  configs = [runner.Config(key="none", label="plain", drafter=None, num_draft=0,
                           dtype="bfloat16"),
             runner.Config(key="ngram", label="ngram", drafter=object(), num_draft=4,
                           dtype="bfloat16")]
  logits = np.zeros(16)
  logits[[5, 6, 9]] = [10.0, 10.0 - 0.5 * 2 ** -6 * 10, 8.0]     # 6: a near-tie of 5; 9: not
  seen = []

  def fake_logits(model32, ids):
    seen.append(list(ids))
    return logits
  monkeypatch.setattr(greedy, "reference_logits", fake_logits)
  tie = {"none": [[4, 5, 7]], "ngram": [[4, 6, 7]]}
  found = greedy.check_greedy(unit, configs, tie, reference=lambda: None)
  assert [(d["id"], d["position"], d["near_tie"]) for d in found] == [("q1", 1, True)]
  assert seen == [[1, 2, 3, 4]]                  # the prompt and plain's tokens before the split
  with pytest.raises(LossyOutputError, match="beyond a near-tie"):
    greedy.check_greedy(unit, configs, {"none": [[4, 5, 7]], "ngram": [[4, 9, 7]]},
                        reference=lambda: None)
  logits[0] = -np.inf            # a masked entry leaves the tolerance at the finite scale
  with pytest.raises(LossyOutputError, match="beyond a near-tie"):
    greedy.check_greedy(unit, configs, {"none": [[4, 5, 7]], "ngram": [[4, 9, 7]]},
                        reference=lambda: None)
  with pytest.raises(LossyOutputError, match="must reproduce plain decoding exactly"):
    greedy.check_greedy(unit, configs, tie, reference=None)        # float32: no tolerance
  assert greedy.check_greedy(unit, configs, {"none": [[4, 5]], "ngram": [[4, 5]]}) == []


def test_eval_trees_run_beside_the_chains(tmp_path, prompt_file, monkeypatch):
  """--tree D,k,N adds a tree configuration after the chain of every drafter that builds trees:
  measured on the same prompts, held to the greedy check (a tree that changed a token would
  raise), with its own rows in every table and its shape in the report."""
  import importlib
  import spec_jax as sj
  evaluate_module = importlib.import_module("spec_jax.eval.evaluate")
  model = need_shared("models", TINY)
  out = tmp_path / "trees"
  calls = []
  real = runner.generate_call

  def spy(target, prompts, config, *args):
    calls.append((config.key, config.tree))
    return real(target, prompts, config, *args)
  monkeypatch.setattr(runner, "generate_call", spy)
  assert cli.main(_argv(model, prompt_file, out, "--tree", "3,2,6", "--tree", "2, 2, 3",
                        "--tree", "3,2,6,auto")) == 0      # the same tree as the first
  assert ("ngram@tree:3,2,6", sj.TreeSpec(3, 2, 6)) in calls
  assert ("ngram@tree:2,2,3", sj.TreeSpec(2, 2, 3)) in calls
  assert ("ngram", None) in calls
  res = json.loads((out / "results.json").read_text())
  assert res["options"]["trees"] == ["3,2,6", "2,2,3"]
  assert [d["label"] for d in res["drafters"]] == ["ngram", "ngram tree 3,2,6",
                                                    "ngram tree 2,2,3"]
  assert res["greedy_check"]["checked"] and not res["greedy_check"]["near_tie_divergences"]
  rows = {r["drafter"]: r for r in res["summary"] if r["category"] == "all"}
  assert rows["ngram tree 3,2,6"]["num_draft"] == "tree 3,2,6"
  assert rows["ngram tree 3,2,6"]["tau"] >= 1.0 and rows["ngram tree 3,2,6"]["new_tokens"] > 0
  assert "trees D,k,N 3,2,6, 2,2,3 beside them" in (out / "report.md").read_text()
  base = dict(target=str(model), drafters=("ngram",), out=str(tmp_path / "o"),
              prompts=str(prompt_file))
  with pytest.raises(ValueError, match="a tree is written D,k,N"):
    EvalOptions(**dict(base, trees=("3,2",))).validate()
  with pytest.raises(ValueError, match=r"num_nodes \(2\) must be >= depth \(3\)"):
    EvalOptions(**dict(base, trees=("3,2,2",))).validate()
  monkeypatch.setattr(sj.drafters.NGram, "supports_tree", False)
  with pytest.raises(ValueError, match="--tree needs a drafter that builds trees"):
    evaluate_module.make_configs(sj.load(model),
                                 EvalOptions(**dict(base, trees=("3,2,6",))).validate())


def test_tau_counts_emitted_tokens_and_noise_is_a_true_median():
  """tau: a round cut by max_new_tokens counts its emitted drafts as accepted but emits no
  correction or bonus, so (accepted + rounds) / rounds overstated it by one token per cut
  request. plain_noise: the median over repeats and over batches is statistics.median's, not
  the upper middle value (2 repeats [1, 2]: 1 / 1.5, not 1 / 2)."""
  from spec_jax.eval import aggregate
  row = {"rounds": 3, "drafted": 12, "accepted": 11, "new_tokens": 14, "e2e_s": 1.0,
         "accepted_at": [3, 3, 3, 2]}          # 4 + 4 + 3 emitted (the last round cut)
  assert aggregate.group_stats([row], 4)["tau"] == 13 / 3
  plain = {"none": {"rounds": 13, "drafted": 0, "accepted": 0, "new_tokens": 14,
                    "e2e_s": 1.0, "accepted_at": []}}
  assert aggregate.group_stats([plain["none"]], 0)["tau"] == 1.0
  unit = lambda secs: {"batch": 4, "configs": {runner.PLAIN: {"seconds": secs}}}
  assert aggregate.plain_noise([unit([1.0, 2.0])], 4) == pytest.approx(1 / 1.5)
  assert aggregate.plain_noise([unit([1.0, 2.0]), unit([1.0, 1.1]), unit([1.0, 1.2]),
                                unit([1.0, 3.0])], 4) == pytest.approx(
      (0.2 / 1.1 + 1 / 1.5) / 2)


def test_terminal_summary_compares_with_the_fastest_plain_and_states_its_noise():
  res = {"throughput": [
      {"drafter": "plain", "batch": 4, "tokens_per_s": 100.0, "speedup": 1.0,
       "speedup_vs_fastest_plain": 0.58, "plain_noise": 0.12},
      {"drafter": "plain bfloat16", "batch": 4, "tokens_per_s": 173.0, "speedup": 1.73,
       "speedup_vs_fastest_plain": 1.0, "plain_noise": 0.12},
      {"drafter": "draft:x", "batch": 4, "tokens_per_s": 51.0, "speedup": 0.51,
       "speedup_vs_fastest_plain": 0.29, "plain_noise": 0.12}],
      "summary": [], "latency": [], "skipped": [], "plots": ["x.png"],
      "greedy_check": {"checked": True},
      "run": {"units": 1, "units_measured": 1, "units_reused": 0, "out": "o"}}
  text = cli.summary_text(res)
  line = next(ln for ln in text.splitlines() if ln.strip().startswith("draft:x"))
  assert "0.29x" in line and "0.51x" not in line and "12%" in line
  assert "vs fastest plain" in text and "plain noise" in text


def test_alpha_token_uses_the_engines_rejections_and_old_units_fall_back():
  from spec_jax.eval import aggregate
  row = lambda **kw: dict(dict(rounds=4, drafted=10, accepted=5, accepted_at=[3, 2, 0],
                               new_tokens=9, e2e_s=1.0, rejected=3), **kw)
  # Rounds of fewer than K = 3 drafts (an n-gram miss, a cut last round): exact with the count.
  got = aggregate.group_stats([row(), row(accepted=1, rejected=1, accepted_at=[1, 0, 0])], 3)
  assert got["alpha_token"] == pytest.approx(6 / (6 + 4))
  # A unit stored before the count: the K-based estimate, refused when a round drafted < K.
  old = row(rejected=None)
  assert aggregate.group_stats([old], 3)["alpha_token"] is None
  full = row(rejected=None, drafted=12, accepted_at=[3, 2, 1])
  assert aggregate.group_stats([full], 3)["alpha_token"] == pytest.approx(5 / (5 + 3))
  assert aggregate.group_stats([row()], "tree 2,2,4")["alpha_token"] is None
