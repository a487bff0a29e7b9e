"""The human-readable table and the JSON file of a benchmark run. CPU-only.

A result is a JSON-ready dict per workload (see ``bench.run_workload``): ``workload`` (from
``Workload.as_dict``), ``layers``, ``l2_honest``, ``graph``/``eager``/``baseline`` timing
records (``stats.timing_record``), ``speedup``, ``check`` and ``error``.
"""
from __future__ import annotations

import json
import math
from typing import Any, Sequence

from .workloads import MIB

COLUMNS = ("B", "S", "Hq/Hkv", "layout", "mode", "q", "KV MiB", "L",
           "graph us [p20-p80]", "GB/s", "%BW", "eager us", "SDPA us", "speedup", "max rel err")


def fmt_us(value: float | None) -> str:
    """Microseconds with precision that fits the magnitude: 3.21, 45.6, 1234."""
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def _check_cell(check: dict | None) -> str:
    if not check:
        return "-"
    err = check["max_rel_err"]
    text = f"{err:.1e}" if math.isfinite(err) else "nan"
    return text if check["ok"] else f"FAIL {text}"


def storage_label(w: dict) -> str:
    """The layout, with the page size of a paged cache (``nhd/16``; ``o`` = pages in order,
    ``s`` = one slot per page for K, V and scales)."""
    page = w.get("page_size") or 0
    if not page:
        return w["kv_layout"]
    return (f"{w['kv_layout']}/{page}" + ("o" if w.get("page_order") == "ordered" else "")
            + ("s" if w.get("page_slot") else ""))


def row_cells(result: dict) -> list[str]:
    w = result["workload"]
    cells = [str(w["batch"]), str(w["seq_len"]), f"{w['num_q_heads']}/{w['num_kv_heads']}",
             storage_label(w), w["mode_label"], w["q_label"], f"{w['kv_bytes'] / MIB:.1f}",
             f"{result.get('layers', '-')}{'' if result.get('l2_honest', True) else '*'}"]
    if result.get("error"):
        return cells + ["ERROR: " + result["error"].splitlines()[-1][:60]] + [""] * 6
    graph, eager, base = result.get("graph"), result.get("eager"), result.get("baseline")
    pct = graph.get("pct_of_bw") if graph else None
    speedup = result.get("speedup")
    cells += [
        f"{fmt_us(graph['median_us'])} [{fmt_us(graph['p20_us'])}-{fmt_us(graph['p80_us'])}]"
        if graph else "-",
        f"{graph['gbps']:.0f}" if graph else "-",
        f"{pct:.1f}" if pct is not None else "-",
        fmt_us(eager["median_us"]) if eager else "-",
        fmt_us(base["median_us"]) if base else "error" if result.get("baseline_error") else "-",
        f"{speedup:.2f}x" if speedup else "-",
        _check_cell(result.get("check")),
    ]
    return cells


def format_table(results: Sequence[dict], columns: Sequence[str] = COLUMNS) -> str:
    """Rows padded to column width; numbers right-aligned, words left-aligned."""
    rows = [list(columns)] + [row_cells(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]

    def line(row: list[str]) -> str:
        return "  ".join(cell.rjust(width) if _numeric(cell) else cell.ljust(width)
                         for cell, width in zip(row, widths)).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(rows[0]), rule] + [line(row) for row in rows[1:]])


def _numeric(cell: str) -> bool:
    return bool(cell) and (cell[0].isdigit() or cell[0] == "-" and len(cell) > 1)


def footnotes(bandwidth_gbps: float | None) -> str:
    notes = ["us = microseconds per layer (median of graph replays / L); GB = 1e9 bytes.",
             "* = L x bytes per layer < 200 MiB: part of the working set may stay in L2.",
             "speedup = SDPA fp16 us / our graph us (each measured in this run)."]
    if bandwidth_gbps:
        notes.insert(1, f"%BW = GB/s / measured read bandwidth {bandwidth_gbps:.0f} GB/s.")
    return "\n".join(notes)


def write_json(path: str, payload: dict[str, Any]) -> None:
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=1, default=_jsonable)
        handle.write("\n")


def _jsonable(value: Any) -> Any:
    """numpy scalars and tuples-in-dataclasses, which json cannot write on its own."""
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "__dataclass_fields__"):
        return {k: getattr(value, k) for k in value.__dataclass_fields__}
    return str(value)
