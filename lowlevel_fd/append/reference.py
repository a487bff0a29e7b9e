"""Numpy reference of the append kernels (rope -> quantize -> write) on host copies of the cache.

The quantization uses ``lowlevel_fd.quant``, which is bit-exact with the kernels' fp32 math, so
without RoPE the written bytes and scales match exactly. With RoPE the rotation here is float64
(``lowlevel_fd.reference.rope_ref``) rounded to fp32, the kernel's is fp32 (and sincosf for the
theta path): compare rotated K within one int8 step and per-token scales within a few fp32 ulps.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..quant import hadamard_rows, quantize_per_token_head, quantize_with_scale
from ..reference import rope_ref


def rotate(x: np.ndarray, positions: np.ndarray, style: str | None, *,
           cos_sin: np.ndarray | None = None, theta: float = 10000.0,
           key_transform: str = "none") -> np.ndarray:
    """x ``[N, H, D]`` rotated by ``positions [N]`` (float32; unchanged when style is None),
    then multiplied by the Hadamard matrix when ``key_transform="hadamard"``."""
    x32 = np.asarray(x, dtype=np.float32)
    if style is not None:
        x32 = rope_ref(x32, np.asarray(positions, np.int64), style=style, cos_sin=cos_sin,
                       theta=theta).astype(np.float32)
    return hadamard_rows(x32) if key_transform == "hadamard" else x32


def quantize_rows(x: np.ndarray, scale_mode: str, scale: Any = None,
                  scale_dtype: Any = np.float32) -> tuple[np.ndarray, np.ndarray | None]:
    """x ``[N, H, D]`` float32 -> (int8 ``[N, H, D]``, per-token scales ``[N, H]`` or None)."""
    x32 = np.asarray(x, dtype=np.float32)
    if scale_mode == "token":
        return quantize_per_token_head(x32, axis=-1, scale_dtype=scale_dtype)
    given = np.asarray(scale, dtype=np.float32)
    broadcast = given.reshape(()) if scale_mode == "tensor" else given[None, :, None]
    return quantize_with_scale(x32, broadcast), None


def _bnsh(cache: np.ndarray, kv_layout: str) -> np.ndarray:
    """A bnsh view of ``cache``: writes through it land in the caller's array."""
    return cache if kv_layout == "bnsh" else cache.transpose(0, 2, 1, 3)


def append_ref(k_cache: np.ndarray, v_cache: np.ndarray, k_scale: np.ndarray,
               v_scale: np.ndarray, seq_lens: np.ndarray, k_new: np.ndarray,
               v_new: np.ndarray, *, kv_layout: str, scale_mode: str,
               scale_dtype: Any = np.float32, rope: str | None = None,
               cos_sin: np.ndarray | None = None, theta: float = 10000.0,
               q: np.ndarray | None = None, advance: bool = False,
               key_transform: str = "none") -> np.ndarray | None:
    """What AppendPlan.run does, in place on host arrays: writes row ``seq_lens[b]`` of the
    caches (and per-token scales) where it lies in [0, S_max), bumps ``seq_lens`` when
    ``advance``. Returns q rotated (float64 ``[B, Hq, D]``, untouched rows where the position
    was outside the cache) when q is given, else None."""
    k_view, v_view = _bnsh(k_cache, kv_layout), _bnsh(v_cache, kv_layout)
    capacity = k_view.shape[2]
    positions = np.asarray(seq_lens).astype(np.int64)
    valid = (positions >= 0) & (positions < capacity)
    safe = np.where(valid, positions, 0)
    k_rot = rotate(k_new, safe, rope, cos_sin=cos_sin, theta=theta,
                   key_transform=key_transform)
    for view, scales, rows in ((k_view, k_scale, k_rot), (v_view, v_scale, v_new)):
        q8, token_scale = quantize_rows(rows, scale_mode, scales, scale_dtype)
        for b in np.flatnonzero(valid):
            view[b, :, safe[b]] = q8[b]
            if token_scale is not None:
                scales[b, :, safe[b]] = token_scale[b]
    if advance:
        seq_lens[valid] += 1
    if q is None:
        return None
    q_rot = np.asarray(q, dtype=np.float64).copy()
    if rope is not None and valid.any():
        q_rot[valid] = rope_ref(np.asarray(q, np.float32)[valid], safe[valid], style=rope,
                                cos_sin=cos_sin, theta=theta)
        if key_transform == "hadamard":
            q_rot[valid] = hadamard_rows(q_rot[valid]).astype(np.float64)
    return q_rot


def prompt_ref(k_cache: np.ndarray, v_cache: np.ndarray, k_scale: np.ndarray,
               v_scale: np.ndarray, prompt_lens: np.ndarray, k: np.ndarray, v: np.ndarray, *,
               kv_layout: str, prompt_layout: str = "bsnh", scale_mode: str,
               scale_dtype: Any = np.float32, rope: str | None = None,
               cos_sin: np.ndarray | None = None, theta: float = 10000.0,
               key_transform: str = "none") -> np.ndarray:
    """What PromptQuantizer.run does, in place on host arrays: positions ``0..len-1`` of each
    sequence, lengths clamped to the prompt's S and to S_max. Returns the lengths written."""
    k_view, v_view = _bnsh(k_cache, kv_layout), _bnsh(v_cache, kv_layout)
    if prompt_layout == "bnsh":  # to [B, S, Hkv, D]
        k, v = np.swapaxes(k, 1, 2), np.swapaxes(v, 1, 2)
    capacity, tokens = k_view.shape[2], k.shape[1]
    written = np.clip(np.asarray(prompt_lens).astype(np.int64), 0, min(tokens, capacity))
    for b, length in enumerate(written):
        if length == 0:
            continue
        positions = np.arange(length)
        rows = {"k": rotate(k[b, :length], positions, rope, cos_sin=cos_sin, theta=theta,
                            key_transform=key_transform),
                "v": np.asarray(v[b, :length], np.float32)}
        for view, scales, name in ((k_view, k_scale, "k"), (v_view, v_scale, "v")):
            q8, token_scale = quantize_rows(rows[name], scale_mode, scales, scale_dtype)
            view[b, :, :length] = q8.transpose(1, 0, 2)
            if token_scale is not None:
                scales[b, :, :length] = token_scale.T
    return written
