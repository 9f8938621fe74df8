"""Multi-process runs on this CPU: python -m spec_jax.launch starts 2 processes x 4 fake CPU
devices joined by jax.distributed (gloo collectives), the code path of a TPU pod slice.

Every result is compared with one process on one device (this pytest process): generate's
tokens (greedy and sampled rows, EAGLE-3 heads), the CLI's printed text, the eval
harness's answers, and distill_heads' per-step losses (also on 8 devices of one process).
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
import yaml

import spec_jax as sj
from spec_jax import distributed, launch, sharding
from train import distill_heads
from train.config import load_config

from .conftest import DATA, MODELS, ROOT, need_shared


def _env(**extra) -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
  env.update(extra)
  return env


def run_launch(args, processes=2, devices=4, timeout=600, env=None):
  """python -m spec_jax.launch ... -- args, from the repository root."""
  cmd = [sys.executable, "-m", "spec_jax.launch", "--processes", str(processes),
         "--devices-per-process", str(devices), "--", *map(str, args)]
  return subprocess.run(cmd, cwd=ROOT, env=env or _env(), capture_output=True, text=True,
                        timeout=timeout)


def _show(res) -> str:
  return f"status {res.returncode}\nstdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-4000:]}"


# ----------------------------------------------------------------------------- fast checks

def test_launcher_environment_output_and_failures(tmp_path):
  script = tmp_path / "child.py"
  script.write_text(textwrap.dedent("""
      import os, sys, time
      i = int(os.environ["SPEC_JAX_PROCESS_ID"])
      print("child", i, os.environ["SPEC_JAX_NUM_PROCESSES"], os.environ["SPEC_JAX_COORDINATOR"],
            os.environ["JAX_PLATFORMS"], os.environ["XLA_FLAGS"], flush=True)
      print("[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer "
            "ranks is : 1", flush=True)
      if sys.argv[1] == "fail" and i == 1:
        print("process 1 gives up", file=sys.stderr, flush=True)
        sys.exit(3)
      if sys.argv[1] == "fail":
        time.sleep(120)                     # stopped by the launcher long before this ends
  """))
  env = _env(XLA_FLAGS="--xla_force_host_platform_device_count=9 --xla_cpu_foo=1")
  ok = run_launch(["python", script, "ok"], processes=3, devices=2, env=env, timeout=60)
  assert ok.returncode == 0, _show(ok)
  lines = ok.stdout.splitlines()
  assert len(lines) == 1 and lines[0].startswith("child 0 3 127.0.0.1:"), ok.stdout   # process 0 only
  assert lines[0].endswith(" cpu --xla_cpu_foo=1 --xla_force_host_platform_device_count=2")
  started = time.time()
  bad = run_launch(["python", script, "fail"], processes=2, devices=1, env=env, timeout=100)
  assert bad.returncode == 3, _show(bad)
  assert time.time() - started < 60                      # process 0 was stopped, not waited for
  assert "[process 1] process 1 gives up" in bad.stderr
  assert "process 1 failed with status 3" in bad.stderr
  assert launch.main(["--processes", "2"]) == 2          # no command
  assert launch.main(["--processes", "0", "--", "true"]) == 2


def test_gloo_noise_filter_takes_interleaved_pieces_only():
  """gloo's connection lines from two threads interleave at any piece boundary (seen in CI);
  such a line is dropped, a line of the command's own text never is."""
  interleaved = ("[Gloo] Rank 1[Gloo] Rank 0 is connected to  is connected to 77 peer ranks.  "
                 "peer ranks. Expected number of connected peer ranks is : Expected number of "
                 "connected peer ranks is : 77")
  assert launch.NOISE.match(interleaved)
  assert launch.NOISE.match("[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of "
                            "connected peer ranks is : 1")
  for text in ("Once upon a time 7 peer ranks.", "The cat and 3 year Tom bec", "", "12 34"):
    assert not launch.NOISE.match(text), text
  # A line left with only a gloo line's digits ("7", seen at the top of a launched generate's
  # output) is dropped right after gloo's lines; the command's own digits never are.
  lines = ["12 34\n", "[Gloo] Rank 1[Gloo] Rank 0 is connected to  is connected to 7\n",
           "7\n", "\n", " 7 \n", "Once upon a time\n", "7\n", "[Gloo] Rank 0 is connected to 1 "
           "peer ranks. Expected number of connected peer ranks is : 1\n", "The end\n", "8\n"]
  gloo = launch.GlooFilter()
  assert [line for line in lines if gloo.keep(line)] == [
      "12 34\n", "\n", "Once upon a time\n", "7\n", "The end\n", "8\n"]
  # A result made of digits right after gloo's lines is the command's (a regex-constrained
  # "2024 2000" was dropped): only a rank number's piece (<= 3 digits) is gloo's.
  gloo = launch.GlooFilter()
  lines = ["[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer "
           "ranks is : 1\n", "2024 2000\n", "\n", "4 new tokens\n"]
  assert [line for line in lines if gloo.keep(line)] == lines[1:]


