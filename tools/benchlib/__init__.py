"""Helpers of tools/bench.py and tools/tune.py (and the other tools).

Imported as ``benchlib`` with tools/ on sys.path: a script run as ``python3 tools/X.py`` has
it there, and pytest adds it (``pythonpath`` in pyproject.toml); lowlevel_fd comes from
``PYTHONPATH=.`` or an install.

CPU-only modules (importable without a GPU): ``workloads`` (shapes, bytes, layer counts),
``stats`` (percentiles), ``report`` (table, JSON). GPU modules: ``kernels`` (bandwidth
reference and random fill, from bench.cu next to it: a tools-only kernel, not in the wheel;
it compiles without a GPU), ``layers`` (per-layer caches and the correctness check),
``timing`` (L2-honest graph and eager timing), ``baseline`` (torch SDPA), ``host_overhead``,
``plot``.
"""
