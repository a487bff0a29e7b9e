"""What the benchmark runs: workloads, the bytes they must move, the default sweep, the layer
count that keeps a timing L2-honest, and the command-line flags that select workloads.

CPU-only: nothing here touches the GPU, so ``--dry-run`` and the tests can use all of it.
"""
from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import asdict, dataclass

import numpy as np

from .pages import PAGE_ORDERS, PageSlot

MIB = 2**20
GIB = 2**30
# H100's L2 is 50 MiB: a step that touches 4x that cannot be served from L2 across replays.
L2_HONEST_BYTES = 200 * MIB
MAX_LAYERS = 64
# Two layers even when one already exceeds 200 MiB, so replays never re-read a cache that
# the previous replay just streamed (its tail could still sit in L2).
MIN_LAYERS = 2
MEMORY_CAP_BYTES = 40 * GIB

DEFAULT_SHAPES = ((1, 1024), (1, 2048), (1, 8192), (1, 32768), (8, 4096), (32, 4096),
                  (64, 8192), (128, 2048))
LAYOUTS = ("bnsh", "bsnh")
PAGED_LAYOUTS = ("nhd", "hnd")  # with --page-size: pools of pages and a block table
# Flag spelling -> (scale_mode, scale_dtype). "token" alone means fp32 token scales.
SCALE_MODES = {"tensor": ("tensor", "float32"), "head": ("head", "float32"),
               "token-fp32": ("token", "float32"), "token-fp16": ("token", "float16"),
               "token": ("token", "float32")}
