"""Host-side scheduling of the decode kernel: how many splits, how many tokens each, which tile.

The heuristic, in order:
1. One CTA serves one (sequence, kv head) pair and a contiguous range of its tokens. With
   ``B * Hkv`` pairs, a wave of the GPU holds ``sm_count * ctas_per_sm`` CTAs.
2. If the pairs alone give every SM a CTA, every sequence gets one split: splitting adds a
   merge and partial traffic and buys no parallelism.
3. Otherwise split the longest sequence so that there is about one CTA per SM (a power of two),
   but never give a split fewer than ``min_split_tokens`` tokens (each warp needs whole 16-token
   tiles to stream) and never exceed MAX_SPLITS.
4. Each sequence's split length is recomputed on the device from its live length and the
   planned split count, so ragged and growing lengths stay balanced without re-planning.
5. The splits merge inside a thread-block cluster through distributed shared memory on sm_90
   (at most 16 splits); before sm_90, in the last CTA to finish (one launch), unless told
   otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

MAX_SPLITS = 128
MAX_CLUSTER = 16  # the non-portable cluster size limit of sm_90


@dataclass(frozen=True)
class TileConfig:
    """The tunables of one launch; ``tools/tune.py`` sweeps them."""

    num_warps: int = 4
    num_splits: int = 1
    min_split_tokens: int = 64
    fused_merge: bool = True
    stages: int = 0  # tiles in flight per warp; 0 picks the head_dim's default
    cluster: bool = False  # merge the splits inside a thread-block cluster (sm_90, <= 16)
    programmatic: bool = True  # programmatic dependent launch (sm_90; ignored before)


@dataclass(frozen=True)
class Workload:
    batch: int
    num_kv_heads: int
    max_len: int
    sm_count: int
    ctas_per_sm: int


def default_min_split_tokens(num_warps: int) -> int:
    """One 16-token tile per warp: splits shorter than that leave warps idle."""
    return 16 * num_warps


def choose(work: Workload, *, num_warps: int = 8, min_split_tokens: int | None = None,
           fused_merge: bool = True, stages: int = 0, clusters: bool = False) -> TileConfig:
    """The split count and tile settings for a workload (see the module docstring). With
    ``clusters`` (sm_90), at most MAX_CLUSTER splits merge through distributed shared memory,
    which saves the global round trips of the last-CTA merge."""
    min_tokens = min_split_tokens or default_min_split_tokens(num_warps)
    pairs = work.batch * work.num_kv_heads
    splits = 1
    if pairs < work.sm_count and work.max_len > min_tokens:
        # About one CTA per SM, in powers of two (measured: more splits cost more in merging
        # than they gain in parallelism, tools/PERF_NOTES.md).
        wanted = 1 << max(0, (work.sm_count // pairs).bit_length() - 1)
        by_length = -(-work.max_len // min_tokens)
        splits = max(1, min(wanted, by_length, MAX_SPLITS))
    cluster = clusters and splits > 1
    if cluster:
        splits = min(splits, MAX_CLUSTER)
    return TileConfig(num_warps=num_warps, num_splits=splits, min_split_tokens=min_tokens,
                      fused_merge=fused_merge, stages=stages, cluster=cluster,
                      programmatic=clusters)


def workspace_pairs_bound(max_batch: int, num_kv_heads: int, sm_count: int,
                          ctas_per_sm_max: int = 8) -> int:
    """An upper bound on ``B * Hkv * splits`` over every plan ``choose`` can make with
    splits > 1, so the workspace can be sized once: splitting only happens below one wave."""
    wave = sm_count * ctas_per_sm_max
    return min(max_batch * num_kv_heads * MAX_SPLITS, 2 * wave + max_batch * num_kv_heads)


def lengths_summary(seq_lens: np.ndarray) -> tuple[int, int]:
    """(batch, longest) of a host array of lengths."""
    return int(seq_lens.shape[0]), int(seq_lens.max(initial=0))


def with_overrides(config: TileConfig, **overrides: object) -> TileConfig:
    return replace(config, **{k: v for k, v in overrides.items() if v is not None})
