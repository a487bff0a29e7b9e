"""Float64 numpy oracle for INT8-KV flash-decoding attention and RoPE.

Test-only: deliberately independent of the kernel-side helpers (``quant.py``)
so that a convention bug there cannot hide in the oracle too.
"""
from __future__ import annotations

import numpy as np

from .core.support import CONTIGUOUS_LAYOUTS as KV_LAYOUTS
from .core.support import ROPE_STYLES as _ROPE_STYLES
from .core.support import SCALE_MODES

ROPE_STYLES = tuple(s for s in _ROPE_STYLES if s is not None)


def _require_choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name}: expected one of {valid}, got {value!r}")


def _cache_dims(cache: np.ndarray, kv_layout: str, name: str) -> tuple[int, int, int, int]:
    """Return (B, Hkv, S_max, D) of a 4-d cache in ``kv_layout``."""
    _require_choice("kv_layout", kv_layout, KV_LAYOUTS)
    if cache.ndim != 4:
        raise ValueError(f"{name}: expected a 4-d cache, got shape {cache.shape}")
    if kv_layout == "bnsh":
        batch, num_kv_heads, max_seq_len, head_dim = cache.shape
    else:
        batch, max_seq_len, num_kv_heads, head_dim = cache.shape
    return batch, num_kv_heads, max_seq_len, head_dim


def _to_bnsh(cache: np.ndarray, kv_layout: str) -> np.ndarray:
    return cache if kv_layout == "bnsh" else cache.transpose(0, 2, 1, 3)


def _broadcastable_scale(
    scale, cache: np.ndarray, kv_layout: str, scale_mode: str, name: str
) -> np.ndarray:
    """Validate ``scale`` for ``scale_mode``; return it as float64, broadcastable to the cache."""
    _require_choice("scale_mode", scale_mode, SCALE_MODES)
    batch, num_kv_heads, max_seq_len, _ = _cache_dims(cache, kv_layout, "cache")
    scale = np.asarray(scale)
    if scale_mode == "tensor":
        if scale.shape not in ((), (1,)):
            raise ValueError(
                f"{name}: expected shape () or (1,) for scale_mode='tensor', got {scale.shape}"
            )
        return scale.astype(np.float64).reshape(())
    if scale_mode == "head":
        if scale.shape != (num_kv_heads,):
            raise ValueError(
                f"{name}: expected shape [Hkv]=({num_kv_heads},) for scale_mode='head', "
                f"got {scale.shape}"
            )
        per_head = scale.astype(np.float64)
        if kv_layout == "bnsh":
            return per_head[None, :, None, None]
        return per_head[None, None, :, None]
    expected = (batch, num_kv_heads, max_seq_len)
    if scale.shape != expected:
        raise ValueError(
            f"{name}: expected shape [B, Hkv, S_max]={expected} for scale_mode='token', "
            f"got {scale.shape}"
        )
    per_token = scale.astype(np.float64)
    # Token scales are [B, Hkv, S_max] for both layouts, so bsnh needs a transpose.
    if kv_layout == "bsnh":
        per_token = per_token.transpose(0, 2, 1)
    return per_token[..., None]


def dequantize_cache(
    cache_int8: np.ndarray, scale, *, kv_layout: str, scale_mode: str, name: str = "scale"
) -> np.ndarray:
    """Return ``int8 * scale`` as float64 in the cache's own layout.

    ``name`` is the argument name used in error messages (e.g. "k_scale").
    """
    cache_int8 = np.asarray(cache_int8)
    if cache_int8.dtype != np.int8:
        raise ValueError(f"cache: expected dtype int8, got {cache_int8.dtype}")
    scale = _broadcastable_scale(scale, cache_int8, kv_layout, scale_mode, name)
    return cache_int8.astype(np.float64) * scale


def _check_query(q: np.ndarray, batch: int, num_kv_heads: int, head_dim: int) -> None:
    if q.ndim != 3:
        raise ValueError(f"q: expected shape [B, Hq, D], got {q.shape}")
    if q.shape[0] != batch or q.shape[2] != head_dim:
        raise ValueError(
            f"q: expected shape [B={batch}, Hq, D={head_dim}] to match the cache, got {q.shape}"
        )
    if q.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"q: number of query heads {q.shape[1]} is not a multiple of Hkv={num_kv_heads}"
        )


