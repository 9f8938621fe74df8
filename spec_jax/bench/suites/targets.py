"""What the spec and breakdown suites share: the grid of options, one target with its drafters
and prompts, and the generate() call they time."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from spec_jax.bench.prompts import prompt_token_lists
from spec_jax.bench.specs import (check_measured_pairs, draft_model_of, load_model, make_drafter,
                                  model_label, parse_pairs)
from spec_jax.tree import parse_tree_spec
from spec_jax.stats import SpecStats
import spec_jax as sj
from spec_jax.decoding.compiled import clear_compiled
from spec_jax.bench import timers


@dataclasses.dataclass(frozen=True)
class Grid:
  """by_target: target spec -> [drafter specs] (order of --pairs); ks, batches: sorted unique
  ints; temps: floats in the given order; trees: sj.TreeSpec per --tree (order given); auto:
  'auto' was among the K values (the governor runs as one more configuration per drafter)."""
  by_target: dict
  ks: list
  batches: list
  temps: list
  trees: list = dataclasses.field(default_factory=list)
  auto: bool = False
  dtypes: list = dataclasses.field(default_factory=lambda: [None])
  plain_dtypes: list = dataclasses.field(default_factory=list)


def grid_of(opts) -> Grid:
  """--pairs, --num-draft, --batch, --temperatures -> Grid (ValueError for K < 1)."""
  auto = any(k == "auto" for k in opts.num_draft)
  ks = sorted(set(int(k) for k in opts.num_draft if k != "auto"))
  if any(k < 1 for k in ks):
    raise ValueError(f"--num-draft values must be >= 1 or 'auto' (K=0, plain decoding, is "
                     f"always run), got {ks}")
  pairs = parse_pairs(opts.pairs)
  check_measured_pairs(pairs)
  by_target: dict = {}
  for t, d in pairs:
    by_target.setdefault(t, []).append(d)
  trees = list(dict.fromkeys(parse_tree_spec(t) for t in (getattr(opts, "tree", None) or [])))
  dtypes = list(dict.fromkeys(getattr(opts, "dtype", None) or [None]))
  plain_dtypes = list(dict.fromkeys([d for d in dtypes if d] +
                                    list(getattr(opts, "plain_dtypes", None) or [])))
  return Grid(by_target=by_target, ks=ks, batches=sorted(set(int(b) for b in opts.batch)),
              temps=[float(t) for t in opts.temperatures], trees=trees, auto=auto,
              dtypes=dtypes, plain_dtypes=plain_dtypes)


@dataclasses.dataclass
class TargetSetup:
  """One target, its drafters (spec -> drafter) and prompts, and the lengths every cell uses:
  max_new = --max-new-tokens capped by the shortest context of target and draft models (note
  says so when capped), fill = longest prompt + max_new // 2 (where cost ratios are timed).
  dtype: the target's weights' dtype (None: as stored); plain_models: {dtype: the target in
  another dtype}, whose plain decoding every cell times beside this one's."""
  spec: str
  model: Any
  drafters: dict
  ids: list
  longest: int
  context: int
  max_new: int
  fill: int
  note: Optional[str]
  dtype: Optional[str] = None
  plain_models: dict = dataclasses.field(default_factory=dict)

  @property
  def label(self) -> str:
    return model_label(self.spec) + ("" if self.dtype is None else " " + DTYPE_TAGS[self.dtype])


DTYPE_TAGS = {"bfloat16": "bf16", "float32": "f32"}


def prepare_target(target_spec: str, drafter_specs, opts, ks, n_prompts: int, dtype=None,
                   plain_dtypes=()) -> TargetSetup:
  """Loads the target (in dtype) and its drafters, refuses K above a drafter's max_draft, and
  reads n_prompts prompts (ValueError when they leave no room for new tokens); plain_dtypes:
  the target also in these dtypes, for plain decoding beside it."""
  target = load_model(target_spec, opts.seed, dtype=dtype)
  plain_models = {d: load_model(target_spec, opts.seed, dtype=d) for d in plain_dtypes
                  if d != target.config.dtype}
  drafters = {d: make_drafter(d, target, opts.seed) for d in drafter_specs}
  for dspec, dr in drafters.items():
    cap = getattr(dr, "max_draft", None)
    if cap is not None and ks and max(ks) > cap:
      raise ValueError(f"drafter {dspec} proposes at most {cap} tokens per round; drop the "
                       f"K values above {cap} from --num-draft (got {ks})")
  ids, _ = prompt_token_lists(target, opts.prompts, n_prompts, opts.prompt_words,
                              opts.max_prompt_tokens, opts.seed)
  context = min([target.config.max_position_embeddings] + [
      draft_model_of(d).config.max_position_embeddings for d in drafters.values()
      if draft_model_of(d) is not None])
  longest = max(len(r) for r in ids)
  max_new = min(int(opts.max_new_tokens), context - longest - 1)
  if max_new < 1:
    raise ValueError(f"prompts of {longest} tokens leave no room in a context of {context}")
  note = None
  if max_new < int(opts.max_new_tokens):
    note = (f"{model_label(target_spec)}: max_new_tokens capped from {opts.max_new_tokens} to "
            f"{max_new} by the context of {context} positions (longest prompt {longest} tokens)")
  return TargetSetup(spec=target_spec, model=target, drafters=drafters, ids=ids,
                     longest=longest, context=context, max_new=max_new,
                     fill=longest + max_new // 2, note=note, dtype=dtype,
                     plain_models=plain_models)