def test_launcher_output_all_prefixes_every_process(tmp_path):
  script = tmp_path / "hello.py"
  script.write_text("import os\nprint('hello from', os.environ['SPEC_JAX_PROCESS_ID'])\n")
  cmd = [sys.executable, "-m", "spec_jax.launch", "--processes", "2", "--output", "all", "--",
         "python", str(script)]
  res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
  assert res.returncode == 0
  assert sorted(res.stdout.splitlines()) == ["[process 0] hello from 0", "[process 1] hello from 1"]


def test_distributed_settings_and_mesh_specs():
  assert distributed.settings_from_env({}) is None
  assert distributed.settings_from_env({"SPEC_JAX_DISTRIBUTED": "auto"}) == {}
  env = {"SPEC_JAX_COORDINATOR": "10.0.0.1:1234", "SPEC_JAX_NUM_PROCESSES": "4",
         "SPEC_JAX_PROCESS_ID": "3"}
  assert distributed.settings_from_env(env) == {
      "coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3}
  with pytest.raises(ValueError, match="incomplete.*SPEC_JAX_PROCESS_ID missing"):
    distributed.settings_from_env({k: v for k, v in env.items() if k != "SPEC_JAX_PROCESS_ID"})
  with pytest.raises(ValueError, match="0 <= SPEC_JAX_PROCESS_ID"):
    distributed.settings_from_env(dict(env, SPEC_JAX_PROCESS_ID="4"))
  assert distributed.share(list("abcde"), 0, 2) == ["a", "b"]
  assert distributed.share(list("abcde"), 1, 2) == ["c", "d", "e"]
  assert distributed.fingerprint({"a": 1, "b": [2]}) == distributed.fingerprint({"b": [2], "a": 1})
  assert sharding.parse_mesh_spec("data=8,model=1") == {"data": 8, "model": 1}
  assert sharding.parse_mesh_spec("data=2") == {"data": 2, "model": 1}
  for bad in ("batch=8", "data=8,data=2", "data=0", "data=x", "data8"):
    with pytest.raises(ValueError, match="mesh"):
      sharding.parse_mesh_spec(bad)
  with pytest.raises(ValueError, match="needs 8 devices; there are 1"):
    sharding.make_mesh(data=8, model=1)


def test_cli_memory_estimate_is_the_global_batchs(monkeypatch, capsys):
  """Under the launcher each process feeds its share of the prompts, but every process decodes
  the global batch: the CLI estimated from its share (off both ways per device) and a process
  with no share (one prompt over two processes) failed with "prompts must be a non-empty
  list". Here a share of the second prompt only must print the whole batch's estimate."""
  from spec_jax.__main__ import main
  model = str(need_shared("models", "stories260K"))
  argv = ["generate", "--model", model, "--max-new-tokens", "4",
          "--prompt", "Once upon a time there was a little girl named Lily who loved to play",
          "--prompt", "Hi"]
  estimate = lambda err: [line for line in err.splitlines() if line.startswith("memory")]
  assert main(argv) == 0
  whole = estimate(capsys.readouterr().err)
  monkeypatch.setattr(distributed, "share", lambda prompts: prompts[1:])
  assert main(argv) == 0
  assert estimate(capsys.readouterr().err) == whole and whole


def test_single_layer_head_weights_get_shardings():
  """EAGLE / EAGLE-3 / MTP heads hold 2-D single-layer weights (wq [D, H*Dh], not [L, D, H*Dh]):
  the model axis is found from the end, so they shard like the target's layers (this raised
  IndexError before)."""
  cfg = sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2)
  target = sj.init_model(cfg, jax.random.key(0))
  head = sj.drafters.EAGLE3.init(target, key=jax.random.key(1))
  specs = sharding.param_shardings(jax.make_mesh((1, 1), ("data", "model")), head.params)
  assert specs["layer"]["wq"].spec == jax.sharding.PartitionSpec(None, "model")
  assert specs["layer"]["wo"].spec == jax.sharding.PartitionSpec("model", None)
  stacked = sharding.param_shardings(jax.make_mesh((1, 1), ("data", "model")), target.params)
  assert stacked["layers"]["wq"].spec == jax.sharding.PartitionSpec(None, None, "model")
  assert stacked["embed"].spec == jax.sharding.PartitionSpec("model", None)


