"""Specification of DecodePlan.append_and_run's and advance_lengths' checks without a GPU: the
RoPE options of the constructor, the new tokens, the written caches and scales, the RoPE
table. Every error names the argument, and a failed bind leaves the parameter block as it was."""
from __future__ import annotations

import numpy as np
import pytest
from test_validation_cpu import (B, CAPACITY, D, DEVICE, HKV, array, good_arguments, make_plan,
                                 planned)

from lowlevel_fd.decode.bind import bind_append_arguments
from lowlevel_fd.decode.params import DecodeParams


def new_tokens(**replace) -> dict:
    return {"k_new": array((B, HKV, D), "float16", ptr=0xB00000),
            "v_new": array((B, HKV, D), "float16", ptr=0xC00000), "cos_sin": None} | replace


def append_arguments(scale_mode="token", **replace) -> dict:
    arguments = good_arguments(scale_mode=scale_mode)
    arguments["positions"] = arguments.pop("seq_lens")
    return arguments | new_tokens() | replace


def bind(plan, arguments) -> DecodeParams:
    params = DecodeParams()
    params.num_splits, params.partial_out = 4, 0x1234  # what plan() set: must survive
    bind_append_arguments(plan, params, **arguments)
    return params


@pytest.mark.parametrize("overrides, error, message", [
    ({"rope": "llama"}, ValueError, r"^rope: expected one of \[None, 'neox', 'gptj'\], got 'llama'"),
    ({"rope_theta": 1.0}, ValueError, r"^rope_theta: expected a finite base > 1, got 1.0"),
    ({"rope_theta": "1e4"}, TypeError, r"^rope_theta: expected a real number"),
])
def test_constructor_checks_the_rope_options(overrides, error, message):
    with pytest.raises(error, match=message):
        make_plan(**overrides)


@pytest.mark.parametrize("rope, rope_id", [(None, 0), ("neox", 1), ("gptj", 2)])
def test_a_good_bind_sets_the_append_fields_and_keeps_the_plan_fields(rope, rope_id):
    plan = planned()
    plan.rope, plan.rope_theta = rope, 5e5
    params = bind(plan, append_arguments())
    assert (params.append, params.rope, params.rope_theta) == (1, rope_id, pytest.approx(5e5))
    assert (params.k_new, params.v_new, params.cos_sin) == (0xB00000, 0xC00000, 0)
    assert (params.k_new_batch_stride, params.k_new_head_stride) == (HKV * D, D)
    assert (params.v_new_batch_stride, params.v_new_head_stride) == (HKV * D, D)
    assert (params.num_splits, params.partial_out, params.capacity) == (4, 0x1234, CAPACITY)
    assert params.seq_lens == 0x800000  # the positions


def test_the_table_is_bound_when_rope_is_on():
    plan = planned()
    plan.rope = "neox"
    table = array((CAPACITY, D // 2, 2), "float32", ptr=0xD00000)
    assert bind(plan, append_arguments(cos_sin=table)).cos_sin == 0xD00000


CACHE = (B, HKV, CAPACITY, D)
BAD = {
    "k_new shape": (dict(k_new=array((B, HKV + 1, D), "float16")), ValueError,
                    r"^k_new: expected shape \[B, Hkv, D\]=\(2, 2, 128\), got \(2, 3, 128\)"),
    "v_new dtype": (dict(v_new=array((B, HKV, D), "bfloat16")), TypeError,
                    r"^v_new: expected dtype float16, got bfloat16"),
    "k_new misaligned": (dict(k_new=array((B, HKV, D), "float16", ptr=0xB00008)), ValueError,
                         r"^k_new: the data pointer must be 16-byte aligned"),
    "k_new strided": (dict(k_new=array((B, HKV, D), "float16", strides=(HKV * D * 4, D * 4, 4))),
                      ValueError, r"^k_new: the last dimension must be contiguous"),
    "v_new missing": (dict(v_new=None), TypeError, r"^v_new: expected a device array, got None"),
    "q still checked": (dict(q=array((B, 8, 64), "float16")), ValueError, r"^q: expected shape"),
    "broadcast cache": (dict(k_cache=array(CACHE, "int8", ptr=0x200000,
                                           strides=(0, CAPACITY * D, D, 1)),
                             v_cache=array(CACHE, "int8", ptr=0x400000,
                                           strides=(0, CAPACITY * D, D, 1))),
                        ValueError, r"^k_cache: "),
    "broadcast scales": (dict(k_scale=array((B, HKV, CAPACITY), "float32", ptr=0x600000,
                                            strides=(0, CAPACITY * 4, 4)),
                              v_scale=array((B, HKV, CAPACITY), "float32", ptr=0x700000,
                                            strides=(0, CAPACITY * 4, 4))),
                         ValueError, r"^k_scale: "),
    "table without rope": (dict(cos_sin=array((CAPACITY, D // 2, 2), "float32")), ValueError,
                           r"^cos_sin: the plan applies no RoPE \(rope=None\)"),
}


@pytest.mark.parametrize("replace, error, message", BAD.values(), ids=BAD.keys())
def test_bad_arguments_raise_and_leave_the_block_untouched(replace, error, message):
    params = DecodeParams()
    with pytest.raises(error, match=message):
        bind_append_arguments(planned(), params, **append_arguments(**replace))
    assert bytes(params) == bytes(DecodeParams())


def test_a_short_rope_table_is_refused():
    plan = planned()
    plan.rope = "gptj"
    with pytest.raises(ValueError, match=r"^cos_sin: expected a row for every cache position "
                                         r"\(max_pos >= S_max=256\), got max_pos=255"):
        bind(plan, append_arguments(cos_sin=array((CAPACITY - 1, D // 2, 2), "float32")))


def test_run_after_append_and_run_binds_a_plain_launch(monkeypatch):
    plan = planned()
    launches = []
    plan._split = plan._split_append = type("Stub", (), {
        "launch": lambda self, stream: launches.append(plan._params.append)})()
    plan.append_and_run(**append_arguments(), stream=None)
    plan.run(**good_arguments(), stream=None)
    assert launches == [1, 0]


@pytest.mark.parametrize("lengths, capacity, error, message", [
    (array((B,), "int64"), 64, TypeError, r"^seq_lens: expected dtype int32, got int64"),
    (array((B, 1), "int32"), 64, ValueError, r"^seq_lens: expected shape \[B\], got \(2, 1\)"),
    (array((B,), "int32"), 0, ValueError, r"^capacity: expected the caches' S_max in \[1, "),
    (array((B,), "int32"), 64.0, TypeError, r"^capacity: expected an int"),
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
    with pytest.raises(RuntimeError, match=r"append_and_run: call plan\(seq_lens, append=True\)"):
        plan.append_and_run(*([None] * 9), stream=None)
    with pytest.raises(RuntimeError, match=r"advance_lengths: call plan"):
        plan.advance_lengths(None, 1, stream=None)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_early_reads_must_be_a_bool(value):
    plan = make_plan()
    with pytest.raises(TypeError, match=r"^early_reads: expected a bool"):
        plan.append_and_run(*([None] * 9), early_reads=value, stream=None)


def test_plan_append_must_be_a_bool():
    with pytest.raises(TypeError, match=r"^append: expected a bool, got int 1"):
        make_plan().plan([5], append=1)
