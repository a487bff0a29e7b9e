"""Check the arguments of DecodePlan's calls and write them into its parameter block.

The cache arrays go through the shared binder (core.binding); this module adds the decode
family's own arguments: q, out, lse, the lengths, and the fused append's new rows and RoPE
table. Everything is checked before anything is written, so a rejected call leaves the block
as it was. The checks are a function of each array's pointer, shape, strides and dtype and of
the planned batch and longest length: a call that repeats the last validated arguments on all
of these (the steady state of a decode loop) skips them; wrapping and the closed/device checks
run every time.
"""
from __future__ import annotations

from typing import Any

from ..core import support
from ..core import validate as check
from ..core.binding import (CacheArrays, check_cache, rope_table, wrap_cache,
                            write_cache_fields)
from ..core.spec import KVCacheSpec
from ..driver import Device, DeviceArray
from .params import DecodeParams

_RUN = ("q", "out", "seq_lens", "lse")
_APPEND = ("k_new", "v_new", "cos_sin")


class RunBinder:
    """The argument checks of one DecodePlan: its spec, heads and dtype, and the batch and
    longest length of its current plan."""

    def __init__(self, spec: KVCacheSpec, num_q_heads: int, dtype: str, device: Device,
                 max_seq_len: int) -> None:
        self.spec, self.num_q_heads, self.dtype, self.device = spec, num_q_heads, dtype, device
        self.max_seq_len = max_seq_len
        self.batch = self.longest = 0
        self.capacity = 0  # the cache capacity of the last validated append_and_run call
        self._validated: tuple = ()

    def planned(self, batch: int, longest: int) -> None:
        """A new plan: ``batch`` sequences, the longest attending ``longest`` tokens."""
        self.batch, self.longest, self._validated = batch, longest, ()

    def bind(self, p: DecodeParams, q: Any, k_cache: Any, v_cache: Any, k_scale: Any,
             v_scale: Any, seq_lens: Any, out: Any, lse: Any,
             block_table: Any = None) -> None:
        """run()'s arguments into ``p`` (its append fields are left alone)."""
        own = self._wrap(q, out, seq_lens, lse)
        cache = wrap_cache(self.device, k_cache, v_cache, k_scale, v_scale, block_table,
                           elements=False)
        key = self._key(False, own, cache)
        if key != self._validated:
            self._check(own, cache, written=False)
            self._validated = key
        self._write(p, own, cache)

    def bind_append(self, p: DecodeParams, q: Any, k_new: Any, v_new: Any, k_cache: Any,
                    v_cache: Any, k_scale: Any, v_scale: Any, seq_lens: Any, out: Any,
                    lse: Any, cos_sin: Any, block_table: Any = None) -> None:
        """append_and_run()'s arguments into ``p``, including its append fields."""
        wrap, device = check.device_array, self.device
        own = self._wrap(q, out, seq_lens, lse)
        new = (wrap("k_new", k_new, device, elements=False),
               wrap("v_new", v_new, device, elements=False),
               None if cos_sin is None else wrap("cos_sin", cos_sin, device, elements=False))
        cache = wrap_cache(device, k_cache, v_cache, k_scale, v_scale, block_table,
                           elements=False)
        key = self._key(True, own + new, cache)
        if key != self._validated:
            capacity = self._check(own, cache, written=True)
            for name, array in zip(_APPEND[:2], new[:2]):
                self._rows(name, array, self.spec.num_kv_heads, "[B, Hkv, D]")
            rope_table(self.spec, device, cos_sin, capacity)
            self._validated, self.capacity = key, capacity
        self._write(p, own, cache)
        kn, vn, table = new
        spec = self.spec
        p.cos_sin = 0 if table is None else table.ptr
        p.append, p.rope, p.rope_theta = 1, support.ROPE_IDS[spec.rope], spec.rope_theta
        p.k_new, p.v_new = kn.ptr, vn.ptr
        item = kn.itemsize
        p.k_new_batch_stride, p.k_new_head_stride = kn.strides[0] // item, kn.strides[1] // item
        p.v_new_batch_stride, p.v_new_head_stride = vn.strides[0] // item, vn.strides[1] // item

    def _wrap(self, q: Any, out: Any, seq_lens: Any, lse: Any) -> tuple:
        """q, out, seq_lens (required) and lse (optional) as DeviceArrays on the plan's device.
        The hot path of a decode loop: plain calls, no generators (host overhead per run)."""
        wrap, device = check.device_array, self.device
        return (wrap("q", q, device, elements=False), wrap("out", out, device, elements=False),
                wrap("seq_lens", seq_lens, device, elements=False),
                None if lse is None else wrap("lse", lse, device, elements=False))

    def _key(self, append: bool, arrays: tuple, cache: CacheArrays) -> tuple:
        return (append, self.batch, self.longest,
                *[(a.ptr, a.shape, a.strides, a.dtype) for a in arrays if a is not None],
                *[(a.ptr, a.shape, a.strides, a.dtype) for a in cache if a is not None])

    def _rows(self, name: str, array: DeviceArray, heads: int, labels: str) -> None:
        """fp16/bf16 ``[B, heads, D]`` in the plan's dtype, rows 16-byte aligned."""
        check.element_aligned(name, array)
        check.dtype(name, array, (self.dtype,))
        check.shape(name, array, (self.batch, heads, self.spec.head_dim), labels)
        check.inner_contiguous(name, array)
        check.aligned(name, array, 16, (0, 1))

    def _check(self, own: tuple, cache: CacheArrays, *, written: bool) -> int:
        q, out, lengths, lse = own
        B, Hq, D = self.batch, self.num_q_heads, self.spec.head_dim
        self._rows("q", q, Hq, "[B, Hq, D]")
        check.element_aligned("out", out)
        check.dtype("out", out, (self.dtype,))
        check.shape("out", out, (B, Hq, D), "[B, Hq, D]")
        check.inner_contiguous("out", out)
        check.no_internal_overlap("out", out)
        capacity = check_cache(self.spec, cache, B, written=written)
        if capacity < self.longest:
            raise ValueError(f"k_cache: capacity {capacity} tokens is below the planned longest "
                             f"sequence {self.longest}")
        if self.spec.paged and capacity < self.max_seq_len:
            raise ValueError(f"block_table: max_pages * page_size = {capacity} tokens is below "
                             f"the plan's max_seq_len {self.max_seq_len}; expected at least "
                             f"{-(-self.max_seq_len // self.spec.page_size)} columns")
        check.device_lengths("seq_lens", lengths, self.device, B)
        if lse is not None:
            check.element_aligned("lse", lse)
            check.dtype("lse", lse, ("float32",))
            check.shape("lse", lse, (B, Hq), "[B, Hq]")
            check.contiguous("lse", lse)
        return capacity

    def _write(self, p: DecodeParams, own: tuple, cache: CacheArrays) -> None:
        q, out, lengths, lse = own
        item = q.itemsize
        p.q, p.out, p.seq_lens = q.ptr, out.ptr, lengths.ptr
        p.lse = 0 if lse is None else lse.ptr
        p.q_batch_stride, p.q_head_stride = q.strides[0] // item, q.strides[1] // item
        p.out_batch_stride, p.out_head_stride = out.strides[0] // item, out.strides[1] // item
        write_cache_fields(p, self.spec, cache)


def advance_pages(spec: KVCacheSpec, device: Device, block_table: Any, num_pages: Any,
                  batch: int, capacity: int) -> tuple[int, int, int, int]:
    """advance_lengths' page arguments: (table address, row stride, pages, page shift); all 0
    for a contiguous spec."""
    if not spec.paged:
        if block_table is not None or num_pages is not None:
            raise ValueError("block_table: the cache spec is contiguous; expected None")
        return 0, 0, 0, 0
    if block_table is None or num_pages is None:
        raise ValueError("block_table, num_pages: a paged spec needs both (the block table "
                         "and the pool's page count)")
    table = check.device_array("block_table", block_table, device)
    check.dtype("block_table", table, ("int32",))
    page_size = spec.page_size
    if table.ndim != 2 or table.shape[0] < batch or table.shape[1] * page_size < capacity:
        raise ValueError(f"block_table: expected [>= {batch}, >= {-(-capacity // page_size)}] "
                         f"(capacity {capacity} tokens in pages of {page_size}), got "
                         f"{table.shape}")
    check.inner_contiguous("block_table", table)
    pages = check.positive("num_pages", num_pages)
    return table.ptr, table.strides[0] // 4, pages, page_size.bit_length() - 1
