"""L2-honest timing of a decode step: L layers with distinct caches, captured once into a CUDA
graph and replayed, one event pair per replay; the eager (Python-launched) step beside it.

Per-layer time = step time / L. Because the L caches together exceed L2 several times over
(``workloads.layer_count``), every replay streams its KV from DRAM, as in a real model where
the other layers' weights and caches evict this layer's cache between decode steps.
"""
from __future__ import annotations

import dataclasses

from lowlevel_fd import DecodePlan, KVCacheSpec, TileConfig
from lowlevel_fd.driver import Device, Stream
from lowlevel_fd.timing import time_graph, time_replays  # noqa: F401 (re-exported)

from .layers import LayerSet
from .workloads import Workload


class WorkloadBench:
    """One workload on the GPU: L layers of inputs, one DecodePlan, and its timings."""

    def __init__(self, workload: Workload, num_layers: int, device: Device, stream: Stream,
                 seed: int = 0) -> None:
        self.workload, self.num_layers, self.stream = workload, num_layers, stream
        self.layers = LayerSet(workload, num_layers, device, stream, seed)
        try:
            cache = KVCacheSpec(workload.num_kv_heads, workload.head_dim,
                                kv_layout=workload.kv_layout, scale_mode=workload.scale_mode,
                                scale_dtype=workload.scale_dtype,
                                page_size=workload.page_size or None)
            self.plan = DecodePlan(cache, workload.num_q_heads, max_batch=workload.batch,
                                   max_seq_len=workload.seq_len, dtype=workload.q_dtype,
                                   device=device)
        except BaseException:
            self.layers.close()
            raise

    def replan(self, config: TileConfig | None = None) -> dict:
        """Plan for the workload's lengths (the planner's choice, or ``config``); returns the
        plan's description."""
        self.plan.plan(self.layers.host_lengths, config=config)
        return self.plan.describe()

    def planned_config(self) -> TileConfig:
        """The current plan as a TileConfig (to name the planner's automatic choice)."""
        described = self.plan.describe()
        return TileConfig(**{f.name: described[f.name] for f in dataclasses.fields(TileConfig)
                             if f.name in described})

    def step(self) -> None:
        """One decode step: every layer's attention, in order, on the stream."""
        for layer in range(self.num_layers):
            self.plan.run(*self.layers.args(layer), **self.layers.pages, stream=self.stream)

    def check(self) -> dict:
        """Poison layer 0's output with NaN, run it once, compare with the oracle."""
        self.layers.layers[0]["out"].fill(float("nan"), stream=self.stream)
        self.plan.run(*self.layers.args(0), **self.layers.pages, stream=self.stream)
        self.stream.synchronize()
        return self.layers.check_output()

    def graph_us(self, *, warmup: int, iters: int) -> list[float]:
        """Per-layer microseconds of each graph replay of the whole step."""
        samples = time_graph(self.step, self.stream, warmup=warmup, iters=iters)
        return [1e3 * ms / self.num_layers for ms in samples]

    def eager_us(self, *, warmup: int, iters: int) -> list[float]:
        """Per-layer microseconds of the step launched from Python (host overhead included
        whenever the host is slower than the GPU)."""
        samples = time_replays(self.step, self.stream, warmup=warmup, iters=iters)
        return [1e3 * ms / self.num_layers for ms in samples]

    def close(self) -> None:
        self.stream.synchronize()
        self.plan.close()
        self.layers.close()
