"""The append kernels without a GPU: they compile cleanly, the numpy reference's quantization
math is right, and AppendPlan/PromptQuantizer reject bad arguments before anything launches."""
from __future__ import annotations

import re

import numpy as np
import pytest
from stand_ins import DEVICE, OTHER_DEVICE, fake

from lowlevel_fd import KVCacheSpec
from lowlevel_fd.append import AppendPlan, PromptQuantizer, shipped_variants
from lowlevel_fd.append.reference import append_ref, prompt_ref, quantize_rows
from lowlevel_fd.append.params import AppendParams
from lowlevel_fd.compiler import clear_memory_cache, compile_cached, compile_source
from lowlevel_fd.compiler.nvrtc import CompileOptions
from lowlevel_fd.reference import rope_ref

VARIANTS = list(shipped_variants())
B, HQ, HKV, D, S_MAX = 3, 32, 8, 128, 64


# -- compilation -------------------------------------------------------------------------------
def test_shipped_variants_cover_the_support_matrix():
    assert len(VARIANTS) == len(set(VARIANTS)) == 3 * 2 * 3 * 4  # dims, dtypes, ropes, modes
    assert all(len(v.kernel_names) == 2 for v in VARIANTS)


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_variant_compiles_for_sm90_without_spills_or_stack(variant, tmp_path, monkeypatch):
    monkeypatch.setenv("LOWLEVEL_FD_CACHE_DIR", str(tmp_path))
    clear_memory_cache()
    program = compile_cached("append.cu", CompileOptions(arch="sm_90"), variant.kernel_names)
    for name in variant.kernel_names:
        r = program.resources[program.symbol(name)]
        assert (r.spill_store_bytes, r.spill_load_bytes, r.stack_bytes) == (0, 0, 0), name
        assert r.registers <= 128, f"{name}: 512 threads need <= 128 registers"


def test_params_struct_matches_the_cuda_layout_field_by_field():
    asserts = "".join(
        f"static_assert(__builtin_offsetof(llfd::AppendParams, {name}) == "
        f"{getattr(AppendParams, name).offset}, \"{name}\");\n"
        for name, _ in AppendParams._fields_)
    compile_source(f'#include "append_params.cuh"\n{asserts}', "offsets.cu",
                   CompileOptions(arch="sm_90"))


# -- the reference's quantization math --------------------------------------------------------
def test_saturation_clamps_to_127_and_never_wraps():
    x = np.array([[[1000.0, -1000.0, 127.4, -127.6, 3e38, -np.inf, 0.5, -0.5]]], np.float32)
    q8, _ = quantize_rows(x, "head", np.array([1.0], np.float32))
    assert q8.tolist() == [[[127, -127, 127, -127, 127, -127, 0, 0]]]
    q8, _ = quantize_rows(x[..., :4] * 1e-3, "tensor", np.array([1e-6], np.float32))
    assert q8.tolist() == [[[127, -127, 127, -127]]]


@pytest.mark.parametrize("scale_dtype", [np.float32, np.float16])
def test_per_token_scale_is_absmax_over_127(rng, scale_dtype):
    x = rng.standard_normal((4, 3, D)).astype(np.float16)
    x[1, 2] = 0
    q8, scale = quantize_rows(x, "token", scale_dtype=scale_dtype)
    absmax = np.abs(x.astype(np.float32)).max(axis=-1)
    np.testing.assert_array_equal(scale, (absmax / np.float32(127)).astype(scale_dtype))
    assert (np.abs(q8).max(axis=-1)[absmax > 0] == 127).all()
    assert (q8[1, 2] == 0).all() and scale[1, 2] == 0
    assert q8.min() >= -127


def host_case(rng, kv_layout, scale_mode):
    shape = (B, HKV, S_MAX, D) if kv_layout == "bnsh" else (B, S_MAX, HKV, D)
    caches = [rng.integers(-127, 128, shape, dtype=np.int8) for _ in range(2)]
    scales = [rng.uniform(0.01, 0.02, {"token": (B, HKV, S_MAX), "head": (HKV,),
                                       "tensor": (1,)}[scale_mode]).astype(np.float32)
              for _ in range(2)]
    new = [rng.standard_normal((B, HKV, D)).astype(np.float16) for _ in range(2)]
    return caches, scales, new


