"""What users would run otherwise: torch's scaled_dot_product_attention over a 16-bit KV
cache (enable_gqa=True), timed exactly like ours: L distinct layers, one CUDA graph, one event
pair per replay. All sequences are full length S (SDPA has no ragged lengths)."""
from __future__ import annotations

import importlib.util

from .workloads import L2_HONEST_BYTES, MIB, Workload, is_l2_honest, layer_count


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def sdpa_baseline(workload: Workload, *, warmup: int, iters: int,
                  layers_override: int | None = None) -> dict:
    """Per-layer microseconds of SDPA on this workload: raw samples plus layer count, bytes
    and a note when the 200 MiB rule had to give way to the memory cap."""
    import torch
    import torch.nn.functional as F

    dtype = torch.float16 if workload.q_dtype == "float16" else torch.bfloat16
    bytes_per_layer = workload.baseline_bytes_per_layer
    num_layers = layer_count(bytes_per_layer, override=layers_override)
    note = ""
    if not is_l2_honest(num_layers, bytes_per_layer) and layers_override is None:
        note = (f"L reduced to {num_layers} by the 64-layer or 40 GiB cap: "
                f"{num_layers * bytes_per_layer / MIB:.0f} MiB < {L2_HONEST_BYTES // MIB} MiB")
    B, S, D = workload.batch, workload.seq_len, workload.head_dim
    Hq, Hkv = workload.num_q_heads, workload.num_kv_heads
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> "torch.Tensor":
        return torch.randn(shape, dtype=dtype, device=device, generator=generator)

    q: list = []
    k: list = []
    v: list = []
    outputs: list = []
    graph = None

    def step() -> None:
        outputs[:] = [F.scaled_dot_product_attention(q[i], k[i], v[i], enable_gqa=True)
                      for i in range(num_layers)]

    try:
        for _ in range(num_layers):
            q.append(randn(B, Hq, 1, D))
            k.append(randn(B, Hkv, S, D))
            v.append(randn(B, Hkv, S, D))
        # Warm up on a side stream (torch's rule before capture: the first calls may allocate
        # and pick kernels), then capture one step and replay it on the current stream.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for _ in range(warmup):
            graph.replay()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        for start, end in events:
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        samples = [1e3 * start.elapsed_time(end) / num_layers for start, end in events]
    finally:
        torch.cuda.synchronize()
        graph = None  # its private memory pool holds the captured outputs
        for tensors in (q, k, v, outputs):
            tensors.clear()
        torch.cuda.empty_cache()
    return {"samples_us": samples, "layers": num_layers, "bytes_per_layer": bytes_per_layer,
            "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
            "note": note}