def test_distill_mesh_config_errors(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_text(yaml.safe_dump({"target": "x", "out_dir": str(tmp_path / "o"),
                                  "train": {"batch_size": 6}}))
  with pytest.raises(ValueError, match="batch_size 6 does not divide over mesh.data=4"):
    load_config(path, ["mesh.data=4"])
  with pytest.raises(ValueError, match="unknown key 'mesh.batch'"):
    load_config(path, ["mesh.batch=4"])
  with pytest.raises(ValueError, match="mesh.model must be an integer >= 1"):
    load_config(path, ["mesh.model=0"])
  assert load_config(path, ["mesh.data=2"])["mesh"] == {"data": 2, "model": 1}
  assert load_config(path)["mesh"] == {"data": None, "model": None}


# ----------------------------------------------------------------------------- generate

GENERATE = textwrap.dedent("""
    import json, pathlib, sys
    from spec_jax import distributed
    distributed.initialize()
    import jax
    import spec_jax as sj
    from spec_jax import sharding

    out_dir, models = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    pid = jax.process_index()
    assert jax.process_count() == 2 and jax.device_count() == 8
    target = sj.load(models / "stories260K")
    drafters = {"eagle3": sj.drafters.EAGLE3.init(target, key=jax.random.key(5), init_std=0.5)}
    prompts = json.loads(sys.argv[3])
    mine = prompts[:3] if pid == 0 else prompts[3:]       # uneven shares: 3 and 5 rows
    mesh = sharding.make_mesh(data=4, model=2)
    temps = [0.0, 1.0] * 4
    mine_temps = temps[:3] if pid == 0 else temps[3:]
    res = {}
    for name, sampling in [("eagle3", sj.Sampling(mine_temps))]:
      out = sj.generate(target, mine, drafter=drafters[name], num_draft=3, max_new_tokens=10,
                        sampling=sampling, key=jax.random.key(7), stop_tokens=[], mesh=mesh)
      s = out.stats
      res[name] = {"mine": out.tokens, "rows": [out.rows.start, out.rows.stop],
                   "every": sj.new_tokens(out.result), "processes": s.processes,
                   "counts": [s.rounds, s.drafted, s.accepted, s.new_tokens]}
    errors = {}
    def expect(name, fn):
      try:
        fn()
      except ValueError as e:
        errors[name] = str(e)
    expect("disagree", lambda: sj.generate(target, mine, max_new_tokens=4 + pid, mesh=mesh))
    expect("indivisible", lambda: sj.generate(target, [[1, 2]], max_new_tokens=4, mesh=mesh))
    expect("axes", lambda: sj.generate(target, mine, max_new_tokens=4,
                                       mesh=jax.make_mesh((8,), ("batch",))))
    expect("bad_prompt", lambda: sj.generate(target, mine if pid == 0 else [[1, 9999]],
                                             max_new_tokens=4, mesh=mesh))
    res["errors"] = errors
    (out_dir / f"process{pid}.json").write_text(json.dumps(res))
""")

PROMPTS = [[1, 5, 7, 9, 5, 7], [1, 3], [1, 2, 3, 4, 5], [1, 9, 9], [1, 4, 4, 4, 2, 1, 4, 4],
           [1], [1, 6, 6], [1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3]]


# One generate per process: sampled rows (T=1) beside greedy rows (T=0). A draft model's static
# greedy loop on a process-spanning mesh was a second one (~28 CPU-s): a draft model on a
# data=4,model=2 mesh is test_sharding.py::test_generate_on_eight_cpu_devices_matches_one_device's,
# the static greedy loop under the launcher test_eval_under_the_launcher_matches_one_process's.
@pytest.mark.slow   # 2 processes x 1 compile of the sharded loop, 1 here (~1 min)
def test_generate_on_two_processes_matches_one_device(tmp_path):
  """Sampled rows (T=1) beside greedy rows (T=0) with EAGLE-3 heads, the same key: every row's
  tokens as one device generates them."""
  need_shared("models", "stories260K")
  script = tmp_path / "generate.py"
  script.write_text(GENERATE)
  res = run_launch(["python", script, tmp_path, MODELS, json.dumps(PROMPTS)])
  assert res.returncode == 0, _show(res)
  got = [json.loads((tmp_path / f"process{p}.json").read_text()) for p in (0, 1)]

  target = sj.load(MODELS / "stories260K")
  drafters = {"eagle3": sj.drafters.EAGLE3.init(target, key=jax.random.key(5), init_std=0.5)}
  for name, sampling in [("eagle3", sj.Sampling([0.0, 1.0] * 4))]:
    one = sj.generate(target, PROMPTS, drafter=drafters[name], num_draft=3, max_new_tokens=10,
                      sampling=sampling, key=jax.random.key(7), stop_tokens=[])
    first, second = got[0][name], got[1][name]
    assert first["every"] == second["every"] == one.tokens, name
    assert first["mine"] == one.tokens[:3] and second["mine"] == one.tokens[3:]
    assert first["rows"] == [0, 3] and second["rows"] == [3, 8]
    s = one.stats
    assert first["counts"] == second["counts"] == [s.rounds, s.drafted, s.accepted,
                                                   s.new_tokens]     # global statistics
    assert first["processes"] == 2 and s.processes == 1
    assert s.accepted > 0, name                    # the drafts are exercised, not all refused
  for p in (0, 1):
    errors = got[p]["errors"]
    assert "processes disagree on generate()'s max_new_tokens" in errors["disagree"]
    assert "batch of 2 rows does not divide over the mesh's data axis of size 4" in (
        errors["indivisible"])
    assert "mesh needs axes named 'data' and 'model'" in errors["axes"]
  assert "process(es) [1] refused their prompts" in got[0]["errors"]["bad_prompt"]
  assert "outside the vocabulary" in got[1]["errors"]["bad_prompt"]


CLI_PROMPTS = ["Once upon a time", "The cat", "Lily was", "One day", "Tom", "A big dog",
               "The sun", "Mom said"]


@pytest.mark.slow   # two launches, one compile (~1 min)
def test_cli_generate_under_the_launcher_prints_what_one_process_prints():
  model = need_shared("models", "stories260K")
  args = ["python", "-m", "spec_jax", "generate", "--model", model, "--max-new-tokens", "10",
          "--drafter", "ngram", "--temperature", "1", "--seed", "3"]
  for p in CLI_PROMPTS:
    args += ["--prompt", p]
  res = run_launch(args + ["--mesh", "data=8,model=1"])
  assert res.returncode == 0, _show(res)
  target = sj.load(model)
  one = sj.generate(target, CLI_PROMPTS, drafter=sj.drafters.NGram(), num_draft=4,
                    max_new_tokens=10, sampling=sj.Sampling(1.0), key=jax.random.key(3))
  expected = "".join(f"{p}{t}\n\n" for p, t in zip(CLI_PROMPTS, one.text))
  printed = res.stdout.lstrip("\n")     # (a blank line may be left of gloo's messages)
  assert printed.startswith(expected), res.stdout
  tail = printed[len(expected):]
  assert f"{one.stats.new_tokens} new tokens (all 2 processes)" in tail
  assert f"accepted={one.stats.accepted} " in tail and "summed over 2 processes" in tail
  no_mesh = run_launch(args, timeout=300)
  assert no_mesh.returncode == 2 and "give --mesh data=N,model=M" in no_mesh.stderr



def test_cli_chat_with_a_process_that_has_no_row(tmp_path):
  """One chat prompt over two processes: the second's share is empty, which generate refused
  for messages ("messages must be a non-empty list") where it allows it for prompts."""
  from tests.chat_helpers import chat_folder
  folder = chat_folder(tmp_path / "chat", "chatml")
  args = ["python", "-m", "spec_jax", "generate", "--model", folder, "--chat", "--prompt",
          "Hello there", "--max-new-tokens", "3", "--mesh", "data=1,model=2"]
  res = run_launch(args, devices=1, timeout=300)
  assert res.returncode == 0, _show(res)
  assert "> Hello there" in res.stdout and "3 new tokens (all 2 processes)" in res.stdout


# ----------------------------------------------------------------------------- eval

EVAL_PROMPTS = [
    {"question_id": "a1", "category": "alpha", "turns": ["Once upon a time there was a cat."]},
    {"question_id": "a2", "category": "alpha", "turns": ["Lily had a red ball."]},
    {"question_id": "b1", "category": "beta", "turns": ["Tom had a red ball.",
                                                        "What happened next?"]},
]


@pytest.mark.slow   # one launch measuring one batch, plus the same evaluation here (~1.5 min)
def test_eval_under_the_launcher_matches_one_process(tmp_path):
  from spec_jax.eval import cli
  model = need_shared("models", "stories260K")
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps(p) + "\n" for p in EVAL_PROMPTS))
  argv = ["--target", str(model), "--drafter", "ngram", "--prompts", str(prompts), "--batch",
          "8", "--max-new-tokens", "6", "--no-progress"]
  one_dir, multi_dir = tmp_path / "one", tmp_path / "multi"
  assert cli.main(argv + ["--out", str(one_dir)]) == 0
  one = json.loads((one_dir / "results.json").read_text())
  # The multi-process run resumes a copy holding turn 1 only: process 0 reads that unit and
  # sends it (and the answers turn 2's prompts are built from) to process 1; turn 2 is measured.
  multi_dir.mkdir()
  shutil.copy(one_dir / "manifest.json", multi_dir)
  shutil.copytree(one_dir / "units", multi_dir / "units",
                  ignore=lambda d, names: [n for n in names if n.startswith("turn2")])
  res = run_launch(["python", "-m", "spec_jax.eval", *argv, "--out", multi_dir,
                    "--mesh", "data=8,model=1"])
  assert res.returncode == 0, _show(res)
  assert "greedy check: passed" in res.stdout and "written:" in res.stdout
  multi = json.loads((multi_dir / "results.json").read_text())
  assert multi["run"] == dict(multi["run"], units=2, units_measured=1, units_reused=1)
  assert multi["machine"]["processes"] == 2 and multi["options"]["mesh"] == "data=8,model=1"
  assert multi["answers"] == one["answers"]
  counts = lambda r: [(q["id"], q["turn"], q["config"], q.get("new_tokens"), q.get("rounds"),
                       q.get("accepted")) for q in r["requests"]]
  assert counts(multi) == counts(one)
  assert not list(multi_dir.glob("*.tmp*"))
  assert cli.main(argv + ["--out", str(tmp_path / "x"), "--mesh", "data=three"]) == 2
  assert cli.main(argv + ["--batch", "2", "--out", str(tmp_path / "x"), "--mesh", "data=4"]) == 2


