"""Specification of DecodePlan.append_and_run's and advance_lengths' checks without a GPU: the
RoPE options of the cache spec, plan(seq_lens, append=True), the new tokens, the written caches
and scales, the RoPE table. Every error names the argument, and a failed bind leaves the
parameter block as it was."""
from __future__ import annotations

import numpy as np
import pytest
from stand_ins import fake
from test_validation_cpu import B, CAPACITY, D, HKV, good_arguments, make_plan, planned

from lowlevel_fd.decode import plan as decode_plan
from lowlevel_fd.decode.params import DecodeParams


def new_tokens(**replace) -> dict:
    return {"k_new": fake((B, HKV, D), "float16", ptr=0xB00000),
            "v_new": fake((B, HKV, D), "float16", ptr=0xC00000), "cos_sin": None} | replace


def append_arguments(scale_mode="token", **replace) -> dict:
    # seq_lens: the tokens already cached; the new one goes to seq_lens[b].
    return good_arguments(scale_mode=scale_mode) | new_tokens() | replace


def bind(plan, arguments) -> DecodeParams:
    params = DecodeParams()
    params.num_splits, params.partial_out = 4, 0x1234  # what plan() set: must survive
    plan._binder.bind_append(params, **arguments)
    return params


@pytest.mark.parametrize("overrides, error, message", [
    ({"rope": "llama"}, ValueError,
     r"^rope: expected one of \[None, 'neox', 'gptj'\], got 'llama'"),
    ({"rope_theta": 1.0}, ValueError, r"^rope_theta: expected a finite base > 1, got 1.0"),
    ({"rope_theta": "1e4"}, TypeError, r"^rope_theta: expected a real number"),
])
def test_constructor_checks_the_rope_options(overrides, error, message):
    with pytest.raises(error, match=message):
        make_plan(**overrides)


@pytest.mark.parametrize("rope, rope_id", [(None, 0), ("neox", 1), ("gptj", 2)])
def test_a_good_bind_sets_the_append_fields_and_keeps_the_plan_fields(rope, rope_id):
    plan = planned(rope=rope, rope_theta=5e5)
    params = bind(plan, append_arguments())
    assert (params.append, params.rope, params.rope_theta) == (1, rope_id, pytest.approx(5e5))
    assert (params.k_new, params.v_new, params.cos_sin) == (0xB00000, 0xC00000, 0)
    assert (params.k_new_batch_stride, params.k_new_head_stride) == (HKV * D, D)
    assert (params.v_new_batch_stride, params.v_new_head_stride) == (HKV * D, D)
    assert (params.num_splits, params.partial_out, params.capacity) == (4, 0x1234, CAPACITY)
    assert params.seq_lens == 0x800000  # where the new tokens go


