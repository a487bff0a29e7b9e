"""MultiPlan: attention of packed ragged query chunks over the INT8 cache (prefill, chunked
prefill, speculative verification). ``plan()`` does the host work; ``run()`` only launches."""
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
from .bind import MultiBinder, host_queries
from .maps import Q8Maps
from .params import MultiParams
from .planner import (MAX_SPLITS, MultiWorkload, choose_cluster, choose_int8_q, choose_ksplit,
                      choose_merge, choose_splits, choose_wg_rows, int8_q_pays,
                      int8_q_unable)
from .prepared import PreparedRun
from .variants import WG_ROWS, CombineVariant, MultiVariant, ksplits, wgmma_available

_LOG2E = 1.4426950408889634
MAX_GRID_Z = 65535  # the batch is grid.z


class MultiPlan(OnCache, CreatedFromOptions):
    """Attention of ``qo_len[b]`` new query tokens per sequence over the INT8 cache.

    Queries are packed ``[total_q, Hq, D]`` (sequence b's rows ``qo_indptr[b] ..
    qo_indptr[b + 1] - 1``); ``seq_lens[b]`` counts the cached tokens including the chunk's,
    whose K/V must already be in the cache (PromptQuantizer with ``starts``, AppendPlan). Query
    i of sequence b is at position ``seq_lens[b] - qo_len[b] + i``; causal attention lets it see
    tokens ``t <= that position``, non-causal (speculative drafts) every cached token.
    ``plan(qo_indptr, seq_lens)`` takes host copies; ``run`` reads the device copies, so a
    captured graph follows new values within the plan (the same batch, total_q, at most
    the planned row tiles per sequence).

    Decode rows (``qo_indptr=None`` in both): one query row per sequence, row b of q for
    sequence b, over its ``seq_lens[b]`` tokens; a sequence with none gets out 0 and lse -inf
    and raises no flag, as in DecodePlan (which runs its many-head groups this way).

    ``allow_int8_q``: decode rows may run with q quantized per row to int8 for ``q K^T``
    (``plan(int8_q=)``; the README's "q in int8" says where and what it costs). Only with
    ``key_transform="hadamard"``.
    """

    def __init__(self, cache: KVCacheSpec, num_q_heads: int, *, max_batch: int,
                 max_seq_len: int, dtype: str = "float16", sm_scale: float | None = None,
                 device: Device | None = None, allow_int8_q: bool = False) -> None:
        self.cache = cache_spec(cache)
        self.allow_int8_q = check.int8_q_option(allow_int8_q, self.cache)
        self.group_size = self.cache.group_size(num_q_heads)
        self.num_q_heads = int(num_q_heads)
        self.max_batch = check.positive("max_batch", max_batch, MAX_GRID_Z + 1)
        self.max_seq_len = check.positive("max_seq_len", max_seq_len)
        self.dtype = check.dtype_option("dtype", dtype, DTYPES)
        self.sm_scale = check.sm_scale(sm_scale, self.cache.head_dim)
        self.device = check.device_option(device)
        self.variant = MultiVariant.planned(self.cache, self.dtype)  # set by plan()
        self._binder = MultiBinder(self.cache, self.num_q_heads, self.dtype, self.device)
        self._workspace: dict[str, Any] = {}
        self._params = MultiParams()
        self._maps = Q8Maps()  # the int8-q kernel's second argument (bound by run)
        self._launch: PreparedLaunch | None = None
        self._combine: PreparedLaunch | None = None  # multi_combine (merge "kernel")
        self._grid = (0, 0, 0)
        self._generation = 0  # bumped by every plan(): PreparedRuns of older plans are stale
        self._description: dict[str, Any] = {}
        self._finalizer = weakref.finalize(self, close_all, self._workspace)

    # -- plan ---------------------------------------------------------------------------------
    def plan(self, qo_indptr: Any, seq_lens: Any, *, causal: bool = True,
             num_splits: int | None = None, ksplit: int | None = None,
             tree: bool = False, wgmma: bool | None = None,
             wg_rows: int | None = None, cluster: bool | None = None,
             combine: bool | None = None, int8_q: bool | None = None) -> "MultiPlan":
        """Cut the launch for these host copies of ``qo_indptr`` ([B + 1], from 0, or None:
        decode rows) and ``seq_lens`` ([B]); load the kernel (compiled once per process), size
        the workspace. ``num_splits`` overrides the planner's KV splits per row tile (1 .. 32), ``ksplit``
        its warps per 16 query rows (see ``ksplits``). ``tree``: run() will take tree masks
        (speculative trees); the plan then uses the split-warp kernel (ksplit > 1), which
        alone carries the mask. ``wgmma``: force (True) or forbid (False) the Hopper
        warpgroup-MMA kernels (sm_90, head_dim 64/128, whole tiles per warpgroup); None lets
        the planner pick them wherever they apply. ``wg_rows`` (implies ``wgmma=True``): the
        warpgroup kernel's query rows per CTA, 128 (two warpgroups) or 64 (one, two CTAs per
        SM); by default the planner's, or the smaller that holds a sequence's rows.
        ``cluster``: the warpgroup kernels' splits merge inside a thread-block cluster (sm_90,
        2 .. 8 splits; True requires it, False forbids it); None: wherever the device holds
        the clustered grid as well as the plain one (``describe()["cluster"]``). ``combine``:
        splits not merged in a cluster are merged by a second kernel (True or None, the
        default; True also forbids the cluster) or by the last split of each row tile to
        finish (False); ``describe()["merge"]`` says which, ``"launches"`` how many.
        ``int8_q`` (a plan made with ``allow_int8_q=True``): run the int8-q kernel (True:
        ValueError where it cannot serve the plan), never (False), or (None) for decode rows of
        16 to 64 query heads per KV head wherever it can (``describe()["int8_q"]``)."""
        self._require_open()
        check.flag("causal", causal)
        check.flag("tree", tree)
        if wgmma is not None:
            check.flag("wgmma", wgmma)
        if cluster is not None:
            check.flag("cluster", cluster)
        if combine is not None:
            check.flag("combine", combine)
            if combine and cluster:
                raise ValueError("combine: the merge kernel and the cluster merge exclude each "
                                 "other, got combine=True with cluster=True")
        if int8_q is not None:
            check.flag("int8_q", int8_q)
        if num_splits is not None:  # checked before anything is compiled or loaded
            num_splits = check.positive("num_splits", num_splits, MAX_SPLITS + 1)
        qo_lens, lengths = host_queries(qo_indptr, seq_lens, self.max_batch, self.max_seq_len)
        decode_rows = qo_indptr is None
        allowed = ksplits(self.head_dim)[1:] if tree else ksplits(self.head_dim)
        if ksplit is not None and ksplit not in allowed:
            raise ValueError(f"ksplit: expected one of {allowed} at head_dim {self.head_dim}"
                             f"{' with tree=True' if tree else ''}, got {ksplit!r}")
        rows = int(qo_lens.max()) * self.group_size
        use_int8_q = choose_int8_q(
            int8_q, self.allow_int8_q,
            int8_q_unable(self.device.arch, self.cache, decode_rows, tree, ksplit, wgmma,
                          wg_rows), rows,
            lambda: num_splits is not None or int8_q_pays(
                qo_lens, lengths, self.group_size, self.num_kv_heads, self.device.sm_count))
        use_wgmma, wg_rows = (False, 128) if use_int8_q else self._wgmma_choice(
            wgmma, wg_rows, ksplit, tree, rows, int(np.count_nonzero(qo_lens)) * self.num_kv_heads)
        if ksplit is None:
            ksplit = (allowed[-1] if tree else 1 if use_wgmma or use_int8_q else
                      choose_ksplit(qo_lens, self.group_size, self.head_dim))
        self.variant = MultiVariant.planned(self.cache, self.dtype, ksplit, use_wgmma, wg_rows,
                                            use_int8_q)
        threads = self.variant.threads
        work = MultiWorkload(qo_lens, lengths, self.group_size, self.num_kv_heads,
                             self.variant.tile_tokens, self.variant.rows_per_cta)
        kernel = load_kernels(self.variant, self.device)[0]
        shared = self.variant.shared_bytes
        kernel.allow_dynamic_shared(shared)
        ctas_per_sm = kernel.occupancy(threads, shared)
        splits, min_tokens = choose_splits(work, self.device.sm_count, ctas_per_sm)
        if num_splits is not None:
            splits = num_splits
        batch, total_q, tiles = int(qo_lens.size), int(qo_lens.sum()), work.max_tiles
        slots = batch * self.num_kv_heads * tiles
        cta_rows = self.variant.rows_per_cta
        self._grid = (tiles * self.num_kv_heads, splits, batch)
        check.int32_count("qo_indptr", self._grid[0], "row tiles x KV heads (grid.x)")
        # The kernels wait for the previous kernel themselves (early_reads, run): on sm_90
        # (Hopper, where clusters can merge the splits too) they launch programmatically, the
        # launch overlapping that kernel's tail.
        programmatic = self.device.compute_capability >= (9, 0)
        clustered = choose_cluster(
            False if combine else cluster,
            "warpgroup" if use_wgmma else "int8-q" if use_int8_q else "mma.sync",
            self.device.arch, programmatic, splits, slots * splits,
            self.device.sm_count * ctas_per_sm,
            lambda: kernel.max_active_clusters(LaunchConfig(self._grid, threads, shared,
                                                            cluster=(1, splits, 1))))
        merge = choose_merge(combine, clustered, splits)
        partials = merge in ("kernel", "last split")  # the cluster keeps them in shared memory
        self._ensure_workspace(slots * splits * cta_rows if partials else 0, slots)
        p = self._params
        ws = self._workspace
        p.partial_out, p.partial_lse = ws["partial_out"].ptr, ws["partial_lse"].ptr
        p.counters, p.error_flags = ws["counters"].ptr, ws["error_flags"].ptr
        p.score_scale_log2 = self.sm_scale * _LOG2E
        p.num_kv_heads, p.group_size = self.num_kv_heads, self.group_size
        p.num_splits, p.min_split_tokens = splits, min_tokens
        p.total_q, p.max_tiles, p.causal = total_q, tiles, int(causal)
        # 2: the merge kernel lets the next launch start early, where the attention kernel
        # runs one CTA per SM (multi_combine.cu says why not with more).
        p.combine = (1 + (ctas_per_sm == 1)) if merge == "kernel" else 0
        self._launch = kernel.prepare(
            LaunchConfig(self._grid, threads, shared, programmatic=programmatic,
                         cluster=(1, splits, 1) if clustered else None),
            p, *((self._maps,) if use_int8_q else ()))
        self._combine = None
        if merge == "kernel":
            combiner = CombineVariant.of(self.variant)
            self._combine = load_kernels(combiner, self.device)[0].prepare(
                LaunchConfig(combiner.grid(self._grid[0], batch), combiner.threads,
                             programmatic=programmatic), p)
        self._generation += 1
        self._binder.planned(batch, total_q, int(lengths.max()), int(qo_lens.max()), tree,
                             decode_rows, use_int8_q)
        self._description = {
            "batch": batch, "total_q": total_q, "causal": causal, "grid": self._grid,
            "decode_rows": decode_rows,
            "block": threads, "rows_per_cta": cta_rows, "ksplit": ksplit, "tree": tree,
            "wgmma": use_wgmma, "wg_rows": wg_rows if use_wgmma else None,
            "int8_q": use_int8_q,
            "max_tiles": tiles,
            "num_splits": splits, "min_split_tokens": min_tokens, "cluster": clustered,
            "merge": merge, "launches": 1 + (merge == "kernel"),
            "tile_tokens": self.variant.tile_tokens,
            "registers": kernel.num_registers,
            "local_bytes": kernel.local_bytes, "shared_bytes": shared,
            "ctas_per_sm": ctas_per_sm, "kernel": self.variant.kernel,
            "programmatic": programmatic,
        }
        return self

    def _wgmma_choice(self, wgmma: bool | None, wg_rows: int | None, ksplit: int | None,
                      tree: bool, rows: int, row_tiles: int = 0) -> tuple[bool, int]:
        """(warpgroup kernel or not, its rows per CTA): the planner's pick (planner.
        choose_wg_rows; ``rows``: the most query rows of one sequence and KV head,
        ``row_tiles``: the (sequence, KV head) pairs with rows) wherever the kernels apply,
        unless ``wgmma`` / ``wg_rows`` say otherwise."""
        if wg_rows is not None:
            if isinstance(wg_rows, bool) or wg_rows not in WG_ROWS:
                raise ValueError(f"wg_rows: expected one of {WG_ROWS}, got {wg_rows!r}")
            if wgmma is False:
                raise ValueError(f"wg_rows: the warpgroup kernel's rows, given with "
                                 f"wgmma=False (got wg_rows={wg_rows})")
            wgmma = True
        available = wgmma_available(self.device.arch, self.head_dim)
        if wgmma is None:
            picked = (choose_wg_rows(rows, row_tiles, self.device.sm_count)
                      if available and ksplit in (None, 1) and not tree else None)
            return picked is not None, picked or 128
        if wgmma and not available:
            raise ValueError(f"wgmma: the warpgroup-MMA kernel needs an sm_90 device and "
                             f"head_dim 64 or 128, got {self.device.arch} and head_dim "
                             f"{self.head_dim}")
        if wgmma and (ksplit not in (None, 1) or tree):
            raise ValueError(f"wgmma: the warpgroup-MMA kernel takes whole tiles (ksplit 1, "
                             f"no tree masks), got ksplit {ksplit}, tree={tree}")
        if not wgmma:
            return False, 128
        return True, wg_rows or (64 if rows <= 64 else 128)

    def _ensure_workspace(self, rows: int, counters: int) -> None:
        """``rows`` split partial rows (D floats and an LSE each), ``counters`` merge counters;
        grows only."""
        ws = self._workspace
        if ("partial_lse" in ws and ws["partial_lse"].shape[0] >= max(rows, 1)
                and ws["counters"].shape[0] >= counters):
            return
        for array in ws.values():
            array.close()
        ws.clear()
        rows = max(rows, 1)
        ws["partial_out"] = DeviceArray.empty(rows * self.head_dim, np.float32, self.device)
        ws["partial_lse"] = DeviceArray.empty(rows, np.float32, self.device)
        ws["counters"] = DeviceArray.full(max(counters, 1), 0, np.uint32, self.device)
        ws["error_flags"] = ErrorWord(self.device)

    # -- run ----------------------------------------------------------------------------------
    def run(self, q: Any, k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any,
            seq_lens: Any, qo_indptr: Any, out: Any, *, lse: Any = None,
            block_table: Any = None, rotate_q: bool = False, cos_sin: Any = None,
            tree_mask: Any = None, early_reads: bool = False, appended: bool = False,
            stream: StreamLike) -> None:
        """out[i, h] = softmax(sm_scale * q[i, h] K^T) V over the tokens query row i sees.

        q, out: ``[total_q, Hq, D]`` fp16/bf16 (out may be q itself); caches and scales as
        for DecodePlan.run (contiguous or paged with ``block_table``); seq_lens: int32 ``[B]``
        and qo_indptr: int32 ``[B + 1]`` on the device (None for a plan of decode rows); lse:
        optional fp32 ``[total_q, Hq]`` (natural log). ``rotate_q``: apply the spec's RoPE to q at the rows' positions first
        (angles from ``cos_sin`` [max_pos, D/2, 2] or ``rope_theta``), as the writers rotate K.
        ``tree_mask`` (a plan made with ``tree=True``): speculative trees, uint32/int32
        ``[total_q, words]`` on the device (words >= ceil(longest planned chunk / 32)): bit j
        of row i (word j // 32, bit j % 32) lets
        query i see draft token j of its chunk; tokens before the chunk stay visible, and a
        causal plan also hides draft tokens after i. Read at run time (graph-stable).
        Device values outside the plan set ERROR_QUERY_RANGE: a sequence whose qo_indptr
        interval is not monotone, passes total_q or is longer than its KV writes nothing;
        rows past the planned row tiles are not written. A length outside the cache is
        clamped (ERROR_OUTSIDE_CACHE). Enqueued on ``stream``; returns at once.

        ``early_reads`` (where the launch is programmatic: Hopper; see
        ``describe()["programmatic"]``): ``seq_lens``, ``qo_indptr``, the block table and the
        cache rows and scales before each sequence's chunk (positions < seq_len - qo_len) may
        be read while the kernel before it on the stream is still finishing, so the first
        tiles stream during its tail. q, ``cos_sin``, the tree mask, the chunk's rows and every
        write wait for it. Pass True only when that kernel writes none of those buffers (it may
        write the chunk's rows: the layer's PromptQuantizer.run(starts=), without seq_lens_out
        into these seq_lens).

        ``appended`` (decode rows only): ``seq_lens[b]`` counts the tokens before the one just
        appended at position ``seq_lens[b]`` (DecodePlan.append_and_run's lengths); each row
        attends ``seq_lens[b] + 1`` tokens (rotated, with ``rotate_q``, at ``seq_lens[b]``).
        """
        check.flag("early_reads", early_reads)
        self._require_planned()
        self._binder.bind(self._params, q, k_cache, v_cache, k_scale, v_scale, seq_lens,
                          qo_indptr, out, lse, block_table, cos_sin, rotate_q, tree_mask,
                          appended, self._maps)
        self._params.early_reads = int(early_reads)
        if self._binder.total_q:
            self._launch.launch(stream)  # type: ignore[union-attr]
            if self._combine is not None:
                self._combine.launch(stream)

    def prepare_run(self, q: Any, k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any,
                    seq_lens: Any, qo_indptr: Any, out: Any, *, lse: Any = None,
                    block_table: Any = None, rotate_q: bool = False, cos_sin: Any = None,
                    tree_mask: Any = None, early_reads: bool = False,
                    appended: bool = False) -> "PreparedRun":
        """``run``'s arguments, validated once: ``launch(stream)`` on the result issues the
        same launch with no further checks, until the next ``plan``."""
        check.flag("early_reads", early_reads)
        self._require_planned()
        params = MultiParams.from_buffer_copy(self._params)
        maps = Q8Maps.from_buffer_copy(self._maps)
        self._binder.bind(params, q, k_cache, v_cache, k_scale, v_scale, seq_lens, qo_indptr,
                          out, lse, block_table, cos_sin, rotate_q, tree_mask, appended, maps)
        params.early_reads = int(early_reads)
        return PreparedRun(self, params, maps, self._binder.total_q > 0)

    # -- introspection and lifetime -----------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """The planned launch: grid, splits, registers, shared memory."""
        return dict(self._description)

    def error_flags(self, *, stream: StreamLike, clear: bool = True) -> int:
        """The bits the kernel set since the last clear (see run). Waits for the work enqueued
        on ``stream``, then clears on it; 0 before the first plan."""
        self._require_open()
        word = self._workspace.get("error_flags")
        return 0 if word is None else word.read(stream, clear)

    def _require_open(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("MultiPlan is closed")

    def _require_planned(self) -> None:
        self._require_open()
        if self._launch is None:
            raise RuntimeError("run: call plan(qo_indptr, seq_lens) first")

    def close(self) -> None:
        """Free the workspace; the plan cannot run afterwards."""
        self._finalizer()
        self._launch = self._combine = None

    def __enter__(self) -> "MultiPlan":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

