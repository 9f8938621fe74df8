"""The training config's checks beyond its schema (train.config.validate calls them): the data
files, the numbers, the head kind's options and the evaluation settings, each a ValueError
before anything runs."""

from __future__ import annotations

import hashlib
import pathlib

from spec_jax.bench.prompts import PROMPT_SETS, source_path
from spec_jax.bench.specs import resolve_path
from spec_jax.drafters import registry


def check_data_files(cfg: dict) -> None:
  """The training text exists and is not evaluation data; the evaluation prompts exist. The
  training text may not be a prompt set (Spec-Bench, MT-bench, HumanEval, GSM8K: evaluation
  only), the held-out split (by name or by content) or the file the evaluation reads."""
  data, ev = cfg["data"], cfg["eval"]
  dev = str(data["dev_path"])
  uses_dev = bool({"generated", "text"} & set(data["sources"]))
  eval_file = None
  if ev["enabled"]:
    ep = str(ev["path"])
    try:
      eval_file = source_path(ep) if ep in PROMPT_SETS or ".jsonl" in ep else resolve_path(ep)
    except ValueError as e:
      raise ValueError(f"eval.path: {e}") from e
    if not eval_file.is_file():
      raise ValueError(f"eval.path {ep!r} is not a file (a text file of paragraphs, a .jsonl "
                       f"prompt set or one of {', '.join(PROMPT_SETS)})")
  if not uses_dev:
    return
  name = pathlib.Path(dev).name
  if dev in PROMPT_SETS or "heldout" in name or name.endswith((".jsonl", ".jsonl.gz", ".json")):
    raise ValueError(f"data.dev_path {dev!r} looks like evaluation data (the held-out split or "
                     f"a prompt set: {', '.join(PROMPT_SETS)}); they are for evaluation only")
  dev_file = resolve_path(dev)
  if not dev_file.is_file():
    raise ValueError(f"data.dev_path {dev!r} is not a file (the sources {data['sources']} read "
                     f"their prompts / text from it)")
  held_out = [resolve_path(PROMPT_SETS["tinystories"])]
  if eval_file is not None:
    held_out.append(eval_file)
  for other in held_out:
    if other.is_file() and (other.resolve() == dev_file.resolve() or _same_bytes(other, dev_file)):
      raise ValueError(f"data.dev_path {dev!r} is the evaluation text {str(other)!r} (same file "
                       f"or same contents): train and evaluate on different text")


def _same_bytes(a: pathlib.Path, b: pathlib.Path) -> bool:
  if a.stat().st_size != b.stat().st_size:
    return False
  digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()
  return digest(a) == digest(b)


def _number(section: dict, where: str, name: str, low: float, strict: bool = False,
            integer: bool = False):
  """section[name] checked as a number >= low (> low when strict); a YAML string such as
  "1e-3" (YAML 1.1 reads exponents without a dot as text) becomes the float it spells."""
  v = section[name]
  if isinstance(v, str) and not integer:
    try:
      v = section[name] = float(v)
    except ValueError:
      pass
  kinds = (int,) if integer else (int, float)
  if isinstance(v, bool) or not isinstance(v, kinds) or v < low or (strict and v == low):
    what = "an integer" if integer else "a number"
    raise ValueError(f"{where}.{name} must be {what} {'>' if strict else '>='} {low:g}, got "
                     f"{v!r}")


def _temperatures(section: dict, where: str, name: str, allow_none: bool = False) -> None:
  v = section[name]
  if v is None and allow_none:
    return
  if isinstance(v, (int, float, str)) and not isinstance(v, bool):
    v = section[name] = [v]
  if not isinstance(v, list) or not v:
    raise ValueError(f"{where}.{name} must be a non-empty list of temperatures >= 0, got {v!r}")
  for i in range(len(v)):
    _number(v, f"{where}.{name}", i, 0)


def check_numbers(cfg: dict) -> None:
  """The optimiser's and the losses' numbers, and the temperature lists (before anything runs:
  a string lr was a TypeError inside optax after the data was built)."""
  t = cfg["train"]
  _number(t, "train", "lr", 0, strict=True)
  _number(t, "train", "warmup_steps", 0, integer=True)
  for name in ("end_lr_ratio", "weight_decay", "clip_norm", "step_decay", "feature_weight",
               "ce_weight", "feature_noise"):
    _number(t, "train", name, 0)
  _temperatures(cfg["data"], "data", "temperatures")
  _temperatures(cfg["data"], "data", "gen_temperatures", allow_none=True)
  _temperatures(cfg["eval"], "eval", "temperatures")


