"""DecodePlan on the GPU against the float64 oracle, across the whole support matrix."""
from __future__ import annotations

import numpy as np
import pytest
from decode_case import Case

from lowlevel_fd import ERROR_OUTSIDE_CACHE
from lowlevel_fd.decode import TileConfig
from lowlevel_fd.driver import DeviceArray, capture

pytestmark = pytest.mark.gpu

RAGGED = [1, 63, 0, 65, 1025, 4097]
LENGTHS = [1, 2, 63, 64, 65, 1000, 1023, 1024, 1025, 4097, 32768, 131072]
MODES = [("tensor", "float32"), ("head", "float32"), ("token", "float32"), ("token", "float16")]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("scale_mode,scale_dtype", MODES)
@pytest.mark.parametrize("kv_layout", ["bnsh", "bsnh"])
@pytest.mark.parametrize("group", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_support_matrix(rng, stream, head_dim, group, kv_layout, scale_mode, scale_dtype,
                        dtype):
    num_kv_heads = 2
    case = Case.random(rng, RAGGED, num_q_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, kv_layout=kv_layout, scale_mode=scale_mode,
                       scale_dtype=scale_dtype, dtype=dtype)
    with case.make_plan() as plan:
        case.check(*case.run(plan, stream))


@pytest.mark.parametrize("length", LENGTHS)
def test_reference_workload_lengths(rng, stream, length):
    case = Case.random(rng, [length])
    with case.make_plan() as plan:
        case.check(*case.run(plan, stream))


@pytest.mark.parametrize("kv_layout", ["bnsh", "bsnh"])
def test_ragged_batch_with_empty_rows(rng, stream, kv_layout):
    case = Case.random(rng, [0, 5, 4097, 0, 1024, 77, 1], kv_layout=kv_layout)
    with case.make_plan() as plan:
        out, lse = case.run(plan, stream)
        case.check(out, lse)
        assert np.isneginf(lse[0]).all() and np.isneginf(lse[3]).all()


@pytest.mark.parametrize("config", [
    TileConfig(num_warps=2, num_splits=1), TileConfig(num_warps=8, num_splits=3),
    TileConfig(num_warps=4, num_splits=16, min_split_tokens=16),
    TileConfig(num_warps=4, num_splits=7, fused_merge=False),
    TileConfig(num_warps=8, num_splits=128, min_split_tokens=16, fused_merge=False),
    TileConfig(num_warps=4, num_splits=8, min_split_tokens=16, cluster=True),
    TileConfig(num_warps=8, num_splits=16, min_split_tokens=16, cluster=True),
    TileConfig(num_warps=2, num_splits=5, min_split_tokens=32, cluster=True, programmatic=False),
    TileConfig(num_warps=4, num_splits=1, cluster=True),
    TileConfig(num_warps=8, num_splits=8, cluster=True),
    TileConfig(num_warps=4, num_splits=3, stages=4),
    TileConfig(num_warps=8, num_splits=2, stages=3, fused_merge=False),
    TileConfig(num_warps=8, num_splits=8, min_split_tokens=256, cluster=True, tiles=2),
    TileConfig(num_warps=4, num_splits=3, stages=3, tiles=2),
])
def test_forced_tile_configs(rng, stream, config):
    case = Case.random(rng, [4097, 1, 300, 2048])
    with case.make_plan() as plan:
        case.check(*case.run(plan, stream, config=config))
        assert plan.describe()["num_splits"] == config.num_splits


def test_sm_scale_override(rng, stream):
    case = Case.random(rng, [999, 3])
    with case.make_plan(sm_scale=0.3) as plan:
        case.check(*case.run(plan, stream), sm_scale=0.3)


def test_bitwise_deterministic(rng, stream):
    case = Case.random(rng, [32768, 100, 5000])
    with case.make_plan() as plan:
        first = case.run(plan, stream)
        for _ in range(3):
            again = case.run(plan, stream, replan=False)
            assert np.array_equal(first[0], again[0]) and np.array_equal(first[1], again[1])


def test_strided_inputs_from_larger_pools(rng, stream):
    """Caches that are slices of a bigger pool, q and out with padded batch strides."""
    case = Case.random(rng, [700, 1500], capacity=2048)
    h = case.host
    pool_k = np.zeros((5,) + h["k"].shape[1:], np.int8)
    pool_v = np.zeros_like(pool_k)
    pool_k[1:5:2], pool_v[1:5:2] = h["k"], h["v"]
    q_pool = np.zeros((2, 40, 128), h["q"].dtype)
    q_pool[:, 4:36] = h["q"]
    case.upload()
    d = case.device
    d["k"] = DeviceArray.from_numpy(pool_k)[1:5:2]
    d["v"] = DeviceArray.from_numpy(pool_v)[1:5:2]
    d["q"] = DeviceArray.from_numpy(q_pool)[:, 4:36]
    out_pool = DeviceArray.empty((2, 48, 128), h["q"].dtype)
    d["out"] = out_pool[:, 8:40]
    with case.make_plan() as plan:
        case.check(*case.run(plan, stream))


def test_graph_replay_follows_device_lengths(rng, stream):
    """Capture once; change the device lengths between replays; each replay matches."""
    case = Case.random(rng, [1000, 20], capacity=9000)
    d = case.upload()
    with case.make_plan() as plan:
        plan.plan([9000, 9000])
        with capture(stream) as graph:
            plan.run(d["q"], d["k"], d["v"], d["k_scale"], d["v_scale"], d["seq_lens"],
                     d["out"], lse=d["lse"], stream=stream)
        for lengths in ([1000, 20], [1, 8999], [0, 4097], [9000, 65]):
            case.set_lengths(lengths)
            d["out"].fill(float("nan"))
            graph.launch(stream)
            stream.synchronize()
            case.check(d["out"].numpy().astype(np.float64), d["lse"].numpy().astype(np.float64))
        graph.close()


def test_length_beyond_capacity_is_clamped_and_flagged(rng, stream):
    case = Case.random(rng, [64, 64], capacity=64)
    d = case.upload()
    with case.make_plan() as plan:
        plan.plan([64, 64])
        d["seq_lens"].copy_from_numpy(np.array([64, 10**6], np.int32))
        d["out"].fill(float("nan"))
        plan.run(d["q"], d["k"], d["v"], d["k_scale"], d["v_scale"], d["seq_lens"], d["out"],
                 stream=stream)
        stream.synchronize()
        assert plan.error_flags(stream=stream) & ERROR_OUTSIDE_CACHE
        assert plan.error_flags(stream=stream) == 0  # cleared by the read
        out = d["out"].numpy().astype(np.float64)
        ref, _ = case.reference()  # host lengths are 64, 64: the clamp gives the same answer
        assert np.abs(out - ref).max() / np.abs(ref).max() <= 2e-3


def test_cache_beyond_4_gib_uses_64_bit_offsets(rng, stream):
    """Sequence 36 of a 40 x 8 x 131072 x 128 pool starts 4.8 GB into each cache."""
    batch, capacity, length = 40, 131072, 3000
    shape = (batch, 8, capacity, 128)
    k_pool, v_pool = DeviceArray.empty(shape, np.int8), DeviceArray.empty(shape, np.int8)
    lengths = [0] * batch
    lengths[36] = lengths[39] = length
    case = Case.random(rng, [length, length], capacity=capacity)
    d = case.upload()
    for slot, row in ((36, 0), (39, 1)):
        k_pool[slot].copy_from_numpy(case.host["k"][row])
        v_pool[slot].copy_from_numpy(case.host["v"][row])
    # The plan sees a batch of two: rows 36 and 39 of the pools, via a stride-3 slice.
    d["k"], d["v"] = k_pool[36:40:3], v_pool[36:40:3]
    assert d["k"].ptr - k_pool.ptr > 2**32
    with case.make_plan() as plan:
        case.check(*case.run(plan, stream))
    k_pool.close()
    v_pool.close()


def test_error_flags_are_read_in_stream_order(rng, stream):
    """error_flags(stream=s) waits for the work already enqueued on s, with no synchronize by
    the caller: the bit raised by the last of many queued runs is seen, and the read clears it
    on s (a second read returns 0)."""
    capacity = 16384
    case = Case.random(rng, [capacity, capacity], capacity=capacity)
    d = case.upload()
    beyond = DeviceArray.from_numpy(np.array([capacity, 10**6], np.int32))
    with case.make_plan() as plan:
        assert plan.error_flags(stream=stream) == 0  # before the first plan
        plan.plan([capacity, capacity])
        assert plan.error_flags(stream=stream) == 0
        args = (d["q"], d["k"], d["v"], d["k_scale"], d["v_scale"])
        for _ in range(50):  # lengths within the capacity: no bit; they keep the stream busy
            plan.run(*args, d["seq_lens"], d["out"], lse=d["lse"], stream=stream)
        plan.run(*args, beyond, d["out"], lse=d["lse"], stream=stream)  # 10**6: clamped
        assert plan.error_flags(stream=stream) & ERROR_OUTSIDE_CACHE
        assert plan.error_flags(stream=stream) == 0  # cleared by the read, on the stream
        stream.synchronize()
        # The host lengths are [capacity, capacity]: the clamp gives the same answer.
        case.check(d["out"].numpy().astype(np.float64), d["lse"].numpy().astype(np.float64))


def test_prepared_run_launches_bitwise_what_run_launches(rng, stream):
    """prepare_run validates run()'s arguments once; each launch(stream) issues that run, also
    after run() was called with other buffers in between and inside a captured graph. After
    the next plan() it is stale (RuntimeError); after close() too."""
    case = Case.random(rng, [4097, 1, 300, 0, 2048])
    d = case.upload()
    args = (d["q"], d["k"], d["v"], d["k_scale"], d["v_scale"], d["seq_lens"])
    other_out = DeviceArray.empty(d["out"].shape, d["out"].dtype)

    def launched(call):
        d["out"].fill(float("nan"))
        d["lse"].fill(float("nan"))
        call()
        stream.synchronize()
        return d["out"].numpy().tobytes(), d["lse"].numpy().tobytes()

    with case.make_plan() as plan:
        out, lse = case.run(plan, stream)
        case.check(out, lse)
        expected = (d["out"].numpy().tobytes(), d["lse"].numpy().tobytes())
        prepared = plan.prepare_run(*args, d["out"], lse=d["lse"])
        for attempt in range(3):
            assert launched(lambda: prepared.launch(stream)) == expected, f"launch {attempt}"
        # run() binds other arguments into the plan; the prepared call keeps its own.
        other_out.fill(float("nan"))
        assert launched(lambda: (plan.run(*args, other_out, stream=stream),
                                 prepared.launch(stream))) == expected
        ref, _ = case.reference()
        error = np.abs(other_out.numpy().astype(np.float64) - ref).max() / np.abs(ref).max()
        assert error <= 2e-3, "run() with other_out wrote other_out"
        with capture(stream) as graph:
            prepared.launch(stream)
        assert launched(lambda: graph.launch(stream)) == expected, "graph replay"
        graph.close()

        plan.plan(case.lengths)  # the same lengths: the same launch, but a new plan
        with pytest.raises(RuntimeError, match="planned again"):
            prepared.launch(stream)
        fresh = plan.prepare_run(*args, d["out"], lse=d["lse"])
        assert launched(lambda: fresh.launch(stream)) == expected, "re-prepared after re-plan"
    with pytest.raises(RuntimeError, match="closed"):
        fresh.launch(stream)
    other_out.close()