@pytest.mark.parametrize("kv_layout", ["bnsh", "bsnh"])
@pytest.mark.parametrize("scale_mode", ["tensor", "head", "token"])
def test_append_ref_writes_only_row_seq_len_and_skips_full_caches(rng, kv_layout, scale_mode):
    (kc, vc), (ks, vs), (k_new, v_new) = host_case(rng, kv_layout, scale_mode)
    before = [a.copy() for a in (kc, vc, ks, vs)]
    lens = np.array([0, 17, S_MAX], np.int32)  # the last cache is full
    append_ref(kc, vc, ks, vs, lens, k_new, v_new, kv_layout=kv_layout, scale_mode=scale_mode,
               advance=True)
    assert lens.tolist() == [1, 18, S_MAX]
    for cache, old, new, scale in ((kc, before[0], k_new, ks), (vc, before[1], v_new, vs)):
        bnsh = cache if kv_layout == "bnsh" else cache.transpose(0, 2, 1, 3)
        old_bnsh = old if kv_layout == "bnsh" else old.transpose(0, 2, 1, 3)
        changed = np.argwhere((bnsh != old_bnsh).any(axis=-1))  # (b, head, position) rows
        assert {(int(b), int(t)) for b, _, t in changed} <= {(0, 0), (1, 17)}
        for b, pos in ((0, 0), (1, 17)):
            expected, token_scale = quantize_rows(new[b:b + 1], scale_mode, scale)
            np.testing.assert_array_equal(bnsh[b, :, pos], expected[0])
            if scale_mode == "token":
                np.testing.assert_array_equal(scale[b, :, pos], token_scale[0])
    if scale_mode != "token":
        np.testing.assert_array_equal(ks, before[2])


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_append_ref_rotates_k_and_q_but_never_v(rng, style):
    (kc, vc), (ks, vs), (k_new, v_new) = host_case(rng, "bnsh", "token")
    q = rng.standard_normal((B, HQ, D)).astype(np.float16)
    lens = np.array([3, 40, 9], np.int32)
    q_rot = append_ref(kc, vc, ks, vs, lens, k_new, v_new, kv_layout="bnsh", scale_mode="token",
                       rope=style, q=q)
    np.testing.assert_allclose(q_rot, rope_ref(q, lens, style=style))
    k_expected, _ = quantize_rows(rope_ref(k_new, lens, style=style).astype(np.float32), "token")
    v_expected, _ = quantize_rows(v_new, "token")
    for b, pos in enumerate(lens):
        np.testing.assert_array_equal(kc[b, :, pos], k_expected[b])
        np.testing.assert_array_equal(vc[b, :, pos], v_expected[b])


@pytest.mark.parametrize("prompt_layout", ["bsnh", "bnsh"])
def test_prompt_ref_matches_token_by_token_appends(rng, prompt_layout):
    (kc, vc), (ks, vs), _ = host_case(rng, "bsnh", "token")
    k = rng.standard_normal((B, 20, HKV, D)).astype(np.float16)
    v = rng.standard_normal((B, 20, HKV, D)).astype(np.float16)
    kc2, vc2, ks2, vs2 = kc.copy(), vc.copy(), ks.copy(), vs.copy()
    given = (k, v) if prompt_layout == "bsnh" else (k.swapaxes(1, 2), v.swapaxes(1, 2))
    written = prompt_ref(kc, vc, ks, vs, np.array([20, 0, 99]), *given, kv_layout="bsnh",
                         prompt_layout=prompt_layout, scale_mode="token", rope="neox")
    assert written.tolist() == [20, 0, 20]  # clamped to the prompt's S
    lens = np.zeros(B, np.int32)
    for t in range(20):
        active = (lens < written).astype(np.int32)
        append_ref(kc2, vc2, ks2, vs2, np.where(active, lens, S_MAX), k[:, t], v[:, t],
                   kv_layout="bsnh", scale_mode="token", rope="neox")
        lens += active
    for a, b_ in ((kc, kc2), (vc, vc2), (ks, ks2), (vs, vs2)):
        np.testing.assert_array_equal(a, b_)


