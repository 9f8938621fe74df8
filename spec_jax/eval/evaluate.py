"""evaluate(options): the whole evaluation, turn by turn, batch size by batch size, unit by
unit, resumable from its directory; then results.json, report.md and the plots.

Several processes (spec_jax.launch, a pod; options.mesh is then required) run the same
evaluation: every process makes the same generate() calls, each feeding its share of every
batch, and gets every row back; only process 0 reads and writes DIR, and what it reads (a
stored unit, the manifest check) is sent to the others (spec_jax.distributed.on_main)."""

from __future__ import annotations

import dataclasses
import datetime
import os
import time

from spec_jax import distributed, sharding
from spec_jax.bench.prompts import read_prompt_records, source_path
from spec_jax.bench.results import SCHEMA_VERSION, describe_cpu, log, machine_info
from spec_jax.bench.specs import (draft_model_of, drafter_label, load_model, make_drafter,
                                  model_label, resolve_path)
from spec_jax.eval import aggregate
from spec_jax.eval.options import EvalOptions
from spec_jax.eval.progress import Progress
from spec_jax.eval.prompting import (build_requests, check_template_options, prompt_format,
                                     select_records)
from spec_jax.eval.report import mixed_hosts_note, render_markdown, write_plots
from spec_jax.eval.runner import PLAIN, Config, UnitRunner, plan_units
from spec_jax.eval.store import RunDir, prompt_hash
from spec_jax.files import atomic_write_json, atomic_write_text
from spec_jax.tree import parse_tree_spec


def make_configs(target, opts: EvalOptions) -> list:
  """Plain decoding first (then plain decoding in each of opts.plain_dtypes), then every
  drafter, each followed by its trees (opts.trees, for the drafters that build trees).
  ValueError: K above a drafter's max_draft, or trees and no drafter that builds them."""
  dtype = target.config.dtype
  configs = [Config(key=PLAIN, label="plain", drafter=None, num_draft=0, dtype=dtype)]
  for other in opts.plain_dtypes:
    if other != dtype:
      configs.append(Config(key=f"{PLAIN}@{other}", label=f"plain {other}", drafter=None,
                            num_draft=0, target=target.astype(other), dtype=other))
  for spec in opts.drafters:
    dr = make_drafter(spec, target, opts.seed)
    cap = getattr(dr, "max_draft", None)
    if cap is not None and isinstance(opts.num_draft, int) and opts.num_draft > cap:
      raise ValueError(f"drafter {spec} proposes at most {cap} tokens per round; give "
                       f"--num-draft {cap} or less (got {opts.num_draft})")
    configs.append(Config(key=spec, label=drafter_label(spec), drafter=dr,
                          num_draft=opts.num_draft, dtype=dtype))
    if getattr(dr, "supports_tree", False):
      for text in opts.trees:
        configs.append(tree_config(spec, dr, text, dtype))
  if opts.trees and not any(c.tree is not None for c in configs):
    raise ValueError(f"--tree needs a drafter that builds trees (n-gram, draft models, heads, "
                     f"DFlash / DSpark); none of {list(opts.drafters)} does")
  return configs


def tree_config(spec: str, drafter, text: str, dtype) -> Config:
  """The tree configuration of a drafter spec and a validated tree text (options.tree_text)."""
  return Config(key=f"{spec}@tree:{text}", label=f"{drafter_label(spec)} tree {text}",
                drafter=drafter, num_draft=f"tree {text}", dtype=dtype,
                tree=parse_tree_spec(text))


def fingerprint(opts: EvalOptions, fmt: str) -> dict:
  """The options that decide what a stored unit means (batch sizes and drafters do not: units
  are stored per batch size and hold every configuration)."""
  target = opts.target if opts.target.startswith("random:") else str(
      resolve_path(opts.target).resolve())
  return {"target": target, "prompts": str(source_path(opts.prompts).resolve()),
          "limit_per_category": opts.limit_per_category, "num_draft": opts.num_draft,
          "temperature": opts.temperature, "max_new_tokens": opts.max_new_tokens,
          "sampling": [list(kv) for kv in opts.sampling], "categories": list(opts.categories),
          "repeats": opts.repeats, "seed": opts.seed, "dtype": opts.dtype,
          "plain_dtypes": list(opts.plain_dtypes),
          "prompt_format": fmt, "chat_template_kwargs": opts.chat_template_kwargs}


def _warn_skipped(skipped, turn: int, strict: bool, main: bool = True) -> None:
  if not skipped:
    return
  ids = ", ".join(s["id"] for s in skipped[:20]) + (" ..." if len(skipped) > 20 else "")
  msg = (f"{len(skipped)} turn-{turn} prompt(s) do not fit the context (prompt + max new "
         f"tokens) and are skipped: {ids}")
  if strict:
    raise ValueError(f"--strict: {msg}")
  if main:
    log(f"[eval] warning: {msg}")


def _measure_turn(run_dir, runner, requests, batches, turn, progress, counters, host) -> list:
  """The units of one turn at every batch size: stored ones reused, the rest measured and
  stored with `host` (describe_cpu of this machine: a resumed run may span hosts)."""
  units = []
  for b in batches:
    for unit in plan_units(requests, b, turn):
      phash = prompt_hash(unit.prompts())
      stored = distributed.on_main(lambda: run_dir.load_unit(
          unit.key, phash, [c.key for c in runner.configs]))
      reused = stored is not None
      if not reused:
        stored = dict(runner.measure(unit), host=host)
        if distributed.is_main():
          run_dir.save_unit(unit.key, stored)
      counters["reused" if reused else "measured"] += 1
      progress.advance(reused=reused)
      units.append(stored)
  return units


