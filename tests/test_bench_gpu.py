"""Smoke runs of the benchmark tools on a GPU: the whole pipeline (bandwidth reference,
correctness check, graph and eager timing, JSON) on a tiny workload."""
from __future__ import annotations

import json

import pytest

import bench  # tools/ is on sys.path through pytest's pythonpath setting (pyproject.toml)

pytestmark = pytest.mark.gpu


def test_bench_smoke_run_passes_its_own_check(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = bench.main(["--shapes", "1,1024", "--quick", "--layers", "4", "--no-baseline",
                       "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "tok-f32" in captured.out  # the table goes to stdout, progress to stderr
    data = json.loads(out.read_text())
    assert data["bandwidth"]["gbps"] > 100
    (result,) = data["results"]
    assert result["layers"] == 4 and result["check"]["ok"] and not result["error"]
    assert result["graph"]["median_us"] > 0 and result["eager"]["median_us"] > 0


@pytest.mark.parametrize("layout,page", [("hnd", 16), ("nhd", 1)])
def test_bench_page_slot_rows_pass_their_check(tmp_path, capsys, layout, page):
    """Pools as views of one allocation of page slots (benchlib.pages.PageSlot): the random
    scales scattered into the slots reach the kernel as the oracle reads them."""
    out = tmp_path / "bench.json"
    code = bench.main(["--shapes", "2,1000", "--page-size", str(page), "--layout", layout,
                       "--page-slot", "--quick", "--layers", "2", "--no-baseline",
                       "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    (result,) = json.loads(out.read_text())["results"]
    assert result["workload"]["page_slot"] and result["check"]["ok"] and not result["error"]


def test_mapped_pool_holds_its_bytes_at_its_alignment():
    """benchlib.vmm: a pool mapped from physical chunks reads back what was written, starts
    at the asked alignment, and rejects chunks off the driver's granularity."""
    import numpy as np
    from benchlib.vmm import MIB, granularity, mapped_empty

    from lowlevel_fd.driver import Device

    device = Device(0)
    step = granularity(device, recommended=False)
    pool, allocation = mapped_empty(3 * MIB + 5, np.int8, device, align=2 * step, chunk=step)
    try:
        assert pool.ptr % (2 * step) == 0 and pool.shape == (3 * MIB + 5,)
        host = np.random.default_rng(0).integers(-128, 128, pool.shape, dtype=np.int8)
        pool.copy_from_numpy(host)
        np.testing.assert_array_equal(pool.numpy(), host)
    finally:
        allocation.close()
    with pytest.raises(ValueError, match="granularity"):
        mapped_empty(16, np.int8, device, align=step, chunk=step + 4096)


def test_probe_gather_runs_mapped_pools_and_head_clusters(capsys):
    import probe_gather

    code = probe_gather.main(["--shapes", "32,4096", "--pages", "16", "--orders", "random",
                              "--alloc", "vmm:2/2", "--heads-together", "off,c2/1",
                              "--iters", "3"])
    out = capsys.readouterr().out
    assert code == 0
    rows = [line.split() for line in out.splitlines()[1:]]
    assert {row[0] for row in rows} == {"vmm:2/2"} and {row[8] for row in rows} == {"off", "c2/1"}
    assert all(float(row[9]) > 0 for row in rows)
