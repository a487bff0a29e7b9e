"""Multi-token attention benchmark on the H100 (issue #13): prefill, chunked prefill and
speculative verification over the INT8 cache, event-timed, each row next to its same-run
reference: torch SDPA (flash and cuDNN backends) on fp16 K/V for prefill and chunks, our decode
at the same KV for verification; the device's read bandwidth (tools/benchlib/kernels.py,
a streaming kernel over 2 GiB) is measured once first, in the same run.

    PYTHONPATH=.:tools python3 tools/bench_multi.py [--quick] [--json PATH] [--dry-run]

Rows (Hq=32, Hkv=8, D=128, fp16 queries, per-token fp32 scales, bnsh cache, causal). Every
time is per layer: one CUDA graph runs L layers with distinct buffers, L = min(64, ceil(200
MiB / bytes per layer)), counted separately for ours and for SDPA (benchlib/multi.py):
  prefill  B=1, qo_len = kv_len = S in 4096/8192/16384: TFLOP/s (causal FLOPs 2*2*S^2*Hq*D/2);
           ours reads q, the int8 K/V and scales and writes out; SDPA reads fp16 q and K/V
           (repeated to 32 heads) and writes out
  chunk    a 2048-token chunk over a 16384/32768-token prefix: us, TFLOP/s, ratio to SDPA
  verify   B=8/64, S=4096, q_len 4/8: us per layer (L caches >= 200 MiB), GB/s of the KV and
           % of the read reference, next to our decode (the same L caches, one token per
           sequence); ours with early_reads (MultiPlan.run) and waiting for the previous
           kernel before any read
Accuracy: outputs NaN-poisoned before the runs; sampled rows of layer 0 against the float64
oracle over the dequantized cache (prefill and chunks), non-finite values over all layers.
"""
from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys

import numpy as np

from benchlib.multi import (D, HKV, HQ, MIB, add_rates, cache_bytes, causal_flops, footprint,
                            format_tables, layer_count, q_out_bytes, sdpa_bytes)
from lowlevel_fd import DecodePlan, MultiPlan
from lowlevel_fd.multi.variants import ksplits

CHUNK = 2048
VERIFY_S = 4096


def multi_plan(batch: int, capacity: int) -> MultiPlan:
    return MultiPlan.create(HQ, HKV, D, max_batch=batch, max_seq_len=capacity)


def run_multi(plan: MultiPlan, q, cache, lens, indptr, out, early_reads: bool = False) -> None:
    import torch
    plan.run(q, cache.k, cache.v, cache.ks, cache.vs, lens, indptr, out,
             early_reads=early_reads, stream=torch.cuda.current_stream())


def sdpa_row(args, kind: str, qo: int, kv: int, seed: int) -> dict:
    """One sequence attending its last ``qo`` of ``kv`` tokens (prefill: qo == kv), L layers
    of distinct caches, q and out per graph replay; then SDPA over its own L layers of fp16
    K/V (the same caches dequantized, as far as they go). Sampled rows of layer 0 are checked
    against the oracle; every layer's output is checked for NaN (poisoned before the runs)."""
    import torch
    from benchlib.multi_torch import Cache, non_finite, sampled_error, sdpa_times, time_graph
    ours_bytes = cache_bytes(1, kv) + q_out_bytes(qo)
    ref_bytes = sdpa_bytes(qo, kv)
    layers, ref_layers = layer_count(ours_bytes), layer_count(ref_bytes)
    caches = [Cache(1, kv, seed=seed + i) for i in range(max(layers, ref_layers))]
    qs = [torch.randn((qo, HQ, D), dtype=torch.float16, device="cuda") for _ in range(layers)]
    outs = [torch.full_like(q, float("nan")) for q in qs]  # rows the kernel misses stay NaN
    lens = torch.tensor([kv], dtype=torch.int32, device="cuda")
    indptr = torch.tensor([0, qo], dtype=torch.int32, device="cuda")
    plan = multi_plan(1, kv).plan([0, qo], [kv], wgmma=args.wgmma)

    def step():
        for q, cache, out in zip(qs, caches, outs):
            run_multi(plan, q, cache, lens, indptr, out)
    ours = time_graph(step, iters=args.iters, warmup=args.warmup, per=layers)
    flops = causal_flops(qo, kv)
    add_rates(ours, nbytes=ours_bytes, flops=flops, bandwidth_gbps=args.bandwidth_gbps)
    row = {"kind": kind, "batch": 1, "qo_len": qo, "kv_len": kv, **footprint(layers, ours_bytes),
           "flops": flops, "ours": ours, "tflops": ours["tflops"],
           "max_rel_error": sampled_error(qs[0], outs[0], caches[0], qo, kv,
                                          np.linspace(0, qo - 1, 12).astype(int)),
           "non_finite": non_finite(outs), "plan": plan.describe()}
    plan.close()
    # SDPA's inputs: q as [1, Hq, qo, D] copies (distinct per layer), K/V dequantized.
    ref_in = [(qs[i % layers].transpose(0, 1).unsqueeze(0).contiguous(), *caches[i].sdpa_kv())
              for i in range(ref_layers)]
    for buffers in (qs, outs, caches):
        buffers.clear()
    torch.cuda.empty_cache()
    ref = sdpa_times(ref_in, lower_right=qo != kv, iters=args.iters, warmup=args.warmup)
    ref_in.clear()
    torch.cuda.empty_cache()
    row.update({f"sdpa_{key}": value for key, value in footprint(ref_layers, ref_bytes).items()})
    row["sdpa"] = ref
    for name, t in ref.items():
        if "median_us" in t:
            add_rates(t, nbytes=ref_bytes, flops=flops, bandwidth_gbps=args.bandwidth_gbps)
            row[f"sdpa_{name}_tflops"] = t["tflops"]
            row[f"ratio_to_{name}"] = ours["median_us"] / t["median_us"]
    return row


