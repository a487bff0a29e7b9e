"""tools/bench_multi.py's bookkeeping (CPU only, no torch): the bytes a row touches per layer,
how many distinct layers make a graph replay L2-honest, FLOPs, rates, and the printed tables."""
from __future__ import annotations

import math

HQ, HKV, D = 32, 8, 128
MIB = 1 << 20
L2_HONEST_BYTES = 200 * MIB  # 4x the H100's 50 MB L2
MAX_LAYERS = 64


def cache_bytes(batch: int, tokens: int) -> int:
    """INT8 K and V with their fp32 per-token scales (Hkv heads): what our kernels read."""
    return 2 * batch * HKV * tokens * (D + 4)


def q_out_bytes(rows: int) -> int:
    """fp16 queries read and fp16 outputs written, ``rows`` query tokens of Hq heads."""
    return 2 * rows * HQ * D * 2


def sdpa_bytes(qo: int, kv: int) -> int:
    """SDPA's traffic per layer: fp16 q and out, fp16 K and V repeated to Hq heads (what the
    reference is given: SDPA reads every head's K/V)."""
    return q_out_bytes(qo) + 2 * kv * HQ * D * 2


def layer_count(bytes_per_layer: int) -> int:
    """Distinct layers per graph replay: ceil(200 MiB / bytes), at least 2 (as tools/bench.py:
    a replay never starts on what the previous one left in L2), at most 64."""
    return max(2, min(MAX_LAYERS, math.ceil(L2_HONEST_BYTES / max(bytes_per_layer, 1))))


def causal_flops(qo: int, kv: int) -> float:
    """Prefill (qo == kv): the issue's 2*2*S^2*Hq*D/2; a chunk (the last qo of kv tokens):
    4*D*Hq times the tokens each row sees."""
    if qo == kv:
        return 2 * 2 * kv * kv * HQ * D / 2
    return 4 * D * HQ * (qo * (kv - qo) + qo * (qo + 1) // 2)


def footprint(layers: int, bytes_per_layer: int) -> dict:
    """The JSON fields that say how L2-honest a timing was."""
    return {"layers": layers, "bytes_per_layer": bytes_per_layer,
            "bytes_per_replay": layers * bytes_per_layer,
            "l2_honest": layers * bytes_per_layer >= L2_HONEST_BYTES}


def add_rates(timing: dict, *, nbytes: int | None = None, flops: float | None = None,
              bandwidth_gbps: float | None = None) -> dict:
    """``timing`` (per-layer median_us, or an error) with GB/s and % of the read reference
    over ``nbytes``, and TFLOP/s for ``flops``; returns it."""
    us = timing.get("median_us")
    if not us:
        return timing
    if nbytes is not None:
        timing["gbps"] = nbytes / us / 1e3
        timing["pct_of_bw"] = 100 * timing["gbps"] / bandwidth_gbps if bandwidth_gbps else None
    if flops is not None:
        timing["tflops"] = flops / us / 1e6
    return timing


def _us(t: dict | None) -> str:
    if not t or "median_us" not in t:
        return "error" if t else "-"
    return f"{t['median_us']:.1f} [{t['p20_us']:.1f}, {t['p80_us']:.1f}]"


def _table(title: str, header: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return [title, line(header), line(["-" * w for w in widths]), *map(line, body)]


def format_tables(rows: list[dict], bandwidth_gbps: float) -> str:
    """The run as text: the compute rows (prefill, chunks) and the verification rows, each
    under a header naming the same-run read reference."""
    out: list[str] = []
    compute = [r for r in rows if r["kind"] in ("prefill", "chunk")]
    if compute:
        body = []
        for r in compute:
            cells = [f"{r['kind']} {r['qo_len']}/{r['kv_len']}", str(r["layers"]),
                     f"{r['bytes_per_replay'] / MIB:.0f}", _us(r["ours"]),
                     f"{r['ours'].get('tflops', float('nan')):.0f}"]
            for name in ("flash", "cudnn"):
                t = r["sdpa"].get(name, {})
                cells += [_us(t) if "median_us" in t else "error",
                          f"{t['tflops']:.0f}" if "tflops" in t else "-",
                          f"{r[f'ratio_to_{name}']:.2f}" if f"ratio_to_{name}" in r else "-"]
            cells += [f"{r['sdpa_layers']}/{r['sdpa_bytes_per_replay'] / MIB:.0f}",
                      f"{r.get('max_rel_error', float('nan')):.1e}", str(r.get("non_finite"))]
            body.append(cells)
        out += _table(f"prefill and chunks (qo/kv tokens): us per layer, L distinct layers per "
                      f"graph replay; read reference {bandwidth_gbps:.0f} GB/s",
                      ["row", "L", "MiB/rep", "ours us [p20, p80]", "TF/s", "flash us [p20, p80]",
                       "TF/s", "ours/flash", "cuDNN us [p20, p80]", "TF/s", "ours/cuDNN",
                       "SDPA L/MiB", "rel err", "NaN"], body)
    verify = [r for r in rows if r["kind"] == "verify"]
    if verify:
        body = []
        for r in verify:
            o, d = r["ours"], r["decode"]
            w = r.get("ours_waits")
            body.append([f"B={r['batch']} q={r['qo_len']} S={r['kv_len']}", str(r["layers"]),
                         f"{r['kv_bytes_per_layer'] / MIB:.1f}", _us(o), f"{o['gbps']:.0f}",
                         f"{o['pct_of_bw']:.1f}", _us(d), f"{d['gbps']:.0f}",
                         f"{d['pct_of_bw']:.1f}", f"{r['ratio_to_decode']:.2f}",
                         f"{w['median_us']:.1f}" if w else "-",
                         f"{r['ratio_to_decode_waits']:.2f}" if w else "-"])
        out += ([""] if out else []) + _table(
            f"verification: us per layer, L distinct caches per graph replay; GB/s over the "
            f"KV bytes (K, V, scales); %BW of the read reference {bandwidth_gbps:.0f} GB/s; "
            f"ours with early reads, and waiting for the previous kernel (waits)",
            ["row", "L", "KV MiB", "ours us [p20, p80]", "GB/s", "%BW",
             "decode us [p20, p80]", "GB/s", "%BW", "ratio", "waits us", "ratio"], body)
    return "\n".join(out)
