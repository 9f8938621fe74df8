"""Mutation check: one-line bugs in the engine, the sampler and the drafters must each make
the tests aimed at them fail.

Each mutant replaces one line of a copy of the package (in a temporary folder) and runs only its
targeted tests there, in a fresh interpreter (`python -m pytest <ids> -x`, the copy shadowing the
installed package because it is the working directory). The run must end with failed tests
(exit status 1), not with a collection or usage error (2, 4, 5: the mutant or the test ids are
broken, which would prove nothing). The unmutated targeted tests are part of the suite itself;
here their ids are checked to exist (collection succeeds on the unmutated copy).

These mutants are the ones tests once let through (issue 15) plus the classic places where a
speculative decoder goes wrong; add one when a bug is found that a test should have caught.
"""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, SHARED

# id (what the bug is above it): (file, the exact line (must occur once), its replacement,
# targeted test ids)
MUTANTS = {
    # commit: no cut after a stop token inside the block
    "commit-stop-cut": (
        "spec_jax/decoding/rounds.py",
        "  n_emit = jnp.minimum(n_emit, first_stop + 1)\n",
        "  n_emit = n_emit\n",
        ["tests/test_engine.py::test_stop_token_inside_an_accepted_block_ends_the_row"]),
    # commit: the block written one slot early
    "commit-offset": (
        "spec_jax/decoding/rounds.py",
        "      tokens, emitted, lengths)\n",
        "      tokens, emitted, lengths - 1)\n",
        ["tests/test_engine.py::test_plain_decoding_matches_full_forward_argmax"]),
    # stats: drafts thrown away by a cut counted as accepted
    "stats-cut-accepted": (
        "spec_jax/decoding/rounds.py",
        "  n_used = jnp.minimum(n_emit, n_accepted) * active\n",
        "  n_used = n_accepted * active\n",
        ["tests/test_engine.py::test_stats_count_only_what_a_cut_block_emitted"]),
    # capacity: the bound one slot short
    "capacity-bound": (
        "spec_jax/decoding/checks.py",
        "  needed = longest_prompt + max_new_tokens + k + 1\n",
        "  needed = longest_prompt + max_new_tokens + k - 1\n",
        ["tests/test_engine.py::test_capacity_exactly_what_is_needed"]),
    # rejection: n == draft_lengths < K taken for a rejection
    "rejection-draft-lengths": (
        "spec_jax/rejection.py",
        "    rejected = n_accepted < lengths ",
        "    rejected = n_accepted < num_draft ",
        ["tests/test_rejection.py::test_bonus_after_fewer_than_k_drafts_follows_p_there"]),
    # rejection: correction drawn from p instead of max(p - q, 0)
    "rejection-residual": (
        "spec_jax/rejection.py",
        "    residual = jnp.maximum(p_final - q_final, 0.0)\n",
        "    residual = p_final\n",
        ["tests/test_rejection.py::test_lossless_against_known_p_q[1]"]),
    # rejection: the bonus drawn from the last draft's position
    "rejection-bonus-position": (
        "spec_jax/rejection.py",
        "  p_final = jnp.take_along_axis(p, n_accepted[:, None, None], axis=1)[:, 0]",
        "  p_final = jnp.take_along_axis(p, jnp.minimum(n_accepted, max(num_draft - 1, 0))"
        "[:, None, None], axis=1)[:, 0]",
        ["tests/test_rejection.py::test_lossless_against_known_p_q[1]"]),
    # sampling: top-p's mass from the top in float32 (it reaches 1.0 before the tail)
    "sampling-top-p-running-sum": (
        "spec_jax/sampling.py",
        "      lambda t: jnp.sum(jnp.where(keys <= t, p, 0.0), axis=-1, keepdims=True) > tail,\n",
        "      lambda t: 1.0 - jnp.sum(jnp.where(keys > t, p, 0.0), axis=-1, keepdims=True) > tail,"
        "\n",
        ["tests/test_sampling.py::test_top_p_below_one_is_exact_in_a_long_float32_tail"]),
    # feature heads: commit keeps the feature of slot 0, not n_accepted
    "feature-head-stale-commit": (
        "spec_jax/drafters/feature_head.py",
        "    last = jnp.take_along_axis(o, n_accepted[:, None, None], axis=1)[:, 0]\n",
        "    last = jnp.take_along_axis(o, 0 * n_accepted[:, None, None], axis=1)[:, 0]\n",
        ["tests/test_heads.py::test_agreeing_heads_through_the_engine[mtp]"]),
    # medusa: commit keeps the hidden state of slot 0
    "medusa-stale-commit": (
        "spec_jax/drafters/medusa.py",
        "    idx = n_accepted[:, None, None]\n",
        "    idx = 0 * n_accepted[:, None, None]\n",
        ["tests/test_heads.py::test_agreeing_heads_through_the_engine[medusa]"]),
    # mtp: enorm and hnorm swapped
    "mtp-norms-swapped": (
        "spec_jax/drafters/feature_head.py",
        '      cat = jnp.concatenate([rms_norm(e, params["enorm"], eps),\n',
        '      cat = jnp.concatenate([rms_norm(e, params["hnorm"], eps),\n',
        ["tests/test_heads.py::test_native_mtp_matches_an_independent_torch_forward[deepseek]"]),
}

_COPIED = ("spec_jax", "kernels_pallas", "train", "tests", "configs", "pyproject.toml")


def _copy_repo(dest: pathlib.Path) -> pathlib.Path:
  dest.mkdir(parents=True, exist_ok=True)
  for name in _COPIED:
    src = ROOT / name
    if src.is_dir():
      shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    elif src.exists():
      shutil.copy2(src, dest / name)
  return dest


def _pytest(repo: pathlib.Path, args, timeout=900):
  env = dict(os.environ)
  env["SPEC_JAX_SHARED"] = str(SHARED)
  env.pop("PYTEST_ADDOPTS", None)
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         *args]
  return subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)


def test_every_targeted_test_id_exists():
  repo = _copy_repo(pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"spec_jax_ids_{os.getpid()}")
  try:
    ids = sorted({t for *_, targets in MUTANTS.values() for t in targets})
    res = _pytest(repo, ["--collect-only", *ids], timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for (path, line, _, _) in MUTANTS.values():
      assert (ROOT / path).read_text().count(line) == 1, (path, line)
  finally:
    shutil.rmtree(repo, ignore_errors=True)


@pytest.mark.slow   # one fresh interpreter + the targeted tests per mutant (~15-40 s each)
@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_is_caught(name, tmp_path):
  path, line, replacement, targets = MUTANTS[name]
  repo = _copy_repo(tmp_path / "repo")
  source = (repo / path).read_text()
  assert source.count(line) == 1, f"the line to mutate is not in {path} exactly once: {line!r}"
  (repo / path).write_text(source.replace(line, replacement))
  res = _pytest(repo, ["-x", *targets])
  out = res.stdout[-3000:] + res.stderr[-2000:]
  assert res.returncode == 1 and "failed" in res.stdout, (
      f"mutant not caught ({name}): exit status {res.returncode}\n{out}")
