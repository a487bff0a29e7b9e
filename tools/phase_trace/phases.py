#!/usr/bin/env python3
"""Where a multi-query MultiPlan launch spends its time, per phase and CTA (PERF_NOTES v28).

Needs a scratch build with trace marks (trace_marks.cuh): copy the header into
lowlevel_fd/cu/, `git apply tools/phase_trace/multi_wg_marks.patch`, run on the device, and revert
(`git checkout lowlevel_fd/cu && rm lowlevel_fd/cu/trace_marks.cuh`):

    PYTHONPATH=.:tools python3 tools/phase_trace/phases.py --batch 32 --heads 64,1

The int8-q kernel (multi_q8.cu) the same way with multi_q8_marks.patch and ``--int8-q``
(decode rows over Hadamard keys; ``--splits`` / ``--combine`` force its plan): its kind-2
record is the second team's (the one that stores the rows), and word 7 is when the two teams'
states are merged.

Times one L2-honest graph of L layers (distinct caches, L x KV bytes >= 200 MiB) by CUDA
events, then zeroes the trace counters, replays once and prints, per layer, microseconds
from the layer's first attention CTA entry (medians over CTAs for per-CTA spans). Record kinds
of the patch: 1 the loading warpgroup (entry, after the wait, primed, first tile handed over,
loop done), 2 the first computing warpgroup (entry, after the wait, Q loaded, first tile
acquired, loop done, rows stored), 3 the split merge kernel (entry, after the wait, done,
lengths read).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def parse(words: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A trace buffer's records (uint64 [n, 8], trace_marks.cuh) -> kind [n], blockIdx [n, 3],
    stamps [n, 7] (int64 ns, 0 where not written)."""
    words = np.asarray(words, dtype=np.uint64).reshape(-1, 8)
    head = words[:, 0]
    kind = (head & np.uint64(0xff)).astype(np.int64)
    block = np.stack([(head >> np.uint64(shift)) & np.uint64(0xffff) for shift in (8, 24, 40)],
                     axis=1).astype(np.int64)
    return kind, block, words[:, 1:].astype(np.int64)


def trace_buffers() -> list[tuple[int, int, int]]:
    """(records, bytes, counter) device addresses of every loaded module with trace marks."""
    from lowlevel_fd.core import loader
    from lowlevel_fd.driver import cu
    buffers = []
    for module, _ in list(loader._loaded.values()):
        try:
            ptr, size = cu.cuModuleGetGlobal(module.handle, b"llfd_trace")
            count, _ = cu.cuModuleGetGlobal(module.handle, b"llfd_trace_n")
        except Exception:  # a module without marks
            continue
        buffers.append((ptr, size, count))
    return buffers


def reset(buffers: list[tuple[int, int, int]]) -> None:
    """Zero the record counters (the next records start at slot 0)."""
    from lowlevel_fd.driver import cu
    for _, _, count in buffers:
        cu.cuMemsetD32(count, 0, 1)


