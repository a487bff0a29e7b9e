"""Paged twins of contiguous caches: the same tokens in the pages of a pool, the pages in a random
physical order (or in order), and the block table that maps them; and the way back, to compare
what kernels wrote into pages with what they wrote into a contiguous cache."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from benchlib.pages import bnsh_from_pages
from lowlevel_fd.driver import DeviceArray


@dataclass
class Pages:
    """A paged copy of ``[B, Hkv, S, D]`` caches (and ``[B, Hkv, S]`` token scales)."""

    layout: str  # "nhd" [N, page, Hkv, D] | "hnd" [N, Hkv, page, D]
    page_size: int
    table: np.ndarray  # int32 [B, pages per sequence]
    arrays: dict[str, np.ndarray]  # k_cache, v_cache, k_scale, v_scale (pools or as given)

    @property
    def num_pages(self) -> int:
        return self.arrays["k_cache"].shape[0]

    def upload(self) -> dict[str, DeviceArray]:
        device = {name: DeviceArray.from_numpy(value) for name, value in self.arrays.items()}
        device["block_table"] = DeviceArray.from_numpy(self.table)
        return device


def to_pool(layout: str, rows: np.ndarray) -> np.ndarray:
    """``[Hkv, n, ...]`` token rows of one page as the pool stores them."""
    return rows.swapaxes(0, 1) if layout == "nhd" else rows


def paginate(rng: np.random.Generator, host: dict[str, np.ndarray], layout: str,
             page_size: int, *, token_scales: bool, shuffle: bool = True, extra_pages: int = 3,
             shared_pages: int = 0, columns: int | None = None,
             table: np.ndarray | None = None) -> Pages:
    """Page the bnsh caches ``host["k_cache"]`` etc. Every page of the pool not referenced
    holds random bytes (a kernel that reads it shows). ``shared_pages``: sequences after the
    first point their first pages at the first sequence's (prefix caching: the caller made
    those tokens equal). ``columns``: table width (default: the pages S needs). ``table``: use
    this block table (another layer's) instead of drawing one."""
    k = host["k_cache"]
    B, Hkv, S, D = k.shape
    per_seq = -(-S // page_size)
    columns = per_seq if columns is None else columns
    count = B * per_seq + extra_pages
    if table is None:
        order = rng.permutation(count) if shuffle else np.arange(count)
        table = np.full((B, columns), -1, np.int32)
        table[:, :per_seq] = order[:B * per_seq].reshape(B, per_seq)
        table[1:, :shared_pages] = table[0, :shared_pages]
    pool_shape = ((count, page_size, Hkv, D) if layout == "nhd"
                  else (count, Hkv, page_size, D))
    scale_shape = (count, page_size, Hkv) if layout == "nhd" else (count, Hkv, page_size)
    arrays = {}
    for name in ("k_cache", "v_cache"):
        arrays[name] = rng.integers(-127, 128, pool_shape, dtype=np.int8)
    for name in ("k_scale", "v_scale"):
        arrays[name] = (rng.uniform(0.5, 1.0, scale_shape).astype(host[name].dtype)
                        if token_scales else host[name].copy())
    for b in range(B):
        for j in range(per_seq):
            page, t0 = table[b, j], j * page_size
            n = min(page_size, S - t0)
            for name in ("k_cache", "v_cache"):
                arrays[name][page][to_slice(layout, n)] = to_pool(layout,
                                                                  host[name][b, :, t0:t0 + n])
            if token_scales:
                for name in ("k_scale", "v_scale"):
                    rows = host[name][b, :, t0:t0 + n]  # [Hkv, n]
                    arrays[name][page][to_slice(layout, n)] = rows.T if layout == "nhd" else rows
    return Pages(layout, page_size, table, arrays)


def to_slice(layout: str, n: int) -> tuple:
    """The first n token slots of a page (pool page or scale page)."""
    return (slice(0, n),) if layout == "nhd" else (slice(None), slice(0, n))


def gather(pages: Pages, pools: dict[str, np.ndarray], batch: int, tokens: int,
           token_scales: bool) -> dict[str, np.ndarray]:
    """The bnsh caches ``[B, Hkv, tokens, D]`` (and ``[B, Hkv, tokens]`` scales) that the pages
    ``pools`` hold per the table: the inverse of ``paginate``."""
    table = pages.table[:batch, :-(-tokens // pages.page_size)]
    names = ("k_cache", "v_cache") + (("k_scale", "v_scale") if token_scales else ())
    return {name: bnsh_from_pages(pools[name], table, pages.layout)[:, :, :tokens]
            for name in names}
