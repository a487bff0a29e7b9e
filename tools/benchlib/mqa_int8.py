"""The int8 Q K^T multi-query probe kernel (tools/benchlib/mqa_int8.cu, PERF_NOTES v39, v40): its
variants, parameter block, tensor maps, launches over a WorkloadBench's layers, and the oracle
with q rounded as the kernel rounds it.

A probe, not a library kernel: contiguous bnsh caches with fp32 token scales, head_dim 128,
one query token per sequence, a group of at most 64 heads, one split."""
from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lowlevel_fd.compiler import CompiledProgram, CompileOptions, compile_source
from lowlevel_fd.core.loader import load_kernels
from lowlevel_fd.driver import LaunchConfig
from lowlevel_fd.reference import decode_attention_ref

from .heads import TensorMap, encode_tiled
from .timing import WorkloadBench

SOURCE = Path(__file__).resolve().parent / "mqa_int8.cu"
TILE = 64  # tokens per tile; the capacity must be a multiple (a tile's scales: one copy)
SPAN = 17 * 1024  # a stage's and a copy's shared bytes (mqa_int8.cu MqaLayout)


class MqaParams(ctypes.Structure):
    """The twin of llfd::MqaParams."""

    _fields_ = [("q", ctypes.c_uint64), ("k_scale", ctypes.c_uint64),
                ("v_scale", ctypes.c_uint64), ("seq_lens", ctypes.c_uint64),
                ("out", ctypes.c_uint64), ("q_batch_stride", ctypes.c_int64),
                ("out_batch_stride", ctypes.c_int64), ("scale_batch_stride", ctypes.c_int64),
                ("score_scale_log2", ctypes.c_float), ("group", ctypes.c_int32),
                ("num_kv_heads", ctypes.c_int32), ("capacity", ctypes.c_int32)]


class MqaMaps(ctypes.Structure):
    _fields_ = [("k", TensorMap), ("v", TensorMap)]


assert ctypes.sizeof(MqaParams) == 80 and ctypes.sizeof(MqaMaps) == 256


@dataclass(frozen=True)
class MqaVariant:
    """One instantiation of mqa_int8: int8 tiles in flight, widened V copies, computing
    warpgroups."""

    stages: int = 6
    copies: int = 3
    teams: int = 1
    control: int = 0  # timing controls (mqa_int8.cu CONTROL): outputs wrong unless 0
    softmax: int = 0  # 0: multi_wg's softmax_tile; 1: softmax_h16 (mqa_int8_softmax.cuh)

    def __post_init__(self) -> None:
        if self.teams not in (1, 2) or self.stages < 2 or self.copies < 2 * self.teams or (
                self.softmax not in (0, 1)):
            raise ValueError(f"mqa_int8: 1 or 2 teams, >= 2 stages and >= 2 copies per team "
                             f"(a team holds one copy while it waits for the next), softmax 0 "
                             f"or 1, got {self}")

    @property
    def threads(self) -> int:
        return 128 * (1 + self.teams)

    @property
    def kernel_names(self) -> tuple[str, ...]:
        return (f"llfd::mqa_int8<{self.stages}, {self.copies}, {self.teams}, {self.control}, "
                f"{self.softmax}>",)

    @property
    def shared_bytes(self) -> int:
        """Stages and copies (the second team's merge area lies over the stages), and 1 KiB
        to align them."""
        return (self.stages + self.copies) * SPAN + 1024

    def compile(self, arch: str) -> CompiledProgram:
        """For sm_90a whatever Hopper ``arch`` says: wgmma is arch-specific."""
        if arch not in ("sm_90", "sm_90a"):
            raise ValueError(f"mqa_int8: needs a Hopper GPU (sm_90), got {arch}")
        return _compile("sm_90a", self.kernel_names)


@functools.lru_cache(maxsize=None)
def _compile(arch: str, names: tuple[str, ...]) -> CompiledProgram:
    options = CompileOptions(arch=arch, extra=(f"-I{SOURCE.parent}",))  # tma.cuh
    return compile_source(SOURCE.read_text(), SOURCE.name, options, names)