def show(row: dict) -> None:
    print(json.dumps({k: v for k, v in row.items() if k != "plan"}), flush=True)


def prefill_rows(args, rows: list) -> None:
    for S in args.prefill:
        rows.append(sdpa_row(args, "prefill", S, S, seed=S))
        show(rows[-1])


def chunk_rows(args, rows: list) -> None:
    for prefix in args.prefix:
        rows.append(sdpa_row(args, "chunk", CHUNK, prefix + CHUNK, seed=prefix))
        show(rows[-1])


def verify_rows(args, rows: list) -> None:
    import torch
    from benchlib.multi_torch import Cache, time_graph
    S, bw = VERIFY_S, args.bandwidth_gbps
    for B in args.verify_batch:
        kv_bytes = cache_bytes(B, S)  # what decode and verification both must read per layer
        layers = layer_count(kv_bytes)
        caches = [Cache(B, S, seed=10 + i) for i in range(layers)]
        lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
        decode = DecodePlan.create(HQ, HKV, D, max_batch=B, max_seq_len=S).plan([S] * B)
        q1 = torch.randn((B, HQ, D), dtype=torch.float16, device="cuda")
        o1 = torch.empty_like(q1)

        def decode_step():
            for c in caches:
                decode.run(q1, c.k, c.v, c.ks, c.vs, lens, o1,
                           stream=torch.cuda.current_stream())
        dec = time_graph(decode_step, iters=args.iters, warmup=args.warmup, per=layers)
        add_rates(dec, nbytes=kv_bytes, bandwidth_gbps=bw)
        for qo in args.verify_q:
            indptr_host = [qo * b for b in range(B + 1)]
            plan = multi_plan(B, S).plan(indptr_host, [S] * B, causal=True, wgmma=args.wgmma)
            q = torch.randn((B * qo, HQ, D), dtype=torch.float16, device="cuda")
            out = torch.empty_like(q)
            indptr = torch.tensor(indptr_host, dtype=torch.int32, device="cuda")

            def step(early_reads: bool):
                for c in caches:
                    run_multi(plan, q, c, lens, indptr, out, early_reads)
            # early_reads: each layer's prefix tiles stream during the previous kernel's tail
            # (what an engine's step allows: the kernel before writes only the chunk's rows);
            # "waits": every read after the previous kernel.
            ours = time_graph(lambda: step(True), iters=args.iters, warmup=args.warmup,
                              per=layers)
            add_rates(ours, nbytes=kv_bytes, bandwidth_gbps=bw)
            waits = time_graph(lambda: step(False), iters=args.iters, warmup=args.warmup,
                               per=layers)
            add_rates(waits, nbytes=kv_bytes, bandwidth_gbps=bw)
            sweep = []
            for splits, ksplit in itertools.product(args.sweep_splits, ksplits(D)):
                alt = multi_plan(B, S).plan(indptr_host, [S] * B, num_splits=splits,
                                            ksplit=ksplit)

                def alt_step(alt=alt):
                    for c in caches:
                        run_multi(alt, q, c, lens, indptr, out)
                t = time_graph(alt_step, iters=args.iters, warmup=args.warmup, per=layers)
                sweep.append({"num_splits": splits, "ksplit": ksplit,
                              **add_rates(t, nbytes=kv_bytes, bandwidth_gbps=bw)})
                alt.close()
            # bytes_per_layer: the KV (K, V, scales), the basis of GB/s; q and out apart.
            row = {"kind": "verify", "batch": B, "qo_len": qo, "kv_len": S,
                   **footprint(layers, kv_bytes), "kv_bytes_per_layer": kv_bytes,
                   "q_out_bytes_per_layer": q_out_bytes(B * qo),
                   "decode_q_out_bytes_per_layer": q_out_bytes(B), "ours": ours, "decode": dec,
                   "ratio_to_decode": ours["median_us"] / dec["median_us"],
                   "ours_waits": waits,
                   "ratio_to_decode_waits": waits["median_us"] / dec["median_us"],
                   "sweep": sweep, "plan": plan.describe()}
            rows.append(row)
            show(row)
            plan.close()
        decode.close()
        caches.clear()
        torch.cuda.empty_cache()


