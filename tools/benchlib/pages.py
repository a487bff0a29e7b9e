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
