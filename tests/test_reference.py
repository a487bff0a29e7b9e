"""Specification tests for the float64 numpy oracle (lowlevel_fd.reference)."""
from __future__ import annotations

import math
import re
import warnings

import numpy as np
import pytest

from lowlevel_fd.reference import (
    attention_ref_fp,
    decode_attention_ref,
    dequantize_cache,
    rope_ref,
    rope_table,
)

BATCH, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_SEQ_LEN = 2, 8, 2, 16, 37
GROUP_SIZE = NUM_Q_HEADS // NUM_KV_HEADS
RAGGED_SEQ_LENS = [[37, 0], [1, 23], [0, 1]]


def make_inputs(seed: int, scale_mode: str, scale_dtype=np.float32):
    """Logical bnsh data: q [B, Hq, D] f32, int8 k/v [B, Hkv, S, D], scales for ``scale_mode``."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((BATCH, NUM_Q_HEADS, HEAD_DIM)).astype(np.float32)
    cache_shape = (BATCH, NUM_KV_HEADS, MAX_SEQ_LEN, HEAD_DIM)
    k = rng.integers(-127, 128, size=cache_shape, dtype=np.int8)
    v = rng.integers(-127, 128, size=cache_shape, dtype=np.int8)
    scale_shape = {"tensor": (), "head": (NUM_KV_HEADS,),
                   "token": (BATCH, NUM_KV_HEADS, MAX_SEQ_LEN)}[scale_mode]
    k_scale = rng.uniform(0.005, 0.02, size=scale_shape).astype(scale_dtype)
    v_scale = rng.uniform(0.005, 0.02, size=scale_shape).astype(scale_dtype)
    return q, k, v, k_scale, v_scale


def to_layout(cache_bnsh: np.ndarray, kv_layout: str) -> np.ndarray:
    return cache_bnsh if kv_layout == "bnsh" else np.ascontiguousarray(cache_bnsh.transpose(0, 2, 1, 3))


def scale_at(scale, scale_mode: str, b: int, g: int, t: int) -> float:
    if scale_mode == "tensor":
        return float(np.asarray(scale).reshape(()))
    if scale_mode == "head":
        return float(scale[g])
    return float(scale[b, g, t])


def naive_decode(q, k, v, k_scale, v_scale, seq_lens, scale_mode, sm_scale):
    """Per-(b, h, t) python loops over logical bnsh int8 k/v; returns (out, lse) float64."""
    out = np.zeros(q.shape)
    lse = np.full(q.shape[:2], -np.inf)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            g = h // GROUP_SIZE
            scores, values = [], []
            for t in range(seq_lens[b]):
                k_t = k[b, g, t].astype(np.float64) * scale_at(k_scale, scale_mode, b, g, t)
                v_t = v[b, g, t].astype(np.float64) * scale_at(v_scale, scale_mode, b, g, t)
                scores.append(sm_scale * float(np.dot(q[b, h].astype(np.float64), k_t)))
                values.append(v_t)
            if not scores:
                continue
            exps = [math.exp(s) for s in scores]
            total = sum(exps)
            out[b, h] = sum(e * val for e, val in zip(exps, values)) / total
            lse[b, h] = math.log(total)
    return out, lse


@pytest.mark.parametrize("seq_lens", RAGGED_SEQ_LENS)
@pytest.mark.parametrize("scale_mode", ["tensor", "head", "token"])
@pytest.mark.parametrize("kv_layout", ["bnsh", "bsnh"])
def test_decode_matches_naive_loops(kv_layout, scale_mode, seq_lens):
    q, k, v, k_scale, v_scale = make_inputs(seed=1, scale_mode=scale_mode)
    out, lse = decode_attention_ref(
        q, to_layout(k, kv_layout), to_layout(v, kv_layout), k_scale, v_scale,
        np.array(seq_lens), kv_layout=kv_layout, scale_mode=scale_mode)
    expected_out, expected_lse = naive_decode(
        q, k, v, k_scale, v_scale, seq_lens, scale_mode, sm_scale=1 / math.sqrt(HEAD_DIM))
    assert out.dtype == np.float64 and lse.dtype == np.float64
    assert out.shape == (BATCH, NUM_Q_HEADS, HEAD_DIM) and lse.shape == (BATCH, NUM_Q_HEADS)
    np.testing.assert_allclose(out, expected_out, rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected_lse))
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-12)


@pytest.mark.parametrize("sm_scale", [0.05, 1.0, 2.5])
def test_sm_scale_override(sm_scale):
    q, k, v, k_scale, v_scale = make_inputs(seed=2, scale_mode="token")
    seq_lens = [37, 5]
    out, lse = decode_attention_ref(q, k, v, k_scale, v_scale, np.array(seq_lens), sm_scale=sm_scale)
    expected_out, expected_lse = naive_decode(q, k, v, k_scale, v_scale, seq_lens, "token", sm_scale)
    np.testing.assert_allclose(out, expected_out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-12)


@pytest.mark.parametrize("tensor_scale_form", ["python_float", "0d", "shape_1"])
def test_tensor_scale_accepts_scalar_forms(tensor_scale_form):
    q, k, v, _, _ = make_inputs(seed=3, scale_mode="tensor")
    wrap = {"python_float": float, "0d": np.float32, "shape_1": lambda s: np.array([s], np.float32)}
    seq_lens = np.array([20, 37])
    k_scale, v_scale = wrap[tensor_scale_form](0.01), wrap[tensor_scale_form](0.02)
    out, lse = decode_attention_ref(q, k, v, k_scale, v_scale, seq_lens, scale_mode="tensor")
    expected_out, expected_lse = naive_decode(q, k, v, k_scale, v_scale, seq_lens,
                                              "tensor", 1 / math.sqrt(HEAD_DIM))
    np.testing.assert_allclose(out, expected_out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-12)


@pytest.mark.parametrize("q_dtype", [np.float16, np.float32, np.float64])
def test_query_dtypes_accepted(q_dtype):
    q, k, v, k_scale, v_scale = make_inputs(seed=4, scale_mode="head")
    out, _ = decode_attention_ref(q.astype(q_dtype), k, v, k_scale, v_scale, np.array([9, 37]),
                                  scale_mode="head")
    expected_out, _ = naive_decode(q.astype(q_dtype), k, v, k_scale, v_scale, [9, 37], "head",
                                   1 / math.sqrt(HEAD_DIM))
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, expected_out, rtol=1e-12, atol=1e-14)


def test_token_scales_float16_accepted():
    q, k, v, k_scale, v_scale = make_inputs(seed=5, scale_mode="token", scale_dtype=np.float16)
    out, _ = decode_attention_ref(q, k, v, k_scale, v_scale, np.array([37, 12]))
    expected_out, _ = naive_decode(q, k, v, k_scale, v_scale, [37, 12], "token", 1 / math.sqrt(HEAD_DIM))
    np.testing.assert_allclose(out, expected_out, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("scale_mode", ["tensor", "head", "token"])
def test_zero_length_row_is_zero_and_neg_inf_without_warnings(scale_mode):
    q, k, v, k_scale, v_scale = make_inputs(seed=6, scale_mode=scale_mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = decode_attention_ref(q, k, v, k_scale, v_scale, np.array([0, 0]),
                                        scale_mode=scale_mode)
    np.testing.assert_array_equal(out, np.zeros_like(out))
    assert np.all(np.isneginf(lse))


@pytest.mark.parametrize("scale_mode", ["tensor", "head", "token"])
def test_layouts_give_identical_results(scale_mode):
    q, k, v, k_scale, v_scale = make_inputs(seed=7, scale_mode=scale_mode)
    seq_lens = np.array([37, 17])
    bnsh = decode_attention_ref(q, k, v, k_scale, v_scale, seq_lens,
                                kv_layout="bnsh", scale_mode=scale_mode)
    bsnh = decode_attention_ref(q, to_layout(k, "bsnh"), to_layout(v, "bsnh"), k_scale, v_scale,
                                seq_lens, kv_layout="bsnh", scale_mode=scale_mode)
    np.testing.assert_array_equal(bnsh[0], bsnh[0])
    np.testing.assert_array_equal(bnsh[1], bsnh[1])


@pytest.mark.parametrize("kv_layout", ["bnsh", "bsnh"])
def test_fp_reference_equals_quantized_reference_on_dequantized_cache(kv_layout):
    q, k, v, k_scale, v_scale = make_inputs(seed=8, scale_mode="token")
    k, v = to_layout(k, kv_layout), to_layout(v, kv_layout)
    seq_lens = np.array([1, 30])
    k_float = dequantize_cache(k, k_scale, kv_layout=kv_layout, scale_mode="token")
    v_float = dequantize_cache(v, v_scale, kv_layout=kv_layout, scale_mode="token")
    fp_out, fp_lse = attention_ref_fp(q, k_float, v_float, seq_lens, kv_layout=kv_layout, sm_scale=0.3)
    q_out, q_lse = decode_attention_ref(q, k, v, k_scale, v_scale, seq_lens,
                                        kv_layout=kv_layout, sm_scale=0.3)
    np.testing.assert_array_equal(fp_out, q_out)
    np.testing.assert_array_equal(fp_lse, q_lse)


@pytest.mark.parametrize("kv_layout", ["bnsh", "bsnh"])
def test_dequantize_cache_multiplies_in_own_layout(kv_layout):
    _, k, _, k_scale, _ = make_inputs(seed=9, scale_mode="token")
    deq = dequantize_cache(to_layout(k, kv_layout), k_scale, kv_layout=kv_layout, scale_mode="token")
    expected_bnsh = k.astype(np.float64) * k_scale.astype(np.float64)[..., None]
    assert deq.dtype == np.float64
    np.testing.assert_array_equal(deq, to_layout(expected_bnsh, kv_layout))


@pytest.mark.parametrize(
    ("scale_mode", "bad_scale", "message"),
    [
        ("head", np.ones(4, np.float32),
         "k_scale: expected shape [Hkv]=(2,) for scale_mode='head', got (4,)"),
        ("tensor", np.ones(2, np.float32),
         "k_scale: expected shape () or (1,) for scale_mode='tensor', got (2,)"),
        ("token", np.ones((BATCH, MAX_SEQ_LEN, NUM_KV_HEADS), np.float32),
         "k_scale: expected shape [B, Hkv, S_max]=(2, 2, 37) for scale_mode='token', got (2, 37, 2)"),
    ],
)
def test_scale_shape_errors_name_the_argument(scale_mode, bad_scale, message):
    q, k, v, _, v_scale = make_inputs(seed=10, scale_mode=scale_mode)
    with pytest.raises(ValueError, match=re.escape(message)):
        decode_attention_ref(q, k, v, bad_scale, v_scale, np.array([3, 4]), scale_mode=scale_mode)
    with pytest.raises(ValueError, match=re.escape(message.replace("k_scale", "scale"))):
        dequantize_cache(k, bad_scale, kv_layout="bnsh", scale_mode=scale_mode)


def test_bsnh_token_scale_shape_is_still_b_hkv_s():
    _, k, v, _, _ = make_inputs(seed=11, scale_mode="token")
    bsnh_shaped_scale = np.ones((BATCH, MAX_SEQ_LEN, NUM_KV_HEADS), np.float32)
    with pytest.raises(ValueError, match=re.escape("expected shape [B, Hkv, S_max]=(2, 2, 37)")):
        dequantize_cache(to_layout(k, "bsnh"), bsnh_shaped_scale, kv_layout="bsnh", scale_mode="token")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kv_layout": "bhsd"}, "kv_layout: expected one of ('bnsh', 'bsnh'), got 'bhsd'"),
        ({"scale_mode": "channel"}, "scale_mode: expected one of ('tensor', 'head', 'token'), got 'channel'"),
        ({"seq_lens": np.array([38, 1])}, "seq_lens: values must lie in [0, S_max=37], got [38, 1]"),
        ({"seq_lens": np.array([-1, 1])}, "seq_lens: values must lie in [0, S_max=37], got [-1, 1]"),
        ({"q": np.ones((BATCH, 5, HEAD_DIM), np.float32)},
         "q: number of query heads 5 is not a multiple of Hkv=2"),
        ({"k_cache": np.ones((BATCH, NUM_KV_HEADS, MAX_SEQ_LEN, HEAD_DIM), np.float32)},
         "k_cache: expected dtype int8, got float32"),
    ],
)
def test_decode_argument_errors(overrides, message):
    q, k, v, k_scale, v_scale = make_inputs(seed=12, scale_mode="token")
    kwargs = {"q": q, "k_cache": k, "v_cache": v, "k_scale": k_scale, "v_scale": v_scale,
              "seq_lens": np.array([3, 4]), **overrides}
    with pytest.raises(ValueError, match=re.escape(message)):
        decode_attention_ref(**kwargs)


# ---------------------------------------------------------------- RoPE


def rope_inputs(seed: int, head_dim: int = 16):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, 4, head_dim))
    positions = np.array([0, 7, 4095])
    return x, positions


def pair_norms(x: np.ndarray, style: str) -> np.ndarray:
    half = x.shape[-1] // 2
    if style == "neox":
        return np.hypot(x[..., :half], x[..., half:])
    return np.hypot(x[..., 0::2], x[..., 1::2])


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rope_preserves_pair_norms(style):
    x, positions = rope_inputs(seed=20)
    np.testing.assert_allclose(pair_norms(rope_ref(x, positions, style=style), style),
                               pair_norms(x, style), rtol=1e-13)


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rope_position_zero_is_identity(style):
    x, _ = rope_inputs(seed=21)
    np.testing.assert_array_equal(rope_ref(x, np.zeros(3, np.int64), style=style), x)


def test_rope_styles_differ():
    x, positions = rope_inputs(seed=22)
    neox, gptj = rope_ref(x, positions, style="neox"), rope_ref(x, positions, style="gptj")
    assert not np.allclose(neox[1:], gptj[1:])


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rope_matches_complex_rotation(style):
    x, positions = rope_inputs(seed=23)
    half = x.shape[-1] // 2
    angles = positions[:, None, None] * 10000.0 ** (-2.0 * np.arange(half) / x.shape[-1])
    first, second = (x[..., :half], x[..., half:]) if style == "neox" else (x[..., 0::2], x[..., 1::2])
    rotated = (first + 1j * second) * np.exp(1j * angles)
    out = rope_ref(x, positions, style=style)
    out_first, out_second = ((out[..., :half], out[..., half:]) if style == "neox"
                             else (out[..., 0::2], out[..., 1::2]))
    np.testing.assert_allclose(out_first, rotated.real, atol=1e-12)
    np.testing.assert_allclose(out_second, rotated.imag, atol=1e-12)


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rope_table_path_equals_theta_path(style, theta):
    x, positions = rope_inputs(seed=24)
    table = rope_table(4096, 16, theta=theta)
    from_table = rope_ref(x, positions, style=style, cos_sin=table)
    from_theta = rope_ref(x, positions, style=style, theta=theta)
    # The table is float32, so the two paths agree to float32 precision only.
    np.testing.assert_allclose(from_table, from_theta, atol=2e-6)


def test_rope_table_layout():
    table = rope_table(8, 6, theta=100.0)
    assert table.shape == (8, 3, 2) and table.dtype == np.float32
    np.testing.assert_array_equal(table[0], np.stack([np.ones(3), np.zeros(3)], axis=-1))
    # Position 5, frequency index 1: angle = 5 * 100 ** (-2/6).
    angle = 5 * 100.0 ** (-2.0 / 6)
    np.testing.assert_array_equal(table[5, 1], np.array([math.cos(angle), math.sin(angle)], np.float32))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda x, p: rope_ref(x, p, style="llama"), "style: expected one of ('neox', 'gptj'), got 'llama'"),
        (lambda x, p: rope_ref(x[..., :15], p, style="neox"), "head_dim: must be even for RoPE, got 15"),
        (lambda x, p: rope_ref(x, p, style="neox", cos_sin=rope_table(100, 16)),
         "positions: values must lie in [0, max_pos=100), got [0, 7, 4095]"),
        (lambda x, p: rope_ref(x, p, style="gptj", cos_sin=rope_table(4096, 8)),
         "cos_sin: expected shape [max_pos, D/2=8, 2], got (4096, 4, 2)"),
        (lambda x, p: rope_ref(x, p[:2], style="gptj"),
         "positions: expected an integer array of shape (3,), got int64 (2,)"),
    ],
)
def test_rope_errors(call, message):
    x, positions = rope_inputs(seed=25)
    with pytest.raises(ValueError, match=re.escape(message)):
        call(x, positions)
