"""A decode step as one torch CUDA graph: the model's torch ops and the backend's launches (the
library's append_and_run and advance_lengths for the INT8 cache) captured together, replayed
once per step. The graph reads its input tokens from a static buffer and writes the logits to
a static output; the positions advance on the device inside it, so each replay is the next
step. Also the attention-only graph (the backend's per-layer work without the model's) and
CUDA-event timing of graph replays.
"""
from __future__ import annotations

import statistics

import torch


def _warm_up(run) -> None:
    """One eager call on a side stream, as torch asks before a capture (lazy inits, cuBLAS
    workspaces), joined back into the current stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)


class GraphStep:
    """`model.decode(tokens, attention)` captured for the backend's batch. The backend must be
    prepared (`prepare_decode`). The eager warm-up step writes at the current positions and
    advances them; the positions are restored before capturing, so the first replay redoes
    that step (rewriting the same cache slots)."""

    def __init__(self, model, attention):
        self.model, self.attention = model, attention
        self.tokens = torch.zeros(attention.batch, dtype=torch.int64, device=model.device)
        saved = attention.save()
        _warm_up(lambda: model.decode(self.tokens, attention))
        attention.restore(saved)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = model.decode(self.tokens, attention)
        attention.restore(saved)  # nothing ran during the capture; this is belt and braces

    def step(self, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Replays one step with `tokens` `[B]` (copied into the static input on the device;
        None: the tokens already there). Returns the static logits `[B, vocab]`, valid until
        the next replay."""
        if tokens is not None:
            self.tokens.copy_(tokens, non_blocking=True)
        self.graph.replay()
        return self.logits

    def close(self) -> None:
        self.graph.reset()
        self.logits = None


class AttentionGraph:
    """The backend's share of a decode step alone, captured: `begin_step`, every layer's
    `decode` on the static projection buffer `attention.qkv`, `end_step`; none of the model's
    matmuls, norms or MLPs. For the INT8 backend that is the step's L append_and_run launches
    and one advance_lengths; for SDPA, RoPE, the cache writes, the mask and SDPA."""

    def __init__(self, attention, num_layers: int):
        from .torch_attention import split_qkv

        c = attention.config
        q, k, v = split_qkv(attention.qkv, c.n_heads, c.n_kv_heads, c.head_dim)

        def run():
            attention.begin_step()
            for i in range(num_layers):
                attention.decode(i, q, k, v)
            attention.end_step()

        saved = attention.save()
        _warm_up(run)
        attention.restore(saved)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            run()
        attention.restore(saved)

    def step(self) -> None:
        self.graph.replay()

    def close(self) -> None:
        self.graph.reset()


def time_replays(replay, *, warmup: int, iters: int) -> dict:
    """Milliseconds per call of `replay` (which enqueues on the current stream): `warmup`
    untimed calls, then `iters` calls each between two CUDA events, all recorded before one
    synchronize. Returns the median, p20 and p80 and the samples."""
    for _ in range(warmup):
        replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        start.record()
        replay()
        end.record()
    torch.cuda.synchronize()
    samples = sorted(start.elapsed_time(end) for start, end in events)
    return {"median_ms": statistics.median(samples), "p20_ms": _quantile(samples, 0.2),
            "p80_ms": _quantile(samples, 0.8), "iters": iters}


def _quantile(ordered: list, q: float) -> float:
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
