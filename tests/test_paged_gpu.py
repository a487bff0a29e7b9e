"""Paged storage on the GPU. Every paged call is checked against the same call on a contiguous
cache holding the same tokens (same plan, same tiles: bitwise equal outputs, byte-equal writes)
and against the float64 oracle: every page size and both paged layouts, every scale mode,
random page order, lengths at page edges, ragged batches with empty rows, shared prefix pages,
a pool over 4 GiB, bad page ids, and graph replay after the table is rewritten."""
from __future__ import annotations

import numpy as np
import pytest
from decode_case import Case
from paged_case import Pages, gather, paginate

from lowlevel_fd import (ERROR_BAD_PAGE, ERROR_OUTSIDE_CACHE, AppendPlan, DecodePlan, DecodeStep,
                         LayerBuffers, PromptQuantizer)
from lowlevel_fd.core import support
from lowlevel_fd.driver import DeviceArray, dtypes

pytestmark = pytest.mark.gpu

SCALES = [("token", "float32"), ("token", "float16"), ("head", "float32"),
          ("tensor", "float32")]
CACHE = ("k_cache", "v_cache", "k_scale", "v_scale")


def page_edges(page_size: int) -> list[int]:
    """Ragged lengths: an empty row, both sides of a page edge, several pages, a long one."""
    return [0, max(page_size - 1, 1), page_size, page_size + 1, 3 * page_size + 5, 1037]


def contiguous(case: Case) -> dict[str, np.ndarray]:
    h = case.host
    return {"k_cache": h["k"], "v_cache": h["v"], "k_scale": h["k_scale"],
            "v_scale": h["v_scale"]}


def paged_plan(case: Case, layout: str, page_size: int, **options) -> DecodePlan:
    return DecodePlan.create(case.num_q_heads, case.num_kv_heads, case.head_dim,
                             max_batch=case.batch, max_seq_len=case.capacity, dtype=case.dtype,
                             kv_layout=layout, page_size=page_size, scale_mode=case.scale_mode,
                             scale_dtype=case.scale_dtype, **options)


def run_paged(case: Case, pages: Pages, plan: DecodePlan, stream, device=None):
    d = device or pages.upload()
    qt = dtypes.as_dtype(case.dtype)
    out = DeviceArray.full(case.host["q"].shape, float("nan"), qt)
    lse = DeviceArray.full((case.batch, case.num_q_heads), float("nan"), np.float32)
    plan.plan(case.lengths)
    plan.run(case.device["q"], *(d[name] for name in CACHE), case.device["seq_lens"], out,
             lse=lse, block_table=d["block_table"], stream=stream)
    flags = plan.error_flags(stream=stream)
    return out.numpy(), lse.numpy(), flags


def assert_bitwise(a: np.ndarray, b: np.ndarray, what: str) -> None:
    assert np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                          np.ascontiguousarray(b).view(np.uint8)), what


@pytest.mark.parametrize("mode, scale_dtype", SCALES, ids=[f"{m}-{d}" for m, d in SCALES])
@pytest.mark.parametrize("layout", support.PAGED_LAYOUTS)
@pytest.mark.parametrize("page_size", support.PAGE_SIZES)
def test_decode_over_pages_equals_contiguous_bitwise_and_the_oracle(rng, stream, page_size,
                                                                    layout, mode, scale_dtype):
    case = Case.random(rng, page_edges(page_size), scale_mode=mode, scale_dtype=scale_dtype)
    out, lse = case.run(case.make_plan(), stream)
    case.check(out, lse)
    pages = paginate(rng, contiguous(case), layout, page_size, token_scales=mode == "token")
    p_out, p_lse, flags = run_paged(case, pages, paged_plan(case, layout, page_size), stream)
    assert flags == 0
    assert_bitwise(p_out, out.astype(p_out.dtype), "out")
    assert_bitwise(p_lse, lse.astype(np.float32), "lse")


