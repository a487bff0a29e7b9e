"""Paged pools: the physical order of their pages, and pools read back as contiguous caches
(host numpy): what the oracle takes."""
from __future__ import annotations

import numpy as np


def bnsh_from_pages(pool: np.ndarray, table: np.ndarray, layout: str) -> np.ndarray:
    """The pages ``table`` [B, P] lists of a pool (``nhd``: [N, page, Hkv, ...], ``hnd``:
    [N, Hkv, page, ...]; caches or per-token scales) as [B, Hkv, P * page, ...]."""
    pages = pool[table]  # [B, P, page, H, ...] (nhd) or [B, P, H, page, ...] (hnd)
    pages = np.moveaxis(pages, 3 if layout == "nhd" else 2, 1)  # [B, H, P, page, ...]
    return pages.reshape(pages.shape[0], pages.shape[1], -1, *pages.shape[4:])


PAGE_ORDERS = ("random", "ordered", "window", "runs", "sweep")


def page_ids(order: str, count: int, page_bytes: int, rng: np.random.Generator,
             row: int | None = None) -> np.ndarray:
    """Physical ids of ``count`` pages of ``page_bytes`` each (in one pool): "random"
    (fragmented), "ordered", "window" (random within each 2 MiB of the pool, the windows in
    order: few address translations at a time, no sequential rows), "runs" (each 2 MiB in
    order, the runs in random order: sequential rows, scattered translations) or "sweep"
    (random, then each sequence's ``row`` ids ascending: as scattered as random per
    sequence, but every sequence walks the pool from its start to its end)."""
    if order == "ordered":
        return np.arange(count)
    if order == "random":
        return rng.permutation(count)
    if order == "sweep":
        ids = rng.permutation(count)
        row = row or count
        whole = count - count % row
        ids[:whole] = np.sort(ids[:whole].reshape(-1, row), axis=1).reshape(-1)
        return ids
    per = max(1, (2 << 20) // page_bytes)
    starts = range(0, count, per)
    if order == "window":
        return np.concatenate([s + rng.permutation(min(per, count - s)) for s in starts])
    if order == "runs":
        runs = [np.arange(s, min(s + per, count)) for s in starts]
        return np.concatenate([runs[i] for i in rng.permutation(len(runs))])
    raise ValueError(f"page order: expected one of {PAGE_ORDERS}, got {order!r}")


class PageSlot:
    """One slot per page in one allocation: the page's K rows, its V rows (each in the pool's
    own layout, ``nhd`` [page, Hkv, D] or ``hnd`` [Hkv, page, D]), then both per-token scales,
    K's and V's of a (token, head) side by side (``hnd`` [Hkv][K, V][page], ``nhd``
    [page][Hkv][K, V]), padded to 128 bytes. A page then lies in one address range instead of
    four separate pools' (the FlashInfer-style [num_pages, 2, ...] pool with its scales), which
    is what address translation pays for when pages are scattered (PERF_NOTES v18, v25).
    Strides and offsets are in bytes; the pools are views of the allocation."""

    def __init__(self, layout: str, page_size: int, num_kv_heads: int, head_dim: int,
                 scale_itemsize: int) -> None:
        if layout not in ("nhd", "hnd"):
            raise ValueError(f"PageSlot layout: expected 'nhd' or 'hnd', got {layout!r}")
        self.layout, self.page_size, self.scale_itemsize = layout, page_size, scale_itemsize
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.rows_bytes = page_size * num_kv_heads * head_dim  # one cache's rows of a page
        self.scale_block_bytes = 2 * page_size * num_kv_heads * scale_itemsize
        self.nbytes = -(-(2 * self.rows_bytes + self.scale_block_bytes) // 128) * 128

    @property
    def row_strides(self) -> tuple[int, int, int, int]:
        """Byte strides of a cache view, in the pool's shape order."""
        P, H, D = self.page_size, self.num_kv_heads, self.head_dim
        return ((self.nbytes, H * D, D, 1) if self.layout == "nhd"
                else (self.nbytes, P * D, D, 1))

    @property
    def scale_strides(self) -> tuple[int, int, int]:
        """Byte strides of a scale view ([N, page, Hkv] nhd, [N, Hkv, page] hnd)."""
        P, H, s = self.page_size, self.num_kv_heads, self.scale_itemsize
        return (self.nbytes, 2 * H * s, 2 * s) if self.layout == "nhd" else (
            self.nbytes, 2 * P * s, s)

    def offsets(self) -> dict[str, int]:
        """Byte offset of each view's first element from the slot's start."""
        scales = 2 * self.rows_bytes
        v_scale = self.scale_itemsize * (1 if self.layout == "nhd" else self.page_size)
        return {"k": 0, "v": self.rows_bytes, "k_scale": scales, "v_scale": scales + v_scale}

    def scale_block(self, k_scale: np.ndarray, v_scale: np.ndarray) -> np.ndarray:
        """The slots' scale blocks [N, scale_block_bytes / itemsize] from the pools' scales
        ([N, page, Hkv] nhd, [N, Hkv, page] hnd): K's and V's interleaved as the views read."""
        axis = 3 if self.layout == "nhd" else 2
        both = np.stack([k_scale, v_scale], axis=axis)  # nhd [N,P,H,2], hnd [N,H,2,P]
        return both.reshape(both.shape[0], -1)
