"""Model, drafter and pair specs as the command lines write them, and the objects they name.

Models: a Hugging Face folder, a llama2.c folder or .bin (anything `sj.load` reads),
`random:100m` / `random:tiny` / `random:tiny-draft` (random weights, see RANDOM_MODELS; no
tokenizer), or `widened:MODEL[:H,F,L]`: MODEL widened in memory by `spec_jax.models.widen` to
hidden H, MLP F, L layers (default 768,2048,12: stories260K becomes a 78M-parameter model with
exactly its logits — the cost of a 100M-class model, the distribution of a real one); trained
heads of MODEL (`heads:PATH`, `KIND:PATH`) are widened with it. Drafters: `none`, `ngram`,
`ngram:MAX[:MIN]`, `draft:MODEL` (a DraftModel), `mtp` (the native MTP head in the target's own
folder, e.g. a Qwen3-Next / Qwen3.5 checkpoint's mtp.*), `heads:PATH` (trained heads of any kind, or
any folder `sj.drafters.load` reads), `KIND:PATH` for a head kind of the registry
(spec_jax.drafters.registry: `dflash:PATH` a DFlash block drafter, trained here or a published
DFlash folder; `eagle3:PATH`, `medusa:PATH`, ...: the same, refused unless the folder holds
that kind), `ngram[:MAX[:MIN]]+DRAFTER` (prompt lookup first, DRAFTER where it finds no match:
sj.drafters.LookupFirst). A pair is `TARGET@DRAFTER`; `default` is DEFAULT_PAIRS.
"""

from __future__ import annotations

import os
import pathlib

from spec_jax.bench.results import ROOT
from spec_jax.drafters import registry
import spec_jax as sj
from spec_jax.models import widen

SHARED = pathlib.Path(os.environ.get("SPEC_JAX_SHARED", ROOT.parent / "shared"))

DEFAULT_PAIRS = (
    "../shared/models/stories260K@draft:../shared/models/salty279K",
    "../shared/models/stories260K@ngram",
    "../shared/models/tinystories656K@ngram",
)

# Random llama shapes. "100m": 100,092,672 params (tied embeddings; kv 4 heads).
RANDOM_MODELS = {
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12,
                 num_heads=12, num_kv_heads=4, tie_embeddings=True,
                 max_position_embeddings=4096, rms_norm_eps=1e-5),
    "tiny": dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2,
                 num_heads=4, num_kv_heads=2, tie_embeddings=False, max_position_embeddings=512,
                 rms_norm_eps=1e-5),
    "tiny-draft": dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1,
                       num_heads=4, num_kv_heads=2, tie_embeddings=False,
                       max_position_embeddings=512, rms_norm_eps=1e-5),
}

DRAFTER_SPECS = ("none, ngram, ngram:MAX[:MIN], draft:MODEL, mtp (the target's own MTP head), "
                 "heads:PATH or KIND:PATH (KIND: "
                 + ", ".join(registry.HEAD_KINDS) + "), ngram[:MAX[:MIN]]+MODEL_DRAFTER (prompt "
                 "lookup first, e.g. ngram:3:2+heads:PATH)")
WIDENED_DEFAULT = (768, 2048, 12)
_WIDENED_SOURCES: dict = {}     # id(widened model) -> (source model, widened model)


def resolve_path(p: str) -> pathlib.Path:
  """'../shared/...' resolves against the repository root when not found from the cwd."""
  path = pathlib.Path(p).expanduser()
  if path.exists() or path.is_absolute():
    return path
  parts = path.parts
  if parts and parts[0] == ".." and len(parts) > 1 and parts[1] == "shared":
    alt = SHARED.joinpath(*parts[2:])
    if alt.exists():
      return alt
  alt = ROOT / path
  return alt if alt.exists() else path


def model_label(spec: str) -> str:
  """A short name for tables: the folder or file name, or the random:NAME spec itself;
  widened:MODEL[:H,F,L] -> 'MODEL-wide' (plus the sizes when not the default)."""
  if spec.startswith("random:"):
    return spec
  if spec.startswith("widened:"):
    source, sizes = parse_widened(spec)
    suffix = "" if sizes == WIDENED_DEFAULT else "-" + "x".join(map(str, sizes))
    return f"{model_label(source)}-wide{suffix}"
  return pathlib.Path(spec).name or spec


def drafter_label(spec: str) -> str:
  """A short name for tables: heads by their run folder, draft models by their model label."""
  if spec in ("none", "", None):
    return "none"
  if "+" in spec:
    return "+".join(drafter_label(part) for part in spec.partition("+")[::2])
  kind, _, arg = spec.partition(":")
  if (kind == "heads" or kind in registry.KINDS) and arg:
    # train.distill_heads saves to OUT_DIR/heads: the run's folder names the heads.
    path = pathlib.Path(arg.rstrip("/"))
    name = path.parent.name if path.name == "heads" and path.parent.name else path.name
    return f"{kind}:{name}"
  if kind == "draft" and arg:
    return f"{kind}:{model_label(arg)}"
  return spec


