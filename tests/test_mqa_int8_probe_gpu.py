"""The int8 Q K^T multi-query probe kernel (tools/benchlib/mqa_int8.cu, PERF_NOTES v39, v40)
against the float64 oracle with q rounded as the kernel rounds it: groups that fill and do
not fill the 64 rows, one and two KV heads, lengths on both sides of the 64-token tiles, an
empty row, shallow and deep rings, one computing warpgroup and two, both softmaxes, V and K
scales across their range, and rows of 16K tokens. Its timings are tools/probe_mqa_int8.py's."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

LENGTHS = [0, 1, 63, 64, 65, 700, 1024]


@pytest.mark.parametrize("config", [(6, 3, 1, 0, 0), (2, 2, 1, 0, 0), (4, 4, 2, 0, 0),
                                    (6, 4, 2, 0, 0), (2, 5, 2, 0, 0), (6, 3, 1, 0, 1),
                                    (2, 2, 1, 0, 1), (4, 4, 2, 0, 1), (2, 5, 2, 0, 1),
                                    (4, 8, 2, 0, 1)],
                         ids=lambda c: "s{}c{}t{}x{}".format(c[0], c[1], c[2], c[4]))
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


@pytest.mark.parametrize("softmax", [0, 1])
def test_mqa_int8_probe_follows_scales_across_their_range(softmax):
    """The V reference and the row maxima move: V scales from 1e-3 to 1e3 (a running largest
    that grows along the sequence, and one that starts large), a tile of zero V scales, and K
    scales that grow along a row so that its maximum keeps rising."""
    from benchlib.mqa_int8 import MqaBench, MqaVariant, quantize_rows
    from benchlib.timing import WorkloadBench
    from benchlib.workloads import Workload

    from lowlevel_fd.driver import Device, Stream
    from lowlevel_fd.reference import decode_attention_ref
    device, stream = Device(0), Stream()
    lengths = [1024, 700, 1024, 129]
    work = Workload(len(lengths), max(lengths), num_q_heads=64, num_kv_heads=1)
    bench = WorkloadBench(work, 1, device, stream, seed=5)
    try:
        layers = bench.layers
        layers.set_lengths(lengths)
        a = layers.layers[0]
        k_scale, v_scale = a["k_scale"].numpy(), a["v_scale"].numpy()
        ramp = np.geomspace(1e-3, 1e3, work.seq_len, dtype=np.float32)
        v_scale[0, 0] *= ramp  # the running largest grows along the row
        v_scale[1, 0] *= ramp[::-1]  # ... or is there from the first tile
        v_scale[1, 0, 64:128] = 0  # a tile whose P is 0 but whose l counts
        k_scale[2, 0] *= np.linspace(0.2, 4.0, work.seq_len, dtype=np.float32)  # rising maxima
        v_scale[3, 0, :] = 0  # nothing but zero V scales: the output is 0
        if softmax == 1:  # softmax_h16 takes the V scales' magnitudes: negative ones work
            v_scale[2, 0, ::3] *= -1
        a["k_scale"].copy_from_numpy(k_scale, stream)
        a["v_scale"].copy_from_numpy(v_scale, stream)
        stream.synchronize()
        probe = MqaBench(bench, MqaVariant(4, 4, 2, 0, softmax))
        result = probe.check()
        out = a["out"].numpy().astype(np.float64)
        ref8, _ = decode_attention_ref(quantize_rows(layers.host_q0), a["k"].numpy(),
                                       a["v"].numpy(), k_scale, v_scale, layers.host_lengths,
                                       kv_layout="bnsh", scale_mode="token")
    finally:
        bench.close()
    assert result["non_finite"] == 0, result
    for b in range(3):  # each row against its own largest: their scales differ by 1e6
        err = np.abs(out[b] - ref8[b]).max() / np.abs(ref8[b]).max()
        assert err <= result["tolerance"], (b, err)
    assert np.all(out[3] == 0)


@pytest.mark.parametrize("softmax", [0, 1])
def test_mqa_int8_probe_holds_its_error_over_long_rows(softmax):
    """16K tokens: an error that grows with the row's length (an fp32 accumulator carrying a
    large term beside the signal, PERF_NOTES v40's rejected bias) shows here, not at 1K."""
    from benchlib.mqa_int8 import MqaBench, MqaVariant
    from benchlib.timing import WorkloadBench
    from benchlib.workloads import Workload

    from lowlevel_fd.driver import Device, Stream
    device, stream = Device(0), Stream()
    work = Workload(2, 16384, num_q_heads=64, num_kv_heads=1)
    bench = WorkloadBench(work, 1, device, stream, seed=7)
    try:
        bench.layers.set_lengths([16384, 9999])
        result = MqaBench(bench, MqaVariant(4, 4, 2, 0, softmax)).check()
    finally:
        bench.close()
    assert result["non_finite"] == 0, result
    assert result["err_q8"] <= result["tolerance"], result
