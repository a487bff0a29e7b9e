"""The compiled programs of the decode family: a variant of the split kernel (decode.cu), the
separate merge (decode_combine.cu) and the length bump (lengths.cu), each its own program, so
every distinct kernel is compiled once."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Union

from ..compiler import CompiledProgram, CompileOptions, compile_cached
from ..core import support
from ..core.spec import KVCacheSpec
from .planner import (CLUSTER_MAX_CTA_HEADS, DEFAULT_WARPS, MAX_SPLITS, TWO_TILE_HEAD_DIMS,
                      TileConfig)


# Query heads per CTA the kernels are built for (the template GROUP): one or two head blocks of
# 8 (the mma's N), and the powers of two below 8 that keep the merges small.
CTA_HEADS = (1, 2, 4, 8, 16)


def head_chunks(group_size: int, cta_heads: int = 0) -> tuple[int, int, int]:
    """How a query group is served: (the kernel's heads per CTA, CTAs per KV head, live heads
    per CTA). By default (``cta_heads`` 0) a group of up to 16 runs in one CTA of the next
    power of two, the heads past it masked; a larger group in ceil(group / 16) CTAs of 16 that
    share it evenly, each streaming its KV head (the ones after the first mostly from L2: they
    run side by side). ``cta_heads`` (one of CTA_HEADS) asks for CTAs of that many heads."""
    if not cta_heads:
        cta_heads = next((n for n in CTA_HEADS if n >= group_size), CTA_HEADS[-1])
    chunks = -(-group_size // cta_heads)
    return cta_heads, chunks, -(-group_size // chunks)


def is_masked(cta_heads: int, chunks: int, chunk_heads: int) -> bool:
    """Whether CTAs of ``cta_heads`` serve the group other than one to one: the MASKED kernels
    read the group from run-time fields; exact ones know it at compile time (~2% faster at B=1,
    PERF_NOTES v15)."""
    return chunks > 1 or chunk_heads != cta_heads


# The kernels the planner picks for a group that is not a power of two up to 16: heads masked
# in CTAs of 4, 8 or 16, or chunks of 16. (1 and 2 are never masked by the planner; a
# TileConfig.cta_heads that needs them compiles on demand.)
MASKED_CTA_HEADS = (4, 8, 16)


def default_stages(head_dim: int) -> int:
    """Tiles in flight per warp. Two (one loading while one is consumed) measured best at
    head_dim 128: deeper pipelines cost occupancy and did not stream faster (PERF_NOTES.md)."""
    return {64: 3, 128: 2, 256: 2}[head_dim]


@dataclass(frozen=True)
class DecodeVariant:
    """One instantiation of decode_split."""

    head_dim: int
    cta_heads: int  # query heads one CTA serves (CTA_HEADS): the template GROUP
    dtype: str = "float16"
    scale_mode: str = "token"
    scale_dtype: str = "float32"  # of per-token scales; per-tensor/per-head are always fp32
    num_warps: int = DEFAULT_WARPS
    stages: int = 0  # 0: default_stages(head_dim)
    cluster: bool = False  # splits merge through a thread-block cluster (sm_90+)
    tiles: int = 1  # 16-token tiles per step of a warp (1 or 2)
    append: bool = False  # the fused append of DecodePlan.append_and_run
    masked: bool = False  # a group other than cta_heads (masked heads or chunks): is_masked()
    paged: bool = False  # the cache lives in pages of a block table (cu/cache_pages.cuh)

    def __post_init__(self) -> None:
        if not self.stages:
            object.__setattr__(self, "stages", default_stages(self.head_dim))

    @classmethod
    def planned(cls, spec: KVCacheSpec, group_size: int, dtype: str, config: TileConfig, *,
                append: bool = False) -> "DecodeVariant":
        """The variant that a plan for this query group with this TileConfig launches."""
        cta_heads, chunks, chunk_heads = head_chunks(group_size, config.cta_heads)
        return cls(spec.head_dim, cta_heads, dtype, spec.scale_mode, spec.scale_dtype,
                   config.num_warps, config.stages, config.cluster, config.tiles, append,
                   is_masked(cta_heads, chunks, chunk_heads), spec.paged)

    @property
    def stage_bytes(self) -> int:
        """One 16-token tile of K and V plus 16 K and 16 V scales (cu/decode_pipeline.cuh;
        paged stages hold every scale as a 4-byte word)."""
        fp16 = self.scale_mode == "token" and self.scale_dtype == "float16"
        scale_size = 2 if fp16 and not self.paged else 4
        return self.tiles * (32 * self.head_dim + 32 * scale_size)

    @property
    def split_kernel(self) -> str:
        return (f"llfd::decode_split<{self.head_dim}, {self.cta_heads}, {self.num_warps}, "
                f"{support.SCALE_MODE_IDS[self.scale_mode]}, {support.CXX_DTYPES[self.dtype]}, "
                f"{support.scale_storage(self.scale_mode, self.scale_dtype)}, {self.stages}, "
                f"{support.cxx_bool(self.cluster)}, {self.tiles}, "
                f"{support.cxx_bool(self.append)}, {support.cxx_bool(self.masked)}, "
                f"{support.cxx_bool(self.paged)}>")

    @property
    def kernel_names(self) -> tuple[str, ...]:
        return (self.split_kernel,)

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def _head_blocks(self) -> int:
        return 2 if self.cta_heads > 8 else 1

    @property
    def dynamic_shared_bytes(self) -> int:
        """The warps' pipelines, later reused for their accumulators: every lane's float4 per
        (head block, m-block) (cu/decode_merge.cuh Quads::kPerWarp), or for the global merge's
        weights ((MAX_SPLITS + 2) x GROUP floats)."""
        pipelines = self.num_warps * self.stages * self.stage_bytes
        quads = self.num_warps * self._head_blocks * (self.head_dim // 16) * 32 * 16
        return max(pipelines, quads, (MAX_SPLITS + 2) * self.cta_heads * 4)

    def cluster_slots_bytes(self, num_splits: int) -> int:
        """The cluster merge's slots after the dynamic shared memory above (16-byte aligned):
        per split, the accumulator quads whose heads exist and GROUP LSEs padded to 4 (fp32)
        (Quads::kSlotFloats)."""
        pairs = 4 if self.cta_heads >= 8 else (self.cta_heads + 1) // 2
        compact = self._head_blocks * (self.head_dim // 16) * 8 * pairs
        return num_splits * (4 * compact + -(-self.cta_heads // 4) * 4) * 4

    def launch_shared_bytes(self, num_splits: int) -> tuple[int, int]:
        """(dynamic shared memory of a launch, offset of the cluster slots in it)."""
        if not self.cluster:
            return self.dynamic_shared_bytes, 0
        offset = -(-self.dynamic_shared_bytes // 16) * 16
        return offset + self.cluster_slots_bytes(num_splits), offset

    source = "decode.cu"

    def compile(self, arch: str) -> CompiledProgram:
        return compile_cached(self.source, CompileOptions(arch=arch), self.kernel_names)


@dataclass(frozen=True)
class CombineVariant:
    """decode_combine for one (head_dim, heads per CTA, dtype): the merge when fused_merge is
    off."""

    head_dim: int
    cta_heads: int
    dtype: str = "float16"
    masked: bool = False

    threads = 128

    @property
    def shared_bytes(self) -> int:
        """The merge weights: (MAX_SPLITS + 2) x GROUP floats."""
        return (MAX_SPLITS + 2) * self.cta_heads * 4

    @property
    def kernel_names(self) -> tuple[str, ...]:
        return (f"llfd::decode_combine<{self.head_dim}, {self.cta_heads}, "
                f"{support.CXX_DTYPES[self.dtype]}, {support.cxx_bool(self.masked)}>",)

    source = "decode_combine.cu"

    def compile(self, arch: str) -> CompiledProgram:
        return compile_cached(self.source, CompileOptions(arch=arch), self.kernel_names)


@dataclass(frozen=True)
class LengthsProgram:
    """advance_lengths: seq_lens[b] += 1 where a fused append wrote (one kernel for all)."""

    threads = 256
    kernel_names = ("llfd::advance_lengths",)
    source = "lengths.cu"

    def compile(self, arch: str) -> CompiledProgram:
        return compile_cached(self.source, CompileOptions(arch=arch), self.kernel_names)


LENGTHS = LengthsProgram()
Program = Union[DecodeVariant, CombineVariant, LengthsProgram]


def shipped_variants(num_warps: tuple[int, ...] = (DEFAULT_WARPS,)) -> Iterator[Program]:
    """Every program the planner can pick (the CI compiles all of them): ``num_warps`` warps,
    one tile per step, with a global merge and (up to CLUSTER_MAX_CTA_HEADS heads per CTA) a
    cluster merge; and the two-tile cluster variants of planner rule 7 (head_dim 128); each
    also with the fused append, each exact and (MASKED_CTA_HEADS) masked, each over a
    contiguous and a paged cache; the merges and the length bump. Variants only a caller's
    TileConfig asks for (other two-tile ones, clusters of 16-head CTAs) compile on demand."""
    for dim, heads, dtype in itertools.product(support.HEAD_DIMS, CTA_HEADS, support.DTYPES):
        clusters = (False, True) if heads <= CLUSTER_MAX_CTA_HEADS else (False,)
        two_tiles = dim in TWO_TILE_HEAD_DIMS and heads <= CLUSTER_MAX_CTA_HEADS
        for masked in (False, True) if heads in MASKED_CTA_HEADS else (False,):
            for mode in support.SCALE_MODES:
                for scale_dtype in support.SCALE_DTYPES[mode]:
                    for warps, append, paged in itertools.product(num_warps, (False, True),
                                                                  (False, True)):
                        common = dict(num_warps=warps, append=append, masked=masked,
                                      paged=paged)
                        for cluster in clusters:
                            yield DecodeVariant(dim, heads, dtype, mode, scale_dtype,
                                                cluster=cluster, **common)
                        if two_tiles:
                            yield DecodeVariant(dim, heads, dtype, mode, scale_dtype,
                                                cluster=True, tiles=2, **common)
            yield CombineVariant(dim, heads, dtype, masked)
    yield LENGTHS