# -- constructor validation --------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,error,message", [
    ({"head_dim": 96}, ValueError, "head_dim: expected one of [64, 128, 256], got 96"),
    ({"dtype": "float32"}, ValueError, "dtype: expected one of ['float16', 'bfloat16']"),
    ({"kv_layout": "nhsd"}, ValueError,
     "kv_layout: expected one of ['bnsh', 'bsnh', 'nhd', 'hnd']"),
    ({"scale_mode": "channel"}, ValueError, "scale_mode: expected one of"),
    ({"scale_mode": "head", "scale_dtype": "float16"}, ValueError,
     "scale_dtype: expected one of ['float32'], got 'float16'"),
    ({"rope": "llama"}, ValueError, "rope: expected one of [None, 'neox', 'gptj'], got 'llama'"),
    ({"num_q_heads": 12}, ValueError, "num_q_heads: expected a multiple of num_kv_heads=8, "
                                      "got 12"),
    ({"num_q_heads": 1033}, ValueError, "num_q_heads: expected a multiple of num_kv_heads=8, "
                                        "got 1033"),
    # Groups follow the support matrix of every plan: any of 1..128.
    ({"num_q_heads": 1032}, ValueError, "group size (num_q_heads // num_kv_heads): expected "
                                        "1..128, got 129"),
    ({"num_q_heads": 2048}, ValueError, "group size (num_q_heads // num_kv_heads): expected "
                                        "1..128, got 256"),
    ({"num_kv_heads": 0}, ValueError, "num_kv_heads: expected an int in [1, 2147483648), got 0"),
    ({"max_batch": 0}, ValueError, "max_batch: expected an int in [1, 2147483648), got 0"),
    ({"rope_theta": 0.0}, ValueError, "rope_theta: expected a finite base > 1, got 0.0"),
])
def test_append_plan_rejects_bad_configuration(kwargs, error, message):
    args = {"num_q_heads": HQ, "num_kv_heads": HKV, "head_dim": D, **kwargs}
    with pytest.raises(error, match=re.escape(message)):
        AppendPlan.create(args.pop("num_q_heads"), args.pop("num_kv_heads"),
                          args.pop("head_dim"), max_batch=args.pop("max_batch", B),
                          device=DEVICE, **args)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 7, 8, 12, 16, 24, 71, 128])
def test_append_plan_accepts_the_supported_groups(group):
    plan = AppendPlan(KVCacheSpec(2, D), 2 * group, max_batch=B, device=DEVICE)
    assert (plan.group_size, plan.num_q_heads) == (group, 2 * group)


def test_prompt_quantizer_rejects_bad_configuration():
    with pytest.raises(ValueError, match=re.escape("prompt_layout: expected one of ['bsnh', "
                                                   "'bnsh'], got 'sbhd'")):
        PromptQuantizer.create(HKV, D, max_batch=B, prompt_layout="sbhd", device=DEVICE)
    with pytest.raises(ValueError, match=re.escape("max_batch: expected at most 65535 (grid.y), "
                                                   "got 70000")):
        PromptQuantizer.create(HKV, D, max_batch=70000, device=DEVICE)
    with pytest.raises(ValueError, match=re.escape("max_batch: expected an int in [1, "
                                                   "2147483648), got 0")):
        PromptQuantizer.create(HKV, D, max_batch=0, device=DEVICE)


@pytest.mark.parametrize("make", [
    lambda: AppendPlan.create(HQ, HKV, D, max_batch=B, device=DEVICE),
    lambda: PromptQuantizer.create(HKV, D, max_batch=B, device=DEVICE),
], ids=["AppendPlan", "PromptQuantizer"])
def test_error_flags_take_a_stream_and_read_0_before_the_first_run(make):
    runner = make()
    with pytest.raises(TypeError, match=r"stream"):
        runner.error_flags()
    with pytest.raises(TypeError):
        runner.error_flags(None)  # keyword only
    flags = runner.error_flags(stream=None)
    assert flags == 0 and type(flags) is int


# -- run() validation: fake device arrays, nothing launches ------------------------------------
def append_args(kv_layout="bnsh", scale_mode="token", scale_dtype="float32"):
    cache = (B, HKV, S_MAX, D) if kv_layout == "bnsh" else (B, S_MAX, HKV, D)
    scale = {"token": (B, HKV, S_MAX), "head": (HKV,), "tensor": (1,)}[scale_mode]
    return {"k_new": fake((B, HKV, D), "float16"), "v_new": fake((B, HKV, D), "float16"),
            "k_cache": fake(cache, "int8"), "v_cache": fake(cache, "int8"),
            "k_scale": fake(scale, scale_dtype), "v_scale": fake(scale, scale_dtype),
            "seq_lens": fake((B,), "int32")}


