"""Stand-ins for tests without a GPU: a device that never reaches the driver and fake device
memory (DeviceArrays over made-up addresses). Plans built on them run every host-side check;
nothing they do may reach the GPU."""
from __future__ import annotations

import itertools
from typing import Any

from lowlevel_fd.driver import DeviceArray, dtypes
from lowlevel_fd.driver.memory import _contiguous_strides as contiguous_strides


class StandInDevice:
    """Enough of a Device for code that never reaches the GPU: the checks compare identity."""

    arch, compute_capability, sm_count = "sm_90", (9, 0), 132
    memory_bandwidth = 3.352e12  # an H100 SXM's, as DeviceInfo computes it

    def __init__(self, ordinal: int = 0) -> None:
        self.ordinal = ordinal

    def __repr__(self) -> str:
        return f"StandInDevice({self.ordinal})"


DEVICE, OTHER_DEVICE = StandInDevice(0), StandInDevice(1)


class Owner:
    """The owner of fake device memory: an Allocation, open or closed."""

    def __init__(self, closed: bool) -> None:
        self.closed = closed


OPEN = Owner(False)
_addresses = itertools.count(1 << 24, 1 << 20)  # distinct, 1 MiB apart: every alignment holds


def fake(shape: tuple[int, ...], dtype: str, *, ptr: int | None = None,
         strides: tuple[int, ...] | None = None, pool: tuple[int, ...] | None = None,
         device: Any = DEVICE, owner: Any = OPEN) -> DeviceArray:
    """Fake device memory: at ``ptr`` (default: a fresh address), a view of ``pool``
    (default: contiguous) unless ``strides`` are given."""
    itemsize = dtypes.as_dtype(dtype).itemsize
    strides = strides or contiguous_strides(tuple(pool or shape), itemsize)
    return DeviceArray(next(_addresses) if ptr is None else ptr, tuple(shape), dtype, device,
                       strides, owner=owner)