def check_head_options(cfg: dict, head, head_defaults: dict) -> None:
  """A head option another kind takes, set away from its default, is refused (it was ignored:
  an EAGLE head with head.num_layers=3 trained one layer)."""
  own = {o.key for o in head.options} | {"num_draft"}      # num_draft: every kind's K
  for key in registry.option_defaults():
    default = head_defaults[key]
    if key not in own and cfg["head"].get(key, default) != default:
      takes = [k for k in registry.KINDS.values() if key in {o.key for o in k.options}]
      raise ValueError(f"head.{key} applies to {registry.labels(takes)} heads, not "
                       f"{head.label}")


def check_eval(cfg: dict, head) -> None:
  """eval.num_draft and eval.trees against the head kind (they were checked only after the
  training, by the evaluation that then failed)."""
  h, ev = cfg["head"], cfg["eval"]
  k = ev["num_draft"]
  if k is not None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
      raise ValueError(f"eval.num_draft must be an integer >= 1 or null (head.num_draft), got "
                       f"{k!r}")
    if head.name == "medusa" and k > h["num_draft"]:
      raise ValueError(f"eval.num_draft={k}: {h['num_draft']} Medusa heads draft at most "
                       f"{h['num_draft']} tokens")
    if head.loss in ("dflash", "dspark"):
      every_slot = head.name == "dspark" and h["readout"] in (None, "next")
      most = h["block_size"] - (0 if every_slot else 1)
      if k > most:
        raise ValueError(f"eval.num_draft={k}: a {head.label} block of {h['block_size']} drafts "
                         f"at most {most} tokens")
  if ev["trees"] and not head.tree:
    raise ValueError(f"eval.trees: {head.label} heads cannot build draft trees")


def check_dflash(cfg: dict) -> None:
  """The DFlash / DSpark loss's options (and the block it drafts in): checked before anything
  runs. A DFlash block of b drafts b - 1 tokens, a DSpark block b (slot k predicts x_(p+k+1))."""
  h, t = cfg["head"], cfg["train"]
  spark = h["kind"] == "dspark"
  label = "DSpark" if spark else "DFlash"
  for name, low in (("block_size", 2), ("num_layers", 1)):
    v = h[name]
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
      raise ValueError(f"head.{name} must be an integer >= {low} for {label}, got {v!r}")
  if spark and h["readout"] not in (None, "next", "mask"):
    raise ValueError(f"head.readout={h['readout']!r}; allowed: next (DeepSpec's: block_size "
                     f"drafts), mask (DFlash's: block_size - 1)")
  every_slot = spark and h["readout"] in (None, "next")
  most = h["block_size"] if every_slot else h["block_size"] - 1
  if h["num_draft"] > most:
    raise ValueError(f"head.num_draft={h['num_draft']}: a {label} block of {h['block_size']} "
                     f"drafts at most {'block_size' if every_slot else 'block_size - 1'} = "
                     f"{most} tokens")
  if spark:
    r = h["markov_rank"]
    if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
      raise ValueError(f"head.markov_rank must be an integer >= 0 (0: no Markov head), got "
                       f"{r!r}")
    if h["markov_head"] not in (None, "vanilla", "gated", "rnn"):
      raise ValueError(f"head.markov_head={h['markov_head']!r}; allowed: vanilla, gated, rnn")
    for name in ("l1_weight", "confidence_weight"):
      v = t[name]
      if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise ValueError(f"train.{name} must be a number >= 0, got {v!r}")
  n = t["num_anchors"]
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise ValueError(f"train.num_anchors must be an integer >= 1, got {n!r}")
  g = t["loss_gamma"]
  if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or g <= 0):
    raise ValueError(f"train.loss_gamma must be a positive number or null, got {g!r}")


def check_mesh(cfg: dict) -> None:
  """mesh.data / mesh.model: both None (no mesh) or integers >= 1 (a None beside an integer is
  1); the batch must divide over mesh.data."""
  mesh = cfg["mesh"]
  if mesh["data"] is None and mesh["model"] is None:
    return
  for name in ("data", "model"):
    n = mesh[name] = 1 if mesh[name] is None else mesh[name]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ValueError(f"mesh.{name} must be an integer >= 1 (or null), got {n!r}")
  b = cfg["train"]["batch_size"]
  if b % mesh["data"]:
    raise ValueError(f"train.batch_size {b} does not divide over mesh.data={mesh['data']}: make "
                     f"the batch a multiple of {mesh['data']}")
