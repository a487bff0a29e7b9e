"""The compiled programs of the multi-token family, one per (head_dim, dtype, scale mode, scale
dtype, storage) and kernel: multi_attend (multi.cu, mma.sync, every arch, KSPLIT 1 or split
warps) and, on Hopper's warpgroup MMA (sm_90 only, head_dim 64 and 128, whole tiles per
warpgroup), multi_attend_wg (multi_wg.cu, CTAs of 128 query rows) and multi_attend_wg64
(multi_wg64.cu, CTAs of 64 rows, two per SM), and for decode rows with q in int8
multi_attend_q8 (multi_q8.cu: head_dim 128, contiguous, per-token scales; CTAs of 64 rows); and
the separate split merge, multi_combine (multi_combine.cu), one per (head_dim, rows per CTA,
tokens per tile, dtype) of those."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Sequence

from ..compiler import CompiledProgram, CompileOptions, compile_cached
from ..core import support
from ..core.spec import KVCacheSpec

THREADS = 128       # four warps
STAGES = 3          # kMultiStages in multi.cu
WG_ROWS = (128, 64)  # the warpgroup kernels' query rows per CTA (multi_wg.cu, multi_wg64.cu)
WG_HEAD_DIMS = (64, 128)
WG_ARCHS = ("sm_90", "sm_90a")  # wgmma: Hopper only (compiled for sm_90a)
WG_SCALE_ROW = 20  # floats per lane's row of scales in a widened tile (WgLayout::kScaleRow)
# multi_q8.cu (Q8Layout): 4 int8 stages of 16 KB, 4 widened V copies of 17 KB, 1 KB to align.
Q8_SHARED_BYTES = 4 * 16384 + 4 * 17408 + 1024


def tile_tokens(head_dim: int, ksplit: int = 1, wgmma: bool = False) -> int:
    """KV tokens per pipeline tile (multi.cu kTileRows): 32 where 64 tokens' score
    accumulators would not fit in registers (head_dim 256; 128 with the whole tile per warp);
    64 in multi_wg.cu (the score mma's N)."""
    if wgmma:
        return 64
    return 32 if head_dim == 256 or (head_dim == 128 and ksplit == 1) else 64


def wgmma_available(arch: str, head_dim: int) -> bool:
    """Whether multi_wg.cu serves this device and head_dim."""
    return arch in WG_ARCHS and head_dim in WG_HEAD_DIMS


def ksplits(head_dim: int) -> tuple[int, ...]:
    """The KSPLIT values shipped: 1 (every warp its own rows) and one split-warp layout: 2 at
    head_dim 256 (32-token tiles: a warp's share is 16 tokens) and 128 (CTAs of 32 rows, each
    warp half of a 64-token tile: measured faster than 4 warps on 16 rows, PERF_NOTES m10),
    4 at head_dim 64."""
    return (1, 4) if head_dim == 64 else (1, 2)


@dataclass(frozen=True)
class MultiVariant:
    """One instantiation of multi_attend."""

    head_dim: int
    dtype: str = "float16"
    scale_mode: str = "token"
    scale_dtype: str = "float32"  # of per-token scales; per-tensor/per-head are always fp32
    paged: bool = False
    ksplit: int = 1  # warps per 16 query rows, sharing each KV tile (multi.cu KSPLIT)
    wgmma: bool = False  # a warpgroup-MMA kernel (ksplit 1)
    wg_rows: int = 128   # ... its query rows per CTA: 128 (multi_wg.cu) or 64 (multi_wg64.cu)
    int8_q: bool = False  # multi_q8.cu: decode rows, q quantized to int8 for Q K^T

    def __post_init__(self) -> None:
        if self.int8_q and (self.head_dim, self.scale_mode, self.paged, self.ksplit,
                            self.wgmma) != (128, "token", False, 1, False):
            raise ValueError(f"the int8-q kernel takes head_dim 128, per-token scales and a "
                             f"contiguous cache (ksplit 1, wgmma False), got head_dim "
                             f"{self.head_dim}, scale_mode {self.scale_mode!r}, paged "
                             f"{self.paged}, ksplit {self.ksplit}, wgmma {self.wgmma}")
        if self.wgmma and (self.ksplit != 1 or self.head_dim not in WG_HEAD_DIMS):
            raise ValueError(f"the wgmma kernel takes ksplit 1 and head_dim {WG_HEAD_DIMS}, "
                             f"got ksplit {self.ksplit}, head_dim {self.head_dim}")
        if self.wg_rows not in WG_ROWS:
            raise ValueError(f"wg_rows: expected one of {WG_ROWS}, got {self.wg_rows!r}")

    @classmethod
    def planned(cls, spec: KVCacheSpec, dtype: str, ksplit: int = 1,
                wgmma: bool = False, wg_rows: int = 128,
                int8_q: bool = False) -> "MultiVariant":
        return cls(spec.head_dim, dtype, spec.scale_mode, spec.scale_dtype, spec.paged,
                   ksplit, wgmma, wg_rows if wgmma else 128, int8_q)

    @property
    def row_blocks(self) -> int:
        """16-row m-blocks per warp (multi.cu kMT): two when each warp takes whole tiles below
        head_dim 256, else one (registers)."""
        return 2 if self.head_dim != 256 and self.ksplit == 1 else 1

    @property
    def rows_per_cta(self) -> int:
        if self.int8_q:
            return 64
        return self.wg_rows if self.wgmma else 16 * self.row_blocks * (4 // self.ksplit)

    @property
    def threads(self) -> int:
        if self.int8_q:
            return 384
        return (384 if self.wg_rows == 128 else 128) if self.wgmma else THREADS

    @property
    def tile_tokens(self) -> int:
        return tile_tokens(self.head_dim, self.ksplit, self.wgmma or self.int8_q)

    @property
    def kernel(self) -> str:
        args = (f"{self.head_dim}, {support.SCALE_MODE_IDS[self.scale_mode]}, "
                f"{support.CXX_DTYPES[self.dtype]}, "
                f"{support.scale_storage(self.scale_mode, self.scale_dtype)}, "
                f"{support.cxx_bool(self.paged)}")
        if self.int8_q:
            return (f"llfd::multi_attend_q8<{support.CXX_DTYPES[self.dtype]}, "
                    f"{support.scale_storage(self.scale_mode, self.scale_dtype)}>")
        if self.wgmma:
            return f"llfd::multi_attend_wg{'64' if self.wg_rows == 64 else ''}<{args}>"
        return f"llfd::multi_attend<{args}, {self.ksplit}>"

    @property
    def kernel_names(self) -> tuple[str, ...]:
        return (self.kernel,)

    @property
    def stage_bytes(self) -> int:
        """K and V rows of a tile and a fp32 K and V scale per token (MultiTile::kBytes;
        multi_wg.cu rounds a stage to 1 KB: swizzle atoms)."""
        rows = self.tile_tokens
        raw = 2 * rows * self.head_dim + 8 * rows
        return -(-raw // 1024) * 1024 if self.wgmma else raw

    @property
    def shared_bytes(self) -> int:
        """multi.cu: the pipeline's stages and the warps' Q fragments (16 bytes per lane,
        m-block and 16-dim chunk); reused after the loop by the warps' merge (KSPLIT: every
        lane's accumulators) and the split merge. The warpgroup kernels (WgLayout::kBytes):
        int8 stages (three; two at 64 rows), widened tiles (fp16 K and V, their fp32 scales in
        rows of 20 floats per lane and two V maxima, 1 KB aligned: three; two at 64 rows), the
        computing warpgroups' fp16 Q (64 rows each; at 64 rows staged in the second widened
        tile), and 1 KB to align them. The int8-q kernel: Q8_SHARED_BYTES."""
        if self.int8_q:
            return Q8_SHARED_BYTES
        if self.wgmma:
            rows = self.tile_tokens
            scales = 2 * 4 * WG_SCALE_ROW * 4 + 8  # K and V: 4 lanes' rows of fp32; 2 maxima
            copy = -(-(2 * rows * self.head_dim * 2 + scales) // 1024) * 1024
            if self.wg_rows == 64:
                return 2 * self.stage_bytes + 2 * copy + 1024
            query = 2 * 64 * self.head_dim * 2
            return STAGES * self.stage_bytes + 3 * copy + query + 1024
        query = (THREADS // 32) * self.row_blocks * (self.head_dim // 16) * 32 * 16
        return STAGES * self.stage_bytes + query

    @property
    def source(self) -> str:
        if self.int8_q:
            return "multi_q8.cu"
        if self.wgmma:
            return "multi_wg64.cu" if self.wg_rows == 64 else "multi_wg.cu"
        return "multi.cu"

    def builds_for(self, arch: str) -> bool:
        """Whether this program exists for ``arch`` (the wgmma kernels: Hopper only)."""
        return not (self.wgmma or self.int8_q) or arch in WG_ARCHS

    def target_arch(self, arch: str) -> str:
        """The arch NVRTC compiles for: wgmma needs the arch-specific sm_90a."""
        if not (self.wgmma or self.int8_q):
            return arch
        if not self.builds_for(arch):
            raise ValueError(f"arch: the wgmma kernel needs sm_90, got {arch!r}")
        return "sm_90a"

    def compile(self, arch: str) -> CompiledProgram:
        return compile_cached(self.source, CompileOptions(arch=self.target_arch(arch)),
                              self.kernel_names)


@dataclass(frozen=True)
class CombineVariant:
    """multi_combine for the partials of one attention kernel shape: its rows per CTA (the
    partials' rows) and tokens per tile (how its splits cut a row tile's KV)."""

    head_dim: int
    rows: int
    tokens: int
    dtype: str = "float16"

    threads = 128  # kCombineThreads
    source = "multi_combine.cu"

    @classmethod
    def of(cls, variant: MultiVariant) -> "CombineVariant":
        return cls(variant.head_dim, variant.rows_per_cta, variant.tile_tokens, variant.dtype)

    @property
    def rows_per_cta(self) -> int:
        """Rows one CTA merges: one quad of 4 dims per thread."""
        return self.threads // (self.head_dim // 4)

    def grid(self, row_tiles: int, batch: int) -> tuple[int, int, int]:
        """(Hkv x row tiles, CTAs per row tile, batch): the attention grid's x and z."""
        return (row_tiles, self.rows // self.rows_per_cta, batch)

    @property
    def kernel_names(self) -> tuple[str, ...]:
        return (f"llfd::multi_combine<{self.head_dim}, {self.rows}, {self.tokens}, "
                f"{support.CXX_DTYPES[self.dtype]}>",)

    def compile(self, arch: str) -> CompiledProgram:
        return compile_cached(self.source, CompileOptions(arch=arch), self.kernel_names)


def shipped_variants(num_warps: Sequence[int] = ()) -> Iterator[MultiVariant | CombineVariant]:
    """Every program a MultiPlan can pick (``num_warps``: the CLI's family interface; one
    block size here): the attention variants, then the merges their shapes need."""
    attention = list(_attention_variants())
    yield from attention
    yield from dict.fromkeys(CombineVariant.of(variant) for variant in attention)


def _attention_variants() -> Iterator[MultiVariant]:
    for dim, dtype, paged in itertools.product(support.HEAD_DIMS, support.DTYPES,
                                               (False, True)):
        for mode in support.SCALE_MODES:
            for scale_dtype in support.SCALE_DTYPES[mode]:
                for ksplit in ksplits(dim):
                    yield MultiVariant(dim, dtype, mode, scale_dtype, paged, ksplit)
                if dim in WG_HEAD_DIMS:
                    for rows in WG_ROWS:
                        yield MultiVariant(dim, dtype, mode, scale_dtype, paged, wgmma=True,
                                           wg_rows=rows)
                if (dim, mode, paged) == (128, "token", False):
                    yield MultiVariant(dim, dtype, mode, scale_dtype, paged, int8_q=True)
