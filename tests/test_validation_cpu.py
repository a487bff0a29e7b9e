"""Specification of DecodePlan's argument checks, without a GPU: the constructor, the host
lengths of plan(), and run()'s arguments as bound by ``decode.bind.bind_arguments``. Every
error names the argument; nothing is written into the parameter block unless all pass."""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

from lowlevel_fd.decode import DecodePlan
from lowlevel_fd.decode.bind import bind_arguments
from lowlevel_fd.decode.params import DecodeParams
from lowlevel_fd.decode.validate import host_lengths
from lowlevel_fd.driver import DeviceArray

# Device stand-ins (an int ordinal and a compute capability): the checks only compare identity.
DEVICE = SimpleNamespace(ordinal=0, compute_capability=(9, 0))
OTHER_DEVICE = SimpleNamespace(ordinal=1, compute_capability=(9, 0))
OWNER = SimpleNamespace(closed=False)
B, HQ, HKV, D, CAPACITY, PLANNED = 2, 8, 2, 128, 256, 200


def make_plan(**overrides) -> DecodePlan:
    options = dict(max_batch=4, max_seq_len=1024, device=DEVICE) | overrides
    return DecodePlan(options.pop("num_q_heads", HQ), options.pop("num_kv_heads", HKV),
                      options.pop("head_dim", D), **options)


# -- the constructor ---------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, error", [
    ({"head_dim": 96}, r"head_dim: expected one of \[64, 128, 256\], got 96"),
    ({"num_q_heads": 24, "num_kv_heads": 8},
     r"group size \(num_q_heads // num_kv_heads\): expected one of \[1, 2, 4, 8, 16\], got 3"),
    ({"num_q_heads": 64, "num_kv_heads": 2}, r"group size .*got 32"),
    ({"num_q_heads": 10, "num_kv_heads": 4},
     r"num_q_heads: expected a multiple of num_kv_heads=4, got 10"),
    ({"num_kv_heads": 0}, r"num_q_heads: expected a multiple of num_kv_heads=0"),
    ({"kv_layout": "nhsd"}, r"kv_layout: expected one of \['bnsh', 'bsnh'\], got 'nhsd'"),
    ({"scale_mode": "channel"},
     r"scale_mode: expected one of \['tensor', 'head', 'token'\], got 'channel'"),
    ({"q_dtype": "float32"}, r"q_dtype: expected one of \['float16', 'bfloat16'\], got 'float32'"),
    ({"scale_mode": "head", "scale_dtype": "float16"},
     r"scale_dtype: expected one of \['float32'\], got 'float16'"),
    ({"scale_mode": "token", "scale_dtype": "bfloat16"},
     r"scale_dtype: expected one of \['float32', 'float16'\], got 'bfloat16'"),
    ({"max_batch": 0}, r"max_batch/max_seq_len: expected >= 1 \(and < 2\*\*31\), got 0/1024"),
    ({"max_seq_len": 0}, r"max_batch/max_seq_len: .*got 4/0"),
    ({"max_seq_len": 2**31}, r"max_batch/max_seq_len: .*got 4/2147483648"),
])
def test_constructor_rejects_unsupported_configurations(overrides, error):
    with pytest.raises(ValueError, match=error):
        make_plan(**overrides)


def test_constructor_accepts_the_support_matrix_and_defaults_sm_scale():
    plan = make_plan(num_q_heads=32, num_kv_heads=2, head_dim=64, kv_layout="bsnh",
                     scale_mode="token", scale_dtype="float16", q_dtype="bfloat16")
    assert plan.group_size == 16 and plan.device is DEVICE
    assert plan.sm_scale == pytest.approx(64 ** -0.5)
    assert make_plan(sm_scale=0.5).sm_scale == 0.5