def quantize_rows(q: np.ndarray) -> np.ndarray:
    """q rounded as the kernel rounds it, per row of the last axis: int8 = rint(x * inv) with
    inv = 127 / max|x| and the row's scale 1 / inv, all in fp32; returned dequantized
    (float64)."""
    x = q.astype(np.float32)
    top = np.abs(x).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(top > 0, np.float32(127) / top, np.float32(0)).astype(np.float32)
        scale = np.where(inv > 0, np.float32(1) / inv, np.float32(0)).astype(np.float32)
    steps = np.rint(x * inv).clip(-127, 127)
    return steps.astype(np.float64) * scale.astype(np.float64)


class MqaBench:
    """mqa_int8 over a WorkloadBench's layers (contiguous bnsh, fp32 token scales)."""

    def __init__(self, bench: WorkloadBench, variant: MqaVariant) -> None:
        w = bench.workload
        group = w.num_q_heads // w.num_kv_heads
        if (w.kv_layout, w.scale_mode, w.scale_dtype, w.head_dim, w.page_size) != (
                "bnsh", "token", "float32", 128, 0) or group > 64 or w.seq_len % TILE:
            raise ValueError(f"mqa_int8: bnsh, fp32 token scales, head_dim 128, a group of at "
                             f"most 64 and a capacity a multiple of {TILE}; got {w}")
        self.bench, self.variant = bench, variant
        kernel = load_kernels(variant, bench.plan.device)[0]
        kernel.allow_dynamic_shared(variant.shared_bytes)
        self.registers = kernel.num_registers
        config = LaunchConfig((w.num_kv_heads, 1, w.batch), variant.threads, variant.shared_bytes,
                              programmatic=True)
        self.launches = []
        for layer in bench.layers.layers:
            params = MqaParams(
                q=layer["q"].ptr, k_scale=layer["k_scale"].ptr, v_scale=layer["v_scale"].ptr,
                seq_lens=bench.layers.seq_lens.ptr, out=layer["out"].ptr,
                q_batch_stride=w.num_q_heads * 128, out_batch_stride=w.num_q_heads * 128,
                scale_batch_stride=w.num_kv_heads * w.seq_len,
                score_scale_log2=math.log2(math.e) / math.sqrt(128), group=group,
                num_kv_heads=w.num_kv_heads, capacity=w.seq_len)
            maps = MqaMaps()
            for name in ("k", "v"):
                pool = layer[name]  # [B, Hkv, S, 128], contiguous
                setattr(maps, name, encode_tiled(
                    "CU_TENSOR_MAP_DATA_TYPE_UINT8", pool.ptr,
                    [128, w.seq_len, w.batch * w.num_kv_heads], [128, w.seq_len * 128],
                    [128, TILE, 1], True))
            self.launches.append(kernel.prepare(config, params, maps))

    def step(self) -> None:
        for launch in self.launches:
            launch.launch(self.bench.stream)

    def check(self) -> dict:
        """Layer 0 against the oracle twice: with q rounded as the kernel rounds it (the
        kernel's own error) and as given (what the rounding costs)."""
        layers, stream = self.bench.layers, self.bench.stream
        layers.layers[0]["out"].fill(float("nan"), stream=stream)
        self.launches[0].launch(stream)
        stream.synchronize()
        exact = layers.check_output()
        rows, ref = layers.reference()
        a = layers.layers[0]
        stack = lambda array: np.stack([array[b].numpy() for b in rows])  # noqa: E731
        q8 = quantize_rows(layers.host_q0[rows])
        ref8, _ = decode_attention_ref(q8, stack(a["k"]), stack(a["v"]), stack(a["k_scale"]),
                                       stack(a["v_scale"]), layers.host_lengths[rows],
                                       kv_layout="bnsh", scale_mode="token")
        out = a["out"].numpy().astype(np.float64)[rows]
        err8 = float(np.abs(out - ref8).max() / max(np.abs(ref8).max(), 1e-30))
        return {"err_q8": err8, "err_exact": exact["max_rel_err"],
                "non_finite": exact["non_finite"], "tolerance": exact["tolerance"],
                "ok": exact["non_finite"] == 0 and err8 <= exact["tolerance"]}