@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim, dtype, page_size", [
    (9, 3, 64, "bfloat16", 16), (10, 2, 256, "float16", 8), (64, 1, 128, "float16", 32),
    (32, 8, 128, "bfloat16", 1)])
def test_heads_dims_and_dtypes_over_pages(rng, stream, num_q_heads, num_kv_heads, head_dim,
                                          dtype, page_size):
    case = Case.random(rng, [0, 17, 300, 2049], num_q_heads=num_q_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
    out, lse = case.run(case.make_plan(), stream)
    case.check(out, lse)
    pages = paginate(rng, contiguous(case), "hnd", page_size, token_scales=True)
    p_out, p_lse, flags = run_paged(case, pages, paged_plan(case, "hnd", page_size), stream)
    assert flags == 0
    assert_bitwise(p_out, out.astype(p_out.dtype), "out")


def test_shared_prefix_pages(rng, stream):
    case = Case.random(rng, [700, 900, 650], num_q_heads=16, num_kv_heads=4)
    for name in ("k", "v", "k_scale", "v_scale"):  # the prefix: the first sequence's tokens
        case.host[name][1:, :, :512] = case.host[name][0, :, :512]
    out, lse = case.run(case.make_plan(), stream)
    case.check(out, lse)
    pages = paginate(rng, contiguous(case), "nhd", 64, token_scales=True, shared_pages=8)
    assert (pages.table[1:, :8] == pages.table[0, :8]).all()
    p_out, _, flags = run_paged(case, pages, paged_plan(case, "nhd", 64), stream)
    assert flags == 0
    assert_bitwise(p_out, out.astype(p_out.dtype), "out")


def test_a_pool_over_4_gib_with_page_ids_near_its_end(rng, stream):
    case = Case.random(rng, [1000, 333], num_q_heads=16, num_kv_heads=8)
    out, lse = case.run(case.make_plan(), stream)
    page_size, per_seq = 16, -(-1000 // 16)
    small = paginate(rng, contiguous(case), "nhd", page_size, token_scales=True, shuffle=False,
                     extra_pages=0)
    page_bytes = page_size * 8 * 128
    count = (4 << 30) // page_bytes + 4096  # 4 GiB + 64 MiB of pages per pool
    big = {name: DeviceArray.empty((count,) + small.arrays[name].shape[1:],
                                   small.arrays[name].dtype) for name in CACHE}
    table = (count - 1 - np.arange(2 * per_seq, dtype=np.int64)).reshape(2, per_seq)
    for b in range(2):
        for j in range(per_seq):
            for name in CACHE:
                big[name][int(table[b, j])].copy_from_numpy(
                    small.arrays[name][small.table[b, j]])
    big["block_table"] = DeviceArray.from_numpy(table.astype(np.int32))
    assert big["k_cache"].nbytes > 4 << 30
    p_out, _, flags = run_paged(case, small, paged_plan(case, "nhd", page_size), stream, big)
    assert flags == 0
    assert_bitwise(p_out, out.astype(p_out.dtype), "out")
    for array in big.values():
        array.close()


def test_bad_page_ids_set_the_flag_and_touch_nothing_outside(rng, stream):
    case = Case.random(rng, [300, 300, 300], num_q_heads=16, num_kv_heads=4)
    out, lse = case.run(case.make_plan(), stream)
    pages = paginate(rng, contiguous(case), "nhd", 16, token_scales=True)
    pages.table[1, 3] = -1
    pages.table[2, 7] = pages.num_pages  # one past the pool
    pages.table[2, 8] = 2**31 - 1
    p_out, p_lse, flags = run_paged(case, pages, paged_plan(case, "nhd", 16), stream)
    assert flags == ERROR_BAD_PAGE
    assert_bitwise(p_out[0], out[0].astype(p_out.dtype), "the sequence with good pages")
    assert np.isfinite(p_out.astype(np.float32)).all() and np.isfinite(p_lse).all()


# -- writes: the fused append, the append kernel, prompts ---------------------------------------
@pytest.mark.parametrize("layout, page_size, mode, scale_dtype", [
    ("nhd", 16, "token", "float32"), ("hnd", 1, "token", "float16"), ("nhd", 64, "head", "float32"),
    ("hnd", 256, "tensor", "float32"), ("hnd", 8, "token", "float32")])
def test_fused_append_over_pages_writes_the_contiguous_bytes(rng, stream, layout, page_size, mode,
                                                             scale_dtype):
    positions = [page_size - 1, page_size, 0, 2 * page_size + 3, 777]  # crossing page edges
    case = Case.random(rng, positions, capacity=1040, num_q_heads=16, num_kv_heads=4,
                       scale_mode=mode, scale_dtype=scale_dtype)
    qt = dtypes.as_dtype(case.dtype)
    k_new = DeviceArray.from_numpy(rng.standard_normal((case.batch, 4, 128)).astype(qt))
    v_new = DeviceArray.from_numpy(rng.standard_normal((case.batch, 4, 128)).astype(qt))
    pages = paginate(rng, contiguous(case), layout, page_size, token_scales=mode == "token")
    d = case.upload()
    paged = pages.upload()
    results = []
    for plan, arrays, table in ((case.make_plan(rope="neox"), [d[n] for n in ("k", "v",
                                                                                "k_scale",
                                                                                "v_scale")],
                                 None),
                                (paged_plan(case, layout, page_size, rope="neox"),
                                 [paged[n] for n in CACHE], paged["block_table"])):
        plan.plan(positions, append=True)
        out = DeviceArray.full((case.batch, 16, 128), float("nan"), qt)
        plan.append_and_run(d["q"], k_new, v_new, *arrays, d["seq_lens"], out,
                            block_table=table, stream=stream)
        assert plan.error_flags(stream=stream) == 0
        results.append(out.numpy())
    assert_bitwise(results[1], results[0], "out")
    written = gather(pages, {n: paged[n].numpy() for n in CACHE}, case.batch, case.capacity,
                     mode == "token")
    expected = {"k_cache": d["k"].numpy(), "v_cache": d["v"].numpy(),
                "k_scale": d["k_scale"].numpy(), "v_scale": d["v_scale"].numpy()}
    for name, value in written.items():
        assert_bitwise(value, expected[name], name)


@pytest.mark.parametrize("layout, page_size", [("hnd", 1), ("nhd", 1), ("nhd", 16)])
def test_fused_append_reads_page_ids_inside_and_past_its_table_window(rng, stream, layout,
                                                                       page_size):
    # Few-CTA paged plans copy up to 1024 table ids per CTA with the position (IdWindow in
    # cu/cache_pages.cuh); at page size 1 positions past 1024 read the rest from the table.
    # Either way the output is the contiguous cache's, bit for bit, and the same with the
    # window off, as calls with early reads on a programmatic launch have it.
    positions = [2050, 1500, 0, 1030]
    case = Case.random(rng, positions, capacity=2100, num_q_heads=8, num_kv_heads=2)
    qt = dtypes.as_dtype(case.dtype)
    k_new = DeviceArray.from_numpy(rng.standard_normal((case.batch, 2, 128)).astype(qt))
    v_new = DeviceArray.from_numpy(rng.standard_normal((case.batch, 2, 128)).astype(qt))
    pages = paginate(rng, contiguous(case), layout, page_size, token_scales=True)
    d, paged = case.upload(), pages.upload()

    def append(plan, arrays, table, early_reads=False):
        out = DeviceArray.full((case.batch, 8, 128), float("nan"), qt)
        plan.append_and_run(d["q"], k_new, v_new, *arrays, d["seq_lens"], out,
                            block_table=table, early_reads=early_reads, stream=stream)
        assert plan.error_flags(stream=stream) == 0
        return out.numpy()

    flat = case.make_plan()
    flat.plan(positions, append=True)
    expected = append(flat, [d[n] for n in ("k", "v", "k_scale", "v_scale")], None)
    plan = paged_plan(case, layout, page_size)
    plan.plan(positions, append=True)
    assert plan.describe()["table_window"]
    arrays = [paged[n] for n in CACHE]
    assert_bitwise(append(plan, arrays, paged["block_table"]), expected, "window")
    assert plan._params.table_window == 1
    # Early reads (the previous kernel, the flag read's, has finished: nothing to race).
    assert_bitwise(append(plan, arrays, paged["block_table"], True), expected, "early")
    assert plan._params.table_window == (0 if plan.describe()["programmatic"] else 1)
    plan._table_window = False  # the same kernel reading every id from the table
    assert_bitwise(append(plan, arrays, paged["block_table"]), expected, "no window")
    assert plan._params.table_window == 0


@pytest.mark.parametrize("layout, page_size", [("nhd", 16), ("hnd", 2), ("nhd", 128)])
def test_append_and_prompt_kernels_write_pages_as_contiguous(rng, stream, layout, page_size):
    B, HKV, S = 3, 4, 300
    qt = dtypes.as_dtype("float16")
    prompt_k = DeviceArray.from_numpy(rng.standard_normal((B, S, HKV, 128)).astype(qt))
    prompt_v = DeviceArray.from_numpy(rng.standard_normal((B, S, HKV, 128)).astype(qt))
    lengths = np.array([0, page_size + 1, 299], np.int32)
    zeros = {"k_cache": np.zeros((B, HKV, S + 2, 128), np.int8),
             "v_cache": np.zeros((B, HKV, S + 2, 128), np.int8),
             "k_scale": np.zeros((B, HKV, S + 2), np.float32),
             "v_scale": np.zeros((B, HKV, S + 2), np.float32)}
    pages = paginate(rng, zeros, layout, page_size, token_scales=True)
    flat = {n: DeviceArray.from_numpy(v) for n, v in zeros.items()}
    paged = pages.upload()
    k_new = DeviceArray.from_numpy(rng.standard_normal((B, HKV, 128)).astype(qt))
    v_new = DeviceArray.from_numpy(rng.standard_normal((B, HKV, 128)).astype(qt))
    for arrays, spec, table in (([flat[n] for n in CACHE], {}, None),
                                ([paged[n] for n in CACHE],
                                 {"kv_layout": layout, "page_size": page_size},
                                 paged["block_table"])):
        lens = DeviceArray.from_numpy(lengths)
        quantizer = PromptQuantizer.create(HKV, 128, max_batch=B, rope="gptj", **spec)
        quantizer.run(prompt_k, prompt_v, *arrays, lens, block_table=table, stream=stream)
        append = AppendPlan.create(8, HKV, 128, max_batch=B, rope="gptj", **spec)
        append.run(k_new, v_new, *arrays, lens, advance=True, block_table=table, stream=stream)
        assert quantizer.error_flags(stream=stream) == append.error_flags(stream=stream) == 0
        assert lens.numpy().tolist() == (lengths + 1).tolist()
    written = gather(pages, {n: paged[n].numpy() for n in CACHE}, B, S + 2, True)
    for name, value in written.items():
        assert_bitwise(value, flat[name].numpy(), name)


# -- DecodeStep: graph replay over pages, a rewritten table --------------------------------------
def test_step_over_pages_replays_like_contiguous_and_follows_a_rewritten_table(rng, stream):
    layers, steps, B, HQ, HKV = 3, 6, 3, 16, 4
    lengths, capacity, page_size = np.array([15, 30, 97], np.int32), 128, 16
    qt = dtypes.as_dtype("float16")
    hosts = [{"k_cache": rng.integers(-127, 128, (B, HKV, capacity, 128), dtype=np.int8),
              "v_cache": rng.integers(-127, 128, (B, HKV, capacity, 128), dtype=np.int8),
              "k_scale": rng.uniform(0.004, 0.012, (B, HKV, capacity)).astype(np.float32),
              "v_scale": rng.uniform(0.004, 0.012, (B, HKV, capacity)).astype(np.float32)}
             for _ in range(layers)]
    first = paginate(rng, hosts[0], "nhd", page_size, token_scales=True, extra_pages=4)
    paged = [first] + [paginate(rng, h, "nhd", page_size, token_scales=True, extra_pages=4,
                                table=first.table) for h in hosts[1:]]
    io = [{n: DeviceArray.empty((B, h, 128), qt) for n, h in (("q", HQ), ("k_new", HKV),
                                                              ("v_new", HKV), ("out", HQ))}
          for _ in range(layers)]
    flat = [{n: DeviceArray.from_numpy(v) for n, v in h.items()} for h in hosts]
    pools = [p.upload() for p in paged]
    table = pools[0]["block_table"]
    runs = {}
    for name, caches, spec in (("flat", flat, {}),
                               ("paged", pools, {"kv_layout": "nhd", "page_size": page_size})):
        step = DecodeStep.create(layers, HQ, HKV, 128, max_batch=B, max_seq_len=capacity,
                                 rope="neox", **spec).plan(lengths)
        buffers = [LayerBuffers(**x, **{n: c[n] for n in CACHE},
                                block_table=table if spec else None)
                   for x, c in zip(io, caches)]
        seq_lens = DeviceArray.from_numpy(lengths)
        graph = step.capture(buffers, seq_lens, stream)
        outs = []
        spare = sorted(set(range(first.num_pages)) - set(first.table.flat))[:B]
        for s in range(steps + 1):
            if s == steps and spec:  # move every sequence's page 1 to a spare page
                for c in pools:
                    for n in CACHE:
                        for b in range(B):
                            c[n][spare[b]].copy_from(c[n][int(first.table[b, 1])], stream)
                moved = first.table.copy()
                moved[:, 1] = spare
                table.copy_from_numpy(moved, stream)
            step_rng = np.random.default_rng(s)
            for x in io:
                for n in ("q", "k_new", "v_new"):
                    x[n].copy_from_numpy(step_rng.standard_normal(x[n].shape).astype(qt), stream)
                x["out"].fill(float("nan"), stream)
            if s % 2 or s == steps:  # the last step replays the graph over the moved page
                graph.launch(stream)
            else:
                step.eager(buffers, seq_lens, stream)
            outs.append([x["out"].numpy(stream=stream) for x in io])
        assert step.error_flags(stream=stream) == 0
        assert seq_lens.numpy().tolist() == (lengths + steps + 1).tolist()
        runs[name] = outs
    for s, (a, b) in enumerate(zip(runs["flat"], runs["paged"])):
        for layer, (x, y) in enumerate(zip(a, b)):
            assert_bitwise(y, x, f"step {s} layer {layer}")


def test_bad_page_ids_in_the_writers(rng, stream):
    """A bad id where a token would go: nothing is written anywhere, ERROR_BAD_PAGE is set, and
    neither the append kernel's advance nor advance_lengths moves that sequence."""
    B, HKV, S, ps = 2, 4, 64, 16
    qt = dtypes.as_dtype("float16")
    host = {"k_cache": rng.integers(-127, 128, (B, HKV, S, 128), dtype=np.int8),
            "v_cache": rng.integers(-127, 128, (B, HKV, S, 128), dtype=np.int8),
            "k_scale": rng.uniform(0.004, 0.012, (B, HKV, S)).astype(np.float32),
            "v_scale": rng.uniform(0.004, 0.012, (B, HKV, S)).astype(np.float32)}
    pages = paginate(rng, host, "nhd", ps, token_scales=True)
    pages.table[1, 2] = -7  # sequence 1's tokens 32..47
    d = pages.upload()
    before = {n: d[n].numpy() for n in CACHE}
    arrays = [d[n] for n in CACHE]
    positions = np.array([20, 33], np.int32)
    k_new = DeviceArray.from_numpy(rng.standard_normal((B, HKV, 128)).astype(qt))
    v_new = DeviceArray.from_numpy(rng.standard_normal((B, HKV, 128)).astype(qt))
    spec = {"kv_layout": "nhd", "page_size": ps}

    plan = DecodePlan.create(8, HKV, 128, max_batch=B, max_seq_len=S, **spec).plan(
        positions, append=True)
    lens = DeviceArray.from_numpy(positions)
    q = DeviceArray.from_numpy(rng.standard_normal((B, 8, 128)).astype(qt))
    out = DeviceArray.full((B, 8, 128), float("nan"), qt)
    plan.append_and_run(q, k_new, v_new, *arrays, lens, out, block_table=d["block_table"],
                        stream=stream)
    plan.advance_lengths(lens, S, block_table=d["block_table"], num_pages=pages.num_pages,
                         stream=stream)
    assert plan.error_flags(stream=stream) == ERROR_BAD_PAGE
    assert lens.numpy().tolist() == [21, 33]
    assert np.isfinite(out.numpy().astype(np.float32)).all()
    after = {n: d[n].numpy() for n in CACHE}
    page = pages.table[0, 1]  # sequence 0's token 20 went to its page 1, slot 4
    for n in CACHE:
        changed = np.argwhere((after[n] != before[n]).reshape(after[n].shape[0], -1).any(1))
        assert changed.ravel().tolist() == [page], n

    append = AppendPlan.create(8, HKV, 128, max_batch=B, **spec)
    lens = DeviceArray.from_numpy(np.array([40, 45], np.int32))
    append.run(k_new, v_new, *arrays, lens, advance=True, block_table=d["block_table"],
               stream=stream)
    assert append.error_flags(stream=stream) == ERROR_BAD_PAGE
    assert lens.numpy().tolist() == [41, 45]

    prompt = PromptQuantizer.create(HKV, 128, max_batch=B, **spec)
    keys = DeviceArray.from_numpy(rng.standard_normal((B, S, HKV, 128)).astype(qt))
    before = {n: d[n].numpy() for n in CACHE}
    prompt.run(keys, keys, *arrays, DeviceArray.from_numpy(np.array([0, S], np.int32)),
               block_table=d["block_table"], stream=stream)
    assert prompt.error_flags(stream=stream) == ERROR_BAD_PAGE
    after = {n: d[n].numpy() for n in CACHE}
    written = set(pages.table[1].tolist()) - {-7}
    for n in CACHE:
        changed = np.argwhere((after[n] != before[n]).reshape(after[n].shape[0], -1).any(1))
        assert set(changed.ravel().tolist()) <= written, n


# -- pools that are views: K and V in one allocation, scales inline after each row ---------------
def shared_and_inline(pages: Pages, slot_pad: int = 16) -> tuple[dict, list]:
    """The pages' pools re-laid out (nhd) as (1) K and V in one ``[N, 2, page, Hkv, D]`` int8
    allocation and (2) per-token fp32 scales stored inline after each row, in a
    ``[D bytes][4-byte scale][pad]`` slot of each cache: device views of both, as arguments."""
    k, v = pages.arrays["k_cache"], pages.arrays["v_cache"]
    count, ps, hkv, d = k.shape
    slot = d + slot_pad
    buffers = []
    views = {}
    for name, rows, scales in (("k", k, pages.arrays["k_scale"]),
                               ("v", v, pages.arrays["v_scale"])):
        host = np.zeros((count, ps, hkv, slot), np.uint8)
        host[..., :d] = rows.view(np.uint8)
        host[..., d:d + 4] = scales.astype(np.float32)[..., None].view(np.uint8)
        buf = DeviceArray.from_numpy(host)
        buffers.append(buf)
        strides = (ps * hkv * slot, hkv * slot, slot)
        views[f"{name}_cache"] = DeviceArray(buf.ptr, (count, ps, hkv, d), np.int8, buf.device,
                                             strides + (1,), owner=buf._owner)
        views[f"{name}_scale"] = DeviceArray(buf.ptr + d, (count, ps, hkv), np.float32,
                                             buf.device, strides, owner=buf._owner)
    both = np.stack([k, v], axis=1)  # [N, 2, page, Hkv, D]
    pair = DeviceArray.from_numpy(both)
    buffers.append(pair)
    shared = {"k_cache": pair[:, 0], "v_cache": pair[:, 1]}
    return {"inline": views, "shared": shared}, buffers


def test_pools_as_views_shared_allocation_and_inline_scales(rng, stream):
    case = Case.random(rng, [0, 15, 16, 17, 700], num_q_heads=16, num_kv_heads=4)
    out, lse = case.run(case.make_plan(), stream)
    pages = paginate(rng, contiguous(case), "nhd", 16, token_scales=True)
    layouts, _buffers = shared_and_inline(pages)
    table = DeviceArray.from_numpy(pages.table)
    scales = {n: DeviceArray.from_numpy(pages.arrays[n]) for n in ("k_scale", "v_scale")}
    for name, arrays in (("shared K/V allocation", {**layouts["shared"], **scales}),
                         ("inline scales", layouts["inline"])):
        plan = paged_plan(case, "nhd", 16)
        plan.plan(case.lengths)
        result = DeviceArray.full(case.host["q"].shape, float("nan"),
                                  dtypes.as_dtype(case.dtype))
        plan.run(case.device["q"], *(arrays[n] for n in CACHE), case.device["seq_lens"],
                 result, block_table=table, stream=stream)
        assert plan.error_flags(stream=stream) == 0
        assert_bitwise(result.numpy(), out.astype(result.numpy().dtype), name)


def test_fused_append_into_inline_scales_writes_the_contiguous_bytes(rng, stream):
    positions = [15, 16, 0, 300]
    case = Case.random(rng, positions, capacity=336, num_q_heads=16, num_kv_heads=4)
    qt = dtypes.as_dtype(case.dtype)
    k_new = DeviceArray.from_numpy(rng.standard_normal((case.batch, 4, 128)).astype(qt))
    v_new = DeviceArray.from_numpy(rng.standard_normal((case.batch, 4, 128)).astype(qt))
    pages = paginate(rng, contiguous(case), "nhd", 16, token_scales=True)
    layouts, buffers = shared_and_inline(pages)
    inline = layouts["inline"]
    table = DeviceArray.from_numpy(pages.table)
    d = case.upload()
    outs = []
    for plan, arrays, bt in ((case.make_plan(rope="neox"), [d[n] for n in ("k", "v", "k_scale",
                                                                             "v_scale")], None),
                             (paged_plan(case, "nhd", 16, rope="neox"),
                              [inline[n] for n in CACHE], table)):
        plan.plan(positions, append=True)
        out = DeviceArray.full((case.batch, 16, 128), float("nan"), qt)
        plan.append_and_run(d["q"], k_new, v_new, *arrays, d["seq_lens"], out, block_table=bt,
                            stream=stream)
        assert plan.error_flags(stream=stream) == 0
        outs.append(out.numpy())
    assert_bitwise(outs[1], outs[0], "out")
    slots = {name: buf.numpy() for name, buf in zip(("k", "v"), buffers[:2])}
    pools = {"k_cache": slots["k"][..., :128].view(np.int8),
             "v_cache": slots["v"][..., :128].view(np.int8),
             "k_scale": np.ascontiguousarray(slots["k"][..., 128:132]).view(np.float32)[..., 0],
             "v_scale": np.ascontiguousarray(slots["v"][..., 128:132]).view(np.float32)[..., 0]}
    written = gather(pages, pools, case.batch, case.capacity, True)
    expected = {"k_cache": d["k"].numpy(), "v_cache": d["v"].numpy(),
                "k_scale": d["k_scale"].numpy(), "v_scale": d["v_scale"].numpy()}
    for name, value in written.items():
        assert_bitwise(value, expected[name], name)


# -- prompts in chunks (chunked prefill's write side): PromptQuantizer(starts=...) -------------
@pytest.mark.parametrize("layout, page_size", [(None, None), ("hnd", 16), ("nhd", 1)])
def test_a_prompt_written_in_chunks_equals_the_prompt_written_at_once(rng, stream, layout,
                                                                      page_size):
    B, HKV, S = 3, 4, 200
    qt = dtypes.as_dtype("float16")
    k = rng.standard_normal((B, S, HKV, 128)).astype(qt)
    v = rng.standard_normal((B, S, HKV, 128)).astype(qt)
    lengths = np.array([200, 130, 0], np.int32)
    split = np.array([64, 129, 0], np.int32)  # the first chunk: a page edge, a ragged end
    zeros = {"k_cache": np.zeros((B, HKV, S, 128), np.int8),
             "v_cache": np.zeros((B, HKV, S, 128), np.int8),
             "k_scale": np.zeros((B, HKV, S), np.float32),
             "v_scale": np.zeros((B, HKV, S), np.float32)}
    spec = {} if layout is None else {"kv_layout": layout, "page_size": page_size}
    results = []
    for chunked in (False, True):
        if layout is None:
            arrays = {n: DeviceArray.from_numpy(x) for n, x in zeros.items()}
            table = None
        else:
            pages = paginate(np.random.default_rng(5), zeros, layout, page_size,
                             token_scales=True)
            arrays = pages.upload()
            table = arrays.pop("block_table")
        quantizer = PromptQuantizer.create(HKV, 128, max_batch=B, rope="neox", **spec)
        cached = DeviceArray.from_numpy(np.zeros(B, np.int32))
        if not chunked:
            quantizer.run(DeviceArray.from_numpy(k), DeviceArray.from_numpy(v),
                          *(arrays[n] for n in CACHE), DeviceArray.from_numpy(lengths),
                          seq_lens_out=cached, block_table=table, stream=stream)
        else:
            for first, count in ((0, split), (split, lengths - split)):
                # chunk b starts at first[b]: the prompt array holds its tokens from index 0
                chunk_k = np.zeros_like(k)
                chunk_v = np.zeros_like(v)
                for b in range(B):
                    first_b = int(np.broadcast_to(first, (B,))[b])
                    chunk_k[b, :count[b]] = k[b, first_b:first_b + count[b]]
                    chunk_v[b, :count[b]] = v[b, first_b:first_b + count[b]]
                before = DeviceArray.from_numpy(cached.numpy())  # not seq_lens_out itself
                quantizer.run(DeviceArray.from_numpy(chunk_k), DeviceArray.from_numpy(chunk_v),
                              *(arrays[n] for n in CACHE),
                              DeviceArray.from_numpy(count.astype(np.int32)),
                              starts=before, seq_lens_out=cached, block_table=table,
                              stream=stream)
                stream.synchronize()
        assert quantizer.error_flags(stream=stream) == 0
        assert cached.numpy().tolist() == lengths.tolist()
        host = {n: arrays[n].numpy() for n in CACHE}
        results.append(host if layout is None else gather(pages, host, B, S, True))
    for name in CACHE:
        assert_bitwise(results[1][name], results[0][name], name)

    # A chunk that starts outside the cache writes nothing and says so.
    arrays = {n: DeviceArray.from_numpy(x) for n, x in zeros.items()}
    quantizer = PromptQuantizer.create(HKV, 128, max_batch=B, rope="neox")
    starts = DeviceArray.from_numpy(np.array([S + 1, -1, 190], np.int32))
    out = DeviceArray.from_numpy(np.zeros(B, np.int32))
    quantizer.run(DeviceArray.from_numpy(k), DeviceArray.from_numpy(v),
                  *(arrays[n] for n in CACHE), DeviceArray.from_numpy(lengths), starts=starts,
                  seq_lens_out=out, stream=stream)
    assert quantizer.error_flags(stream=stream) == ERROR_OUTSIDE_CACHE
    assert out.numpy().tolist() == [S + 1, -1, 190]  # row 2: 0 tokens from 190
    for name in CACHE:
        assert not arrays[name].numpy().any(), name
