"""The compiled variants of the append kernels: what a variant is, its names, how it is built."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Sequence

from ..compiler import CompiledProgram, CompileOptions, compile_cached
from ..decode.params import ROPE_IDS
from ..driver import Device, Kernel, Module

SOURCE = "append.cu"
HEAD_DIMS = (64, 128, 256)
DTYPES = ("float16", "bfloat16")
SCALE_MODES = ("tensor", "head", "token")
TOKEN_SCALE_DTYPES = ("float32", "float16")
ROPE_STYLES = (None, "neox", "gptj")
THREADS = 512               # kThreads in append.cu
PROMPT_TOKENS_PER_CTA = 8   # kPromptTokens in append.cu
_MODE_ID = {"tensor": 0, "head": 1, "token": 2}
_CXX_TYPE = {"float16": "llfd::f16", "bfloat16": "llfd::bf16"}
# Scales are stored, not converted by tag: fp16 per-token scales travel as raw 16-bit words.
_SCALE_STORAGE = {"float32": "float", "float16": "uint16_t"}
_loaded: dict[tuple[int, "AppendVariant"], tuple[Module, Kernel, Kernel]] = {}


@dataclass(frozen=True)
class AppendVariant:
    """One instantiation of append_token and quantize_prompt (same template arguments)."""

    head_dim: int
    dtype: str = "float16"
    scale_mode: str = "token"
    scale_dtype: str = "float32"  # of per-token scales; per-tensor/per-head are always fp32
    rope: str | None = None

    def _arguments(self) -> str:
        scale_t = _SCALE_STORAGE[self.scale_dtype if self.scale_mode == "token" else "float32"]
        return (f"{self.head_dim}, {_MODE_ID[self.scale_mode]}, {_CXX_TYPE[self.dtype]}, "
                f"{scale_t}, {ROPE_IDS[self.rope]}")

    @property
    def append_kernel(self) -> str:
        return f"llfd::append_token<{self._arguments()}>"

    @property
    def prompt_kernel(self) -> str:
        return f"llfd::quantize_prompt<{self._arguments()}>"

    @property
    def kernel_names(self) -> list[str]:
        """The name expressions this variant compiles (for ``python -m lowlevel_fd compile``)."""
        return [self.append_kernel, self.prompt_kernel]

    def compile(self, arch: str) -> CompiledProgram:
        return compile_cached(SOURCE, CompileOptions(arch=arch), tuple(self.kernel_names))


def shipped_variants(num_warps: Sequence[int] = ()) -> Iterator[AppendVariant]:
    """Every variant the append plans can pick. ``num_warps`` is accepted for the CLI's
    family interface and ignored: the append kernels have one block size."""
    for dim, dtype, rope in itertools.product(HEAD_DIMS, DTYPES, ROPE_STYLES):
        for mode in SCALE_MODES:
            for scale_dtype in (TOKEN_SCALE_DTYPES if mode == "token" else ("float32",)):
                yield AppendVariant(dim, dtype, mode, scale_dtype, rope)


def load_variant(variant: AppendVariant, device: Device) -> tuple[Kernel, Kernel]:
    """(append_token, quantize_prompt), compiled (cached on disk) and loaded once per device."""
    key = (device.ordinal, variant)
    if key not in _loaded:
        program = variant.compile(device.arch)
        module = Module(program.cubin, device)
        _loaded[key] = (module, module.get_kernel(program.symbol(variant.append_kernel)),
                        module.get_kernel(program.symbol(variant.prompt_kernel)))
    _, append, prompt = _loaded[key]
    return append, prompt
