"""What bench.py and tune.py share around the measurements: iteration counts, progress lines
on stderr, and the metadata that makes a JSON file reproducible."""
from __future__ import annotations

import datetime
import importlib.util
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass

_START = time.perf_counter()


@dataclass(frozen=True)
class Iterations:
    """How long each measurement runs. ``--quick`` is for smoke runs, not for reporting."""

    warmup: int = 10
    iters: int = 100
    bandwidth_iters: int = 30
    bandwidth_configs: int = 5  # how many of kernels.BANDWIDTH_CONFIGS to try


QUICK = Iterations(warmup=2, iters=10, bandwidth_iters=5, bandwidth_configs=2)


def iterations(quick: bool, iters: int | None = None, warmup: int | None = None) -> Iterations:
    base = QUICK if quick else Iterations()
    if iters is not None and iters < 1 or warmup is not None and warmup < 0:
        raise ValueError(f"--iters/--warmup: expected >= 1 / >= 0, got {iters}/{warmup}")
    return Iterations(warmup=base.warmup if warmup is None else warmup,
                      iters=base.iters if iters is None else iters,
                      bandwidth_iters=base.bandwidth_iters,
                      bandwidth_configs=base.bandwidth_configs)


def progress(message: str) -> None:
    """A progress line on stderr (stdout carries only the results)."""
    print(f"[{time.perf_counter() - _START:7.1f}s] {message}", file=sys.stderr, flush=True)


def run_metadata(tool: str, argv: list[str], device=None) -> dict:
    """Who, where and when: the exact command, the date, the device, library versions."""
    from lowlevel_fd import __version__
    from lowlevel_fd.driver import driver_version
    meta = {"tool": tool, "command": shlex.join(["python3", tool, *argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "python": platform.python_version(),
            "lowlevel_fd": __version__, "driver_version": driver_version(), "torch": None}
    if importlib.util.find_spec("torch") is not None:
        import torch
        meta["torch"] = torch.__version__
    if device is not None:
        meta["device"] = asdict(device.info)
    return meta


def device_line(device) -> str:
    info = device.info
    return (f"device: {info.name} ({info.arch}, {info.sm_count} SMs, L2 "
            f"{info.l2_bytes / 2**20:.0f} MiB, {info.total_memory / 2**30:.0f} GiB)")
