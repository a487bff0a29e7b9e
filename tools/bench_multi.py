"""Multi-token attention benchmark on the H100 (issue #13): prefill, chunked prefill and
speculative verification over the INT8 cache, event-timed, each row next to its same-run
reference: torch SDPA (flash and cuDNN backends) on fp16 K/V for prefill and chunks, our decode
at the same KV for verification.

    PYTHONPATH=.:tools python3 tools/bench_multi.py [--quick] [--json PATH]

Rows (Hq=32, Hkv=8, D=128, fp16 queries, per-token fp32 scales, bnsh cache, causal):
  prefill  B=1, qo_len = kv_len = S in 4096/8192/16384: TFLOP/s (causal FLOPs 2*2*S^2*Hq*D/2)
  chunk    a 2048-token chunk over a 16384/32768-token prefix: us and ratio to SDPA
  verify   B=8/64, S=4096, q_len 4/8: us per layer (L layers of distinct caches >= 200 MiB,
           one CUDA graph) and ratio to decode (the same L layers, one token per sequence)
Accuracy: sampled prefill rows against the float64 oracle over the dequantized cache.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys

import numpy as np
import torch
import torch.nn.functional as F

from lowlevel_fd import DecodePlan, MultiPlan

HQ, HKV, D = 32, 8, 128
MIB = 1 << 20


def summary(samples: list[float]) -> dict:
    data = np.asarray(samples)
    return {"median_us": float(np.median(data)), "p20_us": float(np.percentile(data, 20)),
            "p80_us": float(np.percentile(data, 80)), "count": int(data.size)}


def time_graph(body, *, iters: int, warmup: int, per: int = 1) -> dict:
    """Capture ``body`` in a CUDA graph, replay it with an event pair per replay; the times are
    divided by ``per`` (layers in the graph)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # warm (loads, allocations) before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per)
    return summary(times)


