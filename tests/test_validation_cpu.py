"""Specification of the cache description and DecodePlan's argument checks, without a GPU:
KVCacheSpec, the plans' constructors (the spec form and the keyword ``create`` form), the host
lengths of plan(), and run()'s arguments as bound by the plan's RunBinder. Every error names
the argument; nothing is written into the parameter block unless all pass."""
from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest
from stand_ins import DEVICE, OTHER_DEVICE, fake

from lowlevel_fd import AppendPlan, DecodePlan, DecodeStep, KVCacheSpec, PromptQuantizer
from lowlevel_fd.core.validate import host_lengths
from lowlevel_fd.decode.params import DecodeParams

B, HQ, HKV, D, CAPACITY, PLANNED = 2, 8, 2, 128, 256, 200


def make_plan(**overrides) -> DecodePlan:
    options = dict(max_batch=4, max_seq_len=1024, device=DEVICE) | overrides
    return DecodePlan.create(options.pop("num_q_heads", HQ), options.pop("num_kv_heads", HKV),
                             options.pop("head_dim", D), **options)


# -- KVCacheSpec -------------------------------------------------------------------------------
def test_spec_defaults():
    spec = KVCacheSpec(HKV, D)
    assert dataclasses.astuple(spec) == (HKV, D, "bnsh", "token", "float32", None, 10000.0,
                                         "int8", None, "none")
    assert spec.token_scales and spec.scale_storage == "float"


