"""MultiPlan's separate split merge (multi_combine.cu, ``describe()["merge"] == "kernel"``) on
the GPU: against the float64 oracle and bitwise against the merge by the last split to finish
(the same weights summed in the same order), over every attention kernel shape it serves
(mma.sync at head_dim 64 / 128 / 256 and both split-warp layouts, both warpgroup kernels),
split counts up to the planner's limit, ragged chunks whose short and empty sequences leave
splits idle, decode rows, both dtypes, paged caches, a missing lse, graph replay over lengths
that change the active splits, and the choice and its errors."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import HAS_GPU
from multi_case import TOLERANCE, MultiCase, check_decode_replays, relative_error

from lowlevel_fd.driver import Device
from lowlevel_fd.multi.planner import MAX_SPLITS
from lowlevel_fd.multi.variants import ksplits, wgmma_available

pytestmark = pytest.mark.gpu


def run_both(case: MultiCase, stream, *, causal: bool = True, with_lse: bool = True,
             decode_rows: bool = False, **options) -> None:
    """out and lse merged by the kernel and by the last split, bitwise equal, and the
    kernel's against the oracle; ``decode_rows``: a plan of decode rows (no qo_indptr)."""
    results = []
    d = case.device
    indptr = None if decode_rows else case.indptr
    for combine in (True, False):
        with case.make_plan() as plan:
            plan.plan(indptr, case.kv_lens, causal=causal, combine=combine, cluster=False,
                      **options)
            described = plan.describe()
            assert described["merge"] == ("kernel" if combine else "last split")
            assert described["launches"] == (2 if combine else 1)
            d["out"].fill(np.nan, stream)
            d["lse"].fill(np.nan, stream)
            plan.run(d["q"], d["k_cache"], d["v_cache"], d["k_scale"], d["v_scale"],
                     d["seq_lens"], None if decode_rows else d["qo_indptr"], d["out"],
                     lse=d["lse"] if with_lse else None, block_table=d["block_table"],
                     stream=stream)
            stream.synchronize()
            assert plan.error_flags(stream=stream) == 0
            results.append((d["out"].numpy().copy(), d["lse"].numpy().copy()))
    (out, lse), (out_last, lse_last) = results
    ref_out, ref_lse = case.reference(causal=causal)
    assert relative_error(out, ref_out) <= TOLERANCE[case.dtype]
    assert out.tobytes() == out_last.tobytes()
    if with_lse:
        np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=2e-3)
        assert lse.tobytes() == lse_last.tobytes()
    else:
        assert np.isnan(lse).all()  # never written


def _kernels() -> list[dict]:
    """Every attention kernel shape whose partials multi_combine merges, as plan() options."""
    shapes = [dict(head_dim=dim, ksplit=k, wgmma=False) for dim in (64, 128, 256)
              for k in ksplits(dim)]
    shapes += [dict(head_dim=dim, wg_rows=rows) for dim in (64, 128) for rows in (128, 64)]
    return shapes


@pytest.mark.parametrize("kernel", _kernels(), ids=lambda k: "-".join(
    f"{name}{value}" for name, value in k.items()))
@pytest.mark.parametrize("splits", [2, 5, MAX_SPLITS])
def test_the_merge_kernel_is_the_last_splits_merge(rng, stream, kernel, splits):
    """Ragged chunks (a long prefix, a short one that leaves splits idle, an empty row, a
    chunk of several row tiles) with 2, 5 and 32 splits (four rounds of loads)."""
    kernel = dict(kernel)
    head_dim = kernel.pop("head_dim")
    if "wg_rows" in kernel and not (HAS_GPU and wgmma_available(Device(0).arch, head_dim)):
        pytest.skip("the warpgroup kernels run on sm_90")
    case = MultiCase([1, 3, 0, 40, 1], [4000, 70, 9, 2500, 1], 32, 8, head_dim).fill(rng)
    case.upload(rng)
    run_both(case, stream, num_splits=splits, **kernel)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("with_lse", [True, False])
def test_the_merge_kernel_over_dtypes_decode_rows_and_no_lse(rng, stream, dtype, with_lse):
    """Multi-query decode rows (one row per sequence, group 64), lse optional."""
    case = MultiCase([1] * 6, [4096, 1, 700, 3000, 64, 2049], 64, 1, 128, dtype=dtype,
                     scale_mode="token", scale_dtype="float16").fill(rng)
    case.upload(rng)
    run_both(case, stream, causal=False, with_lse=with_lse, decode_rows=True, num_splits=4)


@pytest.mark.parametrize("layout, page_size", [("hnd", 16), ("nhd", 1)])
def test_the_merge_kernel_over_pages(rng, stream, layout, page_size):
    case = MultiCase([1, 4, 1], [2000, 900, 30], 16, 2, 64, layout, page_size).fill(rng)
    case.upload(rng)
    run_both(case, stream, num_splits=6, causal=False)


def test_graph_replay_follows_the_active_splits(rng, stream):
    """One captured pair of launches replayed over lengths that leave 1 to 7 of its splits
    active per sequence (and none: an empty sequence), bitwise equal to eager runs."""
    case = MultiCase([1] * 4, [4096, 2000, 300, 5], 48, 1, 128, capacity=4096).fill(rng)
    case.upload(rng)
    with case.make_plan() as plan:
        plan.plan(None, [4096] * 4, causal=False, num_splits=7, combine=True)
        assert plan.describe()["merge"] == "kernel"
        check_decode_replays(case, plan, stream, [[4096, 2000, 300, 5], [1, 4096, 0, 1023],
                                                  [3000, 3000, 3000, 3000]])
        assert plan.error_flags(stream=stream) == 0


def test_the_merge_choice_and_its_errors(rng):
    case = MultiCase([1, 1], [3000, 3000], 8, 2, 128).fill(rng)
    with case.make_plan() as plan:
        plan.plan(case.indptr, case.kv_lens, num_splits=1)
        assert plan.describe()["merge"] is None and plan.describe()["launches"] == 1
        plan.plan(case.indptr, case.kv_lens, num_splits=4, wgmma=False)
        assert plan.describe()["merge"] == "kernel"  # the default where no cluster merges
        assert plan._params.combine == 1  # two CTAs per SM: no early launch of the next
        plan.plan(case.indptr, case.kv_lens, num_splits=4, combine=False, cluster=False)
        assert plan.describe()["merge"] == "last split"
        with pytest.raises(TypeError, match=r"^combine: expected a bool, got int 1$"):
            plan.plan(case.indptr, case.kv_lens, combine=1)
        with pytest.raises(ValueError, match=r"^combine: the merge kernel and the cluster "
                                             r"merge exclude each other, got combine=True "
                                             r"with cluster=True$"):
            plan.plan(case.indptr, case.kv_lens, combine=True, cluster=True)
        if wgmma_available(Device(0).arch, 128):  # combine=True forbids the cluster
            plan.plan(case.indptr, case.kv_lens, num_splits=4, wgmma=True, combine=True)
            assert plan.describe()["merge"] == "kernel" and not plan.describe()["cluster"]
            # The merge kernel lets the next launch start early only behind a kernel of one
            # CTA per SM (the 128-row one), not two (64 rows).
            for rows, combine in ((128, 2), (64, 1)):
                plan.plan(case.indptr, case.kv_lens, num_splits=4, wg_rows=rows, combine=True)
                assert plan.describe()["wg_rows"] == rows and plan._params.combine == combine
