"""DecodePlan's route to the multi-token kernels (planner rule 8) and MultiPlan's decode rows
(``qo_indptr=None``) on the GPU, against the float64 decode oracle: every multi-token kernel
(split warps, whole tiles, the 64- and 128-row warpgroup kernels), empty sequences written as
decode writes them (out 0, lse -inf, no flag), KV splits and their merge, every scale mode,
contiguous and paged layouts, graph replay of a prepared call after the lengths change; the
routed append_and_run (append kernel, then attention with q rotated in the kernel) against the
fused append's oracle (cache bytes, q untouched, positions outside the cache) and DecodeStep
on it, graph and eager bitwise equal."""
from __future__ import annotations

import numpy as np
import pytest
from decode_case import Case
from paged_case import paginate
from test_fused_append_gpu import Fused
from test_paged_gpu import CACHE, contiguous

from lowlevel_fd import ERROR_OUTSIDE_CACHE, DecodePlan, DecodeStep, LayerBuffers, MultiPlan
from lowlevel_fd.driver import DeviceArray, capture, dtypes
from lowlevel_fd.quant import hadamard_rows
from lowlevel_fd.multi.variants import ksplits, wgmma_available

pytestmark = pytest.mark.gpu

LENGTHS = [0, 37, 1000, 2049, 0, 64]  # empty rows, a partial tile, split edges, a whole tile


def heads(group: int) -> tuple[int, int]:
    """(Hq, Hkv): two KV heads up to a group of 16, one (multi-query) beyond."""
    kv_heads = 2 if group <= 16 else 1
    return group * kv_heads, kv_heads


def kernels(head_dim: int, device) -> dict[str, dict]:
    """MultiPlan.plan options that pin each multi-token kernel."""
    found = {"whole tiles": {"ksplit": 1, "wgmma": False},
             "split warps": {"ksplit": ksplits(head_dim)[-1], "wgmma": False}}
    if wgmma_available(device.arch, head_dim):
        found.update({"wg 64": {"wg_rows": 64}, "wg 128": {"wg_rows": 128}})
    return found


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("group", [3, 16, 64, 71])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_multi_decode_rows_match_the_decode_oracle_on_every_kernel(rng, stream, device,
                                                                   head_dim, group, splits):
    hq, hkv = heads(group)
    case = Case.random(rng, LENGTHS, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                       capacity=2050)
    d = case.upload()
    for name, options in kernels(head_dim, device).items():
        with MultiPlan.create(hq, hkv, head_dim, max_batch=case.batch,
                              max_seq_len=case.capacity) as plan:
            plan.plan(None, case.lengths, causal=False, num_splits=splits, **options)
            assert plan.describe()["decode_rows"]
            for early in (False, True):
                d["out"].fill(float("nan"))
                d["lse"].fill(float("nan"))
                plan.run(d["q"], d["k"], d["v"], d["k_scale"], d["v_scale"], d["seq_lens"],
                         None, d["out"], lse=d["lse"], early_reads=early, stream=stream)
                stream.synchronize()
                case.check(d["out"].numpy().astype(np.float64),
                           d["lse"].numpy().astype(np.float64))
            assert plan.error_flags(stream=stream) == 0, name


@pytest.mark.parametrize("group", [16, 24, 32, 48, 64, 71, 128])
def test_routed_decode_matches_the_oracle_for_large_groups(rng, stream, group):
    hq, hkv = heads(group)
    case = Case.random(rng, LENGTHS, num_q_heads=hq, num_kv_heads=hkv, capacity=2050)
    with case.make_plan(max_batch=8) as plan:
        case.check(*case.run(plan, stream, multi=True))
        assert plan.describe()["backend"] == "multi"
        assert plan.describe()["multi"]["decode_rows"]
        assert plan.error_flags(stream=stream) == 0
        forced = case.run(plan, stream, multi=False)
        assert plan.describe()["backend"] == "decode"
        case.check(*forced)


# (group, head_dim, kv_layout, scale_mode, scale_dtype, dtype)
MATRIX = [
    (3, 64, "bsnh", "token", "float16", "bfloat16"),
    (24, 64, "bnsh", "token", "float32", "bfloat16"),
    (32, 128, "bsnh", "head", "float32", "float16"),
    (48, 128, "bnsh", "tensor", "float32", "bfloat16"),
    (64, 128, "bsnh", "token", "float16", "float16"),
    (128, 64, "bnsh", "token", "float32", "float16"),
]


