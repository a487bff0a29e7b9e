"""The compiled programs of the append family: append_token and quantize_prompt (append.cu),
one program per (head_dim, dtype, scale mode, scale dtype, RoPE style)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Sequence

from ..compiler import CompiledProgram, CompileOptions, compile_cached
from ..core import support
from ..core.spec import KVCacheSpec

THREADS = 512               # kThreads in append.cu
PROMPT_TOKENS_PER_CTA = 8   # kPromptTokens in append.cu


@dataclass(frozen=True)
class AppendVariant:
    """One instantiation of append_token and quantize_prompt (same template arguments)."""

    head_dim: int
    dtype: str = "float16"
    scale_mode: str = "token"
    scale_dtype: str = "float32"  # of per-token scales; per-tensor/per-head are always fp32
    rope: str | None = None

    @classmethod
    def planned(cls, spec: KVCacheSpec, dtype: str) -> "AppendVariant":
        return cls(spec.head_dim, dtype, spec.scale_mode, spec.scale_dtype, spec.rope)

    def _arguments(self) -> str:
        return (f"{self.head_dim}, {support.SCALE_MODE_IDS[self.scale_mode]}, "
                f"{support.CXX_DTYPES[self.dtype]}, "
                f"{support.scale_storage(self.scale_mode, self.scale_dtype)}, "
                f"{support.ROPE_IDS[self.rope]}")

    @property
    def append_kernel(self) -> str:
        return f"llfd::append_token<{self._arguments()}>"

    @property
    def prompt_kernel(self) -> str:
        return f"llfd::quantize_prompt<{self._arguments()}>"

    @property
    def kernel_names(self) -> tuple[str, ...]:
        """(append_token, quantize_prompt): the order ``load_kernels`` returns them in."""
        return (self.append_kernel, self.prompt_kernel)

    source = "append.cu"

    def compile(self, arch: str) -> CompiledProgram:
        return compile_cached(self.source, CompileOptions(arch=arch), self.kernel_names)


def shipped_variants(num_warps: Sequence[int] = ()) -> Iterator[AppendVariant]:
    """Every variant the append plans can pick. ``num_warps`` is accepted for the CLI's
    family interface and ignored: the append kernels have one block size."""
    for dim, dtype, rope in itertools.product(support.HEAD_DIMS, support.DTYPES,
                                              support.ROPE_STYLES):
        for mode in support.SCALE_MODES:
            for scale_dtype in support.SCALE_DTYPES[mode]:
                yield AppendVariant(dim, dtype, mode, scale_dtype, rope)
