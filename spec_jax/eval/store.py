"""The run directory: what makes a killed evaluation resumable.

  DIR/manifest.json      the options that decide what a measurement means (the fingerprint)
  DIR/units/KEY.json     one measured batch: every configuration on the same prompts
  DIR/results.json, DIR/report.md, DIR/*.png   written at the end from the units

Every file is written atomically (temporary file + rename), so a killed run leaves whole files
only. A unit is reused when its file exists, its prompts are the same token ids (a hash), and
it holds every configuration asked for now; anything else is measured (again).
"""

from __future__ import annotations

import hashlib
import json
import pathlib

from spec_jax.files import atomic_write_json

EVAL_VERSION = 1


def prompt_hash(prompts) -> str:
  """A short hash of a batch's prompt token ids (filler rows included)."""
  h = hashlib.sha1()
  for ids in prompts:
    h.update(json.dumps(list(ids)).encode())
    h.update(b";")
  return h.hexdigest()[:16]


class RunDir:
  """DIR of one evaluation (see the module docstring)."""

  def __init__(self, path):
    self.path = pathlib.Path(path)
    if self.path.exists() and not self.path.is_dir():
      raise ValueError(f"--out {self.path} exists and is not a directory")

  @property
  def units_dir(self) -> pathlib.Path:
    return self.path / "units"

  def open(self, fingerprint: dict) -> None:
    """Creates DIR or checks that it holds a run with the same fingerprint (ValueError with the
    differing options otherwise)."""
    manifest = self.path / "manifest.json"
    fingerprint = dict(fingerprint, eval_version=EVAL_VERSION)
    if manifest.is_file():
      old = json.loads(manifest.read_text()).get("fingerprint", {})
      diff = sorted(k for k in set(old) | set(fingerprint) if old.get(k) != fingerprint.get(k))
      if diff:
        what = "; ".join(f"{k}: {old.get(k)!r} there, {fingerprint.get(k)!r} now" for k in diff)
        raise ValueError(f"{self.path} holds an evaluation with other options ({what}); give "
                         f"another --out, or delete that directory to start afresh")
    atomic_write_json(manifest, {"fingerprint": fingerprint})
    self.units_dir.mkdir(parents=True, exist_ok=True)

  def unit_path(self, key: str) -> pathlib.Path:
    return self.units_dir / f"{key}.json"

  def load_unit(self, key: str, phash: str, config_keys) -> dict:
    """The stored unit if it can be reused (same prompts, every configuration), else None."""
    path = self.unit_path(key)
    if not path.is_file():
      return None
    try:
      unit = json.loads(path.read_text())
    except json.JSONDecodeError:
      return None
    if unit.get("prompt_hash") != phash or not set(config_keys) <= set(unit.get("configs", {})):
      return None
    return unit

  def save_unit(self, key: str, unit: dict) -> None:
    atomic_write_json(self.unit_path(key), unit)
