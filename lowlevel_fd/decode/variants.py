"""The compiled variants of the decode kernels: what is a variant, its name, how it is built."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator

from ..compiler import CompiledProgram, CompileOptions, compile_cached
from .planner import MAX_SPLITS, TWO_TILE_HEAD_DIMS

SOURCE = "decode.cu"
HEAD_DIMS = (64, 128, 256)
GROUP_SIZES = (1, 2, 4, 8, 16)
Q_DTYPES = ("float16", "bfloat16")
SCALE_MODES = ("tensor", "head", "token")
TOKEN_SCALE_DTYPES = ("float32", "float16")
WARP_COUNTS = (2, 4, 8)
PLANNER_WARPS = (8,)  # what the planner picks; the CI compiles these variants


def default_stages(head_dim: int) -> int:
    """Tiles in flight per warp. Two (one loading while one is consumed) measured best at
    head_dim 128: deeper pipelines cost occupancy and did not stream faster (PERF_NOTES.md)."""
    return {64: 3, 128: 2, 256: 2}[head_dim]
_MODE_ID = {"tensor": 0, "head": 1, "token": 2}
_CXX_TYPE = {"float16": "llfd::f16", "bfloat16": "llfd::bf16", "float32": "float"}
# Per-token scales are loaded by value: fp16 ones as raw 16-bit words (the f16 tag is empty).
_SCALE_TYPE = {"float16": "uint16_t", "float32": "float"}


@dataclass(frozen=True)
class DecodeVariant:
    """One instantiation of decode_split (and its decode_combine)."""

    head_dim: int
    group_size: int
    q_dtype: str = "float16"
    scale_mode: str = "token"
    scale_dtype: str = "float32"  # of per-token scales; per-tensor/per-head are always fp32
    num_warps: int = 4
    stages: int = 0  # 0: default_stages(head_dim)
    cluster: bool = False  # splits merge through a thread-block cluster (sm_90+)
    tiles: int = 1  # 16-token tiles per step of a warp (1 or 2)
    append: bool = False  # the fused append of DecodePlan.append_and_run

    def __post_init__(self) -> None:
        if not self.stages:
            object.__setattr__(self, "stages", default_stages(self.head_dim))

    @property
    def stage_bytes(self) -> int:
        """One 16-token tile of K and V plus 16 K and 16 V scales (cu/decode_pipeline.cuh)."""
        scale_size = 2 if self.scale_mode == "token" and self.scale_dtype == "float16" else 4
        return self.tiles * (32 * self.head_dim + 32 * scale_size)

    @property
    def split_kernel(self) -> str:
        scale_t = _SCALE_TYPE[self.scale_dtype if self.scale_mode == "token" else "float32"]
        return (f"llfd::decode_split<{self.head_dim}, {self.group_size}, {self.num_warps}, "
                f"{_MODE_ID[self.scale_mode]}, {_CXX_TYPE[self.q_dtype]}, {scale_t}, {self.stages}, "
                f"{'true' if self.cluster else 'false'}, {self.tiles}, "
                f"{'true' if self.append else 'false'}>")

    @property
    def combine_kernel(self) -> str:
        return (f"llfd::decode_combine<{self.head_dim}, {self.group_size}, "
                f"{_CXX_TYPE[self.q_dtype]}>")

    advance_kernel = "llfd::advance_lengths"  # the fused-append step's length bump

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def _head_blocks(self) -> int:
        return 2 if self.group_size > 8 else 1

    @property
    def dynamic_shared_bytes(self) -> int:
        """The warps' pipelines, later reused for their accumulators: every lane's float4 per
        (head block, m-block) (cu/decode_merge.cuh Quads::kPerWarp), or for the global merge's
        weights ((MAX_SPLITS + 2) x GROUP floats)."""
        pipelines = self.num_warps * self.stages * self.stage_bytes
        quads = self.num_warps * self._head_blocks * (self.head_dim // 16) * 32 * 16
        return max(pipelines, quads, (MAX_SPLITS + 2) * self.group_size * 4)

    def cluster_slots_bytes(self, num_splits: int) -> int:
        """The cluster merge's slots after the dynamic shared memory above (16-byte aligned):
        per split, the accumulator quads whose heads exist and GROUP LSEs padded to 4 (fp32)
        (Quads::kSlotFloats)."""
        pairs = 4 if self.group_size >= 8 else (self.group_size + 1) // 2
        compact = self._head_blocks * (self.head_dim // 16) * 8 * pairs
        return num_splits * (4 * compact + -(-self.group_size // 4) * 4) * 4

    def launch_shared_bytes(self, num_splits: int) -> tuple[int, int]:
        """(dynamic shared memory of a launch, offset of the cluster slots in it)."""
        if not self.cluster:
            return self.dynamic_shared_bytes, 0
        offset = -(-self.dynamic_shared_bytes // 16) * 16
        return offset + self.cluster_slots_bytes(num_splits), offset

    def compile(self, arch: str) -> CompiledProgram:
        return compile_cached(SOURCE, CompileOptions(arch=arch),
                              (self.split_kernel, self.combine_kernel, self.advance_kernel))


def shipped_variants(num_warps: tuple[int, ...] = PLANNER_WARPS) -> Iterator[DecodeVariant]:
    """Every variant the planner can pick (the CI compiles all of them): ``num_warps`` warps,
    one tile per step, with a cluster or a global merge; and the two-tile cluster variants of
    planner rule 7 (head_dim 128, groups up to 8); each also with the fused append. Other
    two-tile variants compile on demand."""
    for dim, group, q_dtype in itertools.product(HEAD_DIMS, GROUP_SIZES, Q_DTYPES):
        two_tiles = dim in TWO_TILE_HEAD_DIMS and group <= 8
        for mode in SCALE_MODES:
            for scale_dtype in (TOKEN_SCALE_DTYPES if mode == "token" else ("float32",)):
                for warps, append in itertools.product(num_warps, (False, True)):
                    for cluster in (False, True):
                        yield DecodeVariant(dim, group, q_dtype, mode, scale_dtype,
                                            num_warps=warps, cluster=cluster, append=append)
                    if two_tiles:
                        yield DecodeVariant(dim, group, q_dtype, mode, scale_dtype,
                                            num_warps=warps, cluster=True, tiles=2,
                                            append=append)
