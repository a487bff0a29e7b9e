"""The lowlevel_fd backend of the GPU runner: the KV cache in INT8, every decode step's RoPE,
quantization, append and attention in one `append_and_run` launch per layer.

- The cache: per layer int8 `[B, Hkv, S_max, D]` K and V (`kv_layout="bnsh"`, keys stored
  rotated: `rope="neox"`), and their scales: `[B, Hkv, S_max]` per token (`"token"`, fp32 or
  fp16), `[Hkv]` per KV head (`"head"`) or `[1]` per tensor (`"tensor"`).
- The prompt goes into the cache through the library's append path: `PromptQuantizer` takes
  the un-rotated prompt K/V (`[B, T, Hkv, D]`), rotates K and quantizes both (per-token scales
  computed in the kernel). The prompt's own attention (prefill) runs in torch SDPA over the
  un-quantized K/V in the model's dtype: the library has no multi-token attention yet.
- Static scales (`"head"`, `"tensor"`) are not computed by the library. They are calibrated
  per layer from the prompt: absmax of the rotated prompt K (and of V) over its valid tokens,
  per KV head or over the whole tensor, times `static_margin`, / 127. A later token outside
  that range is clipped at +-127 by the quantizer.
- Decode: a `DecodeStep` (fused) planned once for the longest length the run reaches, its
  buffers bound once (`DecodeStep.bind`): every layer's prepared `append_and_run` reads q,
  k_new and v_new from views of one `[B, (Hq + 2 Hkv) D]` projection buffer (`qkv`) and
  writes one `[B, Hq, D]` output buffer; `end_step` is the step's one `advance_lengths`.
  Every launch goes to torch's current stream, so a torch CUDA graph captures it.
"""
from __future__ import annotations

import numpy as np
import torch

from .torch_attention import causal_prompt_attention, rope_neox, rope_table, split_qkv

