"""tools/bench_multi.py's torch side (needs a GPU): CUDA-graph timing with an event pair per
replay, the INT8 cache and its fp16 twin for SDPA, torch SDPA over L distinct layers in one
graph, and the float64 oracle check of sampled rows."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from .multi import D, HKV, HQ


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
    """An INT8 bnsh cache [B, Hkv, S, D] with per-token fp32 scales [B, Hkv, S] (Hkv and D:
    the prefill benchmark's unless given)."""

    def __init__(self, batch: int, tokens: int, *, seed: int, num_kv_heads: int = HKV,
                 head_dim: int = D) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        shape = (batch, num_kv_heads, tokens, head_dim)
        self.k = torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda", generator=g)
        self.v = torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda", generator=g)
        self.ks = torch.rand(shape[:3], device="cuda", generator=g) * 0.008 + 0.004
        self.vs = torch.rand(shape[:3], device="cuda", generator=g) * 0.008 + 0.004

    def sdpa_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache dequantized to fp16 and repeated to Hq heads: SDPA's K and V."""
        group = HQ // self.k.shape[1]
        k = (self.k.float() * self.ks[..., None]).half().repeat_interleave(group, dim=1)
        v = (self.v.float() * self.vs[..., None]).half().repeat_interleave(group, dim=1)
        return k, v


def sdpa_times(layers: list[tuple], *, lower_right: bool, iters: int, warmup: int) -> dict:
    """SDPA per backend (flash, cuDNN) over ``layers`` (distinct (q, k, v) per layer, all
    [1, Hq, tokens, D] fp16) in one graph, causal aligned to the end of the KV; us per layer.
    Every layer's output stays allocated until the step ends, so the outputs are distinct too."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    qo, kv = layers[0][0].shape[2], layers[0][1].shape[2]
    mask = causal_lower_right(qo, kv) if lower_right else None
    results = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def body(backend=backend):
            outs = []
            with sdpa_kernel(backend):
                for q, k, v in layers:
                    if mask is None:
                        outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True))
                    else:
                        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
            return outs
        try:
            results[name] = time_graph(body, iters=iters, warmup=warmup, per=len(layers))
        except Exception as exc:  # a backend that does not take the shape: say so
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return results


def sampled_error(q, out, cache: Cache, qo: int, kv: int, rows: np.ndarray) -> float:
    """max |out - ref| / max |ref| over sampled rows of sequence 0 (float64 oracle over the
    dequantized cache; row r sees the first kv - qo + r + 1 tokens)."""
    k = (cache.k[0].double() * cache.ks[0, ..., None].double()).cpu().numpy()
    v = (cache.v[0].double() * cache.vs[0, ..., None].double()).cpu().numpy()
    qh, oh = q.double().cpu().numpy(), out.double().cpu().numpy()
    if not np.isfinite(oh[rows]).all():  # max() below would skip a NaN: report it as inf
        return math.inf
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


def non_finite(tensors) -> int:
    """NaN or inf values over ``tensors`` (outputs poisoned with NaN before the runs)."""
    return sum(int((~torch.isfinite(t)).sum()) for t in tensors)
