"""Fuzzing of the stream argument of every run(): valid arguments, a stream that is not one; the
error names the stream and no kernel launches (see fuzz_support)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st

from fuzz_cases import RunCase, append_run_cases, decode_run_cases, prompt_run_cases
from fuzz_support import (EXAMPLES, REAL_PREPARED_LAUNCH, REAL_RUNNER_LAUNCH, CpuTensor,
                          StandInKernel, assert_rejected, fuzz)
from fuzz_support import nothing_launches  # noqa: F401  (autouse: nothing may launch)
from lowlevel_fd.append import runner as append_runner
from lowlevel_fd.driver import PreparedLaunch

BAD_STREAMS = [None, "0", "stream", 1.5, b"\x00", [0], (0,), {"handle": 0}, object(),
               np.float64(0.0), CpuTensor((1,))]


@st.composite
def bad_stream_cases(draw: st.DrawFn) -> tuple[RunCase, Any]:
    entry = draw(st.sampled_from([decode_run_cases(), append_run_cases(), prompt_run_cases()]))
    return draw(entry), draw(st.sampled_from(BAD_STREAMS))


def test_every_run_rejects_a_bad_stream_before_launching(monkeypatch: pytest.MonkeyPatch):
    # The real launch paths, down to cuLaunchKernel (still refused): the stream is resolved
    # when the launch is issued, after the arguments were bound.
    monkeypatch.setattr(PreparedLaunch, "launch", REAL_PREPARED_LAUNCH)
    monkeypatch.setattr(append_runner.KernelRunner, "_launch", REAL_RUNNER_LAUNCH)

    def check(example: tuple[RunCase, Any]) -> None:
        case, stream = example
        plan = case.make()
        if isinstance(plan, append_runner.KernelRunner):
            plan._kernel = StandInKernel()  # as after load()
        assert_rejected(lambda: plan.run(**case.valid, stream=stream), ("stream",), case)
    assert fuzz(bad_stream_cases(), check) >= EXAMPLES
