"""What AppendPlan and PromptQuantizer share: the kernel, the error word, the packed launch and
the prepared calls."""
from __future__ import annotations

import ctypes
import weakref
from typing import Any

from ..core import validate as check
from ..core.errors import ErrorWord
from ..core.loader import load_kernels
from ..core.resources import close_all
from ..core.spec import KVCacheSpec, OnCache, cache_spec
from ..core.support import DTYPES
from ..driver import Device, Kernel, LaunchConfig, PreparedLaunch, is_capturing
from ..driver.stream import StreamLike
from .params import AppendParams
from .variants import THREADS, AppendVariant


class KernelRunner(OnCache):
    """Checks the plan's own options (the cache's are the KVCacheSpec's), then owns one kernel
    of an AppendVariant, a device error word and the packed parameter block. Nothing touches
    the GPU until ``load()``."""

    _kernel_index = 0  # 0: append_token, 1: quantize_prompt

    def __init__(self, cache: KVCacheSpec, *, max_batch: int, dtype: str,
                 device: Device | None) -> None:
        self.cache = cache_spec(cache)
        self.max_batch = check.positive("max_batch", max_batch)
        self.dtype = check.dtype_option("dtype", dtype, DTYPES)
        self.variant = AppendVariant.planned(self.cache, self.dtype)
        self.device = check.device_option(device)
        self._params = AppendParams()
        self._params.num_kv_heads = self.cache.num_kv_heads
        self._params.rope_theta = self.cache.rope_theta
        self._kernel: Kernel | None = None
        self._launches: dict[tuple[int, ...], PreparedLaunch] = {}
        self._resources: dict[str, ErrorWord] = {}
        self._finalizer = weakref.finalize(self, close_all, self._resources)

    def load(self) -> "KernelRunner":
        """Compile (cached on disk), load the kernel and allocate the zeroed error word. The
        first ``run`` does this; call it yourself before capturing a graph."""
        self._require_open()
        if self._kernel is None:
            kernel = load_kernels(self.variant, self.device)[self._kernel_index]
            self._resources["error_flags"] = ErrorWord(self.device)
            self._params.error_flags = self._resources["error_flags"].ptr
            self._kernel = kernel
        return self

    def _launch(self, grid: tuple[int, ...], stream: StreamLike) -> None:
        """Launch on ``grid``; the packed launch is built once per grid shape."""
        if self._kernel is None:
            if is_capturing(stream):
                raise RuntimeError(f"{type(self).__name__}.run: call load() (or run once) before "
                                   f"capturing: the first run compiles, loads and allocates")
            self.load()
        launch = self._launches.get(grid)
        if launch is None:
            assert self._kernel is not None
            launch = self._kernel.prepare(LaunchConfig(grid, THREADS), self._params)
            self._launches[grid] = launch
        launch.launch(stream)

    def _prepared(self, params: AppendParams, grid: tuple[int, ...]) -> "PreparedAppend":
        return PreparedAppend(self, AppendParams.from_buffer_copy(params), grid)

    def error_flags(self, *, stream: StreamLike, clear: bool = True) -> int:
        """The bits the kernel set since the last clear (ERROR_OUTSIDE_CACHE: a position outside
        the cache, not written; ERROR_PROMPT_LENGTH: a prompt length above the prompt's S,
        clamped). Waits for the work enqueued on ``stream`` (the one the runs went to), then
        clears on it; 0 before the first run."""
        self._require_open()
        word = self._resources.get("error_flags")
        return 0 if word is None else word.read(stream, clear)

    def _require_open(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError(f"{type(self).__name__} is closed")

    def close(self) -> None:
        """Free the error word; the object cannot run afterwards."""
        self._finalizer()
        self._kernel = None
        self._launches.clear()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PreparedAppend:
    """A validated call of an AppendPlan or PromptQuantizer: ``launch(stream)`` issues it (an
    empty batch issues nothing)."""

    __slots__ = ("_runner", "_params", "_grid")

    def __init__(self, runner: KernelRunner, params: AppendParams,
                 grid: tuple[int, ...]) -> None:
        self._runner, self._params, self._grid = runner, params, grid

    def launch(self, stream: StreamLike) -> None:
        runner = self._runner
        runner._require_open()
        if not all(self._grid):
            return
        ctypes.memmove(ctypes.addressof(runner._params), ctypes.addressof(self._params),
                       ctypes.sizeof(AppendParams))
        runner._launch(self._grid, stream)