@pytest.mark.parametrize("group, head_dim, kv_layout, scale_mode, scale_dtype, dtype", MATRIX)
def test_routed_decode_across_the_support_matrix(rng, stream, group, head_dim, kv_layout,
                                                 scale_mode, scale_dtype, dtype):
    hq, hkv = heads(group)
    case = Case.random(rng, [513, 0, 77, 1], num_q_heads=hq, num_kv_heads=hkv,
                       head_dim=head_dim, kv_layout=kv_layout, scale_mode=scale_mode,
                       scale_dtype=scale_dtype, dtype=dtype, capacity=516)
    with case.make_plan(max_batch=4) as plan:
        case.check(*case.run(plan, stream, multi=True))


@pytest.mark.parametrize("layout, page_size, mode, scale_dtype", [
    ("nhd", 16, "token", "float32"), ("hnd", 1, "token", "float32"),
    ("hnd", 2, "token", "float16"), ("hnd", 64, "head", "float32"),
    ("nhd", 256, "tensor", "float32")])
def test_routed_decode_over_pages_matches_the_oracle(rng, stream, layout, page_size, mode,
                                                     scale_dtype):
    case = Case.random(rng, [0, 15, 16, 17, 300, 1037], num_q_heads=64, num_kv_heads=1,
                       scale_mode=mode, scale_dtype=scale_dtype)
    case.upload()
    pages = paginate(rng, contiguous(case), layout, page_size, token_scales=mode == "token")
    d = pages.upload()
    out = DeviceArray.full(case.host["q"].shape, float("nan"), dtypes.as_dtype(case.dtype))
    lse = DeviceArray.full((case.batch, case.num_q_heads), float("nan"), np.float32)
    with DecodePlan.create(64, 1, 128, max_batch=case.batch, max_seq_len=case.capacity,
                           kv_layout=layout, page_size=page_size, scale_mode=mode,
                           scale_dtype=scale_dtype) as plan:
        plan.plan(case.lengths, multi=True)
        plan.run(case.device["q"], *(d[name] for name in CACHE), case.device["seq_lens"], out,
                 lse=lse, block_table=d["block_table"], stream=stream)
        assert plan.describe()["backend"] == "multi"
        assert plan.error_flags(stream=stream) == 0
    case.check(out.numpy().astype(np.float64), lse.numpy().astype(np.float64))


def test_a_prepared_routed_call_replays_in_a_graph_as_the_lengths_change(rng, stream):
    case = Case.random(rng, [1000, 20, 0], num_q_heads=64, num_kv_heads=1, capacity=9000)
    d = case.upload()
    with case.make_plan() as plan:
        plan.plan([9000, 9000, 9000], multi=True)
        call = plan.prepare_run(d["q"], d["k"], d["v"], d["k_scale"], d["v_scale"],
                                d["seq_lens"], d["out"], lse=d["lse"])
        with capture(stream) as graph:
            call.launch(stream)
        for lengths in ([1000, 20, 0], [1, 8999, 4097], [0, 0, 9000]):
            case.set_lengths(lengths)
            d["out"].fill(float("nan"))
            graph.launch(stream)
            stream.synchronize()
            replayed = d["out"].numpy()
            case.check(replayed.astype(np.float64), d["lse"].numpy().astype(np.float64))
            out, _ = case.run(plan, stream, replan=False)
            assert np.array_equal(replayed.astype(np.float64), out), "graph == eager, bitwise"
        graph.close()
        plan.plan([10, 10, 10], multi=True)
        with pytest.raises(RuntimeError, match="planned again"):
            call.launch(stream)


def test_the_planner_routes_large_groups_over_large_caches_on_hopper(device):
    hopper = device.compute_capability >= (9, 0)
    with DecodePlan.create(64, 1, 128, max_batch=8, max_seq_len=65536) as plan:
        assert plan.plan([65536]).describe()["backend"] == ("multi" if hopper else "decode")
        assert plan.plan([4096]).describe()["backend"] == "decode"  # 1 MiB: decode's chain
    with DecodePlan.create(32, 8, 128, max_batch=8, max_seq_len=65536) as plan:
        assert plan.plan([65536] * 8).describe()["backend"] == "decode"  # group 4


