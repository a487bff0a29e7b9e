"""The int8-q kernel (multi_q8.cu: decode rows with q quantized per row to int8 for Q K^T) on
the GPU, against the float64 oracle with q rounded as the kernel rounds it
(reference_multi.int8_query_rows): groups of 16 to 64 heads and forced larger ones, both q
dtypes and scale dtypes, both contiguous layouts, empty rows, lengths at tile edges and a
capacity that is not a multiple of the tile, KV splits under each merge, early reads, q rotated
and appended through DecodePlan, graph replay, the device guards, long rows."""
from __future__ import annotations

import numpy as np
import pytest
from decode_case import TOLERANCE, Case
from test_decode_route_gpu import step_eager_and_graphed
from test_fused_append_gpu import THETA, Fused

from lowlevel_fd import ERROR_OUTSIDE_CACHE, DecodePlan, DecodeStep, LayerBuffers, MultiPlan
from lowlevel_fd.driver import Device, DeviceArray, capture
from lowlevel_fd.multi.variants import WG_ARCHS

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def hopper():
    if Device(0).arch not in WG_ARCHS:
        pytest.skip("the int8-q kernel needs an sm_90 device")


LENGTHS = [0, 1, 63, 64, 65, 700, 1029]  # empty, tile edges, the capacity's partial tile
CAPACITY = 1030  # not a multiple of the 64-token tile


def q8_case(rng, lengths, group, kv_heads=1, capacity=CAPACITY, **options) -> Case:
    return Case.random(rng, lengths, num_q_heads=group * kv_heads, num_kv_heads=kv_heads,
                       capacity=capacity, int8_q=True, **options)


def q8_plan(case: Case, **options) -> MultiPlan:
    return MultiPlan.create(case.num_q_heads, case.num_kv_heads, 128, max_batch=case.batch,
                            max_seq_len=case.capacity, dtype=case.dtype,
                            kv_layout=case.kv_layout, scale_dtype=case.scale_dtype,
                            key_transform="hadamard", allow_int8_q=True, **options)


def run(plan: MultiPlan, case: Case, stream, **options) -> tuple[np.ndarray, np.ndarray]:
    d = case.device
    d["out"].fill(float("nan"))
    d["lse"].fill(float("nan"))
    plan.run(d["q"], d["k"], d["v"], d["k_scale"], d["v_scale"], d["seq_lens"], None,
             d["out"], lse=d["lse"], stream=stream, **options)
    stream.synchronize()
    return d["out"].numpy().astype(np.float64), d["lse"].numpy().astype(np.float64)


MATRIX = [("float16", "float32", "bnsh"), ("float16", "float16", "bsnh"),
          ("bfloat16", "float32", "bsnh"), ("bfloat16", "float16", "bnsh")]


@pytest.mark.parametrize("group", [16, 17, 32, 48, 64])
@pytest.mark.parametrize("dtype, scale_dtype, kv_layout", MATRIX)
def test_int8_q_decode_rows_match_the_oracle(rng, stream, group, dtype, scale_dtype, kv_layout):
    case = q8_case(rng, LENGTHS, group, 2, dtype=dtype, scale_dtype=scale_dtype,
                   kv_layout=kv_layout)
    case.upload()
    with q8_plan(case) as plan:
        plan.plan(None, case.lengths, causal=False, int8_q=True)
        assert plan.describe()["int8_q"] and plan.describe()["rows_per_cta"] == 64
        results = []
        for early in (False, True):
            results.append(run(plan, case, stream, early_reads=early))
            case.check(*results[-1])
        assert results[0][0].tobytes() == results[1][0].tobytes()
        assert plan.error_flags(stream=stream) == 0


@pytest.mark.parametrize("splits, combine", [(1, None), (2, None), (5, None), (8, None),
                                             (3, False), (8, False)])