@pytest.mark.parametrize("fields, error, message", [
    # num_kv_heads: an int in [1, 2**31)
    ({"num_kv_heads": 0}, ValueError,
     r"^num_kv_heads: expected an int in \[1, 2147483648\), got 0$"),
    ({"num_kv_heads": -3}, ValueError,
     r"^num_kv_heads: expected an int in \[1, 2147483648\), got -3$"),
    ({"num_kv_heads": 2**31}, ValueError,
     r"^num_kv_heads: expected an int in \[1, 2147483648\), got 2147483648$"),
    ({"num_kv_heads": 2.0}, TypeError, r"^num_kv_heads: expected an int, got float 2.0$"),
    ({"num_kv_heads": "2"}, TypeError, r"^num_kv_heads: expected an int, got str '2'$"),
    ({"num_kv_heads": True}, TypeError, r"^num_kv_heads: expected an int, got bool True$"),
    ({"num_kv_heads": None}, TypeError, r"^num_kv_heads: expected an int, got NoneType None$"),
    # head_dim: one of HEAD_DIMS, an int
    ({"head_dim": 96}, ValueError, r"^head_dim: expected one of \[64, 128, 256\], got 96$"),
    ({"head_dim": 0}, ValueError, r"^head_dim: expected one of \[64, 128, 256\], got 0$"),
    ({"head_dim": 128.0}, TypeError, r"^head_dim: expected an int, got float 128.0$"),
    ({"head_dim": None}, TypeError, r"^head_dim: expected an int, got NoneType None$"),
    # kv_layout
    ({"kv_layout": "nhsd"}, ValueError,
     r"^kv_layout: expected one of \['bnsh', 'bsnh', 'nhd', 'hnd'\], got 'nhsd'$"),
    ({"kv_layout": "BNSH"}, ValueError, r"^kv_layout: expected one of .*got 'BNSH'$"),
    ({"kv_layout": None}, ValueError, r"^kv_layout: expected one of .*got None$"),
    # scale_mode
    ({"scale_mode": "channel"}, ValueError,
     r"^scale_mode: expected one of \['tensor', 'head', 'token'\], got 'channel'$"),
    ({"scale_mode": None}, ValueError, r"^scale_mode: expected one of .*got None$"),
    # scale_dtype: per the scale mode
    ({"scale_mode": "head", "scale_dtype": "float16"}, ValueError,
     r"^scale_dtype: expected one of \['float32'\], got 'float16'$"),
    ({"scale_mode": "tensor", "scale_dtype": np.dtype("float16")}, ValueError,
     r"^scale_dtype: expected one of \['float32'\], got dtype\('float16'\)$"),
    ({"scale_mode": "token", "scale_dtype": "bfloat16"}, ValueError,
     r"^scale_dtype: expected one of \['float32', 'float16'\], got 'bfloat16'$"),
    ({"scale_dtype": "half precision"}, ValueError,
     r"^scale_dtype: expected one of \['float32', 'float16'\], got 'half precision'$"),
    ({"scale_dtype": np.float16}, TypeError,  # the scalar type, not a dtype
     r"^scale_dtype: expected a dtype name or numpy dtype \(float32 or float16\), got type"),
    ({"scale_dtype": 4}, TypeError,
     r"^scale_dtype: expected a dtype name or numpy dtype \(float32 or float16\), got int 4$"),
    # cache_dtype: int8 only
    ({"cache_dtype": "uint8"}, ValueError,
     r"^cache_dtype: expected one of \['int8'\], got 'uint8'$"),
    ({"cache_dtype": "float8_e4m3"}, ValueError,
     r"^cache_dtype: expected one of \['int8'\], got 'float8_e4m3'$"),
    ({"cache_dtype": 8}, TypeError,
     r"^cache_dtype: expected a dtype name or numpy dtype \(int8\), got int 8$"),
    # rope
    ({"rope": "llama"}, ValueError,
     r"^rope: expected one of \[None, 'neox', 'gptj'\], got 'llama'$"),
    ({"rope": ""}, ValueError, r"^rope: expected one of \[None, 'neox', 'gptj'\], got ''$"),
    ({"rope": False}, ValueError, r"^rope: expected one of \[None, 'neox', 'gptj'\], got False$"),
    # rope_theta: a finite real > 1
    ({"rope_theta": 1.0}, ValueError, r"^rope_theta: expected a finite base > 1, got 1.0$"),
    ({"rope_theta": 0}, ValueError, r"^rope_theta: expected a finite base > 1, got 0$"),
    ({"rope_theta": -1e4}, ValueError, r"^rope_theta: expected a finite base > 1, got -10000.0$"),
    ({"rope_theta": float("inf")}, ValueError, r"^rope_theta: expected a finite number, got inf$"),
    ({"rope_theta": float("nan")}, ValueError, r"^rope_theta: expected a finite number, got nan$"),
    ({"rope_theta": "1e4"}, TypeError, r"^rope_theta: expected a real number, got str '1e4'$"),
    ({"rope_theta": None}, TypeError, r"^rope_theta: expected a real number, got NoneType None$"),
    ({"rope_theta": True}, TypeError, r"^rope_theta: expected a real number, got bool True$"),
    # page_size: a power of two 1..256 with the paged layouts, None with the contiguous ones
    ({"kv_layout": "nhd"}, ValueError,
     r"^page_size: kv_layout='nhd' is paged; expected a page size in \[1, 2, 4, 8, 16, 32, "
     r"64, 128, 256\], got None$"),
    ({"kv_layout": "hnd", "page_size": 24}, ValueError,
     r"^page_size: expected one of \[1, 2, 4, 8, 16, 32, 64, 128, 256\], got 24$"),
    ({"kv_layout": "hnd", "page_size": 512}, ValueError,
     r"^page_size: expected one of .*, got 512$"),
    ({"kv_layout": "nhd", "page_size": 16.0}, TypeError,
     r"^page_size: expected an int, got float 16.0$"),
    ({"page_size": 16}, ValueError,
     r"^page_size: kv_layout='bnsh' is contiguous; expected None \(or a paged layout "
     r"\['nhd', 'hnd'\]\), got 16$"),
    # key_transform: "none" or "hadamard"
    ({"key_transform": "walsh"}, ValueError,
     r"^key_transform: expected one of \['none', 'hadamard'\], got 'walsh'$"),
    ({"key_transform": None}, ValueError,
     r"^key_transform: expected one of \['none', 'hadamard'\], got None$"),
])
def test_spec_rejects_every_field_naming_it(fields, error, message):
    arguments = {"num_kv_heads": HKV, "head_dim": D} | fields
    with pytest.raises(error, match=message):
        KVCacheSpec(**arguments)


def test_spec_accepts_the_support_matrix():
    for layout in ("bnsh", "bsnh"):
        for mode, scale_dtypes in (("tensor", ("float32",)), ("head", ("float32",)),
                                   ("token", ("float32", "float16"))):
            for scale_dtype in scale_dtypes:
                for rope in (None, "neox", "gptj"):
                    for head_dim in (64, 128, 256):
                        spec = KVCacheSpec(1, head_dim, layout, mode, scale_dtype, rope)
                        assert (spec.kv_layout, spec.scale_mode, spec.scale_dtype,
                                spec.rope) == (layout, mode, scale_dtype, rope)


def test_spec_normalises_to_plain_ints_floats_and_dtype_names():
    spec = KVCacheSpec(np.int64(HKV), np.int32(D), scale_dtype=np.dtype("float16"),
                       rope="neox", rope_theta=np.float32(5e5), cache_dtype=np.dtype("int8"))
    assert (spec.num_kv_heads, spec.head_dim, spec.scale_dtype, spec.cache_dtype) == (
        HKV, D, "float16", "int8")
    assert (type(spec.num_kv_heads), type(spec.head_dim)) == (int, int)
    assert (type(spec.scale_dtype), type(spec.cache_dtype)) == (str, str)
    assert type(spec.rope_theta) is float and spec.rope_theta == 5e5
    assert type(KVCacheSpec(HKV, D, rope_theta=500000).rope_theta) is float
    # The normalised spec is the plainly spelled one: equal, and equal as a dict key.
    plain = KVCacheSpec(HKV, D, scale_dtype="float16", rope="neox", rope_theta=5e5)
    assert spec == plain and hash(spec) == hash(plain) and {plain: 1}[spec] == 1
    assert KVCacheSpec(HKV, D, scale_mode="head",
                       scale_dtype=np.dtype("float32")).scale_dtype == "float32"


