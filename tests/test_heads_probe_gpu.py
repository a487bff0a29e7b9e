"""The heads-together probe kernel (tools/benchlib/heads.cu, PERF_NOTES v32) against the
float64 oracle: both paged layouts, every scale mode, one split and several (merged through
global memory by the last split, by the separate merge kernel, or in a cluster), ragged lengths with an empty row and page edges, and a bad page
id (flagged, nothing read). Its timings are tools/probe_heads.py's."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

SCALES = [("token", "float32"), ("token", "float16"), ("head", "float32"),
          ("tensor", "float32")]
# (KV heads per CTA, warps, stages, splits, merge)
CONFIGS = [(4, 8, 4, 1, "last"), (4, 8, 4, 3, "last"), (2, 8, 8, 3, "cluster"),
           (8, 16, 4, 2, "last"), (4, 8, 4, 3, "kernel")]
LENGTHS = [0, 15, 16, 17, 53, 1037]  # an empty row, both sides of a page edge, many pages


def maps_fit(layout: str, scale: tuple[str, str], heads: int) -> bool:
    """Per-token scales whose heads are innermost (nhd) need boxes of >= 16 bytes."""
    if scale[0] != "token" or layout != "nhd":
        return True
    return heads * (2 if scale[1] == "float16" else 4) % 16 == 0


def run_probe(layout: str, scale: tuple[str, str], config: tuple, bad_row: int | None = None):
    from benchlib.timing import WorkloadBench
    from benchlib.workloads import Workload
    from probe_heads import HeadsBench

    from lowlevel_fd.driver import Device, DeviceArray, Stream
    device, stream = Device(0), Stream()
    work = Workload(len(LENGTHS), max(LENGTHS), kv_layout=layout, page_size=16,
                    scale_mode=scale[0], scale_dtype=scale[1])
    bench = WorkloadBench(work, 1, device, stream, seed=7)
    try:
        layers = bench.layers
        layers.set_lengths(LENGTHS)
        if bad_row is not None:  # its first page: an id past the pool
            table = layers.table.copy()
            table[bad_row, 0] = work.num_pages + 3
            layers.pages["block_table"].close()
            layers.pages["block_table"] = DeviceArray.from_numpy(table, device)
        heads, warps, stages, splits, merge = config
        probe = HeadsBench(bench, heads, warps, stages, splits, cluster=merge == "cluster",
                           merge="last" if merge == "cluster" else merge)
        result = probe.check()
        out = layers.layers[0]["out"].numpy().astype(np.float64)
        rows, ref = layers.reference()
        return result, out, rows, ref
    finally:
        bench.close()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "h{}w{}s{}x{}-{}".format(*c))
@pytest.mark.parametrize("scale", SCALES, ids=lambda s: "-".join(s))
@pytest.mark.parametrize("layout", ["hnd", "nhd"])
def test_heads_probe_matches_the_oracle(layout, scale, config):
    if not maps_fit(layout, scale, config[0]):
        pytest.skip("scale boxes under 16 bytes: no tensor map (the probe reports it)")
    result, out, rows, ref = run_probe(layout, scale, config)
    assert result["non_finite"] == 0 and result["flags"] == 0, result
    assert result["ok"], result
    assert np.all(out[0] == 0)  # the empty row: zeros, written


@pytest.mark.parametrize("config", CONFIGS[:3] + CONFIGS[4:],
                         ids=["one-split", "global", "cluster", "merge-kernel"])
def test_heads_probe_flags_a_bad_page_id_and_keeps_the_other_rows(config):
    from lowlevel_fd import ERROR_BAD_PAGE
    result, out, rows, ref = run_probe("hnd", ("token", "float32"), config, bad_row=5)
    assert result["flags"] & ERROR_BAD_PAGE, result
    assert np.isfinite(out).all()
    good = [i for i, row in enumerate(rows) if row != 5]
    err = np.abs(out[[rows[i] for i in good]] - ref[good]).max() / np.abs(ref[good]).max()
    assert err <= result["tolerance"], err