# -- plan(): host lengths ----------------------------------------------------------------------
@pytest.mark.parametrize("lengths, error, message", [
    ([1, 2, 3], ValueError, r"seq_lens: expected at most max_batch=2 sequences, got 3"),
    ([5, -1], ValueError, r"seq_lens: expected lengths in \[0, max_seq_len=100\], got min -1"),
    ([101], ValueError, r"seq_lens: expected lengths in \[0, max_seq_len=100\], got .*max 101"),
    ([], ValueError, r"seq_lens: expected a non-empty 1-D sequence of lengths, got shape \(0,\)"),
    ([[1, 2]], ValueError, r"seq_lens: expected a non-empty 1-D .*got shape \(1, 2\)"),
    (np.array([1.0, 2.0]), TypeError, r"seq_lens: expected integer lengths, got dtype float64"),
    (DeviceArray(0x1000, (2,), "int32", DEVICE, owner=OWNER), TypeError,
     r"seq_lens: plan\(\) needs host lengths \(list or numpy\), got a device array"),
])
def test_host_lengths_are_checked(lengths, error, message):
    with pytest.raises(error, match=message):
        host_lengths("seq_lens", lengths, 2, 100)


def test_host_lengths_accept_lists_and_numpy():
    assert host_lengths("seq_lens", [0, 100], 2, 100).tolist() == [0, 100]
    assert host_lengths("seq_lens", np.array([7], np.int32), 2, 100).dtype == np.int64


# -- run(): argument binding -------------------------------------------------------------------
def array(shape, dtype, *, ptr=0x100000, strides=None, device=DEVICE, owner=OWNER):
    return DeviceArray(ptr, shape, dtype, device, strides=strides, owner=owner)


def cache_shape(kv_layout: str, capacity: int = CAPACITY) -> tuple[int, ...]:
    return (B, HKV, capacity, D) if kv_layout == "bnsh" else (B, capacity, HKV, D)


def good_arguments(kv_layout: str = "bnsh", scale_mode: str = "token") -> dict:
    scale_shape = {"token": (B, HKV, CAPACITY), "head": (HKV,), "tensor": (1,)}[scale_mode]
    return {
        "q": array((B, HQ, D), "float16", ptr=0x100000),
        "k_cache": array(cache_shape(kv_layout), "int8", ptr=0x200000),
        "v_cache": array(cache_shape(kv_layout), "int8", ptr=0x400000),
        "k_scale": array(scale_shape, "float32", ptr=0x600000),
        "v_scale": array(scale_shape, "float32", ptr=0x700000),
        "seq_lens": array((B,), "int32", ptr=0x800000),
        "out": array((B, HQ, D), "float16", ptr=0x900000),
        "lse": array((B, HQ), "float32", ptr=0xA00000),
    }


def planned(kv_layout: str = "bnsh", scale_mode: str = "token") -> DecodePlan:
    plan = make_plan(kv_layout=kv_layout, scale_mode=scale_mode)
    plan._batch, plan._planned_max = B, PLANNED  # what plan([...]) would have set
    return plan


def bind(plan: DecodePlan, arguments: dict) -> DecodeParams:
    params = DecodeParams()
    bind_arguments(plan, params, **arguments)
    return params


