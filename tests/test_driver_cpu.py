"""Specification of the driver layer's host-side logic, testable without a GPU: the error
funnel, launch shapes, argument packing and dtypes."""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from cuda.bindings import driver

from lowlevel_fd.decode.params import DecodeParams
from lowlevel_fd.driver import (ArgPack, CudaError, Device, DeviceArray, LaunchConfig,
                                device_count, driver_version, gpu_available)
from lowlevel_fd.driver import _api, dtypes

from conftest import HAS_GPU

SUCCESS = driver.CUresult.CUDA_SUCCESS
OUT_OF_MEMORY = driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY
INVALID_VALUE = driver.CUresult.CUDA_ERROR_INVALID_VALUE


# -- CudaError and the checked proxy -----------------------------------------------------------
def test_cuda_error_names_the_call_the_result_and_what_to_do():
    with pytest.raises(CudaError, match=r"^cuMemAlloc failed with CUDA_ERROR_OUT_OF_MEMORY \(2\)"
                       r"(: .+)? \[free device memory \(close plans and arrays\) or use smaller "
                       r"sizes\]$") as caught:
        raise CudaError("cuMemAlloc", OUT_OF_MEMORY)
    error = caught.value
    assert (error.function, error.code, error.name) == ("cuMemAlloc", 2,
                                                        "CUDA_ERROR_OUT_OF_MEMORY")
    assert isinstance(error, RuntimeError)


def test_cuda_error_takes_an_explicit_hint():
    with pytest.raises(CudaError, match=r"cuInit failed with CUDA_ERROR_NO_DEVICE \(100\).* "
                       r"\[no NVIDIA driver found\]$"):
        raise CudaError("cuInit", driver.CUresult.CUDA_ERROR_NO_DEVICE, "no NVIDIA driver found")


def test_cuda_error_without_a_known_hint_has_no_brackets():
    error = CudaError("cuCtxSynchronize", driver.CUresult.CUDA_ERROR_NOT_PERMITTED)
    assert str(error).startswith("cuCtxSynchronize failed with CUDA_ERROR_NOT_PERMITTED (800)")
    assert "[" not in str(error)


@pytest.mark.parametrize("returned, value", [
    ((SUCCESS,), None),
    (SUCCESS, None),
    ((SUCCESS, 42), 42),
    ((SUCCESS, "a", "b"), ("a", "b")),
])
def test_unwrap_hands_back_bare_values(returned, value):
    assert _api._unwrap("cuSomething", returned) == value


@pytest.mark.parametrize("returned", [(INVALID_VALUE,), (INVALID_VALUE, 0), INVALID_VALUE])
def test_unwrap_raises_a_cuda_error_naming_the_function(returned):
    with pytest.raises(CudaError, match=r"^cuLaunchKernel failed with CUDA_ERROR_INVALID_VALUE "
                       r"\(1\).*\[an argument is out of range"):
        _api._unwrap("cuLaunchKernel", returned)


