"""Decode throughput of the GPU runner: the whole step (the model's torch ops and the backend's
attention) captured as one CUDA graph, replayed and timed with CUDA events, for a batch B of
sequences of about C cached tokens each.

The caches are filled with random valid content (int8 values and scales, or fp16 values; an
INT8 cache in its storage, by default pages in a random order behind a block table) and
the lengths set directly: the step's cost does not depend on what the cache holds. The lengths
start at C - (warmup + iters) / 2, and each replay appends one token, so the timed steps
attend about C tokens. The attention share is the replay time of a second graph that holds
only the backend's work of a step (AttentionGraph: for the INT8 cache the L append_and_run
launches and the advance_lengths; for fp16 SDPA, RoPE, the cache writes, the mask and SDPA),
over the same lengths, divided by the whole step's time; the two are timed separately, so the
share ignores any overlap between the attention and its neighbours in the full step.
"""
from __future__ import annotations

import time

import torch

from .backends import make_attention
from .graph_step import AttentionGraph, GraphStep, time_replays
from .int8_attention import capacity_for
from .measure import backend_settings


def case(model, name: str, batch: int, context: int, *, warmup: int, iters: int,
         seed: int = 0, int8_options: dict | None = None) -> dict:
    """One (backend, B, C) row: step and attention-only replay times, tokens/s, KV bytes (and
    the INT8 backend's storage). `int8_options`: make_attention's options of the INT8
    backends."""
    started = time.perf_counter()
    steps = warmup + iters
    first = max(1, context - steps // 2)
    capacity = capacity_for(first + steps + 1)
    attention = make_attention(name, model.config, batch=batch, capacity=capacity,
                               dtype=model.dtype, device=model.device, **(int8_options or {}))
    graph = only = None
    try:
        attention.fill_random([first] * batch, seed=seed)
        attention.prepare_decode(first + steps - 1)
        saved = attention.save()
        graph = GraphStep(model, attention)
        generator = torch.Generator(device=model.device).manual_seed(seed)
        graph.tokens.random_(0, model.config.vocab_size, generator=generator)
        step = time_replays(graph.step, warmup=warmup, iters=iters)
        attention.restore(saved)
        only = AttentionGraph(attention, model.config.n_layers)
        attention.qkv.normal_(generator=generator)
        attn = time_replays(only.step, warmup=warmup, iters=iters)
        torch.cuda.synchronize()
        flags = attention.error_flags() if hasattr(attention, "error_flags") else 0
        tokens_per_s = batch / (step["median_ms"] / 1e3)
        return {
            "backend": name, "batch": batch, "context": context,
            "lengths": [first, first + steps], "capacity": capacity,
            "step_ms": step, "attention_ms": attn,
            "tokens_per_s": tokens_per_s,
            "attention_share": attn["median_ms"] / step["median_ms"],
            "kv_bytes_per_token": attention.kv_bytes_per_token(),
            "kv_cache_gib": attention.kv_bytes_per_token() * batch * capacity / 2**30,
            "error_flags": flags, "seconds": time.perf_counter() - started,
            "plan": attention.step.describe() if hasattr(attention, "step") else None,
            **backend_settings(attention)}
    finally:
        for g in (graph, only):
            if g is not None:
                g.close()
        if hasattr(attention, "close"):
            attention.close()
        del attention
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def throughput(model, names, batches, contexts, *, warmup: int, iters: int,
               int8_options: dict | None = None, log=print) -> dict:
    """Every (B, C, backend) case; one failing case is recorded and the rest go on."""
    rows = []
    for batch in batches:
        for context in contexts:
            for name in names:
                log(f"  throughput: {name} B={batch} C={context} ...")
                try:
                    row = case(model, name, batch, context, warmup=warmup, iters=iters,
                               int8_options=int8_options)
                except Exception as exc:
                    import traceback
                    rows.append({"backend": name, "batch": batch, "context": context,
                                 "error": f"{type(exc).__name__}: {exc}",
                                 "traceback": traceback.format_exc()})
                    log(f"  throughput: {name} B={batch} C={context} FAILED: {exc}")
                    continue
                rows.append(row)
                log(f"  throughput: {name} B={batch} C={context}: step "
                    f"{row['step_ms']['median_ms']:.3f} ms, {row['tokens_per_s']:.0f} tok/s, "
                    f"attention {row['attention_share']:.0%} ({row['seconds']:.1f} s)")
    return {"rows": rows, "warmup": warmup, "iters": iters}
