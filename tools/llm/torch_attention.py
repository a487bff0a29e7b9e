"""The torch attention backends of the GPU runner: RoPE and a preallocated KV cache in torch,
attention by torch's scaled_dot_product_attention (SDPA). These are the references the INT8
backend (int8_attention.py) is measured against.

Every backend has one interface (`TorchLlama` in torch_model.py calls it):

- `qkv`: a `[B, (Hq + 2 Hkv) D]` buffer of the model's dtype. A decode step writes its q/k/v
  projection into it (so that a CUDA graph and the INT8 backend's prepared launches always see
  the same addresses); `split_qkv` views it as q `[B, Hq, D]`, k and v `[B, Hkv, D]`.
- `start(lengths)`: a new batch; sequence b's prompt holds `lengths[b]` tokens.
- `prefill(layer, q, k, v)`: q `[B, T, Hq, D]`, k and v `[B, T, Hkv, D]`, un-rotated, for
  positions 0 .. T-1 (right-padded past each prompt's length): writes the prompt into the
  layer's cache and returns the causal attention `[B, T, Hq, D]`.
- `prepare_decode(longest)`: before the first decode step (and before any graph capture): the
  longest cached length any later step starts from.
- `begin_step()`, `decode(layer, q, k, v)` per layer (views of `qkv`; returns `[B, Hq, D]`),
  `end_step()`: one decode step, every sequence's token at its own position; `end_step`
  advances the positions on the device, so a captured step replays as the next step.
- `positions`: the device lengths (the next token's position per sequence); `save()` and
  `restore(saved)` copy them, for an eager warm-up before a capture.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from .attention import rope_angles


def rope_table(theta: float, head_dim: int, positions: int, device) -> tuple:
    """cos and sin `[positions, head_dim/2]` in float32 (angles in float64, as reference.py)."""
    cos, sin = rope_angles(theta, head_dim, np.arange(positions))
    return (torch.from_numpy(cos.astype(np.float32)).to(device),
            torch.from_numpy(sin.astype(np.float32)).to(device))


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in float32: x `[..., H, D]`, cos/sin `[..., D/2]` (one per position)."""
    x = x.float()
    half = x.shape[-1] // 2
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def split_qkv(qkv: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int) -> tuple:
    """Views of a `[..., (Hq + 2 Hkv) D]` projection: q `[..., Hq, D]`, k and v `[..., Hkv, D]`."""
    lead = qkv.shape[:-1]
    q_end, k_end = n_heads * head_dim, (n_heads + n_kv_heads) * head_dim
    return (qkv[..., :q_end].view(*lead, n_heads, head_dim),
            qkv[..., q_end:k_end].view(*lead, n_kv_heads, head_dim),
            qkv[..., k_end:].view(*lead, n_kv_heads, head_dim))


def causal_prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            dtype: torch.dtype) -> torch.Tensor:
    """Causal GQA attention of a prompt over itself in `dtype`: q `[B, T, Hq, D]`, k and v
    `[B, T, Hkv, D]` (q and k rotated); returns `[B, T, Hq, D]`. Query head h reads KV head
    h // (Hq / Hkv), as Hugging Face's repeat_kv lays them out. Right padding never leaks into
    a real token: each token attends only to positions up to its own."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    with _math_if(dtype == torch.float32):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2)


class _math_if:
    """SDPA's math backend for float32 (plain fp32 matmuls: no TF32 or reduced-precision
    kernel can stand in for the reference); torch's choice otherwise."""

    def __init__(self, use_math: bool):
        self.context = None
        if use_math:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            self.context = sdpa_kernel([SDPBackend.MATH])

    def __enter__(self):
        if self.context is not None:
            self.context.__enter__()

    def __exit__(self, *exc):
        if self.context is not None:
            self.context.__exit__(*exc)


