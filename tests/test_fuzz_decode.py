"""Fuzzing of DecodePlan.plan() (host lengths, TileConfig) and DecodePlan.run() (every array
argument): one argument broken, a ValueError/TypeError naming it, nothing compiled or launched
and the parameter block untouched (see fuzz_support)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hypothesis import strategies as st

from fuzz_cases import RunCase, decode_run_cases
from fuzz_support import (DEVICE, EXAMPLES, Broken, StandInKernel, assert_rejected,
                          bad_host_lengths, fuzz)
from fuzz_support import nothing_launches  # noqa: F401  (autouse: nothing may launch)
from lowlevel_fd.core.support import WARP_COUNTS
from lowlevel_fd.decode import DecodePlan, TileConfig
from lowlevel_fd.decode import plan as decode_plan
from lowlevel_fd.decode.planner import check_config

NOT_INTS = [None, "8", 2.5, 8.0, [8], True]
NOT_BOOLS = [0, 1, "yes", None, 1.0]


# -- DecodePlan.plan() -------------------------------------------------------------------------
@st.composite
def tile_configs(draw: st.DrawFn) -> tuple[str, Any]:
    """(broken field, config): a valid TileConfig with one field broken, or not a TileConfig."""
    cluster = draw(st.booleans())
    fields = {"num_warps": draw(st.sampled_from(WARP_COUNTS)),
              "num_splits": draw(st.integers(1, 16 if cluster else 128)),
              "min_split_tokens": 16 * draw(st.integers(1, 64)),
              "fused_merge": draw(st.booleans()), "stages": draw(st.sampled_from((0, 2, 3, 4))),
              "cluster": cluster, "programmatic": draw(st.booleans())}
    check_config(TileConfig(**fields))  # the starting point is valid
    broken = draw(st.sampled_from(list(fields) + ["cluster splits", "not a config"]))
    if broken == "not a config":
        return broken, draw(st.sampled_from([{"num_splits": 2}, (4, 1, 64), "4,1,64,1", 4,
                                             SimpleNamespace(**fields)]))
    if broken == "cluster splits":  # a cluster holds at most 16 CTAs
        return broken, TileConfig(**fields | {"cluster": True,
                                              "num_splits": draw(st.integers(17, 128))})
    wrong = {
        # 16 warps was accepted once: no longer (WARP_COUNTS is what the kernels compile for)
        "num_warps": st.integers(-4, 40).filter(lambda w: w not in WARP_COUNTS) | st.just(16),
        "num_splits": st.integers(-2**31, 0) | st.integers(129, 2**31),
        "min_split_tokens": st.integers(-2**31, 15) | st.integers(16, 2**20).filter(
            lambda t: t % 16),
        "stages": st.integers(-2**31, -1) | st.just(1),  # decode_split double-buffers
    }.get(broken)
    if wrong is None:  # the flags
        value = draw(st.sampled_from(NOT_BOOLS))
    else:
        value = draw(wrong | st.sampled_from(NOT_INTS))
    return broken, TileConfig(**fields | {broken: value})


@st.composite
def plan_cases(draw: st.DrawFn) -> tuple[dict[str, Any], Broken]:
    """(plan options, broken call): bad host lengths, lengths that leave a sequence no room for
    the appended token (``append=True``), or good lengths and a bad config."""
    options = {"max_batch": draw(st.integers(1, 8)), "max_seq_len": draw(st.integers(1, 5000))}
    append = draw(st.booleans())
    if draw(st.booleans()):
        kind, lengths = draw(bad_host_lengths(options["max_batch"], options["max_seq_len"],
                                              exact=False))
        return options, Broken("seq_lens", kind, {"seq_lens": lengths, "append": append},
                               ("seq_lens",))
    # With append, plan() attends seq_lens + 1 tokens: a full sequence is an error.
    longest = options["max_seq_len"] - append
    lengths = draw(st.lists(st.integers(0, longest), min_size=1, max_size=options["max_batch"]))
    if append and draw(st.booleans()):
        lengths[draw(st.integers(0, len(lengths) - 1))] = options["max_seq_len"]
        return options, Broken("seq_lens", "no room", {"seq_lens": lengths, "append": True},
                               ("seq_lens",))
    kind, config = draw(tile_configs())
    return options, Broken("config", kind, {"seq_lens": lengths, "config": config,
                                            "append": append}, ("config",))


def test_decode_plan_plan_rejects_bad_lengths_and_tile_configs(monkeypatch):
    loaded: list[Any] = []

    def stand_in_load(program: Any, device: Any) -> tuple[StandInKernel, ...]:
        loaded.append(program)
        return tuple(StandInKernel() for _ in program.kernel_names)

    monkeypatch.setattr(decode_plan, "load_kernels", stand_in_load)

    def check(example: tuple[dict[str, Any], Broken]) -> None:
        options, case = example
        plan = DecodePlan.create(8, 2, 128, **options, device=DEVICE)
        loaded.clear()
        assert_rejected(lambda: plan.plan(**case.arguments), case.names, case)
        assert not loaded, "bad lengths and configs must be caught before compiling anything"
        assert plan._split is None and plan._binder.batch == 0, \
            "a failed plan() leaves no launch"
    assert fuzz(plan_cases(), check) >= EXAMPLES


# -- DecodePlan.run() --------------------------------------------------------------------------
def test_decode_plan_run_rejects_bad_arguments():
    def check(case: RunCase) -> None:
        plan, broken = case.make(), case.broken
        before = bytes(plan._params)
        assert_rejected(lambda: plan.run(**broken.arguments, stream=0), broken.names, case)
        assert bytes(plan._params) == before, "a failed run() leaves the parameter block alone"
    assert fuzz(decode_run_cases(), check) >= EXAMPLES
