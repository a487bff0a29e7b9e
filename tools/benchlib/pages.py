"""Paged pools read back as contiguous caches (host numpy): what the oracle takes."""
from __future__ import annotations

import numpy as np


def bnsh_from_pages(pool: np.ndarray, table: np.ndarray, layout: str) -> np.ndarray:
    """The pages ``table`` [B, P] lists of a pool (``nhd``: [N, page, Hkv, ...], ``hnd``:
    [N, Hkv, page, ...]; caches or per-token scales) as [B, Hkv, P * page, ...]."""
    pages = pool[table]  # [B, P, page, H, ...] (nhd) or [B, P, H, page, ...] (hnd)
    pages = np.moveaxis(pages, 3 if layout == "nhd" else 2, 1)  # [B, H, P, page, ...]
    return pages.reshape(pages.shape[0], pages.shape[1], -1, *pages.shape[4:])
