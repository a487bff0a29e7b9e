"""Fuzzing of the cache writers' run(): AppendPlan.run(), PromptQuantizer.run() and
quantize_prompt(). One argument broken, a ValueError/TypeError naming it, nothing launched and
the parameter block untouched (see fuzz_support)."""
from __future__ import annotations

from fuzz_cases import RunCase, append_run_cases, prompt_run_cases
from fuzz_support import EXAMPLES, assert_rejected, fuzz
from fuzz_support import nothing_launches  # noqa: F401  (autouse: nothing may launch)
from lowlevel_fd import KVCacheSpec
from lowlevel_fd.append import quantize_prompt


def check_runner(case: RunCase) -> None:
    plan, broken = case.make(), case.broken
    before = bytes(plan._params)
    assert_rejected(lambda: plan.run(**broken.arguments, stream=0), broken.names, case)
    assert bytes(plan._params) == before, "a failed run() leaves the parameter block alone"


def test_append_plan_run_rejects_bad_arguments():
    assert fuzz(append_run_cases(), check_runner) >= EXAMPLES


def test_prompt_quantizer_run_rejects_bad_arguments():
    assert fuzz(prompt_run_cases(), check_runner) >= EXAMPLES


def test_quantize_prompt_rejects_bad_arguments():
    def check(case: RunCase) -> None:
        s = case.setup
        cache = KVCacheSpec(s["heads"], s["head_dim"], kv_layout=s["layout"],
                            scale_mode=s["mode"], scale_dtype=s["scale_dtype"], rope=s["rope"])
        assert_rejected(lambda: quantize_prompt(cache, **case.broken.arguments,
                                                prompt_layout=s["prompt_layout"], stream=0),
                        case.broken.names, case)
    assert fuzz(prompt_run_cases(for_function=True), check) >= EXAMPLES
