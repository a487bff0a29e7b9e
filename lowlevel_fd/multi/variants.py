"""The compiled programs of the multi-token family: multi_attend (multi.cu), one program per
(head_dim, dtype, scale mode, scale dtype, storage)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Sequence

from ..compiler import CompiledProgram, CompileOptions, compile_cached
from ..core import support
from ..core.spec import KVCacheSpec

THREADS = 128       # four warps
STAGES = 3          # kMultiStages in multi.cu


def tile_tokens(head_dim: int, ksplit: int = 1) -> int:
    """KV tokens per pipeline tile (multi.cu kTileRows): 32 where 64 tokens' score
    accumulators would not fit in registers (head_dim 256; 128 with the whole tile per warp)."""
    return 32 if head_dim == 256 or (head_dim == 128 and ksplit == 1) else 64


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

    @classmethod
    def planned(cls, spec: KVCacheSpec, dtype: str, ksplit: int = 1) -> "MultiVariant":
        return cls(spec.head_dim, dtype, spec.scale_mode, spec.scale_dtype, spec.paged,
                   ksplit)

    @property
    def row_blocks(self) -> int:
        """16-row m-blocks per warp (multi.cu kMT): two when each warp takes whole tiles below
        head_dim 256, else one (registers)."""
        return 2 if self.head_dim != 256 and self.ksplit == 1 else 1

    @property
    def rows_per_cta(self) -> int:
        return 16 * self.row_blocks * (4 // self.ksplit)

    @property
    def kernel(self) -> str:
        return (f"llfd::multi_attend<{self.head_dim}, {support.SCALE_MODE_IDS[self.scale_mode]}, "
                f"{support.CXX_DTYPES[self.dtype]}, "
                f"{support.scale_storage(self.scale_mode, self.scale_dtype)}, "
                f"{support.cxx_bool(self.paged)}, {self.ksplit}>")

    @property
    def kernel_names(self) -> tuple[str, ...]:
        return (self.kernel,)

    @property
    def stage_bytes(self) -> int:
        """K and V rows of a tile and a fp32 K and V scale per token (MultiTile::kBytes)."""
        rows = tile_tokens(self.head_dim, self.ksplit)
        return 2 * rows * self.head_dim + 8 * rows

    @property
    def shared_bytes(self) -> int:
        """The pipeline's stages and the warps' Q fragments (16 bytes per lane, m-block and
        16-dim chunk); reused after the loop by the warps' merge (KSPLIT: every lane's
        accumulators) and the split merge."""
        query = (THREADS // 32) * self.row_blocks * (self.head_dim // 16) * 32 * 16
        return STAGES * self.stage_bytes + query

    source = "multi.cu"

    def compile(self, arch: str) -> CompiledProgram:
        return compile_cached(self.source, CompileOptions(arch=arch), self.kernel_names)


def shipped_variants(num_warps: Sequence[int] = ()) -> Iterator[MultiVariant]:
    """Every variant a MultiPlan can pick (``num_warps``: the CLI's family interface; one block
    size here)."""
    for dim, dtype, paged in itertools.product(support.HEAD_DIMS, support.DTYPES,
                                               (False, True)):
        for mode in support.SCALE_MODES:
            for scale_dtype in support.SCALE_DTYPES[mode]:
                for ksplit in ksplits(dim):
                    yield MultiVariant(dim, dtype, mode, scale_dtype, paged, ksplit)