def test_decode_rows_take_no_qo_indptr_and_packed_plans_need_one(rng, stream):
    case = Case.random(rng, [5, 9], num_q_heads=8, num_kv_heads=1, capacity=16)
    d = case.upload()
    indptr = DeviceArray.from_numpy(np.arange(3, dtype=np.int32))
    with MultiPlan.create(8, 1, 128, max_batch=2, max_seq_len=16) as plan:
        plan.plan(None, case.lengths)
        with pytest.raises(ValueError, match="qo_indptr=None"):
            plan.run(d["q"], d["k"], d["v"], d["k_scale"], d["v_scale"], d["seq_lens"],
                     indptr, d["out"], stream=stream)
        plan.plan([0, 1, 2], case.lengths)
        with pytest.raises(ValueError, match="got None"):
            plan.run(d["q"], d["k"], d["v"], d["k_scale"], d["v_scale"], d["seq_lens"],
                     None, d["out"], stream=stream)


# (head_dim, Hq, Hkv, kv_layout, scale_mode, scale_dtype, dtype, rope, table, key_transform)
APPEND = [
    (128, 64, 1, "bnsh", "token", "float32", "float16", "neox", True, "none"),
    (128, 32, 2, "bsnh", "token", "float16", "bfloat16", "gptj", False, "none"),
    (64, 48, 1, "bnsh", "head", "float32", "float16", None, False, "none"),
    (128, 71, 1, "bsnh", "tensor", "float32", "float16", "neox", False, "hadamard"),
    (64, 128, 1, "bnsh", "token", "float32", "bfloat16", "gptj", True, "hadamard"),
]


@pytest.mark.parametrize("head_dim, hq, hkv, kv_layout, scale_mode, scale_dtype, dtype, rope, "
                         "table, key_transform", APPEND)
def test_routed_append_and_run_matches_the_fused_oracle(rng, stream, head_dim, hq, hkv,
                                                        kv_layout, scale_mode, scale_dtype,
                                                        dtype, rope, table, key_transform):
    fused = Fused(rng, [0, 63, 1024, 4097, 5], rope=rope, table=table, num_q_heads=hq,
                  num_kv_heads=hkv, head_dim=head_dim, kv_layout=kv_layout,
                  scale_mode=scale_mode, scale_dtype=scale_dtype, dtype=dtype,
                  key_transform=key_transform)
    if key_transform != "none" and not rope:  # no RoPE: the caller passes q transformed
        q = fused.case.host["q"]
        fused.case.host["q"] = hadamard_rows(q).astype(q.dtype)
        fused.device["q"] = DeviceArray.from_numpy(fused.case.host["q"])
    fused.round_query = False  # the multi-token kernel keeps the rotated q in fp16 per row
    fused.check(*fused.run(stream, multi=True))  # cache bytes, q untouched, out, lse
    described = fused.plan.describe()
    assert described["backend"] == "multi"
    assert described["append_launches"] == 1 + described["multi"]["launches"]
    assert fused.plan.error_flags(stream=stream) == 0
    fused.plan.close()


def test_routed_append_outside_the_cache_writes_nothing_and_raises_the_flag(rng, stream):
    fused = Fused(rng, [4100, -1, 5, 4107], rope="gptj", num_q_heads=64, num_kv_heads=1)
    out, lse = fused.run(stream, multi=True)
    fused.check(out, lse)  # the oracle attends min(max(pos, 0), S_max) with q unrotated
    assert (out[1] == 0).all() and np.isneginf(lse[1]).all()
    assert fused.plan.error_flags(stream=stream) & ERROR_OUTSIDE_CACHE
    fused.plan.close()


