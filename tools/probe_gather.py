#!/usr/bin/env python3
"""The memory system's price of each KV layout, without any attention math: bench.cu's
gather_tiles streams K, V and per-token scales exactly as the decode kernel issues them (one
KV head per CTA, 8 warps, 16-token tiles through 2-stage cp.async pipelines), over contiguous
caches (bnsh, bsnh) and over pages (hnd, nhd) in random or physical order (or 2 MiB-local:
benchlib.pages.page_ids). The decode kernel
cannot beat its layout's row here; PERF_NOTES v17 compares the two.

    PYTHONPATH=.:tools python3 tools/probe_gather.py --shapes '64,8192;32,4096' --pages 16,1

Hkv=8, D=128, int8 K and V, fp32 token scales ([B, Hkv, S] contiguous, [N, P, Hkv] with nhd
pages, [N, Hkv, P] with hnd). Each shape's pools must hold >= 200 MiB (L2-honest without
layers: every launch reads each byte once from DRAM). One launch per graph replay, CUDA
events, median (p20-p80) of --iters replays after warmup; ratio to bnsh of the same shape.
"""
from __future__ import annotations

import argparse
import ctypes
import itertools
import sys
from types import SimpleNamespace

import numpy as np
from benchlib.kernels import bench_kernel, fill_random
from benchlib.pages import PAGE_ORDERS, page_ids
from benchlib.stats import summarize
from benchlib.vmm import mapped_empty
from benchlib.workloads import Workload, parse_shapes

from lowlevel_fd.core.binding import layout_strides, scale_strides
from lowlevel_fd.core.spec import KVCacheSpec

H, D, MIB = 8, 128, 2**20
MIN_BYTES = 200 * MIB
WARPS, STAGE_BYTES = 8, 2 * 16 * D + 128  # the kernel's per-warp stage: K, V tiles, scales


class GatherParams(ctypes.Structure):  # bench.cu's GatherParams, field for field
    _fields_ = ([(name, ctypes.c_uint64) for name in ("k", "v", "k_scale", "v_scale", "table")]
                + [(name, ctypes.c_int64) for name in (
                    "batch_stride", "head_stride", "token_stride", "scale_batch_stride",
                    "scale_head_stride", "scale_token_stride")]
                + [(name, ctypes.c_int32) for name in (
                    "seq_len", "splits", "page_shift", "pages_per_seq", "sync_every")]
                + [("sink", ctypes.c_uint64)])