SCALE_MODES = ("token", "head", "tensor")
_LIBRARY_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
_SCALE_DTYPES = {"float32": torch.float32, "float16": torch.float16}


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
    token scales need; 16-token tiles)."""
    return -(-int(tokens) // 16) * 16


class Int8Attention:
    def __init__(self, config, *, batch: int, capacity: int, dtype: torch.dtype = torch.float16,
                 scale_mode: str = "token", scale_dtype: str = "float32",
                 static_margin: float = 1.0, fused: bool = True, early_reads: bool = True,
                 device="cuda"):
        from lowlevel_fd import DecodeStep, KVCacheSpec, PromptQuantizer

        if scale_mode not in SCALE_MODES:
            raise ValueError(f"scale_mode: expected one of {SCALE_MODES}, got {scale_mode!r}")
        if dtype not in _LIBRARY_DTYPES:
            raise ValueError(f"dtype: the library takes float16 or bfloat16, got {dtype}")
        if scale_mode != "token":
            scale_dtype = "float32"  # static scales are always fp32
        if scale_dtype == "float16" and capacity % 2:
            raise ValueError(f"capacity: fp16 token scales need an even S_max, got {capacity}")
        if not static_margin > 0:
            raise ValueError(f"static_margin: expected > 0, got {static_margin}")
        c = config
        self.config, self.batch, self.capacity, self.dtype = c, batch, capacity, dtype
        self.scale_mode, self.scale_dtype, self.static_margin = scale_mode, scale_dtype, \
            float(static_margin)
        self.device = torch.device(device)
        self.spec = KVCacheSpec(num_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                                kv_layout="bnsh", scale_mode=scale_mode,
                                scale_dtype=scale_dtype, rope="neox",
                                rope_theta=c.rope_theta)
        library_dtype = _LIBRARY_DTYPES[dtype]
        shape = (c.n_layers, batch, c.n_kv_heads, capacity, c.head_dim)
        self.k_cache = torch.zeros(shape, dtype=torch.int8, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=torch.int8, device=self.device)
        scale_shape = {"token": shape[:4], "head": (c.n_layers, c.n_kv_heads),
                       "tensor": (c.n_layers, 1)}[scale_mode]
        self.k_scale = torch.ones(scale_shape, dtype=_SCALE_DTYPES[scale_dtype],
                                  device=self.device)
        self.v_scale = torch.ones_like(self.k_scale)
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
        self.bound = None
        self._host_lengths: np.ndarray | None = None
        self.static_absmax: list = []  # per layer (k, v) absmax of the calibration prompt

    @property
    def name(self) -> str:
        if self.scale_mode == "token":
            return f"int8-token-{self.scale_dtype.replace('float', 'fp')}"
        return f"int8-{self.scale_mode}"

    @property
    def positions(self) -> torch.Tensor:
        return self.seq_lens

    def kv_bytes_per_token(self) -> int:
        """Cache bytes one token takes in every layer: int8 K and V, plus their per-token
        scales in token mode (static scales are per layer, not per token)."""
        c = self.config
        scale = self.k_scale.element_size() if self.scale_mode == "token" else 0
        return 2 * c.n_layers * c.n_kv_heads * (c.head_dim + scale)

    def save(self) -> torch.Tensor:
        return self.seq_lens.clone()

    def restore(self, saved: torch.Tensor) -> None:
        self.seq_lens.copy_(saved)

    def fill_random(self, lengths, seed: int = 0) -> None:
        """Throughput runs: random int8 caches and scales (valid, not a model's) and these
        lengths, no prompt."""
        self.start(lengths)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        for cache in (self.k_cache, self.v_cache):
            cache.random_(-127, 128, generator=generator)
        for scale in (self.k_scale, self.v_scale):
            scale.uniform_(0.005, 0.02, generator=generator)

    def close(self) -> None:
        """Free the library's plans and workspaces (the torch tensors go with the object)."""
        self.bound = None
        self.step.close()
        self.quantizer.close()

    def error_flags(self) -> int:
        """The library's error bits since the last read (0: every length stayed in the cache)."""
        stream = current_stream()
        return (self.step.error_flags(stream=stream)
                | self.quantizer.error_flags(stream=stream))

    # -- prompt -------------------------------------------------------------------------------
    def start(self, lengths) -> None:
        lengths = np.asarray([int(n) for n in lengths], dtype=np.int32)
        if lengths.shape != (self.batch,) or lengths.min() < 1 or lengths.max() > self.capacity:
            raise ValueError(f"lengths: expected {self.batch} prompt lengths in "
                             f"[1, {self.capacity}], got {lengths.tolist()}")
        self._host_lengths, self.bound = lengths, None
        self.seq_lens.copy_(torch.from_numpy(lengths))
        self.static_absmax = []

    def prefill(self, layer: int, q, k, v) -> torch.Tensor:
        t = q.shape[1]
        cos, sin = self.cos[None, :t], self.sin[None, :t]
        q_rot, k_rot = rope_neox(q, cos, sin), rope_neox(k, cos, sin)
        if self.scale_mode != "token":
            self._calibrate(layer, k_rot, v)
        self.quantizer.run(k.to(self.dtype).contiguous(), v.to(self.dtype).contiguous(),
                           self.k_cache[layer], self.v_cache[layer], self.k_scale[layer],
                           self.v_scale[layer], self.seq_lens,
                           host_prompt_lens=self._host_lengths, stream=current_stream())
        return causal_prompt_attention(q_rot, k_rot, v, self.dtype)

    def _calibrate(self, layer: int, k_rot: torch.Tensor, v: torch.Tensor) -> None:
        """Static scales of `layer` from the prompt's valid tokens (module docstring)."""
        t = k_rot.shape[1]
        lengths = torch.from_numpy(self._host_lengths.astype(np.int64)).to(self.device)
        valid = (torch.arange(t, device=self.device)[None, :] < lengths[:, None])[..., None, None]
        absmax = []
        for x, scale in ((k_rot, self.k_scale[layer]), (v, self.v_scale[layer])):
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
        layers = [LayerBuffers(q=q, k_new=k, v_new=v, k_cache=self.k_cache[i],
                               v_cache=self.v_cache[i], k_scale=self.k_scale[i],
                               v_scale=self.v_scale[i], out=self.out)
                  for i in range(c.n_layers)]
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
