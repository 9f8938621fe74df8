"""Training configs: YAML files checked against a schema of defaults, plus --set overrides.

    config = load_config("configs/distill_eagle.yaml", ["train.steps=200", "head.num_draft=6"])

Every key must be one of DEFAULTS' (unknown keys raise ValueError naming the allowed ones);
`target` and `out_dir` are required. Values given with --set are parsed as YAML scalars/lists.
The `head:` section is the head kind's: its kind, K, and every option a registry kind's init
takes (spec_jax.drafters.registry: a new kind's options appear here without an edit).
"""

from __future__ import annotations

import copy
import pathlib
from typing import Optional, Sequence

import yaml

from spec_jax.drafters import registry
from spec_jax.tree import parse_tree_spec
from train import config_checks as checks, losses


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
        "precompute_features": False,  # run the target once over every window, keep its
                               # hidden states on the host (train.features); each step then
                               # runs only its LM head, for the labels
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
  checks.check_data_files(cfg)
  checks.check_numbers(cfg)
  t = cfg["train"]
  for name in ("steps", "batch_size", "checkpoint_every", "log_every", "ttt_steps"):
    if isinstance(t[name], bool) or not isinstance(t[name], int) or t[name] < 1:
      raise ValueError(f"train.{name} must be an integer >= 1, got {t[name]!r}")
  if isinstance(t["frozen"], str):
    t["frozen"] = [t["frozen"]]
  if not isinstance(t["frozen"], list) or not all(isinstance(x, str) for x in t["frozen"]):
    raise ValueError(f"train.frozen must be a list of head param names, got {t['frozen']!r}")
  if not isinstance(t["precompute_features"], bool):
    raise ValueError(f"train.precompute_features must be true or false, got "
                     f"{t['precompute_features']!r}")
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
    checks.check_dflash(cfg)
  elif t["l1_weight"] or t["confidence_weight"] != DEFAULTS["train"]["confidence_weight"]:
    raise ValueError(f"train.l1_weight / train.confidence_weight apply to DSpark heads, not "
                     f"{head.label}")
  if head.loss != "feature_head" and t["ttt_steps"] != 1:
    raise ValueError(f"train.ttt_steps applies to "
                     f"{registry.labels(registry.with_loss('feature_head'))} heads, not "
                     f"{head.label}")
  checks.check_head_options(cfg, head, DEFAULTS["head"])
  checks.check_eval(cfg, head)
  checks.check_mesh(cfg)
  w = cfg["data"]["window"]
  if not isinstance(w, int) or w < cfg["head"]["num_draft"] + 3:
    raise ValueError(f"data.window must be an integer >= num_draft + 3, got {w!r}")
  return cfg


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
