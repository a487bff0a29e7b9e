"""The one error funnel over ``cuda.bindings.driver``.

Every driver call in lowlevel_fd goes through ``cu.<name>(...)``: the proxy checks the returned
``CUresult`` and hands back the bare value, so callers never see ``(err, value)`` tuples.
"""
from __future__ import annotations

from typing import Any, Callable

from cuda.bindings import driver as _driver

_SUCCESS = _driver.CUresult.CUDA_SUCCESS

# Hints that tell the user what to do next, keyed by CUresult name.
_HINTS = {
    "CUDA_ERROR_NO_DEVICE": "no CUDA device is visible; check CUDA_VISIBLE_DEVICES and the driver",
    "CUDA_ERROR_INVALID_VALUE": "an argument is out of range (grid, block or shared-memory size?)",
    "CUDA_ERROR_OUT_OF_MEMORY": "free device memory (close plans and arrays) or use smaller sizes",
    "CUDA_ERROR_ILLEGAL_ADDRESS": "a kernel touched memory it does not own; the context is now "
    "unusable and the process must restart",
    "CUDA_ERROR_MISALIGNED_ADDRESS": "a pointer is not aligned to its element size; the context "
    "is now unusable and the process must restart",
    "CUDA_ERROR_LAUNCH_FAILED": "a kernel faulted; the context is unusable, restart the process",
    "CUDA_ERROR_INVALID_IMAGE": "the CUBIN does not match this GPU's architecture",
    "CUDA_ERROR_NO_BINARY_FOR_GPU": "recompile for this device's arch (lowlevel_fd compile --arch)",
    "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED": "this call cannot run while a stream is capturing",
    "CUDA_ERROR_UNSUPPORTED_PTX_VERSION": "the driver is older than NVRTC; compile to CUBIN",
}


def _describe(result: Any) -> tuple[str, str]:
    """Name and description of a CUresult; falls back to the enum name without a driver."""
    name = getattr(result, "name", str(result))
    try:
        err, text = _driver.cuGetErrorString(result)
        if err == _SUCCESS and text:
            return name, text.decode() if isinstance(text, bytes) else str(text)
    except Exception:  # no libcuda: the description is optional
        pass
    return name, ""


class CudaError(RuntimeError):
    """A CUDA driver call failed. ``function``, ``code`` and ``name`` say which and why."""

    def __init__(self, function: str, result: Any, hint: str = "") -> None:
        self.function = function
        self.code = int(result)
        self.name, self.description = _describe(result)
        hint = hint or _HINTS.get(self.name, "")
        text = f"{function} failed with {self.name} ({self.code})"
        if self.description:
            text += f": {self.description}"
        if hint:
            text += f" [{hint}]"
        super().__init__(text)


def _unwrap(function: str, out: Any) -> Any:
    result = out[0] if isinstance(out, tuple) else out
    if result != _SUCCESS:
        raise CudaError(function, result)
    if not isinstance(out, tuple) or len(out) == 1:
        return None
    return out[1] if len(out) == 2 else out[1:]


class _CheckedDriver:
    """Attribute access yields a checked wrapper of the driver function of the same name."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(_driver, name)
        if not name.startswith("cu") or not callable(fn):
            return fn

        def checked(*args: Any) -> Any:
            return _unwrap(name, fn(*args))

        checked.__name__ = name
        setattr(self, name, checked)  # cache: the next lookup skips __getattr__
        return checked


cu = _CheckedDriver()
raw = _driver  # enums, types and unchecked calls (used where a status is not an error)
