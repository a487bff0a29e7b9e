"""Check the arguments of MultiPlan.plan (its host copies) and MultiPlan.run (writing them into
its parameter block).

The cache arrays go through the shared binder (core.binding); this module adds the family's own
arguments: the packed queries and outputs, the lengths and ``qo_indptr``, the optional LSE,
RoPE table and tree mask. Everything is checked before anything is written; a call that
repeats the last validated arrays (pointers, shapes, strides, dtypes) skips the checks.
"""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ..core import support
from ..core import validate as check
from ..core.binding import check_cache, rope_table, wrap_cache, write_cache_fields
from ..core.spec import KVCacheSpec
from ..driver import Device, DeviceArray
from .maps import Q8Maps, encode_q8_maps
from .params import MultiParams


def host_queries(qo_indptr: Any, seq_lens: Any, max_batch: int,
                 max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The host copies plan() reads: ``qo_indptr`` [B + 1] (monotone, from 0) and ``seq_lens``
    [B] with qo_len[b] <= seq_lens[b] <= max_seq_len, or ``qo_indptr`` None: one query row per
    sequence, empty sequences allowed. Returns (qo_lens, seq_lens) as int64."""
    if qo_indptr is None:
        lengths = check.host_lengths("seq_lens", seq_lens, max_batch, max_seq_len)
        return np.ones(lengths.size, np.int64), lengths
    for name, values in (("qo_indptr", qo_indptr), ("seq_lens", seq_lens)):
        if isinstance(values, DeviceArray) or hasattr(values, "__cuda_array_interface__"):
            raise TypeError(f"{name}: plan() needs the host copy (list or numpy), got a device "
                            f"array")
    indptr = check.host_array("qo_indptr", qo_indptr)
    if indptr.ndim != 1 or indptr.size < 2 or not np.issubdtype(indptr.dtype, np.integer):
        raise ValueError(f"qo_indptr: expected an integer [B + 1] array with B >= 1, got "
                         f"{indptr.dtype} {indptr.shape}")
    indptr = indptr.astype(np.int64)
    if indptr[0] != 0:
        raise ValueError(f"qo_indptr: expected qo_indptr[0] == 0, got {int(indptr[0])}")
    qo_lens = np.diff(indptr)
    falling = np.flatnonzero(qo_lens < 0)
    if falling.size:
        b = int(falling[0])
        raise ValueError(f"qo_indptr: expected a non-decreasing array, got qo_indptr[{b + 1}]="
                         f"{int(indptr[b + 1])} < qo_indptr[{b}]={int(indptr[b])}")
    check.int32_count("qo_indptr", int(indptr[-1]), "query rows (total_q)")
    lengths = check.host_lengths("seq_lens", seq_lens, max_batch, max_seq_len)
    if lengths.size != qo_lens.size:
        raise ValueError(f"seq_lens: expected {qo_lens.size} lengths (one per qo_indptr "
                         f"interval), got {lengths.size}")
    over = np.flatnonzero(qo_lens > lengths)
    if over.size:
        b = int(over[0])
        raise ValueError(f"qo_indptr: sequence {b} has qo_len {int(qo_lens[b])} > seq_lens[{b}]="
                         f"{int(lengths[b])} (seq_lens counts the cached tokens including the "
                         f"chunk's)")
    return qo_lens, lengths


class MultiBinder:
    """The argument checks of one MultiPlan: its spec, heads and dtype, and its current plan's
    batch, total query rows and longest KV."""

    def __init__(self, spec: KVCacheSpec, num_q_heads: int, dtype: str, device: Device) -> None:
        self.spec, self.num_q_heads, self.dtype, self.device = spec, num_q_heads, dtype, device
        self.batch = self.total_q = self.longest = self.longest_chunk = 0
        self.tree = self.decode_rows = self.int8_q = False
        self._validated: tuple = ()
        self._maps: tuple[tuple, Q8Maps] | None = None  # the last cache's, by its key

    def planned(self, batch: int, total_q: int, longest: int, longest_chunk: int,
                tree: bool = False, decode_rows: bool = False, int8_q: bool = False) -> None:
        self.batch, self.total_q, self.longest = batch, total_q, longest
        self.longest_chunk, self.tree, self._validated = longest_chunk, tree, ()
        self.decode_rows, self.int8_q = decode_rows, int8_q

    def bind(self, p: MultiParams, q: Any, k_cache: Any, v_cache: Any, k_scale: Any,
             v_scale: Any, seq_lens: Any, qo_indptr: Any, out: Any, lse: Any,
             block_table: Any, cos_sin: Any, rotate_q: bool, tree_mask: Any = None,
             appended: bool = False, maps: Q8Maps | None = None) -> None:
        wrap, device = check.device_array, self.device
        check.flag("appended", appended)
        if appended and not self.decode_rows:
            raise ValueError("appended: only for decode rows (a plan made with "
                             "qo_indptr=None), got a plan of packed query chunks")
        if (qo_indptr is None) != self.decode_rows:
            raise ValueError("qo_indptr: the plan was made with qo_indptr=None (one query row "
                             "per sequence); pass None" if self.decode_rows else
                             "qo_indptr: expected an int32 [B + 1] device array (the plan was "
                             "made with one), got None")
        own = (wrap("q", q, device, elements=False), wrap("out", out, device, elements=False),
               wrap("seq_lens", seq_lens, device, elements=False),
               None if qo_indptr is None else wrap("qo_indptr", qo_indptr, device,
                                                   elements=False),
               None if lse is None else wrap("lse", lse, device, elements=False),
               None if cos_sin is None else wrap("cos_sin", cos_sin, device, elements=False),
               None if tree_mask is None else wrap("tree_mask", tree_mask, device,
                                                   elements=False))
        cache = wrap_cache(device, k_cache, v_cache, k_scale, v_scale, block_table,
                           elements=False)
        key = (rotate_q, self.batch, self.total_q, self.longest,
               *[(a.ptr, a.shape, a.strides, a.dtype) if a is not None else None for a in own],
               *[(a.ptr, a.shape, a.strides, a.dtype) for a in cache if a is not None])
        if key != self._validated:
            self._check(own, cache, rotate_q, cos_sin)
            self._validated = key
        if self.int8_q:  # the int8-q kernel's tensor maps, encoded once per cache
            assert maps is not None
            cache_key = tuple((a.ptr, a.shape, a.strides) for a in cache[:2])
            if self._maps is None or self._maps[0] != cache_key:
                encoded = Q8Maps()
                encode_q8_maps(encoded, self.spec, cache)
                self._maps = (cache_key, encoded)
            ctypes.memmove(ctypes.addressof(maps), ctypes.addressof(self._maps[1]),
                           ctypes.sizeof(Q8Maps))
        q_arr, out_arr, lengths, indptr, lse_arr, table, tree = own
        item = q_arr.itemsize
        p.q, p.out, p.seq_lens = q_arr.ptr, out_arr.ptr, lengths.ptr
        p.qo_indptr = 0 if indptr is None else indptr.ptr
        p.lse = 0 if lse_arr is None else lse_arr.ptr
        p.q_token_stride, p.q_head_stride = q_arr.strides[0] // item, q_arr.strides[1] // item
        p.out_token_stride = out_arr.strides[0] // item
        p.out_head_stride = out_arr.strides[1] // item
        write_cache_fields(p, self.spec, cache)
        p.rope = support.ROPE_IDS[self.spec.rope] if rotate_q else 0
        p.key_transform = p.key_transform if rotate_q else 0  # else q arrives transformed
        p.rope_theta = self.spec.rope_theta
        p.cos_sin = 0 if table is None else table.ptr
        p.tree_mask = 0 if tree is None else tree.ptr
        p.tree_words = 0 if tree is None else tree.shape[1]
        p.decode_rows = (2 if appended else 1) if self.decode_rows else 0

    def _rows(self, name: str, array: DeviceArray) -> None:
        """fp16/bf16 ``[total_q, Hq, D]`` in the plan's dtype, rows 16-byte aligned."""
        check.element_aligned(name, array)
        check.dtype(name, array, (self.dtype,))
        check.shape(name, array, (None, self.num_q_heads, self.spec.head_dim),
                    "[total_q, Hq, D]")
        if array.shape[0] != self.total_q:
            raise ValueError(f"{name}: expected total_q={self.total_q} rows (the planned "
                             f"qo_indptr[-1]), got {array.shape[0]}")
        check.inner_contiguous(name, array)
        check.aligned(name, array, 16, (0, 1))

    def _check(self, own: tuple, cache: Any, rotate_q: bool, cos_sin: Any) -> None:
        q, out, lengths, indptr, lse, _, tree = own
        self._rows("q", q)
        self._rows("out", out)
        check.no_internal_overlap("out", out)
        check.same_or_disjoint("out", out, "q", q)
        capacity = check_cache(self.spec, cache, self.batch, written=False)
        if capacity < self.longest:
            raise ValueError(f"k_cache: capacity {capacity} tokens is below the planned longest "
                             f"sequence {self.longest}")
        check.device_lengths("seq_lens", lengths, self.device, self.batch)
        if indptr is not None:
            check.dtype("qo_indptr", indptr, ("int32",))
            check.shape("qo_indptr", indptr, (self.batch + 1,), "[B + 1]")
            check.contiguous("qo_indptr", indptr)
        if lse is not None:
            check.element_aligned("lse", lse)
            check.dtype("lse", lse, ("float32",))
            check.shape("lse", lse, (self.total_q, self.num_q_heads), "[total_q, Hq]")
            check.contiguous("lse", lse)
        check.flag("rotate_q", rotate_q)
        if rotate_q and self.spec.rope is None:
            raise ValueError("rotate_q: the cache spec applies no RoPE (rope=None); pass a spec "
                             "with rope='neox'/'gptj' or rotate_q=False")
        if cos_sin is not None and not rotate_q:
            raise ValueError("cos_sin: only used to rotate q; pass rotate_q=True or drop it")
        rope_table(self.spec, self.device, cos_sin, capacity)
        if tree is not None:
            if not self.tree:
                raise ValueError("tree_mask: the plan takes no tree masks; plan with "
                                 "plan(..., tree=True)")
            words = -(-self.longest_chunk // 32)
            check.dtype("tree_mask", tree, ("uint32", "int32"))
            check.shape("tree_mask", tree, (self.total_q, None), "[total_q, words]")
            if tree.shape[1] < words:
                raise ValueError(f"tree_mask: expected at least {words} 32-bit words per row "
                                 f"(the planned longest chunk has {self.longest_chunk} "
                                 f"tokens), got {tree.shape[1]}")
            check.contiguous("tree_mask", tree)
