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