def page_bytes(page: int) -> int:
    """A page holding its rows, then its fp32 scales, padded to 128 bytes (--scale-place page)."""
    return -(-(page * H * (D + 4)) // 128) * 128


def slot_bytes(page: int) -> int:
    """One slot per page holding its K rows, its V rows, then K's and V's fp32 scales, padded
    to 128 bytes (--scale-place slot): one address range per page instead of four."""
    return -(-(2 * page * H * (D + 4)) // 128) * 128


def slot_scales(layout: str, page: int) -> tuple[int, tuple[int, int, int]]:
    """(byte offset of V's scales from K's, byte strides (page, head, token)) of a slot's
    scales: hnd [Hkv][K, V][page] and nhd [page][Hkv][K, V], so that a head's K and V scales of
    a page share their sectors."""
    if layout == "hnd":
        return 4 * page, (slot_bytes(page), 8 * page, 4)
    return 4, (slot_bytes(page), 8, 8 * H)


def _contiguous(shape: tuple[int, ...], itemsize: int) -> SimpleNamespace:
    """An array's shape, C-contiguous byte strides and item size, with nothing allocated: what
    the library's stride readers look at."""
    strides = tuple(itemsize * int(np.prod(shape[i + 1:], dtype=np.int64))
                    for i in range(len(shape)))
    return SimpleNamespace(shape=shape, strides=strides, itemsize=itemsize)


def strides(layout: str, seq_len: int, page: int) -> tuple[tuple[int, int, int], tuple]:
    """(batch or page, head, token) byte strides of the rows and of the fp32 scales: the
    benchmark's arrays (benchlib Workload) read by the library's own layout rules."""
    work = Workload(1, seq_len, num_kv_heads=H, head_dim=D, kv_layout=layout, page_size=page)
    spec = KVCacheSpec(H, D, kv_layout=layout, page_size=page or None)
    rows = layout_strides(spec, _contiguous(work.cache_shape, 1))[1:]
    scales = scale_strides(spec, _contiguous(work.scale_shape, 4))
    return rows, tuple(4 * s for s in scales)


def allocate(alloc: str, size: int, dtype, device):
    """A 1-D pool of ``size`` elements allocated as --alloc says, and what frees it."""
    from lowlevel_fd.driver import DeviceArray
    if alloc == "malloc":
        array = DeviceArray.empty(size, dtype, device)
        return array, array.close
    align, _, chunk = alloc.removeprefix("vmm:").partition("/")
    array, allocation = mapped_empty(size, dtype, device, align=int(align) * MIB,
                                     chunk=int(chunk) * MIB)
    return array, allocation.close


def heads_together(mode: str) -> tuple[tuple[int, int, int] | None, int]:
    """--heads-together's off / cN / cN/k -> (the launch's cluster shape, sync_every)."""
    if mode == "off":
        return None, 0
    heads, _, every = mode.removeprefix("c").partition("/")
    return (int(heads), 1, 1), int(every or 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="64,8192;32,4096;128,2048", help="'B,S;B,S;...'")
    parser.add_argument("--pages", default="16,1", help="comma list of page sizes")
    parser.add_argument("--orders", default="random,ordered",
                        help=f"comma list of page orders: {', '.join(PAGE_ORDERS)}")
    parser.add_argument("--scale-place", default="pool",
                        help="comma list: pool (scales in their own [N, P, Hkv] / [N, Hkv, P] "
                             "pools) and/or page (each page's scales right after its rows, in "
                             "the same allocation, pages padded to 128 bytes) and/or slot (K "
                             "and V rows and their scales in one slot per page)")
    parser.add_argument("--splits", type=int, default=8, help="splits per sequence")
    parser.add_argument("--heads-together", default="off",
                        help="comma list: off (one CTA per KV head, no cluster), cN (N KV "
                             "heads of a split launched as one cluster), cN/k (and meeting "
                             "at a cluster barrier every k steps of 128 tokens)")
    parser.add_argument("--alloc", default="malloc",
                        help="comma list of the pools' allocations: malloc (cuMemAlloc) or "
                             "vmm:A/C (cuMemMap: virtual range aligned to A MiB, physical "
                             "chunks of C MiB)")
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args(argv)
    from lowlevel_fd.driver import Device, DeviceArray, LaunchConfig, Stream
    from lowlevel_fd.timing import time_graph

    device, stream = Device(0), Stream()
    kernel = bench_kernel(device, "gather_tiles")
    shared = WARPS * 2 * STAGE_BYTES
    kernel.allow_dynamic_shared(shared)
    sink = DeviceArray.full(1, 0, np.uint64, device)
    rng = np.random.default_rng(0)
    print(f"{'alloc':>9} {'B':>4} {'S':>6} {'layout':>6} {'page':>4} {'order':>8} {'scales':>10} "
          f"{'heads':>4} {'us':>8} {'p20':>8} {'p80':>8} {'ratio':>6}", flush=True)
    for (batch, seq_len), alloc in itertools.product(parse_shapes(args.shapes),
                                                     args.alloc.split(",")):
        tokens = batch * seq_len
        if 2 * tokens * H * D < MIN_BYTES or seq_len % (16 * WARPS * args.splits):
            print(f"skip B={batch} S={seq_len}: under 200 MiB of K and V, or S not a multiple "
                  f"of {16 * WARPS * args.splits}", file=sys.stderr)
            continue
        # room for the caches, or for their padded pages with the scales inside
        size = max([tokens * H * D] + [(tokens // int(page)) * place_bytes(int(page))
                                       for page in args.pages.split(",")
                                       for place_bytes in (page_bytes, slot_bytes)])
        pools = [allocate(alloc, n, dtype, device)
                 for n, dtype in ((size, np.int8),) * 2 + ((tokens * H, np.float32),) * 2]
        k, v, ks, vs = (array for array, _ in pools)
        for seed, array in enumerate((k, v, ks, vs)):
            fill_random(array, seed + 1, stream)
        variants = [("bnsh", 0, "-", "pool"), ("bsnh", 0, "-", "pool")] + [
            (layout, int(page), order, place) for layout in ("hnd", "nhd")
            for page in args.pages.split(",") for order in args.orders.split(",")
            for place in args.scale_place.split(",")]
        together = args.heads_together.split(",")
        base: dict[bool, float] = {}
        for layout, page, order, place in variants:
            rows, scales = strides(layout, seq_len, page)
            k_scale, v_scale = ks.ptr, vs.ptr
            if place == "page":  # the page's scales follow its rows
                rows = (page_bytes(page),) + rows[1:]
                scales = (page_bytes(page),) + scales[1:]
                k_scale, v_scale = k.ptr + page * H * D, v.ptr + page * H * D
            elif place == "slot":  # K rows, V rows, then both scales, in one slot per page
                rows = (slot_bytes(page),) + rows[1:]
                v_offset, scales = slot_scales(layout, page)
                k_scale = k.ptr + 2 * page * H * D
                v_scale = k_scale + v_offset
            table = None
            if page:  # 2 MiB-local orders count the pool's own page stride
                ids = page_ids(order, tokens // page, rows[0], rng, seq_len // page)
                table = DeviceArray.from_numpy(ids.astype(np.int32), device)
            for with_scales, mode in itertools.product(
                    (False, True) if place != "page" else (True,), together):
                cluster, sync_every = heads_together(mode)
                v_rows = k.ptr + page * H * D if place == "slot" else v.ptr
                p = GatherParams(k.ptr, v_rows, k_scale if with_scales else 0,
                                 v_scale if with_scales else 0, table.ptr if table else 0,
                                 *rows, *scales, seq_len, args.splits,
                                 page.bit_length() - 1 if page else 0,
                                 seq_len // page if page else 0,
                                 sync_every, sink.ptr)
                launch = kernel.prepare(LaunchConfig((H, args.splits, batch), 32 * WARPS,
                                                     shared, cluster=cluster), p)
                stats = summarize([1e3 * ms for ms in time_graph(
                    lambda: launch.launch(stream), stream, warmup=5, iters=args.iters)])
                base.setdefault(with_scales, stats.median)
                print(f"{alloc:>9} {batch:>4} {seq_len:>6} {layout:>6} {page or '-':>4} {order:>8} "
                      f"{place + (' fp32' if with_scales else ' none'):>10} {mode:>4} "
                      f"{stats.median:>8.2f} "
                      f"{stats.p20:>8.2f} {stats.p80:>8.2f} "
                      f"{stats.median / base[with_scales]:>6.3f}", flush=True)
            if table is not None:
                table.close()
        for _, close in pools:
            close()
    sink.close()
    stream.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
