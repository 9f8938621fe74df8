"""Measuring one batch ("unit") of an evaluation: every configuration (plain decoding and each
drafter) on the same prompts, round-robin, with the time to first token, and the check that
greedy speculative outputs equal plain decoding's token for token.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Optional

from spec_jax.eval.greedy import PLAIN, LossyOutputError, check_greedy  # noqa: F401 (re-exported)
from spec_jax.timing import interleaved_rounds
from spec_jax.eval.latency import row_counts
from spec_jax.eval.store import prompt_hash
import spec_jax as sj
from spec_jax import distributed, sharding
from spec_jax.decoding.prompts import capacity_bucket
from spec_jax.decoding.strategies import strategy_for
from spec_jax.models.tokenizers import decode_generated



@dataclasses.dataclass(frozen=True)
class Config:
  """One way to decode: key (the drafter spec, 'none' for plain decoding, 'none@DTYPE' for
  plain decoding in another dtype, 'SPEC@tree:D,k,N' for a tree), label (for tables), drafter
  (None for plain), num_draft (K, 'auto', or 0 for plain; a tree's 'tree D,k,N' for tables);
  target: the model it decodes with (None: the runner's target; plain decoding in another
  dtype has its own cast) and its dtype name; tree: a TreeSpec (tree drafting) or None."""
  key: str
  label: str
  drafter: Any
  num_draft: Any
  target: Any = None
  dtype: Optional[str] = None
  tree: Any = None

  @property
  def strategy_args(self) -> dict:
    """generate()'s num_draft= / tree= for this configuration."""
    if self.tree is not None:
      return {"tree": self.tree}
    return {"num_draft": self.num_draft if self.drafter is not None else 1}

  @property
  def is_plain(self) -> bool:
    return self.drafter is None


@dataclasses.dataclass(frozen=True)
class Unit:
  """One batch: `requests` in prompt order, plus `filler` copies of the last prompt that keep
  the batch at `batch` rows (run, never counted)."""
  turn: int
  batch: int
  index: int
  requests: tuple
  filler: int

  @property
  def key(self) -> str:
    return f"turn{self.turn}-B{self.batch}-{self.index:05d}"

  def prompts(self) -> list:
    return [list(r.ids) for r in self.requests] + [list(self.requests[-1].ids)] * self.filler

  def describe(self) -> str:
    cats = list(dict.fromkeys(r.category for r in self.requests))
    return f"turn {self.turn} | {'+'.join(cats)[:40]} | B={self.batch}"


def plan_units(requests, batch: int, turn: int) -> list:
  """The requests of one turn cut into batches of `batch` rows in prompt order; the last
  batch is filled up to `batch` rows by repeating its last prompt."""
  units = []
  for i in range(0, len(requests), batch):
    chunk = tuple(requests[i:i + batch])
    units.append(Unit(turn=turn, batch=batch, index=i // batch, requests=chunk,
                      filler=batch - len(chunk)))
  return units


def generate_call(target, prompts, config: Config, max_new_tokens: int, temperature: float,
                  key, capacity, mesh=None, sampling=()):
  """The one generate() call of the harness (stop at the model's end-of-text and end-of-turn
  tokens). Prompts are padded to the whole cache capacity, which the runner picks per unit as
  a power-of-two bucket (decoding.prompts.capacity_bucket): every prompt length of a bucket
  shares one compiled decode, and the chunked prefill works on the real tokens only. With a
  mesh over several processes, each process feeds its share of `prompts`
  (spec_jax.distributed.share); every_row() gives every row back. sampling: the other
  sj.Sampling options, (name, value) pairs (EvalOptions.sampling), and the grammar constraint
  as ("constraint", (kind, source)) (sj.constraints.from_pair)."""
  if sharding.spans_processes(mesh):
    prompts = distributed.share(prompts)
  options = dict(sampling)
  constraint = sj.constraints.from_pair(options.pop("constraint", None))
  return sj.generate(target, prompts, drafter=config.drafter, **config.strategy_args,
                     max_new_tokens=max_new_tokens,
                     sampling=sj.Sampling(temperature=temperature, **options),
                     key=key, stop_tokens=None, capacity=capacity, mesh=mesh,
                     constraint=constraint)



def every_row(out, tokenizer=None):
  """(tokens, text) of every row of a generate() output: its own on one process, every
  process's (from out.result, in prompt order) when the call spanned several."""
  if out.stats.processes == 1:
    return out.tokens, out.text
  tokens = sj.new_tokens(out.result)
  return tokens, (None if tokenizer is None else [decode_generated(tokenizer, t) for t in tokens])


class UnitRunner:
  """Measures units with fixed options; remembers which compiled shapes already ran once (a
  new shape gets one untimed run first, so first-run effects stay out of the timings)."""

  def __init__(self, target, configs, max_new_tokens: int, temperature: float, seed: int,
               repeats: int, progress=None, mesh=None, sampling=()):
    self.target, self.configs, self.mesh = target, list(configs), mesh
    self.max_new, self.temperature, self.seed = max_new_tokens, temperature, seed
    self.sampling = tuple(sampling)
    self.repeats, self.progress = repeats, progress
    self._warm: set = set()
    self._model32 = None
    # A low-precision target's greedy divergences are checked against its float32 cast.
    self._reference = None if target.config.dtype == "float32" else self._float32_target

  def _float32_target(self):
    if self._model32 is None:
      self._model32 = self.target.astype("float32")
    return self._model32

  def _key(self, unit: Unit):
    import jax
    return jax.random.fold_in(jax.random.key(self.seed), unit.turn * 1_000_003 + unit.index)

  def _capacity(self, prompts) -> int:
    """The unit's KV capacity, the same for every configuration (plain decoding and each
    drafter read equally long caches) and for the timed and the 1-token TTFT call: the
    power-of-two bucket of the longest prompt + max_new_tokens + the widest round of any
    configuration (one compiled decode per bucket and configuration)."""
    extent = max([0] + [strategy_for(None, c.drafter, **c.strategy_args).extent
                        for c in self.configs if c.drafter is not None])
    return capacity_bucket(max(len(p) for p in prompts) + self.max_new + extent + 1,
                           self.target.config.max_position_embeddings)

  def _runs(self, unit: Unit, prompts: list) -> dict:
    key = self._key(unit)
    runs = {}
    for c in self.configs:
      cap = self._capacity(prompts)

      def run(c=c, cap=cap):
        if self.progress is not None:
          self.progress.describe(f"{unit.describe()} | {c.label}")
        target = c.target if c.target is not None else self.target
        call = lambda n: generate_call(target, prompts, c, n, self.temperature, key, cap,
                                       self.mesh, self.sampling)
        sig = (c.key, len(prompts), cap)
        compile_s = 0.0
        if sig not in self._warm:           # compile (excluded anyway) and a first run
          compile_s = call(self.max_new).compile_seconds + call(1).compile_seconds
          self._warm.add(sig)
        return call(self.max_new), call(1).stats.seconds, compile_s
      runs[c.key] = run
    return runs

  def measure(self, unit: Unit) -> dict:
    """All configurations on the unit's prompts, `repeats` interleaved rounds -> the unit's
    record (see store.py); LossyOutputError at temperature 0 when outputs differ."""
    prompts = unit.prompts()
    results = interleaved_rounds(self._runs(unit, prompts), self.repeats)
    n = len(unit.requests)
    rows = {k: every_row(res[0][0], self.target.tokenizer) for k, res in results.items()}
    outputs = {k: tokens for k, (tokens, _) in rows.items()}
    divergences = []
    if self.temperature == 0:
      divergences = check_greedy(unit, self.configs, outputs, self._reference)
    configs = {}
    for c in self.configs:
      res = results[c.key]
      first = res[0][0]
      counts = row_counts(first.stats)
      configs[c.key] = {
          "label": c.label, "num_draft": c.num_draft, "K": first.stats.num_draft,
          "capacity": self._capacity(prompts),
          "seconds": [o.stats.seconds for o, _, _ in res], "ttft_s": [t for _, t, _ in res],
          "seconds_median": statistics.median(o.stats.seconds for o, _, _ in res),
          "ttft_median_s": statistics.median(t for _, t, _ in res),
          "compile_s": sum(cs for _, _, cs in res), "dtype": c.dtype,
          "iterations": first.stats.iterations,
          "k_histogram": {str(k): n for k, n in (first.stats.k_histogram or {}).items()},
          "new_tokens": [len(t) for t in outputs[c.key][:n]],
          **{name: counts[name][:n] for name in ("rounds", "drafted", "accepted", "rejected",
                                                 "accepted_at") if name in counts}}
    plain_tokens, plain_text = rows[PLAIN]
    return {"key": unit.key, "turn": unit.turn, "batch": unit.batch, "index": unit.index,
            "filler": unit.filler, "prompt_hash": prompt_hash(prompts),
            "requests": [{"id": r.id, "category": r.category, "turn": r.turn,
                          "prompt_tokens": len(r.ids)} for r in unit.requests],
            "configs": configs, "divergences": divergences,
            "answers": {"tokens": plain_tokens[:n],
                        "text": plain_text[:n] if plain_text is not None else None}}
