"""What AppendPlan and PromptQuantizer share: the kernel, the error word, the packed launch."""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ..decode import validate as check
from ..driver import Device, DeviceArray, Kernel, LaunchConfig, PreparedLaunch, is_capturing
from ..driver.stream import StreamLike
from .params import AppendParams
from .variants import (DTYPES, HEAD_DIMS, ROPE_STYLES, SCALE_MODES, THREADS, AppendVariant,
                       load_variant)

KV_LAYOUTS = ("bnsh", "bsnh")


def _close(arrays: dict[str, DeviceArray]) -> None:
    for array in arrays.values():
        array.close()
    arrays.clear()


class KernelRunner:
    """Validates the configuration, then owns one kernel of an AppendVariant, a 4-byte device
    error word and the packed parameter block. Nothing touches the GPU until ``load()``."""

    _kernel_index = 0  # 0: append_token, 1: quantize_prompt

    def __init__(self, num_kv_heads: int, head_dim: int, *, max_batch: int, kv_layout: str,
                 scale_mode: str, scale_dtype: str, dtype: str, rope: str | None,
                 rope_theta: float, device: Device | None) -> None:
        head_dim = check.integer("head_dim", head_dim)
        num_kv_heads = check.integer("num_kv_heads", num_kv_heads)
        max_batch = check.integer("max_batch", max_batch)
        check.choice("head_dim", head_dim, HEAD_DIMS)
        dtype = check.dtype_option("dtype", dtype, DTYPES)
        check.choice("kv_layout", kv_layout, KV_LAYOUTS)
        check.choice("scale_mode", scale_mode, SCALE_MODES)
        scale_dtype = check.dtype_option(
            "scale_dtype", scale_dtype,
            ("float32", "float16") if scale_mode == "token" else ("float32",))
        check.choice("rope", rope, ROPE_STYLES)
        if num_kv_heads < 1:
            raise ValueError(f"num_kv_heads: expected a positive int, got {num_kv_heads!r}")
        if max_batch < 1:
            raise ValueError(f"max_batch: expected a positive int, got {max_batch!r}")
        theta = check.real("rope_theta", rope_theta)
        if not theta > 1.0:
            raise ValueError(f"rope_theta: expected a finite base > 1, got {rope_theta!r}")
        self.num_kv_heads, self.head_dim, self.max_batch = num_kv_heads, head_dim, max_batch
        self.kv_layout, self.scale_mode, self.scale_dtype = kv_layout, scale_mode, scale_dtype
        self.dtype, self.rope, self.rope_theta = dtype, rope, theta
        self.variant = AppendVariant(head_dim, dtype, scale_mode, scale_dtype, rope)
        self.device = check.device_option(device)
        self._params = AppendParams()
        self._params.num_kv_heads = num_kv_heads
        self._params.rope_theta = theta
        self._kernel: Kernel | None = None
        self._launches: dict[tuple[int, ...], PreparedLaunch] = {}
        self._arrays: dict[str, DeviceArray] = {}
        self._finalizer = weakref.finalize(self, _close, self._arrays)

    def load(self) -> "KernelRunner":
        """Compile (cached on disk), load the kernel and allocate the zeroed error word. The
        first ``run`` does this; call it yourself before capturing a graph."""
        self._require_open()
        if self._kernel is None:
            kernel = load_variant(self.variant, self.device)[self._kernel_index]
            self._arrays["error_flags"] = DeviceArray.full(1, 0, np.uint32, self.device)
            self._params.error_flags = self._arrays["error_flags"].ptr
            # The zeroing memset went to the legacy stream, which a non-blocking stream does
            # not wait for: finish it before the first run can set a bit.
            self.device.synchronize()
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

    def error_flags(self, *, stream: StreamLike | None = None, clear: bool = True) -> int:
        """Bit 0: a position fell outside the cache and was not written; bit 1 (prompts): a
        length exceeded the prompt's S and was clamped. Synchronous: waits for ``stream`` (the
        one the runs went to) first; 0 before the first run."""
        self._require_open()
        flags = self._arrays.get("error_flags")
        if flags is None:
            return 0
        value = int(flags.numpy(stream=stream)[0])
        if clear:  # a memset is asynchronous: order it before the next run's writes
            flags.fill(0, stream)
            if stream is None:
                self.device.synchronize()
        return value

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