def test_the_table_is_bound_when_rope_is_on():
    plan = planned(rope="neox")
    table = fake((CAPACITY, D // 2, 2), "float32", ptr=0xD00000)
    assert bind(plan, append_arguments(cos_sin=table)).cos_sin == 0xD00000


CACHE = (B, HKV, CAPACITY, D)
BAD = {
    "k_new shape": (dict(k_new=fake((B, HKV + 1, D), "float16")), ValueError,
                    r"^k_new: expected shape \[B, Hkv, D\]=\(2, 2, 128\), got \(2, 3, 128\)"),
    "v_new dtype": (dict(v_new=fake((B, HKV, D), "bfloat16")), TypeError,
                    r"^v_new: expected dtype float16, got bfloat16"),
    "k_new misaligned": (dict(k_new=fake((B, HKV, D), "float16", ptr=0xB00008)), ValueError,
                         r"^k_new: the data pointer must be 16-byte aligned"),
    "k_new strided": (dict(k_new=fake((B, HKV, D), "float16", strides=(HKV * D * 4, D * 4, 4))),
                      ValueError, r"^k_new: the last dimension must be contiguous"),
    "v_new missing": (dict(v_new=None), TypeError, r"^v_new: expected a device array, got None"),
    "q still checked": (dict(q=fake((B, 8, 64), "float16")), ValueError, r"^q: expected shape"),
    "broadcast cache": (dict(k_cache=fake(CACHE, "int8", ptr=0x200000,
                                          strides=(0, CAPACITY * D, D, 1)),
                             v_cache=fake(CACHE, "int8", ptr=0x400000,
                                          strides=(0, CAPACITY * D, D, 1))),
                        ValueError, r"^k_cache: "),
    "broadcast scales": (dict(k_scale=fake((B, HKV, CAPACITY), "float32", ptr=0x600000,
                                           strides=(0, CAPACITY * 4, 4)),
                              v_scale=fake((B, HKV, CAPACITY), "float32", ptr=0x700000,
                                           strides=(0, CAPACITY * 4, 4))),
                         ValueError, r"^k_scale: "),
    "table without rope": (dict(cos_sin=fake((CAPACITY, D // 2, 2), "float32")), ValueError,
                           r"^cos_sin: the cache spec applies no RoPE \(rope=None\)"),
}


@pytest.mark.parametrize("replace, error, message", BAD.values(), ids=BAD.keys())
def test_bad_arguments_raise_and_leave_the_block_untouched(replace, error, message):
    params = DecodeParams()
    with pytest.raises(error, match=message):
        planned()._binder.bind_append(params, **append_arguments(**replace))
    assert bytes(params) == bytes(DecodeParams())


@pytest.mark.parametrize("replace, error, message", BAD.values(), ids=BAD.keys())
def test_a_rejected_bind_leaves_the_last_good_bind_in_place(replace, error, message):
    plan = planned()
    params = bind(plan, append_arguments())
    before = bytes(params)
    with pytest.raises(error, match=message):
        plan._binder.bind_append(params, **append_arguments(**replace))
    assert bytes(params) == before, "a failed bind writes nothing"


def test_a_short_rope_table_is_refused():
    plan = planned(rope="gptj")
    with pytest.raises(ValueError, match=r"^cos_sin: expected a row for every cache position "
                                         r"\(max_pos >= S_max=256\), got max_pos=255"):
        bind(plan, append_arguments(cos_sin=fake((CAPACITY - 1, D // 2, 2), "float32")))


def test_run_after_append_and_run_binds_a_plain_launch(monkeypatch):
    plan = planned()
    launches = []
    plan._split = plan._split_append = type("Stub", (), {
        "launch": lambda self, stream: launches.append(plan._params.append)})()
    plan.append_and_run(**append_arguments(), stream=None)
    plan.run(**good_arguments(), stream=None)
    assert launches == [1, 0]


# -- plan(seq_lens, append=True): the cached lengths, plus the new token ------------------------
class Planned(Exception):
    """Raised by the stand-in planner: what plan() asked for, before any GPU work."""


@pytest.fixture
def workloads(monkeypatch) -> list:
    seen: list = []

    def choose(work, **kwargs):
        seen.append(work)
        raise Planned

    monkeypatch.setattr(decode_plan, "choose", choose)
    monkeypatch.setattr(decode_plan, "load_kernels",
                        lambda *a: pytest.fail("a rejected plan loaded kernels"))
    return seen


@pytest.mark.parametrize("lengths, message", [
    ([5, 100], r"^seq_lens: sequence 1 has length 100, leaving no room for the new token "
               r"\(max_seq_len=100\)$"),
    ([100, 0, 100], r"^seq_lens: sequence 0 has length 100, leaving no room for the new token "
                    r"\(max_seq_len=100\)$"),
    (np.array([100], np.int32), r"^seq_lens: sequence 0 has length 100, leaving no room"),
])
def test_plan_append_rejects_a_full_sequence(lengths, message, workloads):
    plan = make_plan(max_seq_len=100)
    with pytest.raises(ValueError, match=message):
        plan.plan(lengths, append=True)
    assert workloads == [], "rejected before planning"


def test_plan_append_still_checks_the_lengths_first(workloads):
    with pytest.raises(ValueError, match=r"^seq_lens: expected lengths in \[0, max_seq_len=100\]"):
        make_plan(max_seq_len=100).plan([101], append=True)


def test_plan_append_plans_for_the_cached_lengths_plus_the_new_token(workloads):
    plan = make_plan(max_seq_len=100)
    for append in (True, False):
        with pytest.raises(Planned):
            plan.plan([5, 99], append=append)
    assert [(w.batch, w.max_len) for w in workloads] == [(2, 100), (2, 99)]
    with pytest.raises(Planned):
        plan.plan([100], append=False)  # without the append a full cache is attended as it is
    assert workloads[-1].max_len == 100


@pytest.mark.parametrize("lengths, capacity, error, message", [
    (fake((B,), "int64"), 64, TypeError, r"^seq_lens: expected dtype int32, got int64"),
    (fake((B, 1), "int32"), 64, ValueError,
     r"^seq_lens: expected shape \[B\]=\('\*',\), got \(2, 1\)"),
    (fake((B,), "int32"), 0, ValueError,
     r"^capacity: expected an int in \[1, 2147483648\), got 0$"),
    (fake((B,), "int32"), 64.0, TypeError, r"^capacity: expected an int"),
    (np.zeros(B, np.int32), 64, TypeError, r"^seq_lens: expected a DeviceArray"),
])
def test_advance_lengths_checks_its_arguments(lengths, capacity, error, message):
    plan = planned()
    plan._split = object()
    plan._advance = type("Stub", (), {"prepare": lambda *a, **k: pytest.fail("launched")})()
    with pytest.raises(error, match=message):
        plan.advance_lengths(lengths, capacity, stream=None)


def test_append_and_run_and_advance_need_a_plan():
    plan = make_plan()
    with pytest.raises(RuntimeError,
                       match=r"^append_and_run: call plan\(seq_lens, append=True\) first$"):
        plan.append_and_run(*([None] * 9), stream=None)
    with pytest.raises(RuntimeError, match=r"^advance_lengths: call plan\(seq_lens\) first$"):
        plan.advance_lengths(None, 1, stream=None)
    with pytest.raises(RuntimeError, match=r"^prepare_append_and_run: call plan\(seq_lens, "
                                           r"append=True\) first$"):
        plan.prepare_append_and_run(*([None] * 9))
    plan._split = object()  # planned, but without append=True
    for call in (lambda: plan.append_and_run(*([None] * 9), stream=None),
                 lambda: plan.prepare_append_and_run(*([None] * 9))):
        with pytest.raises(RuntimeError, match=r"append_and_run: call plan\(seq_lens, "
                                               r"append=True\) first$"):
            call()


@pytest.mark.parametrize("value", [1, "yes", None])
def test_early_reads_must_be_a_bool(value):
    plan = make_plan()
    with pytest.raises(TypeError, match=r"^early_reads: expected a bool"):
        plan.append_and_run(*([None] * 9), early_reads=value, stream=None)
    with pytest.raises(TypeError, match=r"^early_reads: expected a bool"):
        plan.prepare_append_and_run(*([None] * 9), early_reads=value)


def test_plan_append_must_be_a_bool():
    with pytest.raises(TypeError, match=r"^append: expected a bool, got int 1"):
        make_plan().plan([5], append=1)