class Cache:
    """An INT8 bnsh cache with per-token fp32 scales, and its fp16 dequantized twin (SDPA's)."""

    def __init__(self, batch: int, tokens: int, *, fp16: bool, seed: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        shape = (batch, HKV, tokens, D)
        self.k = torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda", generator=g)
        self.v = torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda", generator=g)
        self.ks = torch.rand((batch, HKV, tokens), device="cuda", generator=g) * 0.008 + 0.004
        self.vs = torch.rand((batch, HKV, tokens), device="cuda", generator=g) * 0.008 + 0.004
        self.k16 = (self.k.float() * self.ks[..., None]).half() if fp16 else None
        self.v16 = (self.v.float() * self.vs[..., None]).half() if fp16 else None

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() + 2 * self.ks.numel() * 4


def multi_plan(batch: int, capacity: int) -> MultiPlan:
    return MultiPlan.create(HQ, HKV, D, max_batch=batch, max_seq_len=capacity)


def run_multi(plan: MultiPlan, q, cache: Cache, lens, indptr, out):
    plan.run(q, cache.k, cache.v, cache.ks, cache.vs, lens, indptr, out,
             stream=torch.cuda.current_stream())


def sdpa_times(q, k, v, *, lower_right: bool, iters: int, warmup: int) -> dict:
    """SDPA on fp16 K/V per backend (flash, cuDNN), causal aligned to the end of the KV."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    results = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        kk = k.repeat_interleave(HQ // HKV, dim=1)
        vv = v.repeat_interleave(HQ // HKV, dim=1)
        mask = causal_lower_right(q.shape[2], k.shape[2]) if lower_right else None

        def body():
            with sdpa_kernel(backend):
                if mask is None:
                    F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
                else:
                    F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
        try:
            results[name] = time_graph(body, iters=iters, warmup=warmup)
        except Exception as exc:  # a backend that does not take the shape: say so
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return results


def sampled_error(q, out, cache: Cache, qo: int, kv: int, rows: np.ndarray) -> float:
    """max |out - ref| / max |ref| over sampled rows (float64 oracle, dequantized cache)."""
    k = (cache.k[0].double() * cache.ks[0, ..., None].double()).cpu().numpy()
    v = (cache.v[0].double() * cache.vs[0, ..., None].double()).cpu().numpy()
    qh, oh = q.double().cpu().numpy(), out.double().cpu().numpy()
    worst, peak = 0.0, 0.0
    for r in rows:
        visible = kv - qo + int(r) + 1
        for h in range(HQ):
            kh, vh = k[h // (HQ // HKV), :visible], v[h // (HQ // HKV), :visible]
            s = kh @ qh[r, h] / math.sqrt(D)
            w = np.exp(s - s.max())
            ref = (w @ vh) / w.sum()
            worst = max(worst, float(np.abs(oh[r, h] - ref).max()))
            peak = max(peak, float(np.abs(ref).max()))
    return worst / peak


def sdpa_row(args, kind: str, qo: int, kv: int, seed: int) -> dict:
    """One sequence attending its last ``qo`` of ``kv`` tokens (prefill: qo == kv), next to
    SDPA on the same fp16 K/V. Prefill counts the issue's causal FLOPs (2*2*S^2*Hq*D/2) and
    samples rows against the oracle; a chunk counts the tokens each row sees."""
    cache = Cache(1, kv, fp16=True, seed=seed)
    q = torch.randn((qo, HQ, D), dtype=torch.float16, device="cuda")
    out = torch.full_like(q, float("nan"))  # rows the kernel misses stay NaN
    lens = torch.tensor([kv], dtype=torch.int32, device="cuda")
    indptr = torch.tensor([0, qo], dtype=torch.int32, device="cuda")
    plan = multi_plan(1, kv).plan([0, qo], [kv])
    ours = time_graph(lambda: run_multi(plan, q, cache, lens, indptr, out),
                      iters=args.iters, warmup=args.warmup)
    prefill = qo == kv
    flops = (2 * 2 * kv * kv * HQ * D / 2 if prefill
             else 4 * D * HQ * sum(kv - qo + i + 1 for i in range(qo)))
    qt = q.transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, qo, D]
    ref = sdpa_times(qt, cache.k16, cache.v16, lower_right=not prefill, iters=args.iters,
                     warmup=args.warmup)
    row = {"kind": kind, "batch": 1, "qo_len": qo, "kv_len": kv, "ours": ours,
           "tflops": flops / ours["median_us"] / 1e6, "sdpa": ref}
    if prefill:
        row["max_rel_error"] = sampled_error(q, out, cache, qo, kv,
                                             np.linspace(0, qo - 1, 12).astype(int))
    row["plan"] = plan.describe()
    for name, t in ref.items():
        if "median_us" in t:
            row[f"sdpa_{name}_tflops"] = flops / t["median_us"] / 1e6
            row[f"ratio_to_{name}"] = ours["median_us"] / t["median_us"]
    plan.close()
    return row


def prefill_rows(args, rows: list) -> None:
    for S in args.prefill:
        rows.append(sdpa_row(args, "prefill", S, S, seed=S))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "plan"}), flush=True)


def chunk_rows(args, rows: list) -> None:
    chunk = 2048
    for prefix in args.prefix:
        rows.append(sdpa_row(args, "chunk", chunk, prefix + chunk, seed=prefix))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "plan"}), flush=True)


def verify_rows(args, rows: list) -> None:
    S = 4096
    for B in args.verify_batch:
        per_layer = Cache(B, 1, fp16=False, seed=0).nbytes * S
        layers = max(1, min(64, math.ceil(200 * MIB / per_layer)))
        caches = [Cache(B, S, fp16=False, seed=10 + i) for i in range(layers)]
        lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
        decode = DecodePlan.create(HQ, HKV, D, max_batch=B, max_seq_len=S).plan([S] * B)
        q1 = torch.randn((B, HQ, D), dtype=torch.float16, device="cuda")
        o1 = torch.empty_like(q1)

        def decode_step():
            for c in caches:
                decode.run(q1, c.k, c.v, c.ks, c.vs, lens, o1,
                           stream=torch.cuda.current_stream())
        dec = time_graph(decode_step, iters=args.iters, warmup=args.warmup, per=layers)
        for qo in args.verify_q:
            indptr_host = [qo * b for b in range(B + 1)]
            plan = multi_plan(B, S).plan(indptr_host, [S] * B, causal=True)
            q = torch.randn((B * qo, HQ, D), dtype=torch.float16, device="cuda")
            out = torch.empty_like(q)
            indptr = torch.tensor(indptr_host, dtype=torch.int32, device="cuda")

            def step():
                for c in caches:
                    run_multi(plan, q, c, lens, indptr, out)
            ours = time_graph(step, iters=args.iters, warmup=args.warmup, per=layers)
            sweep = []
            for splits, ksplit in itertools.product(args.sweep_splits, (1, 4)):
                alt = multi_plan(B, S).plan(indptr_host, [S] * B, num_splits=splits,
                                            ksplit=ksplit)

                def alt_step(alt=alt):
                    for c in caches:
                        run_multi(alt, q, c, lens, indptr, out)
                t = time_graph(alt_step, iters=args.iters, warmup=args.warmup, per=layers)
                sweep.append({"num_splits": splits, "ksplit": ksplit, **t})
                alt.close()
            row = {"kind": "verify", "batch": B, "qo_len": qo, "kv_len": S, "layers": layers,
                   "bytes_per_layer": per_layer, "ours": ours, "decode": dec,
                   "ratio_to_decode": ours["median_us"] / dec["median_us"],
                   "sweep": sweep, "plan": plan.describe()}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "plan"}), flush=True)
            plan.close()
        decode.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", default="prefill,chunk,verify")
    parser.add_argument("--sweep-splits", default="",
                        help="verify rows: also time these KV splits (comma list) x ksplit 1/4")
    args = parser.parse_args(argv)
    args.iters, args.warmup = (10, 2) if args.quick else (50, 5)
    args.sweep_splits = [int(x) for x in args.sweep_splits.split(",") if x]
    args.prefill = [4096, 8192, 16384]
    args.prefix = [16384, 32768]
    args.verify_batch, args.verify_q = [8, 64], [4, 8]
    torch.manual_seed(0)
    rows: list = []
    only = args.only.split(",")
    if "prefill" in only:
        prefill_rows(args, rows)
    if "chunk" in only:
        chunk_rows(args, rows)
    if "verify" in only:
        verify_rows(args, rows)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
