"""The element types lowlevel_fd moves between host and device, as numpy dtypes."""
from __future__ import annotations

import ml_dtypes
import numpy as np

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
int8 = np.dtype(np.int8)
int32 = np.dtype(np.int32)

SUPPORTED = {np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
                                   np.int64, np.uint64, np.float16, np.float32, np.float64)}
SUPPORTED.add(bfloat16)

# torch spells dtypes as "torch.float16"; the adapter maps the suffix.
_BY_NAME = {d.name: d for d in SUPPORTED}


def as_dtype(value: object) -> np.dtype:
    """Normalise a dtype-like (numpy dtype, name, torch dtype) to a supported numpy dtype."""
    if isinstance(value, np.dtype) and value in SUPPORTED:
        return value
    name = str(value).rsplit(".", 1)[-1]
    if name in _BY_NAME:
        return _BY_NAME[name]
    try:
        dtype = np.dtype(value)  # type: ignore[call-overload]
    except TypeError:
        dtype = None
    if dtype is not None and dtype in SUPPORTED:
        return dtype
    raise TypeError(f"dtype: expected one of {sorted(_BY_NAME)}, got {value!r}")


def from_typestr(typestr: str) -> np.dtype:
    """Parse a ``__cuda_array_interface__`` typestr. ``<V2`` is read as bfloat16 (ml_dtypes)."""
    if typestr in ("<V2", "|V2"):
        return bfloat16
    return as_dtype(np.dtype(typestr))


def to_typestr(dtype: np.dtype) -> str:
    return dtype.str