BNSH_STRIDES = (HKV * CAPACITY * D, CAPACITY * D, D, 1)
BAD_CASES = {
    "q shape": ("q", lambda: array((B, HQ, 64), "float16"), ValueError,
                r"q: expected shape \[B, Hq, D\]=\(2, 8, 128\), got \(2, 8, 64\)"),
    "q dtype": ("q", lambda: array((B, HQ, D), "bfloat16"), TypeError,
                r"q: expected dtype float16, got bfloat16"),
    "q misaligned": ("q", lambda: array((B, HQ, D), "float16", ptr=0x100002), ValueError,
                     r"q: the data pointer must be 16-byte aligned, got 0x100002"),
    "q strided last dim": ("q", lambda: array((B, HQ, D), "float16",
                                              strides=(HQ * D * 4, D * 4, 4)), ValueError,
                           r"q: the last dimension must be contiguous \(stride 2 bytes\), "
                           r"got stride 4 bytes"),
    "out dtype": ("out", lambda: array((B, HQ, D), "float32"), TypeError,
                  r"out: expected dtype float16, got float32"),
    "out shape": ("out", lambda: array((B, HQ), "float16"), ValueError,
                  r"out: expected shape \[B, Hq, D\]"),
    "k not int8": ("k_cache", lambda: array(cache_shape("bnsh"), "float16"), TypeError,
                   r"k_cache: expected dtype int8, got float16"),
    "v not int8": ("v_cache", lambda: array(cache_shape("bnsh"), "uint8"), TypeError,
                   r"v_cache: expected dtype int8, got uint8"),
    "k layout": ("k_cache", lambda: array(cache_shape("bsnh"), "int8"), ValueError,
                 r"k_cache: expected shape \[B, Hkv, S_max, D\]=\(2, 2, '\*', 128\)"),
    "k misaligned": ("k_cache", lambda: array(cache_shape("bnsh"), "int8", ptr=0x200008),
                     ValueError, r"k_cache: the data pointer must be 16-byte aligned"),
    "k token stride": ("k_cache", lambda: array(cache_shape("bnsh"), "int8",
                                                strides=(HKV * CAPACITY * 136, CAPACITY * 136,
                                                         136, 1)),
                       ValueError, r"k_cache: the stride of axis 2 must be a multiple of 16 "
                       r"bytes, got 136"),
    "v strides": ("v_cache", lambda: array(cache_shape("bnsh"), "int8",
                                           strides=(HKV * 512 * D, 512 * D, D, 1)), ValueError,
                  r"v_cache: expected the shape and strides of k_cache"),
    "capacity": ("k_cache", lambda: {"k_cache": array(cache_shape("bnsh", 192), "int8"),
                                     "v_cache": array(cache_shape("bnsh", 192), "int8")},
                 ValueError,
                 r"k_cache: capacity 192 tokens is below the planned longest sequence 200"),
    "token scale layout": ("k_scale", lambda: array((B, CAPACITY, HKV), "float32"), ValueError,
                           r"k_scale: expected shape \[B, Hkv, S_max\]=\(2, 2, 256\), "
                           r"got \(2, 256, 2\)"),
    "token scale dtype": ("v_scale", lambda: array((B, HKV, CAPACITY), "float16"), TypeError,
                          r"v_scale: expected dtype float32, got float16"),
    "seq_lens int64": ("seq_lens", lambda: array((B,), "int64"), TypeError,
                       r"seq_lens: expected dtype int32, got int64"),
    "seq_lens shape": ("seq_lens", lambda: array((B + 1,), "int32"), ValueError,
                       r"seq_lens: expected shape \[B\]=\(2,\), got \(3,\)"),
    "lse shape": ("lse", lambda: array((B, HKV), "float32"), ValueError,
                  r"lse: expected shape \[B, Hq\]=\(2, 8\), got \(2, 2\)"),
    "lse dtype": ("lse", lambda: array((B, HQ), "float16"), TypeError,
                  r"lse: expected dtype float32, got float16"),
    "other device": ("q", lambda: array((B, HQ, D), "float16", device=OTHER_DEVICE), ValueError,
                     r"q: expected an array on device 0, got one on device 1"),
    "closed": ("v_cache", lambda: array(cache_shape("bnsh"), "int8", owner=None), ValueError,
               r"v_cache: the array is closed \(its memory was freed\)"),
    "host array": ("out", lambda: np.zeros((B, HQ, D), np.float16), TypeError,
                   r"out: expected a DeviceArray or an object with __cuda_array_interface__"),
}


@pytest.mark.parametrize("name, make, error, message", BAD_CASES.values(), ids=BAD_CASES.keys())
def test_run_arguments_are_checked_before_anything_is_written(name, make, error, message):
    params = DecodeParams()
    replacement = make()  # one argument, or a dict of several
    arguments = good_arguments() | (replacement if isinstance(replacement, dict)
                                    else {name: replacement})
    with pytest.raises(error, match=message):
        bind_arguments(planned(), params, **arguments)
    assert bytes(params) == bytes(DecodeParams()), "a failed bind leaves the block untouched"


@pytest.mark.parametrize("name", ["q", "k_cache", "v_cache", "k_scale", "v_scale", "seq_lens",
                                  "out"])
def test_run_arguments_may_not_be_none(name):
    with pytest.raises(TypeError, match=rf"^{name}: expected a device array, got None$"):
        bind(planned(), good_arguments() | {name: None})


@pytest.mark.parametrize("scale_mode, shape, message", [
    ("head", (1,), r"k_scale: expected shape \[Hkv\]=\(2,\) for scale_mode='head', got \(1,\)"),
    ("head", (1, HKV), r"k_scale: expected shape \[Hkv\]=\(2,\) .*got \(1, 2\)"),
    ("tensor", (HKV,), r"k_scale: expected shape \[1\]=\(1,\) for scale_mode='tensor'"),
])
def test_static_scale_shapes(scale_mode, shape, message):
    arguments = good_arguments(scale_mode=scale_mode) | {"k_scale": array(shape, "float32")}
    with pytest.raises(ValueError, match=message):
        bind(planned(scale_mode=scale_mode), arguments)


