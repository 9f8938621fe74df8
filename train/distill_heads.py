"""python -m train.distill_heads --config configs/NAME.yaml [--set dotted.key=value ...]

Distills draft heads (Medusa, EAGLE, EAGLE-3, MTP) onto a frozen target:

  1. loads the target (`target:`);
  2. builds training windows (train/data.py: the target's own continuations of dev.txt
     prompts, cached on disk, and/or dev.txt text), then fresh heads (`head:`); an EAGLE-3
     `head.draft_vocab_size` picks the most frequent target tokens of those windows as its
     draft vocabulary (d2t / t2d, as SpecForge does);
  3. trains with optax AdamW (warmup + cosine decay, gradient clipping); only the head's
     params are in the optimizer state; every step runs the frozen target over the [B, T]
     batch inside the same jitted step for its features and soft labels (train/losses.py);
  4. checkpoints {params, opt_state} with orbax every `train.checkpoint_every` steps into
     `out_dir`/checkpoints; rerunning the same command resumes from the last one, and batch
     order is a function of (seed, step), so a resumed run ends where an uninterrupted one does;
  5. saves the heads to `out_dir`/heads (orbax params + heads.json with the target's
     fingerprint; load with sj.drafters.load(out_dir, target));
  6. measures alpha / tau with sj.generate on held-out prompts, before (untrained heads) and
     after training, greedy and T=1, prints the table and writes `out_dir`/eval.json.

Per-step training losses go to `out_dir`/losses.json (merged across resumes).

Data parallelism: `mesh: {data: N, model: M}` (or --set mesh.data=8) trains on a mesh over every
device of every process (N x M of them): the frozen target sharded as in generation
(spec_jax.sharding), each step's batch split over "data", the heads and optimizer state
replicated; the heads' gradients are averaged across "data" by GSPMD (the loss is a mean over
the global batch). The global batch of step s is a function of (seed, s) only
(train/data.py); each process places the rows its own devices hold, so a resumed or re-sharded
run sees the same batches, and its losses are those of one device up to float rounding. Under
several processes (spec_jax.launch, a pod) every process runs this same command: checkpoints
are written and restored by all of them (orbax, multi-host), everything else on disk (losses,
heads, eval.json) and every printed line by process 0, which also runs the acceptance evals.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import spec_jax as sj
from spec_jax import distributed
from spec_jax import sharding
from spec_jax.drafters import heads_io
from spec_jax.models.transformer import KVCache, forward
from train import checkpoint as ckpt_lib
from train import data as data_lib
from train import evaluate as eval_lib
from train import losses
from train.config import load_config


def log(msg: str) -> None:
  """A progress line on stderr, from process 0 only."""
  if distributed.is_main():
    print(msg, file=sys.stderr, flush=True)


def say(msg: str) -> None:
  """A result line on stdout, from process 0 only."""
  if distributed.is_main():
    print(msg, flush=True)


def make_mesh(cfg: dict):
  """The config's mesh over every device of every process, or None (one device)."""
  m = cfg["mesh"]
  if m["data"] is None and m["model"] is None:
    if distributed.process_count() > 1:
      raise ValueError(f"this run has {distributed.process_count()} processes: give the config "
                       f"a mesh (e.g. --set mesh.data={jax.device_count()}) over their "
                       f"{jax.device_count()} devices")
    return None
  return sharding.make_mesh(data=m["data"], model=m["model"])


def host_copy(tree):
  """Numpy copies of replicated (possibly multi-process) arrays: this process's own replica."""
  return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array)
                      else np.asarray(x), tree)


