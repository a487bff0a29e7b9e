"""Host-side scheduling of the decode kernel: how many splits, how many tokens each, which tile.

The heuristic (measured on an H100, tools/PERF_NOTES.md and tools/tune.py):
1. One CTA serves one (sequence, kv head) pair and a contiguous range of its tokens; 8 warps
   per CTA, two 16-token tiles in flight per warp.
2. Few pairs (at most half the SMs): split each sequence so that the pairs x splits CTAs
   cover the SMs, in powers of two. More CTAs than that cost more in merging than they gain.
3. Many pairs: split into ~1024-token ranges (powers of two) at the H100's memory bandwidth,
   longer in proportion on faster memory (``split_tokens``: a split's fixed cost is fixed in
   time while its stream shortens; H200, PERF_NOTES v36). Longer ranges leave a long tail of
   the last wave; shorter ones spend more on the merge. Where such a longer split leaves a
   last wave of fewer CTAs than SMs (they stream alone, at one CTA's rate), the splits double
   if that fills the waves better and each stays at least SPLIT_TOKENS long (so the H100's
   choices are unchanged).
   On faster memory (H200, PERF_NOTES v37) head_dims 64 and 256 aim for twice the tokens
   (``SPLIT_TOKEN_SCALE``: 64 has half the bytes per token, 256 one CTA per SM).
   Few pairs on faster memory: one CTA per SM merged in clusters where those spread one CTA
   per SM (CLUSTER_GRID_SHARE; twice the splits where that leaves a quarter of the SMs idle
   and two CTAs per SM fit); otherwise the global merge once each split holds
   FULL_GRID_TOKENS tokens (half the SMs cannot draw the bandwidth), else half as many splits
   merged in a cluster (short splits: the merge's latency is the time). Clusters of 4 or 8
   over 128 CTAs measured 1.2-1.5x slower than the global merge at the same count (B=4
   S=16384 4 splits 52.7 us vs 38.4).
4. Never more than MAX_PORTABLE_SPLITS splits when they merge in a cluster (a portable
   thread-block cluster on sm_90: 10- to 16-CTA clusters measured slower), MAX_GLOBAL_SPLITS
   when they merge through global memory (B=1 Hkv=1 S=32768: 8 splits 38.9 us, 32 18.6, 64
   18.4, 128 24.8; past 8, splits of at least two tiles per warp: S=4096 16 splits 10.9 us,
   32 11.8), never a split shorter than ``min_split_tokens`` (every warp needs whole
   16-token tiles), and one split when the sequence is too short.
5. Each sequence's split length is recomputed on the device from its live length and the
   planned split count, so ragged and growing lengths stay balanced without re-planning.
6. The splits merge inside a thread-block cluster through distributed shared memory on sm_90
   (groups of at most 8 heads), and the kernel uses programmatic dependent launch; otherwise
   the last CTA to finish merges through global memory.
7. Two 16-token tiles per warp step (sm_90, head_dim 128) when the CTAs are few (at most half
   the SMs, one CTA each) and every split is long (>= 1024 tokens): 9-11% faster at B=1 for
   S >= 32768, 2-4% at S = 8192 and 16384; slower with 512-token splits or 128 CTAs
   (PERF_NOTES.md v9, v12).
8. Groups of 16 heads or more on sm_90 (head_dim 64 or 128) run on the multi-token kernels
   (MultiPlan's decode rows) where the KV is large enough (``routes_to_multi``): decode serves
   such a group in ceil(group / 16) CTAs that each stream the KV head, the multi-token
   kernels share each KV tile among all the group's heads (PERF_NOTES.md v23).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core import support
from ..core import validate as check

MAX_SPLITS = 128
MAX_CLUSTER = 16  # the non-portable cluster size limit of sm_90
MAX_PORTABLE_SPLITS = 8  # what the planner picks at most for a cluster merge
# CTAs of more query heads merge through global memory: their cluster slots are 2x larger and
# measured slower or not co-resident (B=32 S=4096 Hkv=1: 4 splits 31.6 us vs 22.0).
CLUSTER_MAX_CTA_HEADS = 8
MAX_GLOBAL_SPLITS = 64  # ... and for a merge through global memory
SPLIT_TOKENS = 1024  # the split length the planner aims for when pairs fill the GPU (rule 3) ...
REFERENCE_BANDWIDTH = 3.4e12  # ... at up to this peak DRAM bandwidth (H100 SXM: 3.35 TB/s)
MAX_SPLIT_TOKENS = 4096  # ... and at most this long on faster memory
DEFAULT_CTAS_PER_SM = 2  # the 8-warp head_dim-64/128 variants' occupancy (rule 3's wave guard)
CTAS_PER_SM_BY_HEAD_DIM = {256: 1}  # ... and where it differs (H200 sweep, PERF_NOTES v37)
# Faster memory than REFERENCE_BANDWIDTH only (H200, PERF_NOTES v37; the H100 keeps the rules
# it was measured with): rule 3's split length per head_dim, and rule 2's one-CTA-per-SM grid.
SPLIT_TOKEN_SCALE = {64: 2, 256: 2}
FULL_GRID_TOKENS = 512
# Clusters of 4-8 CTAs spread one per SM up to about this share of the SMs (96 CTAs in clusters
# of 4 as fast as the global merge; 128 in clusters of 4 or 8 1.3-1.5x slower: the GPCs' SM
# counts leave some clusters doubled up on SMs).
CLUSTER_GRID_SHARE = 0.75
TWO_TILE_SPLIT_TOKENS = 1024  # the shortest split that takes two tiles per warp step (rule 7)
TWO_TILE_HEAD_DIMS = (128,)  # where rule 7 was measured
DEFAULT_WARPS = 8  # rule 1; every warp default (TileConfig, variants, the demo) derives from it
# Rule 8, by decode's CTAs per KV head (head chunks of 16): the least KV bytes per launch (int8
# K and V, all sequences and KV heads) and (sequence, KV head) pairs from which the multi-token
# kernel wins. H100, S = 1024-16384, B = 1-128 (PERF_NOTES.md v23): with 3 or more chunks it
# wins from 16 MiB (B=64 S=1024 group 48: 20.1 vs 22.4 us; 8 MiB loses: group 64 B=32 S=1024
# 19.3 vs 12.2); with 2 from 64 MiB over >= 32 pairs (B=32 Hkv=2 group 32: 39.1 vs 58.7 us;
# B=16 S=16384 group 32 loses, 42.3 vs 39.9); with 1 (group 16) from 64 MiB over >= 96 pairs
# (B=128 S=4096: 59.2 vs 71.4; B=32 S=16384 loses, 59.2 vs 57.2).
MULTI_ROUTE = {1: (64 << 20, 96), 2: (64 << 20, 32), 3: (16 << 20, 1)}
MULTI_ROUTE_MIN_GROUP = 16
MULTI_ROUTE_HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class TileConfig:
    """The tunables of one launch; ``tools/tune.py`` sweeps them."""

    num_warps: int = DEFAULT_WARPS
    num_splits: int = 1
    min_split_tokens: int = 64
    fused_merge: bool = True
    stages: int = 0  # tiles in flight per warp; 0 picks the head_dim's default
    cluster: bool = False  # merge the splits inside a thread-block cluster (sm_90, <= 16)
    programmatic: bool = True  # programmatic dependent launch (sm_90; ignored before)
    tiles: int = 1  # 16-token tiles per step of a warp (1 or 2)
    cta_heads: int = 0  # query heads per CTA (1, 2, 4, 8, 16); 0: the group's (variants.py)


@dataclass(frozen=True)
class Workload:
    batch: int
    num_kv_heads: int
    max_len: int
    sm_count: int
    ctas_per_sm: int
    group_size: int = 4
    head_dim: int = 128
    memory_bandwidth: float = 0.0  # peak DRAM bytes/s (DeviceInfo); 0: unknown (H100's rule)


def routes_to_multi(group_size: int, head_dim: int, chunks: int, kv_bytes: int, pairs: int,
                    hopper: bool) -> bool:
    """Rule 8: whether a decode launch of ``kv_bytes`` int8 K and V over ``pairs`` (sequence,
    KV head) pairs, whose group decode serves in ``chunks`` CTAs, runs on the multi-token
    kernel."""
    if not hopper or group_size < MULTI_ROUTE_MIN_GROUP or head_dim not in MULTI_ROUTE_HEAD_DIMS:
        return False
    least_bytes, least_pairs = MULTI_ROUTE[min(chunks, 3)]
    return kv_bytes >= least_bytes and pairs >= least_pairs


def default_min_split_tokens(num_warps: int) -> int:
    """One 16-token tile per warp: splits shorter than that leave warps idle."""
    return 16 * num_warps


def _power_of_two_at_most(value: int) -> int:
    return 1 << max(0, int(value).bit_length() - 1)


def fast_memory(memory_bandwidth: float) -> bool:
    """Whether the rules measured on the H200 apply (more bandwidth than the H100's)."""
    return float(memory_bandwidth) > REFERENCE_BANDWIDTH


def split_tokens(memory_bandwidth: float, head_dim: int = 128) -> int:
    """Rule 3's split length on a device with this peak DRAM bandwidth (bytes/s)."""
    scale = max(1.0, float(memory_bandwidth) / REFERENCE_BANDWIDTH)
    tokens = min(MAX_SPLIT_TOKENS, int(SPLIT_TOKENS * scale))
    return tokens * (SPLIT_TOKEN_SCALE.get(head_dim, 1) if fast_memory(memory_bandwidth) else 1)


def _ctas_per_sm(work: Workload) -> int:
    return work.ctas_per_sm or CTAS_PER_SM_BY_HEAD_DIM.get(work.head_dim, DEFAULT_CTAS_PER_SM)


def _few_pairs_splits(work: Workload, pairs: int, merge_in_cluster: bool) -> tuple[int, bool]:
    """Rule 2 on faster memory: (splits, cluster merge) before the length caps."""
    full = _power_of_two_at_most(work.sm_count // pairs)  # at most one CTA per SM
    spread = full * pairs <= CLUSTER_GRID_SHARE * work.sm_count
    if full <= 2 or (full <= MAX_PORTABLE_SPLITS and spread):
        # The clusters spread one CTA per SM. Where they leave a quarter of the SMs idle, twice
        # the splits (two CTAs on most SMs) while they stay long: B=6 S=24000 ragged 4
        # splits 57.3 us, 2 84.5; B=3 S=12000 8 splits 24.7, 4 24.9.
        if spread and 2 * full <= MAX_PORTABLE_SPLITS and \
                2 * full * pairs <= work.sm_count * _ctas_per_sm(work) and \
                work.max_len // (2 * full) >= FULL_GRID_TOKENS:
            return 2 * full, merge_in_cluster
        return full, merge_in_cluster
    split = work.max_len // full
    if split >= FULL_GRID_TOKENS:
        return min(full, MAX_GLOBAL_SPLITS), False
    return min(full // 2, MAX_PORTABLE_SPLITS), merge_in_cluster


def _wave_fill(ctas: int, slots: int) -> float:
    """The share of the resident-CTA slots of all waves that ``ctas`` CTAs use."""
    return ctas / (-(-ctas // slots) * slots)


def _short_last_wave(ctas: int, slots: int, sm_count: int) -> bool:
    """More than one wave, and the last one has fewer CTAs than SMs: those stream alone at one
    CTA's rate (H200, Hkv 8, S=4096: B=20 2 splits 60.6 us, 4 splits 51.9; B=24 62.9, 59.5)."""
    return ctas > slots and 0 < ctas % slots < sm_count


def choose(work: Workload, *, num_warps: int | None = None, min_split_tokens: int | None = None,
           fused_merge: bool = True, stages: int = 0, clusters: bool = False) -> TileConfig:
    """The split count and tile settings for a workload (see the module docstring). With
    ``clusters`` (sm_90) the splits merge through distributed shared memory."""
    pairs = work.batch * work.num_kv_heads
    num_warps = num_warps or DEFAULT_WARPS
    min_tokens = min_split_tokens or default_min_split_tokens(num_warps)
    merge_in_cluster = clusters and work.group_size <= CLUSTER_MAX_CTA_HEADS
    few_pairs = 2 * pairs <= work.sm_count
    if few_pairs and fast_memory(work.memory_bandwidth):
        wanted, merge_in_cluster = _few_pairs_splits(work, pairs, merge_in_cluster)
    elif few_pairs:
        wanted = _power_of_two_at_most(work.sm_count // pairs)
    else:
        wanted = _power_of_two_at_most(
            max(1, work.max_len // split_tokens(work.memory_bandwidth, work.head_dim)))
    by_length = max(1, work.max_len // min_tokens)
    cap = MAX_GLOBAL_SPLITS if few_pairs and not merge_in_cluster else MAX_PORTABLE_SPLITS
    splits = max(1, min(wanted, by_length, cap))
    slots = work.sm_count * _ctas_per_sm(work)
    if (not few_pairs and 2 * splits <= min(by_length, cap) and
            work.max_len // (2 * splits) >= SPLIT_TOKENS and
            _short_last_wave(pairs * splits, slots, work.sm_count) and
            _wave_fill(2 * pairs * splits, slots) > _wave_fill(pairs * splits, slots)):
        splits *= 2
    if splits > MAX_PORTABLE_SPLITS:  # the extra global splits need two tiles per warp each
        splits = max(MAX_PORTABLE_SPLITS,
                     min(splits, _power_of_two_at_most(max(1, work.max_len // (2 * min_tokens)))))
    cluster = merge_in_cluster and splits > 1
    # Rule 7: one CTA per SM on at most half the SMs, each split >= TWO_TILE_SPLIT_TOKENS.
    tiles = 2 if (cluster and work.head_dim in TWO_TILE_HEAD_DIMS and
                  2 * pairs * splits <= work.sm_count and
                  work.max_len // splits >= TWO_TILE_SPLIT_TOKENS) else 1
    if min_split_tokens is None:
        min_tokens *= tiles
    return TileConfig(num_warps=num_warps, num_splits=splits, min_split_tokens=min_tokens,
                      fused_merge=fused_merge, stages=stages, cluster=cluster,
                      programmatic=clusters, tiles=tiles)


def workspace_pairs_bound(max_batch: int, num_kv_heads: int, sm_count: int) -> int:
    """An upper bound on ``B * Hkv * splits`` over every plan ``choose`` can make: the size of
    the global split-merge workspace that serves all of them. Past MAX_PORTABLE_SPLITS only
    with few pairs, where pairs x splits stays within the SM count."""
    return max(max_batch * num_kv_heads * MAX_PORTABLE_SPLITS, sm_count)


def check_config(config: Any) -> TileConfig:
    """A caller's TileConfig, checked before anything is compiled for it. Whether the device
    can run a cluster is checked where the device is known."""
    if not isinstance(config, TileConfig):
        raise TypeError(f"config: expected a TileConfig, got {type(config).__name__}")
    for field in ("num_warps", "num_splits", "min_split_tokens", "stages", "tiles"):
        check.integer(f"config.{field}", getattr(config, field))
    for field in ("fused_merge", "cluster", "programmatic"):
        check.flag(f"config.{field}", getattr(config, field))
    check.choice("config.num_warps", int(config.num_warps), support.WARP_COUNTS)
    check.choice("config.tiles", int(config.tiles), (1, 2))
    check.integer("config.cta_heads", config.cta_heads)
    check.choice("config.cta_heads", int(config.cta_heads), (0, 1, 2, 4, 8, 16))
    if config.stages < 0 or config.stages == 1:  # decode.cu static_asserts STAGES >= 2
        raise ValueError(f"config.stages: expected 0 (the head_dim's default) or at least 2, "
                         f"got {config.stages}")
    if not 1 <= config.num_splits <= MAX_SPLITS:
        raise ValueError(f"config.num_splits: expected 1..{MAX_SPLITS}, got {config.num_splits}")
    if config.min_split_tokens < 16 or config.min_split_tokens % 16:
        raise ValueError(f"config.min_split_tokens: expected a positive multiple of 16, "
                         f"got {config.min_split_tokens}")
    if config.cluster and config.num_splits > MAX_CLUSTER:
        raise ValueError(f"config.cluster: a cluster holds 1..{MAX_CLUSTER} splits, got "
                         f"{config.num_splits}")
    return config