def load_model(spec: str, seed: int = 0, dtype=None):
  """A model spec -> sj.Model (see the module docstring), its weights in `dtype` ("float32",
  "bfloat16"; None: as stored). A widened model is widened in float32, then cast (the cast
  rounds the source's weights once: the bf16 twin has exactly the bf16 source's logits)."""
  model = _load_model(spec, seed)
  if dtype is None or model.config.dtype == dtype:
    return model
  cast = model.astype(dtype)
  widened = _WIDENED_SOURCES.get(id(model))
  if widened is not None and widened[1] is model:          # heads of the source widen with it
    _WIDENED_SOURCES[id(cast)] = (widened[0].astype(dtype), cast)
  return cast


def _load_model(spec: str, seed: int):
  import jax
  if spec.startswith("random:"):
    name = spec.partition(":")[2]
    if name not in RANDOM_MODELS:
      raise ValueError(f"unknown random model {spec!r}; known: "
                       f"{', '.join('random:' + k for k in RANDOM_MODELS)}")
    config = sj.ModelConfig(**RANDOM_MODELS[name])
    # Distinct seeds per shape so a random draft is not a copy of the target.
    return sj.init_model(config, jax.random.key(seed + sorted(RANDOM_MODELS).index(name)))
  if spec.startswith("widened:"):
    return _load_widened(spec, seed)
  path = resolve_path(spec)
  if not path.exists():
    raise ValueError(f"model {spec!r} not found (tried {path}); give a HF folder, a llama2.c "
                     f"folder or .bin, random:NAME or widened:MODEL[:H,F,L]")
  return sj.load(path)


def parse_widened(spec: str) -> tuple:
  """'widened:MODEL[:H,F,L[,Dh]]' -> (MODEL, sizes); ValueError for a malformed spec."""
  rest = spec[len("widened:"):]
  source, sizes = rest, WIDENED_DEFAULT
  head, _, tail = rest.rpartition(":")
  if head and tail and all(x.strip().isdigit() for x in tail.split(",")):
    source = head
    sizes = tuple(int(x) for x in tail.split(","))
    if len(sizes) not in (3, 4):
      raise ValueError(f"{spec!r}: the sizes are H,F,L[,Dh] (hidden, MLP, layers, head_dim "
                       f"64 by default), e.g. widened:MODEL:768,2048,12")
  if not source:
    raise ValueError(f"{spec!r}: widened:MODEL[:H,F,L] needs a MODEL")
  return source, sizes


def _load_widened(spec: str, seed: int):
  source_spec, sizes = parse_widened(spec)
  source = load_model(source_spec, seed)
  wide = widen(source, *sizes[:3], **({"head_dim": sizes[3]} if len(sizes) == 4 else {}))
  _WIDENED_SOURCES[id(wide)] = (source, wide)
  return wide


def check_drafter_spec(spec: str) -> None:
  """Raises ValueError for a spec make_drafter would refuse, without loading anything."""
  if spec in (None, "", "none"):
    return
  if "+" in spec:                          # LOOKUP+MODEL: sj.drafters.LookupFirst
    lookup, _, model = spec.partition("+")
    if lookup.partition(":")[0] != "ngram" or model.partition(":")[0] in ("ngram", "none", ""):
      raise ValueError(f"bad drafter {spec!r}: a combined drafter is ngram[:MAX[:MIN]]+MODEL, "
                       f"prompt lookup first and a model drafter (draft:, heads:, a head kind) "
                       f"where it finds no match")
    check_drafter_spec(lookup)
    check_drafter_spec(model)
    return
  kind, _, arg = spec.partition(":")
  if kind == "ngram":
    try:
      [int(x) for x in arg.split(":") if x]
    except ValueError:
      raise ValueError(f"bad drafter {spec!r}: ngram takes integers, ngram:MAX[:MIN]") from None
    return
  if kind in ("draft", "heads") or kind in registry.KINDS:
    if not arg and kind != "mtp":            # bare mtp: the target's own MTP head
      what = {"draft": "draft model (path or random:NAME)", "heads": "trained heads' directory"}
      what = what.get(kind) or f"{registry.kind(kind).label} drafter's directory"
      raise ValueError(f"drafter {kind}:{'MODEL' if kind == 'draft' else 'PATH'} needs the {what}")
    return
  raise ValueError(f"unknown drafter {spec!r}; use {DRAFTER_SPECS}")


def make_drafter(spec: str, target, seed: int = 0):
  """A drafter spec (see the module docstring) -> a drafter, or None for plain decoding. A draft
  model takes the target's dtype; trained heads keep their own float32 layer and read the
  target's embedding and LM head in its dtype. A drafter that cannot draft for `target` (another
  vocabulary) is a ValueError here, before a CLI compiles or times anything."""
  drafter = _make_drafter(spec, target, seed)
  if drafter is not None:
    drafter.check_compatible(target)
  return drafter


