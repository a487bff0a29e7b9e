"""Helpers of tools/bench.py and tools/tune.py.

CPU-only modules (importable without a GPU): ``workloads`` (shapes, bytes, layer counts),
``stats`` (percentiles), ``report`` (table, JSON). GPU modules: ``kernels`` (bandwidth
reference, random fill), ``layers`` (per-layer caches and the correctness check), ``timing``
(L2-honest graph and eager timing), ``baseline`` (torch SDPA), ``host_overhead``, ``plot``.
"""
