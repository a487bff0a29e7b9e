"""Streams (owned or borrowed) and events (timing, ordering)."""
from __future__ import annotations

import weakref
from typing import Any, Union

from ._api import cu, raw
from .device import Device


def _destroy(function: str, handle: Any, context: Any) -> None:
    try:  # finalizers never raise, also at interpreter shutdown
        cu.cuCtxSetCurrent(context)
        getattr(cu, function)(handle)
    except Exception:
        pass


class Stream:
    """A CUDA stream. ``Stream()`` creates a non-blocking stream that this object owns;
    ``Stream.borrow(x)`` wraps another library's stream (int handle or ``__cuda_stream__``)."""

    def __init__(self, device: Device | None = None, *, priority: int = 0) -> None:
        self.device = device or Device(0)
        self.device.set_current()
        flags = raw.CUstream_flags.CU_STREAM_NON_BLOCKING
        self.handle = cu.cuStreamCreateWithPriority(flags, priority)
        self._finalizer = weakref.finalize(self, _destroy, "cuStreamDestroy", self.handle,
                                           self.device.context)

    @classmethod
    def borrow(cls, obj: Any, device: Device | None = None) -> "Stream":
        """Wrap a stream owned elsewhere; ``close()`` never destroys it."""
        self = cls.__new__(cls)
        self.device = device or Device(0)
        self.handle = raw.CUstream(stream_address(obj))
        self._finalizer = weakref.finalize(self, lambda: None)
        return self

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, int(self.handle))

    def synchronize(self) -> None:
        cu.cuStreamSynchronize(self.handle)

    def query(self) -> bool:
        """True when all work on the stream has finished."""
        result = raw.cuStreamQuery(self.handle)[0]
        if result == raw.CUresult.CUDA_ERROR_NOT_READY:
            return False
        return cu.cuStreamQuery(self.handle) is None

    def wait(self, event: "Event") -> None:
        """Make later work on this stream wait for ``event``."""
        cu.cuStreamWaitEvent(self.handle, event.handle, 0)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __int__(self) -> int:
        return int(self.handle)

    def __repr__(self) -> str:
        return f"Stream({int(self.handle):#x})"


StreamLike = Union[Stream, int, Any]


def stream_address(obj: StreamLike) -> int:
    """The raw CUstream address of a Stream, an int, or an object with ``__cuda_stream__``
    (torch.cuda.Stream, cupy) or a ``cuda_stream`` attribute (older torch)."""
    if isinstance(obj, Stream):
        return int(obj.handle)
    if isinstance(obj, int):
        return obj
    if hasattr(obj, "__cuda_stream__"):
        return int(obj.__cuda_stream__()[1])
    if hasattr(obj, "cuda_stream"):
        return int(obj.cuda_stream)
    if isinstance(obj, raw.CUstream):
        return int(obj)
    raise TypeError(f"stream: expected a Stream, an int handle or an object with "
                    f"__cuda_stream__, got {type(obj).__name__}")


def stream_handle(obj: StreamLike) -> Any:
    """A ``CUstream`` for the driver from any StreamLike."""
    if isinstance(obj, Stream):
        return obj.handle
    return raw.CUstream(stream_address(obj))


class Event:
    """A CUDA event. ``end - start`` gives elapsed milliseconds between two recorded events."""

    def __init__(self, device: Device | None = None, *, timing: bool = True) -> None:
        self.device = device or Device(0)
        self.device.set_current()
        flags = (raw.CUevent_flags.CU_EVENT_DEFAULT if timing
                 else raw.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        self.timing = timing
        self.handle = cu.cuEventCreate(flags)
        self._finalizer = weakref.finalize(self, _destroy, "cuEventDestroy", self.handle,
                                           self.device.context)

    def record(self, stream: StreamLike) -> "Event":
        cu.cuEventRecord(self.handle, stream_handle(stream))
        return self

    def synchronize(self) -> None:
        cu.cuEventSynchronize(self.handle)

    def query(self) -> bool:
        """True once the work before the record has finished; False while it is pending."""
        result = raw.cuEventQuery(self.handle)[0]
        if result == raw.CUresult.CUDA_ERROR_NOT_READY:
            return False
        return cu.cuEventQuery(self.handle) is None

    def elapsed_ms(self, start: "Event") -> float:
        """Milliseconds from ``start`` to this event; both must be recorded and complete."""
        if not (self.timing and start.timing):
            raise ValueError("elapsed_ms: create both events with timing=True")
        return float(cu.cuEventElapsedTime(start.handle, self.handle))

    def __sub__(self, start: "Event") -> float:
        return self.elapsed_ms(start)

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> "Event":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
