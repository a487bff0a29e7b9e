"""The int8-q kernel's host side without a GPU: the option and its gate on Hadamard keys, the
planner's choice and its errors, the variants, the q rounding oracle, and the kernel's NVRTC
compile (no spills, no stack, the shared memory it claims)."""
from __future__ import annotations

import numpy as np
import pytest
from stand_ins import DEVICE, StandInDevice

from lowlevel_fd import DecodePlan, DecodeStep, KVCacheSpec, MultiPlan
from lowlevel_fd.multi.planner import (INT8_Q_MAX_ROWS, INT8_Q_MIN_ROWS, choose_int8_q,
                                       int8_q_unable)
from lowlevel_fd.multi.variants import Q8_SHARED_BYTES, MultiVariant
from lowlevel_fd.reference_multi import int8_query_rows

HADAMARD = KVCacheSpec(1, 128, key_transform="hadamard")


@pytest.mark.parametrize("make", [
    lambda **o: MultiPlan.create(64, 1, 128, max_batch=2, max_seq_len=64, device=DEVICE, **o),
    lambda **o: DecodePlan.create(64, 1, 128, max_batch=2, max_seq_len=64, device=DEVICE, **o),
    lambda **o: DecodeStep.create(2, 64, 1, 128, max_batch=2, max_seq_len=64, device=DEVICE,
                                  **o),
])
def test_allow_int8_q_needs_hadamard_keys_and_a_bool(make):
    with pytest.raises(ValueError, match=r"^allow_int8_q: q in int8 needs key_transform="
                                         r"'hadamard' \(measured harmless there, not without\), "
                                         r"got key_transform='none'$"):
        make(allow_int8_q=True)
    with pytest.raises(TypeError, match=r"^allow_int8_q: expected a bool, got int 1$"):
        make(allow_int8_q=1, key_transform="hadamard")
    assert make(allow_int8_q=True, key_transform="hadamard") is not None


def test_the_planner_takes_the_int8_q_kernel_where_allowed_and_able():
    for rows in (INT8_Q_MIN_ROWS - 1, INT8_Q_MIN_ROWS, INT8_Q_MAX_ROWS, INT8_Q_MAX_ROWS + 1):
        expected = INT8_Q_MIN_ROWS <= rows <= INT8_Q_MAX_ROWS
        assert choose_int8_q(None, True, None, rows) == expected
        assert not choose_int8_q(None, False, None, rows)
        assert not choose_int8_q(None, True, "cannot", rows)
        assert not choose_int8_q(False, True, None, rows)
        assert choose_int8_q(True, True, None, rows)  # forced: any group, 64 rows per tile
    with pytest.raises(ValueError, match=r"^int8_q: the plan was made with allow_int8_q=False"):
        choose_int8_q(True, False, None, 64)
    with pytest.raises(ValueError, match=r"^int8_q: the int8-q kernel takes decode rows only"):
        choose_int8_q(True, True, "takes decode rows only (qo_indptr=None)", 64)


@pytest.mark.parametrize("arch, spec, options, reason", [
    ("sm_90", HADAMARD, {}, None),
    ("sm_80", HADAMARD, {}, "needs an sm_90 device, got sm_80"),
    ("sm_90", KVCacheSpec(1, 64, key_transform="hadamard"), {}, "takes head_dim 128"),
    ("sm_90", KVCacheSpec(1, 128, scale_mode="head"), {}, "scale_mode 'head'"),
    ("sm_90", KVCacheSpec(1, 128, "nhd", page_size=16), {}, "page_size 16"),
    ("sm_90", HADAMARD, {"decode_rows": False}, "takes decode rows only"),
    ("sm_90", HADAMARD, {"tree": True}, "excludes tree masks"),
    ("sm_90", HADAMARD, {"ksplit": 2}, "excludes tree masks, ksplit > 1"),
    ("sm_90", HADAMARD, {"wgmma": True}, "wgmma=True"),
    ("sm_90", HADAMARD, {"wg_rows": 64}, "wg_rows=64"),
])
def test_what_the_int8_q_kernel_cannot_serve(arch, spec, options, reason):
    options = {"decode_rows": True, "tree": False, "ksplit": None, "wgmma": None,
               "wg_rows": None} | options
    found = int8_q_unable(arch, spec, **options)
    assert found is None if reason is None else reason in found


def test_plan_forcing_int8_q_names_what_is_missing():
    plan = MultiPlan.create(64, 1, 128, max_batch=2, max_seq_len=64, device=DEVICE,
                            key_transform="hadamard", allow_int8_q=True)
    with pytest.raises(ValueError, match=r"^int8_q: the int8-q kernel takes decode rows only"):
        plan.plan([0, 1, 2], [5, 6], int8_q=True)
    with pytest.raises(TypeError, match=r"^int8_q: expected a bool, got int 1$"):
        plan.plan(None, [5, 6], int8_q=1)
    old = StandInDevice(0)
    old.arch = "sm_80"
    plan = MultiPlan.create(64, 1, 128, max_batch=2, max_seq_len=64, device=old,
                            key_transform="hadamard", allow_int8_q=True)
    with pytest.raises(ValueError, match=r"^int8_q: the int8-q kernel needs an sm_90 device, "
                                         r"got sm_80$"):
        plan.plan(None, [5, 6], int8_q=True)


