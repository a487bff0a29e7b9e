"""Prompt quantization: a whole prompt's K/V written into the INT8 cache in one launch."""
from __future__ import annotations

from typing import Any

from ..core import support
from ..core import validate as check
from ..core.spec import KVCacheSpec
from ..driver import Device, DeviceArray
from ..driver.stream import StreamLike
from . import bind
from .params import AppendParams
from .runner import KernelRunner, PreparedAppend
from .variants import PROMPT_TOKENS_PER_CTA

MAX_GRID_Y = 65535  # the batch is grid.y


class PromptQuantizer(KernelRunner):
    """Writes positions ``0..prompt_lens[b]-1`` of every sequence: K rotated by RoPE (positions
    0..len-1) when the spec has RoPE, K and V quantized with the scale mode (per-token scales
    computed in the kernel, per-head/per-tensor given). Lengths are read on the device; a length
    above S_max is clamped (ERROR_OUTSIDE_CACHE), one above the prompt's S too
    (ERROR_PROMPT_LENGTH).
    """

    _kernel_index = 1

    def __init__(self, cache: KVCacheSpec, *, max_batch: int, prompt_layout: str = "bsnh",
                 dtype: str = "float16", device: Device | None = None) -> None:
        check.choice("prompt_layout", prompt_layout, support.PROMPT_LAYOUTS)
        if check.integer("max_batch", max_batch) > MAX_GRID_Y:
            raise ValueError(f"max_batch: expected at most {MAX_GRID_Y} (grid.y), got "
                             f"{max_batch}")
        super().__init__(cache, max_batch=max_batch, dtype=dtype, device=device)
        self.prompt_layout = prompt_layout

    @classmethod
    def create(cls, num_kv_heads: int, head_dim: int, *, max_batch: int,
               prompt_layout: str = "bsnh", dtype: str = "float16", kv_layout: str = "bnsh",
               scale_mode: str = "token", scale_dtype: str = "float32",
               rope: str | None = None, rope_theta: float = 10000.0,
               page_size: int | None = None, key_transform: str = "none",
               device: Device | None = None) -> "PromptQuantizer":
        """The keyword form: builds the KVCacheSpec from the cache options."""
        spec = KVCacheSpec(num_kv_heads, head_dim, kv_layout, scale_mode, scale_dtype, rope,
                           rope_theta, page_size=page_size, key_transform=key_transform)
        return cls(spec, max_batch=max_batch, prompt_layout=prompt_layout, dtype=dtype,
                   device=device)

    def run(self, k: Any, v: Any, k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any,
            prompt_lens: Any, *, seq_lens_out: Any = None, cos_sin: Any = None,
            host_prompt_lens: Any = None, block_table: Any = None, starts: Any = None,
            stream: StreamLike) -> None:
        """Quantize ``k``/``v`` (fp16/bf16 ``[B, S, Hkv, D]`` for prompt_layout 'bsnh',
        ``[B, Hkv, S, D]`` for 'bnsh') into the caches at positions ``0..prompt_lens[b]-1``
        (int32 ``[B]`` on the device), or, with ``starts`` (int32 ``[B]`` on the device: a
        chunk after ``starts[b]`` cached tokens, as in chunked prefill), at positions
        ``starts[b] .. starts[b] + prompt_lens[b] - 1``, rotated at those positions.
        seq_lens_out: int32 ``[B]`` that receives the tokens cached afterwards (``starts[b]``
        plus the length written; may be prompt_lens itself, but not starts: every CTA of a
        sequence reads its start while one writes seq_lens_out). block_table: int32
        ``[B, max_pages]`` for a paged spec: position t of sequence b goes to page
        ``block_table[b][t // page_size]`` (the table attention reads, so no second mapping
        to keep in sync). host_prompt_lens: the host's copy, if any, checked against S and
        S_max before launching. Enqueued on ``stream``; returns at once.
        """
        self._require_open()
        grid = self._bind(self._params, k, v, k_cache, v_cache, k_scale, v_scale, prompt_lens,
                          seq_lens_out, cos_sin, host_prompt_lens, block_table, starts)
        if all(grid):
            self._launch(grid, stream)

    def prepare_run(self, k: Any, v: Any, k_cache: Any, v_cache: Any, k_scale: Any,
                    v_scale: Any, prompt_lens: Any, *, seq_lens_out: Any = None,
                    cos_sin: Any = None, host_prompt_lens: Any = None,
                    block_table: Any = None, starts: Any = None) -> PreparedAppend:
        """``run``'s arguments, validated once: ``launch(stream)`` on the result issues the
        same launch with no further checks. Loads the kernel (so the call can be captured)."""
        self.load()
        params = AppendParams.from_buffer_copy(self._params)
        grid = self._bind(params, k, v, k_cache, v_cache, k_scale, v_scale, prompt_lens,
                          seq_lens_out, cos_sin, host_prompt_lens, block_table, starts)
        return PreparedAppend(self, params, grid)

    def _bind(self, p: AppendParams, k: Any, v: Any, k_cache: Any, v_cache: Any, k_scale: Any,
              v_scale: Any, prompt_lens: Any, seq_lens_out: Any, cos_sin: Any,
              host_prompt_lens: Any, block_table: Any, starts: Any) -> tuple[int, int]:
        """Check everything, then write it into ``p``; the launch grid."""
        k_rows = self._prompt("k", k, None)
        batch, tokens = k_rows.shape[0], k_rows.shape[self._token_axis]
        bind.batch_size("k", k_rows, self.max_batch)
        v_rows = self._prompt("v", v, (batch, tokens))
        arrays, capacity, table = bind.caches(self, k_cache, v_cache, k_scale, v_scale, batch,
                                              cos_sin, block_table)
        lengths = check.device_lengths("prompt_lens", prompt_lens, self.device, batch)
        out = first = 0
        if seq_lens_out is not None:
            out = check.device_lengths("seq_lens_out", seq_lens_out, self.device, batch).ptr
        if starts is not None:
            begin = check.device_lengths("starts", starts, self.device, batch)
            if seq_lens_out is not None:
                written = check.device_lengths("seq_lens_out", seq_lens_out, self.device, batch)
                low, high = begin.ptr, begin.ptr + 4 * batch
                if written.ptr < high and low < written.ptr + 4 * batch:
                    raise ValueError("seq_lens_out: must not overlap starts (the kernel's CTAs "
                                     "read starts while one of them writes seq_lens_out); pass "
                                     "another array")
            first = begin.ptr
        check.host_within("host_prompt_lens", host_prompt_lens, batch, min(tokens, capacity),
                          f"a prompt must fit the prompt array's S={tokens} and the cache "
                          f"capacity S_max={capacity}")
        item = k_rows.itemsize
        token_axis, head_axis = self._token_axis, 3 - self._token_axis
        p.k_new, p.v_new = k_rows.ptr, v_rows.ptr
        p.k_batch_stride = k_rows.strides[0] // item
        p.k_head_stride = k_rows.strides[head_axis] // item
        p.k_token_stride = k_rows.strides[token_axis] // item
        p.v_batch_stride = v_rows.strides[0] // item
        p.v_head_stride = v_rows.strides[head_axis] // item
        p.v_token_stride = v_rows.strides[token_axis] // item
        bind.write_caches(p, self, arrays, table)
        p.seq_lens, p.seq_lens_out, p.starts = lengths.ptr, out, first
        p.q = p.q_out = 0
        p.num_q_heads, p.prompt_tokens, p.advance = 0, tokens, 0
        return (-(-tokens // PROMPT_TOKENS_PER_CTA), batch)

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


def quantize_prompt(cache: KVCacheSpec, k: Any, v: Any, k_cache: Any, v_cache: Any,
                    k_scale: Any, v_scale: Any, prompt_lens: Any, *,
                    prompt_layout: str = "bsnh", cos_sin: Any = None, seq_lens_out: Any = None,
                    host_prompt_lens: Any = None, block_table: Any = None,
                    starts: Any = None, stream: StreamLike) -> PromptQuantizer:
    """One-off prompt quantization: builds a PromptQuantizer for ``k``'s dtype, batch and
    device, runs it and returns it (read ``error_flags(stream=...)`` from it). Reuse a
    PromptQuantizer instead when quantizing repeatedly: this allocates its error word."""
    array = check.device_array("k", k, None)  # k decides the device
    check.dtype("k", array, support.DTYPES)
    if array.ndim != 4:
        raise ValueError(f"k: expected a 4-d prompt [B, S, Hkv, D] or [B, Hkv, S, D], got "
                         f"shape {array.shape}")
    quantizer = PromptQuantizer(cache, max_batch=max(array.shape[0], 1),
                                prompt_layout=prompt_layout, dtype=array.dtype.name,
                                device=array.device)
    quantizer.run(k, v, k_cache, v_cache, k_scale, v_scale, prompt_lens,
                  seq_lens_out=seq_lens_out, cos_sin=cos_sin,
                  host_prompt_lens=host_prompt_lens, block_table=block_table, starts=starts,
                  stream=stream)
    return quantizer
