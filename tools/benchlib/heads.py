"""The heads-together paged decode kernel (tools/benchlib/heads.cu, PERF_NOTES v32): its
variants and the pools' tensor maps it copies pages through.

A probe, not a library kernel: it is not routed by DecodePlan (with ragged lengths it loses to
the shipped kernel, v32), so it lives with the tools and is compiled here through the public
compiler API, with lowlevel_fd/cu on the include path for the decode headers it reuses."""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

from lowlevel_fd.compiler import CompiledProgram, CompileOptions, compile_source
from lowlevel_fd.core import support
from lowlevel_fd.driver import DeviceArray

SOURCE = Path(__file__).resolve().parent / "heads.cu"
# Token row r of a tile's mma is token SIGMA[r % 8] + 8 * (r // 8) (heads.cu sigma8): the
# fragment reads are then conflict-free on TMA's 128-byte swizzle (tests/test_bench_cpu.py).
SIGMA = (0, 4, 2, 7, 5, 1, 6, 3)

ROW_BOX_TOKENS = 16  # one tile's tokens of a page per copy


class TensorMap(ctypes.Structure):
    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


class HeadsMaps(ctypes.Structure):
    """The twin of llfd::HeadsMaps: four 64-byte aligned maps, then the scale orientation."""

    _fields_ = [("k", TensorMap), ("v", TensorMap), ("k_scale", TensorMap),
                ("v_scale", TensorMap), ("scale_heads_inner", ctypes.c_int32),
                ("_pad", ctypes.c_int32 * 15)]


assert ctypes.sizeof(HeadsMaps) == 576


@dataclass(frozen=True)
class HeadsVariant:
    """One instantiation of decode_heads."""

    group: int  # query heads per KV head (1, 2, 4, 8)
    kv_heads: int  # KV heads per CTA (2, 4, 8)
    warps: int = 8  # 8 or 16; (warps / kv_heads) tiles in flight per head
    dtype: str = "float16"
    scale_mode: str = "token"
    scale_dtype: str = "float32"
    stages: int = 4
    head_dim: int = 128
    cluster: bool = False  # the splits merge in a thread-block cluster (heads.cu)


    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def kernel_names(self) -> tuple[str, ...]:
        return (f"llfd::decode_heads<{self.head_dim}, {self.group}, {self.kv_heads}, "
                f"{self.warps}, "
                f"{support.SCALE_MODE_IDS[self.scale_mode]}, {support.CXX_DTYPES[self.dtype]}, "
                f"{support.scale_storage(self.scale_mode, self.scale_dtype)}, {self.stages}, "
                f"{support.cxx_bool(self.cluster)}>",)

    @property
    def scale_bytes(self) -> int:
        if self.scale_mode != "token":
            return 0
        item = 2 if self.scale_dtype == "float16" else 4
        return -(-16 * self.kv_heads * item // 128) * 128  # 128-byte aligned copies (heads_copy)

    def shared_bytes(self, num_splits: int = 1) -> int:
        """The stages (heads.cu HeadsLayout), 1 KiB to align them to 1024, and with
        a cluster merge each split's slot after them (HeadsSlots)."""
        rows = 2 * self.kv_heads * ROW_BOX_TOKENS * self.head_dim
        stages = self.stages * (rows + 2 * self.scale_bytes) + 1024
        if not self.cluster:
            return stages
        pairs = 4 if self.group >= 8 else (self.group + 1) // 2
        quads = self.kv_heads * (self.head_dim // 16) * 8 * pairs
        rows_lse = self.kv_heads * self.group
        return stages + num_splits * 4 * (4 * quads + -(-rows_lse // 4) * 4)

    def compile(self, arch: str) -> CompiledProgram:
        return _compile(arch, self.kernel_names)


@functools.lru_cache(maxsize=None)
def _compile(arch: str, names: tuple[str, ...]) -> CompiledProgram:
    """Once per process, arch and variant (not in the library's disk cache)."""
    options = CompileOptions(arch=arch, extra=(f"-I{SOURCE.parent}",))  # heads_*.cuh
    return compile_source(SOURCE.read_text(), SOURCE.name, options, names)


def encode_tiled(dtype_name: str, array_ptr: int, dims: list[int], strides: list[int],
                 box: list[int], swizzle: bool) -> TensorMap:
    """A tiled tensor map (innermost dimension first; strides in bytes from the second),
    with the 128-byte swizzle or none."""
    from cuda.bindings import driver as d

    from lowlevel_fd.driver._api import cu
    dtype = getattr(d.CUtensorMapDataType, dtype_name)
    mode = (d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B if swizzle
            else d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE)
    encoded = cu.cuTensorMapEncodeTiled(
        dtype, len(dims), array_ptr, [d.cuuint64_t(x) for x in dims],
        [d.cuuint64_t(x) for x in strides], [d.cuuint32_t(x) for x in box],
        [d.cuuint32_t(1)] * len(dims), d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        mode, d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    out = TensorMap()
    for i, word in enumerate(encoded.opaque):
        out.opaque[i] = int(word)
    return out


def _axes(layout: str) -> tuple[int, int, int]:
    """(page, head, token) axes of a paged pool of this layout."""
    return (0, 2, 1) if layout == "nhd" else (0, 1, 2)


def encode_maps(layout: str, kv_heads: int, k: DeviceArray, v: DeviceArray,
                k_scale: DeviceArray | None, v_scale: DeviceArray | None) -> HeadsMaps:
    """The tensor maps of one layer's pools: rows (D, slot, head, page) in boxes of
    (D, 16, kv_heads, 1); per-token scales with their innermost axis first."""
    maps = HeadsMaps()
    page_axis, head_axis, token_axis = _axes(layout)
    for name, pool in (("k", k), ("v", v)):
        shape, strides = pool.shape, pool.strides
        setattr(maps, name, encode_tiled(
            "CU_TENSOR_MAP_DATA_TYPE_UINT8", pool.ptr,
            [shape[3], shape[token_axis], shape[head_axis], shape[page_axis]],
            [strides[token_axis], strides[head_axis], strides[page_axis]],
            [shape[3], ROW_BOX_TOKENS, kv_heads, 1], True))
    if k_scale is not None and k_scale.ndim == 3:
        item = k_scale.itemsize
        dtype = "CU_TENSOR_MAP_DATA_TYPE_FLOAT16" if item == 2 else "CU_TENSOR_MAP_DATA_TYPE_FLOAT32"
        heads_inner = k_scale.strides[head_axis] == item
        maps.scale_heads_inner = int(heads_inner)
        for name, pool in (("k_scale", k_scale), ("v_scale", v_scale)):
            shape, strides = pool.shape, pool.strides
            if heads_inner:
                dims = [shape[head_axis], shape[token_axis], shape[page_axis]]
                steps = [strides[token_axis], strides[page_axis]]
                box = [kv_heads, ROW_BOX_TOKENS, 1]
            else:
                dims = [shape[token_axis], shape[head_axis], shape[page_axis]]
                steps = [strides[head_axis], strides[page_axis]]
                box = [ROW_BOX_TOKENS, kv_heads, 1]
            setattr(maps, name, encode_tiled(dtype, pool.ptr, dims, steps, box, False))
    return maps
