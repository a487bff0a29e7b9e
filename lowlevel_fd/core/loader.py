"""Kernels of a compiled program, loaded once per process and device for every family."""
from __future__ import annotations

import threading
from typing import Protocol, Sequence

from ..compiler import CompiledProgram
from ..driver import Device, Kernel, Module


class Program(Protocol):
    """What a family's variant offers: its kernels' name expressions and how to build them."""

    @property
    def kernel_names(self) -> Sequence[str]: ...

    def compile(self, arch: str) -> CompiledProgram: ...


_loaded: dict[tuple[int, Program], tuple[Module, tuple[Kernel, ...]]] = {}
_lock = threading.Lock()


def load_kernels(program: Program, device: Device) -> tuple[Kernel, ...]:
    """Compile ``program`` (cached on disk), load it into ``device``'s context once per process
    and return its kernels in the order of ``kernel_names``."""
    key = (device.ordinal, program)
    with _lock:
        entry = _loaded.get(key)
    if entry is None:  # compile outside the lock: other programs may load meanwhile
        compiled = program.compile(device.arch)
        module = Module(compiled.cubin, device)
        kernels = tuple(module.get_kernel(compiled.symbol(name)) for name in program.kernel_names)
        with _lock:
            entry = _loaded.setdefault(key, (module, kernels))
        if entry[0] is not module:
            module.close()
    return entry[1]