def test_spec_is_frozen():
    spec = KVCacheSpec(HKV, D)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.head_dim = 64  # type: ignore[misc]
    assert spec.head_dim == D


@pytest.mark.parametrize("mode, scale_dtype, storage", [
    ("tensor", "float32", "float"), ("head", "float32", "float"),
    ("token", "float32", "float"), ("token", "float16", "uint16_t")])
def test_spec_scale_storage_and_token_scales(mode, scale_dtype, storage):
    spec = KVCacheSpec(HKV, D, scale_mode=mode, scale_dtype=scale_dtype)
    assert spec.scale_storage == storage and spec.token_scales == (mode == "token")


@pytest.mark.parametrize("num_kv_heads, num_q_heads, group", [
    (1, 1, 1), (2, 4, 2), (4, 16, 4), (8, 64, 8), (2, 32, 16), (3, 48, 16),
    # Any group 1..128, not only the powers of two: the kernels serve it in head chunks.
    (8, 24, 3), (4, 20, 5), (2, 14, 7), (1, 12, 12), (2, 48, 24), (3, 213, 71), (1, 128, 128),
    (2, 256, 128)])
def test_spec_group_size(num_kv_heads, num_q_heads, group):
    size = KVCacheSpec(num_kv_heads, D).group_size(np.int64(num_q_heads))
    assert size == group and type(size) is int


@pytest.mark.parametrize("num_kv_heads, num_q_heads, error, message", [
    (4, 10, ValueError, r"^num_q_heads: expected a multiple of num_kv_heads=4, got 10$"),
    (4, 2, ValueError, r"^num_q_heads: expected a multiple of num_kv_heads=4, got 2$"),
    (8, 36, ValueError, r"^num_q_heads: expected a multiple of num_kv_heads=8, got 36$"),
    (1, 129, ValueError, r"^group size \(num_q_heads // num_kv_heads\): expected 1\.\.128, "
                         r"got 129$"),
    (2, 258, ValueError, r"^group size \(num_q_heads // num_kv_heads\): expected 1\.\.128, "
                         r"got 129$"),
    (2, 512, ValueError, r"^group size \(num_q_heads // num_kv_heads\): expected 1\.\.128, "
                         r"got 256$"),
    (3, 387, ValueError, r"^group size \(num_q_heads // num_kv_heads\): expected 1\.\.128, "
                         r"got 129$"),
    (2, 257, ValueError, r"^num_q_heads: expected a multiple of num_kv_heads=2, got 257$"),
    (4, 0, ValueError, r"^num_q_heads: expected an int in \[1, 2147483648\), got 0$"),
    (4, -8, ValueError, r"^num_q_heads: expected an int in \[1, 2147483648\), got -8$"),
    (4, 8.0, TypeError, r"^num_q_heads: expected an int, got float 8.0$"),
    (4, None, TypeError, r"^num_q_heads: expected an int, got NoneType None$"),
])
def test_spec_group_size_rejects_unsupported_groups(num_kv_heads, num_q_heads, error, message):
    with pytest.raises(error, match=message):
        KVCacheSpec(num_kv_heads, D).group_size(num_q_heads)


@pytest.mark.parametrize("build", [
    lambda cache: DecodePlan(cache, HQ, max_batch=4, max_seq_len=64, device=DEVICE),
    lambda cache: AppendPlan(cache, HQ, max_batch=4, device=DEVICE),
    lambda cache: PromptQuantizer(cache, max_batch=4, device=DEVICE),
    lambda cache: DecodeStep(cache, 2, HQ, max_batch=4, max_seq_len=64, device=DEVICE),
], ids=["DecodePlan", "AppendPlan", "PromptQuantizer", "DecodeStep"])
def test_plans_take_a_spec_and_nothing_else(build):
    with pytest.raises(TypeError, match=r"^cache: expected a KVCacheSpec, got int 2$"):
        build(HKV)
    with pytest.raises(TypeError, match=r"^cache: expected a KVCacheSpec, got dict"):
        build({"num_kv_heads": HKV, "head_dim": D})
    spec = KVCacheSpec(HKV, D)
    assert build(spec).cache is spec  # shared, not copied


