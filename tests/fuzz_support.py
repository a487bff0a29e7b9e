"""What the fuzz tests share (a plain module: pytest collects nothing here).

Each example starts from a valid configuration, or a valid set of ``run()`` arguments on fake
device memory, and breaks one argument: a wrong shape, dtype or stride, a misaligned pointer or
stride, an output whose elements overlap, a length over the capacity, an unsupported head_dim
or group size, a closed array, an array on another device or over host memory, None, a Python
list, a host (numpy) array, a CPU tensor, another library's array of a type we cannot use or
with a malformed interface. The call must raise ValueError or TypeError whose message is about
that argument (its name opens the message), launch nothing (every launch entry point is
replaced by one that fails the test) and leave the parameter block untouched.

Hypothesis runs derandomized with no example database, so CI runs the same 500 examples per
entry point every time. The cases first found by hand stay pinned one by one in
test_validation_regressions.py.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowlevel_fd.append import runner as append_runner
from lowlevel_fd.core import loader as core_loader
from lowlevel_fd.decode import plan as decode_plan
from lowlevel_fd.driver import CudaError, DeviceArray, Kernel, PreparedLaunch, dtypes
from lowlevel_fd.driver import module as driver_module
from lowlevel_fd.driver._api import cu, raw
from stand_ins import DEVICE, OPEN, OTHER_DEVICE, Owner, contiguous_strides, fake

EXAMPLES = 500
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                       HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
SCALES = [("tensor", "float32"), ("head", "float32"), ("token", "float32"), ("token", "float16")]
LAYOUTS = ("bnsh", "bsnh")
DTYPES = ("float16", "bfloat16")
ROPES = (None, "neox", "gptj")
ALL_DTYPES = sorted(d.name for d in dtypes.SUPPORTED)
PARTNERS = {"k_cache": ("v_cache",), "v_cache": ("k_cache",), "k_scale": ("v_scale",),
            "v_scale": ("k_scale",), "k": ("v",), "v": ("k",), "k_new": ("v_new",),
            "v_new": ("k_new",)}


# -- stand-ins: no GPU behind any of them (the device and fake memory are tests/stand_ins.py's)
class StandInKernel:
    """A loaded kernel as plan() sees it; ``prepare`` is the real packing."""
    handle = None
    num_registers = local_bytes = static_shared_bytes = 0
    prepare = Kernel.prepare

    def occupancy(self, block_threads: int, dynamic_shared: int = 0) -> int:
        return 2


class CpuTensor:
    """A torch CPU tensor as lowlevel_fd sees it: asking for the device interface fails."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape, self.is_cuda = shape, False

    @property
    def __cuda_array_interface__(self) -> dict:
        raise AttributeError("Can't get __cuda_array_interface__ on non-CUDA tensor type")

    def __repr__(self) -> str:
        return f"CpuTensor{self.shape}"


class ForeignArray:
    """Another library's array: its __cuda_array_interface__, less the keys in ``drop``."""

    def __init__(self, shape: tuple[int, ...], typestr: str, ptr: int, drop: str = "") -> None:
        interface = {"shape": shape, "typestr": typestr, "version": 3, "data": (ptr, False),
                     "strides": None}
        self.__cuda_array_interface__ = {k: v for k, v in interface.items() if k != drop}

    def __repr__(self) -> str:
        return f"ForeignArray({self.__cuda_array_interface__!r})"


class LaunchAttempted(AssertionError):
    """Raised by every launch entry point's stand-in: invalid input reached a launch."""


