"""The int8 Q K^T multi-query probe kernel (tools/benchlib/mqa_int8.cu, PERF_NOTES v39)
against the float64 oracle with q rounded as the kernel rounds it: groups that fill and do
not fill the 64 rows, one and two KV heads, lengths on both sides of the 64-token tiles, an
empty row, shallow and deep rings, one computing warpgroup and two. Its timings are tools/probe_mqa_int8.py's."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

LENGTHS = [0, 1, 63, 64, 65, 700, 1024]


@pytest.mark.parametrize("config", [(6, 3, 1), (2, 2, 1), (4, 4, 2), (6, 4, 2), (2, 5, 2)],
                         ids=lambda c: "s{}c{}t{}".format(*c))
@pytest.mark.parametrize("heads", [(64, 1), (32, 1), (17, 1), (96, 2)],
                         ids=lambda h: "{}-{}".format(*h))
def test_mqa_int8_probe_matches_the_rounded_q_oracle(heads, config):
    from benchlib.mqa_int8 import MqaBench, MqaVariant
    from benchlib.timing import WorkloadBench
    from benchlib.workloads import Workload

    from lowlevel_fd.driver import Device, Stream
    device, stream = Device(0), Stream()
    work = Workload(len(LENGTHS), max(LENGTHS), num_q_heads=heads[0], num_kv_heads=heads[1])
    bench = WorkloadBench(work, 1, device, stream, seed=11)
    try:
        layers = bench.layers
        layers.set_lengths(LENGTHS)
        probe = MqaBench(bench, MqaVariant(*config))
        result = probe.check()
        out = layers.layers[0]["out"].numpy()
    finally:
        bench.close()
    assert result["non_finite"] == 0, result
    assert result["err_q8"] <= result["tolerance"], result
    assert result["err_exact"] <= 3e-2, result  # what rounding q to int8 costs, bounded
    assert np.all(out[0] == 0)  # the empty row: zeros, written
