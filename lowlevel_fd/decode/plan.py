"""DecodePlan: ``plan()`` does the host work once, ``run()`` only launches (graph-capturable)."""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ..core import validate as check
from ..core.errors import ErrorWord
from ..core.loader import load_kernels
from ..core.resources import close_all
from ..core.spec import CreatedFromOptions, KVCacheSpec, OnCache, cache_spec
from ..core.support import DTYPES
from ..driver import Device, DeviceArray, LaunchConfig, PreparedLaunch
from ..driver.stream import StreamLike
from .bind import RunBinder, advance_pages
from .params import DecodeParams
from .planner import TileConfig, Workload, check_config, choose
from .prepared import PreparedCall
from .route import MultiRoute, wants_multi
from .variants import LENGTHS, CombineVariant, DecodeVariant, head_chunks

_LOG2E = 1.4426950408889634


class DecodePlan(OnCache, CreatedFromOptions):
    """Decode attention (one query token per sequence) over an INT8 KV cache.

    ``plan(seq_lens)`` picks the launch for a batch; ``run(...)`` executes it on a stream with
    no allocation, synchronisation or compilation. The log-sum-exp it can return is the
    natural logarithm (FlashInfer's is base 2). ``dtype`` is that of q, out and the new K/V
    rows (fp16 or bf16). A group of 16 query heads or more over a large KV (planner rule 8)
    runs ``run`` on the multi-token kernel (``describe()["backend"]``), with the same contract.
    ``allow_int8_q`` (Hadamard keys only) lets that route quantize q per row to int8 for
    ``q K^T`` (``describe()["multi"]["int8_q"]``; README, "q in int8").
    """

    def __init__(self, cache: KVCacheSpec, num_q_heads: int, *, max_batch: int,
                 max_seq_len: int, dtype: str = "float16", sm_scale: float | None = None,
                 device: Device | None = None, allow_int8_q: bool = False) -> None:
        self.cache = cache_spec(cache)
        self.allow_int8_q = check.int8_q_option(allow_int8_q, self.cache)
        self.group_size = self.cache.group_size(num_q_heads)
        self.num_q_heads = int(num_q_heads)
        # The group in CTAs (set by plan()): cta_heads (the kernel's GROUP) query heads each,
        # head_chunks CTAs per KV head.
        self.cta_heads, self.head_chunks, _ = head_chunks(self.group_size)
        self.max_batch = check.positive("max_batch", max_batch)
        self.max_seq_len = check.positive("max_seq_len", max_seq_len)
        self.dtype = check.dtype_option("dtype", dtype, DTYPES)
        self.sm_scale = check.sm_scale(sm_scale, self.cache.head_dim)
        self.device = check.device_option(device)
        self._binder = RunBinder(self.cache, self.num_q_heads, self.dtype, self.device,
                                 self.max_seq_len)
        self._workspace: dict[str, Any] = {}
        self._params = DecodeParams()
        self._split: PreparedLaunch | None = None
        self._split_append: PreparedLaunch | None = None
        self._combine: PreparedLaunch | None = None
        self._generation = 0  # bumped by every plan(): PreparedCalls of older plans are stale
        self._table_window = self._programmatic = False  # set by plan()
        self._description: dict[str, Any] = {}
        self._finalizer = weakref.finalize(self, close_all, self._workspace)
        self._route = MultiRoute(self.cache, self.num_q_heads, self.max_batch, self.max_seq_len,
                                 self.dtype, self.sm_scale, self.device, self.allow_int8_q)

    # -- plan ---------------------------------------------------------------------------------
    def plan(self, seq_lens: Any, *, config: TileConfig | None = None,
             append: bool = False, multi: bool | None = None,
             int8_q: bool | None = None) -> "DecodePlan":
        """Choose splits and tiles for these host lengths ``[B]`` (the tokens in each cache),
        compile and load the kernels (once per process), size the workspace. With ``append``
        the fused-append kernel of ``append_and_run`` is loaded too, planned for the
        ``seq_lens[b] + 1`` tokens it attends. A captured graph stays valid for any device
        lengths up to the cache's capacity, but must be recaptured after re-planning.
        ``multi``: run ``run`` on the multi-token kernel (True) or the decode kernel (False);
        None lets the planner choose (rule 8: groups of 16+ heads over a large KV, sm_90; with
        ``allow_int8_q``, also wherever the int8-q kernel pays). ``int8_q``: MultiPlan.plan's,
        for the route (True implies ``multi``)."""
        check.flag("append", append)
        if int8_q is not None:
            check.flag("int8_q", int8_q)
            if int8_q and multi is False:
                raise ValueError("int8_q: the int8-q kernel runs on the multi-token route, got "
                                 "int8_q=True with multi=False")
            multi = True if int8_q else multi
        self._require_open()
        lengths = check.host_lengths("seq_lens", seq_lens, self.max_batch, self.max_seq_len)
        if append:
            check.room_for_new_token("seq_lens", lengths, self.max_seq_len)
            lengths = lengths + 1
        if config is not None:
            check_config(config)
        routed = wants_multi(multi, self.cache, self.group_size,
                             head_chunks(self.group_size)[1], lengths, self.device,
                             config is not None, self.allow_int8_q)
        batch, longest = int(lengths.size), int(lengths.max())
        hopper = self.device.compute_capability >= (9, 0)
        cta_heads, chunks, chunk_heads = head_chunks(self.group_size,
                                                     config.cta_heads if config else 0)
        slots = self.num_kv_heads * chunks  # CTAs per sequence and split
        if config is None:
            config = choose(Workload(batch, slots, longest, self.device.sm_count, 0, cta_heads,
                                     self.head_dim, self.device.memory_bandwidth),
                            clusters=hopper)
        if config.cluster and not hopper:
            raise ValueError(f"config.cluster: needs sm_90+, got {self.device.arch}")
        variant = DecodeVariant.planned(self.cache, self.group_size, self.dtype, config)
        shared, slots_offset = variant.launch_shared_bytes(config.num_splits)
        if shared > self.device.info.max_shared_per_block_optin:
            raise ValueError(f"config: {shared} bytes of shared memory per CTA exceed the "
                             f"device's {self.device.info.max_shared_per_block_optin} (fewer "
                             f"warps, stages, tiles or cluster splits)")
        variants = [variant] + ([DecodeVariant.planned(self.cache, self.group_size, self.dtype,
                                                       config, append=True)] if append else [])
        kernels = [load_kernels(v, self.device)[0] for v in variants]
        for kernel in kernels:
            kernel.allow_dynamic_shared(shared)
            if config.cluster:
                kernel.allow_large_clusters()
        split = kernels[0]
        ctas_per_sm = split.occupancy(variant.threads, shared)
        self.cta_heads, self.head_chunks = cta_heads, chunks
        partials = 1 if config.cluster or config.num_splits == 1 else (
            batch * slots * config.num_splits)
        self._ensure_workspace(partials * cta_heads, self.max_batch * slots)
        p = self._params
        p.partial_out = self._workspace["partial_out"].ptr
        p.partial_lse = self._workspace["partial_lse"].ptr
        p.counters = self._workspace["counters"].ptr
        p.error_flags = self._workspace["error_flags"].ptr
        p.score_scale_log2 = self.sm_scale * _LOG2E
        p.num_kv_heads = self.num_kv_heads
        p.num_splits = config.num_splits
        p.min_split_tokens = config.min_split_tokens
        p.fused_merge = int(config.fused_merge)
        p.cluster_slots_offset = slots_offset
        p.group_size, p.head_chunks, p.chunk_heads = self.group_size, chunks, chunk_heads
        grid = (slots, config.num_splits, batch)
        # The fused append kernels of paged plans of few CTAs copy their first page ids with
        # the positions (IdWindow in cu/cache_pages.cuh): there the chain is the time. Not
        # with early reads on a programmatic launch (_window_for): the ids are then read
        # during the previous kernel's tail anyway, and the window's copy and CTA barrier
        # cost the 32-layer step at B=1 0.03-0.05 us per layer (PERF_NOTES v21).
        self._table_window = bool(self.cache.paged and
                                  batch * slots * config.num_splits <= 2 * self.device.sm_count)
        self._programmatic = bool(config.programmatic and hopper)
        launch_config = LaunchConfig(
            grid, variant.threads, shared,
            cluster=(1, config.num_splits, 1) if config.cluster else None,
            programmatic=config.programmatic and hopper)
        # Both instantiations launch the same way, on the same parameter block.
        self._split = split.prepare(launch_config, p)
        self._split_append = kernels[1].prepare(launch_config, p) if append else None
        self._combine = None
        if config.num_splits > 1 and not config.fused_merge and not config.cluster:
            combine = CombineVariant(self.head_dim, self.cta_heads, self.dtype, variant.masked)
            self._combine = load_kernels(combine, self.device)[0].prepare(
                LaunchConfig((slots, batch), combine.threads, combine.shared_bytes), p)
        self._advance = load_kernels(LENGTHS, self.device)[0]
        self._hopper = hopper
        self._route.planned(lengths if routed else None, append, int8_q)
        self._binder.planned(batch, longest)
        self._generation += 1
        described = self._route.describe()
        launches = described["launches"] if routed else 1 + (self._combine is not None)
        self._description = {
            "backend": "multi" if routed else "decode", "multi": described,
            "batch": batch, "grid": grid, "block": variant.threads,
            "group_size": self.group_size, "cta_heads": self.cta_heads,
            "head_chunks": self.head_chunks, "table_window": self._table_window,
            "num_splits": config.num_splits, "min_split_tokens": config.min_split_tokens,
            "tiles": variant.tiles, "tile_tokens": 16 * variant.tiles,
            "num_warps": variant.num_warps, "stages": variant.stages,
            "fused_merge": config.fused_merge, "cluster": config.cluster,
            "programmatic": config.programmatic and hopper,
            "launches": launches,
            "append_launches": launches + int(routed),  # routed: the append kernel first
            "registers": split.num_registers, "local_bytes": split.local_bytes,
            "shared_bytes": split.static_shared_bytes + shared,
            "ctas_per_sm": ctas_per_sm, "kernel": variant.split_kernel,
            "append_kernel": variants[1].split_kernel if append else None,
        }
        return self

    def _ensure_workspace(self, rows: int, counters: int) -> None:
        """``rows`` split partials (head rows of D floats and their LSEs) for the global merge,
        ``counters`` merge counters (one per sequence and CTA slot); grows only."""
        ws = self._workspace
        if ("partial_lse" in ws and ws["partial_lse"].shape[0] >= rows
                and ws["counters"].shape[0] >= counters):
            return
        for array in ws.values():
            array.close()
        ws["partial_out"] = DeviceArray.empty(rows * self.head_dim, np.float32, self.device)
        ws["partial_lse"] = DeviceArray.empty(rows, np.float32, self.device)
        ws["counters"] = DeviceArray.full(counters, 0, np.uint32, self.device)
        ws["error_flags"] = ErrorWord(self.device)

    # -- run ----------------------------------------------------------------------------------
    def run(self, q: Any, k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any,
            seq_lens: Any, out: Any, *, lse: Any = None, block_table: Any = None,
            stream: StreamLike) -> None:
        """out[b, h] = softmax(sm_scale * q[b, h] K^T) V over the first seq_lens[b] tokens.

        q, out: ``[B, Hq, D]`` fp16/bf16; caches: int8 ``[B, Hkv, S, D]`` (bnsh) or
        ``[B, S, Hkv, D]`` (bsnh), or paged pools ``[num_pages, page_size, Hkv, D]`` (nhd) or
        ``[num_pages, Hkv, page_size, D]`` (hnd) with ``block_table`` int32 ``[B, max_pages]``
        on the device (token t of sequence b in page ``block_table[b][t // page_size]``; read
        at run time, so a captured graph follows a rewritten table); seq_lens: int32 ``[B]`` on
        the device; lse: optional fp32 ``[B, Hq]`` (natural log). Enqueued on ``stream``;
        returns at once.
        """
        self._require_planned("run")
        self._binder.bind(self._params, q, k_cache, v_cache, k_scale, v_scale, seq_lens, out,
                          lse, block_table)
        self._params.append = self._params.early_reads = 0
        if self._route.active:  # decode's checks above (its messages); the route binds its own
            self._route.run(q, k_cache, v_cache, k_scale, v_scale, seq_lens, out, lse,
                            block_table, stream)
        else:
            self._launch(False, stream)

    def append_and_run(self, q: Any, k_new: Any, v_new: Any, k_cache: Any, v_cache: Any,
                       k_scale: Any, v_scale: Any, seq_lens: Any, out: Any, *,
                       cos_sin: Any = None, lse: Any = None, early_reads: bool = False,
                       block_table: Any = None, stream: StreamLike) -> None:
        """One launch that appends each sequence's new token and attends over the cache with it.

        For every b with 0 <= seq_lens[b] < S_max: rotate k_new[b] and q[b] at position
        seq_lens[b] (RoPE per the spec's ``rope``; q itself is not modified), quantize
        k_new[b] and v_new[b] with the spec's scale mode (writing per-token scales), write them
        at seq_lens[b] in the caches, and set out[b, h] to the attention of the rotated q over
        the seq_lens[b] + 1 tokens. A length outside the cache writes nothing and attends the
        tokens there are (ERROR_OUTSIDE_CACHE). ``seq_lens`` is not advanced
        (``advance_lengths`` does that). k_new, v_new: ``[B, Hkv, D]`` like q; cos_sin: optional
        fp32 ``[max_pos >= S_max, D/2, 2]`` table (else the angles come from ``rope_theta``).
        block_table: paged specs (see ``run``); the token goes to page
        ``block_table[b][seq_lens[b] // page_size]`` (an id outside the pool: nothing written,
        ERROR_BAD_PAGE). Plan with ``append=True``. Enqueued on ``stream``; returns at once.

        On a routed plan (``describe()["backend"] == "multi"``) this is two launches: the
        append kernel (AppendPlan, q untouched), then the multi-token kernel, which rotates q
        and attends the ``seq_lens[b] + 1`` tokens; the same writes, flags and contract.

        ``early_reads`` (Hopper's programmatic launch): the kernel reads ``seq_lens``, the
        caches, their scales and ``cos_sin`` while the kernel before it on the stream is still
        finishing, so its first cache tiles stream during that kernel's tail. Only q, k_new and
        v_new wait for it, and every write does. Pass True only when that previous kernel writes
        none of those buffers (DecodeStep: every layer after the first).
        """
        check.flag("early_reads", early_reads)
        self._require_planned("append_and_run", append=True)
        self._binder.bind_append(self._params, q, k_new, v_new, k_cache, v_cache, k_scale,
                                 v_scale, seq_lens, out, lse, cos_sin, block_table)
        self._params.early_reads = int(early_reads)
        self._params.table_window = self._window_for(early_reads)
        if self._route.active:
            self._route.append_and_run(q, k_new, v_new, k_cache, v_cache, k_scale, v_scale,
                                       seq_lens, out, cos_sin, lse, early_reads, block_table,
                                       self._binder.capacity, stream)
        else:
            self._launch(True, stream)

    def prepare_run(self, q: Any, k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any,
                    seq_lens: Any, out: Any, *, lse: Any = None,
                    block_table: Any = None) -> "PreparedCall":
        """``run``'s arguments, validated once: ``launch(stream)`` on the result issues the same
        launch with no further checks, until the next ``plan``."""
        self._require_planned("prepare_run")
        params = DecodeParams.from_buffer_copy(self._params)
        self._binder.bind(params, q, k_cache, v_cache, k_scale, v_scale, seq_lens, out, lse,
                          block_table)
        params.append = params.early_reads = 0
        routed = ((self._route.prepare(q, k_cache, v_cache, k_scale, v_scale, seq_lens, out,
                                       lse, block_table),) if self._route.active else ())
        return PreparedCall(self, params, False, routed)

    def prepare_append_and_run(self, q: Any, k_new: Any, v_new: Any, k_cache: Any,
                               v_cache: Any, k_scale: Any, v_scale: Any, seq_lens: Any,
                               out: Any, *, cos_sin: Any = None, lse: Any = None,
                               early_reads: bool = False,
                               block_table: Any = None) -> "PreparedCall":
        """``append_and_run``'s arguments, validated once (see ``prepare_run``)."""
        check.flag("early_reads", early_reads)
        self._require_planned("prepare_append_and_run", append=True)
        params = DecodeParams.from_buffer_copy(self._params)
        self._binder.bind_append(params, q, k_new, v_new, k_cache, v_cache, k_scale, v_scale,
                                 seq_lens, out, lse, cos_sin, block_table)
        params.early_reads = int(early_reads)
        params.table_window = self._window_for(early_reads)
        routed = (self._route.prepare_append(q, k_new, v_new, k_cache, v_cache, k_scale,
                                             v_scale, seq_lens, out, cos_sin, lse, early_reads,
                                             block_table, self._binder.capacity)
                  if self._route.active else ())
        return PreparedCall(self, params, True, routed)

    def _window_for(self, early_reads: bool) -> int:
        """The fused append's table window for this call (see plan)."""
        return int(self._table_window and not (early_reads and self._programmatic))

    def _launch(self, append: bool, stream: StreamLike) -> None:
        (self._split_append if append else self._split).launch(stream)  # type: ignore[union-attr]
        if self._combine is not None:
            self._combine.launch(stream)

    def advance_lengths(self, seq_lens: Any, capacity: int, *, block_table: Any = None,
                        num_pages: int | None = None, stream: StreamLike) -> None:
        """seq_lens[b] += 1 where 0 <= seq_lens[b] < capacity, on the device: after the
        append_and_run calls of a step (which all read the same lengths). Paged specs pass the
        ``block_table`` and the pool's ``num_pages`` too: a token whose page id is outside the
        pool was not written, so its length does not advance."""
        self._require_planned("advance_lengths")
        lengths = check.device_lengths("seq_lens", seq_lens, self.device, None)
        capacity = check.positive("capacity", capacity)
        batch = lengths.shape[0]
        table, stride, pages, shift = advance_pages(self.cache, self.device, block_table,
                                                    num_pages, batch, capacity)
        blocks = max(1, min(-(-batch // LENGTHS.threads), 1024))
        self._advance.prepare(LaunchConfig(blocks, LENGTHS.threads, programmatic=self._hopper),
                              lengths, np.int32(batch), np.int32(capacity), np.uint64(table),
                              np.int64(stride), np.int32(pages), np.int32(shift)
                              ).launch(stream)

    # -- introspection and lifetime -----------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """The planned launch: grid, splits, tile, stages, registers, shared memory."""
        return dict(self._description)

    def error_flags(self, *, stream: StreamLike, clear: bool = True) -> int:
        """The bits the kernels set since the last clear (ERROR_OUTSIDE_CACHE: a length or
        append position outside the cache). Waits for the work enqueued on ``stream`` (the one
        the launches went to), then clears on it; 0 before the first plan."""
        self._require_open()
        word = self._workspace.get("error_flags")
        flags = 0 if word is None else word.read(stream, clear)
        return flags | self._route.error_flags(stream, clear)

    def _require_open(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("DecodePlan is closed")

    def _require_planned(self, call: str, append: bool = False) -> None:
        self._require_open()
        if self._split is None or (append and self._split_append is None):
            raise RuntimeError(f"{call}: call plan(seq_lens{', append=True' if append else ''}) "
                               f"first")

    def close(self) -> None:
        """Free the workspace; the plan cannot run afterwards."""
        self._finalizer()
        self._route.close()
        self._split = self._split_append = self._combine = None

    def __enter__(self) -> "DecodePlan":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