@pytest.fixture(autouse=True)
def nothing_launches(monkeypatch: pytest.MonkeyPatch):
    """Replace every way to compile, load or launch a kernel with one that fails the test; any
    foreign pointer is host memory (what cuPointerGetAttribute says of one)."""
    calls: list[str] = []

    def refuse(what: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> None:
            calls.append(what)
            raise LaunchAttempted(f"{what} was called: an invalid input reached a launch")
        return refused

    monkeypatch.setattr(PreparedLaunch, "launch", refuse("PreparedLaunch.launch"))
    monkeypatch.setattr(driver_module, "launch", refuse("driver.module.launch"))
    monkeypatch.setattr(append_runner.KernelRunner, "_launch", refuse("KernelRunner._launch"))
    monkeypatch.setattr(core_loader, "load_kernels", refuse("core.loader.load_kernels"))
    monkeypatch.setattr(decode_plan, "load_kernels", refuse("decode.plan.load_kernels"))
    monkeypatch.setattr(append_runner, "load_kernels", refuse("append.runner.load_kernels"))
    for name in ("cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel",
                 "cuGraphLaunch"):
        monkeypatch.setattr(cu, name, refuse(name), raising=False)
    not_device_memory = CudaError("cuPointerGetAttribute",
                                  raw.CUresult.CUDA_ERROR_INVALID_VALUE)

    def host_pointer(attribute: Any, ptr: int) -> None:
        raise not_device_memory

    monkeypatch.setattr(cu, "cuPointerGetAttribute", host_pointer, raising=False)
    yield calls
    assert not calls, f"launch entry points were called: {calls}"


REAL_PREPARED_LAUNCH = PreparedLaunch.launch
REAL_RUNNER_LAUNCH = append_runner.KernelRunner._launch


# -- helpers -----------------------------------------------------------------------------------
def fuzz(strategy: st.SearchStrategy, check: Callable[[Any], None]) -> int:
    """Run ``check`` on FUZZ's examples of ``strategy``; returns how many examples ran."""
    ran = [0]

    @FUZZ
    @given(strategy)
    def run(example: Any) -> None:
        ran[0] += 1
        check(example)

    run()
    return ran[0]


def assert_rejected(call: Callable[[], Any], names: tuple[str, ...], context: Any = "") -> str:
    """``call`` raises ValueError/TypeError whose message opens with one of ``names``."""
    try:
        call()
    except (ValueError, TypeError) as exc:
        message = str(exc)
    else:
        raise AssertionError(f"accepted, expected an error about {names[0]} ({context})")
    subject = message.split(":", 1)[0]
    assert any(re.search(rf"(?<![\w.]){re.escape(n)}(?!\w)", subject) for n in names), (
        f"the message is not about {' or '.join(names)}: {message!r} ({context})")
    return message


def shifted(array: DeviceArray, by: int) -> DeviceArray:
    return DeviceArray(array.ptr + by, array.shape, array.dtype.name, DEVICE, array.strides,
                       owner=OPEN)


def restrided(array: DeviceArray, strides: tuple[int, ...]) -> DeviceArray:
    return DeviceArray(array.ptr, array.shape, array.dtype.name, DEVICE, strides, owner=OPEN)


class Pointers:
    """Distinct 256-byte aligned fake device addresses."""

    def __init__(self) -> None:
        self.last = 1 << 32

    def __call__(self) -> int:
        self.last += 1 << 28
        return self.last


@dataclass(frozen=True)
class Spec:
    """What an array argument must be: the contract the fuzzing breaks one clause of."""
    dtypes: tuple[str, ...]
    shape: tuple[int | None, ...]    # None: any extent (fixed by another argument)
    align: int = 1                   # of the data pointer, in bytes (at least the itemsize)
    stride_align: int = 1            # of the byte strides of aligned_axes
    aligned_axes: tuple[int, ...] = ()
    dense: bool = False              # C-contiguous; otherwise only the last dimension
    written: bool = False            # an output: no two elements may share bytes
    optional: bool = False


@dataclass
class Broken:
    """One broken call: the arguments with one of them broken, and who must be named."""
    target: str
    kind: str
    arguments: dict[str, Any]
    names: tuple[str, ...]

    def __repr__(self) -> str:
        shown = {name: self.arguments[name] for name in (self.target,) + self.names
                 if name in self.arguments}
        return f"Broken({self.target}: {self.kind} -> {shown!r})"


# Which argument to break and how, drawn before anything else: hypothesis spreads its first
# draws well, and later ones, behind dozens of setup draws, much less.
PICKS = st.tuples(st.sampled_from(range(720)), st.sampled_from(range(720)))


def outer_axes(array: DeviceArray) -> list[int]:
    """The axes but the last with two entries or more: where strides can make rows overlap."""
    return [axis for axis in range(array.ndim - 1) if array.shape[axis] > 1]


def overlapping_strides(draw: st.DrawFn, array: DeviceArray) -> tuple[int, ...]:
    """``array``'s strides with an outer axis broadcast (stride 0) or stepping like the axis
    inside it, so two elements share bytes."""
    axis = draw(st.sampled_from(outer_axes(array)))
    inner = array.strides[axis + 1] if array.shape[axis + 1] > 1 else 0
    strides = list(array.strides)
    strides[axis] = draw(st.sampled_from(sorted({0, inner})))
    return tuple(strides)


@st.composite
def broken_array(draw: st.DrawFn, good: DeviceArray, spec: Spec, pick: int | None = None
                 ) -> tuple[str, Any]:
    """(kind, value): ``good`` with one clause of ``spec`` broken (kind number ``pick``)."""
    shape, item = good.shape, good.itemsize
    kinds = ["host", "list", "scalar", "cpu tensor", "foreign dtype", "malformed interface",
             "host memory", "closed", "other device", "dtype", "ndim"]
    if not spec.optional:
        kinds.append("none")
    fixed = [axis for axis, extent in enumerate(spec.shape) if extent is not None]
    if fixed:
        kinds.append("extent")
    if good.size > 1 if spec.dense else shape[-1] > 1:
        kinds.append("stride")
    if spec.align > 1:
        kinds.append("misaligned")
    stride_axes = [axis for axis in spec.aligned_axes if shape[axis] > 1]
    if spec.stride_align > item and stride_axes:
        kinds.append("misaligned stride")
    if item > 1 and any(extent > 1 for extent in shape):
        kinds.append("element stride")
    if spec.written and outer_axes(good):
        kinds.append("overlap")
    kind = kinds[pick % len(kinds)] if pick is not None else draw(st.sampled_from(kinds))

    def like(**changes: Any) -> DeviceArray:
        fields = {"ptr": good.ptr, "shape": shape, "dtype": good.dtype.name,
                  "strides": good.strides, "device": DEVICE, "owner": OPEN} | changes
        return DeviceArray(fields["ptr"], fields["shape"], fields["dtype"], fields["device"],
                           fields["strides"], owner=fields["owner"])

    if kind == "none":
        return kind, None
    if kind == "host":
        return kind, np.zeros(shape if good.size <= 4096 else (2, 2), good.dtype)
    if kind == "list":
        return kind, np.zeros(shape).tolist() if good.size <= 4096 else [0, 1, 2]
    if kind == "scalar":
        return kind, draw(st.sampled_from([0, 1, 0.5, "array", b"", {"ptr": 16}, good.ptr]))
    if kind == "cpu tensor":
        return kind, CpuTensor(shape)
    if kind == "foreign dtype":
        typestr = draw(st.sampled_from(["<c8", "<c16", "|b1", "<M8[s]", "|O", "not-a-type"]))
        return kind, ForeignArray(shape, typestr, good.ptr)
    if kind == "malformed interface":
        drop = draw(st.sampled_from(["data", "shape", "typestr"]))
        return kind, ForeignArray(shape, good.dtype.str, good.ptr, drop=drop)
    if kind == "host memory":  # a valid interface, but the pointer is not device memory
        return kind, ForeignArray(shape, good.dtype.str, good.ptr)
    if kind == "closed":
        return kind, like(owner=draw(st.sampled_from([None, Owner(True)])))
    if kind == "other device":
        return kind, like(device=OTHER_DEVICE)
    if kind == "dtype":
        wrong = draw(st.sampled_from([d for d in ALL_DTYPES if d not in spec.dtypes]))
        return kind, like(dtype=wrong, strides=contiguous_strides(
            shape, dtypes.as_dtype(wrong).itemsize))
    if kind == "ndim":
        new = list(shape)
        if len(new) >= 2 and draw(st.booleans()):
            del new[draw(st.integers(0, len(new) - 1))]
        else:
            new.insert(draw(st.integers(0, len(new))), draw(st.integers(1, 3)))
        return kind, like(shape=tuple(new), strides=contiguous_strides(tuple(new), item))
    if kind == "extent":
        axis = draw(st.sampled_from(fixed))
        required = spec.shape[axis]
        extent = draw(st.integers(0, 2 * required + 4).filter(lambda e: e != required))
        new = shape[:axis] + (extent,) + shape[axis + 1:]
        return kind, like(shape=new, strides=contiguous_strides(new, item))
    if kind == "stride":
        strides = list(good.strides)
        if spec.dense:  # spread one axis (and the ones outside it) apart
            axis = draw(st.sampled_from([a for a, e in enumerate(shape) if e > 1]))
            factor = draw(st.integers(2, 3))
            strides = [s * factor if a <= axis else s for a, s in enumerate(strides)]
        else:  # the last dimension strided, broadcast or reversed
            factor = draw(st.sampled_from([2, 3, 0, -1]))
            strides[-1] = item * factor
        return kind, like(strides=tuple(strides))
    if kind == "misaligned":
        return kind, like(ptr=good.ptr + draw(st.integers(1, spec.align - 1)))
    if kind == "overlap":
        return kind, like(strides=overlapping_strides(draw, good))
    strides = list(good.strides)
    if kind == "element stride":  # one byte more: elements straddle their natural alignment
        strides[draw(st.sampled_from([a for a, e in enumerate(shape) if e > 1]))] += 1
    else:  # misaligned stride: one element more
        strides[draw(st.sampled_from(stride_axes))] += item
    return kind, like(strides=tuple(strides))


@st.composite
def bad_host_lengths(draw: st.DrawFn, count: int, limit: int, *, exact: bool = True
                     ) -> tuple[str, Any]:
    """(kind, value): host lengths that are not ``count`` (``exact``, else 1 to ``count``)
    integers in [0, limit]."""
    kind = draw(st.sampled_from(["beyond", "negative", "length", "floats", "2-D", "ragged",
                                 "strings", "bools", "none", "objects", "device array"]))
    valid = draw(st.lists(st.integers(0, limit), min_size=count, max_size=count))
    if kind in ("beyond", "negative") and valid:
        position = draw(st.integers(0, count - 1))
        valid[position] = draw(st.integers(limit + 1, 2**62) if kind == "beyond"
                               else st.integers(-2**62, -1))
        return kind, draw(st.sampled_from([valid, np.asarray(valid, np.int64)]))
    if kind == "length" or not valid:
        sizes = st.integers(0, count + 3).filter(lambda n: n != count) if exact else (
            st.just(0) | st.integers(count + 1, count + 4))
        return "length", [0] * draw(sizes)
    if kind == "floats":
        return kind, [float(v) for v in valid]
    if kind == "2-D":
        return kind, np.asarray(valid, np.int64).reshape(count, 1).repeat(2, axis=1)
    if kind == "ragged":  # numpy cannot make an array of these
        return kind, [[v] for v in valid] + [[0, 1]]
    if kind == "strings":
        return kind, [str(v) for v in valid]
    if kind == "bools":
        return kind, [bool(v % 2) for v in valid]
    if kind == "none":
        return kind, None
    if kind == "objects":
        return kind, [None] + valid[1:]
    return kind, fake((count,), "int32", ptr=1 << 32)


def mutate(draw: st.DrawFn, pick: tuple[int, int], goods: dict[str, Any],
           specs: dict[str, Spec], arguments: dict[str, Any], targets: list[str],
           special: Callable[[str], tuple[str, dict[str, Any], tuple[str, ...]]] | None = None,
           partners: dict[str, tuple[str, ...]] = PARTNERS) -> Broken:
    """Break one argument: ``targets`` names arrays of ``specs`` or special cases."""
    target = targets[pick[0] % len(targets)]
    if target in specs:
        kind, value = draw(broken_array(goods[target], specs[target], pick[1]))
        return Broken(target, kind, arguments | {target: value},
                      (target,) + partners.get(target, ()))
    assert special is not None
    kind, changes, names = special(target)
    return Broken(target, kind, arguments | changes, names)
