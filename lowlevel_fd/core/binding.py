"""The one binder of cache arrays for every kernel family: K, V, their scales and the RoPE table
are checked against a KVCacheSpec and written into a parameter block.

Both parameter blocks (cu/decode_params.cuh, cu/append_params.cuh) name the cache fields alike,
so ``write_cache_fields`` serves either. The checks are split from the wrapping so that a plan
can skip them when a call repeats the arrays it validated last (the steady state of a decode
loop): ``wrap_cache`` is cheap, ``check_cache`` is not.
"""
from __future__ import annotations

from typing import Any, Tuple

from ..driver import Device, DeviceArray
from . import validate as check
from .spec import KVCacheSpec

CACHE_NAMES = ("k_cache", "v_cache", "k_scale", "v_scale")


# (k_cache, v_cache, k_scale, v_scale): a plain tuple, built on every run (host overhead).
CacheArrays = Tuple[DeviceArray, DeviceArray, DeviceArray, DeviceArray]


def wrap_cache(device: Device, k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any, *,
               elements: bool = True) -> CacheArrays:
    """The four arrays as open DeviceArrays on ``device`` (``elements=False`` leaves the element
    alignment to ``check_cache``)."""
    wrap = check.device_array
    return (wrap("k_cache", k_cache, device, elements=elements),
            wrap("v_cache", v_cache, device, elements=elements),
            wrap("k_scale", k_scale, device, elements=elements),
            wrap("v_scale", v_scale, device, elements=elements))


def layout_strides(spec: KVCacheSpec, k: DeviceArray) -> tuple[int, int, int, int]:
    """(capacity S_max, batch, head, token byte strides) of a cache in the spec's layout."""
    capacity, axes = (k.shape[2], (0, 1, 2)) if spec.kv_layout == "bnsh" else (k.shape[1],
                                                                              (0, 2, 1))
    return (capacity, *(k.strides[a] for a in axes))  # type: ignore[return-value]


def check_cache(spec: KVCacheSpec, arrays: CacheArrays, batch: int | None, *,
                written: bool) -> int:
    """Check the caches and scales of ``batch`` sequences (None: any); ``written``: the call
    stores tokens (and per-token scales) into them, so no two elements may share bytes.
    Returns the capacity S_max."""
    k, v, ks, vs = arrays
    for name, array in zip(CACHE_NAMES, arrays):
        check.element_aligned(name, array)
    Hkv, D = spec.num_kv_heads, spec.head_dim
    check.dtype("k_cache", k, ("int8",))
    check.dtype("v_cache", v, ("int8",))
    if spec.kv_layout == "bnsh":
        check.shape("k_cache", k, (batch, Hkv, None, D), "[B, Hkv, S_max, D]")
    else:
        check.shape("k_cache", k, (batch, None, Hkv, D), "[B, S_max, Hkv, D]")
    if v.shape != k.shape or v.strides != k.strides:
        raise ValueError(f"v_cache: expected the shape and strides of k_cache "
                         f"{k.shape}/{k.strides}, got {v.shape}/{v.strides}")
    capacity = layout_strides(spec, k)[0]
    check.int32_count("k_cache", capacity, "tokens of capacity")  # the kernels index with int32
    for name, array in (("k_cache", k), ("v_cache", v)):
        check.inner_contiguous(name, array)
        check.aligned(name, array, 16, (0, 1, 2))  # 16-byte row loads
        if written:
            check.no_internal_overlap(name, array)
    for name, array in (("k_scale", ks), ("v_scale", vs)):
        _check_scale(spec, name, array, k.shape[0], capacity, written)
    if spec.token_scales and ks.strides != vs.strides:
        raise ValueError(f"v_scale: expected the strides of k_scale {ks.strides}, "
                         f"got {vs.strides}")
    return capacity


def _check_scale(spec: KVCacheSpec, name: str, array: DeviceArray, batch: int, capacity: int,
                 written: bool) -> None:
    if spec.token_scales:
        check.dtype(name, array, (spec.scale_dtype,))
        check.shape(name, array, (batch, spec.num_kv_heads, capacity), "[B, Hkv, S_max]")
        check.inner_contiguous(name, array)
        # The decode kernel copies scales 4 bytes at a time (two fp16 tokens): rows start
        # 4-byte aligned (fp16: an even row stride, e.g. an even S_max when contiguous).
        check.aligned(name, array, 4, (0, 1))
        if written:
            check.no_internal_overlap(name, array)
        return
    check.dtype(name, array, ("float32",))
    count = 1 if spec.scale_mode == "tensor" else spec.num_kv_heads
    if array.ndim != 1 or array.size != count:
        label = "[1]" if count == 1 else "[Hkv]"
        raise ValueError(f"{name}: expected shape {label}=({count},) for scale_mode="
                         f"'{spec.scale_mode}', got {array.shape}")
    check.contiguous(name, array)  # the kernels index scales + head


def write_cache_fields(p: Any, spec: KVCacheSpec, arrays: CacheArrays) -> None:
    """Pointers, byte strides, scale strides (elements) and capacity into a parameter block."""
    k, v, ks, vs = arrays
    p.k_cache, p.v_cache, p.k_scale, p.v_scale = k.ptr, v.ptr, ks.ptr, vs.ptr
    p.capacity, p.kv_batch_stride, p.kv_head_stride, p.kv_token_stride = layout_strides(spec, k)
    if spec.token_scales:
        p.scale_batch_stride = ks.strides[0] // ks.itemsize
        p.scale_head_stride = ks.strides[1] // ks.itemsize
    else:
        p.scale_batch_stride = p.scale_head_stride = 0


def rope_table(spec: KVCacheSpec, device: Device, cos_sin: Any, capacity: int) -> int:
    """The RoPE table's address, or 0 for angles from ``rope_theta``: fp32
    ``[max_pos >= S_max, D/2, 2]`` (cos, sin) pairs; rejected where the spec has no RoPE."""
    if cos_sin is None:
        return 0
    if spec.rope is None:
        raise ValueError("cos_sin: the cache spec applies no RoPE (rope=None); pass rope='neox' "
                         "or 'gptj', or drop cos_sin")
    table = check.device_array("cos_sin", cos_sin, device)
    check.dtype("cos_sin", table, ("float32",))
    check.shape("cos_sin", table, (None, spec.head_dim // 2, 2), "[max_pos, D/2, 2]")
    check.contiguous("cos_sin", table)
    check.aligned("cos_sin", table, 8)  # the kernels load (cos, sin) pairs as float2
    if table.shape[0] < capacity:
        raise ValueError(f"cos_sin: expected a row for every cache position (max_pos >= "
                         f"S_max={capacity}), got max_pos={table.shape[0]}")
    return table.ptr
