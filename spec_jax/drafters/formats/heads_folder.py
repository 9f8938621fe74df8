"""The library's own heads folder: trained draft heads, bound to the target they were trained on.

A saved head is a folder:

    heads.json     metadata (written atomically): format, kind, num_draft (K trained for),
                   hyper_params, and the target's fingerprint (its ModelConfig fields, the
                   sha256 over the float32 bytes of every param leaf in tree order, and the
                   same over the weights rounded to bfloat16)
    params-<id>/   the head's params (an orbax StandardCheckpointer checkpoint), in a folder
                   of a fresh name that heads.json's "params" names (folders written before
                   it had the field: "params/")

A save is atomic: the params go to a new folder, then heads.json, renamed into place, switches
to it (the commit), then the folder it replaced is removed. A save killed at any point leaves
the old pair or the new pair, never the new weights under the old metadata.

`save(path, drafter, target, num_draft)` writes one (train.distill_heads does); `load(path,
target)` rebuilds the drafter of the saved kind (`spec_jax.drafters.registry.build`) and
refuses a different target with a ValueError that says what differs (the config, and which
fields, or the weights). The same checkpoint in another dtype is the same target: heads
trained on a float32 target load on its bfloat16 cast (the weights are compared at the
coarser of the two dtypes). `sj.drafters.load` routes here for a folder with heads.json
(`spec_jax.drafters.formats`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import uuid
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.drafters import registry
from spec_jax.drafters.base import in_target_dtype

FORMAT = "spec_jax.heads/1"
META = "heads.json"
PARAMS = "params"
# Runtime choices that do not change what the head was trained against.
_IGNORED_FIELDS = ("attention_impl",)


def is_heads_folder(path) -> bool:
  """Whether `path` holds a heads.json (a folder `save` wrote)."""
  return (pathlib.Path(path) / META).is_file()


def config_fields(config) -> dict:
  out = {}
  for k, v in dataclasses.asdict(config).items():
    if k in _IGNORED_FIELDS:
      continue
    out[k] = [list(x) if isinstance(x, tuple) else x for x in v] if isinstance(v, tuple) else v
  return json.loads(json.dumps(out))


def _field_defaults(config_type) -> dict:
  """The JSON form of every ModelConfig field that has a default."""
  out = {}
  for f in dataclasses.fields(config_type):
    if f.default is not dataclasses.MISSING:
      out[f.name] = f.default
    elif f.default_factory is not dataclasses.MISSING:
      out[f.name] = f.default_factory()
  out = {k: v for k, v in out.items() if k not in _IGNORED_FIELDS}
  return json.loads(json.dumps({k: [list(x) if isinstance(x, tuple) else x for x in v]
                                if isinstance(v, tuple) else v for k, v in out.items()}))


def weights_sha256(params, round_to: Optional[str] = None) -> str:
  """sha256 over the float32 little-endian bytes of every leaf, in jax.tree order; with
  round_to="bfloat16", of every floating leaf rounded to bfloat16 first (what a bf16 cast of
  the same weights hashes to)."""
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(params):
    if round_to is not None and jnp.issubdtype(leaf.dtype, jnp.floating):
      leaf = jnp.asarray(leaf).astype(round_to)
    arr = np.ascontiguousarray(np.asarray(leaf, dtype=np.float32))
    h.update(str(arr.shape).encode())
    h.update(arr.astype("<f4").tobytes())
  return h.hexdigest()


def fingerprint(model) -> dict:
  """{"config": ModelConfig fields, "sha256": weights checksum, "sha256_bfloat16": the checksum
  of the weights rounded to bfloat16} of a Model."""
  return {"config": config_fields(model.config), "sha256": weights_sha256(model.params),
          "sha256_bfloat16": weights_sha256(model.params, round_to="bfloat16")}


def check_fingerprint(saved: dict, model, what: str = "these heads") -> None:
  """Raises ValueError when `model` is not the target `saved` describes. The dtype is not part
  of the identity: a float32 target and its bfloat16 cast match at bfloat16 precision."""
  mine = config_fields(model.config)
  # A field added to ModelConfig after the heads were saved held its default then.
  theirs = {**_field_defaults(type(model.config)), **saved.get("config", {})}
  diff = sorted(k for k in set(mine) | set(theirs)
                if k != "dtype" and mine.get(k) != theirs.get(k))
  if diff:
    shown = "; ".join(f"{k}: trained on {theirs.get(k)!r}, given {mine.get(k)!r}"
                      for k in diff[:6])
    raise ValueError(f"{what} were trained on a different target: the config differs ({shown})")
  trained_dtype = theirs.get("dtype", model.config.dtype)
  if trained_dtype == model.config.dtype:
    sha, want = weights_sha256(model.params), saved.get("sha256")
  elif trained_dtype == "bfloat16":        # bf16 heads on an f32 target: compare in bf16
    sha, want = weights_sha256(model.params, round_to="bfloat16"), saved.get("sha256")
  else:                                    # f32 heads on a bf16 target
    want = saved.get("sha256_bfloat16")
    if want is None:
      raise ValueError(f"{what} were saved for a {trained_dtype} target without a bfloat16 "
                       f"checksum (an older heads.json): load them on the {trained_dtype} "
                       f"target, or save them again with this version")
    sha = weights_sha256(model.params, round_to="bfloat16")
  if sha != want:
    raise ValueError(f"{what} were trained on a different target: the configs match but the "
                     f"weights differ (sha256 {sha[:16]}... given, {str(want)[:16]}"
                     f"... at training time)")


def write_json_atomic(path: pathlib.Path, obj) -> None:
  """json.dump to `path` through a temporary file renamed into place (a reader never sees half)."""
  tmp = path.with_name(path.name + f".tmp{os.getpid()}")
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _this_process_only(ocp):
  """Heads are small host copies: each process reads them on its own, and process 0 alone
  writes them (train.distill_heads), with no barrier with the other processes of a
  multi-process run (which orbax would otherwise wait for)."""
  me = jax.process_index()
  return ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})


def save(path, drafter, target, num_draft: int, extra: Optional[dict] = None) -> pathlib.Path:
  """Saves `drafter` (a head of a registry kind) trained for `target` into folder `path`,
  atomically (module docstring)."""
  import orbax.checkpoint as ocp
  path = pathlib.Path(path).absolute()
  path.mkdir(parents=True, exist_ok=True)
  params_name = f"{PARAMS}-{uuid.uuid4().hex[:12]}"
  tmp_dir = path / (params_name + ".tmp")
  with ocp.StandardCheckpointer(multiprocessing_options=_this_process_only(ocp)) as ckpt:
    ckpt.save(tmp_dir, jax.tree.map(np.asarray, drafter.params))
    ckpt.wait_until_finished()
  os.replace(tmp_dir, path / params_name)
  meta = {"format": FORMAT, "kind": drafter.kind, "num_draft": int(num_draft),
          "hyper_params": drafter.hyper_params(), "target": fingerprint(target),
          "params": params_name}
  if extra:
    meta["extra"] = extra
  write_json_atomic(path / META, meta)          # the commit: heads.json now names the new folder
  for old in path.iterdir():                    # the replaced pair's params, and torn saves'
    if old.name != params_name and (old.name == PARAMS or old.name.startswith(PARAMS + "-")):
      shutil.rmtree(old, ignore_errors=True)
  return path


def params_folder(path: pathlib.Path, meta: dict) -> pathlib.Path:
  """The params folder heads.json names ("params/" for folders written before the field)."""
  name = meta.get("params", PARAMS)
  if (not isinstance(name, str) or not (name == PARAMS or name.startswith(PARAMS + "-"))
      or "/" in name or "\\" in name or name.endswith(".tmp")):
    raise ValueError(f"{path / META}: params {name!r} is not a params folder of this heads "
                     f"folder; allowed: 'params' or 'params-<id>'")
  return path / name


def load(path, target, greedy_drafts: bool = False):
  """The drafter saved at `path` (a folder with heads.json) for `target` (a Model), its params
  in the target's dtype when that is low-precision (base.in_target_dtype).

  Raises ValueError when `target` differs from the model the heads were trained on, or the
  folder's metadata is unreadable or of another format.
  """
  import orbax.checkpoint as ocp  # heavy; only heads folders need it
  path = pathlib.Path(os.fspath(path)).expanduser().absolute()
  try:
    meta = json.loads((path / META).read_text())
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"{path / META}: unreadable head metadata: {e}") from e
  if not isinstance(meta, dict):
    raise ValueError(f"{path / META}: head metadata must be a JSON object, got "
                     f"{type(meta).__name__}")
  if meta.get("format") != FORMAT:
    raise ValueError(f"{path / META}: format {meta.get('format')!r}, expected {FORMAT!r}")
  missing = [k for k in ("kind", "hyper_params", "target") if k not in meta]
  if missing:
    raise ValueError(f"{path / META}: head metadata lacks {', '.join(missing)}")
  check_fingerprint(meta["target"], target, what=f"the {meta['kind']} heads at {path}")
  kind = meta["kind"]
  if kind == "eagle3" and "draft_tokens" not in meta["hyper_params"]:
    # Saved before the public EAGLE-3 architecture took the name "eagle3" (every EAGLE3 since
    # writes draft_tokens): those heads are today's eagle3_fused.
    kind = "eagle3_fused"
  skeleton = registry.build(kind, target, meta["hyper_params"])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                          skeleton.params)
  folder = params_folder(path, meta)
  try:
    with ocp.StandardCheckpointer(multiprocessing_options=_this_process_only(ocp)) as ckpt:
      params = ckpt.restore(folder, abstract)
  except Exception as e:  # noqa: BLE001 - orbax raises many types for a missing or torn folder
    raise ValueError(f"{folder}: the heads' weights could not be read "
                     f"({e.__class__.__name__}: {e})") from e
  # orbax returns what is stored whatever shape the template says: weights saved with other
  # hyper-parameters (an edited heads.json) would otherwise load and decode.
  wrong = [f"{jax.tree_util.keystr(k)} {np.shape(got)} (expected {want.shape})"
           for (k, got), want in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                     jax.tree.leaves(abstract)) if np.shape(got) != want.shape]
  if wrong:
    raise ValueError(f"{path}: the stored weights do not match {META}'s hyper-parameters: "
                     + "; ".join(wrong[:4]))
  params = jax.tree.map(jax.numpy.asarray, params)
  drafter = skeleton.replace(params=params, greedy_drafts=bool(greedy_drafts),
                             trained_num_draft=int(meta.get("num_draft", 0)), source=str(path))
  return in_target_dtype(drafter, target)