# ----------------------------------------------------------------------------- distill_heads

def distill_config(tmp_path, name: str, steps: int, **train) -> pathlib.Path:
  need_shared("models", "stories260K")
  cfg = {"target": str(MODELS / "stories260K"), "out_dir": str(tmp_path / name), "seed": 0,
         "head": {"kind": "eagle3", "num_draft": 2},
         "data": {"sources": ["text"], "dev_path": str(DATA / "tinystories" / "dev.txt"),
                  "text_paragraphs": 40, "window": 16, "cache_dir": str(tmp_path / "cache")},
         "train": {"steps": steps, "batch_size": 8, "lr": 1e-2, "warmup_steps": 2,
                   "ttt_steps": 2, "log_every": 10, **train},
         "eval": {"enabled": False}}
  path = tmp_path / f"{name}.yaml"
  path.write_text(yaml.safe_dump(cfg))
  return path


def assert_same_losses(got: dict, want: dict, steps: int) -> None:
  got = {int(k): v for k, v in got.items()}
  want = {int(k): v for k, v in want.items()}
  assert sorted(got) == sorted(want) == list(range(1, steps + 1))
  for step in want:
    assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got[step], want[step])


EIGHT_DEVICES = textwrap.dedent("""
    import json, sys
    import jax
    from train import distill_heads
    assert jax.device_count() == 8
    path = sys.argv[1]
    first = distill_heads.main(["--config", path, "--set", "mesh.data=8",
                                "--set", "train.stop_after=8"])
    assert first["stopped"] and first["end_step"] == 8 and first["devices"] == 8
    second = distill_heads.main(["--config", path, "--set", "mesh.data=8"])
    assert second["start_step"] == 8 and second["end_step"] == 12
    print("RESULT", json.dumps({"final": second["final"]["loss"]}))
""")


