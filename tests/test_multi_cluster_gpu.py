"""The warpgroup kernels' split merge inside a thread-block cluster (multi_cluster.cuh) on the
GPU: against the float64 oracle and bitwise against the global merge (the same weights summed
in the same order), over both warpgroup kernels, head dims, split counts up to the cluster
limit, ragged batches whose short and empty sequences leave splits idle, decode rows, paged
caches with bad page ids, graph replay over lengths that change the active splits, and the
planner's choice."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import HAS_GPU
from multi_case import TOLERANCE, MultiCase, check_decode_replays, relative_error

from lowlevel_fd import ERROR_BAD_PAGE
from lowlevel_fd.driver import Device, LaunchConfig
from lowlevel_fd.multi.planner import MAX_CLUSTER_SPLITS, cluster_merge_fits
from lowlevel_fd.multi.variants import WG_ROWS, wgmma_available

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _hopper():
    if not (HAS_GPU and wgmma_available(Device(0).arch, 128)):
        pytest.skip("the cluster merge runs on the warpgroup kernels of an sm_90 GPU")


def run_both(case: MultiCase, stream, *, causal: bool = True,
             **options) -> tuple[np.ndarray, np.ndarray]:
    """out and lse of a clustered run and of the global merge's, checked against each other
    bitwise and the clustered one against the oracle."""
    results = []
    for cluster in (True, False):
        with case.make_plan() as plan:
            plan.plan(case.indptr, case.kv_lens, causal=causal, cluster=cluster, **options)
            assert plan.describe()["cluster"] is cluster
            case.run(plan, stream)
            stream.synchronize()
            assert plan.error_flags(stream=stream) == 0
            results.append((case.device["out"].numpy().copy(),
                            case.device["lse"].numpy().copy()))
    (out, lse), (out_global, lse_global) = results
    ref_out, ref_lse = case.reference(causal=causal)
    assert relative_error(out, ref_out) <= TOLERANCE[case.dtype]
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=2e-3)
    assert out.tobytes() == out_global.tobytes()
    assert lse.tobytes() == lse_global.tobytes()
    return out, lse


@pytest.mark.parametrize("wg_rows", WG_ROWS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("splits", [2, 3, 5, MAX_CLUSTER_SPLITS])
def test_cluster_merge_is_the_global_merge(rng, stream, wg_rows, head_dim, splits):
    """Ragged chunks (a long prefix, a short one that leaves splits idle, an empty row, a
    chunk of more than one row tile) over both warpgroup kernels."""
    case = MultiCase([1, 3, 0, 40, 1], [4000, 70, 9, 2500, 1], 32, 8, head_dim).fill(rng)
    case.upload(rng)
    run_both(case, stream, num_splits=splits, wg_rows=wg_rows)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("scale_mode, scale_dtype", [("token", "float16"), ("head", "float32")])
def test_cluster_merge_over_dtypes_and_scales(rng, stream, dtype, scale_mode, scale_dtype):
    case = MultiCase([2, 1, 5], [3000, 600, 1500], 16, 2, 128, scale_mode=scale_mode,
                     scale_dtype=scale_dtype, dtype=dtype).fill(rng)
    case.upload(rng)
    run_both(case, stream, num_splits=4, causal=False, wgmma=True)


@pytest.mark.parametrize("layout, page_size", [("hnd", 16), ("nhd", 1)])
def test_cluster_merge_over_pages_and_bad_page_ids(rng, stream, layout, page_size):
    case = MultiCase([1, 4, 1], [2000, 900, 30], 64, 1, 128, layout, page_size).fill(rng)
    d = case.upload(rng)
    run_both(case, stream, num_splits=4, causal=False, wg_rows=128)
    table = d["block_table"].numpy()
    table[0, 3] = -5
    table[1, 2] = 1 << 30
    d["block_table"].copy_from_numpy(table)
    with case.make_plan() as plan:
        plan.plan(case.indptr, case.kv_lens, causal=False, num_splits=4, cluster=True,
                  wg_rows=128)
        case.run(plan, stream)
        assert plan.error_flags(stream=stream) == ERROR_BAD_PAGE
        assert np.isfinite(d["out"].numpy()).all()


def test_graph_replay_follows_the_active_splits(rng, stream):
    """One captured clustered launch replayed over lengths that leave 1 to 5 of its splits
    active per sequence (and none: an empty sequence), bitwise equal to eager runs."""
    case = MultiCase([1] * 4, [4096, 2000, 300, 5], 64, 1, 128, capacity=4096).fill(rng)
    case.upload(rng)
    with case.make_plan() as plan:
        plan.plan(None, [4096] * 4, causal=False, num_splits=5, cluster=True, wg_rows=128)
        assert plan.describe()["cluster"]
        check_decode_replays(case, plan, stream, [[4096, 2000, 300, 5], [1, 4096, 0, 1023],
                                                  [3000, 3000, 3000, 3000]])
        assert plan.error_flags(stream=stream) == 0


@pytest.mark.parametrize("batch", [8, 32])
def test_the_planner_clusters_where_the_device_holds_the_clusters(rng, stream, batch):
    """Multi-query decode rows (group 64, 4096 tokens): the planner's splits merge in clusters
    exactly where the device holds the clustered grid as well as the plain one, and the
    result is the oracle's either way."""
    case = MultiCase([1] * batch, [4096] * batch, 64, 1, 128).fill(rng)
    d = case.upload(rng)
    with case.make_plan() as plan:
        plan.plan(None, case.kv_lens, causal=False)
        described = plan.describe()
        splits, ctas = described["num_splits"], batch * described["num_splits"]
        config = LaunchConfig(described["grid"], described["block"], plan.variant.shared_bytes,
                              cluster=(1, splits, 1))
        resident = plan._launch.kernel.max_active_clusters(config)
        assert described["cluster"] == cluster_merge_fits(
            splits, ctas, Device(0).sm_count * described["ctas_per_sm"], resident)
        d["out"].fill(np.nan)
        d["lse"].fill(np.nan)
        plan.run(d["q"], d["k_cache"], d["v_cache"], d["k_scale"], d["v_scale"],
                 d["seq_lens"], None, d["out"], lse=d["lse"], stream=stream)
        stream.synchronize()
    ref_out, ref_lse = case.reference(causal=False)
    assert relative_error(d["out"].numpy(), ref_out) <= TOLERANCE["float16"]
    np.testing.assert_allclose(d["lse"].numpy(), ref_lse, rtol=0, atol=2e-3)


def test_cluster_requires_the_warpgroup_kernels(rng):
    case = MultiCase([1, 1], [2000, 2000], 8, 2, 128).fill(rng)
    arch = Device(0).arch

    def needs(kernel: str, splits: int) -> str:
        return (r"^cluster: the cluster merge needs the warpgroup kernels \(sm_90\) and 2 to 8 "
                rf"splits, got the {kernel} kernel on {arch} with {splits} split\(s\)$")
    with case.make_plan() as plan:
        with pytest.raises(ValueError, match=needs("mma.sync", 4)):
            plan.plan(case.indptr, case.kv_lens, num_splits=4, cluster=True, wgmma=False)
        with pytest.raises(ValueError, match=needs("warpgroup", MAX_CLUSTER_SPLITS + 1)):
            plan.plan(case.indptr, case.kv_lens, num_splits=MAX_CLUSTER_SPLITS + 1,
                      cluster=True, wgmma=True)
        with pytest.raises(ValueError, match=needs("warpgroup", 1)):
            plan.plan(case.indptr, case.kv_lens, num_splits=1, cluster=True, wgmma=True)
        with pytest.raises(TypeError, match=r"^cluster: expected a bool, got int 1$"):
            plan.plan(case.indptr, case.kv_lens, cluster=1)