def test_int8_q_splits_merge(rng, stream, splits, combine):
    case = q8_case(rng, [4096, 2500, 0, 1, 1100], 64, capacity=4100)
    case.upload()
    with q8_plan(case) as plan:
        plan.plan(None, case.lengths, causal=False, num_splits=splits, combine=combine)
        described = plan.describe()
        assert described["int8_q"] and described["num_splits"] == splits
        assert described["merge"] == (None if splits == 1 else
                                      "last split" if combine is False else "kernel")
        for _ in range(2):  # the last split's counters are ready for the next launch
            case.check(*run(plan, case, stream))
        assert plan.error_flags(stream=stream) == 0


def test_int8_q_has_no_cluster_merge(rng, stream):
    case = q8_case(rng, [4096], 64, capacity=4096)
    with q8_plan(case) as plan:
        with pytest.raises(ValueError, match=r"^cluster: the cluster merge needs the warpgroup "
                                             r"kernels"):
            plan.plan(None, case.lengths, causal=False, num_splits=4, cluster=True)


@pytest.mark.parametrize("group", [8, 71, 128])
def test_int8_q_forced_on_other_groups(rng, stream, group):
    """Below 16 heads and past one row tile of 64 (several CTAs per KV head) when forced."""
    case = q8_case(rng, [0, 300, 1500, 64], group, capacity=1500)
    case.upload()
    with q8_plan(case) as plan:
        plan.plan(None, case.lengths, causal=False, int8_q=True)
        assert plan.describe()["max_tiles"] == -(-group // 64)
        case.check(*run(plan, case, stream))


def test_int8_q_negative_score_scale_flips_q(rng, stream):
    case = q8_case(rng, [500, 37], 32, capacity=512)
    case.upload()
    with q8_plan(case, sm_scale=-0.1) as plan:
        plan.plan(None, case.lengths, causal=False, int8_q=True)
        case.check(*run(plan, case, stream), sm_scale=-0.1)


def test_int8_q_device_guards_clamp_and_flag(rng, stream):
    case = q8_case(rng, [100, 200, 300], 64)
    case.upload()
    with q8_plan(case) as plan:
        plan.plan(None, case.lengths, causal=False, int8_q=True)
        case.device["seq_lens"].copy_from_numpy(np.array([5000, -3, 300], np.int32))
        out, lse = run(plan, case, stream)
        case.lengths = [CAPACITY, 0, 300]  # what the kernel clamps to (no device copy)
        case.host["seq_lens"] = np.asarray(case.lengths, np.int32)
        case.check(out, lse)
        assert plan.error_flags(stream=stream) == ERROR_OUTSIDE_CACHE


def test_int8_q_long_rows_hold_the_error(rng, stream):
    """16K tokens per row: the fp16 V scales and sums of softmax_h16 over many tiles (a biased
    widening measured 5.2e-3 here, PERF_NOTES v40)."""
    case = q8_case(rng, [16384, 9999], 64, capacity=16384)
    case.upload()
    with q8_plan(case) as plan:
        plan.plan(None, case.lengths, causal=False, num_splits=1)
        assert case.check(*run(plan, case, stream)) <= TOLERANCE["float16"] / 2


def test_int8_q_prepared_call_replays_in_a_graph_as_lengths_change(rng, stream):
    case = q8_case(rng, [700, 1029, 0, 64], 48, 2)
    d = case.upload()
    with q8_plan(case) as plan:
        plan.plan(None, [CAPACITY] * 4, causal=False, int8_q=True)
        prepared = plan.prepare_run(d["q"], d["k"], d["v"], d["k_scale"], d["v_scale"],
                                    d["seq_lens"], None, d["out"], lse=d["lse"])
        with capture(stream) as graph:
            prepared.launch(stream)
        for lengths in ([700, 1029, 0, 64], [1, 0, 1030, 65], [0, 0, 0, 513]):
            case.set_lengths(lengths)
            d["out"].fill(float("nan"))
            graph.launch(stream)
            stream.synchronize()
            replayed = d["out"].numpy().astype(np.float64)
            case.check(replayed, d["lse"].numpy().astype(np.float64))
            eager, _ = run(plan, case, stream)
            assert eager.tobytes() == replayed.tobytes()
        graph.close()


@pytest.mark.parametrize("rope, table, dtype", [("neox", True, "float16"),
                                                ("gptj", False, "bfloat16"),
                                                ("neox", False, "float16")])
def test_int8_q_routed_append_and_run_matches_the_fused_oracle(rng, stream, rope, table, dtype):
    """DecodePlan with allow_int8_q: the append kernel writes the token, the int8-q kernel
    rotates q at its position, transforms and quantizes it, and attends seq_lens + 1 tokens;
    positions outside the cache attend what is there with q as given, and raise the flag."""
    fused = Fused(rng, [0, 63, 1024, 4097, 5, 4100], rope=rope, table=table, num_q_heads=64,
                  num_kv_heads=1, dtype=dtype, key_transform="hadamard", int8_q=True)
    fused.plan.close()
    c = fused.case
    fused.plan = DecodePlan.create(64, 1, 128, max_batch=c.batch, max_seq_len=c.capacity,
                                   dtype=dtype, rope=rope, rope_theta=THETA,
                                   key_transform="hadamard", allow_int8_q=True)
    fused.round_query = False
    fused.check(*fused.run(stream, int8_q=True))
    assert fused.plan.describe()["multi"]["int8_q"]
    assert fused.plan.error_flags(stream=stream) == ERROR_OUTSIDE_CACHE
    fused.plan.close()


def test_int8_q_decode_step_replays_bitwise_what_it_issues_eagerly(rng, stream):
    batch, hq, dim, layers, capacity = 3, 64, 128, 3, 600
    lengths = np.array([0, 257, 511], np.int32)
    step = DecodeStep.create(layers, hq, 1, dim, max_batch=batch, max_seq_len=capacity,
                             rope="neox", key_transform="hadamard", allow_int8_q=True)
    step.plan(lengths)
    step.attention.plan(lengths, append=True, int8_q=True)
    assert step.attention.describe()["multi"]["int8_q"]
    host = [(rng.standard_normal((batch, hq, dim)).astype(np.float16),
             rng.standard_normal((batch, 1, dim)).astype(np.float16),
             rng.standard_normal((batch, 1, dim)).astype(np.float16),
             rng.integers(-127, 128, (batch, 1, capacity, dim), dtype=np.int8),
             rng.integers(-127, 128, (batch, 1, capacity, dim), dtype=np.int8),
             rng.uniform(0.004, 0.012, (batch, 1, capacity)).astype(np.float32),
             rng.uniform(0.004, 0.012, (batch, 1, capacity)).astype(np.float32))
            for _ in range(layers)]
    eager, graphed = step_eager_and_graphed(
        step, lambda: [LayerBuffers(*map(DeviceArray.from_numpy, arrays),
                                    DeviceArray.empty((batch, hq, dim), np.float16))
                       for arrays in host], lengths, stream)
    assert eager == graphed
    assert all(np.isfinite(np.frombuffer(out, np.float16)).all() for out, _ in eager[:-1])
    step.close()


@pytest.mark.parametrize("batch, group, seq, routed", [
    (128, 64, 4096, True),    # unsplit, 64 tiles per CTA
    (128, 32, 1024, True),    # unsplit, 16 tiles: the decode kernel's shape without int8 q
    (32, 64, 16384, True),    # 4 splits of 64 tiles
    (32, 64, 4096, False),    # 4 splits of 16 tiles: the warpgroup kernel, cluster merge
    (8, 64, 32768, False),    # 16 splits of 32 tiles
])
def test_the_route_takes_int8_q_where_allowed_and_it_pays(batch, group, seq, routed):
    for allow in (False, True):
        with DecodePlan.create(group, 1, 128, max_batch=batch, max_seq_len=seq,
                               key_transform="hadamard", allow_int8_q=allow) as plan:
            plan.plan([seq] * batch)
            described = plan.describe()
            assert described.get("multi", {}).get("int8_q", False) == (allow and routed)
