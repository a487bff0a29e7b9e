"""Paged storage without a GPU: the spec's page size, the pool / scale / block-table checks of
every family (each error names the argument, before anything is written), the parameter
fields a paged binding writes, the paged kernel variants, and the host paging helpers the GPU
tests rely on."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from paged_case import gather, paginate
from stand_ins import DEVICE, fake

from lowlevel_fd import AppendPlan, DecodePlan, KVCacheSpec, PromptQuantizer
from lowlevel_fd.append.params import AppendParams
from lowlevel_fd.core import support
from lowlevel_fd.decode import DecodeVariant, TileConfig
from lowlevel_fd.decode.params import DecodeParams

B, HQ, HKV, D, PS, PAGES, COLS = 2, 8, 2, 128, 16, 40, 16  # 16 columns x 16 = 256 tokens


def pools(layout: str = "nhd", *, pages: int = PAGES, ps: int = PS, scale: str = "float32",
          scale_shape: tuple[int, ...] | None = None) -> dict:
    shape = (pages, ps, HKV, D) if layout == "nhd" else (pages, HKV, ps, D)
    scales = scale_shape or ((pages, ps, HKV) if layout == "nhd" else (pages, HKV, ps))
    return {"k_cache": fake(shape, "int8"), "v_cache": fake(shape, "int8"),
            "k_scale": fake(scales, scale), "v_scale": fake(scales, scale),
            "block_table": fake((B, COLS), "int32")}


def plan(layout: str = "nhd", *, scale_dtype: str = "float32", max_seq_len: int = 256,
         **options) -> DecodePlan:
    p = DecodePlan.create(HQ, HKV, D, max_batch=B, max_seq_len=max_seq_len, kv_layout=layout,
                          page_size=options.pop("page_size", PS), scale_dtype=scale_dtype,
                          device=DEVICE, **options)
    p._binder.planned(B, 200)  # what plan([...]) would have set
    return p


def arguments(layout: str = "nhd", **replace) -> dict:
    args = {"q": fake((B, HQ, D), "float16"), "seq_lens": fake((B,), "int32"),
            "out": fake((B, HQ, D), "float16"), "lse": None} | pools(layout)
    return args | replace


@pytest.mark.parametrize("layout", support.PAGED_LAYOUTS)
def test_a_paged_binding_writes_page_strides_table_and_capacity(layout):
    p = DecodeParams()
    args = arguments(layout)
    plan(layout)._binder.bind(p, **args)
    k, table = args["k_cache"], args["block_table"]
    head, token = (D, HKV * D) if layout == "nhd" else (PS * D, D)
    assert (p.kv_batch_stride, p.kv_head_stride, p.kv_token_stride) == (PS * HKV * D, head,
                                                                        token)
    s_head, s_token = (1, HKV) if layout == "nhd" else (PS, 1)
    assert (p.scale_batch_stride, p.scale_head_stride, p.scale_token_stride) == (
        PS * HKV, s_head, s_token)
    assert (p.block_table, p.table_stride, p.num_pages, p.page_shift) == (table.ptr, COLS,
                                                                          PAGES, 4)
    assert p.capacity == COLS * PS and p.k_cache == k.ptr


def test_a_contiguous_binding_zeroes_the_page_fields():
    from test_validation_cpu import good_arguments as flat_arguments
    from test_validation_cpu import planned
    p = DecodeParams()
    ctypes.memset(ctypes.addressof(p), 0xFF, ctypes.sizeof(p))
    planned("bnsh", "token")._binder.bind(p, **flat_arguments(), block_table=None)
    assert (p.block_table, p.table_stride, p.num_pages, p.page_shift) == (0, 0, 0, 0)
    assert p.scale_token_stride == 1


BAD = {
    "no table": ({"block_table": None}, ValueError,
                 r"block_table: the cache spec is paged \(kv_layout='nhd', page_size=16\); "
                 r"expected an int32 \[B, max_pages\] device array, got None"),
    "table dtype": ({"block_table": fake((B, COLS), "int64")}, TypeError,
                    r"block_table: expected dtype int32, got int64"),
    "table rows": ({"block_table": fake((1, COLS), "int32")}, ValueError,
                   r"block_table: expected shape \[B, max_pages\] with at least 2 rows"),
    "table 1-d": ({"block_table": fake((B * COLS,), "int32")}, ValueError,
                  r"block_table: expected shape \[B, max_pages\]"),
    "table strided": ({"block_table": fake((B, COLS), "int32", strides=(COLS * 8, 8))},
                      ValueError, r"block_table: the last dimension must be contiguous"),
    "table too short": ({"block_table": fake((B, 15), "int32")}, ValueError,
                        r"block_table: max_pages \* page_size = 240 tokens is below the "
                        r"plan's max_seq_len 256; expected at least 16 columns"),
    "pool page size": ({"k_cache": fake((PAGES, 8, HKV, D), "int8"),
                        "v_cache": fake((PAGES, 8, HKV, D), "int8")}, ValueError,
                       r"k_cache: expected shape \[num_pages, page_size, Hkv, D\]="
                       r"\('\*', 16, 2, 128\), got \(40, 8, 2, 128\)"),
    "pool layout": ({"k_cache": fake((PAGES, HKV, PS, D), "int8"),
                     "v_cache": fake((PAGES, HKV, PS, D), "int8")}, ValueError,
                    r"k_cache: expected shape \[num_pages, page_size, Hkv, D\]"),
    "v pool size": ({"v_cache": fake((PAGES + 1, PS, HKV, D), "int8")}, ValueError,
                    r"v_cache: expected the shape and strides of k_cache"),
    "row alignment": ({n: fake((PAGES, PS, HKV, D), "int8",
                               strides=(PS * HKV * 136, HKV * 136, 136, 1))
                       for n in ("k_cache", "v_cache")}, ValueError,
                      r"k_cache: the stride of axis 2 must be a multiple of 16 bytes, got 136"),
    "scale pool shape": ({"k_scale": fake((PAGES, HKV, PS), "float32"),
                          "v_scale": fake((PAGES, HKV, PS), "float32")}, ValueError,
                         r"k_scale: expected shape \[num_pages, page_size, Hkv\]=\(40, 16, 2\)"),
    "scale pool pages": ({"k_scale": fake((PAGES - 1, PS, HKV), "float32"),
                          "v_scale": fake((PAGES - 1, PS, HKV), "float32")}, ValueError,
                         r"k_scale: expected shape \[num_pages, page_size, Hkv\]"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_paged_arguments_are_rejected_naming_them(case):
    replace, error, message = BAD[case]
    p = DecodeParams()
    before = bytes(p)
    with pytest.raises(error, match=message):
        plan()._binder.bind(p, **arguments(**replace))
    assert bytes(p) == before, "nothing is written before every check passed"


def test_a_contiguous_spec_rejects_a_table():
    from test_validation_cpu import good_arguments as flat_arguments
    from test_validation_cpu import planned
    with pytest.raises(ValueError, match=r"block_table: the cache spec is contiguous"):
        planned("bnsh", "token")._binder.bind(DecodeParams(), **flat_arguments(),
                                               block_table=fake((B, 4), "int32"))


def test_fp16_paged_scales_must_keep_their_words_inside_the_pool():
    # [1, 1, 1] fp16 (page 1, one head): the only element starts a 4-byte word that ends
    # 2 bytes past the pool.
    odd = {"k_scale": fake((1, 1, 1), "float16", ptr=0x4000000),
           "v_scale": fake((1, 1, 1), "float16", ptr=0x5000000)}
    p1 = DecodePlan.create(HQ, 1, D, max_batch=B, max_seq_len=16, kv_layout="nhd",
                           page_size=1, scale_dtype="float16", device=DEVICE)
    p1._binder.planned(B, 10)
    args = {"q": fake((B, HQ, D), "float16"), "seq_lens": fake((B,), "int32"),
            "out": fake((B, HQ, D), "float16"), "lse": None,
            "k_cache": fake((1, 1, 1, D), "int8"), "v_cache": fake((1, 1, 1, D), "int8"),
            "block_table": fake((B, 16), "int32")} | odd
    with pytest.raises(ValueError, match=r"k_scale: fp16 paged scales are read as aligned "
                                         r"4-byte words"):
        p1._binder.bind(DecodeParams(), **args)
    # Any strides otherwise: a [pages, Hkv, page] pool seen through a transposed view.
    view = fake((PAGES, PS, HKV), "float16", strides=(PS * HKV * 2, 2, PS * 2))
    plan(scale_dtype="float16")._binder.bind(DecodeParams(),
                                             **arguments(k_scale=view, v_scale=view))


def test_the_plan_compiles_the_paged_variant():
    spec = KVCacheSpec(HKV, D, "hnd", page_size=64)
    variant = DecodeVariant.planned(spec, HQ // HKV, "float16", TileConfig())
    assert variant.paged and variant.split_kernel.endswith(", true>")
    assert DecodeVariant.planned(KVCacheSpec(HKV, D), 4, "float16", TileConfig()).paged is False
    fp16 = DecodeVariant(128, 4, scale_dtype="float16")
    assert DecodeVariant(128, 4, scale_dtype="float16", paged=True).stage_bytes == (
        fp16.stage_bytes + 64)  # paged stages keep every scale as a 4-byte word


def test_append_families_take_the_table():
    params = AppendParams()
    append = AppendPlan.create(HQ, HKV, D, max_batch=B, kv_layout="hnd", page_size=PS,
                               device=DEVICE)
    cache = pools("hnd")
    table = cache.pop("block_table")
    append._bind(params, fake((B, HKV, D), "float16"), fake((B, HKV, D), "float16"),
                 *cache.values(), fake((B,), "int32"), None, None, None, False, None, table)
    assert (params.block_table, params.num_pages, params.page_shift, params.capacity) == (
        table.ptr, PAGES, 4, COLS * PS)
    with pytest.raises(ValueError, match="block_table: the cache spec is paged"):
        append._bind(AppendParams(), fake((B, HKV, D), "float16"),
                     fake((B, HKV, D), "float16"), *cache.values(), fake((B,), "int32"),
                     None, None, None, False, None, None)
    prompt = PromptQuantizer.create(HKV, D, max_batch=B, kv_layout="hnd", page_size=PS,
                                    device=DEVICE)
    grid = prompt._bind(AppendParams(), fake((B, 100, HKV, D), "float16"),
                        fake((B, 100, HKV, D), "float16"), *cache.values(),
                        fake((B,), "int32"), None, None, None, table, None)
    assert grid == (13, B)


def test_advance_lengths_needs_the_table_of_a_paged_spec():
    p = plan()
    p._split = object()  # planned
    with pytest.raises(ValueError, match="block_table, num_pages: a paged spec needs both"):
        p.advance_lengths(fake((B,), "int32"), 256, stream=0)
    with pytest.raises(ValueError, match=r"block_table: expected \[>= 2, >= 16\]"):
        p.advance_lengths(fake((B,), "int32"), 256, block_table=fake((B, 8), "int32"),
                          num_pages=PAGES, stream=0)


# -- the host helpers of the GPU tests ----------------------------------------------------------
@pytest.mark.parametrize("layout", support.PAGED_LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paginate_and_gather_are_inverse(rng, layout, page_size):
    host = {"k_cache": rng.integers(-127, 128, (3, 2, 37, 8), dtype=np.int8),
            "v_cache": rng.integers(-127, 128, (3, 2, 37, 8), dtype=np.int8),
            "k_scale": rng.random((3, 2, 37)).astype(np.float32),
            "v_scale": rng.random((3, 2, 37)).astype(np.float32)}
    pages = paginate(rng, host, layout, page_size, token_scales=True)
    assert sorted(pages.table.ravel()) == sorted(set(pages.table.ravel()))  # no page twice
    back = gather(pages, pages.arrays, 3, 37, True)
    for name, value in host.items():
        assert np.array_equal(back[name], value), name
