"""A plan's device error word: the bits its kernels set (support.ERROR_*), read in stream order.

The bits are sticky: a kernel ORs them in and only the host clears them. ``read`` waits for the
work already enqueued on the stream (not for the whole device), and the clear is a memset on
that stream, so it lands before the plan's next launch there.
"""
from __future__ import annotations

import numpy as np

from ..driver import Device, DeviceArray
from ..driver.stream import StreamLike


class ErrorWord:
    def __init__(self, device: Device) -> None:
        # Zeroed synchronously: a first launch on any stream may set a bit.
        self.array = DeviceArray.full(1, 0, np.uint32, device)

    @property
    def ptr(self) -> int:
        return self.array.ptr

    def read(self, stream: StreamLike, clear: bool) -> int:
        value = int(self.array.numpy(stream=stream)[0])
        if clear:
            self.array.fill(0, stream)
        return value

    def close(self) -> None:
        self.array.close()