def dry_run(args, only: list[str]) -> str:
    """Each row's layer count and bytes, ours and SDPA's (no GPU, no torch)."""
    lines = [f"{'row':<20} {'ours MiB/layer':>14} {'L':>2} {'MiB/replay':>10}  "
             f"{'SDPA MiB/layer':>14} {'L':>2} {'MiB/replay':>10}"]
    shapes = ([("prefill", S, S) for S in args.prefill] if "prefill" in only else []) + (
        [("chunk", CHUNK, p + CHUNK) for p in args.prefix] if "chunk" in only else [])
    for kind, qo, kv in shapes:
        ours, ref = cache_bytes(1, kv) + q_out_bytes(qo), sdpa_bytes(qo, kv)
        lines.append(f"{f'{kind} {qo}/{kv}':<20} {ours / MIB:>14.1f} {layer_count(ours):>2} "
                     f"{layer_count(ours) * ours / MIB:>10.1f}  {ref / MIB:>14.1f} "
                     f"{layer_count(ref):>2} {layer_count(ref) * ref / MIB:>10.1f}")
    for B in args.verify_batch if "verify" in only else []:
        kv = cache_bytes(B, VERIFY_S)
        lines.append(f"{f'verify B={B} S={VERIFY_S}':<20} {kv / MIB:>14.1f} {layer_count(kv):>2} "
                     f"{layer_count(kv) * kv / MIB:>10.1f}  (KV bytes; decode: the same)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", default="prefill,chunk,verify")
    parser.add_argument("--sweep-splits", default="",
                        help="verify rows: also time these KV splits (comma list) x ksplit 1/4")
    parser.add_argument("--wgmma", choices=("auto", "on", "off"), default="auto",
                        help="the Hopper warpgroup-MMA kernel: the planner's choice, forced, "
                             "or off (mma.sync)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print each row's layers and bytes per replay and exit (no GPU)")
    args = parser.parse_args(argv)
    args.iters, args.warmup = (10, 2) if args.quick else (50, 5)
    args.wgmma = {"auto": None, "on": True, "off": False}[args.wgmma]
    args.sweep_splits = [int(x) for x in args.sweep_splits.split(",") if x]
    args.prefill = [4096, 8192, 16384]
    args.prefix = [16384, 32768]
    args.verify_batch, args.verify_q = [8, 64], [4, 8]
    only = args.only.split(",")
    if args.dry_run:
        print(dry_run(args, only))
        return 0
    import torch
    from benchlib.kernels import BANDWIDTH_CONFIGS, measure_read_bandwidth
    from benchlib.session import iterations
    from lowlevel_fd.driver import Device, Stream
    torch.manual_seed(0)
    device = Device(0)  # the primary context, shared with torch
    stream = Stream(device)
    counts = iterations(args.quick)
    bandwidth = measure_read_bandwidth(device, stream, iters=counts.bandwidth_iters,
                                       configs=BANDWIDTH_CONFIGS[:counts.bandwidth_configs])
    stream.close()
    args.bandwidth_gbps = bandwidth["gbps"]
    best = bandwidth["best"]
    print(f"read bandwidth: {args.bandwidth_gbps:.0f} GB/s (read_bandwidth over "
          f"{bandwidth['bytes'] / 2**30:.2f} GiB, grid {best['grid']} x {best['threads']})",
          flush=True)
    rows: list = []
    if "prefill" in only:
        prefill_rows(args, rows)
    if "chunk" in only:
        chunk_rows(args, rows)
    if "verify" in only:
        verify_rows(args, rows)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "command": shlex.join(["python3", "tools/bench_multi.py", *argv]),
                       "iters": args.iters, "warmup": args.warmup,
                       "read_bandwidth_gbps": args.bandwidth_gbps, "bandwidth": bandwidth,
                       "rows": rows}, handle, indent=1)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, median of "
          f"{args.iters} graph replays after {args.warmup}; read reference "
          f"{args.bandwidth_gbps:.0f} GB/s")
    print(format_tables(rows, args.bandwidth_gbps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
