#!/usr/bin/env python3
"""The best a kernel could do with a layout's bytes: bench.cu's gather_bulk reads all KV heads
of each 16-token tile per CTA, every contiguous run of the tile's rows (a head's tokens, a whole
page, a page's tokens of all heads) and of its scales as one cp.async.bulk copy, ``--stages``
tiles in flight per CTA, no math. Over contiguous caches (bnsh, bsnh) and pages (hnd, nhd) in
random or physical order (benchlib.pages.page_ids). Where a paged row costs more than the
contiguous one here, no attention kernel reading those pages avoids the difference (PERF_NOTES
v31 compares it with the decode kernel's own copies, tools/probe_gather.py).

    PYTHONPATH=.:tools python3 tools/probe_bulk.py --shapes '32,4096;64,8192' --pages 16,1

Hkv=8, D=128, int8 K and V, fp32 token scales in their own pools, as probe_gather.py. Each
shape's pools hold >= 200 MiB (one launch reads every byte once from DRAM). One launch per graph
replay, CUDA events, median (p20-p80) of --iters replays after warmup; GB/s, % of the read
reference measured in the same run, and ratio to bnsh of the same shape, stages and splits.
"""
from __future__ import annotations

import argparse
import ctypes
import itertools
import sys
from typing import Any

import numpy as np
from benchlib.kernels import bench_kernel, fill_random, measure_read_bandwidth
from benchlib.pages import PAGE_ORDERS, page_ids
from benchlib.stats import gbps, summarize
from benchlib.workloads import parse_shapes
from probe_gather import MIN_BYTES, D, H, strides

TILE = 16
ROW_BYTES, SCALE_BYTES = D, 4
STAGE_BYTES = 2 * TILE * H * (ROW_BYTES + SCALE_BYTES)  # K, V rows and scales of one tile
MAX_SHARED = 6 * STAGE_BYTES  # within the H100's 227 KiB per CTA (and 1 KiB to align it)


class BulkSide(ctypes.Structure):  # bench.cu's BulkSide
    _fields_ = [("unit_stride", ctypes.c_int64), ("token_stride", ctypes.c_int64),
                ("seg_stride", ctypes.c_int64), ("seg_bytes", ctypes.c_int32),
                ("segs", ctypes.c_int32)]


class BulkParams(ctypes.Structure):  # bench.cu's BulkParams, field for field
    _fields_ = ([(name, ctypes.c_uint64) for name in ("k", "v", "k_scale", "v_scale", "table")]
                + [("rows", BulkSide), ("scales", BulkSide)]
                + [(name, ctypes.c_int32) for name in (
                    "seq_len", "splits", "page_shift", "pages_per_seq", "tile_units", "stages",
                    "stage_bytes")]
                + [("row_head_step", ctypes.c_int64), ("scale_head_step", ctypes.c_int64),
                   ("warps", ctypes.c_int32), ("lockstep", ctypes.c_int32),
                   ("interleave", ctypes.c_int32), ("tensor_maps", ctypes.c_uint64),
                   ("delay", ctypes.c_int32),
                   ("sink", ctypes.c_uint64)])


def side(byte_strides: tuple[int, int, int], item: int, unit_tokens: int, heads: int,
         merge: bool = True) -> BulkSide | None:
    """A tile's copies of one kind of row: (unit, head, token) byte strides and the bytes per
    (token, head) -> the contiguous runs of ``unit_tokens`` tokens of ``heads`` consecutive
    heads in one unit (adjoining runs merged into one copy unless ``merge`` is off); None
    where a run would be under the 16 bytes a bulk copy takes."""
    unit, head, token = byte_strides
    if token == item:  # a head's tokens adjoin: one run per head, or one for all heads
        if heads == 1 or (merge and head == unit_tokens * item):
            run = BulkSide(unit, token, 0, heads * unit_tokens * item, 1)
        else:
            run = BulkSide(unit, token, head, unit_tokens * item, heads)
    elif head == item and token == H * item:  # a token's heads adjoin, then the next token
        if merge and heads == H:
            run = BulkSide(unit, token, 0, unit_tokens * H * item, 1)
        elif merge or heads == 1:
            run = BulkSide(unit, token, token, heads * item, unit_tokens)
        else:
            raise ValueError("unmerged runs of several heads: hnd or contiguous bnsh only")
    else:
        raise ValueError(f"no contiguous runs in strides {byte_strides}")
    return run if run.seg_bytes % 16 == 0 else None


_tensor_maps: dict[tuple, Any] = {}


