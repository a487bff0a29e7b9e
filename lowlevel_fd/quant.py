"""Host-side symmetric INT8 quantization math and scale helpers (pure numpy).

Everything is computed in np.float32 on purpose: results must be bit-exact with the
CUDA kernel, which quantizes with IEEE float32 multiply/divide and __float2int_rn.
Dequantization convention: value = int8 * scale.
"""
from __future__ import annotations

import numpy as np

from .core.support import CONTIGUOUS_LAYOUTS as KV_LAYOUTS, SCALE_MODES

QMAX = 127  # symmetric range [-127, 127]; -128 is never produced
_CALIBRATED_MODES = ("tensor", "head")
_SCALE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))


def _require_choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name}: expected one of {valid}, got {value!r}")


def _round_and_saturate(scaled: np.ndarray) -> np.ndarray:
    """float32 -> int8 with round-half-to-even; clip first so out-of-range values saturate."""
    return np.clip(np.rint(scaled), -QMAX, QMAX).astype(np.int8)


def _safe_reciprocal(numerator: np.float32, denominator: np.ndarray) -> np.ndarray:
    """float32 ``numerator / denominator``, with 0 where the denominator is 0."""
    denominator = np.asarray(denominator, dtype=np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        quotient = np.float32(numerator) / denominator
    return np.where(denominator == 0, np.float32(0), quotient).astype(np.float32)


def quantize_with_scale(x: np.ndarray, scale) -> np.ndarray:
    """int8 q = clip(rint(x * (1/scale)), -127, 127) in float32; ``scale`` broadcasts to x.

    The reciprocal is taken once in float32 (as the kernel does); scale == 0 gives q = 0.
    """
    x32 = np.asarray(x, dtype=np.float32)
    inv_scale = _safe_reciprocal(np.float32(1), scale)
    return _round_and_saturate(x32 * inv_scale)


def quantize_per_token_head(
    x: np.ndarray, axis: int = -1, scale_dtype=np.float32
) -> tuple[np.ndarray, np.ndarray]:
    """Quantize with one scale per vector along ``axis`` (head_dim): returns (q int8, scale).

    scale = absmax / 127 (float32), shape of x without ``axis``, cast to ``scale_dtype``
    (float32 or float16). q uses inv = 127 / absmax in float32 *before* that cast, so a
    float16 scale is rounded after quantization, exactly like the kernel. absmax == 0 -> q = 0.
    """
    scale_dtype = np.dtype(scale_dtype)
    if scale_dtype not in _SCALE_DTYPES:
        raise ValueError(f"scale_dtype: expected float32 or float16, got {scale_dtype}")
    x32 = np.asarray(x, dtype=np.float32)
    absmax = np.max(np.abs(x32), axis=axis, keepdims=True)
    scale = absmax / np.float32(QMAX)
    q = _round_and_saturate(x32 * _safe_reciprocal(np.float32(QMAX), absmax))
    return q, np.squeeze(scale, axis=axis).astype(scale_dtype)


def _head_axis(samples: np.ndarray, kv_layout: str) -> int:
    _require_choice("kv_layout", kv_layout, KV_LAYOUTS)
    if samples.ndim != 4:
        expected = "[B, Hkv, S, D]" if kv_layout == "bnsh" else "[B, S, Hkv, D]"
        raise ValueError(f"samples: expected a 4-d {kv_layout!r} array {expected}, "
                         f"got shape {samples.shape}")
    return 1 if kv_layout == "bnsh" else 2


def calibrate_scales(samples: np.ndarray, mode: str, *, kv_layout: str = "bnsh") -> np.ndarray:
    """float32 scales = absmax / 127: shape (1,) for mode "tensor", [Hkv] for mode "head".

    An all-zero entry gets scale 1.0 (not 0) so downstream 1/scale never divides by zero;
    its values still quantize to 0.
    """
    if mode == "token":
        raise ValueError("mode: token scales are computed per token by the kernel, not calibrated")
    _require_choice("mode", mode, _CALIBRATED_MODES)
    samples32 = np.asarray(samples, dtype=np.float32)
    head_axis = _head_axis(samples32, kv_layout)
    magnitudes = np.abs(samples32)
    if mode == "tensor":
        absmax = np.max(magnitudes).reshape(1)
    else:
        other_axes = tuple(axis for axis in range(4) if axis != head_axis)
        absmax = np.max(magnitudes, axis=other_axes)
    scale = absmax / np.float32(QMAX)
    return np.where(absmax == 0, np.float32(1), scale).astype(np.float32)


def _checked_static_scale(scale, mode: str, num_kv_heads: int) -> np.ndarray:
    """Validate a caller-given tensor/head scale; return it as float32 (1,) or [Hkv]."""
    scale = np.asarray(scale, dtype=np.float32)
    if mode == "tensor":
        if scale.shape not in ((), (1,)):
            raise ValueError(
                f"scale: expected shape () or (1,) for mode='tensor', got {scale.shape}")
        return scale.reshape(1)
    if scale.shape != (num_kv_heads,):
        raise ValueError(f"scale: expected shape [Hkv]=({num_kv_heads},) for mode='head', "
                         f"got {scale.shape}")
    return scale


def quantize_cache(
    k_or_v_float: np.ndarray, mode: str, *, kv_layout: str = "bnsh", scale=None,
    scale_dtype=np.float32,
) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a float K or V cache; returns (int8 cache in the same layout, scale).

    "tensor"/"head": float32 scale (1,)/[Hkv], taken from ``scale`` or calibrated.
    "token": scales computed here, returned as [B, Hkv, S] for both layouts in ``scale_dtype``.
    """
    _require_choice("mode", mode, SCALE_MODES)
    x32 = np.asarray(k_or_v_float, dtype=np.float32)
    head_axis = _head_axis(x32, kv_layout)
    if mode == "token":
        if scale is not None:
            raise ValueError("scale: must be None for mode='token' (scales are computed per token)")
        q, token_scale = quantize_per_token_head(x32, axis=-1, scale_dtype=scale_dtype)
        if kv_layout == "bsnh":  # [B, S, Hkv] -> [B, Hkv, S]
            token_scale = np.ascontiguousarray(token_scale.transpose(0, 2, 1))
        return q, token_scale
    if np.dtype(scale_dtype) != np.float32:
        raise ValueError(f"scale_dtype: mode={mode!r} scales are always float32, got "
                         f"{np.dtype(scale_dtype)}")
    if scale is None:
        static_scale = calibrate_scales(x32, mode, kv_layout=kv_layout)
    else:
        static_scale = _checked_static_scale(scale, mode, x32.shape[head_axis])
    if mode == "tensor":
        broadcast_scale = static_scale.reshape(())
    elif kv_layout == "bnsh":
        broadcast_scale = static_scale[None, :, None, None]
    else:
        broadcast_scale = static_scale[None, None, :, None]
    return quantize_with_scale(x32, broadcast_scale), static_scale


# -- key transform ----------------------------------------------------------------------------
_HADAMARD_NORM = {64: np.float32(0.125), 128: np.float32(0.08838834764831845),
                  256: np.float32(0.0625)}  # 1/sqrt(D) rounded to fp32, as cu/rows.cuh


def hadamard_rows(x: np.ndarray) -> np.ndarray:
    """``x [..., D] @ H`` in float32, as the kernels compute it (cu/rows.cuh hadamard_row):
    butterflies over the index bits from the lowest, then one product by 1/sqrt(D). H is the
    normalized Sylvester-Hadamard matrix (``hadamard``), symmetric: ``x @ H == (H @ x.T).T``."""
    y = np.array(x, dtype=np.float32, copy=True)
    head_dim = y.shape[-1]
    if head_dim not in _HADAMARD_NORM:
        raise ValueError(f"x: expected a last dimension in {sorted(_HADAMARD_NORM)}, got "
                         f"{head_dim}")
    lead = y.shape[:-1]
    bit = 1
    while bit < head_dim:
        pairs = y.reshape(*lead, head_dim // (2 * bit), 2, bit)
        low, high = pairs[..., 0, :].copy(), pairs[..., 1, :].copy()
        pairs[..., 0, :], pairs[..., 1, :] = low + high, low - high
        bit *= 2
    return y * _HADAMARD_NORM[head_dim]


def hadamard(head_dim: int) -> np.ndarray:
    """The normalized Sylvester-Hadamard matrix of order ``head_dim`` (64, 128 or 256) as
    float32: entry (i, j) is ``(-1) ** popcount(i & j) / sqrt(head_dim)``. A cache with
    ``key_transform="hadamard"`` stores ``H @ RoPE(k)``; pass ``RoPE(q) @ H`` where the caller
    rotates q itself (``DecodePlan.run``, ``MultiPlan.run(rotate_q=False)``)."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, (int, np.integer)):
        raise TypeError(f"head_dim: expected an int, got {type(head_dim).__name__} "
                        f"{head_dim!r}")
    if head_dim not in _HADAMARD_NORM:
        raise ValueError(f"head_dim: expected one of {sorted(_HADAMARD_NORM)}, got {head_dim}")
    return hadamard_rows(np.eye(int(head_dim), dtype=np.float32))