def _answers_from(units, turn: int) -> dict:
  """(record id, turn) -> plain decoding's answer text at the smallest batch size."""
  b = min(u["batch"] for u in units)
  out = {}
  for u in units:
    if u["batch"] == b and u["turn"] == turn:
      for req, text in zip(u["requests"], u["answers"]["text"]):
        out[(req["id"], turn)] = text
  return out


def evaluate(opts: EvalOptions) -> dict:
  """Runs (or resumes) the evaluation and writes DIR/results.json, DIR/report.md and the
  plots; returns the results. ValueError for bad options or inputs, before anything runs;
  runner.LossyOutputError when greedy outputs differ."""
  opts = opts.validate()
  started = time.time()
  distributed.agree(dataclasses.asdict(opts), "the evaluation's options")
  if distributed.process_count() > 1 and opts.mesh is None:
    raise ValueError(f"this evaluation runs on {distributed.process_count()} processes: give "
                     "--mesh data=N,model=M over all their devices")
  mesh = sharding.parse_mesh(opts.mesh)
  main = distributed.is_main()
  target = load_model(opts.target, opts.seed, dtype=opts.dtype)
  if target.tokenizer is None:
    raise ValueError(f"{opts.target} has no tokenizer: the evaluation reads text prompts")
  configs = make_configs(target, opts)
  context = min([target.config.max_position_embeddings] + [
      draft_model_of(c.drafter).config.max_position_embeddings for c in configs
      if draft_model_of(c.drafter) is not None])
  records = select_records(read_prompt_records(opts.prompts), opts.limit_per_category,
                           opts.categories)
  fmt = prompt_format(target)
  check_template_options(target, opts.chat_template_kwargs)   # before DIR is written
  run_dir = RunDir(opts.out)
  distributed.on_main(lambda: run_dir.open(fingerprint(opts, fmt)))
  info = machine_info()
  info["processes"] = distributed.process_count()
  runner = None
  progress = Progress(enabled=opts.progress, silent=not main)
  units, skipped, answers = [], [], {}
  counters = {"measured": 0, "reused": 0}
  try:
    for turn in range(1, max(len(r.turns) for r in records) + 1):
      requests, sk = build_requests(target, records, turn, answers, context, opts.max_new_tokens,
                                    opts.chat_template_kwargs)
      skipped += sk
      _warn_skipped(sk, turn, opts.strict, main)
      if not requests:
        continue
      progress.add_total(sum(-(-len(requests) // b) for b in opts.batch))
      runner = runner or UnitRunner(target, configs, opts.max_new_tokens, opts.temperature,
                                    opts.seed, opts.repeats, progress, mesh,
                                    sampling=opts.sampling)
      turn_units = _measure_turn(run_dir, runner, requests, opts.batch, turn, progress, counters,
                                 describe_cpu(info))
      units += turn_units
      answers.update(_answers_from(turn_units, turn))
  finally:
    progress.close()
  if not units:
    raise ValueError(f"no prompt of {opts.prompts} fits the context of {context} positions "
                     f"with {opts.max_new_tokens} new tokens; lower --max-new-tokens")
  res = results_of(opts, target, configs, records, units, skipped, fmt, info, counters)
  if len(res["run"]["hosts"]) > 1 and main:
    log(f"[eval] warning: {mixed_hosts_note(res['run']['hosts'])}")
  res["wall_seconds"] = time.time() - started
  res["plots"] = write_plots(res, run_dir.path) if main else []
  if main:
    atomic_write_json(run_dir.path / "results.json", res)
    atomic_write_text(run_dir.path / "report.md", render_markdown(res))
  return res


def results_of(opts, target, configs, records, units, skipped, fmt, info, counters) -> dict:
  """results.json's content (plots and wall time are added by evaluate)."""
  try:
    info["loadavg_end"] = os.getloadavg()
  except OSError:
    pass
  batches = list(opts.batch)
  categories = list(dict.fromkeys(r.category for r in records))
  rows = aggregate.request_rows(units, configs)
  greedy = opts.temperature == 0
  return {
      "schema_version": SCHEMA_VERSION, "kind": "eval",
      "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "machine": info, "options": dataclasses.asdict(opts),
      "target": {"spec": opts.target, "label": model_label(opts.target),
                 "params": target.config.num_params, "prompt_format": fmt,
                 "context": target.config.max_position_embeddings},
      "drafters": [{"spec": c.key, "label": c.label, "num_draft": c.num_draft}
                   for c in configs if not c.is_plain],
      "prompts": {"source": opts.prompts, "selected": len(records), "categories": categories,
                  "requests": len({(r["id"], r["turn"]) for r in rows})},
      "skipped": skipped,
      "greedy_check": {"checked": greedy, "mismatches": 0,
                       "requests_compared": sum(1 for r in rows if r["config"] == PLAIN)
                       if greedy else 0,
                       "near_tie_divergences": [d for u in units
                                                for d in u.get("divergences", [])]},
      "summary": aggregate.summary_table(rows, configs, batches, categories),
      "throughput": aggregate.throughput_table(units, configs, batches),
      "compile": aggregate.compile_summary(units, configs),
      "latency": aggregate.latency_table(rows, configs, batches),
      "requests": rows,
      "answers": aggregate.answers_of(units),
      "run": {"units": len(units), "units_measured": counters["measured"],
              "units_reused": counters["reused"], "out": str(opts.out),
              "hosts": sorted({u.get("host", describe_cpu({})) for u in units})},   # {}: unrecorded
      "definitions": aggregate.EVAL_DEFINITIONS,
  }
