"""NVRTC: CUDA C++ source to CUBIN for one exact architecture, with a parsed ptxas report."""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from cuda.bindings import nvrtc as _nvrtc

KERNEL_DIR = Path(__file__).resolve().parent.parent / "cu"


class CompileError(RuntimeError):
    """NVRTC rejected the source; ``log`` holds the full compiler output with file:line."""

    def __init__(self, source: str, arch: str, log: str) -> None:
        self.source, self.arch, self.log = source, arch, log
        super().__init__(f"NVRTC failed to compile {source} for {arch}:\n{log.strip()}")


class NvrtcError(RuntimeError):
    """An NVRTC API call failed for a reason other than the source (e.g. bad options)."""


def _check(function: str, out: Any) -> Any:
    result = out[0] if isinstance(out, tuple) else out
    if result != _nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, text = _nvrtc.nvrtcGetErrorString(result)
        raise NvrtcError(f"{function} failed with {result.name}: {text.decode()}")
    if isinstance(out, tuple) and len(out) > 1:
        return out[1] if len(out) == 2 else out[1:]
    return None


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    return tuple(_check("nvrtcVersion", _nvrtc.nvrtcVersion()))  # type: ignore[return-value]


@dataclass(frozen=True)
class CompileOptions:
    """Everything that changes the CUBIN besides the source; rendered into NVRTC flags."""

    arch: str = "sm_90"
    std: str = "c++17"
    defines: tuple[tuple[str, str], ...] = ()
    extra: tuple[str, ...] = ()

    def flags(self) -> list[str]:
        if not re.fullmatch(r"sm_\d+[af]?", self.arch):
            raise ValueError(f"arch: expected a real architecture like 'sm_90', got {self.arch!r}")
        flags = [f"-arch={self.arch}", f"-std={self.std}", f"-I{KERNEL_DIR}",
                 "-Xptxas=-v", "-default-device", "-lineinfo"]
        flags += [f"-D{k}={v}" for k, v in self.defines]
        return flags + list(self.extra)


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reported for one kernel."""

    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    shared_bytes: int


@dataclass
class CompiledProgram:
    """A CUBIN plus what the compiler said: the log, lowered names, per-kernel resources."""

    cubin: bytes
    log: str
    arch: str
    lowered_names: dict[str, str] = field(default_factory=dict)
    resources: dict[str, KernelResources] = field(default_factory=dict)

    def symbol(self, name_expression: str) -> str:
        """The mangled symbol of a template instantiation (or the name itself)."""
        return self.lowered_names.get(name_expression, name_expression)


_ENTRY = re.compile(r"Compiling entry function '(\S+)' for")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_report(log: str) -> dict[str, KernelResources]:
    """Per-kernel registers, spills, stack and static shared memory from ``-Xptxas=-v`` output."""
    report: dict[str, KernelResources] = {}
    current, frame = None, (0, 0, 0)
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current, frame = m.group(1), (0, 0, 0)
        elif current and (m := _FRAME.search(line)):
            frame = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        elif current and (m := _USED.search(line)):
            smem = _SMEM.search(line)
            report[current] = KernelResources(
                registers=int(m.group(1)), spill_store_bytes=frame[1], spill_load_bytes=frame[2],
                stack_bytes=frame[0], shared_bytes=int(smem.group(1)) if smem else 0)
            current = None
    return report


def compile_source(source: str, name: str, options: CompileOptions,
                   name_expressions: Sequence[str] = ()) -> CompiledProgram:
    """Compile ``source`` (named ``name`` in diagnostics) straight to CUBIN; never PTX, since
    the driver may be older than NVRTC. Raises CompileError with the log on failure."""
    flags = [f.encode() for f in options.flags()]
    program = _check("nvrtcCreateProgram",
                     _nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []))
    try:
        for expression in name_expressions:
            _check("nvrtcAddNameExpression",
                   _nvrtc.nvrtcAddNameExpression(program, expression.encode()))
        result = _nvrtc.nvrtcCompileProgram(program, len(flags), flags)[0]
        size = _check("nvrtcGetProgramLogSize", _nvrtc.nvrtcGetProgramLogSize(program))
        buffer = b" " * size
        _check("nvrtcGetProgramLog", _nvrtc.nvrtcGetProgramLog(program, buffer))
        log = buffer.rstrip(b"\0 ").decode(errors="replace")
        if result != _nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(name, options.arch, log)
        size = _check("nvrtcGetCUBINSize", _nvrtc.nvrtcGetCUBINSize(program))
        cubin = b" " * size
        _check("nvrtcGetCUBIN", _nvrtc.nvrtcGetCUBIN(program, cubin))
        lowered = {}
        for expression in name_expressions:
            mangled = _check("nvrtcGetLoweredName",
                             _nvrtc.nvrtcGetLoweredName(program, expression.encode()))
            lowered[expression] = mangled.decode() if isinstance(mangled, bytes) else mangled
    finally:
        _nvrtc.nvrtcDestroyProgram(program)
    return CompiledProgram(cubin=cubin, log=log, arch=options.arch, lowered_names=lowered,
                           resources=parse_ptxas_report(log))
