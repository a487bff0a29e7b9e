"""KVCacheSpec: what an INT8 KV cache is, validated once and shared by every plan over it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import support
from . import validate as check


@dataclass(frozen=True)
class KVCacheSpec:
    """The cache that a model's plans read and write: ``num_kv_heads`` KV heads of ``head_dim``
    int8 values per token, stored as ``kv_layout``: contiguous per sequence (``"bnsh"`` =
    ``[B, Hkv, S_max, D]``, ``"bsnh"`` = ``[B, S_max, Hkv, D]``) or in pages of ``page_size``
    tokens that a block table assigns to sequences (``"nhd"`` = ``[num_pages, page_size, Hkv,
    D]``, ``"hnd"`` = ``[num_pages, Hkv, page_size, D]``), dequantized as ``int8 * scale``
    with one fp32 scale per tensor (``scale_mode="tensor"``), per KV head (``"head"``) or an
    fp32/fp16 scale per token and KV head (``"token"``, ``scale_dtype``), and, when ``rope``
    is ``"neox"`` or ``"gptj"``, keys stored rotated by RoPE with base ``rope_theta``.
    ``key_transform="hadamard"`` stores every key as ``H @ RoPE(k)`` (H the normalized
    Sylvester-Hadamard matrix of order D, ``lowlevel_fd.hadamard``) before quantizing it: the
    scores are unchanged when q is transformed alike, and the per-token INT8 error drops
    because H spreads a key's outlier channels over the whole row. Kernels that rotate q
    transform it too; a q passed already rotated must be passed as ``H @ RoPE(q)``.

    Every field is checked here, once; a plan built on the spec checks only its own options.
    """

    num_kv_heads: int
    head_dim: int
    kv_layout: str = "bnsh"
    scale_mode: str = "token"
    scale_dtype: str = "float32"
    rope: str | None = None
    rope_theta: float = 10000.0
    cache_dtype: str = "int8"
    page_size: int | None = None  # paged layouts: tokens per page, a power of two 1..256
    key_transform: str = "none"   # "hadamard": keys stored as H @ RoPE(k)

    def __post_init__(self) -> None:
        num_kv_heads = check.positive("num_kv_heads", self.num_kv_heads)
        head_dim = check.integer("head_dim", self.head_dim)
        check.choice("head_dim", head_dim, support.HEAD_DIMS)
        check.choice("kv_layout", self.kv_layout, support.KV_LAYOUTS)
        check.choice("scale_mode", self.scale_mode, support.SCALE_MODES)
        scale_dtype = check.dtype_option("scale_dtype", self.scale_dtype,
                                         support.SCALE_DTYPES[self.scale_mode])
        cache_dtype = check.dtype_option("cache_dtype", self.cache_dtype, support.CACHE_DTYPES)
        check.choice("rope", self.rope, support.ROPE_STYLES)
        check.choice("key_transform", self.key_transform, support.KEY_TRANSFORMS)
        theta = check.real("rope_theta", self.rope_theta)
        if not theta > 1.0:
            raise ValueError(f"rope_theta: expected a finite base > 1, got {self.rope_theta!r}")
        page_size = self.page_size
        if self.kv_layout in support.PAGED_LAYOUTS:
            if page_size is None:
                raise ValueError(f"page_size: kv_layout='{self.kv_layout}' is paged; expected "
                                 f"a page size in {list(support.PAGE_SIZES)}, got None")
            page_size = check.integer("page_size", page_size)
            check.choice("page_size", page_size, support.PAGE_SIZES)
        elif page_size is not None:
            raise ValueError(f"page_size: kv_layout='{self.kv_layout}' is contiguous; expected "
                             f"None (or a paged layout {list(support.PAGED_LAYOUTS)}), got "
                             f"{page_size!r}")
        object.__setattr__(self, "page_size", page_size)
        for name, value in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("scale_dtype", scale_dtype), ("cache_dtype", cache_dtype),
                            ("rope_theta", theta)):
            object.__setattr__(self, name, value)  # normalised: plain ints, floats and names

    @property
    def paged(self) -> bool:
        """The cache lives in pages (``block_table`` arguments say which)."""
        return self.page_size is not None

    @property
    def token_scales(self) -> bool:
        """Scales per token and KV head: arrays ``[B, Hkv, S_max]`` the appends write."""
        return self.scale_mode == "token"

    @property
    def scale_storage(self) -> str:
        """The C++ type of one stored scale (kernel template argument)."""
        return support.scale_storage(self.scale_mode, self.scale_dtype)

    def group_size(self, num_q_heads: Any) -> int:
        """Query heads per KV head for ``num_q_heads``, checked against the support matrix."""
        num_q_heads = check.positive("num_q_heads", num_q_heads)
        if num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads: expected a multiple of num_kv_heads="
                             f"{self.num_kv_heads}, got {num_q_heads}")
        group = num_q_heads // self.num_kv_heads
        if group > support.MAX_GROUP:
            raise ValueError(f"group size (num_q_heads // num_kv_heads): expected 1.."
                             f"{support.MAX_GROUP}, got {group}")
        return group


class OnCache:
    """A plan over a KVCacheSpec (``self.cache``): the cache's shape, named as the plans' own."""

    cache: KVCacheSpec

    @property
    def num_kv_heads(self) -> int:
        return self.cache.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.cache.head_dim


class CreatedFromOptions:
    """The keyword form of the attention plans' constructors (DecodePlan, MultiPlan): the
    cache's options in place of a KVCacheSpec."""

    @classmethod
    def create(cls, num_q_heads: int, num_kv_heads: int, head_dim: int, *, max_batch: int,
               max_seq_len: int, dtype: str = "float16", kv_layout: str = "bnsh",
               scale_mode: str = "token", scale_dtype: str = "float32",
               rope: str | None = None, rope_theta: float = 10000.0,
               page_size: int | None = None, key_transform: str = "none",
               sm_scale: float | None = None, device: Any = None,
               allow_int8_q: bool = False) -> Any:
        """The keyword form: builds the KVCacheSpec from the cache options."""
        spec = KVCacheSpec(num_kv_heads, head_dim, kv_layout, scale_mode, scale_dtype, rope,
                           rope_theta, page_size=page_size, key_transform=key_transform)
        return cls(spec, num_q_heads, max_batch=max_batch,  # type: ignore[call-arg]
                   max_seq_len=max_seq_len, dtype=dtype, sm_scale=sm_scale, device=device,
                   allow_int8_q=allow_int8_q)


def cache_spec(cache: Any) -> KVCacheSpec:
    """A plan's ``cache`` argument: a KVCacheSpec (TypeError otherwise)."""
    if not isinstance(cache, KVCacheSpec):
        raise TypeError(f"cache: expected a KVCacheSpec, got {type(cache).__name__} {cache!r}")
    return cache
