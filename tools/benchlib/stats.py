"""Summaries of timing samples: the median with p20/p80 (as triton.testing.do_bench reports),
and the bandwidth a time implies."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]), interpolating linearly between order statistics."""
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        raise ValueError("percentile: expected at least one sample")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: expected q in [0, 100], got {q}")
    return float(np.percentile(data, q))


@dataclass(frozen=True)
class Summary:
    median: float
    p20: float
    p80: float
    mean: float
    min: float
    max: float
    count: int


def summarize(samples: Sequence[float]) -> Summary:
    data = np.asarray(samples, dtype=np.float64)
    return Summary(median=percentile(data, 50), p20=percentile(data, 20),
                   p80=percentile(data, 80), mean=float(data.mean()), min=float(data.min()),
                   max=float(data.max()), count=int(data.size))


def gbps(nbytes: float, microseconds: float) -> float:
    """GB/s (1 GB = 1e9 bytes) for moving ``nbytes`` in ``microseconds``."""
    return nbytes / microseconds / 1e3 if microseconds > 0 else float("nan")


def timing_record(samples_us: Sequence[float], bytes_per_layer: int,
                  bandwidth_gbps: float | None) -> dict:
    """JSON-ready per-layer timing: raw samples, median/p20/p80 in us, GB/s and % of the
    measured read bandwidth (both from the median)."""
    summary = summarize(samples_us)
    rate = gbps(bytes_per_layer, summary.median)
    return {
        "samples_us": [float(s) for s in samples_us],
        **{f"{key}_us": value for key, value in asdict(summary).items() if key != "count"},
        "count": summary.count,
        "gbps": rate,
        "pct_of_bw": 100.0 * rate / bandwidth_gbps if bandwidth_gbps else None,
    }