class SdpaAttention:
    """RoPE in float32, a `[L, B, Hkv, S_max, D]` cache of `cache_dtype` (float32 or float16),
    attention by SDPA over the whole cache with a mask of each sequence's valid positions (so
    the shapes, and a captured graph, do not depend on the lengths). The float32 cache attends
    in float32 with SDPA's math backend: the reference. Decode attention runs the Hq / Hkv query
    heads of a KV head as G query rows over that head's cache: exact GQA without repeating K/V.
    """

    def __init__(self, config, *, batch: int, capacity: int, dtype: torch.dtype,
                 cache_dtype: torch.dtype = torch.float32, device="cuda"):
        c = config
        self.config, self.batch, self.capacity = c, batch, capacity
        self.dtype, self.cache_dtype, self.device = dtype, cache_dtype, torch.device(device)
        shape = (c.n_layers, batch, c.n_kv_heads, capacity, c.head_dim)
        self.k_cache = torch.zeros(shape, dtype=cache_dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=cache_dtype, device=self.device)
        self.cos, self.sin = rope_table(c.rope_theta, c.head_dim, capacity, self.device)
        self.positions = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self.qkv = torch.zeros(batch, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, dtype=dtype,
                               device=self.device)
        self._batch_index = torch.arange(batch, device=self.device)
        self._slots = torch.arange(capacity, device=self.device)

    @property
    def name(self) -> str:
        return f"sdpa-{str(self.cache_dtype).removeprefix('torch.')}"

    def kv_bytes_per_token(self) -> int:
        """Cache bytes one token takes in every layer (K and V)."""
        c = self.config
        return 2 * c.n_layers * c.n_kv_heads * c.head_dim * self.k_cache.element_size()

    def save(self) -> torch.Tensor:
        return self.positions.clone()

    def fill_random(self, lengths, seed: int = 0) -> None:
        """Throughput runs: random cache contents and these lengths, no prompt."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        for cache in (self.k_cache, self.v_cache):
            cache.normal_(generator=generator)
        self.start(lengths)

    def close(self) -> None:
        self.k_cache = self.v_cache = None

    def restore(self, saved: torch.Tensor) -> None:
        self.positions.copy_(saved)

    # -- prompt -------------------------------------------------------------------------------
    def start(self, lengths) -> None:
        lengths = [int(n) for n in lengths]
        if len(lengths) != self.batch or min(lengths) < 1 or max(lengths) > self.capacity:
            raise ValueError(f"lengths: expected {self.batch} prompt lengths in "
                             f"[1, {self.capacity}], got {lengths}")
        self.positions.copy_(torch.tensor(lengths, dtype=torch.int64))

    def prefill(self, layer: int, q, k, v) -> torch.Tensor:
        t = q.shape[1]
        cos, sin = self.cos[None, :t], self.sin[None, :t]  # [1, T, D/2]: per position
        q_rot, k_rot = rope_neox(q, cos, sin), rope_neox(k, cos, sin)
        self.k_cache[layer, :, :, :t] = k_rot.transpose(1, 2).to(self.cache_dtype)
        self.v_cache[layer, :, :, :t] = v.transpose(1, 2).to(self.cache_dtype)
        attend_dtype = self.cache_dtype if self.cache_dtype == torch.float32 else self.dtype
        return causal_prompt_attention(q_rot, k_rot, v, attend_dtype).to(self.dtype)

    # -- decode -------------------------------------------------------------------------------
    def prepare_decode(self, longest: int) -> None:
        if longest + 1 > self.capacity:
            raise ValueError(f"longest: a step from {longest} cached tokens needs capacity "
                             f"{longest + 1}, the cache holds {self.capacity}")

    def begin_step(self) -> None:
        pos = self.positions.clamp(max=self.capacity - 1)
        self._cos, self._sin = self.cos[pos], self.sin[pos]           # [B, D/2]
        self._mask = (self._slots[None, :] <= pos[:, None])[:, None, None, :]  # [B,1,1,S]
        self._write_at = pos

    def decode(self, layer: int, q, k, v) -> torch.Tensor:
        c = self.config
        b, group = self.batch, c.n_heads // c.n_kv_heads
        q_rot = rope_neox(q, self._cos, self._sin)                    # [B, Hq, D] fp32
        k_rot = rope_neox(k, self._cos, self._sin)
        keys, values = self.k_cache[layer], self.v_cache[layer]       # [B, Hkv, S, D]
        keys[self._batch_index, :, self._write_at] = k_rot.to(self.cache_dtype)
        values[self._batch_index, :, self._write_at] = v.to(self.cache_dtype)
        queries = q_rot.to(self.cache_dtype).view(b, c.n_kv_heads, group, c.head_dim)
        with _math_if(self.cache_dtype == torch.float32):
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=self._mask,
                                                 scale=1.0 / math.sqrt(c.head_dim))
        return out.reshape(b, c.n_heads, c.head_dim).to(self.dtype)

    def end_step(self) -> None:
        self.positions.add_(1).clamp_(max=self.capacity)
