"""key_transform="hadamard" on the GPU: the writers store H k bit-exactly as quant.hadamard_rows
computes it (no RoPE: no other rounding), paged as contiguous; and what it is for: keys with
outlier channels, quantized per token, attend closer to the unquantized keys than without it.
(The fused append and the multi-token kernel's q side: test_fused_append_gpu.py and
test_multi_gpu.py.)"""
from __future__ import annotations

import numpy as np
import pytest
from append_case import cache_state

from lowlevel_fd import DecodePlan, KVCacheSpec, PromptQuantizer, hadamard
from lowlevel_fd.append import AppendPlan
from lowlevel_fd.append.reference import append_ref, prompt_ref
from lowlevel_fd.driver import DeviceArray, dtypes
from lowlevel_fd.quant import hadamard_rows
from lowlevel_fd.reference import attention_ref_fp

pytestmark = pytest.mark.gpu

MODES = [("tensor", "float32"), ("head", "float32"), ("token", "float32"), ("token", "float16")]
NAMES = ("k_cache", "v_cache", "k_scale", "v_scale", "seq_lens")


def upload(host):
    return {name: DeviceArray.from_numpy(value) for name, value in host.items()}


@pytest.mark.parametrize("scale_mode, scale_dtype", MODES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_append_writes_hadamard_keys_bit_exactly(rng, stream, head_dim, dtype, scale_mode,
                                                 scale_dtype):
    batch, heads, capacity = 3, 2, 24
    host = cache_state(rng, batch=batch, heads=heads, head_dim=head_dim, capacity=capacity,
                       kv_layout="bsnh", scale_mode=scale_mode, scale_dtype=scale_dtype,
                       lengths=[0, 11, capacity - 1])
    d = upload(host)
    qt = dtypes.as_dtype(dtype)
    k_new, v_new = (rng.standard_normal((batch, heads, head_dim)).astype(qt) for _ in range(2))
    with AppendPlan.create(heads, heads, head_dim, max_batch=batch, kv_layout="bsnh",
                           scale_mode=scale_mode, scale_dtype=scale_dtype, dtype=dtype,
                           key_transform="hadamard") as plan:
        plan.run(DeviceArray.from_numpy(k_new), DeviceArray.from_numpy(v_new),
                 *(d[n] for n in NAMES), stream=stream)
        stream.synchronize()
        assert plan.error_flags(stream=stream) == 0
    append_ref(*(host[n] for n in NAMES[:4]), host["seq_lens"].copy(), k_new, v_new,
               kv_layout="bsnh", scale_mode=scale_mode, scale_dtype=scale_dtype,
               key_transform="hadamard")
    for name in NAMES:  # bitwise: only row seq_len moved; V exactly as without the transform
        np.testing.assert_array_equal(d[name].numpy(), host[name], err_msg=name)


@pytest.mark.parametrize("kv_layout, page_size", [("bnsh", None), ("nhd", 16), ("hnd", 1)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_prompt_writes_hadamard_keys_bit_exactly(rng, stream, head_dim, kv_layout, page_size):
    """PromptQuantizer into contiguous and paged pools (pages in order: the pool is the
    contiguous cache re-cut), bitwise equal to prompt_ref."""
    batch, heads, tokens, capacity = 3, 2, 37, 48
    host = cache_state(rng, batch=batch, heads=heads, head_dim=head_dim, capacity=capacity,
                       kv_layout="bnsh", scale_mode="token", scale_dtype="float32",
                       lengths=[37, 1, 20])
    k, v = (rng.standard_normal((batch, tokens, heads, head_dim)).astype(np.float16)
            for _ in range(2))
    spec = KVCacheSpec(heads, head_dim, kv_layout=kv_layout, page_size=page_size,
                       key_transform="hadamard")
    d = upload(host)
    table = None
    if page_size:  # page p of sequence b is pool page b * pages + p: [B*pages, ...] views
        pages = capacity // page_size
        table = DeviceArray.from_numpy(
            np.arange(batch * pages, dtype=np.int32).reshape(batch, pages))
        for name in ("k_cache", "v_cache"):
            cut = host[name].reshape(batch, heads, pages, page_size, head_dim)
            order = (0, 2, 3, 1, 4) if kv_layout == "nhd" else (0, 2, 1, 3, 4)
            d[name] = DeviceArray.from_numpy(np.ascontiguousarray(cut.transpose(order)).reshape(
                (batch * pages,) + cut.transpose(order).shape[2:]))
        for name in ("k_scale", "v_scale"):
            cut = host[name].reshape(batch, heads, pages, page_size)
            order = (0, 2, 3, 1) if kv_layout == "nhd" else (0, 2, 1, 3)
            d[name] = DeviceArray.from_numpy(np.ascontiguousarray(cut.transpose(order)).reshape(
                (batch * pages,) + cut.transpose(order).shape[2:]))
    with PromptQuantizer(spec, max_batch=batch) as quantizer:
        quantizer.run(DeviceArray.from_numpy(k), DeviceArray.from_numpy(v),
                      *(d[n] for n in NAMES), block_table=table, stream=stream)
        stream.synchronize()
        assert quantizer.error_flags(stream=stream) == 0
    prompt_ref(*(host[n] for n in NAMES), k, v, kv_layout="bnsh", scale_mode="token",
               key_transform="hadamard")
    for name in NAMES[:4]:
        got = d[name].numpy()
        if page_size:  # back to [B, Hkv, S(, D)]
            pages = capacity // page_size
            got = got.reshape((batch, pages) + got.shape[1:])
            if kv_layout == "nhd":
                got = np.moveaxis(got, 3, 1)          # [B, Hkv, pages, page, ...]
            else:
                got = np.moveaxis(got, 2, 1)
            got = got.reshape(host[name].shape)
        np.testing.assert_array_equal(got, host[name], err_msg=name)


def outlier_keys(rng, shape, head_dim):
    """Keys like a trained model's: most channels O(1), a few large and biased ones."""
    k = rng.standard_normal(shape)
    channels = rng.choice(head_dim, 4, replace=False)
    k[..., channels] = 12.0 + 8.0 * rng.standard_normal(shape[:-1] + (4,))
    return k


@pytest.mark.parametrize("head_dim", [64, 128])
def test_hadamard_keys_cut_the_attention_error_of_outlier_channels(rng, stream, head_dim):
    """Per-token INT8 keys with outlier channels: with the transform the decode output is
    closer to attention over the unquantized cache (float64) than without it."""
    batch, heads, group, tokens = 2, 2, 4, 512
    k = outlier_keys(rng, (batch, tokens, heads, head_dim), head_dim).astype(np.float16)
    v = rng.standard_normal((batch, tokens, heads, head_dim)).astype(np.float16)
    q = (rng.standard_normal((batch, heads * group, head_dim)) * 0.6).astype(np.float16)
    lens = np.array([tokens, 301], np.int32)
    exact, _ = attention_ref_fp(q.astype(np.float64), k.astype(np.float64).transpose(0, 2, 1, 3),
                                v.astype(np.float64).transpose(0, 2, 1, 3), lens)
    errors = {}
    for transform in ("none", "hadamard"):
        spec = KVCacheSpec(heads, head_dim, key_transform=transform)
        cache = {"k_cache": np.zeros((batch, heads, tokens, head_dim), np.int8),
                 "v_cache": np.zeros((batch, heads, tokens, head_dim), np.int8),
                 "k_scale": np.zeros((batch, heads, tokens), np.float32),
                 "v_scale": np.zeros((batch, heads, tokens), np.float32)}
        d = upload(cache)
        d["seq_lens"] = DeviceArray.from_numpy(lens)
        q_used = q if transform == "none" else (q.astype(np.float32) @ hadamard(head_dim)
                                                ).astype(np.float16)
        out = DeviceArray.empty(q.shape, np.float16)
        out.fill(np.nan)
        with PromptQuantizer(spec, max_batch=batch) as quantizer, \
                DecodePlan(spec, heads * group, max_batch=batch, max_seq_len=tokens) as plan:
            quantizer.run(DeviceArray.from_numpy(k), DeviceArray.from_numpy(v),
                          *(d[n] for n in NAMES), stream=stream)
            plan.plan(lens)
            plan.run(DeviceArray.from_numpy(q_used), *(d[n] for n in NAMES[:4]),
                     d["seq_lens"], out, stream=stream)
            stream.synchronize()
        got = out.numpy().astype(np.float64)
        assert np.isfinite(got).all()
        errors[transform] = float(np.abs(got - exact).max() / np.abs(exact).max())
    assert errors["hadamard"] < 0.5 * errors["none"], errors


def test_hadamard_matrix_is_the_kernels_transform():
    """``lowlevel_fd.hadamard`` (what a caller multiplies q by) is the writers' transform."""
    x = np.random.default_rng(1).standard_normal((5, 128)).astype(np.float32)
    np.testing.assert_allclose(x @ hadamard(128), hadamard_rows(x), rtol=0, atol=1e-5)
