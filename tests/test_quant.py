"""Specification tests for host-side INT8 quantization math (lowlevel_fd.quant)."""
from __future__ import annotations

import re

import numpy as np
import pytest

from lowlevel_fd.quant import (
    QMAX,
    calibrate_scales,
    hadamard,
    hadamard_rows,
    quantize_cache,
    quantize_per_token_head,
    quantize_with_scale,
)
from lowlevel_fd.reference import dequantize_cache

BATCH, NUM_KV_HEADS, SEQ_LEN, HEAD_DIM = 2, 3, 11, 32


def float_cache(seed: int, kv_layout: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (BATCH, NUM_KV_HEADS, SEQ_LEN, HEAD_DIM) if kv_layout == "bnsh" else \
        (BATCH, SEQ_LEN, NUM_KV_HEADS, HEAD_DIM)
    return rng.standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------- quantize_with_scale


@pytest.mark.parametrize("scale", [0.01, 0.37, 3.0])
def test_out_of_range_values_saturate_instead_of_wrapping(scale):
    x = np.array([1000 * scale, -1000 * scale, 127.6 * scale, -127.6 * scale, 1e30, -np.inf])
    q = quantize_with_scale(x, scale)
    assert q.dtype == np.int8
    np.testing.assert_array_equal(q, [127, -127, 127, -127, 127, -127])


def test_rounds_half_to_even():
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 125.5, 126.5])
    np.testing.assert_array_equal(quantize_with_scale(x, 1.0), [0, 2, 2, 0, -2, -2, 126, 126])


def test_reciprocal_is_taken_in_float32():
    # float32(1) / float32(0.1) == 10.0 exactly, and float32(0.35) * 10 rounds to 3.5 -> 4,
    # although the exact quotient 0.35 / 0.1 in float64 is 3.4999999 -> 3.
    assert float(np.float32(0.35)) / float(np.float32(0.1)) < 3.5
    np.testing.assert_array_equal(quantize_with_scale(np.float32(0.35), np.float32(0.1)), 4)


def test_zero_scale_gives_zero_without_warnings():
    x = np.random.default_rng(0).standard_normal(8).astype(np.float32)
    with np.errstate(all="raise"):
        q = quantize_with_scale(x, np.float32(0))
    np.testing.assert_array_equal(q, np.zeros(8, np.int8))


def test_scale_broadcasts_per_row():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 16)).astype(np.float32)
    scales = np.array([[0.01], [0.02], [0.05], [0.1]], np.float32)
    q = quantize_with_scale(x, scales)
    for row in range(4):
        np.testing.assert_array_equal(q[row], quantize_with_scale(x[row], scales[row, 0]))


@pytest.mark.parametrize("scale", [0.004, 0.02, 0.5])
def test_in_range_dequantization_error_is_at_most_half_a_step(scale):
    x = np.random.default_rng(2).standard_normal(4096).astype(np.float32) * 120 * scale / 4
    x = np.clip(x, -127 * scale, 127 * scale)
    error = np.abs(quantize_with_scale(x, scale).astype(np.float64) * np.float32(scale) - x)
    assert np.all(error <= scale / 2 * (1 + 1e-5))


# ---------------------------------------------------------------- quantize_per_token_head


@pytest.mark.parametrize("axis", [-1, 1])
def test_per_token_head_matches_float32_formula(axis):
    x = np.random.default_rng(3).standard_normal((5, 16, 7))
    q, scale = quantize_per_token_head(x, axis=axis)
    x32 = x.astype(np.float32)
    absmax = np.max(np.abs(x32), axis=axis, keepdims=True)
    expected_q = np.clip(np.rint(x32 * (np.float32(127) / absmax)), -127, 127).astype(np.int8)
    assert q.dtype == np.int8 and scale.dtype == np.float32
    np.testing.assert_array_equal(q, expected_q)
    np.testing.assert_array_equal(scale, np.squeeze(absmax / np.float32(127), axis=axis))


def test_absmax_element_maps_to_exactly_plus_minus_127():
    x = np.random.default_rng(4).standard_normal((64, 128)).astype(np.float32)
    q, _ = quantize_per_token_head(x)
    argmax = np.argmax(np.abs(x), axis=-1)
    rows = np.arange(64)
    np.testing.assert_array_equal(q[rows, argmax], np.sign(x[rows, argmax]) * QMAX)
    assert q.min() >= -QMAX


def test_zero_row_gives_zero_scale_and_zero_values():
    x = np.random.default_rng(5).standard_normal((3, 16)).astype(np.float32)
    x[1] = 0.0
    with np.errstate(all="raise"):
        q, scale = quantize_per_token_head(x)
    assert scale[1] == 0
    np.testing.assert_array_equal(q[1], np.zeros(16, np.int8))
    assert np.all(scale[[0, 2]] > 0)


