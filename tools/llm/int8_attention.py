"""The lowlevel_fd backend of the GPU runner: the KV cache in INT8, the prompt's attention by
the library's multi-token attention over that cache, every decode step's RoPE, quantization,
append and attention in one `append_and_run` launch per layer.

- The cache (int8_storage.py): per layer int8 K and V, contiguous (`"contiguous"`: `[B, Hkv,
  S_max, D]`, `kv_layout="bnsh"`) or in pages (`"hnd"`, the default, or `"nhd"`, `page_size`
  tokens a page, 16 by default) that one device block table, shared by every layer, assigns
  to the sequences in a seeded random physical order; keys stored rotated (`rope="neox"`).
  Scales: per token (`"token"`, fp32 or fp16, laid out as the cache), per KV head
  (`"head"`) or per tensor (`"tensor"`). `key_transform="hadamard"` stores the keys as
  H RoPE(k) (the library transforms k and q in its kernels; static scales are calibrated on
  the transformed keys).
- The prompt goes into the cache through the library's append path: `PromptQuantizer` takes
  the un-rotated prompt K/V (`[B, T, Hkv, D]`) and the block table, rotates K and quantizes
  both (per-token scales computed in the kernel).
- The prompt's own attention (prefill, `prefill="multi"`, the default) is `MultiPlan` over the
  INT8 cache the quantizer just wrote: each sequence's valid rows of q packed `[total_q, Hq,
  D]` (`qo_indptr` from the prompt lengths; the right padding of the model's `[B, T]` layout
  is left out and its rows of the output are zero), causal, q rotated in the kernel
  (`rotate_q=True`, the spec's RoPE). The plan is made once per prefill (host `qo_indptr` and
  lengths) and run for every layer. `prefill="sdpa"` keeps the older path: torch SDPA over the
  un-quantized K/V in the model's dtype (the cache is written all the same).
- Static scales (`"head"`, `"tensor"`) are not computed by the library. They are calibrated
  per layer from the prompt: absmax of the rotated prompt K (and of V) over its valid tokens,
  per KV head or over the whole tensor, times `static_margin`, / 127. A later token outside
  that range is clipped at +-127 by the quantizer.
- Decode: a `DecodeStep` (fused) planned once for the longest length the run reaches, its
  buffers bound once (`DecodeStep.bind`, every layer's `LayerBuffers` with the block table):
  every layer's prepared `append_and_run` reads q, k_new and v_new from views of one
  `[B, (Hq + 2 Hkv) D]` projection buffer (`qkv`) and writes one `[B, Hq, D]` output buffer;
  `end_step` is the step's one `advance_lengths`. Every launch goes to torch's current
  stream, so a torch CUDA graph captures it.
"""
from __future__ import annotations

import numpy as np
import torch

from .int8_storage import (DEFAULT_PAGE_SIZE, DEFAULT_STORAGE, Int8Cache, cache_layout,
                           packed_rows, storage_options)
from .torch_attention import causal_prompt_attention, rope_neox, rope_table, split_qkv

SCALE_MODES = ("token", "head", "tensor")
PREFILLS = ("multi", "sdpa")
_LIBRARY_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def current_stream() -> int:
    """torch's current CUDA stream as the raw handle the library takes (inside a
    `torch.cuda.graph` block: the capturing stream). Run under `torch.cuda.stream(...)` of a
    created stream (gpu_report.py does): handle 0, the legacy default stream, is refused."""
    handle = int(torch.cuda.current_stream().cuda_stream)
    if handle == 0:
        raise RuntimeError("the INT8 backend launches on torch's current stream, which is the "
                           "legacy default stream; run under torch.cuda.stream(torch.cuda."
                           "Stream())")
    return handle


