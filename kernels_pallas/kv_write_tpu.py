"""The TPU cache kernels: new keys / values written into a head-major stacked KV cache, and a
tree round's accepted path moved to contiguous slots, in place, with Pallas.

Why a kernel. The cache is [L, B, Hkv, S, D] (the TPU attention kernel reads one head's
[block_k, D] window of it in place). Written with XLA's scatter at slots offsets[b] + t, XLA:TPU
lays the whole cache out slot-major in memory ({4,2,3,1,0}: a scatter wants its scattered axes
major), so before every attention call it copied the layer's K and V back to [B, Hkv, S, D]:
per round, the whole cache read and written once more (4 GiB each way for an 8B decode at B = 8
and 4,096 slots; `python -m spec_jax.aot`'s buffer reports, docs/accelerators.md). A Pallas call
fixes its operands' layout: with the writes and the reads both kernels, the cache keeps one
row-major layout and nothing copies it.

How. A DMA into HBM must start on a tile boundary of the two minor dims (Mosaic refuses a
dynamic slot offset that is not a multiple of the tile), so each row reads the tile-aligned
window of W slots that holds its T new slots into VMEM, places the new entries in it with a
one-hot [W, T] x [T, D] matmul per head (exact for finite entries: one 1.0 per output element,
float32 accumulation; a non-finite K or V entry, 0 x inf = NaN, spreads NaN over its window's
column, where the scatter kept it to its slot), and writes the window back. Slots at or past
S are dropped (as the scatter's mode="drop" did); the window itself always lies inside the
buffer.

The move (`move_slots_pallas_tpu`, after a tree round): slot lengths[b] + j takes slot
src[b, j] for j < n_accepted[b]. Each source's aligned tile is read first (all reads before
any write, as the gather-then-scatter it replaces), the D sources are picked out of them and
placed into the aligned window of the destinations, both with one-hot matmuls, in every layer.

Grids: the write one step per row b, the move one per (layer, row); all steps independent
("parallel"). Offsets, lengths, sources and the layer are scalars in SMEM. The cache operand
is aliased to the output: XLA updates the buffer in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

ALIGN = 16        # slots per aligned window step: a multiple of every dtype's sublane tile
                  # (float32 8, bfloat16 16 packed rows)
SUPPORTED_DTYPES = ("float32", "bfloat16")
MAX_WINDOW_BYTES = 8 * 1024 * 1024     # VMEM for one row's window (all its kv heads)


def window_slots(num_new: int) -> int:
  """W: the aligned window that holds T consecutive slots starting anywhere."""
  return -(-(num_new + ALIGN - 1) // ALIGN) * ALIGN


def _cache_reason(cache_shape, dtype, window: int, vmem_slots: int) -> str | None:
  """Why a kernel cannot take a stacked head-major cache with this window (None: it can)."""
  if len(cache_shape) != 5:
    return f"cache of rank {len(cache_shape)}, not a stacked [L, B, Hkv, S, D] buffer"
  _, _, hkv, s, d = cache_shape
  if jnp.dtype(dtype).name not in SUPPORTED_DTYPES:
    return f"dtype {jnp.dtype(dtype).name} not in {SUPPORTED_DTYPES}"
  if s % ALIGN or s < window:
    return f"{s} slots: need a multiple of {ALIGN} and at least the window of {window}"
  if hkv * vmem_slots * d * jnp.dtype(dtype).itemsize > MAX_WINDOW_BYTES:
    return f"{hkv} kv heads x {vmem_slots} slots x {d} exceed {MAX_WINDOW_BYTES} bytes of VMEM"
  return None


def unsupported_reason(cache_shape, new_shape, dtype) -> str | None:
  """None when the kernel handles a stacked head-major cache [L, B, Hkv, S, D] written with
  new [B, T, Hkv, D], else why not (write_rows then scatters)."""
  w = window_slots(new_shape[1])
  return _cache_reason(cache_shape, dtype, w, w)


def _kernel(scalars_ref, new_ref, cache_in_ref, cache_ref, window_ref, sem, *, num_new: int,
            slots: int):
  # scalars_ref: SMEM int32 [B + 1] (offsets, then the layer); new_ref: VMEM [Hkv, T, D] of row
  # b; cache_ref: HBM [L, B, Hkv, S, D] (aliased with cache_in_ref); window_ref: VMEM [Hkv, W, D].
  del cache_in_ref
  b = pl.program_id(0)
  num_rows = pl.num_programs(0)
  offset = scalars_ref[b]
  layer = scalars_ref[num_rows]
  w = window_ref.shape[1]
  # jax.lax.div, not //: offsets are >= 0, and floor division's sign fix-up has no Mosaic
  # lowering without a chip's generation at hand.
  start = pl.multiple_of(jnp.minimum(jax.lax.div(offset, ALIGN) * ALIGN, slots - w), ALIGN)
  window = cache_ref.at[layer, b, :, pl.ds(start, w), :]
  copy_in = pltpu.make_async_copy(window, window_ref, sem.at[0])
  copy_in.start()
  copy_in.wait()
  # place[w, t]: new slot t lands on window slot w (slots past S are dropped).
  rel = offset - start
  w_ids = jax.lax.broadcasted_iota(jnp.int32, (w, num_new), 0)
  t_ids = jax.lax.broadcasted_iota(jnp.int32, (w, num_new), 1)
  place = (w_ids == rel + t_ids) & (start + w_ids < slots)
  hit = jnp.max(place.astype(jnp.int32), axis=1, keepdims=True) > 0          # [W, 1]
  one_hot = place.astype(jnp.float32)
  for h in range(window_ref.shape[0]):
    moved = jax.lax.dot_general(one_hot, new_ref[h].astype(jnp.float32),
                                (((1,), (0,)), ((), ())),
                                precision=jax.lax.Precision.HIGHEST,
                                preferred_element_type=jnp.float32)        # [W, D]
    window_ref[h] = jnp.where(hit, moved.astype(window_ref.dtype), window_ref[h])
  copy_out = pltpu.make_async_copy(window_ref, window, sem.at[0])
  copy_out.start()
  copy_out.wait()


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_slots_pallas_tpu(cache, layer, new, offsets, *, interpret=False):
  """cache [L, B, Hkv, S, D] <- new [B, T, Hkv, D] at slab `layer`, row b, slots offsets[b] ..
  offsets[b] + T - 1 (those past S dropped); XLA updates the cache in place (the output
  aliases it) where it is not used afterwards.

  layer: int or int32 scalar; offsets int32 [B] >= 0. Inputs are assumed valid
  (unsupported_reason is None). interpret: the Pallas interpreter (CPU tests)."""
  _, b, hkv, s, d = cache.shape
  t = new.shape[1]
  w = window_slots(t)
  scalars = jnp.concatenate([offsets.astype(jnp.int32),
                             jnp.asarray(layer, jnp.int32).reshape(1)])
  new_heads = jnp.swapaxes(new, 1, 2).astype(cache.dtype)                  # [B, Hkv, T, D]
  kernel = functools.partial(_kernel, num_new=t, slots=s)
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(b,),
          in_specs=[pl.BlockSpec((None, hkv, t, d), lambda bi, sc: (bi, 0, 0, 0)),
                    pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=pl.BlockSpec(memory_space=pl.ANY),
          scratch_shapes=[pltpu.VMEM((hkv, w, d), cache.dtype),
                          pltpu.SemaphoreType.DMA((1,))]),
      out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
      input_output_aliases={2: 0},
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=interpret,
      name="kv_write_tpu",
  )(scalars, new_heads, cache)



def _move_kernel(len_ref, src_ref, n_ref, cache_in_ref, cache_ref, tiles_ref, window_ref, sem, *,
                 depth: int, slots: int):
  # len_ref, n_ref: SMEM int32 [B]; src_ref: SMEM int32 [B * depth]; cache_ref: HBM
  # [L, B, Hkv, S, D] (aliased); tiles_ref: VMEM [depth, Hkv, ALIGN, D]; window_ref: VMEM
  # [Hkv, W, D]. Grid step (layer, b).
  del cache_in_ref
  layer, b = pl.program_id(0), pl.program_id(1)
  hkv, w = window_ref.shape[0], window_ref.shape[1]
  # 1. The aligned tile holding each source slot (a DMA starts on a tile boundary), all read
  #    before anything is written.
  copies = []
  tile_starts = []
  for j in range(depth):
    src = src_ref[b * depth + j]
    tile = pl.multiple_of(jax.lax.div(src, ALIGN) * ALIGN, ALIGN)
    tile_starts.append(tile)
    copies.append(pltpu.make_async_copy(cache_ref.at[layer, b, :, pl.ds(tile, ALIGN), :],
                                        tiles_ref.at[j], sem.at[0]))
  length = len_ref[b]
  start = pl.multiple_of(jnp.minimum(jax.lax.div(length, ALIGN) * ALIGN, slots - w), ALIGN)
  window = cache_ref.at[layer, b, :, pl.ds(start, w), :]
  copy_window = pltpu.make_async_copy(window, window_ref, sem.at[0])
  for c in copies + [copy_window]:
    c.start()
  for c in copies + [copy_window]:
    c.wait()
  # 2. Per head: the D sources picked out of their tiles, and placed at slots length + j
  #    (j < n_accepted; the rest of the window as it was), one-hot matmuls (exact).
  pick = jnp.zeros((depth, depth * ALIGN), jnp.float32)       # [D, D * ALIGN]
  rows = jax.lax.broadcasted_iota(jnp.int32, (depth, depth * ALIGN), 0)
  cols = jax.lax.broadcasted_iota(jnp.int32, (depth, depth * ALIGN), 1)
  for j in range(depth):
    at = j * ALIGN + src_ref[b * depth + j] - tile_starts[j]
    pick = pick + ((rows == j) & (cols == at)).astype(jnp.float32)
  w_ids = jax.lax.broadcasted_iota(jnp.int32, (w, depth), 0)
  j_ids = jax.lax.broadcasted_iota(jnp.int32, (w, depth), 1)
  place = (w_ids == length - start + j_ids) & (j_ids < n_ref[b]) & (start + w_ids < slots)
  hit = jnp.max(place.astype(jnp.int32), axis=1, keepdims=True) > 0          # [W, 1]
  place = place.astype(jnp.float32)
  dot = functools.partial(jax.lax.dot_general, dimension_numbers=(((1,), (0,)), ((), ())),
                          precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)
  for h in range(hkv):
    stacked = jnp.concatenate([tiles_ref[j, h].astype(jnp.float32) for j in range(depth)],
                              axis=0)                                         # [D*ALIGN, D]
    moved = dot(place, dot(pick, stacked))                                    # [W, D]
    window_ref[h] = jnp.where(hit, moved.astype(window_ref.dtype), window_ref[h])
  copy_out = pltpu.make_async_copy(window_ref, window, sem.at[0])
  copy_out.start()
  copy_out.wait()


@functools.partial(jax.jit, static_argnames=("interpret",))
def move_slots_pallas_tpu(cache, lengths, src, n_accepted, *, interpret=False):
  """In every layer of cache [L, B, Hkv, S, D], row b: slot lengths[b] + j <- slot src[b, j]
  for j < n_accepted[b] (all sources read before any write; slots past S dropped): a tree
  round's accepted path moved to contiguous slots (spec_jax.models.cache.move_kv). In place
  (the output aliases the cache). src int32 [B, depth] in [0, S)."""
  l, b, hkv, s, d = cache.shape
  depth = src.shape[1]
  w = window_slots(depth)
  kernel = functools.partial(_move_kernel, depth=depth, slots=s)
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3,
          grid=(l, b),
          in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=pl.BlockSpec(memory_space=pl.ANY),
          scratch_shapes=[pltpu.VMEM((depth, hkv, ALIGN, d), cache.dtype),
                          pltpu.VMEM((hkv, w, d), cache.dtype),
                          pltpu.SemaphoreType.DMA((1,))]),
      out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
      input_output_aliases={3: 0},
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
      interpret=interpret,
      name="kv_move_tpu",
  )(lengths.astype(jnp.int32), src.astype(jnp.int32).reshape(-1),
    n_accepted.astype(jnp.int32), cache)


def move_unsupported_reason(cache_shape, dtype, depth: int) -> str | None:
  """None when move_slots_pallas_tpu takes this cache and path depth, else why not."""
  w = window_slots(depth)
  return _cache_reason(cache_shape, dtype, w, w + depth * ALIGN)