def build_head(cfg: dict, target, draft_tokens=None):
  """Fresh heads per cfg["head"]; draft_tokens: EAGLE-3's draft vocabulary (target ids)."""
  h = cfg["head"]
  key = jax.random.key(cfg["seed"])
  if h["kind"] == "medusa":
    return heads_io.build("medusa", target, {"num_heads": h["num_draft"],
                                             "num_layers": h["medusa_layers"]}, key=key)
  hp = {"init_std": h["init_std"]}
  if h["intermediate_size"] is not None:
    hp["intermediate_size"] = h["intermediate_size"]
  if h["kind"] in ("eagle", "eagle3", "eagle3_fused") and h["num_heads"] is not None:
    hp["num_heads"] = h["num_heads"]
  if h["kind"] in ("eagle3", "eagle3_fused") and h["target_layers"] is not None:
    hp["target_layers"] = tuple(h["target_layers"])
  if draft_tokens is not None:
    hp["draft_tokens"] = [int(i) for i in draft_tokens]
  return heads_io.build(h["kind"], target, hp, key=key)


def make_optimizer(tcfg: dict, params=None):
  """AdamW (warmup + cosine, clipping) over the head's params; the top-level params named in
  train.frozen keep their initial values (optax.set_to_zero on their updates)."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=tcfg["lr"], warmup_steps=min(tcfg["warmup_steps"], tcfg["steps"]),
      decay_steps=max(tcfg["steps"], tcfg["warmup_steps"] + 1),
      end_value=tcfg["lr"] * tcfg["end_lr_ratio"])
  adamw = optax.chain(optax.clip_by_global_norm(tcfg["clip_norm"]),
                      optax.adamw(schedule, weight_decay=tcfg["weight_decay"]))
  frozen = set(tcfg.get("frozen") or ())
  if not frozen:
    return adamw
  unknown = sorted(frozen - set(params))
  if unknown:
    raise ValueError(f"train.frozen names {unknown}, which these heads do not have; allowed: "
                     f"{', '.join(sorted(params))}")
  labels = {name: jax.tree.map(lambda _, n=name: "frozen" if n in frozen else "train", leaf)
            for name, leaf in params.items()}
  return optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()}, labels)


def make_loss_fn(head, target_config, tcfg: dict):
  """loss(params, target_params, tokens, key) -> (loss, metrics); the target is frozen."""
  layers = tuple(head.target_layers)
  compute = jnp.bfloat16 if tcfg["dtype"] == "bfloat16" else jnp.float32

  def loss_fn(params, target_params, tokens, key):
    b, t = tokens.shape
    out = forward(target_params, target_config, tokens, KVCache.zeros(target_config, b, t),
                  jnp.zeros((b,), jnp.int32), return_layers=layers)
    out = jax.lax.stop_gradient(out)
    probs = jax.nn.softmax(out.logits.astype(jnp.float32), axis=-1)
    # bfloat16: the head computes with bf16-rounded weights; master weights stay float32.
    p = jax.tree.map(lambda x: x.astype(compute).astype(jnp.float32), params)
    if head.kind == "medusa":
      return losses.medusa_loss(p, out.hidden, probs, tcfg)
    return losses.feature_head_loss(head, p, target_params, tokens, out.hidden,
                                    out.layer_hidden, probs, tcfg, key)

  return loss_fn


def run(cfg: dict) -> dict:
  """Trains per `cfg` (train.config schema). Returns a summary dict (also used by tests)."""
  started = time.perf_counter()
  distributed.agree(cfg, "the training config")
  mesh = make_mesh(cfg)
  main = distributed.is_main()
  out_dir = pathlib.Path(cfg["out_dir"])
  out_dir.mkdir(parents=True, exist_ok=True)
  tcfg, ecfg, hcfg = cfg["train"], cfg["eval"], cfg["head"]
  target = sj.load(cfg["target"])
  fp = heads_io.fingerprint(target)
  windows = data_lib.build_windows(target, cfg["data"], fp["sha256"], cfg["seed"], log)
  draft_tokens = None
  if hcfg["draft_vocab_size"] is not None:
    draft_tokens = data_lib.frequent_tokens(windows, hcfg["draft_vocab_size"],
                                            target.config.vocab_size)
    covered = np.isin(windows, draft_tokens).mean()
    log(f"draft vocabulary: the {len(draft_tokens)} most frequent of {target.config.vocab_size} "
        f"tokens cover {covered:.1%} of the training tokens")
  head = build_head(cfg, target, draft_tokens)
  k_eval = ecfg["num_draft"] or hcfg["num_draft"]
  log(f"target {cfg['target']}: {target.config.num_params} params; {head.kind} heads, "
      f"{sum(np.size(x) for x in jax.tree.leaves(head.params))} trainable params")

  evals = {}
  prompts = None
  if ecfg["enabled"] and main:     # sj.generate on this process's devices only
    prompts = eval_lib.heldout_prompts(target, ecfg["path"], ecfg["num_prompts"],
                                       ecfg["prompt_tokens"])
    if ecfg["before"]:
      evals["before"] = eval_lib.measure(target, head, prompts, k_eval, ecfg["temperatures"],
                                         ecfg["max_new_tokens"], cfg["seed"])

  optimizer = make_optimizer(tcfg, head.params)
  loss_fn = make_loss_fn(head, target.config, tcfg)

  def train_step(params, opt_state, target_params, tokens, key):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, target_params, tokens, key)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, metrics

  # On a mesh: the target as in generation, the batch on "data", everything else replicated
  # (the heads' state stays replicated across steps: out_shardings pins it).
  pinned = {} if mesh is None else {"out_shardings": jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec())}
  train_step = jax.jit(train_step, **pinned)
  eval_loss = jax.jit(loss_fn, **pinned)
  target_params = sharding.shard_params(mesh, target.params)
  batch_of = lambda idx: sharding.shard_rows(mesh, np.asarray(windows[idx]))

  params = sharding.replicate(mesh, head.params)
  state = {"params": params, "opt_state": sharding.replicate(mesh, optimizer.init(params))}
  ckpts = ckpt_lib.TrainCheckpoints(out_dir / "checkpoints", tcfg["checkpoint_every"])
  start = 0
  latest = ckpts.latest_step()
  if latest is not None:
    try:
      state = ckpts.restore(latest, state)
    except Exception as e:  # noqa: BLE001 - orbax raises many types on a structure mismatch
      raise ValueError(f"{out_dir / 'checkpoints'} holds a step-{latest} checkpoint that does "
                       f"not match this config's heads ({e.__class__.__name__}: {e}); resume "
                       "with the config that wrote it, or use a fresh out_dir") from e
    start = latest
    log(f"resuming from {out_dir / 'checkpoints'} at step {start}")

  probe = batch_of(data_lib.batch_indices(len(windows), tcfg["batch_size"], cfg["seed"] + 1, 0))
  probe_key = sharding.replicate(mesh, jax.random.key(0))
  l0, m0 = eval_loss(sharding.replicate(mesh, head.params), target_params, probe, probe_key)
  initial = {"loss": float(l0), "agree": np.asarray(m0["agree"]).tolist()}

  steps = tcfg["steps"]
  stop_after = tcfg["stop_after"]
  bar = _progress(start, steps, enabled=main)
  base_key = jax.random.key(cfg["seed"])
  train_started = time.perf_counter()
  loss = metrics = None
  params, opt_state = state["params"], state["opt_state"]
  stopped = False
  done = start
  losses = {}
  for step in range(start, steps):
    idx = data_lib.batch_indices(len(windows), tcfg["batch_size"], cfg["seed"], step)
    params, opt_state, loss, metrics = train_step(
        params, opt_state, target_params, batch_of(idx),
        sharding.replicate(mesh, jax.random.fold_in(base_key, step)))
    losses[step + 1] = loss
    done = step + 1
    if done % tcfg["log_every"] == 0 or done == steps:
      agree = " ".join(f"{a:.2f}" for a in np.asarray(metrics["agree"]))
      bar.update(done, f"loss {float(loss):.3f} top1 [{agree}]")
    if done % tcfg["checkpoint_every"] == 0 or done == steps:
      ckpts.save(done, {"params": params, "opt_state": opt_state})
    if stop_after is not None and done >= stop_after:
      stopped = True
      break
  bar.close()
  ckpts.close()
  train_seconds = time.perf_counter() - train_started
  losses = {s: float(v) for s, v in losses.items()}
  if main:
    _write_losses(out_dir / "losses.json", losses)

  l1, m1 = eval_loss(params, target_params, probe, probe_key)
  final = {"loss": float(l1), "agree": np.asarray(m1["agree"]).tolist()}
  params = host_copy(params)
  summary = {"kind": head.kind, "num_draft": k_eval, "start_step": start,
             "end_step": done, "stopped": stopped,
             "initial": initial, "final": final, "train_seconds": train_seconds,
             "params": params, "losses": losses,
             "processes": distributed.process_count(),
             "devices": 1 if mesh is None else mesh.size}
  if stopped:
    log(f"stopped after step {done} (train.stop_after); rerun to resume")
    return summary

  trained = head.with_params(params)
  if main:
    heads_dir = heads_io.save(out_dir / "heads", trained, target, num_draft=k_eval,
                              extra={"train_steps": steps, "config": _jsonable(cfg)})
    log(f"heads saved to {heads_dir} (load: sj.drafters.load({str(out_dir)!r}, target))")
  if ecfg["enabled"] and main:
    evals["after"] = eval_lib.measure(target, trained, prompts, k_eval, ecfg["temperatures"],
                                      ecfg["max_new_tokens"], cfg["seed"])
    table = eval_lib.format_table(head.kind, k_eval, evals)
    say(table)
  total = time.perf_counter() - started
  say(f"training: {steps - start} steps in {train_seconds:.1f} s; whole run {total:.1f} s; "
      f"probe loss {initial['loss']:.3f} -> {final['loss']:.3f}")
  report = {"kind": head.kind, "num_draft": k_eval, "eval": {n: {str(t): v for t, v in r.items()}
                                                             for n, r in evals.items()},
            "train_seconds": train_seconds, "total_seconds": total, "steps": steps,
            "initial": initial, "final": final}
  if main:
    heads_io._write_json_atomic(out_dir / "eval.json", report)
  summary.update(eval=evals, total_seconds=total)
  return summary


def _write_losses(path: pathlib.Path, losses: dict) -> None:
  """out_dir/losses.json: {"losses": {step: training loss}}, merged with an earlier run's."""
  old = {}
  if path.is_file():
    try:
      old = json.loads(path.read_text()).get("losses", {})
    except json.JSONDecodeError:
      old = {}
  old.update({str(s): v for s, v in losses.items()})
  merged = dict(sorted(old.items(), key=lambda kv: int(kv[0])))
  heads_io._write_json_atomic(path, {"losses": merged})


