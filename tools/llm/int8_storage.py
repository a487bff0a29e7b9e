"""Where the INT8 backend (int8_attention.py) keeps its cache: contiguous per sequence, or in
pages that a block table assigns to the sequences.

- `"contiguous"`: per layer int8 K and V `[B, Hkv, S_max, D]` (`kv_layout="bnsh"`) and per-token
  scales `[B, Hkv, S_max]`.
- `"nhd"` / `"hnd"` (paged, `page_size` tokens a page): per layer a K and a V pool `[num_pages,
  page_size, Hkv, D]` / `[num_pages, Hkv, page_size, D]` and per-token scale pools
  `[num_pages, page_size, Hkv]` / `[num_pages, Hkv, page_size]` (docs/contract.md, "Paged
  storage"). One int32 block table `[B, max_pages]` on the device, shared by every layer (the
  fused DecodeStep advances the lengths once, so it needs one table and pools of one size),
  maps token t of sequence b to slot `t % page_size` of page `table[b, t // page_size]`. The
  pages go to the sequences in a random physical order, a seeded permutation of the pool, so
  that nothing works only because a sequence's pages happen to be adjacent.

Static scales (`"head"`: `[Hkv]`, `"tensor"`: `[1]` per layer) are the same in every storage.
Also the packed layout of ragged prompts that the multi-token attention takes (`packed_rows`).
The host-side helpers (options, table, shapes, packing) need only numpy; `Int8Cache`
allocates in torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

STORAGES = ("contiguous", "nhd", "hnd")
DEFAULT_STORAGE, DEFAULT_PAGE_SIZE = "hnd", 16  # hnd: the faster paged decode on the H100
PAGE_SIZES = tuple(1 << i for i in range(9))  # 1 .. 256, the library's page sizes


def storage_options(storage: str, page_size) -> tuple[str, int | None]:
    """(kv_layout, page_size) of the library's KVCacheSpec for `storage` (STORAGES);
    `page_size` is ignored for "contiguous" (None), else a power of two from 1 to 256."""
    if storage not in STORAGES:
        raise ValueError(f"storage: expected one of {STORAGES}, got {storage!r}")
    if storage == "contiguous":
        return "bnsh", None
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) \
            or int(page_size) not in PAGE_SIZES:
        raise ValueError(f"page_size: expected a power of two in {list(PAGE_SIZES)} for "
                         f"storage {storage!r}, got {page_size!r}")
    return storage, int(page_size)


def random_block_table(batch: int, pages_per_sequence: int, num_pages: int,
                       seed: int = 0) -> np.ndarray:
    """int32 `[batch, pages_per_sequence]`: the first `batch * pages_per_sequence` ids of a
    seeded random permutation of the pool's `num_pages` pages, row b sequence b's pages in
    token order. Every id appears at most once (no sharing); pages left over stay unused."""
    if batch < 1 or pages_per_sequence < 1:
        raise ValueError(f"batch and pages_per_sequence: expected >= 1, got {batch} and "
                         f"{pages_per_sequence}")
    if num_pages < batch * pages_per_sequence:
        raise ValueError(f"num_pages: {batch} sequences of {pages_per_sequence} pages need "
                         f"{batch * pages_per_sequence}, the pool has {num_pages}")
    order = np.random.default_rng(seed).permutation(num_pages)
    return order[:batch * pages_per_sequence].reshape(batch, pages_per_sequence).astype(np.int32)


def packed_rows(lengths, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The prompts of `lengths` in a right-padded `[B, tokens]` layout, packed: (`qo_indptr`
    int32 `[B + 1]`, `rows` int64 `[total_q]`, the flat `b * tokens + i` index of each valid
    row in order)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1 or lengths.size < 1 or lengths.min() < 0 or lengths.max() > tokens:
        raise ValueError(f"lengths: expected prompt lengths in [0, {tokens}], got "
                         f"{lengths.tolist()}")
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    rows = np.concatenate([b * tokens + np.arange(n) for b, n in enumerate(lengths)])
    return indptr, rows.astype(np.int64)


@dataclass(frozen=True)
class CacheLayout:
    """The shapes of one layer's cache arrays for a storage, batch and capacity."""

    storage: str
    kv_layout: str
    page_size: int | None
    batch: int
    capacity: int          # tokens per sequence the arrays can hold (>= the one asked for)
    kv_heads: int
    head_dim: int
    scale_mode: str
    scale_dtype: str

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    @property
    def pages_per_sequence(self) -> int:
        return self.capacity // self.page_size if self.paged else 0

    @property
    def num_pages(self) -> int:
        """Pages in each pool: every sequence's, plus one spare where fp16 token scales would
        otherwise leave a pool of an odd element count (the library reads fp16 paged scales
        as aligned 4-byte words, so a layer's pool must not end at the start of one)."""
        if not self.paged:
            return 0
        pages = self.batch * self.pages_per_sequence
        odd = (pages * self.page_size * self.kv_heads) % 2
        return pages + int(odd and self.scale_mode == "token" and self.scale_dtype == "float16")

    @property
    def kv_shape(self) -> tuple:
        """One layer's K (and V) array."""
        h, d = self.kv_heads, self.head_dim
        return {"bnsh": (self.batch, h, self.capacity, d),
                "nhd": (self.num_pages, self.page_size, h, d),
                "hnd": (self.num_pages, h, self.page_size, d)}[self.kv_layout]

    @property
    def scale_shape(self) -> tuple:
        """One layer's K (and V) scales: per token (laid out as the layout's), or static."""
        h = self.kv_heads
        if self.scale_mode != "token":
            return (h,) if self.scale_mode == "head" else (1,)
        return {"bnsh": (self.batch, h, self.capacity),
                "nhd": (self.num_pages, self.page_size, h),
                "hnd": (self.num_pages, h, self.page_size)}[self.kv_layout]