def capacity_for(tokens: int) -> int:
    """A cache capacity of at least `tokens`, rounded up to a multiple of 16 (even, as fp16
    token scales need; 16-token tiles; whole pages of up to 16 tokens)."""
    return -(-int(tokens) // 16) * 16


def check_options(scale_mode: str, prefill: str, storage: str, page_size) -> None:
    """The constructor's option checks that need no GPU (ValueError naming the option)."""
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode: expected one of {SCALE_MODES}, got {scale_mode!r}")
    if prefill not in PREFILLS:
        raise ValueError(f"prefill: expected one of {PREFILLS}, got {prefill!r}")
    storage_options(storage, page_size)


class Int8Attention:
    def __init__(self, config, *, batch: int, capacity: int, dtype: torch.dtype = torch.float16,
                 scale_mode: str = "token", scale_dtype: str = "float32",
                 static_margin: float = 1.0, storage: str = DEFAULT_STORAGE,
                 page_size: int = DEFAULT_PAGE_SIZE, page_seed: int = 0,
                 prefill: str = "multi", key_transform: str = "none", fused: bool = True,
                 early_reads: bool = True, device="cuda"):
        check_options(scale_mode, prefill, storage, page_size)
        if dtype not in _LIBRARY_DTYPES:
            raise ValueError(f"dtype: the library takes float16 or bfloat16, got {dtype}")
        if scale_mode != "token":
            scale_dtype = "float32"  # static scales are always fp32
        if scale_dtype == "float16" and capacity % 2:
            raise ValueError(f"capacity: fp16 token scales need an even S_max, got {capacity}")
        if not static_margin > 0:
            raise ValueError(f"static_margin: expected > 0, got {static_margin}")
        from lowlevel_fd import DecodeStep, KVCacheSpec, MultiPlan, PromptQuantizer

        c = config
        self.config, self.batch, self.capacity, self.dtype = c, batch, capacity, dtype
        self.scale_mode, self.scale_dtype, self.static_margin = scale_mode, scale_dtype, \
            float(static_margin)
        self.storage, self.prefill_mode, self.key_transform = storage, prefill, key_transform
        self.device = torch.device(device)
        layout = cache_layout(storage, page_size, batch=batch, capacity=capacity,
                              kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                              scale_mode=scale_mode, scale_dtype=scale_dtype)
        self.page_size = layout.page_size
        self.spec = KVCacheSpec(num_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                                kv_layout=layout.kv_layout, scale_mode=scale_mode,
                                scale_dtype=scale_dtype, rope="neox", rope_theta=c.rope_theta,
                                page_size=layout.page_size, key_transform=key_transform)
        library_dtype = _LIBRARY_DTYPES[dtype]
        self.cache = Int8Cache(layout, c.n_layers, device=self.device, page_seed=page_seed)
        self.block_table = self.cache.block_table  # None when contiguous
        self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=self.device)
        self.qkv = torch.zeros(batch, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, dtype=dtype,
                               device=self.device)
        self.out = torch.zeros(batch, c.n_heads, c.head_dim, dtype=dtype, device=self.device)
        self.cos, self.sin = rope_table(c.rope_theta, c.head_dim, capacity, self.device)
        self.step = DecodeStep(self.spec, c.n_layers, c.n_heads, max_batch=batch,
                               max_seq_len=capacity, dtype=library_dtype, fused=fused,
                               early_reads=early_reads)
        self.quantizer = PromptQuantizer(self.spec, max_batch=batch, prompt_layout="bsnh",
                                         dtype=library_dtype)
        self.multi = None if prefill == "sdpa" else MultiPlan(
            self.spec, c.n_heads, max_batch=batch, max_seq_len=capacity, dtype=library_dtype)
        self.bound = None
        self._host_lengths: np.ndarray | None = None
        self._packing: dict | None = None  # the prefill's packed rows (multi), per start()
        self.static_absmax: list = []  # per layer (k, v) absmax of the calibration prompt

    @property
    def name(self) -> str:
        suffix = "+hadamard" if self.key_transform == "hadamard" else ""
        if self.scale_mode == "token":
            return f"int8-token-{self.scale_dtype.replace('float', 'fp')}{suffix}"
        return f"int8-{self.scale_mode}{suffix}"

    @property
    def positions(self) -> torch.Tensor:
        return self.seq_lens

    def settings(self) -> dict:
        """The storage and prefill of this backend, for the report."""
        layout = self.cache.layout
        return {"storage": self.storage, "page_size": self.page_size,
                "num_pages": layout.num_pages if layout.paged else None,
                "prefill": self.prefill_mode, "key_transform": self.key_transform}

    def kv_bytes_per_token(self) -> int:
        """Cache bytes one token takes in every layer: int8 K and V, plus their per-token
        scales in token mode (static scales are per layer, not per token)."""
        c = self.config
        scale = self.cache.k_scale.element_size() if self.scale_mode == "token" else 0
        return 2 * c.n_layers * c.n_kv_heads * (c.head_dim + scale)

    def save(self) -> torch.Tensor:
        return self.seq_lens.clone()

    def restore(self, saved: torch.Tensor) -> None:
        self.seq_lens.copy_(saved)

    def fill_random(self, lengths, seed: int = 0) -> None:
        """Throughput runs: random int8 caches and scales (valid, not a model's) and these
        lengths, no prompt (the block table stays: the pages are the table's)."""
        self.start(lengths)
        self.cache.fill_random(torch.Generator(device=self.device).manual_seed(seed))

    def close(self) -> None:
        """Free the library's plans and workspaces (the torch tensors go with the object)."""
        self.bound = None
        self.step.close()
        self.quantizer.close()
        if self.multi is not None:
            self.multi.close()

    def error_flags(self) -> int:
        """The library's error bits since the last read (0: every length stayed in the cache,
        every page id in the pool, every query row in its plan)."""
        stream = current_stream()
        flags = self.step.error_flags(stream=stream) | self.quantizer.error_flags(stream=stream)
        if self.multi is not None:
            flags |= self.multi.error_flags(stream=stream)
        return flags

    # -- prompt -------------------------------------------------------------------------------
    def start(self, lengths) -> None:
        lengths = np.asarray([int(n) for n in lengths], dtype=np.int32)
        if lengths.shape != (self.batch,) or lengths.min() < 1 or lengths.max() > self.capacity:
            raise ValueError(f"lengths: expected {self.batch} prompt lengths in "
                             f"[1, {self.capacity}], got {lengths.tolist()}")
        self._host_lengths, self.bound, self._packing = lengths, None, None
        self.seq_lens.copy_(torch.from_numpy(lengths))
        self.static_absmax = []

    def prefill(self, layer: int, q, k, v) -> torch.Tensor:
        """q `[B, T, Hq, D]`, k and v `[B, T, Hkv, D]`, un-rotated (torch_attention.py):
        writes the prompt into `layer`'s cache and returns the causal attention `[B, T, Hq,
        D]` in the model's dtype (zero rows past each prompt's length with `prefill="multi"`).
        """
        t = q.shape[1]
        cos, sin = self.cos[None, :t], self.sin[None, :t]
        k_rot = None
        if self.scale_mode != "token" or self.multi is None:
            k_rot = rope_neox(k, cos, sin)
        if self.scale_mode != "token":
            self._calibrate(layer, k_rot, v)
        self.quantizer.run(k.to(self.dtype).contiguous(), v.to(self.dtype).contiguous(),
                           *self.cache.layer(layer), self.seq_lens,
                           host_prompt_lens=self._host_lengths, block_table=self.block_table,
                           stream=current_stream())
        if self.multi is None:
            return causal_prompt_attention(rope_neox(q, cos, sin), k_rot, v, self.dtype)
        return self._multi_prefill(layer, q)

    def _multi_prefill(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """MultiPlan over `layer`'s cache, which holds the prompt (the quantizer ran first, on
        the same stream): the valid rows of q packed, attended, scattered back."""
        b, t, hq, d = q.shape
        packing = self._packing
        if packing is None or packing["tokens"] != t:
            packing = self._packing = self._plan_prefill(t)
        q_rows = q.reshape(b * t, hq, d).index_select(0, packing["rows"]).to(self.dtype)
        out = packing["out"]
        self.multi.run(q_rows, *self.cache.layer(layer), self.seq_lens, packing["qo_indptr"],
                       out, block_table=self.block_table, rotate_q=True,
                       stream=current_stream())
        full = torch.zeros(b * t, hq, d, dtype=self.dtype, device=self.device)
        return full.index_copy_(0, packing["rows"], out).view(b, t, hq, d)

    def _plan_prefill(self, tokens: int) -> dict:
        """Plan the prompt's MultiPlan (host qo_indptr and lengths: the prompts whole, each
        sequence's KV its own prompt) and allocate its packed buffers, once per prefill."""
        c = self.config
        indptr, rows = packed_rows(self._host_lengths, tokens)
        self.multi.plan(indptr, self._host_lengths, causal=True)
        return {"tokens": tokens,
                "rows": torch.from_numpy(rows).to(self.device),
                "qo_indptr": torch.from_numpy(indptr).to(self.device),
                "out": torch.empty(int(indptr[-1]), c.n_heads, c.head_dim, dtype=self.dtype,
                                   device=self.device)}

    def _calibrate(self, layer: int, k_rot: torch.Tensor, v: torch.Tensor) -> None:
        """Static scales of `layer` from the prompt's valid tokens (module docstring)."""
        t = k_rot.shape[1]
        lengths = torch.from_numpy(self._host_lengths.astype(np.int64)).to(self.device)
        valid = (torch.arange(t, device=self.device)[None, :] < lengths[:, None])[..., None, None]
        absmax = []
        if self.key_transform == "hadamard":  # the cache holds H k: calibrate on that
            from lowlevel_fd import hadamard
            k_rot = k_rot.float() @ torch.from_numpy(hadamard(k_rot.shape[-1])).to(k_rot.device)
        for x, scale in ((k_rot, self.cache.k_scale[layer]), (v, self.cache.v_scale[layer])):
            x = x.float().abs().masked_fill(~valid, 0.0)
            peak = x.amax(dim=(0, 1, 3)) if self.scale_mode == "head" else x.amax().reshape(1)
            absmax.append(peak)
            scale.copy_(peak.clamp(min=1e-6) * (self.static_margin / 127.0))
        self.static_absmax.append(absmax)

    # -- decode -------------------------------------------------------------------------------
    def prepare_decode(self, longest: int) -> None:
        """Plan the step for `longest` cached tokens (the most any later step starts from;
        the split count is fixed here, the split lengths follow the device lengths), then bind
        every layer's buffers once. Call before capturing; re-planning means recapturing."""
        from lowlevel_fd import LayerBuffers

        if self._host_lengths is None:
            raise RuntimeError("prepare_decode: call start(lengths) and prefill first")
        if longest + 1 > self.capacity:
            raise ValueError(f"longest: a step from {longest} cached tokens needs capacity "
                             f"{longest + 1}, the cache holds {self.capacity}")
        c = self.config
        self.step.plan(np.full(self.batch, longest, dtype=np.int32))
        q, k, v = split_qkv(self.qkv, c.n_heads, c.n_kv_heads, c.head_dim)
        layers = []
        for i in range(c.n_layers):
            k_cache, v_cache, k_scale, v_scale = self.cache.layer(i)
            layers.append(LayerBuffers(q=q, k_new=k, v_new=v, k_cache=k_cache, v_cache=v_cache,
                                       k_scale=k_scale, v_scale=v_scale, out=self.out,
                                       block_table=self.block_table))
        self.bound = self.step.bind(layers, self.seq_lens)

    def begin_step(self) -> None:
        self._require_bound().begin(current_stream())

    def decode(self, layer: int, q, k, v) -> torch.Tensor:
        if q.data_ptr() != self.qkv.data_ptr():
            raise ValueError("q: the INT8 backend's launches read the projection from its own "
                             "`qkv` buffer; write it there (TorchLlama does)")
        self._require_bound().layer(layer, current_stream())
        return self.out

    def end_step(self) -> None:
        self._require_bound().end(current_stream())

    def _require_bound(self):
        if self.bound is None:
            raise RuntimeError("decode: call prepare_decode(longest) after the prefill first")
        return self.bound
