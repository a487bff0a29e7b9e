"""Validate run()'s arguments against a plan and write their addresses and strides into the
kernel's parameter block. Everything is checked before anything is written or launched."""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

from . import validate as check
from ..driver import DeviceArray
from .params import ROPE_IDS, DecodeParams

if TYPE_CHECKING:
    from .plan import DecodePlan


def _kv_layout(plan: "DecodePlan", k: DeviceArray) -> tuple[int, int, int, int]:
    """(capacity, batch stride, head stride, token stride) in bytes for either layout."""
    capacity, axes = (k.shape[2], (0, 1, 2)) if plan.kv_layout == "bnsh" else (k.shape[1],
                                                                              (0, 2, 1))
    return (capacity, *(k.strides[a] for a in axes))  # type: ignore[return-value]


def _kv_geometry(plan: "DecodePlan", k: Any, name: str) -> int:
    """Check a cache's shape and layout; its capacity."""
    B, Hkv, D = plan._batch, plan.num_kv_heads, plan.head_dim
    if plan.kv_layout == "bnsh":
        check.shape(name, k, (B, Hkv, None, D), "[B, Hkv, S_max, D]")
    else:
        check.shape(name, k, (B, None, Hkv, D), "[B, S_max, Hkv, D]")
    capacity = _kv_layout(plan, k)[0]
    check.int32_count(name, capacity, "tokens of capacity")  # DecodeParams.capacity is int32
    check.inner_contiguous(name, k)
    check.aligned(name, k, 16, (0, 1, 2))
    return capacity


def _scale(plan: "DecodePlan", name: str, array: DeviceArray, capacity: int) -> None:
    if plan.scale_mode == "token":
        check.dtype(name, array, (plan.scale_dtype,))
        check.shape(name, array, (plan._batch, plan.num_kv_heads, capacity),
                    "[B, Hkv, S_max]")
        check.inner_contiguous(name, array)
        # The kernel copies scales 4 bytes at a time (two fp16 tokens): rows start 4-aligned.
        check.aligned(name, array, 4, (0, 1))
    else:
        check.dtype(name, array, ("float32",))
        count = 1 if plan.scale_mode == "tensor" else plan.num_kv_heads
        if array.size != count or array.ndim > 1:
            label = "[1]" if count == 1 else "[Hkv]"
            raise ValueError(f"{name}: expected shape {label}=({count},) for scale_mode="
                             f"'{plan.scale_mode}', got {array.shape}")
        check.contiguous(name, array)


def bind_arguments(plan: "DecodePlan", p: DecodeParams, q: Any, k_cache: Any, v_cache: Any,
                   k_scale: Any, v_scale: Any, seq_lens: Any, out: Any,
                   lse: Any) -> tuple[DeviceArray | None, ...]:
    """Wrap and check the arguments, write them into ``p``, return them wrapped (in the order
    of _NAMES). The checks are a function of
    each array's pointer, shape, strides, dtype and device and of the planned batch and
    longest length: a call whose arguments repeat the last validated ones on all of these
    (the steady state of a decode loop) skips them; wrapping and the closed/device checks run
    every time."""
    device, wrap = plan.device, check.device_array
    arrays = (wrap("q", q, device, elements=False), wrap("out", out, device, elements=False),
              wrap("k_cache", k_cache, device, elements=False),
              wrap("v_cache", v_cache, device, elements=False),
              wrap("k_scale", k_scale, device, elements=False),
              wrap("v_scale", v_scale, device, elements=False),
              wrap("seq_lens", seq_lens, device, elements=False),
              None if lse is None else wrap("lse", lse, device, elements=False))
    key = (plan._batch, plan._planned_max, *((a.ptr, a.shape, a.strides, a.dtype)
                                              for a in arrays if a is not None))
    if key != plan._validated:
        for name, array in zip(_NAMES, arrays):
            if array is not None:
                check.element_aligned(name, array)
        _check_arguments(plan, *arrays)
        plan._validated = key
    _write_arguments(plan, p, *arrays)
    return arrays


_NAMES = ("q", "out", "k_cache", "v_cache", "k_scale", "v_scale", "seq_lens", "lse")


