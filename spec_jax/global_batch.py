"""A generate() call spread over processes: each process's rows into one global batch, and each
process's rows back.

With a mesh that spans processes (spec_jax.sharding.spans_processes), every process calls
generate() with the same options and its own prompts. The global batch is the processes' rows
concatenated in process order (process 0's first): row r of process p is global row
offset[p] + r, and its randomness is fold_in(key, global row), so the tokens are those of one
process generating every row. Processes may pass different numbers of rows (none included).

How the processes agree on shapes: two small allgathers before anything is compiled. The first
carries each process's row count, longest prompt and a fingerprint of every option that must be
equal (a mismatch is a ValueError on every process, naming the options); the second carries the
prompts themselves (token ids, padded) and their per-row sampling settings. Every process then
holds the whole global batch and pads and buckets it with the same host code as one process
would (engine.prepare_batch), so the padded prompt length and the KV-cache capacity agree by
construction; each device is then given the rows it holds (sharding.shard_rows).
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional

import numpy as np

from spec_jax import distributed
from spec_jax.sampling import OPTIONS, BiasOption, Sampling


class GlobalBatch(NamedTuple):
  """ids: list[list[int]], every process's prompts in global row order; sampling: Sampling of
  per-row numpy arrays [B]; rows: range of this process's global rows; processes: how many
  processes fed rows (their statistics are summed)."""
  ids: list
  sampling: Sampling
  rows: range
  processes: int


def _bucket(n: int) -> int:
  """Power-of-two padding of the exchanged arrays: few distinct shapes, few compiled gathers."""
  return 1 << max(n - 1, 0).bit_length()


def assemble(ids: list, sampling: Sampling, fields: Mapping[str, Any],
             error: Optional[str] = None) -> GlobalBatch:
  """The global batch from this process's prompt ids and Sampling (scalars or per-row arrays
  of len(ids)); `fields`: the options every process must agree on (ValueError otherwise).

  error: this process's own prompts were refused with this message: every process raises a
  ValueError (this one with the message), instead of the others waiting for it forever."""
  try:
    local = sampling.as_arrays(len(ids)) if error is None else sampling.as_arrays(0)
  except ValueError as e:
    error, local = str(e), Sampling().rows(0, np)
  names = sorted(fields)
  meta = np.asarray([len(ids), max((len(r) for r in ids), default=0), error is not None] +
                    [distributed.fingerprint(fields[n]) for n in names], np.int64)
  every = distributed.allgather(meta)                            # [P, 3 + fields]
  counts, longest, failed = every[:, 0], int(every[:, 1].max()), np.flatnonzero(every[:, 2])
  if error is not None:
    raise ValueError(error)
  if len(failed):
    raise ValueError(f"process(es) {failed.tolist()} refused their prompts or sampling settings "
                     "(their own error says why); no process generates")
  differ = [n for i, n in enumerate(names) if np.any(every[:, 3 + i] != every[0, 3 + i])]
  if differ:
    procs = [p for p in range(every.shape[0]) if np.any(every[p, 3:] != every[0, 3:])]
    raise ValueError(f"processes disagree on generate()'s {', '.join(differ)}: process 0 and "
                     f"process(es) {procs} passed different values; every process must call "
                     "generate() with the same options (only its own prompts may differ)")
  if counts.sum() == 0:
    raise ValueError("no process passed a prompt: the global batch is empty")
  b, length = _bucket(int(counts.max())), _bucket(max(longest, 1))
  tokens = np.zeros((b, length), np.int32)
  lens = np.zeros((b,), np.int32)
  for i, r in enumerate(ids):
    tokens[i, :len(r)], lens[i] = r, len(r)
  rows = {"tokens": tokens, "lens": lens}
  # A logit bias is one map every process passed alike (generate()'s agreed options hold it).
  per_row = {n: o for n, o in OPTIONS.items() if not isinstance(o, BiasOption)}
  for name, opt in per_row.items():       # padding rows at the option's "off" value
    rows[name] = np.array(opt.rows(opt.off, b, np))
    rows[name][:len(ids)] = getattr(local, name)
  got = distributed.allgather(rows)
  out_ids, cols = [], {name: [] for name in per_row}
  for p, n in enumerate(counts.tolist()):
    out_ids += [got["tokens"][p, i, :got["lens"][p, i]].tolist() for i in range(n)]
    for name in cols:
      cols[name].append(got[name][p, :n])
  start = int(counts[:distributed.process_index()].sum())
  shared = {n: getattr(sampling, n) for n in OPTIONS if n not in per_row}
  glob = Sampling(**{name: np.concatenate(v) for name, v in cols.items()}, **shared)
  return GlobalBatch(ids=out_ids, sampling=glob, rows=range(start, start + len(ids)),
                     processes=len(counts))


def to_host(tree, spans: bool):
  """Numpy copies of a result pytree: the global arrays, gathered from every process when the
  mesh spans processes (each process then holds every row)."""
  import jax
  if not spans:
    return np.asarray(tree) if isinstance(tree, jax.Array) else jax.tree.map(np.asarray, tree)
  from jax.experimental import multihost_utils
  return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))