MODE_NAMES = ("tensor", "head", "token-fp32", "token-fp16")
Q_DTYPES = {"fp16": "float16", "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
_MODE_LABEL = {("tensor", "float32"): "tensor", ("head", "float32"): "head",
               ("token", "float32"): "tok-f32", ("token", "float16"): "tok-f16"}


@dataclass(frozen=True)
class Workload:
    """One decode step of one layer: B sequences of up to S tokens, GQA heads Hq/Hkv."""

    batch: int
    seq_len: int
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    kv_layout: str = "bnsh"
    scale_mode: str = "token"
    scale_dtype: str = "float32"
    q_dtype: str = "float16"
    ragged: bool = False
    page_size: int = 0  # 0: a contiguous cache; else pages (kv_layout nhd or hnd)
    page_order: str = "random"  # physical page order: benchlib.pages.PAGE_ORDERS
    page_slot: bool = False  # a page's K, V and token scales in one slot (benchlib.pages.PageSlot)

    @property
    def pages_per_seq(self) -> int:
        return -(-self.seq_len // self.page_size)

    @property
    def num_pages(self) -> int:
        return self.batch * self.pages_per_seq

    def seq_lens(self) -> np.ndarray:
        """Host lengths [B] int64: all S, or (ragged) uniform in [S/2, S] with row 0 at S."""
        lengths = np.full(self.batch, self.seq_len, dtype=np.int64)
        if self.ragged:
            rng = np.random.default_rng(self.batch * 1_000_003 + self.seq_len)
            lengths = rng.integers(max(1, self.seq_len // 2), self.seq_len + 1, self.batch)
            lengths[0] = self.seq_len  # the longest row fixes the plan's split count
        return lengths

    @property
    def live_tokens(self) -> int:
        return int(self.seq_lens().sum())

    @property
    def cache_shape(self) -> tuple[int, int, int, int]:
        B, S, H, D = self.batch, self.seq_len, self.num_kv_heads, self.head_dim
        if self.page_size:
            N, P = self.num_pages, self.page_size
            return (N, P, H, D) if self.kv_layout == "nhd" else (N, H, P, D)
        return (B, H, S, D) if self.kv_layout == "bnsh" else (B, S, H, D)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        if self.scale_mode == "token" and self.page_size:
            N, P, H = self.num_pages, self.page_size, self.num_kv_heads
            return (N, P, H) if self.kv_layout == "nhd" else (N, H, P)
        if self.scale_mode == "token":
            return (self.batch, self.num_kv_heads, self.seq_len)
        return (1,) if self.scale_mode == "tensor" else (self.num_kv_heads,)

    # -- bytes ----------------------------------------------------------------------------------
    @property
    def kv_bytes(self) -> int:
        """K + V int8 bytes the kernel must read: live tokens only."""
        return self.live_tokens * self.num_kv_heads * self.head_dim * 2

    @property
    def scale_bytes(self) -> int:
        """K + V scale bytes read: per live token, or the small per-tensor/per-head arrays."""
        if self.scale_mode == "token":
            return self.live_tokens * self.num_kv_heads * 2 * _ITEMSIZE[self.scale_dtype]
        return 2 * int(np.prod(self.scale_shape)) * 4

    @property
    def q_out_bytes(self) -> int:
        return 2 * self.batch * self.num_q_heads * self.head_dim * _ITEMSIZE[self.q_dtype]

    @property
    def bytes_per_layer(self) -> int:
        """The compulsory traffic of one layer: what a perfect kernel reads and writes."""
        return self.kv_bytes + self.scale_bytes + self.q_out_bytes

    @property
    def footprint_per_layer(self) -> int:
        """Device memory one layer allocates (full-capacity caches and scales, q, out)."""
        if self.page_slot:
            return self.num_pages * self.slot().nbytes + self.q_out_bytes
        cache = 2 * int(np.prod(self.cache_shape))
        scales = 2 * int(np.prod(self.scale_shape)) * (
            _ITEMSIZE[self.scale_dtype] if self.scale_mode == "token" else 4)
        return cache + scales + self.q_out_bytes

    @property
    def baseline_bytes_per_layer(self) -> int:
        """What SDPA moves with a 16-bit cache at full length S: 2x the int8 KV bytes."""
        kv = self.batch * self.num_kv_heads * self.seq_len * self.head_dim * 2 * 2
        return kv + self.q_out_bytes

    def slot(self) -> PageSlot:
        """The layout of a page slot (``page_slot`` workloads: paged, per-token scales)."""
        if not (self.page_slot and self.page_size and self.scale_mode == "token"):
            raise ValueError(f"page_slot: needs pages and per-token scales, got {self.label}")
        return PageSlot(self.kv_layout, self.page_size, self.num_kv_heads, self.head_dim,
                        _ITEMSIZE[self.scale_dtype])

    # -- labels ---------------------------------------------------------------------------------
    @property
    def mode_label(self) -> str:
        return _MODE_LABEL[(self.scale_mode, self.scale_dtype)]

    @property
    def q_label(self) -> str:
        return "fp16" if self.q_dtype == "float16" else "bf16"

    @property
    def label(self) -> str:
        return (f"B={self.batch} S={self.seq_len} H={self.num_q_heads}/{self.num_kv_heads} "
                f"D={self.head_dim} {self.kv_layout} {self.mode_label} {self.q_label}"
                + (f" page {self.page_size}" if self.page_size else "")
                + (f" {self.page_order}" if self.page_size and self.page_order != "random"
                   else "")
                + (" slot" if self.page_slot else "")
                + (" ragged" if self.ragged else ""))

    def as_dict(self) -> dict:
        return {**asdict(self), "label": self.label, "mode_label": self.mode_label,
                "q_label": self.q_label, "kv_bytes": self.kv_bytes, "scale_bytes": self.scale_bytes,
                "q_out_bytes": self.q_out_bytes, "bytes_per_layer": self.bytes_per_layer,
                "footprint_per_layer": self.footprint_per_layer}


def layer_count(bytes_per_layer: int, footprint_per_layer: int | None = None,
                override: int | None = None, memory_cap: int = MEMORY_CAP_BYTES) -> int:
    """Layers L with distinct caches: the fewest with L x bytes >= 200 MiB, at least 2 and
    at most 64, and never more than ``memory_cap`` of allocations (``override`` wins over
    the 200 MiB rule but not over the memory cap)."""
    footprint = footprint_per_layer or bytes_per_layer
    fits = max(1, memory_cap // max(footprint, 1))
    if override is not None:
        return max(1, min(override, fits))
    wanted = max(math.ceil(L2_HONEST_BYTES / max(bytes_per_layer, 1)), MIN_LAYERS)
    return max(1, min(wanted, MAX_LAYERS, fits))


def is_l2_honest(num_layers: int, bytes_per_layer: int) -> bool:
    return num_layers * bytes_per_layer >= L2_HONEST_BYTES


def default_sweep() -> list[Workload]:
    """The issue's sweep: 8 shapes at Hq/Hkv = 32/8, Hkv = 1 (group 16: 32 is unsupported),
    and every layout x scale mode at B=8, S=4096."""
    sweep = [Workload(b, s) for b, s in DEFAULT_SHAPES]
    sweep.append(Workload(32, 4096, num_q_heads=16, num_kv_heads=1))
    for layout, mode in itertools.product(LAYOUTS, MODE_NAMES):
        scale_mode, scale_dtype = SCALE_MODES[mode]
        extra = Workload(8, 4096, kv_layout=layout, scale_mode=scale_mode,
                         scale_dtype=scale_dtype)
        if extra not in sweep:
            sweep.append(extra)
    return sweep


# -- flags ------------------------------------------------------------------------------------
def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'B,S;B,S' -> [(B, S), ...]."""
    shapes = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        try:
            batch, seq_len = (int(x) for x in item.split(","))
        except ValueError:
            raise ValueError(f"--shapes: expected 'B,S;B,S' (e.g. '1,1024;8,4096'), "
                             f"got {item!r}") from None
        if batch < 1 or seq_len < 1:
            raise ValueError(f"--shapes: B and S must be >= 1, got {item!r}")
        shapes.append((batch, seq_len))
    if not shapes:
        raise ValueError("--shapes: expected at least one 'B,S'")
    return shapes


def parse_heads(text: str) -> tuple[int, int]:
    """'Hq,Hkv' -> (Hq, Hkv) with Hq a multiple of Hkv."""
    try:
        num_q_heads, num_kv_heads = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--heads: expected 'Hq,Hkv' (e.g. '32,8'), got {text!r}") from None
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"--heads: Hq must be a multiple of Hkv >= 1, got {text!r}")
    return num_q_heads, num_kv_heads


def parse_choices(flag: str, text: str, spellings: dict, canonical: tuple[str, ...]) -> list:
    """A comma list of ``spellings`` keys, or 'all' (= ``canonical``), as distinct values."""
    names = list(canonical) if text.strip() == "all" else [
        t.strip() for t in text.split(",") if t.strip()]
    if not names or any(n not in spellings for n in names):
        raise ValueError(f"{flag}: expected a comma list of {list(canonical)} or 'all', "
                         f"got {text!r}")
    return list(dict.fromkeys(spellings[n] for n in names))


CUSTOM_FLAGS = ("shapes", "heads", "head_dim", "layout", "scale_mode", "q_dtype", "ragged",
                "page_size")


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that pick workloads; shared by bench.py and tune.py."""
    group = parser.add_argument_group(
        "workloads", "Without any of these the default sweep runs. With any, the sweep is the "
        "product of the given values (defaults: the default shapes, 32,8 heads, D=128, bnsh, "
        "token-fp32, fp16).")
    group.add_argument("--shapes", help="'B,S;B,S;...' e.g. '1,1024;8,4096'")
    group.add_argument("--heads", help="'Hq,Hkv;Hq,Hkv;...' (default 32,8), e.g. "
                                       "'24,8;32,8' for groups 3 and 4")
    group.add_argument("--head-dim", type=int, help="64, 128 or 256 (default 128)")
    group.add_argument("--layout", help="comma list of bnsh,bsnh (contiguous) or nhd,hnd "
                                        "(paged, with --page-size) or 'all'")
    group.add_argument("--page-size", help="comma list of page sizes (powers of two 1..256; "
                                           "0: contiguous): paged caches in the nhd/hnd "
                                           "layouts (default nhd)")
    group.add_argument("--page-order", choices=PAGE_ORDERS, default="random",
                       help="physical order of the pages (default random: fragmented; "
                            "benchlib.pages.page_ids)")
    group.add_argument("--page-slot", action="store_true",
                       help="paged rows keep each page's K rows, V rows and token scales in "
                            "one slot of one allocation (benchlib.pages.PageSlot) instead of "
                            "four pools")
    group.add_argument("--scale-mode", help="comma list of tensor,head,token-fp32,token-fp16 "
                                            "(token = token-fp32) or 'all'")
    group.add_argument("--q-dtype", help="comma list of fp16,bf16 or 'all'")
    group.add_argument("--ragged", action="store_true",
                       help="lengths uniform in [S/2, S] (row 0 at S) instead of all S")


def workloads_from_args(args: argparse.Namespace,
                        default: list[Workload] | None = None) -> list[Workload]:
    """The sweep the flags ask for; ``default`` (else ``default_sweep()``) when none is given.
    Raises ValueError with the flag's name on a malformed value."""
    if not any(getattr(args, name, None) for name in CUSTOM_FLAGS):
        return list(default if default is not None else default_sweep())
    shapes = parse_shapes(args.shapes) if args.shapes else list(DEFAULT_SHAPES)
    head_pairs = ([parse_heads(text) for text in args.heads.split(";") if text.strip()]
                  if args.heads else [(32, 8)])
    head_dim = args.head_dim or 128
    page_sizes = [0]
    if getattr(args, "page_size", None):
        try:
            page_sizes = [int(x) for x in args.page_size.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--page-size: expected a comma list of ints, got "
                             f"{args.page_size!r}") from None
        if not page_sizes or any(p < 0 or p > 256 or p & (p - 1) for p in page_sizes):
            raise ValueError(f"--page-size: expected powers of two 1..256 (0: contiguous), got "
                             f"{args.page_size!r}")
    known = LAYOUTS + PAGED_LAYOUTS
    default = ",".join(dict.fromkeys("nhd" if p else "bnsh" for p in page_sizes))
    layouts = parse_choices("--layout", args.layout or default, {x: x for x in known}, known)
    modes = parse_choices("--scale-mode", args.scale_mode or "token-fp32", SCALE_MODES,
                          MODE_NAMES)
    q_dtypes = parse_choices("--q-dtype", args.q_dtype or "fp16", Q_DTYPES, ("fp16", "bf16"))
    order = getattr(args, "page_order", None) or "random"
    slot = bool(getattr(args, "page_slot", False))
    sweep = [Workload(b, s, num_q_heads, num_kv_heads, head_dim, layout, mode, scale_dtype, q,
                      bool(args.ragged), page, order, slot and page > 0 and mode == "token")
             for (b, s), (num_q_heads, num_kv_heads), layout, (mode, scale_dtype), q, page
             in itertools.product(shapes, head_pairs, layouts, modes, q_dtypes, page_sizes)
             if (layout in PAGED_LAYOUTS) == (page > 0)]  # paged layouts with page sizes only
    return list(dict.fromkeys(sweep))  # a shape given twice runs once


def parse_config(text: str):
    """'num_warps,num_splits,min_split_tokens,fused[,stages[,cluster[,pdl]]]' -> TileConfig
    (booleans 1/0/true/false; stages 0 = the head_dim's default)."""
    from lowlevel_fd.core.support import WARP_COUNTS
    from lowlevel_fd.decode.planner import MAX_SPLITS, TileConfig, check_config
    flags = {"1": True, "true": True, "0": False, "false": False}
    parts = [p.strip().lower() for p in text.split(",")]
    try:
        if not 4 <= len(parts) <= 7:
            raise ValueError
        warps, splits, min_tokens = (int(p) for p in parts[:3])
        fused = flags[parts[3]]
        extra: dict = {"stages": int(parts[4])} if len(parts) >= 5 else {}
        if len(parts) >= 6:
            extra["cluster"] = flags[parts[5]]
        if len(parts) == 7:
            extra["programmatic"] = flags[parts[6]]
    except (ValueError, KeyError):
        raise ValueError(f"--config: expected 'num_warps,num_splits,min_split_tokens,fused"
                         f"[,stages[,cluster[,pdl]]]' (e.g. '4,16,128,1'), got {text!r}") from None
    if warps not in WARP_COUNTS or not 1 <= splits <= MAX_SPLITS or min_tokens < 16 \
            or min_tokens % 16 or extra.get("stages", 0) < 0:
        raise ValueError(f"--config: need num_warps in {WARP_COUNTS}, 1 <= num_splits <= "
                         f"{MAX_SPLITS}, min_split_tokens a positive multiple of 16, "
                         f"stages >= 0; got {text!r}")
    config = TileConfig(num_warps=warps, num_splits=splits, min_split_tokens=min_tokens,
                        fused_merge=fused, **extra)
    try:  # what plan() would reject later: stages 1, a cluster of more than 16 splits
        return check_config(config)
    except ValueError as exc:
        raise ValueError(f"--config: {exc}; got {text!r}") from None
