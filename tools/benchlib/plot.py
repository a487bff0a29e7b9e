"""The PNG of a run: achieved GB/s against KV bytes per layer (log x) for our graph replays
and the SDPA baseline, with the measured read bandwidth as the ceiling."""
from __future__ import annotations

from typing import Sequence

from .workloads import MIB


def write_plot(results: Sequence[dict], bandwidth_gbps: float | None, path: str,
               title: str = "") -> bool:
    """Write the plot to ``path``; False (and nothing written) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display on a GPU server
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in results if r.get("graph")]
    fig, ax = plt.subplots(figsize=(8, 5))
    xs = [r["workload"]["kv_bytes"] / MIB for r in ok]
    ax.scatter(xs, [r["graph"]["gbps"] for r in ok], marker="o", label="lowlevel_fd INT8 "
               "(graph replay)", zorder=3)
    for x, r in zip(xs, ok):
        w = r["workload"]
        ax.annotate(f"{w['batch']},{w['seq_len']}", (x, r["graph"]["gbps"]), fontsize=7,
                    textcoords="offset points", xytext=(4, 4))
    with_base = [r for r in ok if r.get("baseline")]
    if with_base:
        ax.scatter([r["workload"]["kv_bytes"] / MIB for r in with_base],
                   [r["baseline"]["gbps"] for r in with_base], marker="s",
                   label="torch SDPA fp16 (its own bytes)", zorder=2)
    if bandwidth_gbps:
        ax.axhline(bandwidth_gbps, color="gray", linestyle="--",
                   label=f"measured read bandwidth {bandwidth_gbps:.0f} GB/s")
    ax.set_xscale("log")
    ax.set_xlabel("INT8 KV bytes per layer (MiB, log scale)")
    ax.set_ylabel("achieved GB/s (1 GB = 1e9 B)")
    ax.set_ylim(bottom=0)
    ax.set_title(title or "Decode attention: achieved bandwidth per layer")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return True
