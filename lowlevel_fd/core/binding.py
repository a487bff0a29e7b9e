"""The one binder of cache arrays for every kernel family: K, V, their scales and the RoPE table
are checked against a KVCacheSpec and written into a parameter block.

Both parameter blocks (cu/decode_params.cuh, cu/append_params.cuh) name the cache fields alike,
so ``write_cache_fields`` serves either. The checks are split from the wrapping so that a plan
can skip them when a call repeats the arrays it validated last (the steady state of a decode
loop): ``wrap_cache`` is cheap, ``check_cache`` is not.
"""
from __future__ import annotations

import ctypes
from typing import Any, Optional, Tuple

from ..driver import Device, DeviceArray
from . import support
from . import validate as check
from .spec import KVCacheSpec

CACHE_NAMES = ("k_cache", "v_cache", "k_scale", "v_scale")

# The paged-storage fields both parameter blocks end with (cu/cache_pages.cuh).
PAGE_FIELDS = [("block_table", ctypes.c_uint64), ("table_stride", ctypes.c_int64),
               ("scale_token_stride", ctypes.c_int64), ("num_pages", ctypes.c_int32),
               ("page_shift", ctypes.c_int32)]

# (k_cache, v_cache, k_scale, v_scale, block_table or None): a plain tuple, built on every run
# (host overhead).
CacheArrays = Tuple[DeviceArray, DeviceArray, DeviceArray, DeviceArray, Optional[DeviceArray]]

# Axes of (sequence or page, head, token) in each layout's K/V and per-token scale arrays.
_KV_AXES = {"bnsh": (0, 1, 2), "bsnh": (0, 2, 1), "nhd": (0, 2, 1), "hnd": (0, 1, 2)}
_KV_LABELS = {"bnsh": "[B, Hkv, S_max, D]", "bsnh": "[B, S_max, Hkv, D]",
              "nhd": "[num_pages, page_size, Hkv, D]", "hnd": "[num_pages, Hkv, page_size, D]"}
_SCALE_LABELS = {"bnsh": "[B, Hkv, S_max]", "bsnh": "[B, Hkv, S_max]",
                 "nhd": "[num_pages, page_size, Hkv]", "hnd": "[num_pages, Hkv, page_size]"}


def wrap_cache(device: Device, k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any,
               block_table: Any = None, *, elements: bool = True) -> CacheArrays:
    """The arrays as open DeviceArrays on ``device`` (``elements=False`` leaves the element
    alignment to ``check_cache``)."""
    wrap = check.device_array
    return (wrap("k_cache", k_cache, device, elements=elements),
            wrap("v_cache", v_cache, device, elements=elements),
            wrap("k_scale", k_scale, device, elements=elements),
            wrap("v_scale", v_scale, device, elements=elements),
            None if block_table is None else wrap("block_table", block_table, device,
                                                  elements=elements))


def layout_strides(spec: KVCacheSpec, k: DeviceArray) -> tuple[int, int, int, int]:
    """(tokens per sequence or page, sequence or page, head, token byte strides) of a cache in
    the spec's layout."""
    axes = _KV_AXES[spec.kv_layout]
    return (k.shape[axes[2]], *(k.strides[a] for a in axes))  # type: ignore[return-value]