def _check_seq_lens(seq_lens, batch: int, max_seq_len: int) -> np.ndarray:
    seq_lens = np.asarray(seq_lens)
    if seq_lens.shape != (batch,) or not np.issubdtype(seq_lens.dtype, np.integer):
        raise ValueError(f"seq_lens: expected an integer array of shape ({batch},), "
                         f"got {seq_lens.dtype} {seq_lens.shape}")
    if np.any(seq_lens < 0) or np.any(seq_lens > max_seq_len):
        raise ValueError(f"seq_lens: values must lie in [0, S_max={max_seq_len}], "
                         f"got {seq_lens.tolist()}")
    return seq_lens


def _softmax_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, sm_scale: float
) -> tuple[np.ndarray, np.ndarray]:
    """One batch row: q [Hq, D], k/v [Hkv, L, D] float64 (L >= 1) -> (out [Hq, D], lse [Hq])."""
    num_kv_heads, _, head_dim = k.shape
    group_size = q.shape[0] // num_kv_heads
    # Query head h = g * G + j uses kv head g, so [Hq, D] -> [Hkv, G, D] groups them.
    q_grouped = q.reshape(num_kv_heads, group_size, head_dim)
    scores = np.matmul(q_grouped, k.transpose(0, 2, 1)) * sm_scale  # [Hkv, G, L]
    row_max = scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores - row_max)
    denom = weights.sum(axis=-1, keepdims=True)
    out = np.matmul(weights, v) / denom  # [Hkv, G, D]
    lse = row_max[..., 0] + np.log(denom[..., 0])
    return out.reshape(-1, head_dim), lse.reshape(-1)


