"""Check the append family's own arguments (the new rows, q, prompts) and write them into the
parameter block; the caches, scales and RoPE table go through the shared binder
(core.binding). Everything is checked before anything is written or launched."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core import validate as check
from ..core.binding import (CacheArrays, check_cache, rope_table, wrap_cache,
                            write_cache_fields)
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


def caches(runner: "KernelRunner", k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any,
           batch: int, cos_sin: Any, block_table: Any) -> tuple[CacheArrays, int, int]:
    """The written caches and scales (paged: and the block table) and the RoPE table:
    (arrays, capacity, RoPE table address)."""
    arrays = wrap_cache(runner.device, k_cache, v_cache, k_scale, v_scale, block_table)
    capacity = check_cache(runner.cache, arrays, batch, written=True)
    return arrays, capacity, rope_table(runner.cache, runner.device, cos_sin, capacity)


def write_caches(p: AppendParams, runner: "KernelRunner", arrays: CacheArrays,
                 table: int) -> None:
    write_cache_fields(p, runner.cache, arrays)
    p.cos_sin = table


def query(runner: "KernelRunner", num_q_heads: int, q: Any, q_out: Any,
          batch: int) -> tuple[int, int, tuple[int, ...]]:
    """(q, q_out addresses, their element strides); q_out defaults to q (in place)."""
    if q is None:
        if q_out is not None:
            raise ValueError("q_out: given without q; pass the q to rotate")
        return 0, 0, (0, 0, 0, 0)
    if runner.cache.rope is None:
        raise ValueError("q: the cache spec applies no RoPE (rope=None), so there is nothing to "
                         "do to q; drop it or use a spec with rope='neox'/'gptj'")
    labels = "[B, Hq, D]"
    rows = token_rows("q", q, runner, num_q_heads, labels, batch)
    out = rows
    if q_out is not None:
        out = token_rows("q_out", q_out, runner, num_q_heads, labels, batch)
        check.same_or_disjoint("q_out", out, "q", rows)
    check.no_internal_overlap("q" if q_out is None else "q_out", out)  # the rotated rows
    item = rows.itemsize
    return rows.ptr, out.ptr, (rows.strides[0] // item, rows.strides[1] // item,
                               out.strides[0] // item, out.strides[1] // item)