def test_float16_scale_is_rounded_after_quantization():
    x = np.random.default_rng(6).standard_normal((8, 64)).astype(np.float32)
    q16, scale16 = quantize_per_token_head(x, scale_dtype=np.float16)
    q32, scale32 = quantize_per_token_head(x, scale_dtype=np.float32)
    assert scale16.dtype == np.float16
    np.testing.assert_array_equal(q16, q32)
    np.testing.assert_array_equal(scale16, scale32.astype(np.float16))


def test_per_token_head_dequantization_error_is_at_most_half_a_step():
    x = np.random.default_rng(7).standard_normal((32, 128)).astype(np.float32) * 3
    q, scale = quantize_per_token_head(x)
    error = np.abs(q * scale[:, None].astype(np.float64) - x)
    assert np.all(error <= scale[:, None] / 2 * (1 + 1e-5))


def test_per_token_head_rejects_other_scale_dtypes():
    x = np.random.default_rng(8).standard_normal((2, 8))
    with pytest.raises(ValueError, match=re.escape("scale_dtype: expected float32 or float16, got float64")):
        quantize_per_token_head(x, scale_dtype=np.float64)


# ---------------------------------------------------------------- calibrate_scales


@pytest.mark.parametrize("kv_layout", ["bnsh", "bsnh"])
def test_calibrate_tensor_scale(kv_layout):
    samples = float_cache(9, kv_layout)
    scale = calibrate_scales(samples, "tensor", kv_layout=kv_layout)
    assert scale.shape == (1,) and scale.dtype == np.float32
    np.testing.assert_array_equal(scale, [np.max(np.abs(samples)) / np.float32(127)])


@pytest.mark.parametrize("kv_layout", ["bnsh", "bsnh"])
def test_calibrate_head_scales(kv_layout):
    samples = float_cache(10, kv_layout)
    head_axis = 1 if kv_layout == "bnsh" else 2
    samples_bnsh = np.moveaxis(samples, head_axis, 1)
    samples_bnsh[:, 1] *= 4  # make heads clearly different
    scale = calibrate_scales(samples, "head", kv_layout=kv_layout)
    expected = np.abs(samples_bnsh).max(axis=(0, 2, 3)) / np.float32(127)
    assert scale.shape == (NUM_KV_HEADS,) and scale.dtype == np.float32
    np.testing.assert_array_equal(scale, expected)


def test_calibrate_all_zero_head_gets_scale_one():
    samples = float_cache(11, "bnsh")
    samples[:, 2] = 0.0
    scale = calibrate_scales(samples, "head")
    assert scale[2] == 1.0 and np.all(scale[:2] < 1.0)
    np.testing.assert_array_equal(calibrate_scales(np.zeros_like(samples), "tensor"), [1.0])


