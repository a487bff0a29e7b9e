"""The PNG of a run: achieved GB/s against KV bytes per layer (log x) for our graph replays
and the SDPA baseline, with the measured read bandwidth as the ceiling."""
from __future__ import annotations

from typing import Sequence

from .report import storage_label
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
    # One series per storage: contiguous, and each paged layout and page size.
    kinds = list(dict.fromkeys(storage_label(r["workload"]) for r in ok))
    contiguous = [k for k in kinds if "/" not in k]
    for kind in kinds:
        rows = [r for r in ok if storage_label(r["workload"]) == kind]
        xs = [r["workload"]["kv_bytes"] / MIB for r in rows]
        paged = "/" in kind
        name = (f"INT8 paged {kind}" if paged else
                "INT8 contiguous" + (f" {kind}" if len(contiguous) > 1 else ""))
        ax.scatter(xs, [r["graph"]["gbps"] for r in rows], marker="x" if paged else "o",
                   s=18 if paged else 30, label=f"lowlevel_fd {name} (graph replay)", zorder=3)
        if not paged:
            for x, r in zip(xs, rows):
                w = r["workload"]
                ax.annotate(f"{w['batch']},{w['seq_len']}", (x, r["graph"]["gbps"]),
                            fontsize=7, textcoords="offset points", xytext=(4, 4))
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
