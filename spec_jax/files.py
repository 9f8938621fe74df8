"""Files written atomically: a reader, or a run killed mid-write, sees the old file or the new
one, never half of one. Used by the governor's cost tables, the trainer, the bench and eval."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import tempfile


def _json_default(x):
  if hasattr(x, "tolist"):
    return x.tolist()
  if dataclasses.is_dataclass(x):
    return dataclasses.asdict(x)
  return str(x)


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def atomic_write_text(path, text: str) -> None:
  """Writes `text` to a temporary file beside `path`, then renames it over `path`: a reader (or
  a run killed mid-write) sees the old file or the new one, never half of one."""
  atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path, data: bytes) -> None:
  """atomic_write_text for bytes (PNG plots)."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    os.chmod(tmp, 0o666 & ~_umask())       # mkstemp makes 0600; results are for reading
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def atomic_write_json(path, data) -> None:
  """`data` as indented JSON (arrays via .tolist(), dataclasses as dicts), written atomically."""
  atomic_write_text(path, json.dumps(data, indent=1, default=_json_default) + "\n")
