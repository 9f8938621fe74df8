"""Training configs: YAML files checked against a schema of defaults, plus --set overrides.

    config = load_config("configs/distill_eagle.yaml", ["train.steps=200", "head.num_draft=6"])

Every key must be one of DEFAULTS' (unknown keys raise ValueError naming the allowed ones);
`target` and `out_dir` are required. Values given with --set are parsed as YAML scalars/lists.
The `head:` section is the head kind's: its kind, K, and every option a registry kind's init
takes (spec_jax.drafters.registry: a new kind's options appear here without an edit).
"""

from __future__ import annotations

import copy
import hashlib
import pathlib
from typing import Optional, Sequence

import yaml

from spec_jax.bench.prompts import PROMPT_SETS, source_path
from spec_jax.bench.specs import resolve_path
from spec_jax.drafters import registry
from spec_jax.tree import parse_tree_spec
from train import losses


DEFAULTS = {
    "target": None,            # path of the frozen target (sj.load)
    "target_dtype": None,      # its weights: None (as stored; GGUF: float32) | float32 | bfloat16
    "out_dir": None,           # checkpoints/, heads/, eval.json go here
    "seed": 0,
    "mesh": {                  # data parallelism (and the target's tensor parallelism)
        "data": None,          # batch rows over this many devices (None and model None: no mesh)
        "model": None,         # the frozen target's heads / MLP / vocabulary over this many
    },                         # data x model = every device of every process
    "head": {
        **registry.option_defaults(),   # every kind's init options (registry.KINDS)
        "kind": "eagle",       # a registry kind: medusa | eagle | eagle3 | eagle3_fused | mtp |
                               # dflash | dspark
        "num_draft": 4,        # K: Medusa heads / the K the final evaluation drafts with
                               # (DFlash: <= block_size - 1; DSpark: <= block_size)
        "draft_vocab_size": None,  # EAGLE-3 draft vocabulary: the N most frequent target tokens
                                   # of the training data (None: the whole vocabulary)
    },
    "data": {
        "sources": ["generated"],   # generated (self-distillation), text (dev.txt) and/or
                                    # self_generated (an instruct target's own conversations:
                                    # train.self_generate, Magpie; data.self_generate's knobs)
        "dev_path": "../shared/data/tinystories/dev.txt",
        "num_prompts": 256,    # dev.txt paragraphs used as prompts for self-distillation
        "prompt_tokens": 8,    # prompt length (tokens of the paragraph, BOS included)
        "gen_tokens": 160,     # new tokens generated per prompt
        "temperatures": [1.0],  # sampling temperatures, cycled over the prompts
        "gen_temperatures": None,  # the generated source's own (None: temperatures); with
                                   # regenerate, [1.0, 0.0] against [0.0, 1.0] gives every
                                   # paragraph its other temperature: new rows, not repeats
        "gen_batch": 64,       # rows per sj.generate call
        "text_paragraphs": 0,  # dev.txt paragraphs for the text source (0: all)
        "window": 64,          # training window T
        "regenerate": False,   # text source: keep each paragraph's first prompt_tokens tokens
                               # and let the target rewrite the rest (as long as the original,
                               # at `temperatures`; cached): training on target-regenerated
                               # responses instead of the written text
        "cache_dir": "runs/cache",
        "self_generate": {     # the self_generated source (train.self_generate)
            "conversations": 1000,   # distinct conversations (more extends a finished run)
            "batch": 32,             # conversations answered per batch
            "user_batch": None,      # user messages asked per batch (None: 1.5 x batch)
            "user_tokens": 64,       # budget of the self-written user message
            "answer_tokens": 256,    # budget of the answer
            "temperature": 1.0,
            "top_p": 1.0,
            "answer_temperature": None,  # the answers' own (None: temperature; 0: greedy)
            "system_prompts": [],    # steer the questions: question j is asked after
                                     # prompt j % n ("": the template's default; []: default)
        },
    },
    "train": {
        "steps": 1000,
        "batch_size": 32,
        "lr": 3.0e-3,
        "warmup_steps": 50,
        "end_lr_ratio": 0.02,  # cosine decay ends at lr * end_lr_ratio
        "weight_decay": 0.0,
        "clip_norm": 1.0,
        "dtype": "float32",    # compute dtype of the head: float32 | bfloat16
        "ttt_steps": 1,        # training-time-test unroll steps (EAGLE/EAGLE-3/MTP)
        "step_decay": 0.8,     # weight of unroll step / Medusa head i: decay^i
        "feature_weight": 0.0,  # smooth-L1 on predicted features (EAGLE: 1.0 in the paper)
        "ce_weight": 1.0,      # soft cross-entropy against the target (EAGLE: 0.1)
        "feature_noise": 0.0,  # uniform noise on teacher features (EAGLE's robustness trick)
        "frozen": [],          # top-level head params kept at their init (e.g. [lm_head])
        "num_anchors": 16,     # DFlash: blocks per training window (anchors a, a + 1 < T)
        "loss_gamma": None,    # DFlash: slot k's weight exp(-(k-1)/gamma) (None: 7 for
                               # b >= 16, 4 for b >= 8, b/2 below); DSpark: exp(-k/gamma)
        "l1_weight": 0.0,      # DSpark: weight of ||q - p||_1 per slot (DeepSpec: 0.9)
        "confidence_weight": 1.0,  # DSpark: weight of the confidence head's BCE (DeepSpec: 1.0)
        "checkpoint_every": 200,
        "log_every": 25,
        "stop_after": None,    # test hook: stop (as if killed) after this step's checkpoint
    },
    "eval": {
        "enabled": True,
        "path": "../shared/data/tinystories/heldout.txt",
        "num_prompts": 24,
        "prompt_tokens": 12,
        "max_new_tokens": 96,
        "num_draft": None,     # None: head.num_draft
        "temperatures": [0.0, 1.0],
        "before": True,        # also measure the untrained heads
        "trees": [],           # also measure the trained heads with these trees, "D,k,N[,C]"
                               # (C: topk | sampled | distinct; greedy rows use top-k)
    },
}


