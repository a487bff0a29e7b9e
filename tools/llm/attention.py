"""Attention over the KV cache: RoPE, the cache itself, and causal GQA softmax attention.

This is the one piece of the forward pass that a GPU runner replaces: lowlevel_fd's
`DecodePlan.append_and_run` takes the un-rotated query and new key/value of a step, rotates them
(RoPE), quantizes the key and value into the INT8 cache and attends, all in one launch. So the
interface (`KVAttention`) receives q, k and v *before* RoPE, together with their positions, and
owns the cache: the model never touches cached keys itself. `CpuKVAttention` is the float
reference implementation of that contract.
"""
from __future__ import annotations

import math
from typing import Protocol

import numpy as np


class KVAttention(Protocol):
    """What the model needs from an attention backend."""

    def reset(self) -> None:
        """Forget every cached token (a new sequence starts at position 0)."""

    def __call__(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                 start: int) -> np.ndarray:
        """q (T, Hq, D), k and v (T, Hkv, D), un-rotated, for positions start .. start+T-1.
        Rotates q and k, writes k and v into `layer`'s cache at those positions, and returns
        the causal attention output (T, Hq, D) over cache positions 0 .. start+T-1."""


def rope_angles(theta: float, head_dim: int,
                positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (T, head_dim/2) of position * theta^(-2i/head_dim), as in HF's Llama.
    Computed in float64 so that the float32 model's only rounding is in the cast."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles), np.sin(angles)


def rope_neox(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """NeoX ("rotate half") RoPE on x (T, H, D): channel i pairs with channel i + D/2. This is
    the layout of Hugging Face checkpoints, and of our weights (weights.py un-permutes q/k)."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def rope_gptj(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """GPT-J (adjacent pairs) RoPE: channel 2i pairs with 2i+1. llama.cpp's layout for GGUF
    Llama weights; kept to show (in the tests) that it matches NeoX on un-permuted weights."""
    c, s = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x2 * c + x1 * s
    return out


def causal_gqa_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray,
                         start: int) -> np.ndarray:
    """softmax(q k^T / sqrt(D)) v for queries at positions start .. start+T-1 over keys/values
    (Hkv, S, D) at positions 0 .. S-1, each query seeing only positions up to its own.
    Query head h reads KV head h // (Hq / Hkv), as HF's repeat_kv lays the heads out."""
    t, n_heads, d = q.shape
    n_kv, s, _ = keys.shape
    group = n_heads // n_kv
    qg = q.reshape(t, n_kv, group, d).transpose(1, 2, 0, 3)            # (Hkv, G, T, D)
    # Python-float scale: a numpy float64 scalar would promote float32 scores to float64.
    scores = np.matmul(qg, keys[:, None].swapaxes(-1, -2)) * (1.0 / math.sqrt(d))  # (Hkv,G,T,S)
    future = np.arange(s)[None, :] > (start + np.arange(t))[:, None]    # (T, S)
    scores[..., future] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    out = np.matmul(weights, values[:, None])                           # (Hkv, G, T, D)
    return out.transpose(2, 0, 1, 3).reshape(t, n_heads, d)


class CpuKVAttention:
    """The float reference backend: NeoX RoPE, a float KV cache per layer, exact attention.
    The cache grows by doubling up to `max_positions` (the model's context length)."""

    def __init__(self, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 rope_theta: float, max_positions: int, dtype=np.float32, capacity: int = 256):
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads {n_heads} must be a multiple of n_kv_heads {n_kv_heads}")
        self.n_layers, self.n_heads, self.n_kv_heads = n_layers, n_heads, n_kv_heads
        self.head_dim, self.rope_theta, self.max_positions = head_dim, rope_theta, max_positions
        self.dtype = np.dtype(dtype)
        self._shape = (n_layers, n_kv_heads, 0, head_dim)
        self.keys = np.zeros(self._shape, self.dtype)
        self.values = np.zeros(self._shape, self.dtype)
        self._grow(min(capacity, max_positions))

    def reset(self) -> None:
        pass  # positions are given per call; stale entries past `start` are overwritten

    def __call__(self, layer, q, k, v, start):
        t = q.shape[0]
        end = start + t
        if start < 0 or end > self.max_positions:
            raise ValueError(f"start: positions {start}..{end - 1} are outside the context of "
                             f"{self.max_positions}")
        if end > self.keys.shape[2]:
            self._grow(min(self.max_positions, max(end, 2 * self.keys.shape[2])))
        cos, sin = rope_angles(self.rope_theta, self.head_dim, np.arange(start, end))
        q, k = rope_neox(q, cos, sin), rope_neox(k, cos, sin)
        self.keys[layer, :, start:end] = k.transpose(1, 0, 2)
        self.values[layer, :, start:end] = v.transpose(1, 0, 2)
        return causal_gqa_attention(q, self.keys[layer, :, :end], self.values[layer, :, :end],
                                    start)

    def _grow(self, capacity: int) -> None:
        old = self.keys.shape[2]
        pad = [(0, 0), (0, 0), (0, capacity - old), (0, 0)]
        self.keys, self.values = np.pad(self.keys, pad), np.pad(self.values, pad)
