"""verify_attention: validates inputs and picks the kernel for the backend.

impl="auto"      GPU kernel on a gpu platform, TPU kernel on tpu, the jnp reference elsewhere. The
                 platform is the one being lowered for (kernels_pallas.platform.current(): the
                 process's backend, or the one an ahead-of-time export sets).
impl="pallas"    a Pallas kernel always: native on gpu / tpu, under the Pallas interpreter on
                 any other backend (CPU tests). `kernel` picks "gpu" or "tpu" flavour; None =
                 the backend's own, "gpu" on CPU.
impl="reference" the jnp reference.

A kernel that does not support the shapes (see pallas_gpu / pallas_tpu.unsupported_reason) falls
back to the reference with a one-time warning: never a wrong answer. Everything here reads
static shapes and dtypes only, so it works under jit with traced kv_lengths and tree_mask.

Under a mesh (kernels_pallas.platform.kernel_mesh, set by spec_jax.decode) a kernel call is
wrapped in a `shard_map`: XLA cannot partition an opaque Mosaic / Triton call, so each device
runs the kernel on its own rows ("data") and KV heads ("model"), with their query heads: no
collective at all. An axis whose size does not divide the rows (or the KV heads) leaves that
dimension whole on every device of the axis (computed redundantly, still exact).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kernels_pallas import kv_write_tpu, lanes, pallas_gpu, pallas_tpu, platform as platform_lib
from kernels_pallas.reference import verify_attention_reference

IMPLS = ("auto", "pallas", "reference")
KERNELS = ("gpu", "tpu")

_KERNEL_FNS = {"gpu": pallas_gpu.verify_attention_pallas_gpu,
               "tpu": pallas_tpu.verify_attention_pallas_tpu}
_UNSUPPORTED = {"gpu": pallas_gpu.unsupported_reason, "tpu": pallas_tpu.unsupported_reason}
_warned: set = set()


def validate_inputs(q, k_cache, v_cache, kv_lengths, tree_mask=None):
  """Raises ValueError naming what is wrong and what is allowed. Static shapes/dtypes only."""
  def shape(x, name):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(x.shape)

  qs, ks, vs = shape(q, "q"), shape(k_cache, "k_cache"), shape(v_cache, "v_cache")
  if len(qs) != 4:
    raise ValueError(f"q must be rank 4 [B, T, Hq, D], got shape {qs}")
  if len(ks) != 4:
    raise ValueError(f"k_cache must be rank 4 [B, S, Hkv, D], got shape {ks}")
  if vs != ks:
    raise ValueError(f"v_cache shape {vs} must equal k_cache shape {ks} ([B, S, Hkv, D])")
  b, t, hq, d = qs
  kb, s, hkv, kd = ks
  if kb != b:
    raise ValueError(f"batch mismatch: q has B={b}, k_cache/v_cache have B={kb}")
  if kd != d:
    raise ValueError(f"head_dim mismatch: q has D={d}, k_cache/v_cache have D={kd}")
  if min(b, t, hq, d, s, hkv) < 1:
    raise ValueError(f"all dims must be >= 1, got q {qs}, k_cache {ks}")
  if hq % hkv:
    raise ValueError(f"Hq={hq} query heads must be a multiple of Hkv={hkv} kv heads")
  if t > s:
    raise ValueError(f"T={t} new tokens cannot exceed the cache capacity S={s}")
  for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be a floating dtype, got {x.dtype}")
  if k_cache.dtype != v_cache.dtype:
    raise ValueError(f"k_cache dtype {k_cache.dtype} != v_cache dtype {v_cache.dtype}")
  ls = shape(kv_lengths, "kv_lengths")
  if ls != (b,):
    raise ValueError(f"kv_lengths must have shape [B]=({b},), got {ls}")
  if not jnp.issubdtype(kv_lengths.dtype, jnp.integer):
    raise ValueError(f"kv_lengths must be an integer array (int32), got {kv_lengths.dtype}")
  if tree_mask is not None:
    ms = shape(tree_mask, "tree_mask")
    if ms != (b, t, t):
      raise ValueError(f"tree_mask must have shape [B, T, T]=({b}, {t}, {t}) or be None, "
                       f"got {ms}")
    if tree_mask.dtype != jnp.bool_:
      raise ValueError(f"tree_mask must be bool, got {tree_mask.dtype}")


def _warn_once(key, message):
  if key not in _warned:
    _warned.add(key)
    warnings.warn(message, stacklevel=3)


def resolve(impl: str, kernel: str | None = None, platform: str | None = None):
  """(kernel or None for the reference, interpret) for impl on platform (default: the platform
  being lowered for, kernels_pallas.platform.current())."""
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  if kernel is not None and kernel not in KERNELS:
    raise ValueError(f"kernel must be one of {KERNELS} or None, got {kernel!r}")
  platform = platform_lib.normalize(platform) if platform else platform_lib.current()
  if impl == "reference":
    return None, False
  if impl == "auto":
    if kernel is not None:
      return kernel, platform != kernel
    return (platform, False) if platform in KERNELS else (None, False)
  chosen = kernel or (platform if platform in KERNELS else "gpu")
  return chosen, platform != chosen


def _head_major_packing(q, k_cache, layer) -> int:
  """p of a head-major cache (lanes.py), after the checks the packing needs: the cache's rank
  (4, or 5 with `layer`) and a minor dim that is q's head_dim or a packed 128 = p x head_dim
  (the only packing lanes.lane_pack makes); anything else is a head_dim mismatch."""
  want = 4 + (layer is not None)
  if getattr(k_cache, "ndim", None) != want or getattr(q, "ndim", None) != 4:
    raise ValueError(f"head_major wants q [B, T, Hq, D] and a cache of rank {want} "
                     f"([{'L, ' if layer is not None else ''}B, Hkv, S, D]), got q of shape "
                     f"{getattr(q, 'shape', None)} and k_cache of shape "
                     f"{getattr(k_cache, 'shape', None)}")
  minor, head_dim = k_cache.shape[-1], q.shape[-1]
  if minor == head_dim or (minor == lanes.LANES and minor % head_dim == 0):
    return minor // head_dim
  raise ValueError(f"head_dim mismatch: q has head_dim {head_dim}, the head-major cache's minor "
                   f"dim is {minor} (allowed: {head_dim}, or {lanes.LANES} lane-packed)")


def verify_attention(q, k_cache, v_cache, kv_lengths, tree_mask=None, impl="auto", *,
                     kernel: str | None = None, layer: int | None = None,
                     head_major: bool = False, **kernel_kwargs):
  """See ../shared/DESIGN.md. q [B,T,Hq,D]; k_cache, v_cache [B,S,Hkv,D]; kv_lengths int32[B].

  kv_lengths counts the valid cache entries including the T new ones at kv_lengths-T ..
  kv_lengths-1 (T <= kv_lengths <= S is the caller's contract). tree_mask bool [B,T,T] or None
  (causal). impl: "auto" | "pallas" | "reference". kernel: "gpu" | "tpu" | None picks the Pallas
  flavour (see the module docstring). layer: k_cache and v_cache are a model's stacked cache
  [L,B,S,Hkv,D] and layer (a static int) the slab to attend to: a kernel reads it in place
  (k_cache[layer] handed to a custom call is a copy of the layer's cache, every call).
  head_major: the caches are [B,Hkv,S,D] ([L,B,Hkv,S,D] with layer): the TPU kernel and the
  reference read that layout in place, the GPU kernel gets a transposed copy. A head-major
  cache whose minor dim is p x D is lane-packed, [B, Hkv/p, S, p*D] (kernels_pallas.lanes):
  the TPU kernel reads it in place, the other paths unpack the layer's slab.
  kernel_kwargs (block_k, num_splits, ...) go to the kernel. Returns [B,T,Hq,D] in q's dtype.
  """
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  if layer is not None and not (isinstance(layer, int) and getattr(k_cache, "ndim", 0) == 5
                                and 0 <= layer < k_cache.shape[0]):
    raise ValueError(f"layer must be a static int indexing a stacked [L, B, S, Hkv, D] cache, "
                     f"got layer={layer!r} for k_cache of shape {getattr(k_cache, 'shape', None)}")
  # A head-major cache may pack p heads along its lanes, [.., Hkv / p, S, p * D] (lanes.py):
  # the TPU kernel reads it so; every other path gets the layer's slab unpacked (a copy).
  packed = _head_major_packing(q, k_cache, layer) if head_major else 1

  def view(c):           # the [B, S, Hkv, D] shape of one layer, for the checks
    shape = c.shape[1:] if layer is not None else c.shape
    if head_major:
      shape = (shape[0], shape[2], shape[1] * packed, shape[3] // packed)
    return jax.ShapeDtypeStruct(shape, c.dtype)

  validate_inputs(q, view(k_cache), view(v_cache), kv_lengths, tree_mask)
  chosen, interpret = resolve(impl, kernel)
  whole = ((lambda c: lanes.unpack(c, packed)) if layer is None else
           (lambda c: lanes.unpack(c[layer], packed)))
  reference = lambda: verify_attention_reference(q, whole(k_cache), whole(v_cache), kv_lengths,
                                                 tree_mask, head_major=head_major)
  if chosen is None:
    return reference()
  extra = {"head_major": True} if head_major and chosen == "tpu" else {}
  reason = _UNSUPPORTED[chosen](q.shape, view(k_cache).shape, q.dtype, k_cache.dtype,
                                **({"block_k": kernel_kwargs["block_k"]}
                                   if "block_k" in kernel_kwargs else {}), **extra)
  if reason is not None:
    _warn_once((chosen, reason),
               f"kernels_pallas.verify_attention: the {chosen} Pallas kernel does not support "
               f"this call ({reason}); using the jnp reference instead.")
    return reference()
  if head_major and chosen != "tpu":        # the GPU kernel reads [B, S, Hkv, D]: a copy
    k_cache, v_cache = (jnp.swapaxes(whole(c), 1, 2) for c in (k_cache, v_cache))
    layer, head_major = None, False
  call = lambda q, k, v, lengths, mask: _KERNEL_FNS[chosen](
      q, k, v, lengths, mask, interpret=interpret, layer=layer, **extra, **kernel_kwargs)
  return sharded(call, platform_lib.mesh(), q, k_cache, v_cache, kv_lengths.astype(jnp.int32),
                 tree_mask, head_major=head_major)


def kernel_specs(mesh, batch: int, num_kv_heads: int):
  """(PartitionSpec of q / k / v / out [B, ., H, D], of kv_lengths [B], of tree_mask [B, T, T])
  for a kernel call under `mesh`: rows on "data" and heads on "model" where they divide (and
  the mesh has that axis), else whole."""
  names, sizes = mesh.axis_names, dict(zip(mesh.axis_names, mesh.devices.shape))
  data = "data" if "data" in names and batch % sizes["data"] == 0 else None
  model = "model" if "model" in names and num_kv_heads % sizes["model"] == 0 else None
  return P(data, None, model, None), P(data), P(data, None, None)


def sharded(call, mesh, q, k_cache, v_cache, kv_lengths, tree_mask, head_major: bool = False):
  """call(q, k, v, kv_lengths, tree_mask) -> [B, T, Hq, D], run per device under a shard_map
  over mesh (none: called as it is; inside a shard_map already: called on the local blocks).
  k_cache, v_cache: [B, S, Hkv, D] ([B, Hkv, S, D] with head_major), or a stacked [L, B, ...]
  (split alike, L whole).

  Query head h belongs to KV head h // (Hq / Hkv), so splitting both head axes into the same
  number of contiguous blocks keeps every group on the device of its KV head."""
  if mesh is None or jax.sharding.get_abstract_mesh().manual_axes:
    return call(q, k_cache, v_cache, kv_lengths, tree_mask)
  stacked = k_cache.ndim == 5                    # [L, B, ...]: a layer of it is read
  hkv = k_cache.shape[-3] if head_major else k_cache.shape[-2]
  heads, rows, mask_spec = kernel_specs(mesh, q.shape[0], hkv)
  cache = P(heads[0], heads[2], None, None) if head_major else heads   # [B, Hkv, S, D]
  cache = P(None, *cache) if stacked else cache
  if tree_mask is None:
    body = lambda q, k, v, lengths: call(q, k, v, lengths, None)
    in_specs, args = (heads, cache, cache, rows), (q, k_cache, v_cache, kv_lengths)
  else:
    body = call
    in_specs = (heads, cache, cache, rows, mask_spec)
    args = (q, k_cache, v_cache, kv_lengths, tree_mask)
  return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=heads,
                       check_vma=False)(*args)


def _cache_kernel(call, cache, row_args, head_args=()):
  """call(cache, *row_args, *head_args) -> cache, shard_mapped over the kernel mesh like the
  attention (rows on "data", KV heads on "model"; the stacked cache [L, B, Hkv, S, D] split
  alike); called as it is without a mesh or inside a shard_map already."""
  mesh = platform_lib.mesh()
  if mesh is None or jax.sharding.get_abstract_mesh().manual_axes:
    return call(cache, *row_args, *head_args)
  heads, rows, _ = kernel_specs(mesh, cache.shape[1], cache.shape[2])
  cache_spec = P(None, heads[0], heads[2], None, None)
  row_specs = tuple(P(rows[0], *([None] * (a.ndim - 1))) for a in row_args)
  return jax.shard_map(call, mesh=mesh, in_specs=(cache_spec,) + row_specs + (heads,) *
                       len(head_args), out_specs=cache_spec, check_vma=False)(
                           cache, *row_args, *head_args)


def write_kv(cache, layer, new, offsets, *, interpret: bool = False):
  """cache [L, B, Hkv, S, D] (head-major, stacked) <- new [B, T, Hkv, D] at slab `layer`, row b,
  slots offsets[b] .. offsets[b] + T - 1 (past S dropped), with the TPU write kernel
  (kernels_pallas.kv_write_tpu) in place, shard_mapped under a kernel mesh. None when the
  kernel does not take these shapes (the caller scatters). interpret: the Pallas interpreter
  (tests on CPU)."""
  if kv_write_tpu.unsupported_reason(cache.shape, new.shape, cache.dtype) is not None:
    return None
  layer = jnp.asarray(layer, jnp.int32)
  call = lambda c, o, n: kv_write_tpu.write_slots_pallas_tpu(c, layer, n, o,
                                                             interpret=interpret)
  return _cache_kernel(call, cache, (offsets.astype(jnp.int32),), (new,))


def move_kv(cache, lengths, src, n_accepted, *, interpret: bool = False):
  """In every layer of cache [L, B, Hkv, S, D] (head-major, stacked), row b: slot
  lengths[b] + j <- slot src[b, j] for j < n_accepted[b], with the TPU move kernel in place
  (kernels_pallas.kv_write_tpu.move_slots_pallas_tpu), shard_mapped under a kernel mesh. None
  when the kernel does not take these shapes (the caller gathers and scatters)."""
  if kv_write_tpu.move_unsupported_reason(cache.shape, cache.dtype, src.shape[1]) is not None:
    return None
  call = lambda c, l, s, n: kv_write_tpu.move_slots_pallas_tpu(c, l, s, n, interpret=interpret)
  return _cache_kernel(call, cache, (lengths.astype(jnp.int32), src.astype(jnp.int32),
                                     n_accepted.astype(jnp.int32)))
