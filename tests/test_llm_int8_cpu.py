"""The INT8 backend of the GPU runner (tools/llm) without a GPU or torch: its storage options,
the random page assignment and pool shapes (int8_storage.py), the packing of ragged prompts
for the multi-token prefill, and gpu_report.py's new options. Runs in CI."""
from __future__ import annotations

import numpy as np
import pytest

from llm import gpu_report
from llm.int8_storage import (DEFAULT_PAGE_SIZE, DEFAULT_STORAGE, PAGE_SIZES, STORAGES,
                              cache_layout, packed_rows, random_block_table, storage_options)
from llm.report_tables import markdown


def test_storage_options_name_the_library_layout():
    assert (DEFAULT_STORAGE, DEFAULT_PAGE_SIZE) == ("hnd", 16)
    assert storage_options("contiguous", 16) == ("bnsh", None)
    assert storage_options("contiguous", 3) == ("bnsh", None)  # page_size ignored
    assert storage_options("nhd", 16) == ("nhd", 16)
    assert storage_options("hnd", np.int64(1)) == ("hnd", 1)
    assert PAGE_SIZES == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    with pytest.raises(ValueError, match="storage: expected one of"):
        storage_options("paged", 16)
    for bad in (0, 3, 24, 512, None, 16.0, True):
        with pytest.raises(ValueError, match="page_size: expected a power of two"):
            storage_options("nhd", bad)


def test_random_block_table_is_a_seeded_permutation():
    table = random_block_table(3, 5, 16, seed=1)
    assert table.dtype == np.int32 and table.shape == (3, 5)
    assert len(set(table.ravel().tolist())) == 15 and table.min() >= 0 and table.max() < 16
    assert np.array_equal(table, random_block_table(3, 5, 16, seed=1))
    assert not np.array_equal(table, random_block_table(3, 5, 16, seed=2))
    # not the identity, nor each sequence's pages adjacent and in order
    assert not np.array_equal(table.ravel(), np.arange(15))
    assert not all((np.diff(row) == 1).all() for row in table)
    with pytest.raises(ValueError, match="num_pages: 3 sequences of 5 pages need 15"):
        random_block_table(3, 5, 14)
    with pytest.raises(ValueError, match="batch and pages_per_sequence"):
        random_block_table(0, 5, 14)


@pytest.mark.parametrize("storage, page_size, kv, scale", [
    ("contiguous", 16, (2, 3, 40, 64), (2, 3, 40)),
    ("nhd", 16, (6, 16, 3, 64), (6, 16, 3)),       # 40 tokens: 3 pages per sequence
    ("hnd", 8, (10, 3, 8, 64), (10, 3, 8)),
    ("nhd", 1, (80, 1, 3, 64), (80, 1, 3)),
])
def test_cache_layout_shapes(storage, page_size, kv, scale):
    layout = cache_layout(storage, page_size, batch=2, capacity=40, kv_heads=3, head_dim=64)
    assert layout.kv_shape == kv and layout.scale_shape == scale
    assert layout.paged == (storage != "contiguous")
    if layout.paged:
        assert layout.capacity == layout.pages_per_sequence * page_size >= 40
        assert layout.num_pages == 2 * layout.pages_per_sequence
    else:
        assert layout.capacity == 40 and layout.num_pages == 0
    static = cache_layout(storage, page_size, batch=2, capacity=40, kv_heads=3, head_dim=64,
                          scale_mode="head")
    assert static.scale_shape == (3,) and static.kv_shape == kv
    tensor = cache_layout(storage, page_size, batch=2, capacity=40, kv_heads=3, head_dim=64,
                          scale_mode="tensor")
    assert tensor.scale_shape == (1,)


def test_fp16_scale_pools_of_an_odd_size_get_a_spare_page():
    """The library reads fp16 paged scales as aligned 4-byte words: a layer's pool must not
    end at the start of one, so an odd element count gets one page more."""
    odd = dict(batch=1, capacity=3, kv_heads=3, head_dim=64)  # 3 pages x 1 token x 3 heads
    assert cache_layout("nhd", 1, **odd, scale_dtype="float16").num_pages == 4
    assert cache_layout("nhd", 1, **odd, scale_dtype="float32").num_pages == 3
    assert cache_layout("hnd", 1, **odd, scale_mode="head").num_pages == 3
    assert cache_layout("nhd", 2, **odd, scale_dtype="float16").num_pages == 2  # even already


def test_packed_rows_of_ragged_prompts():
    indptr, rows = packed_rows([3, 1, 2], 4)
    assert indptr.dtype == np.int32 and indptr.tolist() == [0, 3, 4, 6]
    assert rows.dtype == np.int64 and rows.tolist() == [0, 1, 2, 4, 8, 9]
    indptr, rows = packed_rows([4, 4], 4)  # no padding: every row, in order
    assert indptr.tolist() == [0, 4, 8] and rows.tolist() == list(range(8))
    for lengths in ([5, 1], [-1, 2], []):
        with pytest.raises(ValueError, match="lengths: expected prompt lengths"):
            packed_rows(lengths, 4)


def test_gpu_report_options():
    args = gpu_report.parse_args(["--out", "x"])
    assert (args.storage, args.page_size, args.page_seed, args.prefill) == ("hnd", 16, 0,
                                                                            "multi")
    assert gpu_report.int8_options(args) == {"storage": "hnd", "page_size": 16,
                                             "page_seed": 0, "prefill": "multi"}
    args = gpu_report.parse_args(["--out", "x", "--storage", "nhd", "--page-size", "64",
                                  "--page-seed", "3", "--prefill", "both"])
    assert gpu_report.int8_options(args) == {"storage": "nhd", "page_size": 64,
                                             "page_seed": 3, "prefill": "multi"}
    sdpa = gpu_report.parse_args(["--out", "x", "--storage", "contiguous", "--prefill", "sdpa"])
    assert gpu_report.int8_options(sdpa)["prefill"] == "sdpa"
    assert set(STORAGES) == {"contiguous", "nhd", "hnd"}
    for bad in (["--storage", "paged"], ["--page-size", "24"], ["--prefill", "flash"]):
        with pytest.raises(SystemExit):
            gpu_report.parse_args(["--out", "x", *bad])
    names, int8 = ("sdpa-fp32", "int8-head"), ("int8-head",)
    assert gpu_report.backend_names(names, int8, "multi") == names
    assert gpu_report.backend_names(names, int8, "sdpa") == names
    assert gpu_report.backend_names(names, int8, "both") == names + ("int8-head+sdpa-prefill",)


def test_report_names_the_int8_storage_and_prefill():
    paged = {"settings": {"dtype": "float16", "storage": "hnd", "page_size": 32,
                          "page_seed": 0, "prefill": "both"}, "sections": {}}
    text = markdown(paged)
    assert "pages of 32 tokens in hnd order" in text and "random physical order" in text
    assert "MultiPlan over the INT8 cache (`+sdpa-prefill`" in text
    contiguous = {"settings": {"storage": "contiguous", "prefill": "sdpa"}, "sections": {}}
    text = markdown(contiguous)
    assert "contiguous per sequence" in text and "torch SDPA over the un-quantized" in text
    assert "INT8 caches" not in markdown({"settings": {}, "sections": {}})