@pytest.fixture
def fake_driver(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """The proxy over a fake bindings module: no libcuda needed."""
    calls: list[tuple] = []
    fake = SimpleNamespace(
        cuMemGetInfo=lambda: (SUCCESS, 10, 20),
        cuDeviceGetCount=lambda: (SUCCESS, 3),
        cuCtxSynchronize=lambda: (SUCCESS,),
        cuMemFree=lambda ptr: calls.append(("cuMemFree", ptr)) or (OUT_OF_MEMORY,),
        CUresult=driver.CUresult,
        CU_SOME_CONSTANT=7,
    )
    monkeypatch.setattr(_api, "_driver", fake)
    return SimpleNamespace(proxy=_api._CheckedDriver(), calls=calls)


def test_proxy_returns_bare_values(fake_driver):
    cu = fake_driver.proxy
    assert cu.cuDeviceGetCount() == 3
    assert cu.cuMemGetInfo() == (10, 20)
    assert cu.cuCtxSynchronize() is None


def test_proxy_raises_a_cuda_error_naming_the_failing_function(fake_driver):
    with pytest.raises(CudaError, match=r"^cuMemFree failed with CUDA_ERROR_OUT_OF_MEMORY"):
        fake_driver.proxy.cuMemFree(0x1000)
    assert fake_driver.calls == [("cuMemFree", 0x1000)]


def test_proxy_passes_enums_and_constants_through_and_caches_wrappers(fake_driver):
    cu = fake_driver.proxy
    assert cu.CUresult is driver.CUresult and cu.CU_SOME_CONSTANT == 7
    assert cu.cuDeviceGetCount is cu.cuDeviceGetCount
    assert cu.cuDeviceGetCount.__name__ == "cuDeviceGetCount"


def test_proxy_unknown_function_is_an_attribute_error(fake_driver):
    with pytest.raises(AttributeError, match="cuNoSuchCall"):
        fake_driver.proxy.cuNoSuchCall()


# -- without a GPU -----------------------------------------------------------------------------
@pytest.mark.skipif(HAS_GPU, reason="a GPU is visible")
def test_no_gpu_is_reported_plainly():
    assert gpu_available() is False and device_count() == 0
    assert driver_version() is None or driver_version() >= 11000
    with pytest.raises(CudaError, match=r"^cuInit failed with CUDA_ERROR_NO_DEVICE"):
        Device(0)


# -- launch shapes -----------------------------------------------------------------------------
@pytest.mark.parametrize("grid, block, dims", [
    (7, 128, (7, 1, 1, 128, 1, 1)),
    ((8, 4, 2), (32, 4, 1), (8, 4, 2, 32, 4, 1)),
    ((1, 1, 1), 1, (1, 1, 1, 1, 1, 1)),
    ((8, 4), (64,), (8, 4, 1, 64, 1, 1)),  # shorter tuples are padded with 1
])
def test_launch_config_dims(grid, block, dims):
    assert LaunchConfig(grid, block, shared_mem=1024).dims() == dims


@pytest.mark.parametrize("grid, block", [(0, 128), (4, 0), ((8, 0, 1), 32), ((8, 4, 1, 1), 32),
                                         (4, (32, 4, 1, 1)), (-1, 32)])
def test_launch_config_rejects_empty_or_malformed_shapes(grid, block):
    with pytest.raises(ValueError, match=r"LaunchConfig: expected (positive 3-D grid and block|1 to 3 grid and block extents)"):
        LaunchConfig(grid, block).dims()


# -- argument packing --------------------------------------------------------------------------
STAND_IN_DEVICE = SimpleNamespace(ordinal=0)


@pytest.mark.parametrize("value, ctype, expected", [
    (ctypes.c_int32(-3), ctypes.c_int32, -3),
    (ctypes.c_float(0.5), ctypes.c_float, 0.5),
    (np.int32(7), ctypes.c_int32, 7),
    (np.uint32(2**32 - 1), ctypes.c_uint32, 2**32 - 1),
    (np.int64(-2**40), ctypes.c_int64, -2**40),
    (np.float32(1.5), ctypes.c_float, 1.5),
    (np.float64(2.25), ctypes.c_double, 2.25),
    (np.int8(-1), ctypes.c_int8, -1),
    (None, ctypes.c_uint64, 0),
    (DeviceArray(0xABC00, (4,), "float16", STAND_IN_DEVICE, owner=object()), ctypes.c_uint64,
     0xABC00),
])
def test_argpack_packs_each_kind_of_argument(value, ctype, expected):
    pack = ArgPack(value)
    [slot] = pack.values
    assert type(slot) is ctype and slot.value == expected
    pointers = (ctypes.c_void_p * 1).from_address(pack.address)
    assert pointers[0] == ctypes.addressof(slot), "the block points at the packed value"


def test_argpack_set_rewrites_in_place():
    params = DecodeParams(num_splits=1)
    pack = ArgPack(np.int32(1), None, params)
    addresses = [ctypes.addressof(v) for v in pack.values]
    pack.set(0, 9)
    pack.set(1, DeviceArray(0x2000, (1,), "int8", STAND_IN_DEVICE, owner=object()))
    pack.set(2, DecodeParams(num_splits=5, capacity=64))
    assert [ctypes.addressof(v) for v in pack.values] == addresses
    assert pack.values[0].value == 9 and pack.values[1].value == 0x2000
    assert (pack.values[2].num_splits, pack.values[2].capacity) == (5, 64)


@pytest.mark.parametrize("value", [3, 2.5, True, "x", [1, 2]])
def test_argpack_rejects_python_values_of_ambiguous_width(value):
    with pytest.raises(TypeError, match=r"kernel argument: .*got "
                       rf"{type(value).__name__} .*ambiguous"):
        ArgPack(value)


# -- dtypes ------------------------------------------------------------------------------------
@pytest.mark.parametrize("spelling, expected", [
    ("bfloat16", ml_dtypes.bfloat16),
    ("torch.bfloat16", ml_dtypes.bfloat16),
    ("torch.float16", np.float16),
    ("float32", np.float32),
    (np.int8, np.int8),
    (np.dtype(np.int32), np.int32),
    ("<f2", np.float16),
    (ml_dtypes.bfloat16, ml_dtypes.bfloat16),
])
def test_as_dtype_normalises_spellings(spelling, expected):
    assert dtypes.as_dtype(spelling) == np.dtype(expected)


@pytest.mark.parametrize("spelling", ["complex64", np.complex128, "torch.float8_e4m3fn", "bool"])
def test_as_dtype_rejects_unsupported_types(spelling):
    with pytest.raises(TypeError, match=r"^dtype: expected one of \[.*'bfloat16'.*\], got"):
        dtypes.as_dtype(spelling)


@pytest.mark.parametrize("typestr, expected", [
    ("<V2", ml_dtypes.bfloat16), ("|V2", ml_dtypes.bfloat16), ("<f2", np.float16),
    ("|i1", np.int8), ("<i4", np.int32), ("<f4", np.float32),
])
def test_from_typestr_reads_the_array_interface(typestr, expected):
    assert dtypes.from_typestr(typestr) == np.dtype(expected)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int8, np.int32])
def test_typestr_round_trips(dtype):
    assert dtypes.from_typestr(dtypes.to_typestr(np.dtype(dtype))) == np.dtype(dtype)