def read_records(buffers: list[tuple[int, int, int]]) -> dict[int, np.ndarray]:
    """The records taken since ``reset``: stamps [n, 7] per kind, over all buffers."""
    from lowlevel_fd.driver import cu
    stamps: dict[int, list[np.ndarray]] = {}
    for ptr, size, count in buffers:
        n = np.zeros(1, np.uint32)
        cu.cuMemcpyDtoH(n.ctypes.data, count, 4)
        words = np.zeros(size // 8, np.uint64)
        cu.cuMemcpyDtoH(words.ctypes.data, ptr, size)
        kind, _, t = parse(words[:8 * min(int(n[0]), size // 64)])
        for k in np.unique(kind):
            stamps.setdefault(int(k), []).append(t[kind == k])
    return {k: np.concatenate(v) for k, v in stamps.items()}


def layer_rows(stamps_by_kind: dict[int, np.ndarray], layers: int) -> list[dict[str, float]]:
    """Per layer, the phases of the patch's records (kinds 1, 2, 3; each kind's records cut
    into ``layers`` equal groups by entry time). Microseconds."""
    def us(ns):
        return float(ns) / 1e3

    sorted_ = {k: v[np.argsort(v[:, 0], kind="stable")] for k, v in stamps_by_kind.items()}
    per = {k: len(v) // layers for k, v in sorted_.items()}
    rows = []
    for i in range(layers):
        c, ld = (sorted_[k][i * per[k]:(i + 1) * per[k]] for k in (2, 1))
        a0 = c[:, 0].min()
        row = {"first_entry": us(a0 - sorted_[2][:, 0].min()),
               "entry_spread": us(c[:, 0].max() - a0),
               "wait": us(np.median(c[:, 1] - c[:, 0])), "q": us(np.median(c[:, 2] - c[:, 1])),
               "tile0": us(np.median(c[:, 3] - c[:, 2])), "loop": us(np.median(c[:, 4] - c[:, 3])),
               "store": us(np.median(c[:, 5] - c[:, 4])), "att_end": us(c[:, 5].max() - a0),
               "ld_wait": us(np.median(ld[:, 1] - ld[:, 0])),
               "ld_prime": us(np.median(ld[:, 2] - ld[:, 1])),
               "ld_tile0": us(np.median(ld[:, 3] - ld[:, 2]))}
        if (c[:, 6] > 0).all():  # the int8-q kernel's teams merged
            row["teams"] = us(np.median(c[:, 6] - c[:, 4]))
        if per.get(3):
            m = sorted_[3][i * per[3]:(i + 1) * per[3]]
            row.update(cb_entry=us(m[:, 0].min() - a0), cb_wait=us(m[:, 1].min() - a0),
                       cb_end=us(m[:, 2].max() - a0))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--heads", default="64,1", help="query,kv heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--early-reads", action="store_true",
                        help="run(early_reads=True): each layer's first tiles stream during the "
                             "previous layer's tail")
    parser.add_argument("--same-cache", action="store_true",
                        help="every layer over the first layer's cache (L2-warm: a control)")
    parser.add_argument("--int8-q", action="store_true",
                        help="decode rows on the int8-q kernel (multi_q8_marks.patch)")
    parser.add_argument("--splits", type=int, help="num_splits for --int8-q (planned if unset)")
    parser.add_argument("--combine", type=int, choices=(0, 1),
                        help="--int8-q: 1 the merge kernel, 0 the last split (planned if unset)")
    args = parser.parse_args(argv)
    import torch
    from benchlib.multi import layer_count
    from benchlib.multi_torch import Cache

    from lowlevel_fd import MultiPlan

    batch, (hq, hkv), d, seq = args.batch, map(int, args.heads.split(",")), args.head_dim, args.seq
    layers = layer_count(batch * hkv * seq * (2 * d + 8))  # int8 K and V, fp32 scales
    caches = [Cache(batch, seq, seed=i, num_kv_heads=hkv, head_dim=d) for i in range(layers)]
    caches = [(c.k, c.v, c.ks, c.vs) for c in caches]
    if args.same_cache:
        caches = [caches[0]] * layers
    lens = torch.full((batch,), seq, dtype=torch.int32, device="cuda")
    q = torch.randn((batch, hq, d), dtype=torch.float16, device="cuda")
    out = torch.empty_like(q)
    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    if args.int8_q:
        combine = None if args.combine is None else bool(args.combine)
        plan = MultiPlan.create(hq, hkv, d, max_batch=batch, max_seq_len=seq,
                                key_transform="hadamard", allow_int8_q=True).plan(
            None, [seq] * batch, causal=False, num_splits=args.splits, combine=combine,
            int8_q=True)
        indptr = None
    else:
        plan = MultiPlan.create(hq, hkv, d, max_batch=batch, max_seq_len=seq).plan(
            list(range(batch + 1)), [seq] * batch, causal=False)
    print(plan.describe()["kernel"], plan.describe()["merge"], plan.describe()["grid"],
          f"L={layers}")
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in caches:  # load and warm outside the capture
            plan.run(q, *c, lens, indptr, out, early_reads=args.early_reads, stream=stream)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for c in caches:
                plan.run(q, *c, lens, indptr, out, early_reads=args.early_reads, stream=stream)
    for _ in range(20):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / layers)
    print(f"us per layer (events, median of 20): {np.median(times):.2f}")
    buffers = trace_buffers()
    if not buffers:
        print("no trace marks in the loaded kernels: apply the patch first", file=sys.stderr)
        return 1
    reset(buffers)
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    records = read_records(buffers)
    rows = layer_rows(records, layers)
    keys = list(rows[0])
    print("layer " + " ".join(f"{k:>12}" for k in keys))
    for i, row in enumerate(rows):
        print(f"{i:>5} " + " ".join(f"{row[k]:>12.2f}" for k in keys))
    print("mean(1..) " + " ".join(f"{np.mean([r[k] for r in rows[1:]]):>12.2f}" for k in keys))
    for kind, t in sorted(records.items()):  # a scratch patch's finer marks: kinds 4 and up
        if kind < 4:
            continue
        steps = [np.median(t[:, i + 1] - t[:, i]) / 1e3 for i in range(6) if (t[:, i + 1] > 0).all()]
        print(f"kind {kind}: median us between its marks (all layers): "
              + " ".join(f"{x:.2f}" for x in steps))
    plan.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
