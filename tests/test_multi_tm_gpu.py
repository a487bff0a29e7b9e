"""The token-major multi-query kernel (multi_tm.cu, ``plan(..., token_major=True)``): MultiPlan's
decode rows of 17-64 query heads per KV head at head_dim 128 on sm_90, against the float64
decode oracle: groups that pad to 64 heads, lengths at tile edges and empty rows, KV splits
and their merge kernel, early reads, every scale mode and dtype, both contiguous layouts and
paged caches (bad page ids flagged), scores and V scales that grow along the sequence (the
rare rescaling path), any sign of the score scale, RoPE of appended rows and Hadamard keys
(against the warpgroup kernel), graph replay, and DecodePlan's route onto it."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import HAS_GPU
from decode_case import TOLERANCE, Case
from multi_case import MultiCase, check_decode_replays, relative_error
from paged_case import paginate
from test_paged_gpu import CACHE, contiguous

from lowlevel_fd import ERROR_BAD_PAGE, DecodePlan, MultiPlan
from lowlevel_fd.driver import Device, DeviceArray, dtypes
from lowlevel_fd.multi.variants import token_major_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (HAS_GPU and token_major_available(Device(0).arch, 128)),
    reason="the token-major kernel runs on sm_90")]

# Empty rows, one token, tile edges (64 tokens), a team's second tile, split edges.
LENGTHS = [0, 1, 63, 64, 65, 127, 128, 129, 1000, 2049, 4096]


def run_rows(case: Case, plan: MultiPlan, stream, *, early_reads: bool = False,
             block_table=None, cache=None) -> tuple[np.ndarray, np.ndarray]:
    """Decode rows (no qo_indptr) after a NaN poison: (out, lse) as float64."""
    d = case.device
    cache = cache or (d["k"], d["v"], d["k_scale"], d["v_scale"])
    d["out"].fill(float("nan"))
    d["lse"].fill(float("nan"))
    plan.run(d["q"], *cache, d["seq_lens"], None, d["out"], lse=d["lse"],
             block_table=block_table, early_reads=early_reads, stream=stream)
    stream.synchronize()
    return d["out"].numpy().astype(np.float64), d["lse"].numpy().astype(np.float64)


def rows_plan(case: Case, **options) -> MultiPlan:
    return MultiPlan.create(case.num_q_heads, case.num_kv_heads, case.head_dim,
                            max_batch=case.batch, max_seq_len=case.capacity, dtype=case.dtype,
                            kv_layout=case.kv_layout, scale_mode=case.scale_mode,
                            scale_dtype=case.scale_dtype, **options)


@pytest.mark.parametrize("splits", [None, 1, 3, 32])
@pytest.mark.parametrize("group, num_kv_heads", [(17, 1), (24, 2), (32, 1), (33, 1), (48, 1),
                                                 (63, 2), (64, 1), (64, 3)])
def test_token_major_matches_the_decode_oracle(rng, stream, group, num_kv_heads, splits):
    case = Case.random(rng, LENGTHS, num_q_heads=group * num_kv_heads,
                       num_kv_heads=num_kv_heads, capacity=4096)
    case.upload()
    with rows_plan(case) as plan:
        plan.plan(None, case.lengths, causal=False, num_splits=splits, token_major=True)
        described = plan.describe()
        assert described["token_major"] and described["kernel"].startswith(
            "llfd::multi_attend_tm<")
        assert described["merge"] == (None if described["num_splits"] == 1 else "kernel")
        for early in (False, True):
            case.check(*run_rows(case, plan, stream, early_reads=early))
        assert plan.error_flags(stream=stream) == 0


@pytest.mark.parametrize("scale_mode, scale_dtype", [("tensor", "float32"), ("head", "float32"),
                                                     ("token", "float32"), ("token", "float16")])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kv_layout", ["bnsh", "bsnh"])
def test_token_major_across_scale_modes_dtypes_and_layouts(rng, stream, scale_mode, scale_dtype,
                                                          dtype, kv_layout):
    case = Case.random(rng, [700, 0, 65, 3000], num_q_heads=128, num_kv_heads=2,
                       scale_mode=scale_mode, scale_dtype=scale_dtype, dtype=dtype,
                       kv_layout=kv_layout, capacity=3002)
    case.upload()
    with rows_plan(case) as plan:
        plan.plan(None, case.lengths, causal=False, token_major=True)
        case.check(*run_rows(case, plan, stream))
        plan.plan(None, case.lengths, causal=False, token_major=True, num_splits=4)
        case.check(*run_rows(case, plan, stream))


@pytest.mark.parametrize("layout, page_size, mode, scale_dtype", [
    ("hnd", 16, "token", "float32"), ("nhd", 16, "token", "float16"),
    ("hnd", 1, "token", "float32"), ("nhd", 64, "head", "float32"),
    ("hnd", 256, "tensor", "float32")])
def test_token_major_over_pages_and_bad_page_ids(rng, stream, layout, page_size, mode,
                                                  scale_dtype):
    case = Case.random(rng, [0, 15, 16, 17, 300, 1037], num_q_heads=64, num_kv_heads=1,
                       scale_mode=mode, scale_dtype=scale_dtype, capacity=1038)
    case.upload()
    pages = paginate(rng, contiguous(case), layout, page_size, token_scales=mode == "token")
    d = pages.upload()
    cache = tuple(d[name] for name in CACHE)
    with MultiPlan.create(64, 1, 128, max_batch=case.batch, max_seq_len=case.capacity,
                          kv_layout=layout, page_size=page_size, scale_mode=mode,
                          scale_dtype=scale_dtype) as plan:
        plan.plan(None, case.lengths, causal=False, token_major=True)
        case.check(*run_rows(case, plan, stream, block_table=d["block_table"], cache=cache))
        assert plan.error_flags(stream=stream) == 0
        table = d["block_table"].numpy()
        table[5, 3] = -1
        table[4, 0] = 1 << 30
        d["block_table"].copy_from_numpy(table)
        out, lse = run_rows(case, plan, stream, block_table=d["block_table"], cache=cache)
        assert plan.error_flags(stream=stream) == ERROR_BAD_PAGE
        assert np.isfinite(out).all() and not np.isnan(lse).any()
        ref, _ = case.reference()
        good = [0, 1, 2, 3]  # the sequences without a bad page are exact
        assert relative_error(out[good], ref[good]) <= TOLERANCE["float16"]


@pytest.mark.parametrize("scale_dtype", ["float32", "float16"])
def test_scores_and_v_scales_that_grow_along_the_sequence(rng, stream, scale_dtype):
    """K scales that grow by e^6 over the sequence (each tile's maximum passes the lazy
    bound: the shared-memory rescaling path, many times), V scales that grow by e^5 (a larger
    V scale than any before: the same path), one token with a score far above the rest."""
    case = Case.random(rng, [4096, 3000, 130], num_q_heads=64, num_kv_heads=1,
                       scale_dtype=scale_dtype, capacity=4096)
    ramp = np.exp(np.linspace(0.0, 6.0, 4096))
    case.host["k_scale"] = (case.host["k_scale"] * 0.2 * ramp).astype(case.host["k_scale"].dtype)
    case.host["v_scale"] = (case.host["v_scale"] * np.exp(np.linspace(0.0, 5.0, 4096))).astype(
        case.host["v_scale"].dtype)
    case.host["k"][1, 0, 2500] = np.sign(case.host["q"][1, 0]).astype(np.int8) * 127
    case.upload()
    with rows_plan(case) as plan:
        for splits in (None, 1):
            plan.plan(None, case.lengths, causal=False, token_major=True, num_splits=splits)
            case.check(*run_rows(case, plan, stream))


@pytest.mark.parametrize("sm_scale, k_scale", [(-0.1, 1.0), (0.1, -1.0), (0.1, 0.0),
                                               (-0.05, -2.0)])
def test_any_sign_of_the_score_scale(rng, stream, sm_scale, k_scale):
    case = Case.random(rng, [200, 33, 1], num_q_heads=48, num_kv_heads=1, scale_mode="head",
                       capacity=200)
    case.host["k_scale"] = (case.host["k_scale"] * np.float32(k_scale)).astype(np.float32)
    case.upload()
    with rows_plan(case, sm_scale=sm_scale) as plan:
        plan.plan(None, case.lengths, causal=False, token_major=True)
        case.check(*run_rows(case, plan, stream), sm_scale=sm_scale)


@pytest.mark.parametrize("rope, table, key_transform", [("neox", False, "none"),
                                                        ("gptj", True, "none"),
                                                        ("neox", True, "hadamard")])
def test_appended_rows_rotate_q_as_the_warpgroup_kernel_does(rng, stream, rope, table,
                                                             key_transform):
    """appended=True (DecodePlan.append_and_run's lengths: seq_lens[b] + 1 tokens, q rotated
    at seq_lens[b]; outside the cache q is used as given) with rotate_q, against the warpgroup
    kernel's rows on the same inputs."""
    from lowlevel_fd.reference import rope_table
    case = MultiCase([1] * 4, [500, 63, 4095, 1], 64, 1, 128, capacity=4096).fill(rng)
    d = case.upload(rng)
    d["seq_lens"].copy_from_numpy(np.array([500, 63, 4095, 4096], np.int32))  # last: outside
    cos_sin = DeviceArray.from_numpy(rope_table(case.capacity, 128)) if table else None
    results = {}
    for token_major in (True, False):
        with case.make_plan(rope=rope, key_transform=key_transform) as plan:
            plan.plan(None, [4096] * 4, causal=False, token_major=token_major)
            assert plan.describe()["token_major"] is token_major
            d["out"].fill(np.nan)
            plan.run(d["q"], *(d[name] for name in ("k_cache", "v_cache", "k_scale", "v_scale")),
                     d["seq_lens"], None, d["out"], lse=d["lse"], rotate_q=True,
                     cos_sin=cos_sin, appended=True, stream=stream)
            stream.synchronize()
            results[token_major] = d["out"].numpy().astype(np.float64)
    assert np.isfinite(results[True]).all()
    assert relative_error(results[True], results[False]) <= 2 * TOLERANCE["float16"]