DISTILL_STEPS = 12      # checkpoints at 4 and 8; the multi-device runs stop after 8 and resume


@pytest.fixture(scope="module")
def one_device_distill(tmp_path_factory):
  """distill_heads on this process's one device, DISTILL_STEPS steps: the reference both
  multi-device tests compare their losses and heads with."""
  tmp = tmp_path_factory.mktemp("one_device")
  return distill_heads.main(["--config", str(distill_config(tmp, "one", DISTILL_STEPS,
                                                           checkpoint_every=4))])


@pytest.mark.slow   # 8 + 4 (resumed) steps on 8 devices, one subprocess (~30 s)
def test_distill_on_eight_devices_matches_one_device_and_resumes(tmp_path, one_device_distill):
  one = one_device_distill
  path = distill_config(tmp_path, "eight", DISTILL_STEPS, checkpoint_every=4)
  script = tmp_path / "eight.py"
  script.write_text(EIGHT_DEVICES)
  flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  res = subprocess.run([sys.executable, str(script), str(path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env=_env(XLA_FLAGS=flags, JAX_PLATFORMS="cpu"))
  assert res.returncode == 0, _show(res)
  final = json.loads(res.stdout.split("RESULT", 1)[1])["final"]
  losses = json.loads((tmp_path / "eight" / "losses.json").read_text())["losses"]
  assert_same_losses(losses, one["losses"], DISTILL_STEPS)
  assert abs(final - one["final"]["loss"]) <= 1e-5 * abs(one["final"]["loss"])


@pytest.mark.slow   # two launches of 8 (+ 4 resumed) steps (~1.5 min)
def test_distill_on_two_processes_checkpoints_resumes_and_matches_one_device(
    tmp_path, one_device_distill):
  steps, one = DISTILL_STEPS, one_device_distill
  path = distill_config(tmp_path, "multi", steps, checkpoint_every=4)
  cmd = ["python", "-m", "train.distill_heads", "--config", path, "--set", "mesh.data=8"]
  first = run_launch(cmd + ["--set", "train.stop_after=8"])
  assert first.returncode == 0, _show(first)
  assert "stopped after step 8" in first.stderr
  assert sorted(p.name for p in (tmp_path / "multi" / "checkpoints").iterdir()
                if p.name.isdigit()) == ["4", "8"]
  second = run_launch(cmd)
  assert second.returncode == 0, _show(second)
  assert "resuming from" in second.stderr and "at step 8" in second.stderr
  losses = json.loads((tmp_path / "multi" / "losses.json").read_text())["losses"]
  assert_same_losses(losses, one["losses"], steps)
  trained = sj.drafters.load(tmp_path / "multi", sj.load(MODELS / "stories260K"))
  for a, b in zip(jax.tree.leaves(trained.params), jax.tree.leaves(one["params"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
  # Processes that disagree on the config stop before anything is compiled.
  disagree = run_launch(["bash", "-c", f"exec {sys.executable} -m train.distill_heads "
                         f"--config {path} --set mesh.data=8 --set out_dir={tmp_path / 'bad'} "
                         "--set train.lr=0.01$SPEC_JAX_PROCESS_ID"], timeout=300)
  assert disagree.returncode == 2, _show(disagree)
  assert "processes disagree on the training config: train differ" in disagree.stderr
