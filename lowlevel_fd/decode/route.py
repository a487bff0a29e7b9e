"""DecodePlan's route to the multi-token kernels (planner rule 8): a group of 16 query heads or
more over a large KV runs as MultiPlan's decode rows (one query row per sequence, empty
sequences written as decode writes them), whose kernels share each KV tile among all the
group's heads. ``run`` is one multi-token launch; ``append_and_run`` two: AppendPlan writes
the new token (q untouched), then the multi-token kernel rotates q itself and attends the
``seq_lens[b] + 1`` tokens (``appended``). The other families are used through their public
plans only."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..append import AppendPlan, PreparedAppend
from ..core import validate as check
from ..core.spec import KVCacheSpec
from ..driver import Device, DeviceArray
from ..driver.stream import StreamLike
from ..multi import MultiPlan, PreparedRun, int8_q_decode_pays
from .planner import routes_to_multi

MAX_MULTI_BATCH = 65535  # MultiPlan's batch is its grid.z


def theta_table(spec: KVCacheSpec, positions: int) -> np.ndarray:
    """fp32 ``[positions, D/2, 2]`` (cos, sin), computed the way the kernels' ``rope_theta``
    path does (rows.cuh rope_coefficients: inv_freq rounded to fp32, the angle pos * inv_freq
    rounded to fp32, its cos and sin evaluated in double and rounded once to fp32)."""
    half = spec.head_dim // 2
    inv_freq = np.exp2(-2.0 * np.arange(half) / spec.head_dim
                       * np.log2(float(spec.rope_theta))).astype(np.float32)
    angles = (np.arange(positions, dtype=np.float32)[:, None] * inv_freq[None, :])
    angles = angles.astype(np.float64)
    return np.stack([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)


def wants_multi(multi: bool | None, cache: KVCacheSpec, group_size: int, chunks: int,
                lengths: np.ndarray, device: Device, configured: bool,
                int8_q: bool = False) -> bool:
    """Whether a plan of these host ``lengths`` takes the route: ``multi`` True / False forces
    it (True: not with a decode ``config``), None applies rule 8, and (``int8_q``: the plan
    allows q in int8) takes it wherever the int8-q kernel would run and pay."""
    if multi is not None:
        check.flag("multi", multi)
        if multi and configured:
            raise ValueError("multi: a TileConfig plans the decode kernel; pass config=None "
                             "with multi=True")
        if multi and lengths.size > MAX_MULTI_BATCH:
            raise ValueError(f"multi: the multi-token kernel takes at most {MAX_MULTI_BATCH} "
                             f"sequences, got {lengths.size}")
        return multi
    if configured or lengths.size > MAX_MULTI_BATCH:
        return False
    if int8_q and int8_q_decode_pays(cache, group_size, lengths, device.arch,
                                     device.sm_count):
        return True
    kv_bytes = int(lengths.sum()) * cache.num_kv_heads * 2 * cache.head_dim
    return routes_to_multi(group_size, cache.head_dim, chunks, kv_bytes,
                           int(lengths.size) * cache.num_kv_heads,
                           device.compute_capability >= (9, 0))


class MultiRoute:
    """The MultiPlan a DecodePlan runs its routed launches on (made on first use, kept across
    plans, closed with the DecodePlan)."""

    def __init__(self, cache: KVCacheSpec, num_q_heads: int, max_batch: int, max_seq_len: int,
                 dtype: str, sm_scale: float, device: Device, allow_int8_q: bool = False) -> None:
        self.cache, self.max_batch, self.max_seq_len = cache, max_batch, max_seq_len
        self._options = dict(dtype=dtype, device=device)
        self._allow_int8_q = allow_int8_q
        self._heads, self._sm_scale = num_q_heads, sm_scale
        self.plan: MultiPlan | None = None
        self.append: AppendPlan | None = None
        # q rotated in the multi-token kernel from rope_theta costs every row a double-precision
        # evaluation per element; from a table, a load (B=32, group 64, S=4096: 74.2 us vs 33.0,
        # 27.9 unrotated; PERF_NOTES v23). Planned appends without a caller's table use this
        # one, built once for max_seq_len positions.
        self.table: DeviceArray | None = None
        self.active = False

    def planned(self, lengths: np.ndarray | None, append: bool,
                int8_q: bool | None = None) -> None:
        """Plan the route for these host lengths (``append``: the tokens ``append_and_run``
        attends, and load the append kernel; ``int8_q``: MultiPlan.plan's), or (None) leave
        it."""
        self.active = lengths is not None
        if lengths is None:
            return
        if self.plan is None:
            self.plan = MultiPlan(self.cache, self._heads,
                                  max_batch=min(self.max_batch, MAX_MULTI_BATCH),
                                  max_seq_len=self.max_seq_len, sm_scale=self._sm_scale,
                                  allow_int8_q=self._allow_int8_q, **self._options)
        self.plan.plan(None, lengths, causal=False, int8_q=int8_q)
        if not append:
            return
        if self.append is None:
            self.append = AppendPlan(self.cache, self._heads, max_batch=self.max_batch,
                                     **self._options)
        self.append.load()
        if self.cache.rope is not None and self.table is None:
            self.table = DeviceArray.from_numpy(theta_table(self.cache, self.max_seq_len),
                                                self._options["device"])

    def _attention(self, cos_sin: Any, capacity: int, early_reads: bool) -> dict[str, Any]:
        """The multi-token launch's options after the append: q rotated (RoPE specs) with the
        caller's table, else the route's where it covers the cache, else from rope_theta."""
        rotate = self.cache.rope is not None
        if rotate and cos_sin is None and self.table is not None:
            cos_sin = self.table if self.table.shape[0] >= capacity else None
        return dict(rotate_q=rotate, cos_sin=cos_sin if rotate else None,
                    early_reads=early_reads, appended=True)

    def run(self, q: Any, k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any,
            seq_lens: Any, out: Any, lse: Any, block_table: Any, stream: StreamLike) -> None:
        plan = self.plan
        assert plan is not None and self.active
        plan.run(q, k_cache, v_cache, k_scale, v_scale, seq_lens, None, out, lse=lse,
                 block_table=block_table, stream=stream)

    def prepare(self, q: Any, k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any,
                seq_lens: Any, out: Any, lse: Any, block_table: Any) -> PreparedRun:
        plan = self.plan
        assert plan is not None and self.active
        return plan.prepare_run(q, k_cache, v_cache, k_scale, v_scale, seq_lens, None, out,
                                lse=lse, block_table=block_table)

    def append_and_run(self, q: Any, k_new: Any, v_new: Any, k_cache: Any, v_cache: Any,
                       k_scale: Any, v_scale: Any, seq_lens: Any, out: Any, cos_sin: Any,
                       lse: Any, early_reads: bool, block_table: Any, capacity: int,
                       stream: StreamLike) -> None:
        plan, append = self.plan, self.append
        assert plan is not None and append is not None and self.active
        append.run(k_new, v_new, k_cache, v_cache, k_scale, v_scale, seq_lens, cos_sin=cos_sin,
                   block_table=block_table, stream=stream)
        plan.run(q, k_cache, v_cache, k_scale, v_scale, seq_lens, None, out, lse=lse,
                 block_table=block_table, stream=stream,
                 **self._attention(cos_sin, capacity, early_reads))

    def prepare_append(self, q: Any, k_new: Any, v_new: Any, k_cache: Any, v_cache: Any,
                       k_scale: Any, v_scale: Any, seq_lens: Any, out: Any, cos_sin: Any,
                       lse: Any, early_reads: bool, block_table: Any,
                       capacity: int) -> tuple[PreparedAppend, PreparedRun]:
        """The two launches of ``append_and_run``: the append (which reads nothing the kernel
        before it may write, except the new rows: it waits for it) and the attention, whose
        early reads then overlap the append's tail (it writes only the new token's row)."""
        plan, append = self.plan, self.append
        assert plan is not None and append is not None and self.active
        write = append.prepare_run(k_new, v_new, k_cache, v_cache, k_scale, v_scale, seq_lens,
                                   cos_sin=cos_sin, block_table=block_table)
        attend = plan.prepare_run(q, k_cache, v_cache, k_scale, v_scale, seq_lens, None, out,
                                  lse=lse, block_table=block_table,
                                  **self._attention(cos_sin, capacity, early_reads))
        return write, attend

    def error_flags(self, stream: StreamLike, clear: bool) -> int:
        flags = 0 if self.plan is None else self.plan.error_flags(stream=stream, clear=clear)
        if self.append is not None:
            flags |= self.append.error_flags(stream=stream, clear=clear)
        return flags

    def describe(self) -> dict[str, Any]:
        return self.plan.describe() if self.active and self.plan is not None else {}

    def close(self) -> None:
        for plan in (self.plan, self.append, self.table):
            if plan is not None:
                plan.close()
        self.table = None
        self.active = False
