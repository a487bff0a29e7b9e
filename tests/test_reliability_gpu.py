"""Reliability on the GPU (issue 6): no leaks, clear errors after a fault, device-side guards of
lengths beyond the cache capacity, bitwise determinism across runs and graph replay."""
from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from decode_case import Case

from lowlevel_fd import ERROR_OUTSIDE_CACHE, ERROR_PROMPT_LENGTH
from lowlevel_fd.append import AppendPlan, PromptQuantizer
from lowlevel_fd.append.reference import append_ref, prompt_ref
from lowlevel_fd.decode import DecodePlan, TileConfig
from lowlevel_fd.driver import DeviceArray, Event, Stream, capture

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
DEVICE_TOLERANCE = 4 * MiB  # cuMemGetInfo moves in 2 MiB pages: two pages of slack
RSS_TOLERANCE = 64 * MiB    # allocator arenas and interned objects; a per-object leak is far more
MODES = [("tensor", "float32"), ("head", "float32"), ("token", "float32"), ("token", "float16")]


# -- leaks --------------------------------------------------------------------------------------
def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def usage(device: Any) -> tuple[int, int]:
    """(free device memory from cuMemGetInfo, process RSS), after a collection and a sync."""
    gc.collect()
    device.synchronize()
    return device.memory_info()[0], resident_bytes()