def launched(runner, monkeypatch) -> list:
    grids: list = []
    monkeypatch.setattr(runner, "_launch", lambda grid, stream: grids.append(grid))
    return grids


@pytest.mark.parametrize("kv_layout,strides", [("bnsh", (HKV * S_MAX * D, S_MAX * D, D)),
                                                ("bsnh", (S_MAX * HKV * D, D, HKV * D))])
def test_valid_append_arguments_are_packed(kv_layout, strides, monkeypatch):
    plan = AppendPlan.create(HQ, HKV, D, max_batch=4, kv_layout=kv_layout, rope="neox",
                             device=DEVICE)
    grids = launched(plan, monkeypatch)
    q = fake((B, 40, D), "float16")[:, 4:36]  # a strided view of a padded buffer
    plan.run(**append_args(kv_layout), q=q, cos_sin=fake((S_MAX, D // 2, 2), "float32"),
             advance=True, host_seq_lens=[0, 5, S_MAX - 1], stream=0)
    p = plan._params
    assert grids == [(B,)]
    assert (p.kv_batch_stride, p.kv_head_stride, p.kv_token_stride) == strides
    assert (p.scale_batch_stride, p.scale_head_stride, p.capacity) == (HKV * S_MAX, S_MAX, S_MAX)
    assert (p.q_batch_stride, p.q_head_stride, p.q_out_batch_stride) == (40 * D, D, 40 * D)
    assert p.q == p.q_out == q.ptr and p.num_q_heads == HQ and p.advance == 1
    assert p.k_head_stride == D and p.cos_sin != 0


@pytest.mark.parametrize("change,error,message", [
    ({"k_new": None}, TypeError, "k_new: expected a device array, got None"),
    ({"k_new": fake((B, HKV, D), "float32")}, TypeError,
     "k_new: expected dtype float16, got float32"),
    ({"k_new": fake((B, HKV + 1, D), "float16")}, ValueError,
     "k_new: expected shape [B, Hkv, D]=('*', 8, 128), got (3, 9, 128)"),
    ({"k_new": fake((5, HKV, D), "float16")}, ValueError,
     "k_new: expected at most max_batch=4 sequences, got 5"),
    ({"v_new": fake((2, HKV, D), "float16")}, ValueError, "v_new: expected shape"),
    ({"k_new": fake((B, HKV, D), "float16", ptr=(1 << 20) + 8)}, ValueError,
     "k_new: the data pointer must be 16-byte aligned"),
    ({"k_new": fake((B, HKV, D), "float16", strides=(HKV * D * 4, D * 4, 4))}, ValueError,
     "k_new: the last dimension must be contiguous"),
    ({"k_new": fake((B, HKV, D), "float16", device=OTHER_DEVICE)}, ValueError,
     "k_new: expected an array on device 0, got one on device 1"),
    ({"k_cache": fake((B, S_MAX, HKV, D), "int8")}, ValueError,
     "k_cache: expected shape [B, Hkv, S_max, D]=(3, 8, '*', 128), got (3, 64, 8, 128)"),
    ({"v_cache": fake((B, HKV, S_MAX, D), "uint8")}, TypeError,
     "v_cache: expected dtype int8, got uint8"),
    ({"v_cache": fake((B, HKV, 32, D), "int8")}, ValueError,
     "v_cache: expected the shape and strides of k_cache"),
    ({"k_scale": fake((B, HKV, S_MAX), "float16")}, TypeError,
     "k_scale: expected dtype float32, got float16"),
    ({"v_scale": fake((B, HKV, S_MAX - 1), "float32")}, ValueError,
     "v_scale: expected shape [B, Hkv, S_max]=(3, 8, 64)"),
    ({"seq_lens": fake((B,), "int64")}, TypeError, "seq_lens: expected dtype int32, got int64"),
    ({"seq_lens": fake((B + 1,), "int32")}, ValueError, "seq_lens: expected shape [B]=(3,)"),
    ({"q": fake((B, HQ, D), "float16")}, ValueError,
     "q: the cache spec applies no RoPE (rope=None)"),
    ({"q_out": fake((B, HQ, D), "float16")}, ValueError, "q_out: given without q"),
    ({"cos_sin": fake((S_MAX, D // 2, 2), "float32")}, ValueError,
     "cos_sin: the cache spec applies no RoPE (rope=None); pass rope='neox' or 'gptj', or "
     "drop cos_sin"),
    ({"advance": 1}, TypeError, "advance: expected a bool, got int"),
    ({"host_seq_lens": [0, S_MAX, 3]}, ValueError,
     "host_seq_lens: sequence 1 has length 64, outside [0, 63] (the new token must land below "
     "the cache capacity S_max=64); nothing was launched"),
    ({"host_seq_lens": [1, 2]}, ValueError, "host_seq_lens: expected 3 integer lengths"),
])
def test_append_run_rejects_bad_arguments(change, error, message, monkeypatch):
    plan = AppendPlan.create(HQ, HKV, D, max_batch=4, device=DEVICE)
    grids = launched(plan, monkeypatch)
    before = bytes(plan._params)
    with pytest.raises(error, match=re.escape(message)):
        plan.run(**{**append_args(), **change}, stream=0)
    assert grids == [] and bytes(plan._params) == before, "nothing launched, nothing written"


@pytest.mark.parametrize("change,message", [
    ({"q": fake((B, HQ // 2, D), "float16")}, "q: expected shape [B, Hq, D]=(3, 32, 128)"),
    ({"q": fake((B, HQ, D), "bfloat16")}, "q: expected dtype float16, got bfloat16"),
    ({"cos_sin": fake((S_MAX - 1, D // 2, 2), "float32")},
     "cos_sin: expected a row for every cache position (max_pos >= S_max=64), got max_pos=63"),
    ({"cos_sin": fake((S_MAX, D, 2), "float32")}, "cos_sin: expected shape [max_pos, D/2, 2]"),
    ({"cos_sin": fake((S_MAX, D // 2, 2), "float16")}, "cos_sin: expected dtype float32"),
])
def test_append_run_rejects_bad_rope_arguments(change, message, monkeypatch):
    plan = AppendPlan.create(HQ, HKV, D, max_batch=4, rope="gptj", device=DEVICE)
    launched(plan, monkeypatch)
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        plan.run(**{**append_args(), **change}, stream=0)


@pytest.mark.parametrize("scale_mode,shape,message", [
    ("head", (HKV + 1,), "k_scale: expected shape [Hkv]=(8,) for scale_mode='head', got (9,)"),
    ("tensor", (2,), "k_scale: expected shape [1]=(1,) for scale_mode='tensor', got (2,)"),
    # One scale is a 1-D [1] array, as for DecodePlan: a 0-d array is refused.
    ("tensor", (), "k_scale: expected shape [1]=(1,) for scale_mode='tensor', got ()"),
    ("tensor", (1, 1), "k_scale: expected shape [1]=(1,) for scale_mode='tensor', got (1, 1)"),
])
def test_given_scales_must_match_the_mode(scale_mode, shape, message, monkeypatch):
    plan = AppendPlan.create(HQ, HKV, D, max_batch=4, scale_mode=scale_mode, device=DEVICE)
    launched(plan, monkeypatch)
    args = {**append_args(scale_mode=scale_mode), "k_scale": fake(shape, "float32")}
    with pytest.raises(ValueError, match=re.escape(message)):
        plan.run(**args, stream=0)


@pytest.mark.parametrize("change, message", [
    ({"ptr": (1 << 20) + 2}, "k_scale: the data pointer must be 4-byte aligned, got 0x100002"),
    ({"strides": (HKV * (S_MAX + 1) * 2, (S_MAX + 1) * 2, 2)},  # rows of 65 fp16 scales
     "k_scale: the stride of axis 1 must be a multiple of 4 bytes, got 130"),
    ({"strides": ((HKV * S_MAX + 1) * 2, S_MAX * 2, 2)},
     "k_scale: the stride of axis 0 must be a multiple of 4 bytes, got 1026"),
])
@pytest.mark.parametrize("runner", ["append", "prompt"])
def test_token_scale_rows_are_4_byte_aligned_for_the_writes_too(change, message, runner,
                                                                monkeypatch):
    # fp16 per-token scales: every row [b, h, :] starts 4-byte aligned, as for DecodePlan.
    make = (AppendPlan.create(HQ, HKV, D, max_batch=4, scale_dtype="float16", device=DEVICE)
            if runner == "append" else
            PromptQuantizer.create(HKV, D, max_batch=4, scale_dtype="float16", device=DEVICE))
    grids = launched(make, monkeypatch)
    args = append_args(scale_dtype="float16")
    good_scale = args["k_scale"]
    if runner == "prompt":
        args = {"k": fake((B, 16, HKV, D), "float16"), "v": fake((B, 16, HKV, D), "float16"),
                **{name: args[name] for name in ("k_cache", "v_cache", "k_scale", "v_scale")},
                "prompt_lens": args["seq_lens"]}
    make.run(**args, stream=0)  # contiguous rows of an even S_max: accepted
    pool = (B, HKV, S_MAX + 1) if "strides" in change else None
    args["k_scale"] = args["v_scale"] = fake(good_scale.shape, "float16", pool=pool,
                                             **change)
    with pytest.raises(ValueError, match=re.escape(message)):
        make.run(**args, stream=0)
    assert len(grids) == 1


def test_a_rejected_prompt_writes_nothing(monkeypatch):
    quantizer = PromptQuantizer.create(HKV, D, max_batch=B, device=DEVICE)
    grids = launched(quantizer, monkeypatch)
    args = {name: value for name, value in append_args().items() if "new" not in name}
    args["prompt_lens"] = args.pop("seq_lens")
    k, v = fake((B, 20, HKV, D), "float16"), fake((B, 20, HKV, D), "float16")
    quantizer.run(k, v, **args, stream=0)
    before = bytes(quantizer._params)
    for bad in ({"k_cache": fake((B, HKV, S_MAX, D), "uint8")},
                {"prompt_lens": fake((B,), "int64")},
                {"seq_lens_out": fake((B + 1,), "int32")},
                {"host_prompt_lens": [0, 21, 0]},
                {"starts": fake((B,), "float32")},
                {"starts": fake((B - 1,), "int32")},
                {"cos_sin": fake((S_MAX, D // 2, 2), "float32")}):
        (name,) = bad
        with pytest.raises((ValueError, TypeError), match=rf"^{name}: "):
            quantizer.run(fake((B, 20, HKV, D), "float16"), v, **(args | bad), stream=0)
        assert bytes(quantizer._params) == before, bad
    assert len(grids) == 1


@pytest.mark.parametrize("prompt_layout", ["bsnh", "bnsh"])
def test_prompt_arguments_are_validated_and_packed(prompt_layout, monkeypatch):
    quantizer = PromptQuantizer.create(HKV, D, max_batch=B, prompt_layout=prompt_layout,
                                       device=DEVICE)
    grids = launched(quantizer, monkeypatch)
    shape = (B, 20, HKV, D) if prompt_layout == "bsnh" else (B, HKV, 20, D)
    args = {name: value for name, value in append_args().items() if "new" not in name}
    lens = args.pop("seq_lens")
    k, v = fake(shape, "float16"), fake(shape, "float16")
    quantizer.run(k, v, **args, prompt_lens=lens, host_prompt_lens=[20, 0, 7], stream=0)
    p = quantizer._params
    token, head = (HKV * D, D) if prompt_layout == "bsnh" else (D, 20 * D)
    assert grids == [(3, B)] and p.prompt_tokens == 20
    assert (p.k_token_stride, p.k_head_stride, p.v_batch_stride) == (token, head, 20 * HKV * D)
    with pytest.raises(ValueError, match=re.escape(
            "host_prompt_lens: sequence 0 has length 21, outside [0, 20]")):
        quantizer.run(k, v, **args, prompt_lens=lens, host_prompt_lens=[21, 0, 0], stream=0)
    with pytest.raises(ValueError, match=re.escape("v: expected shape")):
        quantizer.run(k, fake(shape[:3] + (64,), "float16"), **args, prompt_lens=lens, stream=0)
    assert len(grids) == 1 and p.starts == 0  # no starts: every prompt at position 0
    starts = fake((B,), "int32")
    quantizer.run(k, v, **args, prompt_lens=lens, starts=starts, stream=0)
    assert p.starts == starts.ptr and len(grids) == 2
    with pytest.raises(ValueError, match="^seq_lens_out: must not overlap starts"):
        quantizer.run(k, v, **args, prompt_lens=lens, starts=starts, seq_lens_out=starts,
                      stream=0)


def test_closed_plan_refuses_to_run():
    plan = AppendPlan.create(HQ, HKV, D, max_batch=4, device=DEVICE)
    plan.close()
    with pytest.raises(RuntimeError, match="AppendPlan is closed"):
        plan.run(**append_args(), stream=0)
