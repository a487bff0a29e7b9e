"""The main job: decode attention for the reference workload, checked and timed.

B=1, 32 query heads, 8 KV heads, head_dim 128, 1024 tokens, INT8 cache with per-token-per-head
scales. Checks one layer against the float64 oracle (outputs poisoned with NaN first), then
times a CUDA graph of 64 layers with distinct caches (64 x 2.1 MB = 134 MB, 2.7x the H100's
L2, so no layer is served from L2) and reports the median per-layer time with p20/p80.
"""
from __future__ import annotations

import sys

import numpy as np

from .core.spec import KVCacheSpec
from .decode import DecodePlan, DecodeVariant, Workload, choose
from .driver import DeviceArray, Stream
from .reference import decode_attention_ref
from .timing import time_graph

HEADS, KV_HEADS, HEAD_DIM, LENGTH, LAYERS = 32, 8, 128, 1024, 64
CACHE = KVCacheSpec(KV_HEADS, HEAD_DIM, scale_mode="token")
H100_SMS = 132


def planned_variant(sm_count: int = H100_SMS, hopper: bool = True) -> DecodeVariant:
    """The kernel the demo's plan launches on a GPU of ``sm_count`` SMs (an H100 by default):
    the planner's choice for its shape, as DecodePlan.plan makes it."""
    config = choose(Workload(1, KV_HEADS, LENGTH, sm_count, 0, HEADS // KV_HEADS, HEAD_DIM),
                    clusters=hopper)
    return DecodeVariant.planned(CACHE, HEADS // KV_HEADS, "float16", config)


def _layer(rng: np.random.Generator) -> dict[str, DeviceArray]:
    cache = (1, KV_HEADS, LENGTH, HEAD_DIM)
    host = {
        "q": rng.standard_normal((1, HEADS, HEAD_DIM)).astype(np.float16),
        "k": rng.integers(-127, 128, cache, dtype=np.int8),
        "v": rng.integers(-127, 128, cache, dtype=np.int8),
        "k_scale": rng.uniform(0.004, 0.012, cache[:3]).astype(np.float32),
        "v_scale": rng.uniform(0.004, 0.012, cache[:3]).astype(np.float32),
    }
    layer = {name: DeviceArray.from_numpy(value) for name, value in host.items()}
    layer["out"] = DeviceArray.empty((1, HEADS, HEAD_DIM), np.float16)
    layer["host"] = host  # type: ignore[assignment]
    return layer


def main() -> int:
    rng = np.random.default_rng(0)
    stream = Stream()
    seq_lens = DeviceArray.from_numpy(np.array([LENGTH], np.int32))
    layers = [_layer(rng) for _ in range(LAYERS)]
    plan = DecodePlan(CACHE, HEADS, max_batch=1, max_seq_len=LENGTH).plan([LENGTH])

    def run(layer: dict) -> None:
        plan.run(layer["q"], layer["k"], layer["v"], layer["k_scale"], layer["v_scale"],
                 seq_lens, layer["out"], stream=stream)

    first = layers[0]
    first["out"].fill(float("nan"))
    run(first)
    stream.synchronize()
    h = first["host"]
    ref, _ = decode_attention_ref(h["q"], h["k"], h["v"], h["k_scale"], h["v_scale"],
                                  np.array([LENGTH]))
    out = first["out"].numpy().astype(np.float64)
    error = float(np.abs(out - ref).max() / np.abs(ref).max())
    print(f"plan: {plan.describe()}")
    print(f"correctness: max|out-ref|/max|ref| = {error:.2e} "
          f"({'ok' if error <= 2e-3 and not np.isnan(out).any() else 'FAILED'})")

    def step() -> None:
        for layer in layers:
            run(layer)

    times = [ms * 1e3 / LAYERS for ms in time_graph(step, stream, warmup=10, iters=100)]
    p20, median, p80 = np.percentile(times, [20, 50, 80])
    kv_bytes = KV_HEADS * LENGTH * (2 * HEAD_DIM + 2 * 4) + 2 * HEADS * HEAD_DIM * 2
    print(f"time per layer (CUDA graph, {LAYERS} distinct layers): {median:.2f} us "
          f"[p20 {p20:.2f}, p80 {p80:.2f}]  ->  {kv_bytes / median / 1e3:.0f} GB/s "
          f"({kv_bytes / 2**20:.2f} MiB read per layer)")
    plan.close()
    return 0 if error <= 2e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