def cache_layout(storage: str, page_size, *, batch: int, capacity: int, kv_heads: int,
                 head_dim: int, scale_mode: str = "token",
                 scale_dtype: str = "float32") -> CacheLayout:
    """The layout of `storage` for `batch` sequences of up to `capacity` tokens; a paged
    capacity is rounded up to whole pages."""
    kv_layout, page_size = storage_options(storage, page_size)
    if page_size is not None:
        capacity = -(-int(capacity) // page_size) * page_size
    return CacheLayout(storage, kv_layout, page_size, int(batch), int(capacity), int(kv_heads),
                       int(head_dim), scale_mode, scale_dtype)


class Int8Cache:
    """Every layer's K/V arrays and scales of a CacheLayout, in torch on `device`: `k`, `v`
    `[L, *kv_shape]` int8, `k_scale`, `v_scale` `[L, *scale_shape]`, and for paged storage
    the block table (`block_table`: int32 `[B, max_pages]` on the device; `host_table` its
    numpy copy; both None when contiguous)."""

    def __init__(self, layout: CacheLayout, num_layers: int, *, device, page_seed: int = 0):
        import torch

        self.layout = layout
        scale_dtype = {"float32": torch.float32, "float16": torch.float16}[layout.scale_dtype]
        self.k = torch.zeros((num_layers, *layout.kv_shape), dtype=torch.int8, device=device)
        self.v = torch.zeros_like(self.k)
        self.k_scale = torch.ones((num_layers, *layout.scale_shape), dtype=scale_dtype,
                                  device=device)
        self.v_scale = torch.ones_like(self.k_scale)
        self.host_table = self.block_table = None
        if layout.paged:
            self.host_table = random_block_table(layout.batch, layout.pages_per_sequence,
                                                 layout.num_pages, page_seed)
            self.block_table = torch.from_numpy(self.host_table).to(device)

    def layer(self, i: int) -> tuple:
        """(k_cache, v_cache, k_scale, v_scale) of layer i, as the library's calls take them."""
        return self.k[i], self.v[i], self.k_scale[i], self.v_scale[i]

    def fill_random(self, generator) -> None:
        """Random valid content (int8 in [-127, 127], scales in [0.005, 0.02]) everywhere,
        pages outside the table included."""
        for cache in (self.k, self.v):
            cache.random_(-127, 128, generator=generator)
        for scale in (self.k_scale, self.v_scale):
            scale.uniform_(0.005, 0.02, generator=generator)

    def contiguous(self, i: int, name: str):
        """Layer i's `name` ("k", "v", "k_scale", "v_scale") as a contiguous-layout tensor
        (`[B, Hkv, S, D]`, token scales `[B, Hkv, S]`): the pages gathered through the table.
        For tests: compare what was written in pages with what a contiguous cache holds."""
        import torch

        array = getattr(self, name)[i]
        lay = self.layout
        if not lay.paged or (name.endswith("scale") and lay.scale_mode != "token"):
            return array
        pages = array[self.block_table.long()]   # [B, pages, *page]
        if lay.kv_layout == "nhd":               # [B, P, ps, H, (D)] -> [B, H, P, ps, (D)]
            pages = pages.movedim(3, 1)
        else:                                    # [B, P, H, ps, (D)] -> [B, H, P, ps, (D)]
            pages = pages.movedim(2, 1)
        b, h = pages.shape[:2]
        return torch.reshape(pages, (b, h, lay.capacity, *pages.shape[4:]))