def _attention(
    q: np.ndarray, dequantized_kv_row, batch: int, num_kv_heads: int,
    max_seq_len: int, head_dim: int, seq_lens, sm_scale: float | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Loop over batch rows; ``dequantized_kv_row(b, L)`` gives float64 bnsh k/v [Hkv, L, D]."""
    q = np.asarray(q)
    _check_query(q, batch, num_kv_heads, head_dim)
    seq_lens = _check_seq_lens(seq_lens, batch, max_seq_len)
    if sm_scale is None:
        sm_scale = 1.0 / np.sqrt(head_dim)
    q64 = q.astype(np.float64)
    out = np.zeros(q.shape, dtype=np.float64)
    lse = np.full(q.shape[:2], -np.inf, dtype=np.float64)
    for b in range(batch):
        length = int(seq_lens[b])
        if length == 0:  # empty softmax: defined as zero output, lse = log(0) = -inf
            continue
        k_row, v_row = dequantized_kv_row(b, length)
        out[b], lse[b] = _softmax_attention(q64[b], k_row, v_row, float(sm_scale))
    return out, lse


def decode_attention_ref(
    q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, k_scale, v_scale, seq_lens,
    *, kv_layout: str = "bnsh", scale_mode: str = "token", sm_scale: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Attention over an int8 KV cache: q [B, Hq, D] -> (out [B, Hq, D], lse [B, Hq]) float64.

    lse is the natural-log logsumexp of the scaled scores; seq_lens[b] == 0 gives 0 / -inf.
    """
    k_cache, v_cache = np.asarray(k_cache), np.asarray(v_cache)
    dims = _cache_dims(k_cache, kv_layout, "k_cache")
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache: expected shape {k_cache.shape} like k_cache, got {v_cache.shape}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype != np.int8:
            raise ValueError(f"{name}: expected dtype int8, got {cache.dtype}")
    k_scale_b = _broadcastable_scale(k_scale, k_cache, kv_layout, scale_mode, "k_scale")
    v_scale_b = _broadcastable_scale(v_scale, v_cache, kv_layout, scale_mode, "v_scale")

    def dequantized_kv_row(b: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        # Dequantize only the live prefix of one batch row to bound memory for long caches.
        return (_live_prefix(k_cache, k_scale_b, b, length, kv_layout),
                _live_prefix(v_cache, v_scale_b, b, length, kv_layout))

    return _attention(q, dequantized_kv_row, *dims, seq_lens, sm_scale)


def _live_prefix(
    cache: np.ndarray, scale: np.ndarray, b: int, length: int, kv_layout: str
) -> np.ndarray:
    """Row b of ``cache * scale`` as contiguous float64 bnsh [Hkv, length, D]."""
    cache_row = _to_bnsh(cache, kv_layout)[b, :, :length]
    scale_row = _to_bnsh(np.broadcast_to(scale, cache.shape), kv_layout)[b, :, :length]
    # order="C" makes both layouts hit matmul with identical memory, hence identical results.
    return np.multiply(cache_row, scale_row, dtype=np.float64, order="C")


def attention_ref_fp(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, seq_lens,
    *, kv_layout: str = "bnsh", sm_scale: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Same as ``decode_attention_ref`` but with unquantized float K/V caches."""
    k, v = np.asarray(k), np.asarray(v)
    dims = _cache_dims(k, kv_layout, "k")
    if v.shape != k.shape:
        raise ValueError(f"v: expected shape {k.shape} like k, got {v.shape}")

    unit = np.float64(1.0)

    def kv_row(b: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        return (_live_prefix(k, unit, b, length, kv_layout),
                _live_prefix(v, unit, b, length, kv_layout))

    return _attention(q, kv_row, *dims, seq_lens, sm_scale)


def _inv_freq(head_dim: int, theta: float) -> np.ndarray:
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim: must be even for RoPE, got {head_dim}")
    return float(theta) ** (-2.0 * np.arange(head_dim // 2, dtype=np.float64) / head_dim)


def rope_table(max_pos: int, head_dim: int, theta: float = 10000.0) -> np.ndarray:
    """float32 [max_pos, D/2, 2] table of (cos, sin) per position and frequency index."""
    angles = np.arange(max_pos, dtype=np.float64)[:, None] * _inv_freq(head_dim, theta)[None, :]
    return np.stack([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)


def rope_ref(
    x: np.ndarray, positions, *, style: str, cos_sin: np.ndarray | None = None,
    theta: float = 10000.0,
) -> np.ndarray:
    """Rotate x [B, H, D] by positions [B]; returns float64.

    style "neox" pairs (i, i + D/2); "gptj" pairs (2i, 2i + 1). ``cos_sin`` overrides ``theta``.
    """
    _require_choice("style", style, ROPE_STYLES)
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 3:
        raise ValueError(f"x: expected shape [B, H, D], got {x.shape}")
    head_dim = x.shape[2]
    positions = np.asarray(positions)
    if positions.shape != (x.shape[0],) or not np.issubdtype(positions.dtype, np.integer):
        raise ValueError(f"positions: expected an integer array of shape ({x.shape[0]},), "
                         f"got {positions.dtype} {positions.shape}")
    if cos_sin is None:
        angles = positions.astype(np.float64)[:, None] * _inv_freq(head_dim, theta)[None, :]
        cos, sin = np.cos(angles), np.sin(angles)
    else:
        cos_sin = np.asarray(cos_sin)
        if cos_sin.ndim != 3 or cos_sin.shape[1:] != (head_dim // 2, 2) or head_dim % 2:
            raise ValueError(f"cos_sin: expected shape [max_pos, D/2={head_dim // 2}, 2], "
                             f"got {cos_sin.shape}")
        if np.any(positions < 0) or np.any(positions >= cos_sin.shape[0]):
            raise ValueError(f"positions: values must lie in [0, max_pos={cos_sin.shape[0]}), "
                             f"got {positions.tolist()}")
        rows = cos_sin[positions].astype(np.float64)
        cos, sin = rows[..., 0], rows[..., 1]
    cos, sin = cos[:, None, :], sin[:, None, :]  # [B, 1, D/2], broadcast over heads
    if style == "neox":
        first, second = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    else:
        first, second = x[..., 0::2], x[..., 1::2]
    rotated_first = first * cos - second * sin
    rotated_second = first * sin + second * cos
    out = np.empty_like(x)
    if style == "neox":
        out[..., : head_dim // 2], out[..., head_dim // 2 :] = rotated_first, rotated_second
    else:
        out[..., 0::2], out[..., 1::2] = rotated_first, rotated_second
    return out
