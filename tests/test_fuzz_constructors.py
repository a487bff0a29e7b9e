"""Fuzzing of the constructors' option checks (KVCacheSpec, and the keyword forms of DecodePlan,
AppendPlan, PromptQuantizer and DecodeStep): a valid configuration with one option broken, a
wrong value or a wrong type, must raise ValueError or TypeError naming that option (see
fuzz_support). Valid ones store dtype options as plain names.
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
from hypothesis import strategies as st

from fuzz_support import (ALL_DTYPES, DTYPES, EXAMPLES, LAYOUTS, ROPES, SCALES, Broken,
                          assert_rejected, fuzz)
from fuzz_support import nothing_launches  # noqa: F401  (autouse: nothing may launch)
from lowlevel_fd import AppendPlan, DecodePlan, DecodeStep, KVCacheSpec, PromptQuantizer
from lowlevel_fd.core.support import CACHE_DTYPES, GROUP_SIZES, HEAD_DIMS, MAX_GROUP
from lowlevel_fd.driver import dtypes
from stand_ins import DEVICE


# -- wrong options ------------------------------------------------------------------------------
def is_one_of(value: Any, valid: tuple[Any, ...]) -> bool:
    """Whether a choice option accepts ``value``: equal and of the same type (128.0 is not 128)."""
    return any(type(value) is type(option) and value == option for option in valid)


def dtype_name(value: Any) -> str | None:
    """The dtype name a dtype option reads ``value`` as (names and numpy dtypes), or None."""
    if not isinstance(value, (str, np.dtype)):
        return None
    try:
        return dtypes.as_dtype(value).name
    except (TypeError, ValueError, SyntaxError):
        return None


def dtype_forms(names: tuple[str, ...]) -> st.SearchStrategy:
    """A dtype option as its name or as the numpy dtype."""
    return st.sampled_from(names) | st.sampled_from(names).map(dtypes.as_dtype)


def wrong_choice(valid: tuple[Any, ...]) -> st.SearchStrategy:
    """Anything but one of ``valid``: typos, other types, None, equal values of other types."""
    typos = ["float32", "float64", "bf16", "fp16", "half", "Float16", "int8", "BNSH", "nhsd",
             "channel", "tensor ", "token", "head", "neox", "GPTJ", "llama", "", "float16",
             "bfloat16", "bsnh", "bnsh", "gptj"]
    lookalikes = [float(v) for v in valid if type(v) is int] + [True, False]
    return st.one_of(st.sampled_from(typos), st.text(max_size=8), st.integers(-9, 300),
                     st.none(), st.floats(allow_nan=True), st.just(["float16"]),
                     st.just(np.float16), st.sampled_from(lookalikes)
                     ).filter(lambda value: not is_one_of(value, valid))


def wrong_dtype(valid: tuple[str, ...]) -> st.SearchStrategy:
    """Anything a dtype option does not read as one of ``valid``, numpy dtypes included."""
    others = st.sampled_from([d for d in ALL_DTYPES if d not in valid]).map(dtypes.as_dtype)
    return wrong_choice(valid).filter(lambda value: dtype_name(value) not in valid) | others


NOT_INTS = [None, "8", 2.5, 8.0, [8], float("nan"), True, False]


def wrong_int(low: int, high: int) -> st.SearchStrategy:
    """Integers in [low, high], and what is not an int: None, bools, strings, floats, lists."""
    return st.integers(low, high) | st.sampled_from(NOT_INTS)


@st.composite
def heads(draw: st.DrawFn, max_group: int = MAX_GROUP
          ) -> tuple[str, dict[str, Any], tuple[str, ...]]:
    """num_q_heads/num_kv_heads that are not a multiple, a group past ``max_group`` (any group
    from 1 to it is supported), or not ints of at least 1. The kind decides who the message
    must be about: the multiple names num_q_heads, the group opens with "group size"."""
    kind = draw(st.sampled_from(["multiple", "group", "value"]))
    if kind == "multiple":  # a remainder of 1..kv_heads-1 heads, past any group
        kv_heads = draw(st.integers(2, 40))
        q_heads = (kv_heads * draw(st.integers(0, 2 * max_group))
                   + draw(st.integers(1, kv_heads - 1)))
        return kind, {"num_q_heads": q_heads, "num_kv_heads": kv_heads}, ("num_q_heads",)
    if kind == "group":  # a whole multiple, one group too many heads or far more
        kv_heads = draw(st.integers(1, 40))
        group = draw(st.just(max_group + 1) | st.integers(max_group + 1, 40 * max_group))
        return kind, {"num_q_heads": kv_heads * group, "num_kv_heads": kv_heads}, (
            "group size",)
    q_heads = draw(wrong_int(-8, 40 * max_group))
    kv_heads = draw(wrong_int(-4, 40))
    valid = (type(q_heads) is int and type(kv_heads) is int and kv_heads >= 1 and q_heads >= 1
             and q_heads % kv_heads == 0 and q_heads // kv_heads <= max_group)
    if valid:  # often drawn: push the group size past the largest supported one
        q_heads = kv_heads * draw(st.integers(max_group + 1, 4 * max_group))
    return kind, {"num_q_heads": q_heads, "num_kv_heads": kv_heads}, (
        "num_q_heads", "num_kv_heads")


# Devices a plan cannot run on: names, ordinals, and objects without a Device's fields.
WRONG_DEVICES = ["cuda:0", "cuda", 0, 1, 1.0, True, b"0", [0], object(),
                 SimpleNamespace(compute_capability=(9, 0)), SimpleNamespace(ordinal=0),
                 SimpleNamespace(ordinal="0", compute_capability=(9, 0))]


NOT_REALS = ["x", "0.1", None, True, [1.0], b"1", 1j]


def theta_wrong() -> st.SearchStrategy:
    """rope_theta values a spec refuses: not a real number, not finite, or not above 1."""
    return st.sampled_from(NOT_REALS) | st.floats(allow_nan=True).filter(
        lambda t: not (math.isfinite(t) and t > 1))


def cache_field(draw: st.DrawFn, valid: dict[str, Any], field: str) -> Any:
    """A wrong value for a field of the cache spec (the keyword forms pass them on)."""
    return draw({
        "head_dim": wrong_choice(HEAD_DIMS),
        "kv_layout": wrong_choice(LAYOUTS),
        "scale_mode": wrong_choice(("tensor", "head", "token")),
        "scale_dtype": wrong_dtype(("float32", "float16") if valid["scale_mode"] == "token"
                                   else ("float32",)),
        "rope": wrong_choice(ROPES),
        "rope_theta": theta_wrong(),
    }[field])


CACHE_FIELDS = ["head_dim", "kv_layout", "scale_mode", "scale_dtype", "rope", "rope_theta"]


def cache_configuration(draw: st.DrawFn) -> dict[str, Any]:
    """Valid cache options, dtype options as names or numpy dtypes."""
    mode, scale_dtype = draw(st.sampled_from(SCALES))
    return {"head_dim": draw(st.sampled_from(HEAD_DIMS)),
            "kv_layout": draw(st.sampled_from(LAYOUTS)), "scale_mode": mode,
            "scale_dtype": draw(dtype_forms((scale_dtype,))), "rope": draw(st.sampled_from(ROPES)),
            "rope_theta": draw(st.floats(1.5, 1e7))}


# -- KVCacheSpec --------------------------------------------------------------------------------
@st.composite
def spec_cases(draw: st.DrawFn) -> Broken:
    valid = {"num_kv_heads": draw(st.integers(1, 2**31 - 1)), **cache_configuration(draw),
             "cache_dtype": draw(dtype_forms(CACHE_DTYPES))}
    spec = KVCacheSpec(**valid)  # the starting point is valid
    assert (type(spec.scale_dtype), type(spec.cache_dtype)) == (str, str), "names key variants"
    assert (type(spec.num_kv_heads), type(spec.head_dim)) == (int, int)
    field = draw(st.sampled_from(["num_kv_heads", "cache_dtype"] + CACHE_FIELDS))
    if field == "num_kv_heads":
        value = draw(wrong_int(-2**40, 0) | st.integers(2**31, 2**62))
    elif field == "cache_dtype":
        value = draw(wrong_dtype(CACHE_DTYPES))
    else:
        value = cache_field(draw, valid, field)
    return Broken(field, "value", valid | {field: value}, (field,))


def test_cache_spec_rejects_bad_fields():
    def check(case: Broken) -> None:
        assert_rejected(lambda: KVCacheSpec(**case.arguments), case.names, case)
    assert fuzz(spec_cases(), check) >= EXAMPLES


# -- DecodePlan ---------------------------------------------------------------------------------
@st.composite
def decode_constructor_cases(draw: st.DrawFn) -> Broken:
    kv_heads, group = draw(st.integers(1, 8)), draw(st.sampled_from(GROUP_SIZES))
    valid = {"num_q_heads": kv_heads * group, "num_kv_heads": kv_heads,
             **cache_configuration(draw),
             "max_batch": draw(st.integers(1, 512)),
             "max_seq_len": draw(st.integers(1, 2**31 - 1)),
             "dtype": draw(dtype_forms(DTYPES)),
             "sm_scale": draw(st.none() | st.floats(1e-3, 10.0)), "device": DEVICE}
    plan = DecodePlan.create(**valid)  # the starting point is valid: any group 1..128
    assert plan.group_size == group
    assert (type(plan.dtype), type(plan.cache.scale_dtype)) == (str, str), "names key variants"
    field = draw(st.sampled_from(["heads", "max_batch", "max_seq_len", "dtype", "sm_scale",
                                  "device"] + CACHE_FIELDS))
    if field == "heads":
        kind, changes, names = draw(heads())
        return Broken(field, kind, valid | changes, names)
    if field in CACHE_FIELDS:
        return Broken(field, "value", valid | {field: cache_field(draw, valid, field)}, (field,))
    wrong = {
        "max_batch": wrong_int(-2**40, 0) | st.integers(2**31, 2**62),
        "max_seq_len": wrong_int(-2**40, 0) | st.integers(2**31, 2**62),
        "dtype": wrong_dtype(DTYPES),
        # None is valid (the 1/sqrt(head_dim) default), so it is not among the wrong values.
        "sm_scale": st.sampled_from([x for x in NOT_REALS if x is not None] + [0, 0.0, -0.0])
        | st.floats(allow_nan=True).filter(lambda s: not math.isfinite(s)),
        "device": st.sampled_from(WRONG_DEVICES),
    }[field]
    return Broken(field, "value", valid | {field: draw(wrong)}, (field,))


def test_decode_plan_constructor_rejects_bad_configurations():
    def check(case: Broken) -> None:
        assert_rejected(lambda: DecodePlan.create(**case.arguments), case.names, case)
    assert fuzz(decode_constructor_cases(), check) >= EXAMPLES


# -- AppendPlan and PromptQuantizer ------------------------------------------------------------
def runner_configuration(draw: st.DrawFn) -> dict[str, Any]:
    return {"num_kv_heads": draw(st.integers(1, 8)), **cache_configuration(draw),
            "max_batch": draw(st.integers(1, 512)), "dtype": draw(dtype_forms(DTYPES)),
            "device": DEVICE}


def runner_field(draw: st.DrawFn, valid: dict[str, Any], field: str) -> Any:
    """A wrong value for a field that KernelRunner or the cache spec validates."""
    if field in CACHE_FIELDS:
        return cache_field(draw, valid, field)
    return draw({
        "max_batch": wrong_int(-2**40, 0) | st.integers(2**31, 2**62),
        "dtype": wrong_dtype(DTYPES),
        "device": st.sampled_from(WRONG_DEVICES),
    }[field])


RUNNER_FIELDS = ["max_batch", "dtype", "device"] + CACHE_FIELDS


def stores_plain_names(runner: Any) -> None:
    assert (type(runner.dtype), type(runner.cache.scale_dtype)) == (str, str), (
        "names key the variants")


@st.composite
def append_constructor_cases(draw: st.DrawFn) -> Broken:
    valid = runner_configuration(draw)
    # Groups follow the support matrix of every plan: any of 1..128.
    group = draw(st.sampled_from(GROUP_SIZES))
    valid["num_q_heads"] = valid["num_kv_heads"] * group
    plan = AppendPlan.create(**valid)
    stores_plain_names(plan)
    assert plan.group_size == group
    field = draw(st.sampled_from(["heads"] + RUNNER_FIELDS))
    if field == "heads":
        kind, changes, names = draw(heads())
        return Broken(field, kind, valid | changes, names)
    return Broken(field, "value", valid | {field: runner_field(draw, valid, field)}, (field,))


@st.composite
def prompt_constructor_cases(draw: st.DrawFn) -> Broken:
    valid = runner_configuration(draw) | {"prompt_layout": draw(st.sampled_from(("bsnh", "bnsh")))}
    stores_plain_names(PromptQuantizer.create(**valid))
    field = draw(st.sampled_from(["num_kv_heads", "prompt_layout", "max_batch"] + RUNNER_FIELDS))
    if field == "num_kv_heads":
        value = draw(wrong_int(-2**40, 0))
    elif field == "prompt_layout":
        value = draw(wrong_choice(("bsnh", "bnsh")))
    elif field == "max_batch":
        value = draw(wrong_int(-2**40, 0) | st.integers(65536, 2**40))
    else:
        value = runner_field(draw, valid, field)
    return Broken(field, "value", valid | {field: value}, (field,))


def test_append_plan_constructor_rejects_bad_configurations():
    def check(case: Broken) -> None:
        assert_rejected(lambda: AppendPlan.create(**case.arguments), case.names, case)
    assert fuzz(append_constructor_cases(), check) >= EXAMPLES


def test_prompt_quantizer_constructor_rejects_bad_configurations():
    def check(case: Broken) -> None:
        assert_rejected(lambda: PromptQuantizer.create(**case.arguments), case.names, case)
    assert fuzz(prompt_constructor_cases(), check) >= EXAMPLES


# -- DecodeStep ---------------------------------------------------------------------------------
@st.composite
def step_constructor_cases(draw: st.DrawFn) -> Broken:
    kv_heads, group = draw(st.integers(1, 8)), draw(st.sampled_from(GROUP_SIZES))
    valid = {"num_layers": draw(st.integers(1, 128)), "num_q_heads": kv_heads * group,
             "num_kv_heads": kv_heads, **cache_configuration(draw),
             "max_batch": draw(st.integers(1, 512)),
             "max_seq_len": draw(st.integers(1, 2**31 - 1)), "dtype": draw(dtype_forms(DTYPES)),
             "fused": draw(st.booleans()), "early_reads": draw(st.booleans()), "device": DEVICE}
    step = DecodeStep.create(**valid)  # the starting point is valid: any group 1..128
    assert (step.append is None) == valid["fused"]
    assert step.attention.group_size == group
    field = draw(st.sampled_from(["num_layers", "heads", "fused", "early_reads"]
                                 + RUNNER_FIELDS))
    if field == "heads":
        kind, changes, names = draw(heads())
        return Broken(field, kind, valid | changes, names)
    if field == "num_layers":
        value = draw(wrong_int(-2**40, 0) | st.integers(2**31, 2**62))
    elif field in ("fused", "early_reads"):
        value = draw(st.sampled_from([0, 1, "yes", None, "True", [True]]))
    else:
        value = runner_field(draw, valid, field)
    return Broken(field, "value", valid | {field: value}, (field,))


def test_decode_step_constructor_rejects_bad_configurations():
    def check(case: Broken) -> None:
        assert_rejected(lambda: DecodeStep.create(**case.arguments), case.names, case)
    assert fuzz(step_constructor_cases(), check) >= EXAMPLES
