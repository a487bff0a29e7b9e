"""The driver layer on a real GPU: memory, interop, events, graphs, launches, errors."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from lowlevel_fd.compiler import CompileOptions, compile_source
from lowlevel_fd.driver import (ArgPack, CudaError, DeviceArray, Event, LaunchConfig, Module,
                                Stream, as_device_array, capture, launch, pinned_empty)

pytestmark = pytest.mark.gpu

AXPB = r"""
extern "C" __global__ void axpb(float* y, const float* x, float a, int b, long long n,
                                double c) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + (float)b + (float)c;
}
"""


@pytest.fixture(scope="module")
def axpb(device):
    program = compile_source(AXPB, "axpb.cu", CompileOptions(arch=device.arch))
    with Module(program.cubin, device) as module:
        yield module.get_kernel("axpb")


@pytest.mark.parametrize("nbytes", [1, 3, 17, 4096, 65537, 10**6 + 3, 2**30])
def test_round_trip_sizes(rng, nbytes):
    host = rng.integers(0, 256, nbytes, dtype=np.uint8)
    with DeviceArray.from_numpy(host) as array:
        assert np.array_equal(array.numpy(), host)


def test_async_round_trip_through_pinned_memory(rng, stream):
    host = pinned_empty((1000, 3), np.float32)
    host[...] = rng.standard_normal((1000, 3))
    back = pinned_empty((1000, 3), np.float32)
    with DeviceArray.empty((1000, 3), np.float32) as array:
        array.copy_from_numpy(host, stream=stream)
        array.copy_to_host_async(back, stream)
        stream.synchronize()
    assert np.array_equal(back, host)


def test_views_fill_and_strided_download(rng):
    host = rng.standard_normal((6, 5, 4)).astype(np.float16)
    array = DeviceArray.from_numpy(host)
    assert np.array_equal(array[1:5:2, :, 1].numpy(), host[1:5:2, :, 1])
    assert np.array_equal(array[-1].numpy(), host[-1])
    array[2].fill(float("nan"))
    assert np.isnan(array.numpy()[2]).all() and not np.isnan(array.numpy()[3]).any()


def test_torch_interop_both_ways(rng):
    torch = pytest.importorskip("torch")
    tensor = torch.randn(4, 8, device="cuda", dtype=torch.float16)
    wrapped = as_device_array(tensor)
    assert wrapped.ptr == tensor.data_ptr() and wrapped.shape == (4, 8)
    assert np.array_equal(wrapped.numpy(), tensor.cpu().numpy())
    bf16 = torch.randn(3, 5, device="cuda", dtype=torch.bfloat16)[:, 1:]
    wrapped_bf16 = as_device_array(bf16)
    assert wrapped_bf16.dtype.name == "bfloat16" and wrapped_bf16.strides == (10, 2)
    host = rng.standard_normal((7, 3)).astype(np.float32)
    ours = DeviceArray.from_numpy(host)
    seen_by_torch = torch.as_tensor(ours, device="cuda")
    assert seen_by_torch.data_ptr() == ours.ptr
    seen_by_torch.mul_(2)  # zero copy: our array sees the change
    torch.cuda.synchronize()
    assert np.allclose(ours.numpy(), 2 * host)


def test_event_timing_and_query(stream, axpb):
    x = DeviceArray.full(1 << 20, 1.0, np.float32)
    y = DeviceArray.empty(1 << 20, np.float32)
    start, end = Event(), Event()
    start.record(stream)
    for _ in range(10):
        launch(stream, LaunchConfig(4096, 256), axpb, y, x, ctypes.c_float(2.0),
               np.int32(1), np.int64(1 << 20), np.float64(0.5))
    end.record(stream)
    end.synchronize()
    assert end.query() is True
    assert 0 < end - start < 1000
    assert np.all(y.numpy() == 3.5)
    with pytest.raises(ValueError, match="timing=True"):
        Event(timing=False).elapsed_ms(start)


def test_argument_packing_int_float_pointer(stream, axpb, rng):
    host = rng.standard_normal(1000).astype(np.float32)
    x, y = DeviceArray.from_numpy(host), DeviceArray.empty(1000, np.float32)
    prepared = axpb.prepare(LaunchConfig(4, 256), y, x, np.float32(-1.5), np.int32(7),
                            np.int64(1000), np.float64(0.25))
    prepared.launch(stream)
    stream.synchronize()
    np.testing.assert_allclose(y.numpy(), -1.5 * host + 7.25, rtol=1e-6)
    prepared.args.set(2, 3.0)  # rewrite one field in place; no repacking
    prepared.launch(stream)
    stream.synchronize()
    np.testing.assert_allclose(y.numpy(), 3.0 * host + 7.25, rtol=1e-6)
    with pytest.raises(TypeError, match="ambiguous"):
        ArgPack(y, 3)


def test_graph_replay_sees_new_inputs(stream, axpb, rng):
    x, y = DeviceArray.empty(512, np.float32), DeviceArray.empty(512, np.float32)
    with capture(stream) as graph:
        launch(stream, LaunchConfig(2, 256), axpb, y, x, np.float32(2), np.int32(0),
               np.int64(512), np.float64(0))
    assert graph.node_count == 1
    assert graph.node_kinds() == {"kernel": 1}
    graph.upload(stream)
    for _ in range(3):
        host = rng.standard_normal(512).astype(np.float32)
        x.copy_from_numpy(host)
        graph.launch(stream)
        stream.synchronize()
        np.testing.assert_allclose(y.numpy(), 2 * host, rtol=1e-6)
    graph.close()


def test_bad_launch_configuration_raises(stream, axpb):
    y = DeviceArray.empty(4, np.float32)
    with pytest.raises(CudaError, match="cuLaunchKernel failed with CUDA_ERROR_INVALID_VALUE"):
        launch(stream, LaunchConfig(1, 4096), axpb, y, y, np.float32(1), np.int32(0),
               np.int64(4), np.float64(0))


def test_borrowed_stream_is_not_destroyed(stream):
    borrowed = Stream.borrow(stream)
    borrowed.close()
    stream.synchronize()  # still valid
    assert stream.query() is True