def run_batches(target, batches, drafter, k, max_new: int, temperature, seed: int,
                capacity=None):
  """run_generate over consecutive batches of prompts -> one merged SpecStats (their rows side
  by side; tokens/s over all of them). temperature: a float or an sj.Sampling."""
  return SpecStats.merge([run_generate(target, prompts, drafter, k, max_new, temperature,
                                       seed, capacity).stats for prompts in batches])


TUNED = "tuned"            # --draft-temperature-scale tuned


def draft_scale(opts):
  """--draft-temperature-scale: a float, or TUNED."""
  scale = getattr(opts, "draft_temperature_scale", 1.0)
  return scale if scale == TUNED else float(scale)


def cell_sampling(temperature: float, opts) -> "sj.Sampling":
  """A cell's sampling settings: its temperature and --draft-temperature-scale (1 when
  'tuned': the strategy scales it, cell_config)."""
  scale = draft_scale(opts)
  return sj.Sampling(temperature=temperature,
                     draft_temperature_scale=1.0 if scale == TUNED else scale)


def cell_config(k, temperature: float, drafter, opts):
  """What run_generate runs for configuration k of a cell: k itself, or with
  --draft-temperature-scale tuned at a temperature > 0, a chain's K as
  sj.strategies.TunedDraftTemperature(K)."""
  if draft_scale(opts) == TUNED and temperature > 0 and drafter is not None and isinstance(k, int) and k > 0:
    return sj.strategies.TunedDraftTemperature(k)
  return k


def run_generate(target, prompts, drafter, k, max_new: int, temperature, seed: int,
                 capacity=None):
  """One timed generate() that produces exactly max_new tokens per row (stop_tokens=[]); k is
  an integer, 'auto' (the governor: calibrated on its first call, outside the timing), an
  sj.TreeSpec (tree drafting) or an sj.Strategy (cell_config); temperature: a float or an
  sj.Sampling (cell_sampling); capacity: the KV cache's (None: generate's default bucket, which
  grows with K: configurations compared side by side pass one)."""
  import jax
  tree = k if isinstance(k, sj.TreeSpec) else None
  sampling = (temperature if isinstance(temperature, sj.Sampling)
              else sj.Sampling(temperature=temperature))
  if isinstance(k, sj.Strategy):
    how = {"strategy": k}
  else:
    how = {"num_draft": k if drafter is not None and tree is None else 4, "tree": tree}
  out = sj.generate(target, prompts, drafter=drafter, max_new_tokens=max_new,
                    sampling=sampling, key=jax.random.key(seed), stop_tokens=[],
                    capacity=capacity, **how)
  counts = {len(t) for t in out.tokens}
  if counts != {max_new}:
    raise RuntimeError(f"expected exactly {max_new} new tokens per row with stop_tokens=[], got "
                       f"{sorted(counts)}")
  return out


def release_compiled() -> None:
  """Bounds the memory of a long run: drops generate()'s compiled executables and the timing
  loops before the next target."""
  import jax
  clear_compiled()
  timers.clear_cache()
  jax.clear_caches()


def tree_text(tree, kind=None) -> str:
  """'D,k,N,KIND': KIND the candidates drafted (the run's SpecStats.tree resolves "auto"),
  else the TreeSpec's own."""
  return f"{tree.depth},{tree.top_k},{tree.num_nodes},{kind or tree.candidates}"


def tree_drafters(setup, tree=None) -> list:
  """The drafters that build trees (those that build `tree`, when given: best-first trees
  need a block drafter)."""
  best_first = tree is not None and tree.candidates == "best_first"
  return [d for d, dr in setup.drafters.items() if getattr(dr, "supports_tree", False) and
          (not best_first or getattr(dr, "supports_best_first", False))]


def tree_configs(setup, trees, label: str) -> tuple:
  """(drafter spec, TreeSpec) for every --tree a drafter of `setup` builds, and a note naming
  the --tree values none of them builds (None when every one is built): such a tree has no
  row, and the note says why (it was dropped without a word)."""
  configs = [(d, t) for d in tree_drafters(setup) for t in trees if d in tree_drafters(setup, t)]
  unbuilt = [tree_text(t) for t in trees if all(tt != t for _, tt in configs)]
  note = None
  if unbuilt:
    note = (f"{label}: no row for --tree {', '.join(unbuilt)}: no drafter of this target builds "
            f"it (trees need a drafter that drafts them: a draft model, EAGLE / EAGLE-3 / MTP "
            f"heads, DFlash, DSpark, the Gemma 4 assistant; best_first needs a block drafter: "
            f"DFlash or DSpark)")
  return configs, note
