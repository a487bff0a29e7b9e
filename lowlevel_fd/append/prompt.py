"""Prompt quantization: a whole prompt's K/V written into the INT8 cache in one launch."""
from __future__ import annotations

from typing import Any

from ..decode import validate as check
from ..driver import Device, DeviceArray
from ..driver.stream import StreamLike
from . import bind
from .runner import KernelRunner
from .variants import DTYPES, PROMPT_TOKENS_PER_CTA, TOKEN_SCALE_DTYPES

MAX_GRID_Y = 65535  # the batch is grid.y


class PromptQuantizer(KernelRunner):
    """Writes positions ``0..prompt_lens[b]-1`` of every sequence: K rotated by RoPE (positions
    0..len-1) when ``rope`` is set, K and V quantized with the scale mode (per-token scales
    computed in the kernel, per-head/per-tensor given). Lengths are read on the device; a length
    above S_max is clamped (bit 0 of ``error_flags()``), one above the prompt's S too (bit 1).
    """

    _kernel_index = 1

    def __init__(self, num_kv_heads: int, head_dim: int, *, max_batch: int,
                 kv_layout: str = "bnsh", prompt_layout: str = "bsnh",
                 scale_mode: str = "token", scale_dtype: str = "float32",
                 dtype: str = "float16", rope: str | None = None, rope_theta: float = 10000.0,
                 device: Device | None = None) -> None:
        check.choice("prompt_layout", prompt_layout, ("bsnh", "bnsh"))
        max_batch = check.integer("max_batch", max_batch)
        if max_batch > MAX_GRID_Y:
            raise ValueError(f"max_batch: expected at most {MAX_GRID_Y} (grid.y), got "
                             f"{max_batch}")
        super().__init__(num_kv_heads, head_dim, max_batch=max_batch, kv_layout=kv_layout,
                         scale_mode=scale_mode, scale_dtype=scale_dtype, dtype=dtype, rope=rope,
                         rope_theta=rope_theta, device=device)
        self.prompt_layout = prompt_layout

    def run(self, k: Any, v: Any, k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any,
            prompt_lens: Any, *, seq_lens_out: Any = None, cos_sin: Any = None,
            host_prompt_lens: Any = None, stream: StreamLike) -> None:
        """Quantize ``k``/``v`` (fp16/bf16 ``[B, S, Hkv, D]`` for prompt_layout 'bsnh',
        ``[B, Hkv, S, D]`` for 'bnsh') into the caches at positions ``0..prompt_lens[b]-1``
        (int32 ``[B]`` on the device). seq_lens_out: int32 ``[B]`` that receives the lengths
        written (may be prompt_lens itself). host_prompt_lens: the host's copy, if any, checked
        against S and S_max before launching. Enqueued on ``stream``; returns at once.
        """
        self._require_open()
        p = self._params
        k_rows = self._prompt("k", k, None)
        batch, tokens = k_rows.shape[0], k_rows.shape[self._token_axis]
        bind.batch_size("k", k_rows, self.max_batch)
        v_rows = self._prompt("v", v, (batch, tokens))
        kc, vc, capacity, strides = bind.caches(self, k_cache, v_cache, batch)
        ks, vs = bind.scales(self, k_scale, v_scale, batch, capacity)
        lengths = bind.lengths("prompt_lens", prompt_lens, self, batch)
        out = 0
        if seq_lens_out is not None:
            out = bind.lengths("seq_lens_out", seq_lens_out, self, batch).ptr
        table = bind.rope_table(self, cos_sin, capacity)
        bind.host_positions("host_prompt_lens", host_prompt_lens, batch, min(tokens, capacity),
                            f"a prompt must fit the prompt array's S={tokens} and the cache "
                            f"capacity S_max={capacity}")
        if batch == 0 or tokens == 0:
            return

        item = k_rows.itemsize
        token_axis, head_axis = self._token_axis, 3 - self._token_axis
        p.k_new, p.v_new = k_rows.ptr, v_rows.ptr
        p.k_batch_stride = k_rows.strides[0] // item
        p.k_head_stride = k_rows.strides[head_axis] // item
        p.k_token_stride = k_rows.strides[token_axis] // item
        p.v_batch_stride = v_rows.strides[0] // item
        p.v_head_stride = v_rows.strides[head_axis] // item
        p.v_token_stride = v_rows.strides[token_axis] // item
        bind.kv_fields(p, kc, vc, ks, vs, capacity, strides, self.scale_mode)
        p.seq_lens, p.seq_lens_out, p.cos_sin = lengths.ptr, out, table
        p.q = p.q_out = 0
        p.num_q_heads, p.prompt_tokens, p.advance = 0, tokens, 0
        blocks = -(-tokens // PROMPT_TOKENS_PER_CTA)
        self._launch((blocks, batch), stream)

    @property
    def _token_axis(self) -> int:
        return 1 if self.prompt_layout == "bsnh" else 2

    def _prompt(self, name: str, obj: Any, batch_tokens: tuple[int, int] | None) -> DeviceArray:
        array = check.device_array(name, obj, self.device)
        check.dtype(name, array, (self.dtype,))
        B, S = batch_tokens if batch_tokens else (None, None)
        Hkv, D = self.num_kv_heads, self.head_dim
        if self.prompt_layout == "bsnh":
            check.shape(name, array, (B, S, Hkv, D), "[B, S, Hkv, D]")
        else:
            check.shape(name, array, (B, Hkv, S, D), "[B, Hkv, S, D]")
        check.inner_contiguous(name, array)
        check.aligned(name, array, 16, (0, 1, 2))
        check.int32_count(name, array.shape[self._token_axis], "tokens")
        return array


def quantize_prompt(k: Any, v: Any, k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any,
                    prompt_lens: Any, *, kv_layout: str = "bnsh", prompt_layout: str = "bsnh",
                    scale_mode: str = "token", rope: str | None = None,
                    rope_theta: float = 10000.0, cos_sin: Any = None, seq_lens_out: Any = None,
                    host_prompt_lens: Any = None, stream: StreamLike) -> PromptQuantizer:
    """One-off prompt quantization: infers the shapes and dtypes from ``k`` and ``k_scale``,
    builds a PromptQuantizer, runs it and returns it (read ``error_flags()`` from it). Reuse a
    PromptQuantizer instead when quantizing repeatedly: this allocates its error word."""
    array = check.device_array("k", k, None)  # k decides the device
    check.dtype("k", array, DTYPES)
    if array.ndim != 4:
        raise ValueError(f"k: expected a 4-d prompt [B, S, Hkv, D] or [B, Hkv, S, D], got "
                         f"shape {array.shape}")
    heads = array.shape[2] if prompt_layout == "bsnh" else array.shape[1]
    scale_dtype = "float32"
    if scale_mode == "token":
        scale = check.device_array("k_scale", k_scale, array.device)
        check.dtype("k_scale", scale, TOKEN_SCALE_DTYPES)
        scale_dtype = scale.dtype.name
    quantizer = PromptQuantizer(heads, array.shape[3], max_batch=max(array.shape[0], 1),
                                kv_layout=kv_layout, prompt_layout=prompt_layout,
                                scale_mode=scale_mode, scale_dtype=scale_dtype,
                                dtype=array.dtype.name, rope=rope, rope_theta=rope_theta,
                                device=array.device)
    quantizer.run(k, v, k_cache, v_cache, k_scale, v_scale, prompt_lens,
                  seq_lens_out=seq_lens_out, cos_sin=cos_sin,
                  host_prompt_lens=host_prompt_lens, stream=stream)
    return quantizer