def _jsonable(obj):
  return json.loads(json.dumps(obj, default=str))


class _progress:
  """tqdm when installed, else a line on stderr at each update (nothing when not enabled)."""

  def __init__(self, start, total, enabled: bool = True):
    self.n = start
    self.bar = None
    if enabled:
      try:
        from tqdm import tqdm
        self.bar = tqdm(total=total, initial=start, file=sys.stderr, dynamic_ncols=True,
                        mininterval=1.0)
      except ImportError:
        pass
    self.total = total

  def update(self, step, text):
    if self.bar is not None:
      self.bar.update(step - self.n)
      self.bar.set_postfix_str(text, refresh=False)
    else:
      log(f"step {step}/{self.total} {text}")
    self.n = step

  def close(self):
    if self.bar is not None:
      self.bar.close()


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m train.distill_heads",
                                   description="Distill draft heads onto a frozen target.")
  parser.add_argument("--config", required=True, help="YAML config (see configs/distill_*.yaml)")
  parser.add_argument("--set", action="append", default=[], metavar="dotted.key=value",
                      help="override a config value (repeatable), e.g. --set train.steps=200")
  args = parser.parse_args(argv)
  distributed.initialize()          # a multi-process run (spec_jax.launch, a pod) or nothing
  cfg = load_config(args.config, args.set)
  return run(cfg)


if __name__ == "__main__":
  try:
    main()
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    distributed.exit(2)
  distributed.exit(0)