def test_static_scales_must_be_float32():
    arguments = good_arguments(scale_mode="head") | {"v_scale": array((HKV,), "float16")}
    with pytest.raises(TypeError, match=r"v_scale: expected dtype float32, got float16"):
        bind(planned(scale_mode="head"), arguments)


@pytest.mark.parametrize("kv_layout, token_stride, head_stride",
                         [("bnsh", D, CAPACITY * D), ("bsnh", HKV * D, D)])
def test_good_arguments_write_addresses_and_strides(kv_layout, token_stride, head_stride):
    arguments = good_arguments(kv_layout)
    params = bind(planned(kv_layout), arguments)
    assert (params.kv_token_stride, params.kv_head_stride) == (token_stride, head_stride)
    assert params.kv_batch_stride == HKV * CAPACITY * D  # int8: bytes == elements
    assert (params.q_batch_stride, params.q_head_stride) == (HQ * D, D)
    assert (params.out_batch_stride, params.out_head_stride) == (HQ * D, D)
    assert (params.scale_batch_stride, params.scale_head_stride) == (HKV * CAPACITY, CAPACITY)
    assert params.capacity == CAPACITY
    for field in ("q", "k_cache", "v_cache", "k_scale", "v_scale", "seq_lens", "out", "lse"):
        assert getattr(params, field) == arguments[field].ptr, field


def test_lse_is_optional_and_binds_as_null():
    params = bind(planned(), good_arguments() | {"lse": None})
    assert params.lse == 0 and params.q == 0x100000


def test_strided_views_bind_their_own_strides():
    # q as a view into a larger [B, 2*Hq, D] buffer, caches as a prefix of a longer cache.
    wide_q = array((B, HQ, D), "float16", strides=(2 * HQ * D * 2, D * 2, 2))
    long_k = array(cache_shape("bnsh"), "int8", strides=(HKV * 1024 * D, 1024 * D, D, 1))
    long_v = array(cache_shape("bnsh"), "int8", ptr=0x400000, strides=long_k.strides)
    params = bind(planned(), good_arguments() | {"q": wide_q, "k_cache": long_k,
                                                 "v_cache": long_v})
    assert (params.q_batch_stride, params.q_head_stride) == (2 * HQ * D, D)
    assert (params.kv_batch_stride, params.kv_head_stride) == (HKV * 1024 * D, 1024 * D)
    assert ctypes.sizeof(params) == 272


# -- run(): the validated-arguments memo -------------------------------------------------------
def test_repeated_arguments_skip_the_checks_and_still_bind(monkeypatch):
    from lowlevel_fd.decode import bind as bind_module
    plan, calls = planned(), []
    real = bind_module._check_arguments
    monkeypatch.setattr(bind_module, "_check_arguments",
                        lambda *a: (calls.append(1), real(*a)))
    first, second = bind(plan, good_arguments()), bind(plan, good_arguments())
    assert len(calls) == 1 and bytes(first) == bytes(second)
    moved = good_arguments() | {"out": array((B, HQ, D), "float16", ptr=0x980000)}
    assert bind(plan, moved).out == 0x980000 and len(calls) == 2  # a new pointer: checked


def test_the_memo_never_hides_a_check_that_now_fails():
    plan = planned()
    bind(plan, good_arguments())
    plan._planned_max = CAPACITY + 1  # re-planned for longer sequences: the same caches fail
    with pytest.raises(ValueError, match=r"k_cache: capacity 256 tokens is below the planned"):
        bind(plan, good_arguments())
    plan._planned_max = PLANNED
    closed = good_arguments() | {"q": array((B, HQ, D), "float16", ptr=0x100000, owner=None)}
    with pytest.raises(ValueError, match=r"q: the array is closed"):
        bind(plan, closed)  # same pointer, shape and strides, but freed: still refused
    misaligned = good_arguments() | {"k_scale": array((B, HKV, CAPACITY), "float32",
                                                      ptr=0x600002)}
    with pytest.raises(ValueError, match=r"k_scale: the data pointer must be 4-byte aligned"):
        bind(plan, misaligned)
