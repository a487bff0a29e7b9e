"""Validate the arguments of AppendPlan.run and PromptQuantizer.run and write their addresses and
strides into the parameter block. Everything is checked before anything is written or launched.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..decode import validate as check
from ..driver import DeviceArray
from .params import AppendParams

if TYPE_CHECKING:
    from .runner import KernelRunner


def token_rows(name: str, obj: Any, runner: "KernelRunner", heads: int, labels: str,
               batch: int | None = None) -> DeviceArray:
    """fp16/bf16 ``[B, H, D]``, last dimension contiguous, 16-byte aligned rows."""
    array = check.device_array(name, obj, runner.device)
    check.dtype(name, array, (runner.dtype,))
    check.shape(name, array, (batch, heads, runner.head_dim), labels)
    check.inner_contiguous(name, array)
    check.aligned(name, array, 16, (0, 1))
    return array


def batch_size(name: str, array: DeviceArray, max_batch: int) -> int:
    batch = array.shape[0]
    if batch > max_batch:
        raise ValueError(f"{name}: expected at most max_batch={max_batch} sequences, got {batch}")
    return batch


def caches(runner: "KernelRunner", k_cache: Any, v_cache: Any, batch: int
           ) -> tuple[DeviceArray, DeviceArray, int, tuple[int, int, int]]:
    """(k, v, capacity, (batch, head, token) byte strides) of the int8 caches in the layout."""
    k = check.device_array("k_cache", k_cache, runner.device)
    v = check.device_array("v_cache", v_cache, runner.device)
    check.dtype("k_cache", k, ("int8",))
    check.dtype("v_cache", v, ("int8",))
    Hkv, D = runner.num_kv_heads, runner.head_dim
    if runner.kv_layout == "bnsh":
        check.shape("k_cache", k, (batch, Hkv, None, D), "[B, Hkv, S_max, D]")
        capacity, axes = k.shape[2], (0, 1, 2)
    else:
        check.shape("k_cache", k, (batch, None, Hkv, D), "[B, S_max, Hkv, D]")
        capacity, axes = k.shape[1], (0, 2, 1)
    if v.shape != k.shape or v.strides != k.strides:
        raise ValueError(f"v_cache: expected the shape and strides of k_cache "
                         f"{k.shape}/{k.strides}, got {v.shape}/{v.strides}")
    for name, array in (("k_cache", k), ("v_cache", v)):
        check.inner_contiguous(name, array)
        check.aligned(name, array, 16, (0, 1, 2))
        check.no_internal_overlap(name, array)
    check.int32_count("k_cache", capacity, "tokens of capacity")
    strides = tuple(k.strides[a] for a in axes)
    return k, v, capacity, strides  # type: ignore[return-value]


def scales(runner: "KernelRunner", k_scale: Any, v_scale: Any, batch: int, capacity: int
           ) -> tuple[DeviceArray, DeviceArray]:
    """Per-token ``[B, Hkv, S_max]`` (written), or fp32 ``[Hkv]``/``[1]`` (read)."""
    arrays = []
    for name, obj in (("k_scale", k_scale), ("v_scale", v_scale)):
        array = check.device_array(name, obj, runner.device)
        if runner.scale_mode == "token":
            check.dtype(name, array, (runner.scale_dtype,))
            check.shape(name, array, (batch, runner.num_kv_heads, capacity), "[B, Hkv, S_max]")
            check.inner_contiguous(name, array)
            check.no_internal_overlap(name, array)  # written: one scale per token
        else:
            check.dtype(name, array, ("float32",))
            count = 1 if runner.scale_mode == "tensor" else runner.num_kv_heads
            if array.size != count or array.ndim != 1:
                label = "[1]" if count == 1 else "[Hkv]"
                raise ValueError(f"{name}: expected shape {label}=({count},) for scale_mode="
                                 f"'{runner.scale_mode}', got {array.shape}")
            check.contiguous(name, array)  # the kernel indexes scales + head
        arrays.append(array)
    ks, vs = arrays
    if runner.scale_mode == "token" and ks.strides != vs.strides:
        raise ValueError(f"v_scale: expected the strides of k_scale {ks.strides}, "
                         f"got {vs.strides}")
    return ks, vs


def lengths(name: str, obj: Any, runner: "KernelRunner", batch: int) -> DeviceArray:
    array = check.device_array(name, obj, runner.device)
    check.dtype(name, array, ("int32",))
    check.shape(name, array, (batch,), "[B]")
    check.contiguous(name, array)
    return array


def rope_table(runner: "KernelRunner", cos_sin: Any, capacity: int) -> int:
    """The table's address, or 0 for the theta path; rejects a table where RoPE is off."""
    if cos_sin is None:
        return 0
    if runner.rope is None:
        raise ValueError("cos_sin: the plan applies no RoPE (rope=None); pass rope='neox' or "
                         "'gptj' to the constructor, or drop cos_sin")
    table = check.device_array("cos_sin", cos_sin, runner.device)
    check.dtype("cos_sin", table, ("float32",))
    check.shape("cos_sin", table, (None, runner.head_dim // 2, 2), "[max_pos, D/2, 2]")
    check.contiguous("cos_sin", table)
    check.aligned("cos_sin", table, 8)  # the kernel loads (cos, sin) pairs as float2
    if table.shape[0] < capacity:
        raise ValueError(f"cos_sin: expected a row for every cache position (max_pos >= "
                         f"S_max={capacity}), got max_pos={table.shape[0]}")
    return table.ptr


def host_positions(name: str, values: Any, batch: int, limit: int, what: str) -> None:
    """The capacity check the host can make: host copies of the lengths, when the caller has
    them, must lie in [0, limit]; ``what`` says which limit (in the message)."""
    if values is None:
        return
    host = check.host_array(name, values)
    if host.shape != (batch,) or not np.issubdtype(host.dtype, np.integer):
        raise ValueError(f"{name}: expected {batch} integer lengths, got {host.dtype} "
                         f"{host.shape}")
    bad = np.flatnonzero((host < 0) | (host > limit))
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"{name}: sequence {b} has length {int(host[b])}, outside [0, {limit}] "
                         f"({what}); nothing was launched")


def kv_fields(p: AppendParams, k: DeviceArray, v: DeviceArray, ks: DeviceArray,
              vs: DeviceArray, capacity: int, strides: tuple[int, int, int],
              scale_mode: str) -> None:
    p.k_cache, p.v_cache, p.k_scale, p.v_scale = k.ptr, v.ptr, ks.ptr, vs.ptr
    p.kv_batch_stride, p.kv_head_stride, p.kv_token_stride = strides
    if scale_mode == "token":
        p.scale_batch_stride = ks.strides[0] // ks.itemsize
        p.scale_head_stride = ks.strides[1] // ks.itemsize
    else:
        p.scale_batch_stride = p.scale_head_stride = 0
    p.capacity = capacity