def test_graph_replay_follows_new_lengths(rng, stream):
    case = MultiCase([1] * 4, [4096, 2000, 300, 5], 48, 1, 128, capacity=4096).fill(rng)
    case.upload(rng)
    with case.make_plan() as plan:
        plan.plan(None, [4096] * 4, causal=False, token_major=True)
        assert plan.describe()["merge"] == "kernel"
        check_decode_replays(case, plan, stream, [[4096, 2000, 300, 5], [1, 4096, 0, 1023],
                                                  [64, 65, 0, 4096]])
        assert plan.error_flags(stream=stream) == 0


def test_decode_plan_routes_multi_query_groups_onto_it(rng, stream):
    case = Case.random(rng, [4096] * 32, num_q_heads=64, num_kv_heads=1, capacity=4096)
    with case.make_plan(max_batch=32) as plan:
        out, lse = case.run(plan, stream)
        described = plan.describe()
        assert described["backend"] == "multi" and described["multi"]["token_major"]
        case.check(out, lse)
        assert plan.error_flags(stream=stream) == 0


def test_the_choice_and_its_errors(rng):
    case = Case.random(rng, [100, 100], num_q_heads=64, num_kv_heads=1, capacity=100)
    with rows_plan(case) as plan:
        assert plan.plan(None, case.lengths, causal=False).describe()["token_major"]
        assert not plan.plan(None, case.lengths, causal=False,
                             token_major=False).describe()["token_major"]
        assert not plan.plan(None, case.lengths, causal=False,
                             wgmma=True).describe()["token_major"]
        with pytest.raises(ValueError, match=r"^token_major: the token-major kernel runs decode "
                                             r"rows \(qo_indptr=None\), got a qo_indptr$"):
            plan.plan([0, 1, 2], case.lengths, token_major=True)
        with pytest.raises(ValueError, match=r"^token_major: the token-major kernel takes none "
                                             r"of wg_rows, combine=False$"):
            plan.plan(None, case.lengths, token_major=True, wg_rows=64, combine=False)
        with pytest.raises(TypeError, match=r"^token_major: expected a bool, got int 1$"):
            plan.plan(None, case.lengths, token_major=1)
    wide = Case.random(rng, [100], num_q_heads=71, num_kv_heads=1, capacity=100)
    with rows_plan(wide) as plan:
        assert not plan.plan(None, wide.lengths, causal=False).describe()["token_major"]
        with pytest.raises(ValueError, match=r"^token_major: the token-major kernel takes up "
                                             r"to 64 query heads per KV head, got 71$"):
            plan.plan(None, wide.lengths, token_major=True)
    narrow = Case.random(rng, [100], num_q_heads=16, num_kv_heads=1, head_dim=64, capacity=100)
    with rows_plan(narrow) as plan:
        with pytest.raises(ValueError, match=r"^token_major: the token-major kernel needs an "
                                             r"sm_90 device and head_dim 128, got sm_90 and "
                                             r"head_dim 64$"):
            plan.plan(None, narrow.lengths, token_major=True)
