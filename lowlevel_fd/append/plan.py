"""AppendPlan: the decode step's fused RoPE + INT8 quantization + cache append, one launch."""
from __future__ import annotations

from typing import Any

from ..core import validate as check
from ..core.spec import KVCacheSpec
from ..driver import Device
from ..driver.stream import StreamLike
from . import bind
from .params import AppendParams
from .runner import KernelRunner, PreparedAppend


class AppendPlan(KernelRunner):
    """Writes one new token per sequence into an INT8 KV cache at position ``seq_lens[b]``:
    rotates k (and q, in place or into ``q_out``) when the spec has RoPE, quantizes k and v
    with the spec's scale mode, and optionally advances ``seq_lens[b]`` on the device.

    ``run`` only validates and launches: no allocation, no synchronisation, capturable in a
    CUDA graph after the first run (or ``load()``). A position outside ``[0, S_max)`` is never
    written; the kernel sets ERROR_OUTSIDE_CACHE and leaves that sequence (and its q and
    length) untouched.

    RoPE angles come from a caller's fp32 ``cos_sin`` table (one load: the fast path) or from
    ``rope_theta``: inv_freq = theta^(-2i/D) rounded to fp32, angle = pos * inv_freq in fp32,
    (cos, sin) within one fp32 ulp. That is as accurate as fp32 allows, not bit-equal to a
    float64 reference: the tests compare it with a tolerance.
    """

    _kernel_index = 0

    def __init__(self, cache: KVCacheSpec, num_q_heads: int, *, max_batch: int,
                 dtype: str = "float16", device: Device | None = None) -> None:
        super().__init__(cache, max_batch=max_batch, dtype=dtype, device=device)
        self.group_size = self.cache.group_size(num_q_heads)
        self.num_q_heads = int(num_q_heads)

    @classmethod
    def create(cls, num_q_heads: int, num_kv_heads: int, head_dim: int, *, max_batch: int,
               dtype: str = "float16", kv_layout: str = "bnsh", scale_mode: str = "token",
               scale_dtype: str = "float32", rope: str | None = None,
               rope_theta: float = 10000.0, page_size: int | None = None,
               key_transform: str = "none",
               device: Device | None = None) -> "AppendPlan":
        """The keyword form: builds the KVCacheSpec from the cache options."""
        spec = KVCacheSpec(num_kv_heads, head_dim, kv_layout, scale_mode, scale_dtype, rope,
                           rope_theta, page_size=page_size, key_transform=key_transform)
        return cls(spec, num_q_heads, max_batch=max_batch, dtype=dtype, device=device)

    def run(self, k_new: Any, v_new: Any, k_cache: Any, v_cache: Any, k_scale: Any,
            v_scale: Any, seq_lens: Any, *, q: Any = None, q_out: Any = None,
            cos_sin: Any = None, advance: bool = False, host_seq_lens: Any = None,
            block_table: Any = None, stream: StreamLike) -> None:
        """Append ``k_new``/``v_new`` (``[B, Hkv, D]`` fp16/bf16) at ``seq_lens[b]`` (int32
        ``[B]`` on the device: the tokens cached so far) of the int8 caches and their scales
        (see DecodePlan.run).

        q: ``[B, Hq, D]`` rotated in place (or into ``q_out``, which must equal q or not
        overlap it), RoPE specs only. cos_sin: fp32 ``[max_pos >= S_max, D/2, 2]``; without it
        the angles come from ``rope_theta``. advance: ``seq_lens[b] += 1`` on the device.
        host_seq_lens: the host's copy of the lengths, if it has one: checked against the
        capacity before launching. block_table: int32 ``[B, max_pages]`` on the device for a
        paged spec (the token goes to page ``block_table[b][pos // page_size]``, slot
        ``pos % page_size``; a page id outside the pool writes nothing and sets
        ERROR_BAD_PAGE). Enqueued on ``stream``; returns at once.
        """
        self._require_open()
        grid = self._bind(self._params, k_new, v_new, k_cache, v_cache, k_scale, v_scale,
                          seq_lens, q, q_out, cos_sin, advance, host_seq_lens, block_table)
        if grid[0]:
            self._launch(grid, stream)

    def prepare_run(self, k_new: Any, v_new: Any, k_cache: Any, v_cache: Any, k_scale: Any,
                    v_scale: Any, seq_lens: Any, *, q: Any = None, q_out: Any = None,
                    cos_sin: Any = None, advance: bool = False,
                    host_seq_lens: Any = None, block_table: Any = None) -> PreparedAppend:
        """``run``'s arguments, validated once: ``launch(stream)`` on the result issues the
        same launch with no further checks. Loads the kernel (so the call can be captured)."""
        self.load()
        params = AppendParams.from_buffer_copy(self._params)
        grid = self._bind(params, k_new, v_new, k_cache, v_cache, k_scale, v_scale, seq_lens,
                          q, q_out, cos_sin, advance, host_seq_lens, block_table)
        return PreparedAppend(self, params, grid)

    def _bind(self, p: AppendParams, k_new: Any, v_new: Any, k_cache: Any, v_cache: Any,
              k_scale: Any, v_scale: Any, seq_lens: Any, q: Any, q_out: Any, cos_sin: Any,
              advance: Any, host_seq_lens: Any, block_table: Any) -> tuple[int]:
        """Check everything, then write it into ``p``; the launch grid."""
        k = bind.token_rows("k_new", k_new, self, self.num_kv_heads, "[B, Hkv, D]")
        batch = bind.batch_size("k_new", k, self.max_batch)
        v = bind.token_rows("v_new", v_new, self, self.num_kv_heads, "[B, Hkv, D]", batch)
        arrays, capacity, table = bind.caches(self, k_cache, v_cache, k_scale, v_scale, batch,
                                              cos_sin, block_table)
        lengths = check.device_lengths("seq_lens", seq_lens, self.device, batch)
        q_ptr, q_out_ptr, q_strides = bind.query(self, self.num_q_heads, q, q_out, batch)
        check.flag("advance", advance)
        check.host_within("host_seq_lens", host_seq_lens, batch, capacity - 1,
                          f"the new token must land below the cache capacity S_max={capacity}")
        item = k.itemsize
        p.k_new, p.v_new = k.ptr, v.ptr
        p.k_batch_stride, p.k_head_stride = k.strides[0] // item, k.strides[1] // item
        p.v_batch_stride, p.v_head_stride = v.strides[0] // item, v.strides[1] // item
        p.k_token_stride = p.v_token_stride = 0
        bind.write_caches(p, self, arrays, table)
        p.seq_lens, p.seq_lens_out = lengths.ptr, 0
        p.q, p.q_out = q_ptr, q_out_ptr
        (p.q_batch_stride, p.q_head_stride, p.q_out_batch_stride,
         p.q_out_head_stride) = q_strides
        p.num_q_heads = self.num_q_heads if q_ptr else 0
        p.prompt_tokens, p.advance = 0, int(advance)
        return (batch,)
