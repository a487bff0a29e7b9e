"""AppendPlan: the decode step's fused RoPE + INT8 quantization + cache append, one launch."""
from __future__ import annotations

from typing import Any

from ..decode import validate as check
from ..driver import Device
from ..driver.stream import StreamLike
from . import bind
from .runner import KernelRunner

MAX_GROUP_SIZE = 16


class AppendPlan(KernelRunner):
    """Writes one new token per sequence into an INT8 KV cache at position ``seq_lens[b]``:
    rotates k (and q, in place or into ``q_out``) when ``rope`` is set, quantizes k and v with
    the plan's scale mode, and optionally advances ``seq_lens[b]`` on the device.

    ``run`` only validates and launches: no allocation, no synchronisation, capturable in a
    CUDA graph after the first run (or ``load()``). A position outside ``[0, S_max)`` is never
    written; the kernel sets bit 0 of ``error_flags()`` and leaves that sequence (and its q and
    length) untouched.

    RoPE angles come from a caller's fp32 ``cos_sin`` table (one load: the fast path) or from
    ``rope_theta``: inv_freq = theta^(-2i/D) rounded to fp32, angle = pos * inv_freq in fp32,
    evaluated with the accurate ``sincosf``. That is as accurate as fp32 allows, not bit-equal
    to a float64 reference: the tests compare it with a tolerance.
    """

    _kernel_index = 0

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, *, max_batch: int,
                 kv_layout: str = "bnsh", scale_mode: str = "token",
                 scale_dtype: str = "float32", dtype: str = "float16", rope: str | None = None,
                 rope_theta: float = 10000.0, device: Device | None = None) -> None:
        num_kv_heads = check.integer("num_kv_heads", num_kv_heads)
        num_q_heads = check.integer("num_q_heads", num_q_heads)
        if num_kv_heads < 1:
            raise ValueError(f"num_kv_heads: expected a positive int, got {num_kv_heads!r}")
        if num_q_heads < 1 or num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads: expected a positive multiple of num_kv_heads="
                             f"{num_kv_heads}, got {num_q_heads!r}")
        check.choice("group size (num_q_heads // num_kv_heads)", num_q_heads // num_kv_heads,
                     range(1, MAX_GROUP_SIZE + 1))
        super().__init__(num_kv_heads, head_dim, max_batch=max_batch, kv_layout=kv_layout,
                         scale_mode=scale_mode, scale_dtype=scale_dtype, dtype=dtype, rope=rope,
                         rope_theta=rope_theta, device=device)
        self.num_q_heads = num_q_heads

    def run(self, k_new: Any, v_new: Any, k_cache: Any, v_cache: Any, k_scale: Any,
            v_scale: Any, seq_lens: Any, *, q: Any = None, q_out: Any = None,
            cos_sin: Any = None, advance: bool = False, host_seq_lens: Any = None,
            stream: StreamLike) -> None:
        """Append ``k_new``/``v_new`` (``[B, Hkv, D]`` fp16/bf16) at ``seq_lens[b]`` (int32
        ``[B]`` on the device) of the int8 caches and their scales (see DecodePlan.run).

        q: ``[B, Hq, D]`` rotated in place (or into ``q_out``, which must equal q or not
        overlap it), RoPE plans only. cos_sin: fp32
        ``[max_pos >= S_max, D/2, 2]``; without it the angles come from ``rope_theta``.
        advance: ``seq_lens[b] += 1`` on the device. host_seq_lens: the host's copy of the
        lengths, if it has one: checked against the capacity before launching. Enqueued on
        ``stream``; returns at once.
        """
        self._require_open()
        p = self._params
        k = bind.token_rows("k_new", k_new, self, self.num_kv_heads, "[B, Hkv, D]")
        batch = bind.batch_size("k_new", k, self.max_batch)
        v = bind.token_rows("v_new", v_new, self, self.num_kv_heads, "[B, Hkv, D]", batch)
        kc, vc, capacity, strides = bind.caches(self, k_cache, v_cache, batch)
        ks, vs = bind.scales(self, k_scale, v_scale, batch, capacity)
        lengths = bind.lengths("seq_lens", seq_lens, self, batch)
        q_ptr, q_out_ptr, q_strides = self._query(q, q_out, batch)
        table = bind.rope_table(self, cos_sin, capacity)
        check.flag("advance", advance)
        bind.host_positions("host_seq_lens", host_seq_lens, batch, capacity - 1,
                            f"the new token must land below the cache capacity S_max="
                            f"{capacity}")
        if batch == 0:
            return

        item = k.itemsize
        p.k_new, p.v_new = k.ptr, v.ptr
        p.k_batch_stride, p.k_head_stride = k.strides[0] // item, k.strides[1] // item
        p.v_batch_stride, p.v_head_stride = v.strides[0] // item, v.strides[1] // item
        p.k_token_stride = p.v_token_stride = 0
        bind.kv_fields(p, kc, vc, ks, vs, capacity, strides, self.scale_mode)
        p.seq_lens, p.seq_lens_out, p.cos_sin = lengths.ptr, 0, table
        p.q, p.q_out = q_ptr, q_out_ptr
        (p.q_batch_stride, p.q_head_stride, p.q_out_batch_stride,
         p.q_out_head_stride) = q_strides
        p.num_q_heads = self.num_q_heads if q_ptr else 0
        p.prompt_tokens, p.advance = 0, int(advance)
        self._launch((batch,), stream)

    def _query(self, q: Any, q_out: Any, batch: int) -> tuple[int, int, tuple[int, ...]]:
        """(q, q_out addresses, their element strides); q_out defaults to q (in place)."""
        if q is None:
            if q_out is not None:
                raise ValueError("q_out: given without q; pass the q to rotate")
            return 0, 0, (0, 0, 0, 0)
        if self.rope is None:
            raise ValueError("q: the plan applies no RoPE (rope=None), so there is nothing to "
                             "do to q; drop it or construct the plan with rope='neox'/'gptj'")
        labels = "[B, Hq, D]"
        query = bind.token_rows("q", q, self, self.num_q_heads, labels, batch)
        out = query
        if q_out is not None:
            out = bind.token_rows("q_out", q_out, self, self.num_q_heads, labels, batch)
            check.same_or_disjoint("q_out", out, "q", query)
        check.no_internal_overlap("q" if q_out is None else "q_out", out)  # the rotated rows
        item = query.itemsize
        return query.ptr, out.ptr, (query.strides[0] // item, query.strides[1] // item,
                                    out.strides[0] // item, out.strides[1] // item)