class Workload:
    """Small inputs shared by the plans of the leak test (allocated before the baseline)."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.lengths = [4097, 1, 300, 2048]  # splits > 1: the largest workspace
        self.case = Case.random(rng, self.lengths, num_q_heads=32, num_kv_heads=8)
        self.case.upload()
        shape = (4, 8, 128)
        self.k_new = DeviceArray.from_numpy(rng.standard_normal(shape).astype(np.float16))
        self.v_new = DeviceArray.from_numpy(rng.standard_normal(shape).astype(np.float16))
        self.prompt = DeviceArray.from_numpy(rng.standard_normal((4, 16, 8, 128)).astype(
            np.float16))
        self.append_lens = DeviceArray.from_numpy(np.array([0, 5, 100, 4000], np.int32))
        self.target = DeviceArray.empty(1024, np.float32)

    def cache_args(self) -> tuple[DeviceArray, ...]:
        d = self.case.device
        return d["k"], d["v"], d["k_scale"], d["v_scale"]


def decode_plan_cycle(work: Workload, stream: Stream, i: int) -> None:
    plan = DecodePlan.create(32, 8, 128, max_batch=4, max_seq_len=work.case.capacity)
    plan.plan(work.lengths)
    if i % 2:
        plan.close()  # the other half is dropped: the finalizer frees the workspace


def append_plan_cycle(work: Workload, stream: Stream, i: int) -> None:
    if i % 2:
        plan = AppendPlan.create(32, 8, 128, max_batch=4)
        plan.run(work.k_new, work.v_new, *work.cache_args(), work.append_lens, stream=stream)
    else:
        plan = PromptQuantizer.create(8, 128, max_batch=4)
        plan.run(work.prompt, work.prompt, *work.cache_args(), work.append_lens, stream=stream)
    stream.synchronize()
    if i % 4 < 2:
        plan.close()


def device_array_cycle(work: Workload, stream: Stream, i: int) -> None:
    array = DeviceArray.empty((256, 4 + i % 7), np.float32)
    view = array[1:, 2:]  # views share the allocation and must not keep extra memory
    assert view.ptr > array.ptr
    if i % 2:
        array.close()


def stream_cycle(work: Workload, stream: Stream, i: int) -> None:
    created = Stream(priority=-(i % 2))
    if i % 2:
        created.close()


def event_cycle(work: Workload, stream: Stream, i: int) -> None:
    event = Event(timing=bool(i % 2)).record(stream)
    event.synchronize()
    if i % 3:
        event.close()


def graph_cycle(work: Workload, stream: Stream, i: int) -> None:
    with capture(stream) as graph:
        work.target.fill(float(i), stream)
    graph.launch(stream)
    stream.synchronize()
    if i % 2:
        graph.close()


LEAK_CASES = {
    "1000 DecodePlans (plan + close)": (1000, decode_plan_cycle),
    "1000 AppendPlans and PromptQuantizers (run + close)": (1000, append_plan_cycle),
    "10000 DeviceArrays": (10_000, device_array_cycle),
    "10000 Streams": (10_000, stream_cycle),
    "10000 Events": (10_000, event_cycle),
    "1000 CUDA graphs": (1000, graph_cycle),
}


@pytest.mark.parametrize("count, cycle", LEAK_CASES.values(), ids=LEAK_CASES.keys())
def test_creating_and_closing_leaves_memory_at_baseline(rng, device, stream, count, cycle):
    """After a warm-up (the first plan compiles, loads its module and sizes caches), ``count``
    objects are created, used and released: half by ``close()``, half dropped to their
    finalizers. Free device memory (cuMemGetInfo) must end within 4 MiB of the baseline and
    the process RSS (/proc/self/statm) within 64 MiB above it."""
    work = Workload(rng)
    for i in range(8):  # warm-up: compile, load, first-use allocations of the driver
        cycle(work, stream, i)
    free_before, rss_before = usage(device)
    for i in range(count):
        cycle(work, stream, i)
    free_after, rss_after = usage(device)
    assert abs(free_after - free_before) <= DEVICE_TOLERANCE, (
        f"free device memory moved by {(free_after - free_before) / MiB:+.1f} MiB over "
        f"{count} cycles (tolerance 4 MiB)")
    assert rss_after - rss_before <= RSS_TOLERANCE, (
        f"RSS grew by {(rss_after - rss_before) / MiB:.1f} MiB over {count} cycles "
        f"(tolerance 64 MiB)")


# -- faults: a separate process, since a faulting kernel poisons its context --------------------
CHILD = r'''
import json, sys
import numpy as np
from cuda.bindings import driver as raw
from lowlevel_fd import CudaError, DecodePlan, Device, DeviceArray, Stream
from lowlevel_fd.compiler import CompileOptions, compile_source
from lowlevel_fd.driver import LaunchConfig, Module, launch

FAULTS = {
    "illegal_address": "*reinterpret_cast<volatile int*>(0x10) = 1;",
    "trap": "__trap();",
}
fault = sys.argv[1]
device = Device(0)
stream = Stream(device)
B, HQ, HKV, D, S = 2, 8, 2, 128, 64
rng = np.random.default_rng(0)
plan = DecodePlan.create(HQ, HKV, D, max_batch=B, max_seq_len=S).plan([S, 5])
cache = lambda: DeviceArray.from_numpy(rng.integers(-127, 128, (B, HKV, S, D), dtype=np.int8))
scale = lambda: DeviceArray.from_numpy(np.full((B, HKV, S), 0.01, np.float32))
args = (DeviceArray.from_numpy(rng.standard_normal((B, HQ, D)).astype(np.float16)), cache(),
        cache(), scale(), scale(), DeviceArray.from_numpy(np.array([S, 5], np.int32)),
        DeviceArray.empty((B, HQ, D), np.float16))
plan.run(*args, stream=stream)
stream.synchronize()  # everything works before the fault

# The user's kernel, on the same (primary) context, faults.
source = 'extern "C" __global__ void fault(int* unused) { %s }' % FAULTS[fault]
kernel = Module(compile_source(source, "fault.cu", CompileOptions(arch=device.arch)).cubin,
                device).get_kernel("fault")
user_stream = Stream(device)
launch(user_stream, LaunchConfig(1, 1), kernel, None)
observed = raw.cuStreamSynchronize(user_stream.handle)[0]  # the user's own, unchecked, sync

def attempt(call):
    try:
        call()
    except CudaError as exc:
        return {"error": "CudaError", "function": exc.function, "name": exc.name,
                "message": str(exc)}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}

calls = {
    "DecodePlan.run": lambda: (plan.run(*args, stream=stream), stream.synchronize()),
    "DecodePlan.plan (new plan)": lambda: DecodePlan.create(HQ, HKV, D, max_batch=B,
                                                            max_seq_len=S).plan([3, 4]),
    "DeviceArray.copy_from_numpy": lambda: args[0].copy_from_numpy(
        np.zeros((B, HQ, D), np.float16)),
    "DeviceArray.numpy": lambda: args[6].numpy(),
    "DecodePlan.error_flags": lambda: plan.error_flags(stream=stream),
}
print(json.dumps({"observed": getattr(observed, "name", str(observed)),
                  "calls": {name: attempt(call) for name, call in calls.items()}}))
'''
FAULT_NAMES = {"illegal_address": {"CUDA_ERROR_ILLEGAL_ADDRESS"},
               "trap": {"CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_ILLEGAL_INSTRUCTION"}}
# Errors whose CudaError message says the context is lost and the process must restart.
RESTART_HINT = {"CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED"}


@pytest.mark.parametrize("fault", FAULT_NAMES)
def test_after_a_users_kernel_faults_every_call_raises_a_clear_cuda_error(fault):
    """A user's kernel on our context writes to address 0x10 (or traps). In a child process,
    every later call of ours that touches the device raises CudaError naming the driver
    function and the error, and the process exits on its own within 60 s."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    try:
        child = subprocess.run([sys.executable, "-c", CHILD, fault], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the process hung after the fault (no exit within 60 s): {exc.stderr!r}")
    assert child.returncode == 0, child.stderr[-4000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    expected = FAULT_NAMES[fault]
    assert report["observed"] in expected, report
    for call, outcome in report["calls"].items():
        assert outcome["error"] == "CudaError", f"{call}: {outcome}"
        assert outcome["name"] in expected, f"{call}: {outcome}"
        assert re.match(rf"cu\w+ failed with {outcome['name']} \(\d+\)", outcome["message"]), (
            f"{call}: the message names the driver function and the error: {outcome}")
        if outcome["name"] in RESTART_HINT:
            assert "restart" in outcome["message"], f"{call}: says what to do: {outcome}"


# -- device-side guards: lengths beyond the capacity ----------------------------------------------
def poisoned_pool(cache: np.ndarray, tail: int, axis: int, fill: Any) -> np.ndarray:
    """``cache`` followed along ``axis`` by ``tail`` rows of ``fill``: a read or write past
    the capacity shows up as NaN in the output or as a changed tail."""
    shape = list(cache.shape)
    shape[axis] = tail
    return np.concatenate([cache, np.full(shape, fill, cache.dtype)], axis=axis)


def prefix(array: Any, axis: int, length: int) -> Any:
    """The first ``length`` entries of ``axis``: a strided view into the pool (a DeviceArray
    or a numpy array alike, so host writes through it land in the pool)."""
    return array[(slice(None),) * axis + (slice(0, length),)]


@pytest.mark.parametrize("config", [None, TileConfig(4, 5, 16, True), TileConfig(4, 5, 16, False)],
                         ids=["planned", "5 splits fused merge", "5 splits combine kernel"])
@pytest.mark.parametrize("kv_layout", ["bnsh", "bsnh"])
def test_decode_clamps_device_lengths_to_the_capacity_and_flags_them(rng, stream, kv_layout,
                                                                      config):
    # 83 = 5 tiles of 16 and 3 tokens: the last tile straddles the capacity.
    capacity, tail = 83, 48
    device_lengths = [capacity, capacity + 1, 10**6, 2**31 - 1, -5, 17]
    clamped = [min(max(n, 0), capacity) for n in device_lengths]
    case = Case.random(rng, clamped, num_q_heads=8, num_kv_heads=2, capacity=capacity,
                       kv_layout=kv_layout)
    d = case.upload()
    token_axis = 2 if kv_layout == "bnsh" else 1
    for name in ("k", "v"):  # int8 extremes past the capacity
        pool = DeviceArray.from_numpy(poisoned_pool(case.host[name], tail, token_axis, 127))
        d[name] = prefix(pool, token_axis, capacity)
    for name in ("k_scale", "v_scale"):  # NaN scales past the capacity
        pool = DeviceArray.from_numpy(poisoned_pool(case.host[name], tail, 2, np.nan))
        d[name] = prefix(pool, 2, capacity)
    d["seq_lens"].copy_from_numpy(np.array(device_lengths, np.int32))
    with case.make_plan() as plan:
        out, lse = case.run(plan, stream, config=config)
        assert plan.error_flags(stream=stream) & ERROR_OUTSIDE_CACHE, (
            "a length beyond the capacity sets ERROR_OUTSIDE_CACHE")
        assert plan.error_flags(stream=stream) == 0, "reading the flags clears them"
        case.check(out, lse)  # as if the lengths were clamped: no NaN read from the tail
        d["seq_lens"].copy_from_numpy(np.array(clamped, np.int32))
        case.check(*case.run(plan, stream, config=config, replan=False))
        assert plan.error_flags(stream=stream) == 0, "lengths within the capacity set no flag"


def test_decode_guard_holds_under_graph_replay(rng, stream):
    capacity = 96
    case = Case.random(rng, [capacity, capacity, 3], num_q_heads=16, num_kv_heads=4,
                       capacity=capacity)
    d = case.upload()
    with case.make_plan() as plan:
        plan.plan([capacity] * 3)
        with capture(stream) as graph:
            plan.run(d["q"], d["k"], d["v"], d["k_scale"], d["v_scale"], d["seq_lens"],
                     d["out"], lse=d["lse"], stream=stream)
        for device_lengths in ([capacity, 7, 0], [capacity + 1, -1, 2**31 - 1], [5, 6, 7]):
            clamped = [min(max(n, 0), capacity) for n in device_lengths]
            case.lengths, case.host["seq_lens"] = clamped, np.array(clamped, np.int32)
            d["seq_lens"].copy_from_numpy(np.array(device_lengths, np.int32))
            d["out"].fill(float("nan"))
            d["lse"].fill(float("nan"))
            graph.launch(stream)
            stream.synchronize()
            case.check(d["out"].numpy().astype(np.float64), d["lse"].numpy().astype(np.float64))
            flagged = bool(plan.error_flags(stream=stream) & ERROR_OUTSIDE_CACHE)
            assert flagged == (device_lengths != clamped)
        graph.close()


def kv_pools(rng, *, batch, heads, head_dim, capacity, tail, kv_layout, scale_mode,
             scale_dtype) -> dict[str, np.ndarray]:
    """Host caches and scales as pools ``tail`` tokens longer than the capacity: random int8
    caches, NaN per-token scales (or given per-head/per-tensor scales)."""
    token_axis = 2 if kv_layout == "bnsh" else 1
    shape = [batch, heads, head_dim]
    shape.insert(token_axis, capacity + tail)
    pools = {name: rng.integers(-128, 128, shape, dtype=np.int8)
             for name in ("k_cache", "v_cache")}
    for name in ("k_scale", "v_scale"):
        if scale_mode == "token":
            pools[name] = np.full((batch, heads, capacity + tail), np.nan, np.dtype(scale_dtype))
        else:
            count = 1 if scale_mode == "tensor" else heads
            pools[name] = rng.uniform(0.02, 0.05, count).astype(np.float32)
    return pools


def views(pools: dict[str, Any], kv_layout: str, scale_mode: str, capacity: int
          ) -> dict[str, Any]:
    """The capacity-long prefixes of the pools; per-head/per-tensor scales as they are."""
    token_axis = 2 if kv_layout == "bnsh" else 1
    out = {name: prefix(pools[name], token_axis, capacity) for name in ("k_cache", "v_cache")}
    for name in ("k_scale", "v_scale"):
        out[name] = prefix(pools[name], 2, capacity) if scale_mode == "token" else pools[name]
    return out


@pytest.mark.parametrize("scale_mode,scale_dtype", MODES)
@pytest.mark.parametrize("kv_layout", ["bnsh", "bsnh"])
def test_append_never_writes_at_or_past_the_capacity(rng, stream, kv_layout, scale_mode,
                                                     scale_dtype):
    batch, heads, head_dim, capacity, tail = 7, 2, 64, 24, 8
    positions = np.array([capacity - 1, capacity, capacity + 3, 2**31 - 1, -1, -2**31, 0],
                         np.int32)
    host = kv_pools(rng, batch=batch, heads=heads, head_dim=head_dim, capacity=capacity,
                    tail=tail, kv_layout=kv_layout, scale_mode=scale_mode,
                    scale_dtype=scale_dtype)
    k_new, v_new = (rng.standard_normal((batch, heads, head_dim)).astype(np.float16)
                    for _ in range(2))
    device = {name: DeviceArray.from_numpy(value) for name, value in host.items()}
    d_lens = DeviceArray.from_numpy(positions)
    v = views(device, kv_layout, scale_mode, capacity)
    with AppendPlan.create(2 * heads, heads, head_dim, max_batch=batch, kv_layout=kv_layout,
                           scale_mode=scale_mode, scale_dtype=scale_dtype) as plan:
        plan.run(DeviceArray.from_numpy(k_new), DeviceArray.from_numpy(v_new), v["k_cache"],
                 v["v_cache"], v["k_scale"], v["v_scale"], d_lens, advance=True,
                 stream=stream)
        assert plan.error_flags(stream=stream) & ERROR_OUTSIDE_CACHE
    expected_lens = positions.copy()
    h = views(host, kv_layout, scale_mode, capacity)  # numpy views: writes land in the pools
    append_ref(h["k_cache"], h["v_cache"], h["k_scale"], h["v_scale"], expected_lens, k_new,
               v_new, kv_layout=kv_layout, scale_mode=scale_mode, scale_dtype=scale_dtype,
               advance=True)
    assert d_lens.numpy().tolist() == expected_lens.tolist()  # only rows 0 and 6 advanced
    for name, pool in host.items():  # bitwise, tails and NaN poison included
        np.testing.assert_array_equal(device[name].numpy(), pool, err_msg=name)


@pytest.mark.parametrize("kv_layout", ["bnsh", "bsnh"])
def test_prompt_quantizer_never_writes_past_the_capacity(rng, stream, kv_layout):
    batch, heads, head_dim, capacity, tail, tokens = 5, 2, 64, 24, 8, 30
    lengths = np.array([tokens, capacity + 1, -3, 10**6, 5], np.int32)
    host = kv_pools(rng, batch=batch, heads=heads, head_dim=head_dim, capacity=capacity,
                    tail=tail, kv_layout=kv_layout, scale_mode="token", scale_dtype="float32")
    k, v = (rng.standard_normal((batch, tokens, heads, head_dim)).astype(np.float16)
            for _ in range(2))
    device = {name: DeviceArray.from_numpy(value) for name, value in host.items()}
    written = DeviceArray.full(batch, -7, np.int32)
    dv = views(device, kv_layout, "token", capacity)
    with PromptQuantizer.create(heads, head_dim, max_batch=batch,
                                kv_layout=kv_layout) as quantizer:
        quantizer.run(DeviceArray.from_numpy(k), DeviceArray.from_numpy(v), dv["k_cache"],
                      dv["v_cache"], dv["k_scale"], dv["v_scale"],
                      DeviceArray.from_numpy(lengths), seq_lens_out=written, stream=stream)
        # ERROR_OUTSIDE_CACHE: lengths cut to the capacity; ERROR_PROMPT_LENGTH: lengths
        # outside [0, S] clamped
        assert quantizer.error_flags(stream=stream) == ERROR_OUTSIDE_CACHE | ERROR_PROMPT_LENGTH
    h = views(host, kv_layout, "token", capacity)
    expected = prompt_ref(h["k_cache"], h["v_cache"], h["k_scale"], h["v_scale"], lengths, k,
                          v, kv_layout=kv_layout, scale_mode="token")
    assert written.numpy().tolist() == expected.tolist() == [24, 24, 0, 24, 5]
    for name, pool in host.items():
        np.testing.assert_array_equal(device[name].numpy(), pool, err_msg=name)


# -- determinism ----------------------------------------------------------------------------------
def bits(array: DeviceArray) -> bytes:
    return array.numpy().tobytes()


@pytest.mark.parametrize("config", [
    None, TileConfig(4, 7, 16, True), TileConfig(4, 7, 16, False), TileConfig(8, 3, 64, True),
    TileConfig(2, 1),
], ids=["planned", "7 splits fused", "7 splits combine", "8 warps 3 splits", "no split"])
@pytest.mark.parametrize("dtype,scale_mode,scale_dtype", [
    ("float16", "token", "float32"), ("bfloat16", "token", "float16"), ("float16", "head",
                                                                         "float32")])
def test_decode_is_bitwise_deterministic_across_runs_streams_and_graph_replay(
        rng, stream, config, dtype, scale_mode, scale_dtype):
    case = Case.random(rng, [4097, 1, 0, 1500, 63], num_q_heads=16, num_kv_heads=4,
                       dtype=dtype, scale_mode=scale_mode, scale_dtype=scale_dtype)
    d = case.upload()
    with case.make_plan() as plan:
        out, lse = case.run(plan, stream, config=config)
        case.check(out, lse)  # right, before asking whether it is repeatable
        reference = (bits(d["out"]), bits(d["lse"]))

        def eager(on: Stream) -> tuple[bytes, bytes]:
            d["out"].fill(float("nan"))
            d["lse"].fill(float("nan"))
            plan.run(d["q"], d["k"], d["v"], d["k_scale"], d["v_scale"], d["seq_lens"],
                     d["out"], lse=d["lse"], stream=on)
            on.synchronize()
            return bits(d["out"]), bits(d["lse"])

        for run in range(9):
            assert eager(stream) == reference, f"eager run {run + 2} differs"
        with Stream() as other:
            assert eager(other) == reference, "another stream gives other bits"
        plan.plan(case.lengths, config=config)  # re-planning the same lengths
        assert eager(stream) == reference, "re-planning the same lengths gives other bits"

        with capture(stream) as graph:
            plan.run(d["q"], d["k"], d["v"], d["k_scale"], d["v_scale"], d["seq_lens"],
                     d["out"], lse=d["lse"], stream=stream)
        for replay in range(10):
            d["out"].fill(float("nan"))
            d["lse"].fill(float("nan"))
            graph.launch(stream)
            stream.synchronize()
            assert (bits(d["out"]), bits(d["lse"])) == reference, f"replay {replay} differs"
        graph.close()