def test_int8_q_variants_reject_what_the_kernel_lacks():
    with pytest.raises(ValueError, match=r"^the int8-q kernel takes head_dim 128, per-token "
                                         r"scales and a contiguous cache"):
        MultiVariant(64, int8_q=True)
    with pytest.raises(ValueError, match=r"paged True"):
        MultiVariant(128, paged=True, int8_q=True)
    variant = MultiVariant(128, "bfloat16", scale_dtype="float16", int8_q=True)
    assert variant.kernel == "llfd::multi_attend_q8<llfd::bf16, uint16_t>"
    assert variant.target_arch("sm_90") == "sm_90a" and not variant.builds_for("sm_80")


def test_int8_q_kernels_compile_without_spills_or_stack_and_claim_their_shared_memory():
    """Q8Layout: 4 int8 stages of 16 KB, 4 widened V copies of 17 KB (WgLayout's V and scale
    regions), 1 KB to align; the loading warpgroup's 72 registers and the teams' 216 fit."""
    assert Q8_SHARED_BYTES == 4 * 16384 + 4 * 17408 + 1024
    for dtype in ("float16", "bfloat16"):
        for scale_dtype in ("float32", "float16"):
            variant = MultiVariant(128, dtype, scale_dtype=scale_dtype, int8_q=True)
            program = variant.compile("sm_90")
            for name in variant.kernel_names:
                r = program.resources[program.symbol(name)]
                assert (r.spill_store_bytes, r.spill_load_bytes, r.stack_bytes) == (0, 0, 0)
                assert r.registers * variant.threads <= 65536, name


def test_int8_query_rows_round_each_row_to_127_steps_of_its_largest():
    rng = np.random.default_rng(7)
    q = rng.standard_normal((6, 4, 128)).astype(np.float16)
    q[0, 0] = 0  # a zero row stays zero
    q[1, 1, 5] = 40.0  # an outlier sets its row's step
    rounded = int8_query_rows(q)
    x = q.astype(np.float64)
    top = np.abs(x).max(axis=-1, keepdims=True)
    step = top / 127
    assert (np.abs(rounded - x) <= step / 2 * (1 + 1e-6)).all()
    steps = np.divide(rounded, step, out=np.zeros_like(rounded), where=step > 0)
    np.testing.assert_allclose(steps, np.rint(steps), atol=1e-3)
    assert (rounded[0, 0] == 0).all()
    np.testing.assert_allclose(np.abs(rounded).max(axis=-1), top[..., 0], rtol=1e-6)
    # bf16 or rotated rows pass through fp16 scaled by a power of two first: the same steps
    # for values fp16 holds exactly
    np.testing.assert_array_equal(int8_query_rows(x * 2.0**-20), rounded * 2.0**-20)


@pytest.mark.parametrize("batch, group, seq, pays", [
    (128, 64, 4096, True), (128, 32, 1024, True), (32, 64, 16384, True),
    (16, 64, 32768, True), (32, 64, 4096, False), (8, 64, 32768, False),
    (128, 64, 512, False), (64, 32, 1024, False),
])
def test_int8_q_pays_for_long_tiles_per_cta(batch, group, seq, pays):
    """PERF_NOTES v42 on the H200's 132 SMs: unsplit with >= 16 tiles per CTA, or splits of
    >= 48 tiles (each split pays its fixed chain and the merge kernel)."""
    from lowlevel_fd.multi.planner import int8_q_pays
    lengths = np.full(batch, seq, np.int64)
    assert int8_q_pays(np.ones(batch, np.int64), lengths, group, 1, 132) == pays


def test_decode_plans_route_to_int8_q_only_where_allowed_and_paying():
    from lowlevel_fd.decode.route import wants_multi
    spec = KVCacheSpec(1, 128, key_transform="hadamard")
    lengths = np.full(128, 1024, np.int64)
    # group 32 over 33 MiB: rule 8 keeps the decode kernel, int8 q takes the route
    assert not wants_multi(None, spec, 32, 2, lengths, DEVICE, False)
    assert wants_multi(None, spec, 32, 2, lengths, DEVICE, False, True)
    assert not wants_multi(None, spec, 32, 2, lengths[:64], DEVICE, False, True)
    assert not wants_multi(None, spec, 8, 1, lengths, DEVICE, False, True)  # below 16 heads
    plan = DecodePlan(spec, 32, max_batch=2, max_seq_len=64, device=DEVICE, allow_int8_q=True)
    with pytest.raises(ValueError, match=r"^int8_q: the int8-q kernel runs on the multi-token "
                                         r"route, got int8_q=True with multi=False$"):
        plan.plan([5, 6], int8_q=True, multi=False)
    with pytest.raises(TypeError, match=r"^int8_q: expected a bool, got int 1$"):
        plan.plan([5, 6], int8_q=1)