def _check(cfg: dict, schema: dict, where: str = "") -> None:
  for key, value in cfg.items():
    if key not in schema:
      allowed = ", ".join(sorted(schema))
      raise ValueError(f"unknown config key '{where}{key}'; allowed here: {allowed}")
    if isinstance(schema[key], dict):
      if not isinstance(value, dict):
        raise ValueError(f"config key {where}{key} must be a mapping, got {value!r}")
      _check(value, schema[key], f"{where}{key}.")


def _merge(base: dict, over: dict) -> dict:
  out = copy.deepcopy(base)
  for k, v in over.items():
    if isinstance(out.get(k), dict) and isinstance(v, dict):
      out[k] = _merge(out[k], v)
    else:
      out[k] = v
  return out


def parse_set(item: str) -> tuple:
  """'train.steps=200' -> (['train', 'steps'], 200). Raises ValueError on bad syntax."""
  if "=" not in item:
    raise ValueError(f"--set expects dotted.key=value, got {item!r}")
  key, raw = item.split("=", 1)
  parts = key.strip().split(".")
  if not key.strip() or any(not p for p in parts):
    raise ValueError(f"--set expects dotted.key=value with a non-empty key, got {item!r}")
  try:
    value = yaml.safe_load(raw) if raw.strip() else None
  except yaml.YAMLError as e:
    raise ValueError(f"--set {item!r}: the value is not valid YAML: {e}") from e
  return parts, value


def apply_sets(cfg: dict, sets: Sequence[str]) -> dict:
  cfg = copy.deepcopy(cfg)
  for item in sets or ():
    parts, value = parse_set(item)
    node, schema = cfg, DEFAULTS
    for i, p in enumerate(parts):
      if not isinstance(schema, dict) or p not in schema:
        allowed = ", ".join(sorted(schema)) if isinstance(schema, dict) else "(none)"
        raise ValueError(f"--set {item!r}: unknown key {'.'.join(parts[:i + 1])!r}; allowed "
                         f"there: {allowed}")
      if i == len(parts) - 1:
        if isinstance(schema[p], dict):
          raise ValueError(f"--set {item!r}: {'.'.join(parts)} is a section, set one of its "
                           f"keys ({', '.join(sorted(schema[p]))})")
        node[p] = value
      else:
        node = node.setdefault(p, {})
        schema = schema[p]
  return cfg