# -- the keyword forms build the spec form -----------------------------------------------------
CACHE_OPTIONS = {"kv_layout": "bsnh", "scale_mode": "token", "scale_dtype": "float16",
                 "rope": "gptj", "rope_theta": 5e5}
SPEC = KVCacheSpec(HKV, D, **CACHE_OPTIONS)


def test_decode_plan_create_builds_the_spec_form():
    made = DecodePlan.create(HQ, HKV, D, max_batch=4, max_seq_len=512, dtype="bfloat16",
                             sm_scale=0.25, device=DEVICE, **CACHE_OPTIONS)
    given = DecodePlan(SPEC, HQ, max_batch=4, max_seq_len=512, dtype="bfloat16", sm_scale=0.25,
                       device=DEVICE)
    assert made.cache == given.cache == SPEC
    for name in ("num_q_heads", "num_kv_heads", "head_dim", "group_size", "max_batch",
                 "max_seq_len", "dtype", "sm_scale", "device"):
        assert getattr(made, name) == getattr(given, name), name
    assert (made.group_size, made.dtype, made.sm_scale) == (HQ // HKV, "bfloat16", 0.25)
    assert (made.num_kv_heads, made.head_dim) == (HKV, D)


def test_append_plan_create_builds_the_spec_form():
    made = AppendPlan.create(HQ, HKV, D, max_batch=4, dtype="bfloat16", device=DEVICE,
                             **CACHE_OPTIONS)
    given = AppendPlan(SPEC, HQ, max_batch=4, dtype="bfloat16", device=DEVICE)
    assert made.cache == given.cache == SPEC
    for name in ("num_q_heads", "num_kv_heads", "head_dim", "group_size", "max_batch", "dtype",
                 "device", "variant"):
        assert getattr(made, name) == getattr(given, name), name
    assert made.variant.kernel_names == given.variant.kernel_names
    assert bytes(made._params) == bytes(given._params)  # num_kv_heads, rope_theta


def test_prompt_quantizer_create_builds_the_spec_form():
    made = PromptQuantizer.create(HKV, D, max_batch=4, prompt_layout="bnsh", dtype="bfloat16",
                                  device=DEVICE, **CACHE_OPTIONS)
    given = PromptQuantizer(SPEC, max_batch=4, prompt_layout="bnsh", dtype="bfloat16",
                            device=DEVICE)
    assert made.cache == given.cache == SPEC
    for name in ("num_kv_heads", "head_dim", "max_batch", "prompt_layout", "dtype", "device",
                 "variant"):
        assert getattr(made, name) == getattr(given, name), name
    assert bytes(made._params) == bytes(given._params)


@pytest.mark.parametrize("fused", [True, False])
def test_decode_step_create_builds_the_spec_form(fused):
    made = DecodeStep.create(3, HQ, HKV, D, max_batch=4, max_seq_len=512, dtype="bfloat16",
                             sm_scale=0.25, fused=fused, early_reads=False, device=DEVICE,
                             **CACHE_OPTIONS)
    given = DecodeStep(SPEC, 3, HQ, max_batch=4, max_seq_len=512, dtype="bfloat16",
                       sm_scale=0.25, fused=fused, early_reads=False, device=DEVICE)
    assert made.cache == given.cache == made.attention.cache == SPEC
    for name in ("num_layers", "num_q_heads", "max_batch", "max_seq_len", "dtype", "fused",
                 "early_reads", "device"):
        assert getattr(made, name) == getattr(given, name), name
    assert made.attention.sm_scale == given.attention.sm_scale == 0.25
    assert (made.append is None) == (given.append is None) == fused
    if not fused:
        assert made.append.cache == SPEC and made.append.variant == given.append.variant


@pytest.mark.parametrize("create", [
    lambda **o: DecodePlan.create(HQ, o.pop("num_kv_heads", HKV), o.pop("head_dim", D),
                                  max_batch=4, max_seq_len=64, device=DEVICE, **o),
    lambda **o: AppendPlan.create(HQ, o.pop("num_kv_heads", HKV), o.pop("head_dim", D),
                                  max_batch=4, device=DEVICE, **o),
    lambda **o: PromptQuantizer.create(o.pop("num_kv_heads", HKV), o.pop("head_dim", D),
                                       max_batch=4, device=DEVICE, **o),
    lambda **o: DecodeStep.create(2, HQ, o.pop("num_kv_heads", HKV), o.pop("head_dim", D),
                                  max_batch=4, max_seq_len=64, device=DEVICE, **o),
], ids=["DecodePlan", "AppendPlan", "PromptQuantizer", "DecodeStep"])
@pytest.mark.parametrize("options, error, message", [
    ({"head_dim": 96}, ValueError, r"^head_dim: expected one of \[64, 128, 256\], got 96$"),
    ({"num_kv_heads": 0}, ValueError,
     r"^num_kv_heads: expected an int in \[1, 2147483648\), got 0$"),
    ({"kv_layout": "nhsd"}, ValueError, r"^kv_layout: expected one of \['bnsh', 'bsnh', 'nhd', 'hnd'\]"),
    ({"scale_mode": "channel"}, ValueError, r"^scale_mode: expected one of"),
    ({"scale_mode": "head", "scale_dtype": "float16"}, ValueError,
     r"^scale_dtype: expected one of \['float32'\], got 'float16'$"),
    ({"rope": "llama"}, ValueError, r"^rope: expected one of \[None, 'neox', 'gptj'\]"),
    ({"rope_theta": 1.0}, ValueError, r"^rope_theta: expected a finite base > 1, got 1.0$"),
])
def test_create_reports_the_spec_messages(create, options, error, message):
    with pytest.raises(error, match=message):
        create(**options)


# -- the DecodePlan constructor ----------------------------------------------------------------
@pytest.mark.parametrize("overrides, error", [
    ({"head_dim": 96}, r"head_dim: expected one of \[64, 128, 256\], got 96"),
    ({"num_q_heads": 258, "num_kv_heads": 2},
     r"^group size \(num_q_heads // num_kv_heads\): expected 1\.\.128, got 129$"),
    ({"num_q_heads": 1024, "num_kv_heads": 4}, r"^group size .*expected 1\.\.128, got 256$"),
    ({"num_q_heads": 36, "num_kv_heads": 8},
     r"^num_q_heads: expected a multiple of num_kv_heads=8, got 36$"),
    ({"num_q_heads": 10, "num_kv_heads": 4},
     r"num_q_heads: expected a multiple of num_kv_heads=4, got 10"),
    ({"num_kv_heads": 0}, r"^num_kv_heads: expected an int in \[1, 2147483648\), got 0$"),
    ({"kv_layout": "nhsd"}, r"kv_layout: expected one of \['bnsh', 'bsnh', 'nhd', 'hnd'\], got 'nhsd'"),
    ({"scale_mode": "channel"},
     r"scale_mode: expected one of \['tensor', 'head', 'token'\], got 'channel'"),
    ({"dtype": "float32"}, r"^dtype: expected one of \['float16', 'bfloat16'\], got 'float32'"),
    ({"scale_mode": "head", "scale_dtype": "float16"},
     r"scale_dtype: expected one of \['float32'\], got 'float16'"),
    ({"scale_mode": "token", "scale_dtype": "bfloat16"},
     r"scale_dtype: expected one of \['float32', 'float16'\], got 'bfloat16'"),
    ({"max_batch": 0}, r"^max_batch: expected an int in \[1, 2147483648\), got 0$"),
    ({"max_batch": 2**31}, r"^max_batch: expected an int in \[1, 2147483648\), got 2147483648$"),
    ({"max_seq_len": 0}, r"^max_seq_len: expected an int in \[1, 2147483648\), got 0$"),
    ({"max_seq_len": 2**31},
     r"^max_seq_len: expected an int in \[1, 2147483648\), got 2147483648$"),
])
def test_constructor_rejects_unsupported_configurations(overrides, error):
    with pytest.raises(ValueError, match=error):
        make_plan(**overrides)


def test_constructor_accepts_the_support_matrix_and_defaults_sm_scale():
    plan = make_plan(num_q_heads=32, num_kv_heads=2, head_dim=64, kv_layout="bsnh",
                     scale_mode="token", scale_dtype="float16", dtype="bfloat16")
    assert plan.group_size == 16 and plan.device is DEVICE and plan.dtype == "bfloat16"
    assert plan.sm_scale == pytest.approx(64 ** -0.5)
    assert make_plan(sm_scale=0.5).sm_scale == 0.5


@pytest.mark.parametrize("num_q_heads, num_kv_heads, group", [
    (24, 8, 3), (20, 4, 5), (14, 2, 7), (12, 1, 12), (48, 2, 24), (213, 3, 71), (128, 1, 128),
    (256, 2, 128)])
def test_constructor_accepts_every_group_up_to_128(num_q_heads, num_kv_heads, group):
    plan = make_plan(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)
    assert (plan.num_q_heads, plan.num_kv_heads, plan.group_size) == (
        num_q_heads, num_kv_heads, group)


def test_error_flags_take_a_stream_and_read_0_before_the_first_plan():
    plan = make_plan()
    with pytest.raises(TypeError, match=r"stream"):
        plan.error_flags()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        plan.error_flags(None)  # type: ignore[misc]  # keyword only
    flags = plan.error_flags(stream=None)
    assert flags == 0 and type(flags) is int


# -- plan(): host lengths ----------------------------------------------------------------------
@pytest.mark.parametrize("lengths, error, message", [
    ([1, 2, 3], ValueError, r"seq_lens: expected at most max_batch=2 sequences, got 3"),
    ([5, -1], ValueError, r"seq_lens: expected lengths in \[0, max_seq_len=100\], got min -1"),
    ([101], ValueError, r"seq_lens: expected lengths in \[0, max_seq_len=100\], got .*max 101"),
    ([], ValueError, r"seq_lens: expected a non-empty 1-D sequence of lengths, got shape \(0,\)"),
    ([[1, 2]], ValueError, r"seq_lens: expected a non-empty 1-D .*got shape \(1, 2\)"),
    (np.array([1.0, 2.0]), TypeError, r"seq_lens: expected integer lengths, got dtype float64"),
    (fake((2,), "int32"), TypeError,
     r"seq_lens: plan\(\) needs host lengths \(list or numpy\), got a device array"),
])
def test_host_lengths_are_checked(lengths, error, message):
    with pytest.raises(error, match=message):
        host_lengths("seq_lens", lengths, 2, 100)


def test_host_lengths_accept_lists_and_numpy():
    assert host_lengths("seq_lens", [0, 100], 2, 100).tolist() == [0, 100]
    assert host_lengths("seq_lens", np.array([7], np.int32), 2, 100).dtype == np.int64


# -- run(): argument binding -------------------------------------------------------------------
def cache_shape(kv_layout: str, capacity: int = CAPACITY) -> tuple[int, ...]:
    return (B, HKV, capacity, D) if kv_layout == "bnsh" else (B, capacity, HKV, D)


def good_arguments(kv_layout: str = "bnsh", scale_mode: str = "token") -> dict:
    scale_shape = {"token": (B, HKV, CAPACITY), "head": (HKV,), "tensor": (1,)}[scale_mode]
    return {
        "q": fake((B, HQ, D), "float16", ptr=0x100000),
        "k_cache": fake(cache_shape(kv_layout), "int8", ptr=0x200000),
        "v_cache": fake(cache_shape(kv_layout), "int8", ptr=0x400000),
        "k_scale": fake(scale_shape, "float32", ptr=0x600000),
        "v_scale": fake(scale_shape, "float32", ptr=0x700000),
        "seq_lens": fake((B,), "int32", ptr=0x800000),
        "out": fake((B, HQ, D), "float16", ptr=0x900000),
        "lse": fake((B, HQ), "float32", ptr=0xA00000),
    }


def planned(kv_layout: str = "bnsh", scale_mode: str = "token", **overrides) -> DecodePlan:
    plan = make_plan(kv_layout=kv_layout, scale_mode=scale_mode, **overrides)
    plan._binder.planned(B, PLANNED)  # what plan([...]) would have set
    return plan


def bind(plan: DecodePlan, arguments: dict) -> DecodeParams:
    params = DecodeParams()
    plan._binder.bind(params, **arguments)
    return params


def test_plan_attributes_live_on_the_plan_and_the_spec():
    plan = planned("bsnh", "head", rope="neox")
    assert (plan.num_q_heads, plan.num_kv_heads, plan.head_dim, plan.group_size) == (
        HQ, HKV, D, HQ // HKV)
    assert (plan.cache.kv_layout, plan.cache.scale_mode, plan.cache.rope) == (
        "bsnh", "head", "neox")
    assert (plan._binder.batch, plan._binder.longest) == (B, PLANNED)
    assert plan._binder.spec is plan.cache


BAD_CASES = {
    "q shape": ("q", lambda: fake((B, HQ, 64), "float16"), ValueError,
                r"q: expected shape \[B, Hq, D\]=\(2, 8, 128\), got \(2, 8, 64\)"),
    "q dtype": ("q", lambda: fake((B, HQ, D), "bfloat16"), TypeError,
                r"q: expected dtype float16, got bfloat16"),
    "q misaligned": ("q", lambda: fake((B, HQ, D), "float16", ptr=0x100002), ValueError,
                     r"q: the data pointer must be 16-byte aligned, got 0x100002"),
    "q strided last dim": ("q", lambda: fake((B, HQ, D), "float16",
                                             strides=(HQ * D * 4, D * 4, 4)), ValueError,
                           r"q: the last dimension must be contiguous \(stride 2 bytes\), "
                           r"got stride 4 bytes"),
    "out dtype": ("out", lambda: fake((B, HQ, D), "float32"), TypeError,
                  r"out: expected dtype float16, got float32"),
    "out shape": ("out", lambda: fake((B, HQ), "float16"), ValueError,
                  r"out: expected shape \[B, Hq, D\]"),
    "k not int8": ("k_cache", lambda: fake(cache_shape("bnsh"), "float16"), TypeError,
                   r"k_cache: expected dtype int8, got float16"),
    "v not int8": ("v_cache", lambda: fake(cache_shape("bnsh"), "uint8"), TypeError,
                   r"v_cache: expected dtype int8, got uint8"),
    "k layout": ("k_cache", lambda: fake(cache_shape("bsnh"), "int8"), ValueError,
                 r"k_cache: expected shape \[B, Hkv, S_max, D\]=\(2, 2, '\*', 128\)"),
    "k misaligned": ("k_cache", lambda: fake(cache_shape("bnsh"), "int8", ptr=0x200008),
                     ValueError, r"k_cache: the data pointer must be 16-byte aligned"),
    # Both caches alike (v_cache must repeat k_cache's layout, checked first).
    "k token stride": ("k_cache", lambda: {name: fake(cache_shape("bnsh"), "int8",
                                                      strides=(HKV * CAPACITY * 136,
                                                               CAPACITY * 136, 136, 1))
                                           for name in ("k_cache", "v_cache")},
                       ValueError, r"k_cache: the stride of axis 2 must be a multiple of 16 "
                       r"bytes, got 136"),
    "v strides": ("v_cache", lambda: fake(cache_shape("bnsh"), "int8",
                                          strides=(HKV * 512 * D, 512 * D, D, 1)), ValueError,
                  r"v_cache: expected the shape and strides of k_cache"),
    # Caches and scales of one capacity, below the planned longest sequence.
    "capacity": ("k_cache", lambda: {"k_cache": fake(cache_shape("bnsh", 192), "int8"),
                                     "v_cache": fake(cache_shape("bnsh", 192), "int8"),
                                     "k_scale": fake((B, HKV, 192), "float32"),
                                     "v_scale": fake((B, HKV, 192), "float32")},
                 ValueError,
                 r"k_cache: capacity 192 tokens is below the planned longest sequence 200"),
    "token scale layout": ("k_scale", lambda: fake((B, CAPACITY, HKV), "float32"), ValueError,
                           r"k_scale: expected shape \[B, Hkv, S_max\]=\(2, 2, 256\), "
                           r"got \(2, 256, 2\)"),
    "token scale dtype": ("v_scale", lambda: fake((B, HKV, CAPACITY), "float16"), TypeError,
                          r"v_scale: expected dtype float32, got float16"),
    "seq_lens int64": ("seq_lens", lambda: fake((B,), "int64"), TypeError,
                       r"seq_lens: expected dtype int32, got int64"),
    "seq_lens shape": ("seq_lens", lambda: fake((B + 1,), "int32"), ValueError,
                       r"seq_lens: expected shape \[B\]=\(2,\), got \(3,\)"),
    "lse shape": ("lse", lambda: fake((B, HKV), "float32"), ValueError,
                  r"lse: expected shape \[B, Hq\]=\(2, 8\), got \(2, 2\)"),
    "lse dtype": ("lse", lambda: fake((B, HQ), "float16"), TypeError,
                  r"lse: expected dtype float32, got float16"),
    "other device": ("q", lambda: fake((B, HQ, D), "float16", device=OTHER_DEVICE), ValueError,
                     r"q: expected an array on device 0, got one on device 1"),
    "closed": ("v_cache", lambda: fake(cache_shape("bnsh"), "int8", owner=None), ValueError,
               r"v_cache: the array is closed \(its memory was freed\)"),
    "host array": ("out", lambda: np.zeros((B, HQ, D), np.float16), TypeError,
                   r"out: expected a DeviceArray or an object with __cuda_array_interface__"),
}


def broken(name: str, make) -> dict:
    replacement = make()  # one argument, or a dict of several
    return good_arguments() | (replacement if isinstance(replacement, dict)
                               else {name: replacement})


@pytest.mark.parametrize("name, make, error, message", BAD_CASES.values(), ids=BAD_CASES.keys())
def test_run_arguments_are_checked_before_anything_is_written(name, make, error, message):
    params = DecodeParams()
    with pytest.raises(error, match=message):
        planned()._binder.bind(params, **broken(name, make))
    assert bytes(params) == bytes(DecodeParams()), "a failed bind leaves the block untouched"


@pytest.mark.parametrize("name, make, error, message", BAD_CASES.values(), ids=BAD_CASES.keys())
def test_a_rejected_bind_leaves_the_last_good_bind_in_place(name, make, error, message):
    # The binder writes straight into the block (no scratch copy): every check comes first.
    plan, params = planned(), DecodeParams()
    plan._binder.bind(params, **good_arguments())
    before = bytes(params)
    assert before != bytes(DecodeParams())
    with pytest.raises(error, match=message):
        plan._binder.bind(params, **broken(name, make))
    assert bytes(params) == before, "a failed bind writes nothing"
    plan._binder.bind(params, **good_arguments())  # and the good arguments still bind
    assert bytes(params) == before


@pytest.mark.parametrize("name", ["q", "k_cache", "v_cache", "k_scale", "v_scale", "seq_lens",
                                  "out"])
def test_run_arguments_may_not_be_none(name):
    with pytest.raises(TypeError, match=rf"^{name}: expected a device array, got None$"):
        bind(planned(), good_arguments() | {name: None})


@pytest.mark.parametrize("scale_mode, shape, message", [
    ("head", (1,), r"k_scale: expected shape \[Hkv\]=\(2,\) for scale_mode='head', got \(1,\)"),
    ("head", (1, HKV), r"k_scale: expected shape \[Hkv\]=\(2,\) .*got \(1, 2\)"),
    ("tensor", (HKV,), r"k_scale: expected shape \[1\]=\(1,\) for scale_mode='tensor'"),
    # One scale must still be a 1-D [1] array: a 0-d array is refused.
    ("tensor", (), r"^k_scale: expected shape \[1\]=\(1,\) for scale_mode='tensor', got \(\)$"),
    ("tensor", (1, 1), r"^k_scale: expected shape \[1\]=\(1,\) .*got \(1, 1\)$"),
])
def test_static_scale_shapes(scale_mode, shape, message):
    arguments = good_arguments(scale_mode=scale_mode) | {"k_scale": fake(shape, "float32")}
    with pytest.raises(ValueError, match=message):
        bind(planned(scale_mode=scale_mode), arguments)


def test_static_scales_must_be_float32():
    arguments = good_arguments(scale_mode="head") | {"v_scale": fake((HKV,), "float16")}
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


@pytest.mark.parametrize("scale_mode", ["tensor", "head"])
def test_static_scales_bind_with_no_strides(scale_mode):
    arguments = good_arguments(scale_mode=scale_mode)
    params = bind(planned(scale_mode=scale_mode), arguments)
    assert (params.scale_batch_stride, params.scale_head_stride) == (0, 0)
    assert (params.k_scale, params.v_scale) == (0x600000, 0x700000)


def test_lse_is_optional_and_binds_as_null():
    params = bind(planned(), good_arguments() | {"lse": None})
    assert params.lse == 0 and params.q == 0x100000


def test_strided_views_bind_their_own_strides():
    # q as a view into a larger [B, 2*Hq, D] buffer, caches as a prefix of a longer cache.
    wide_q = fake((B, HQ, D), "float16", strides=(2 * HQ * D * 2, D * 2, 2))
    long_k = fake(cache_shape("bnsh"), "int8", strides=(HKV * 1024 * D, 1024 * D, D, 1))
    long_v = fake(cache_shape("bnsh"), "int8", ptr=0x400000, strides=long_k.strides)
    params = bind(planned(), good_arguments() | {"q": wide_q, "k_cache": long_k,
                                                 "v_cache": long_v})
    assert (params.q_batch_stride, params.q_head_stride) == (2 * HQ * D, D)
    assert (params.kv_batch_stride, params.kv_head_stride) == (HKV * 1024 * D, 1024 * D)
    assert ctypes.sizeof(params) == 320


# -- run(): the validated-arguments memo -------------------------------------------------------
def test_repeated_arguments_skip_the_checks_and_still_bind(monkeypatch):
    plan, calls = planned(), []
    real = plan._binder._check
    monkeypatch.setattr(plan._binder, "_check",
                        lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    first, second = bind(plan, good_arguments()), bind(plan, good_arguments())
    assert len(calls) == 1 and bytes(first) == bytes(second)
    moved = good_arguments() | {"out": fake((B, HQ, D), "float16", ptr=0x980000)}
    assert bind(plan, moved).out == 0x980000 and len(calls) == 2  # a new pointer: checked


def test_the_memo_never_hides_a_check_that_now_fails():
    plan = planned()
    bind(plan, good_arguments())
    plan._binder.planned(B, CAPACITY + 1)  # re-planned for longer sequences: the caches fail
    with pytest.raises(ValueError, match=r"k_cache: capacity 256 tokens is below the planned"):
        bind(plan, good_arguments())
    plan._binder.planned(B, PLANNED)
    closed = good_arguments() | {"q": fake((B, HQ, D), "float16", ptr=0x100000, owner=None)}
    with pytest.raises(ValueError, match=r"q: the array is closed"):
        bind(plan, closed)  # same pointer, shape and strides, but freed: still refused
    misaligned = good_arguments() | {"k_scale": fake((B, HKV, CAPACITY), "float32",
                                                     ptr=0x600002)}
    with pytest.raises(ValueError, match=r"k_scale: the data pointer must be 4-byte aligned"):
        bind(plan, misaligned)