def test_prepared_routed_append_and_run_launches_bitwise_what_append_and_run_does(rng, stream):
    fused = Fused(rng, [7, 300, 2048, 4100], rope="neox", table=True, num_q_heads=64,
                  num_kv_heads=1)
    fused.check(*fused.run(stream, multi=True))
    assert fused.plan.error_flags(stream=stream) & ERROR_OUTSIDE_CACHE
    expected = fused.state()
    for early_reads in (False, True):
        prepared = fused.prepare(early_reads)
        fused.launch_from_the_start(prepared, stream, graph=True)
        for name, value in fused.state().items():
            assert value == expected[name], (early_reads, name)
        assert fused.plan.error_flags(stream=stream) & ERROR_OUTSIDE_CACHE, early_reads
    fused.plan.close()


@pytest.mark.parametrize("fused", [True, False])
def test_decode_step_on_a_routed_plan_replays_bitwise_what_it_issues_eagerly(rng, stream,
                                                                             fused):
    batch, hq, hkv, dim, layers, capacity = 3, 64, 1, 128, 3, 600
    lengths = np.array([0, 257, 511], np.int32)
    qt = np.float16
    step = DecodeStep.create(layers, hq, hkv, dim, max_batch=batch, max_seq_len=capacity,
                             rope="neox", fused=fused)
    step.plan(lengths)
    step.attention.plan(lengths + (0 if fused else 1), append=fused, multi=True)
    assert step.attention.describe()["backend"] == "multi"
    host = {"k": [rng.integers(-127, 128, (batch, hkv, capacity, dim), dtype=np.int8)
                  for _ in range(layers)],
            "v": [rng.integers(-127, 128, (batch, hkv, capacity, dim), dtype=np.int8)
                  for _ in range(layers)],
            "s": [rng.uniform(0.004, 0.012, (batch, hkv, capacity)).astype(np.float32)
                  for _ in range(2 * layers)],
            "q": [rng.standard_normal((batch, hq, dim)).astype(qt) for _ in range(layers)],
            "new": [rng.standard_normal((batch, hkv, dim)).astype(qt)
                    for _ in range(2 * layers)]}

    def buffers():
        return [LayerBuffers(DeviceArray.from_numpy(host["q"][i]),
                             DeviceArray.from_numpy(host["new"][2 * i]),
                             DeviceArray.from_numpy(host["new"][2 * i + 1]),
                             DeviceArray.from_numpy(host["k"][i]),
                             DeviceArray.from_numpy(host["v"][i]),
                             DeviceArray.from_numpy(host["s"][2 * i]),
                             DeviceArray.from_numpy(host["s"][2 * i + 1]),
                             DeviceArray.empty((batch, hq, dim), qt))
                for i in range(layers)]

    eager, graphed = step_eager_and_graphed(step, buffers, lengths, stream)
    assert eager == graphed
    assert eager[-1] == (lengths + 1).tolist()
    step.close()


def step_eager_and_graphed(step, buffers, lengths, stream) -> list[list]:
    """The step issued eagerly, then captured and replayed, each over fresh ``buffers()`` and
    ``lengths``: per way, every layer's (out, k_cache) bytes, then the lengths after."""
    results = []
    for graphed in (False, True):
        layer_buffers, lens = buffers(), DeviceArray.from_numpy(lengths)
        if graphed:
            graph = step.capture(layer_buffers, lens, stream=stream)
            graph.launch(stream)
            graph.close()
        else:
            step.eager(layer_buffers, lens, stream=stream)
        stream.synchronize()
        results.append([(b.out.numpy().tobytes(), b.k_cache.numpy().tobytes())
                        for b in layer_buffers] + [lens.numpy().tolist()])
    return results


def test_routed_append_rotates_q_from_theta_where_its_table_misses_cache_positions(rng, stream):
    """The route's own (cos, sin) table covers max_seq_len positions; a cache holding more
    (capacity 4100 here, max_seq_len 200) rotates q from rope_theta instead: same oracle."""
    fused = Fused(rng, [5, 100, 199], rope="neox", num_q_heads=64, num_kv_heads=1)
    fused.plan.close()
    c = fused.case
    fused.plan = DecodePlan.create(c.num_q_heads, c.num_kv_heads, c.head_dim,
                                   max_batch=c.batch, max_seq_len=200, rope="neox",
                                   rope_theta=fused.plan.cache.rope_theta)
    fused.round_query = False
    fused.check(*fused.run(stream, multi=True))
    assert fused.plan._route.table.shape[0] == 200
    assert fused.plan.error_flags(stream=stream) == 0
    fused.plan.close()