def _check_arguments(plan: "DecodePlan", q: DeviceArray, out: DeviceArray, k: DeviceArray,
                     v: DeviceArray, ks: DeviceArray, vs: DeviceArray, lengths: DeviceArray,
                     lse: DeviceArray | None) -> None:
    B, Hq, D = plan._batch, plan.num_q_heads, plan.head_dim
    check.dtype("q", q, (plan.q_dtype,))
    check.shape("q", q, (B, Hq, D), "[B, Hq, D]")
    check.inner_contiguous("q", q)
    check.aligned("q", q, 16, (0, 1))
    check.dtype("out", out, (plan.q_dtype,))
    check.shape("out", out, (B, Hq, D), "[B, Hq, D]")
    check.inner_contiguous("out", out)
    check.no_internal_overlap("out", out)
    check.dtype("k_cache", k, ("int8",))
    check.dtype("v_cache", v, ("int8",))
    capacity = _kv_geometry(plan, k, "k_cache")
    if v.shape != k.shape or v.strides != k.strides:
        raise ValueError(f"v_cache: expected the shape and strides of k_cache "
                         f"{k.shape}/{k.strides}, got {v.shape}/{v.strides}")
    check.aligned("v_cache", v, 16, (0, 1, 2))
    if capacity < plan._planned_max:
        raise ValueError(f"k_cache: capacity {capacity} tokens is below the planned longest "
                         f"sequence {plan._planned_max}")
    _scale(plan, "k_scale", ks, capacity)
    _scale(plan, "v_scale", vs, capacity)
    if plan.scale_mode == "token" and ks.strides != vs.strides:
        raise ValueError(f"v_scale: expected the strides of k_scale {ks.strides}, "
                         f"got {vs.strides}")
    check.dtype("seq_lens", lengths, ("int32",))
    check.shape("seq_lens", lengths, (B,), "[B]")
    check.contiguous("seq_lens", lengths)
    if lse is not None:
        check.dtype("lse", lse, ("float32",))
        check.shape("lse", lse, (B, Hq), "[B, Hq]")
        check.contiguous("lse", lse)


def _write_arguments(plan: "DecodePlan", p: DecodeParams, q: DeviceArray, out: DeviceArray,
                     k: DeviceArray, v: DeviceArray, ks: DeviceArray, vs: DeviceArray,
                     lengths: DeviceArray, lse: DeviceArray | None) -> None:
    item = q.itemsize
    p.q, p.out, p.k_cache, p.v_cache = q.ptr, out.ptr, k.ptr, v.ptr
    p.k_scale, p.v_scale, p.seq_lens = ks.ptr, vs.ptr, lengths.ptr
    p.lse = 0 if lse is None else lse.ptr
    p.q_batch_stride, p.q_head_stride = q.strides[0] // item, q.strides[1] // item
    p.out_batch_stride, p.out_head_stride = out.strides[0] // item, out.strides[1] // item
    p.capacity, p.kv_batch_stride, p.kv_head_stride, p.kv_token_stride = _kv_layout(plan, k)
    if plan.scale_mode == "token":
        p.scale_batch_stride = ks.strides[0] // ks.itemsize
        p.scale_head_stride = ks.strides[1] // ks.itemsize


def _new_rows(plan: "DecodePlan", name: str, obj: Any, batch: int) -> Any:
    """The new tokens' K or V: ``[B, Hkv, D]`` in the query dtype, rows 16-byte aligned."""
    array = check.device_array(name, obj, plan.device)
    check.dtype(name, array, (plan.q_dtype,))
    check.shape(name, array, (batch, plan.num_kv_heads, plan.head_dim), "[B, Hkv, D]")
    check.inner_contiguous(name, array)
    check.aligned(name, array, 16, (0, 1))
    return array


def bind_append_arguments(plan: "DecodePlan", p: DecodeParams, q: Any, k_new: Any, v_new: Any,
                          k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any,
                          positions: Any, out: Any, lse: Any, cos_sin: Any) -> None:
    """run()'s checks, plus the new tokens, the written caches and scales, and the RoPE table;
    ``p`` is written only when all of them pass."""
    from ..append.bind import rope_table  # the append kernels' table check (same layout)

    B = plan._batch
    kn = _new_rows(plan, "k_new", k_new, B)
    vn = _new_rows(plan, "v_new", v_new, B)
    scratch = DecodeParams.from_buffer_copy(p)  # keeps the plan's fields
    _, _, k, v, ks, vs, _, _ = bind_arguments(plan, scratch, q, k_cache, v_cache, k_scale,
                                              v_scale, positions, out, lse)
    written = ((("k_cache", k), ("v_cache", v)) +  # at the positions, and their scales
               ((("k_scale", ks), ("v_scale", vs)) if plan.scale_mode == "token" else ()))
    for name, array in written:
        check.no_internal_overlap(name, array)
    scratch.cos_sin = rope_table(plan, cos_sin, scratch.capacity)
    scratch.append = 1
    scratch.rope = ROPE_IDS[plan.rope]
    scratch.rope_theta = plan.rope_theta
    scratch.k_new, scratch.v_new = kn.ptr, vn.ptr
    item = kn.itemsize
    scratch.k_new_batch_stride = kn.strides[0] // item
    scratch.k_new_head_stride = kn.strides[1] // item
    scratch.v_new_batch_stride = vn.strides[0] // item
    scratch.v_new_head_stride = vn.strides[1] // item
    ctypes.memmove(ctypes.addressof(p), ctypes.addressof(scratch), ctypes.sizeof(p))