def validate(cfg: dict) -> dict:
  _check(cfg, DEFAULTS)
  if cfg["target_dtype"] not in (None, "float32", "bfloat16"):
    raise ValueError(f"target_dtype must be null, float32 or bfloat16, got "
                     f"{cfg['target_dtype']!r}")
  for key in ("target", "out_dir"):
    if not cfg.get(key):
      raise ValueError(f"config needs a top-level {key!r}")
  kind = cfg["head"]["kind"]
  head = registry.kind(kind)              # ValueError naming the known kinds
  if head.loss not in losses.LOSSES:
    raise ValueError(f"head kind {kind!r} trains with loss {head.loss!r}, which train.losses "
                     f"does not have; known: {', '.join(losses.LOSSES)}")
  k = cfg["head"]["num_draft"]
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ValueError(f"head.num_draft must be an integer >= 1, got {k!r}")
  sources = cfg["data"]["sources"]
  if isinstance(sources, str):
    sources = cfg["data"]["sources"] = [sources]
  bad = [s for s in sources if s not in ("generated", "text", "self_generated")]
  if bad or not sources:
    raise ValueError(f"data.sources must be a non-empty list of 'generated' / 'text' / "
                     f"'self_generated', got {sources!r}")
  sg = cfg["data"]["self_generate"]
  for name in ("conversations", "batch", "user_tokens", "answer_tokens"):
    if isinstance(sg[name], bool) or not isinstance(sg[name], int) or sg[name] < 1:
      raise ValueError(f"data.self_generate.{name} must be an integer >= 1, got {sg[name]!r}")
  at = sg["answer_temperature"]
  if at is not None and (isinstance(at, bool) or not isinstance(at, (int, float)) or at < 0):
    raise ValueError(f"data.self_generate.answer_temperature must be a number >= 0 (0: greedy "
                     f"answers) or null, got {at!r}")
  sp = sg["system_prompts"]
  if not isinstance(sp, list) or not all(isinstance(x, str) for x in sp):
    raise ValueError(f"data.self_generate.system_prompts must be a list of strings (\"\": the "
                     f"template's default system prompt), got {sp!r}")
  ub = sg["user_batch"]
  if ub is not None and (isinstance(ub, bool) or not isinstance(ub, int) or ub < 1):
    raise ValueError(f"data.self_generate.user_batch must be an integer >= 1 or null, got {ub!r}")
  if not isinstance(cfg["data"]["regenerate"], bool):
    raise ValueError(f"data.regenerate must be true or false, got {cfg['data']['regenerate']!r}")
  if cfg["data"]["regenerate"] and "text" not in sources:
    raise ValueError("data.regenerate rewrites the text source's responses: add 'text' to "
                     "data.sources (or set data.regenerate: false)")
  trees = cfg["eval"]["trees"]
  if isinstance(trees, str):
    trees = cfg["eval"]["trees"] = [trees]
  if not isinstance(trees, list):
    raise ValueError(f"eval.trees must be a list of 'D,k,N[,candidates]' strings, got {trees!r}")
  for tree in trees:
    parse_tree_spec(tree)
  _check_data_files(cfg)
  _check_numbers(cfg)
  t = cfg["train"]
  for name in ("steps", "batch_size", "checkpoint_every", "log_every", "ttt_steps"):
    if isinstance(t[name], bool) or not isinstance(t[name], int) or t[name] < 1:
      raise ValueError(f"train.{name} must be an integer >= 1, got {t[name]!r}")
  if isinstance(t["frozen"], str):
    t["frozen"] = [t["frozen"]]
  if not isinstance(t["frozen"], list) or not all(isinstance(x, str) for x in t["frozen"]):
    raise ValueError(f"train.frozen must be a list of head param names, got {t['frozen']!r}")
  if t["dtype"] not in ("float32", "bfloat16"):
    raise ValueError(f"train.dtype must be float32 or bfloat16, got {t['dtype']!r}")
  n = cfg["head"]["draft_vocab_size"]
  if n is not None:
    if not head.draft_vocabulary:
      takes = [k for k in registry.KINDS.values() if k.draft_vocabulary]
      raise ValueError(f"head.draft_vocab_size applies to {registry.labels(takes)} heads, not "
                       f"{kind}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ValueError(f"head.draft_vocab_size must be None or an integer >= 1, got {n!r}")
  if head.loss in ("dflash", "dspark"):
    _check_dflash(cfg)
  elif t["l1_weight"] or t["confidence_weight"] != DEFAULTS["train"]["confidence_weight"]:
    raise ValueError(f"train.l1_weight / train.confidence_weight apply to DSpark heads, not "
                     f"{head.label}")
  if head.loss != "feature_head" and t["ttt_steps"] != 1:
    raise ValueError(f"train.ttt_steps applies to "
                     f"{registry.labels(registry.with_loss('feature_head'))} heads, not "
                     f"{head.label}")
  _check_head_options(cfg, head)
  _check_eval(cfg, head)
  _check_mesh(cfg)
  w = cfg["data"]["window"]
  if not isinstance(w, int) or w < cfg["head"]["num_draft"] + 3:
    raise ValueError(f"data.window must be an integer >= num_draft + 3, got {w!r}")
  return cfg


def _check_data_files(cfg: dict) -> None:
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


def _check_numbers(cfg: dict) -> None:
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


def _check_head_options(cfg: dict, head) -> None:
  """A head option another kind takes, set away from its default, is refused (it was ignored:
  an EAGLE head with head.num_layers=3 trained one layer)."""
  own = {o.key for o in head.options} | {"num_draft"}      # num_draft: every kind's K
  for key in registry.option_defaults():
    default = DEFAULTS["head"][key]
    if key not in own and cfg["head"].get(key, default) != default:
      takes = [k for k in registry.KINDS.values() if key in {o.key for o in k.options}]
      raise ValueError(f"head.{key} applies to {registry.labels(takes)} heads, not "
                       f"{head.label}")


def _check_eval(cfg: dict, head) -> None:
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


def _check_dflash(cfg: dict) -> None:
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


def _check_mesh(cfg: dict) -> None:
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


def _read(path: pathlib.Path, chain: tuple = ()) -> dict:
  """One YAML config as written, with its `base:` config (a path relative to it) merged under it."""
  try:
    raw = yaml.safe_load(path.read_text()) or {}
  except OSError as e:
    raise ValueError(f"cannot read config {path}: {e}") from e
  except yaml.YAMLError as e:
    raise ValueError(f"{path}: not valid YAML: {e}") from e
  if not isinstance(raw, dict):
    raise ValueError(f"{path}: a config is a mapping of keys, got {type(raw).__name__}")
  base = raw.pop("base", None)
  if base is None:
    return raw
  if not isinstance(base, str):
    raise ValueError(f"{path}: base must be a config's path (relative to {path.name}), got {base!r}")
  chain = chain + (path.resolve(),)
  base_path = (path.parent / base).resolve()
  if base_path in chain:
    raise ValueError(f"{path}: base {base!r} makes a cycle of configs")
  return _merge(_read(base_path, chain), raw)


def load_config(path, sets: Optional[Sequence[str]] = None) -> dict:
  """Reads a YAML config (over its `base:` config, if it names one: mappings merge key by key,
  anything else replaces), applies --set overrides, fills defaults and validates."""
  raw = _read(pathlib.Path(path))
  _check(raw, DEFAULTS)
  cfg = _merge(DEFAULTS, raw)
  cfg = apply_sets(cfg, sets)
  return validate(cfg)