def scale_strides(spec: KVCacheSpec, scale: DeviceArray) -> tuple[int, int, int]:
    """(sequence or page, head, token) element strides of per-token scales (0s otherwise)."""
    if not spec.token_scales:
        return 0, 0, 0
    axes = (0, 1, 2) if spec.kv_layout in ("bnsh", "bsnh", "hnd") else (0, 2, 1)
    return tuple(scale.strides[a] // scale.itemsize for a in axes)  # type: ignore[return-value]


def check_cache(spec: KVCacheSpec, arrays: CacheArrays, batch: int | None, *,
                written: bool) -> int:
    """Check the caches, scales and (paged) block table of ``batch`` sequences (None: any);
    ``written``: the call stores tokens (and per-token scales) into them, so no two elements
    may share bytes. Returns the capacity: tokens per sequence (S_max, or the table's pages
    per sequence times page_size)."""
    k, v, ks, vs, table = arrays
    for name, array in zip(CACHE_NAMES, arrays):
        check.element_aligned(name, array)
    Hkv, D = spec.num_kv_heads, spec.head_dim
    check.dtype("k_cache", k, ("int8",))
    check.dtype("v_cache", v, ("int8",))
    layout = spec.kv_layout
    rows = None if spec.paged else batch  # pages: any number of them
    expected = {"bnsh": (rows, Hkv, None, D), "bsnh": (rows, None, Hkv, D),
                "nhd": (None, spec.page_size, Hkv, D), "hnd": (None, Hkv, spec.page_size, D)}
    check.shape("k_cache", k, expected[layout], _KV_LABELS[layout])
    if v.shape != k.shape or v.strides != k.strides:
        raise ValueError(f"v_cache: expected the shape and strides of k_cache "
                         f"{k.shape}/{k.strides}, got {v.shape}/{v.strides}")
    if spec.paged:
        capacity = _check_table(spec, table, batch, k.shape[0])
    else:
        if table is not None:
            raise ValueError(f"block_table: the cache spec is contiguous (kv_layout="
                             f"'{layout}'); expected None, got an array of shape {table.shape}")
        capacity = layout_strides(spec, k)[0]
        check.int32_count("k_cache", capacity, "tokens of capacity")  # int32 indexing
    for name, array in (("k_cache", k), ("v_cache", v)):
        check.inner_contiguous(name, array)
        check.aligned(name, array, 16, (0, 1, 2))  # 16-byte row loads
        if written:
            check.no_internal_overlap(name, array)
    for name, array in (("k_scale", ks), ("v_scale", vs)):
        _check_scale(spec, name, array, k.shape[0] if spec.paged else batch,
                     spec.page_size or capacity, written)
    if spec.token_scales and ks.strides != vs.strides:
        raise ValueError(f"v_scale: expected the strides of k_scale {ks.strides}, "
                         f"got {vs.strides}")
    return capacity


def _check_table(spec: KVCacheSpec, table: DeviceArray | None, batch: int | None,
                 num_pages: int) -> int:
    """The block table of a paged cache: int32 ``[>= B, pages per sequence]``, rows of
    contiguous page ids. Returns the tokens per sequence it can address."""
    if table is None:
        raise ValueError(f"block_table: the cache spec is paged (kv_layout='{spec.kv_layout}', "
                         f"page_size={spec.page_size}); expected an int32 [B, max_pages] "
                         f"device array, got None")
    check.dtype("block_table", table, ("int32",))
    if table.ndim != 2 or (batch is not None and table.shape[0] < batch) or table.shape[1] < 1:
        raise ValueError(f"block_table: expected shape [B, max_pages] with at least "
                         f"{batch if batch is not None else 1} rows and one column, got "
                         f"{table.shape}")
    check.inner_contiguous("block_table", table)
    check.int32_count("k_cache", num_pages, "pages")
    capacity = table.shape[1] * spec.page_size
    check.int32_count("block_table", capacity, "tokens per sequence (max_pages * page_size)")
    return capacity


def _check_scale(spec: KVCacheSpec, name: str, array: DeviceArray, rows: int | None,
                 tokens: int, written: bool) -> None:
    """Per-token scales: ``[B, Hkv, S_max]`` (contiguous caches) or ``[num_pages, page_size,
    Hkv]`` / ``[num_pages, Hkv, page_size]`` (paged, any element strides)."""
    if spec.token_scales:
        check.dtype(name, array, (spec.scale_dtype,))
        layout = spec.kv_layout
        expected = ((rows, tokens, spec.num_kv_heads) if layout == "nhd"
                    else (rows, spec.num_kv_heads, tokens))
        check.shape(name, array, expected, _SCALE_LABELS[layout])
        if spec.paged:
            # Paged scales are copied as the aligned 4-byte word holding them (fp16: either
            # half), so that word must lie inside the array's span.
            if array.itemsize == 2 and array.size and (_last_element(array) % 4 == 0):
                raise ValueError(f"{name}: fp16 paged scales are read as aligned 4-byte words; "
                                 f"the last element (address {_last_element(array):#x}) starts "
                                 f"a word that ends past the array: pad the pool by one element")
        else:
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


def _last_element(array: DeviceArray) -> int:
    """The address of the array's element with the largest offset."""
    return array.ptr + sum((n - 1) * s for n, s in zip(array.shape, array.strides) if s > 0)


def write_cache_fields(p: Any, spec: KVCacheSpec, arrays: CacheArrays) -> None:
    """Pointers, byte strides, scale strides (elements), capacity and the page fields into a
    parameter block (cu/cache_pages.cuh: paged, the "batch" strides are page strides)."""
    k, v, ks, vs, table = arrays
    p.k_cache, p.v_cache, p.k_scale, p.v_scale = k.ptr, v.ptr, ks.ptr, vs.ptr
    tokens, p.kv_batch_stride, p.kv_head_stride, p.kv_token_stride = layout_strides(spec, k)
    p.scale_batch_stride, p.scale_head_stride, p.scale_token_stride = scale_strides(spec, ks)
    if spec.paged:
        assert table is not None
        p.capacity = table.shape[1] * spec.page_size
        p.block_table, p.table_stride = table.ptr, table.strides[0] // 4
        p.num_pages, p.page_shift = k.shape[0], spec.page_size.bit_length() - 1
    else:
        p.capacity = tokens
        p.block_table = p.table_stride = p.num_pages = p.page_shift = 0
    p.key_transform = support.KEY_TRANSFORM_IDS[spec.key_transform]


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
