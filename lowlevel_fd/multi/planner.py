"""How a multi-token launch is cut: host-side rules from the planned query and KV lengths.

A CTA owns a tile of packed query rows (tokens x heads of a group) of one KV head. Prefill has
thousands of such tiles and runs unsplit; a few rows over a long KV (speculative verification,
short chunks over long prefixes) would leave most SMs idle, so each tile's KV range is cut into
splits (a multiple of the KV tile each, at least MIN_SPLIT_TILES tiles): a grid below one wave
of resident CTAs as far as it still fits one, a larger one toward WAVES waves. The device
recomputes every split's range from the live lengths (multi_params.cuh tile_splits), so a
captured graph follows lengths that change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..core.spec import KVCacheSpec

MAX_SPLITS = 32       # kMultiMaxSplits in multi.cu
# The warpgroup kernels' splits of a row tile merge inside a thread-block cluster through
# distributed shared memory (multi_cluster.cuh) when they are 2 .. MAX_CLUSTER_SPLITS (the
# portable cluster size) and the device holds as many of the clustered CTAs at once as of
# the plain ones: the global merge's round trips cost 6.6 of 28.2 us at B=32, multi-query
# group 64, 4 splits (PERF_NOTES v24).
MAX_CLUSTER_SPLITS = 8  # kMultiMaxClusterSplits in multi_cluster.cuh
# KV tiles per split at least, and the grid the splits aim for (resident CTAs per SM x SMs x
# WAVES). Measured at S=4096, 4 drafts (PERF_NOTES m2): at B=8, 4 splits of 1024 tokens took
# 35.6 us and 13 splits of 320 tokens 46.4 us (a split's fixed cost, its Q, the pipeline's
# fill, its partial and the merge, outweighs short splits); at B=64, 2 splits 216 us and
# none 246 us (512 CTAs are 1.3 waves: the second one runs a third full).
MIN_SPLIT_TILES = 16
WAVES = 2
# The warpgroup-MMA kernels (sm_90) by the most query rows a sequence has per KV head (PERF_NOTES
# m13, m14; S=4096, drafts of Hq=32 / Hkv=8 at B=8 and 64, multi-query groups): up to 32 rows
# the split-warp mma.sync kernel (4-8 drafts: 1.24-1.43x decode's time vs 1.46-1.59x on the
# warpgroup kernels); from 33 the warp-specialized CTA of 128 rows, even half full (a
# multi-query group of 64: B=32 29.0 us vs 36.9 on 64-row CTAs, B=128 69.3 vs 76.8; 16 drafts
# at B=8 44.9 vs 48.7), except where 33-64 rows come in enough row tiles to give every SM two
# 64-row CTAs (16 drafts at B=64, 512 tiles: 239 us vs 264).
WGMMA_MIN_ROWS = 65
WG64_MIN_ROWS = 33
WG64_MIN_TILES_PER_SM = 2


@dataclass(frozen=True)
class MultiWorkload:
    """What the planner needs: per sequence its chunk (query tokens) and its KV length."""

    qo_lens: np.ndarray
    kv_lens: np.ndarray
    group_size: int
    num_kv_heads: int
    tile_tokens: int   # KV tokens per pipeline tile
    rows_per_cta: int  # query rows per CTA

    @property
    def tiles(self) -> np.ndarray:
        """Row tiles per sequence and KV head."""
        rows = self.qo_lens.astype(np.int64) * self.group_size
        return -(-rows // self.rows_per_cta)

    @property
    def max_tiles(self) -> int:
        return max(1, int(self.tiles.max()))


def choose_splits(work: MultiWorkload, sm_count: int, ctas_per_sm: int) -> tuple[int, int]:
    """(num_splits, min_split_tokens) for this workload on ``sm_count`` SMs that hold
    ``ctas_per_sm`` CTAs each. A grid below one wave of resident CTAs is split as far as it
    still fits one wave (a partial second wave costs a whole split's time: B=8, 8 drafts,
    S=4096: 3 splits, 384 CTAs, 52.8 us; 4 splits, 512 CTAs, 62.2 us); a larger grid aims at
    WAVES waves, rounded (B=64, 4 and 8 drafts, 512 CTAs in 264 slots: unsplit 193.8 / 236.8
    us, 2 splits 216.4 / 262.0; 512 in 396 slots: 2 splits, as m2 measured). Never below
    MIN_SPLIT_TILES tiles per split."""
    min_tokens = MIN_SPLIT_TILES * work.tile_tokens
    ctas = int(work.tiles.sum()) * work.num_kv_heads
    longest = int(work.kv_lens.max()) if work.kv_lens.size else 0
    slots = sm_count * max(1, ctas_per_sm)
    if ctas == 0 or longest <= min_tokens:
        return 1, min_tokens
    by_length = -(-longest // min_tokens)
    wanted = slots // ctas if ctas < slots else round(WAVES * slots / ctas)
    return max(1, min(MAX_SPLITS, wanted, by_length)), min_tokens


def choose_wg_rows(rows: int, row_tiles: int, sm_count: int) -> int | None:
    """The warpgroup kernel's CTA rows for a workload whose sequences have at most ``rows``
    query rows per KV head, in ``row_tiles`` (sequence, KV head) pairs, or None for the
    mma.sync kernel."""
    if rows >= WGMMA_MIN_ROWS:
        return 128
    if rows >= WG64_MIN_ROWS:
        return 64 if row_tiles >= WG64_MIN_TILES_PER_SM * sm_count else 128
    return None


def choose_ksplit(qo_lens: np.ndarray, group_size: int, head_dim: int) -> int:
    """Warps per row group: when every sequence's rows of a KV head (qo_len x group) fit in 32,
    the CTA's warps share each KV tile instead of idling (variants.ksplits: 2, CTAs of 32 rows,
    at head_dim 128 and 256; 4, CTAs of 16 rows, at 64); else every warp takes whole tiles."""
    rows = int(qo_lens.max()) * group_size if qo_lens.size else 0
    if rows <= 32:
        return 4 if head_dim == 64 else 2
    return 1


def cluster_merge_fits(splits: int, ctas: int, resident_ctas: int,
                       resident_clusters: int) -> bool:
    """Whether ``ctas`` CTAs in clusters of ``splits`` lose no residency: the device holds
    ``resident_clusters`` such clusters at once against ``resident_ctas`` plain CTAs."""
    if not 2 <= splits <= MAX_CLUSTER_SPLITS:
        return False
    return resident_clusters * splits >= min(ctas, resident_ctas)


def choose_cluster(cluster: bool | None, kernel: str, arch: str, hopper: bool, splits: int,
                   ctas: int, resident_ctas: int, resident_clusters: Callable[[], int]) -> bool:
    """Whether a plan's ``splits`` merge inside a cluster: only the warpgroup kernels
    (``kernel``) on sm_90 (``hopper``) at 2 .. MAX_CLUSTER_SPLITS splits can; ``cluster``
    True requires it (ValueError where it cannot), False forbids it, None takes it where
    cluster_merge_fits. ``resident_clusters()``: how many the device holds at once (asked only
    when needed)."""
    if cluster is False:
        return False
    able = kernel == "warpgroup" and hopper and 2 <= splits <= MAX_CLUSTER_SPLITS
    if cluster and not able:
        raise ValueError(f"cluster: the cluster merge needs the warpgroup kernels (sm_90) and 2 "
                         f"to {MAX_CLUSTER_SPLITS} splits, got the {kernel} kernel on {arch} "
                         f"with {splits} split(s)")
    if not able:
        return False
    resident = resident_clusters()
    if cluster:
        if resident < 1:
            raise ValueError(f"cluster: the device holds no cluster of {splits} CTAs of this "
                             f"kernel")
        return True
    return cluster_merge_fits(splits, ctas, resident_ctas, resident)


def choose_merge(combine: bool | None, clustered: bool, splits: int) -> str | None:
    """How a plan's ``splits`` merge: None with one split (nothing to merge); "cluster" where
    choose_cluster clustered them; else "kernel", multi_combine as a second launch (every
    row's quads merged by their own threads across the GPU, PERF_NOTES v26), unless
    ``combine`` is False: "last split", the last split of each row tile to finish merges them
    all after a fence and an atomic (merge_if_last)."""
    if splits <= 1:
        return None
    if clustered:
        return "cluster"
    return "last split" if combine is False else "kernel"


# Decode rows with q in int8 (multi_q8.cu, where the plan allows it): from a group of this many
# query heads per KV head up to one row tile of 64 (a larger group would stream its KV once per
# 64 rows). Below, the split-warp mma.sync kernel's CTAs of 32 rows waste less.
INT8_Q_MIN_ROWS = 16
INT8_Q_MAX_ROWS = 64
# Where the planner takes it unasked (H200, multi-query groups 32 and 64, PERF_NOTES v42): an
# unsplit launch of at least INT8_Q_MIN_TILES tiles per CTA over nearly every SM (B=128,
# S=1024: 18.9 us against the decode kernel's 24.4, 20.7 against the warpgroup kernel's 21.5;
# B=64 on 132 SMs, S=1024: slower than the decode kernel's 12.6), or splits of at least
# INT8_Q_MIN_SPLIT_TILES (B=32 S=16384, 4 splits of 64 tiles: 58.6 against 69.0; B=16 S=32768,
# 57.7 against 68.4). Shorter splits pay their fixed chain and the merge kernel while the
# warpgroup kernel merges in a cluster (B=32 S=4096, 4 x 16 tiles: 27.5 against 24.4; B=8
# S=32768, 16 x 32: 39.4 against 39.4).
INT8_Q_MIN_TILES = 16
INT8_Q_MIN_SPLIT_TILES = 48


def int8_q_unable(arch: str, spec: KVCacheSpec, decode_rows: bool, tree: bool,
                  ksplit: int | None, wgmma: bool | None, wg_rows: int | None) -> str | None:
    """Why the int8-q kernel cannot serve a plan with these options (None: it can)."""
    if arch not in ("sm_90", "sm_90a"):
        return f"needs an sm_90 device, got {arch}"
    if (spec.head_dim, spec.scale_mode, spec.paged) != (128, "token", False):
        return (f"takes head_dim 128, per-token scales and a contiguous cache, got head_dim "
                f"{spec.head_dim}, scale_mode {spec.scale_mode!r}, page_size {spec.page_size}")
    if not decode_rows:
        return "takes decode rows only (qo_indptr=None)"
    if tree or ksplit not in (None, 1) or wgmma or wg_rows is not None:
        return (f"excludes tree masks, ksplit > 1 and the warpgroup kernels' options, got "
                f"tree={tree}, ksplit={ksplit}, wgmma={wgmma}, wg_rows={wg_rows}")
    return None


def int8_q_pays(qo_lens: np.ndarray, kv_lens: np.ndarray, group_size: int,
                num_kv_heads: int, sm_count: int) -> bool:
    """Whether the int8-q kernel (one CTA per SM, 64-row tiles, 64-token KV tiles) is the
    faster choice for this workload as it would be split (INT8_Q_MIN_TILES,
    INT8_Q_MIN_SPLIT_TILES)."""
    work = MultiWorkload(qo_lens, kv_lens, group_size, num_kv_heads, 64, INT8_Q_MAX_ROWS)
    splits, _ = choose_splits(work, sm_count, 1)
    tiles = -(-int(kv_lens.max()) // 64) if kv_lens.size else 0
    if splits > 1:
        return -(-tiles // splits) >= INT8_Q_MIN_SPLIT_TILES
    ctas = int(work.tiles.sum()) * num_kv_heads
    return tiles >= INT8_Q_MIN_TILES and 8 * ctas >= 7 * sm_count


def int8_q_decode_pays(spec: KVCacheSpec, group_size: int, lengths: np.ndarray, arch: str,
                       sm_count: int) -> bool:
    """Whether decode rows of these host ``lengths`` would run the int8-q kernel unasked in a
    plan that allows it (DecodePlan's route takes it where rule 8 would not)."""
    return (int8_q_unable(arch, spec, True, False, None, None, None) is None
            and INT8_Q_MIN_ROWS <= group_size <= INT8_Q_MAX_ROWS
            and int8_q_pays(np.ones(lengths.size, np.int64), lengths, group_size,
                            spec.num_kv_heads, sm_count))


def choose_int8_q(int8_q: bool | None, allowed: bool, unable: str | None, rows: int,
                  pays: Callable[[], bool] = lambda: True) -> bool:
    """Whether a plan runs the int8-q kernel: ``int8_q`` True requires it (ValueError where the
    plan does not allow q in int8 or ``unable`` says why the kernel cannot serve it), False
    forbids it, None takes it where allowed and able for ``rows`` query rows per sequence and
    KV head in INT8_Q_MIN_ROWS .. INT8_Q_MAX_ROWS, where it ``pays`` (int8_q_pays)."""
    if int8_q is False:
        return False
    if int8_q:
        if not allowed:
            raise ValueError("int8_q: the plan was made with allow_int8_q=False; pass "
                             "allow_int8_q=True to the constructor")
        if unable:
            raise ValueError(f"int8_q: the int8-q kernel {unable}")
        return True
    return (allowed and unable is None and INT8_Q_MIN_ROWS <= rows <= INT8_Q_MAX_ROWS
            and pays())