def _make_drafter(spec: str, target, seed: int = 0):
  check_drafter_spec(spec)
  if spec in (None, "", "none"):
    return None
  if "+" in spec:                          # checked above: ngram...+MODEL
    lookup, _, model = spec.partition("+")
    return sj.drafters.LookupFirst(_make_drafter(model, target, seed),
                                   _make_drafter(lookup, target, seed))
  kind, _, arg = spec.partition(":")
  if kind == "ngram":
    return sj.drafters.NGram(*[int(x) for x in arg.split(":") if x])
  if kind == "draft":
    return sj.drafters.DraftModel(load_model(arg, seed, dtype=target.config.dtype))
  if not hasattr(sj.drafters, "load"):
    raise ValueError("this spec_jax has no sj.drafters.load for trained heads")
  if kind == "mtp" and not arg:
    if not getattr(target, "source", None):
      raise ValueError("drafter mtp (the target's own MTP head) needs a target loaded from a "
                       "folder; give mtp:PATH otherwise")
    arg = target.source
  widened = _WIDENED_SOURCES.get(id(target))
  if widened is not None and widened[1] is target:
    # Heads trained on the source of a widened:... target: load them for the source, then
    # widen them with it (the same drafts, exactly).
    source = widened[0]
    drafter = sj.drafters.widen_heads(sj.drafters.load(str(resolve_path(arg)), source), source,
                                      target)
  else:
    drafter = sj.drafters.load(str(resolve_path(arg)), target)
  if kind in registry.KINDS and getattr(drafter, "kind", None) != kind:
    raise ValueError(f"drafter {spec!r}: {arg} holds {getattr(drafter, 'kind', '?')} heads, not "
                     f"a {registry.kind(kind).label} drafter; use heads:{arg}")
  return drafter


def draft_model_of(drafter):
  """The separate draft model of a DraftModel drafter (also as a LookupFirst's fallback); None
  for every other drafter."""
  if isinstance(drafter, sj.drafters.LookupFirst):
    drafter = drafter.fallback
  return drafter.model if isinstance(drafter, sj.drafters.DraftModel) else None


def check_measured_pairs(pairs) -> None:
  """ValueError for pairs a side-by-side table cannot hold: a drafter 'none' (plain decoding is
  measured beside every pair already), or two targets (or two drafters of one target) with one
  label, which the tables, the verdicts and --resume key on (a/m and b/m were both "m": resume
  skipped the second, and the verdicts merged them)."""
  if any(d in ("none", "") for _, d in pairs):
    raise ValueError("TARGET@none: plain decoding (K=0) is measured beside every pair already; "
                     "give each pair a drafter")
  specs_of: dict = {}                        # a table's label -> the specs it stands for
  for t, d in pairs:
    specs_of.setdefault(("targets", model_label(t)), set()).add(t)
    specs_of.setdefault((f"drafters of {t}", drafter_label(d)), set()).add(d)
  for (what, label), specs in specs_of.items():
    if len(specs) > 1:
      raise ValueError(f"{what} {sorted(specs)} share the table label {label!r}; give them "
                       f"folders (or links) of different names")


def parse_pairs(pairs) -> list:
  """['default'] | ['TARGET@DRAFTER', {'target':..., 'drafter':...}, ...] -> [(target, drafter)]."""
  if pairs is None or pairs == "default":
    pairs = ["default"]
  if isinstance(pairs, str):
    pairs = [pairs]
  out = []
  for p in pairs:
    if p == "default":
      out.extend(tuple(x.split("@", 1)) for x in DEFAULT_PAIRS)
    elif isinstance(p, dict):
      if "target" not in p or "drafter" not in p:
        raise ValueError(f"a pair given as a mapping needs 'target' and 'drafter' keys: {p}")
      out.append((str(p["target"]), str(p["drafter"])))
    elif isinstance(p, str) and "@" in p:
      t, d = p.split("@", 1)
      out.append((t, d))
    else:
      raise ValueError(f"bad pair {p!r}: write TARGET@DRAFTER (e.g. "
                       f"../shared/models/stories260K@ngram) or 'default'")
  seen, uniq = set(), []
  for p in out:
    if p not in seen:
      seen.add(p)
      uniq.append(p)
  return uniq


def constraint_of(args):
  """--regex PATTERN / --json-schema FILE as an sj.constraints constraint (None: neither);
  ValueError naming the flag for an unreadable file or both flags."""
  constraints = sj.constraints
  pattern, schema = getattr(args, "regex", None), getattr(args, "json_schema", None)
  if pattern is not None and schema is not None:
    raise ValueError("give --regex or --json-schema, not both")
  if pattern is not None:
    return constraints.regex(pattern)
  if schema is not None:
    try:
      text = pathlib.Path(schema).read_text()
    except OSError as e:
      raise ValueError(f"--json-schema: cannot read {schema!r}: {e}") from e
    return constraints.json_schema(text)
  return None


def add_constraint_flags(parser) -> None:
  """--regex and --json-schema (generate's and the eval's)."""
  parser.add_argument("--regex", default=None, metavar="PATTERN",
                      help="constrain every answer to match this regex (outlines-core syntax)")
  parser.add_argument("--json-schema", default=None, metavar="FILE",
                      help="constrain every answer to one JSON value valid under this schema")