def maps(copies: str, layout: str, k, v, seq_len: int, page: int) -> int:
    """Device address of the K and V pools' tensor maps for --copies tensor / tensor128 (dims:
    a row's bytes, tokens of a sequence or page, heads, sequences or pages; box 128 x 16), or
    0 for plain bulk copies. Encoded once per pool and kept for the run."""
    if copies == "bulk":
        return 0
    import struct

    import numpy as np
    from cuda.bindings import driver as d

    from lowlevel_fd.driver import DeviceArray
    from lowlevel_fd.driver._api import cu
    key = (copies, layout, k.ptr, v.ptr, seq_len, page)
    if key not in _tensor_maps:
        rows = strides(layout, seq_len, page)[0]
        tokens = page or seq_len
        units = k.nbytes // rows[0]
        swizzle = (d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B if copies == "tensor128"
                   else d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE)
        blob = b""
        for pool in (k, v):
            tensor_map = cu.cuTensorMapEncodeTiled(
                d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, pool.ptr,
                [d.cuuint64_t(x) for x in (D, tokens, H, units)],
                [d.cuuint64_t(x) for x in (rows[2], rows[1], rows[0])],
                [d.cuuint32_t(x) for x in (D, TILE, 1, 1)], [d.cuuint32_t(1)] * 4,
                d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
            blob += struct.pack("16Q", *[int(word) for word in tensor_map.opaque])
        _tensor_maps[key] = DeviceArray.from_numpy(np.frombuffer(blob, np.uint8), k.device)
    return _tensor_maps[key].ptr


def plan_case(args: argparse.Namespace, layout: str, page: int, seq_len: int, batch: int,
              on: bool, stages: int, ctas: str, heads: int, runs: str, warps: int,
              copies: str) -> tuple | None:
    """(row runs, scale runs, splits, stage bytes) of one case, or None where the kernel cannot
    run it: tensor copies other than one head of bnsh / hnd, runs under 16 bytes, a warp per
    head without one run per head, lockstep with uneven tiles per warp, S not a multiple of
    the splits' tiles, more stages than shared memory or the kernel's 64 barriers hold."""
    if copies != "bulk" and (heads != 1 or layout not in ("bnsh", "hnd")):
        return None
    unit_tokens = min(TILE, page) if page else TILE
    rows, scales = strides(layout, seq_len, page)
    splits = 1 << (max(1, int(ctas) * heads // (H * batch)).bit_length() - 1)
    try:
        row_side = side(rows, ROW_BYTES, unit_tokens, heads, runs == "merged")
        scale_side = side(scales, SCALE_BYTES, unit_tokens, heads, warps == 1)
    except ValueError:
        return None
    if row_side is None or (on and scale_side is None):
        return None
    if warps > 1 and not args.interleave and (
            row_side.segs != warps or (on and scale_side.segs != warps)):
        return None
    stage_bytes = STAGE_BYTES * heads // H // (1 if args.interleave else warps)
    if copies != "bulk":  # whole 1 KiB blocks: the swizzle's period
        stage_bytes = -(-stage_bytes // 1024) * 1024
    if args.interleave and args.lockstep and (seq_len // splits // TILE) % warps:
        return None
    if (seq_len % (TILE * splits) or warps * stages > 64 or stages > 16
            or warps * stages * stage_bytes + 1024 * args.extra_shared > MAX_SHARED):
        return None
    return row_side, scale_side, splits, stage_bytes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="32,4096;64,8192;128,2048", help="'B,S;B,S;...'")
    parser.add_argument("--pages", default="16,1", help="comma list of page sizes (<= 16)")
    parser.add_argument("--orders", default="random,ordered",
                        help=f"comma list of page orders: {', '.join(PAGE_ORDERS)}")
    parser.add_argument("--stages", default="3,6", help="comma list: tiles in flight per CTA "
                                                       "(3: two CTAs per SM, 6: one)")
    parser.add_argument("--ctas", default="128,264",
                        help="comma list of CTAs per launch (B x splits x 8 / heads per "
                             "CTA; splits rounded down to a power of two, at least 1)")
    parser.add_argument("--scales", default="fp32", help="comma list: fp32 and/or none")
    parser.add_argument("--heads", default="8", help="comma list of KV heads per CTA (divisors "
                                                   "of 8)")
    parser.add_argument("--runs", default="merged",
                        help="comma list: merged (adjoining runs of a CTA's heads as one copy) "
                             "and/or split (a copy per head and token run)")
    parser.add_argument("--warps", default="1",
                        help="comma list: 1 (one warp issues every copy) and/or 8 (with "
                             "--heads 8 --runs split: warp w copies head w's runs on its own "
                             "stages, as the decode kernel's warps do)")
    parser.add_argument("--lockstep", action="store_true",
                        help="with 8 warps: a CTA barrier per tile, so the heads of a page are "
                             "fetched together")
    parser.add_argument("--interleave", action="store_true",
                        help="with several warps: warp w copies all of the CTA's heads of tiles "
                             "w, w + warps, ... (the decode kernel's order of tiles), instead of "
                             "one head each")
    parser.add_argument("--copies", default="bulk",
                        help="comma list: bulk (cp.async.bulk), tensor (bulk tensor copies, no "
                             "swizzle), tensor128 (128-byte swizzle); tensor needs --heads 1 and "
                             "bnsh or hnd")
    parser.add_argument("--delay", default="0",
                        help="comma list of cycles each warp spins per tile once it has landed "
                             "(stands in for the math)")
    parser.add_argument("--extra-shared", type=int, default=0,
                        help="KiB of shared memory each CTA asks for beyond its stages (fewer "
                             "CTAs per SM)")
    parser.add_argument("--iters", type=int, default=30)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from lowlevel_fd.driver import Device, DeviceArray, LaunchConfig, Stream
    from lowlevel_fd.timing import time_graph

    device, stream = Device(0), Stream()
    reference = measure_read_bandwidth(device, stream)["gbps"]
    print(f"read reference {reference:.0f} GB/s", flush=True)
    kernel = bench_kernel(device, "gather_bulk")
    stage_counts = [int(s) for s in args.stages.split(",")]
    # the static barriers and 1 KiB of alignment come out of the device's limit
    kernel.allow_dynamic_shared(min(MAX_SHARED + 1024 + 1024 * args.extra_shared,
                                    device.info.max_shared_per_block_optin - 1024))
    sink = DeviceArray.full(1, 0, np.uint64, device)
    rng = np.random.default_rng(0)
    print(f"{'B':>4} {'S':>6} {'layout':>6} {'page':>4} {'order':>8} {'scales':>6} {'stages':>6} "
          f"{'splits':>6} {'heads':>5} {'runs':>6} {'warps':>5} {'copies':>9} {'delay':>6} "
          f"{'us':>8} {'p20':>8} {'p80':>8} {'GB/s':>6} {'%ref':>6} {'ratio':>6}",
          flush=True)
    for batch, seq_len in parse_shapes(args.shapes):
        tokens = batch * seq_len
        if 2 * tokens * H * D < MIN_BYTES:
            print(f"skip B={batch} S={seq_len}: under 200 MiB of K and V", file=sys.stderr)
            continue
        pools = [DeviceArray.empty(n, dtype, device)
                 for n, dtype in ((tokens * H * D, np.int8),) * 2 + ((tokens * H, np.float32),) * 2]
        k, v, ks, vs = pools
        for seed, array in enumerate(pools):
            fill_random(array, seed + 1, stream)
        variants = [("bnsh", 0, "-"), ("bsnh", 0, "-")] + [
            (layout, int(page), order) for layout in ("hnd", "nhd")
            for page in args.pages.split(",") for order in args.orders.split(",")]
        base: dict[tuple, float] = {}
        for layout, page, order in variants:
            unit_tokens = min(TILE, page) if page else TILE
            rows, scales = strides(layout, seq_len, page)
            table = None
            if page:
                ids = page_ids(order, tokens // page, rows[0], rng, seq_len // page)
                table = DeviceArray.from_numpy(ids.astype(np.int32), device)
            for with_scales, stages, ctas, heads, runs, warps, copies, delay in itertools.product(
                    args.scales.split(","), stage_counts, args.ctas.split(","),
                    [int(h) for h in args.heads.split(",")], args.runs.split(","),
                    [int(w) for w in args.warps.split(",")], args.copies.split(","),
                    [int(c) for c in args.delay.split(",")]):
                on = with_scales == "fp32"
                case = plan_case(args, layout, page, seq_len, batch, on, stages, ctas, heads,
                                 runs, warps, copies)
                if case is None:
                    continue
                row_side, scale_side, splits, stage_bytes = case
                p = BulkParams(k.ptr, v.ptr, ks.ptr if on else 0, vs.ptr if on else 0,
                               table.ptr if table else 0, row_side,
                               scale_side or BulkSide(), seq_len, splits,
                               page.bit_length() - 1 if page else 0,
                               seq_len // page if page else 0, TILE // unit_tokens, stages,
                               stage_bytes, heads * rows[1], heads * scales[1], warps,
                               int(args.lockstep), int(args.interleave),
                               maps(copies, layout, k, v, seq_len, page), delay, sink.ptr)
                launch = kernel.prepare(LaunchConfig((splits, batch, H // heads), 32 * warps,
                                                     warps * stages * stage_bytes + 1024
                                                     + 1024 * args.extra_shared), p)
                stats = summarize([1e3 * ms for ms in time_graph(
                    lambda: launch.launch(stream), stream, warmup=5, iters=args.iters)])
                nbytes = 2 * tokens * H * (D + (SCALE_BYTES if on else 0))
                rate = gbps(nbytes, stats.median)
                key = (with_scales, stages, splits, heads, runs, warps, copies, delay)
                base.setdefault(key, stats.median)
                print(f"{batch:>4} {seq_len:>6} {layout:>6} {page or '-':>4} {order:>8} "
                      f"{with_scales:>6} {stages:>6} {splits:>6} {heads:>5} {runs:>6} {warps:>5} "
                      f"{copies:>9} {delay:>6} "
                      f"{stats.median:>8.2f} "
                      f"{stats.p20:>8.2f} {stats.p80:>8.2f} {rate:>6.0f} "
                      f"{100 * rate / reference:>5.1f}% {stats.median / base[key]:>6.3f}",
                      flush=True)
            if table is not None:
                table.close()
        for array in [*pools, *_tensor_maps.values()]:
            array.close()
        _tensor_maps.clear()
    sink.close()
    stream.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