@pytest.mark.parametrize(
    ("mode", "kwargs", "message"),
    [
        ("token", {}, "mode: token scales are computed per token by the kernel, not calibrated"),
        ("channel", {}, "mode: expected one of ('tensor', 'head'), got 'channel'"),
        ("head", {"kv_layout": "bhsd"}, "kv_layout: expected one of ('bnsh', 'bsnh'), got 'bhsd'"),
    ],
)
def test_calibrate_errors(mode, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        calibrate_scales(float_cache(12, "bnsh"), mode, **kwargs)


def test_calibrate_rejects_non_4d_samples():
    with pytest.raises(ValueError, match=re.escape(
            "samples: expected a 4-d 'bsnh' array [B, S, Hkv, D], got shape (3, 4)")):
        calibrate_scales(np.ones((3, 4)), "tensor", kv_layout="bsnh")


# ---------------------------------------------------------------- quantize_cache


@pytest.mark.parametrize(("mode", "max_relative_error"), [("tensor", 0.02), ("head", 0.02), ("token", 0.01)])
@pytest.mark.parametrize("kv_layout", ["bnsh", "bsnh"])
def test_quantize_cache_round_trip(kv_layout, mode, max_relative_error):
    x = float_cache(13, kv_layout)
    q, scale = quantize_cache(x, mode, kv_layout=kv_layout)
    assert q.dtype == np.int8 and q.shape == x.shape
    expected_scale_shape = {"tensor": (1,), "head": (NUM_KV_HEADS,),
                            "token": (BATCH, NUM_KV_HEADS, SEQ_LEN)}[mode]
    assert scale.shape == expected_scale_shape
    restored = dequantize_cache(q, scale, kv_layout=kv_layout, scale_mode=mode)
    relative_error = np.linalg.norm(restored - x) / np.linalg.norm(x)
    assert relative_error < max_relative_error


@pytest.mark.parametrize("mode", ["tensor", "head", "token"])
def test_quantize_cache_layouts_agree(mode):
    x_bnsh = float_cache(14, "bnsh")
    x_bsnh = np.ascontiguousarray(x_bnsh.transpose(0, 2, 1, 3))
    q_bnsh, scale_bnsh = quantize_cache(x_bnsh, mode, kv_layout="bnsh")
    q_bsnh, scale_bsnh = quantize_cache(x_bsnh, mode, kv_layout="bsnh")
    np.testing.assert_array_equal(q_bsnh, q_bnsh.transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(scale_bsnh, scale_bnsh)


def test_quantize_cache_token_mode_matches_per_token_head():
    x = float_cache(15, "bsnh")
    q, scale = quantize_cache(x, "token", kv_layout="bsnh", scale_dtype=np.float16)
    expected_q, expected_scale = quantize_per_token_head(x, scale_dtype=np.float16)
    assert scale.dtype == np.float16 and scale.flags.c_contiguous
    np.testing.assert_array_equal(q, expected_q)
    np.testing.assert_array_equal(scale, expected_scale.transpose(0, 2, 1))


@pytest.mark.parametrize("given_scale", [0.05, np.float32(0.05), np.array([0.05], np.float32)])
def test_quantize_cache_uses_given_tensor_scale(given_scale):
    x = float_cache(16, "bnsh")
    q, scale = quantize_cache(x, "tensor", scale=given_scale)
    np.testing.assert_array_equal(scale, np.array([0.05], np.float32))
    np.testing.assert_array_equal(q, quantize_with_scale(x, np.float32(0.05)))


def test_quantize_cache_uses_given_head_scales():
    x = float_cache(17, "bsnh")
    head_scales = np.array([0.01, 0.02, 0.03], np.float32)
    q, scale = quantize_cache(x, "head", kv_layout="bsnh", scale=head_scales)
    np.testing.assert_array_equal(scale, head_scales)
    np.testing.assert_array_equal(q, quantize_with_scale(x, head_scales[None, None, :, None]))


@pytest.mark.parametrize(
    ("mode", "kwargs", "message"),
    [
        ("head", {"scale": np.ones(2, np.float32)},
         "scale: expected shape [Hkv]=(3,) for mode='head', got (2,)"),
        ("tensor", {"scale": np.ones(3, np.float32)},
         "scale: expected shape () or (1,) for mode='tensor', got (3,)"),
        ("token", {"scale": np.ones((BATCH, NUM_KV_HEADS, SEQ_LEN), np.float32)},
         "scale: must be None for mode='token' (scales are computed per token)"),
        ("head", {"scale_dtype": np.float16}, "scale_dtype: mode='head' scales are always float32, got float16"),
        ("channel", {}, "mode: expected one of ('tensor', 'head', 'token'), got 'channel'"),
        ("token", {"kv_layout": "nhsd"}, "kv_layout: expected one of ('bnsh', 'bsnh'), got 'nhsd'"),
    ],
)
def test_quantize_cache_errors(mode, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        quantize_cache(float_cache(18, "bnsh"), mode, **kwargs)


# -- the key transform ---------------------------------------------------------------------------
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_hadamard_is_the_normalized_sylvester_matrix(head_dim):
    index = np.arange(head_dim)
    signs = np.array([[(-1.0) ** bin(i & j).count("1") for j in index] for i in index])
    h = hadamard(head_dim)
    assert h.dtype == np.float32
    np.testing.assert_allclose(h, signs / np.sqrt(head_dim), rtol=1e-7, atol=0)
    np.testing.assert_allclose(h.astype(np.float64) @ h, np.eye(head_dim), atol=1e-6)
    np.testing.assert_array_equal(h, h.T)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_hadamard_rows_is_the_fp32_butterfly(head_dim):
    """Bit for bit the kernels' order: butterflies over the index bits from the lowest, each a
    rounded fp32 sum or difference, then one fp32 product by 1/sqrt(D)."""
    x = np.random.default_rng(3).standard_normal((4, 3, head_dim)).astype(np.float32)
    y = x.copy()
    bit = 1
    while bit < head_dim:
        for i in range(head_dim):
            if not i & bit:
                a, b = y[..., i].copy(), y[..., i | bit].copy()
                y[..., i], y[..., i | bit] = a + b, a - b
        bit *= 2
    expected = y * np.float32(1.0 / np.sqrt(head_dim))
    got = hadamard_rows(x)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(x, np.random.default_rng(3).standard_normal(
        (4, 3, head_dim)).astype(np.float32))  # the input is not modified
    np.testing.assert_allclose(got, x @ hadamard(head_dim), atol=1e-5)


@pytest.mark.parametrize("head_dim, error, message", [
    (32, ValueError, r"^head_dim: expected one of \[64, 128, 256\], got 32$"),
    (128.0, TypeError, r"^head_dim: expected an int, got float 128.0$"),
    (True, TypeError, r"^head_dim: expected an int, got bool True$"),
])
def test_hadamard_names_a_bad_head_dim(head_dim, error, message):
    with pytest.raises(error, match=message):
        hadamard(head_dim)


def test_hadamard_rows_rejects_other_head_dims():
    with pytest.raises(ValueError, match=r"^x: expected a last dimension in \[64, 128, 256\], "
                                         r"got 32$"):
        hadamard_rows(np.zeros((2, 32), np.float32))
