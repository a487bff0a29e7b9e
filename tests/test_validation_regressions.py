"""Argument checks pinned case by case: the inputs first found by hand, each once let through
(or reported without the argument's name). Each must raise ValueError/TypeError naming the
argument, before anything is compiled or launched. The fuzz tests (test_fuzz_*.py) cover the
same clauses in general; these keep the original cases readable and fast to rerun."""
from __future__ import annotations

import operator
import re
from typing import Any, Callable

import numpy as np
import pytest

from fuzz_support import (ForeignArray, Pointers, StandInKernel, assert_rejected, restrided,
                          shifted)
from fuzz_support import nothing_launches  # noqa: F401  (autouse: nothing may launch)
from lowlevel_fd import KVCacheSpec
from lowlevel_fd.append import AppendPlan, PromptQuantizer, quantize_prompt
from lowlevel_fd.decode import DecodePlan, TileConfig
from lowlevel_fd.decode import plan as decode_plan
from lowlevel_fd.driver import CudaError, LaunchConfig
from lowlevel_fd.driver._api import raw
from stand_ins import DEVICE, fake

GB, GHQ, GHKV, GD, GCAP = 2, 8, 2, 128, 64  # one small valid configuration


# -- valid calls, changed by one argument -------------------------------------------------------
def decode_call(change: Callable[[dict[str, Any]], dict[str, Any]], *, mode: str = "token",
                capacity: int = GCAP) -> Callable[[], None]:
    """A DecodePlan.run call on valid arguments but for ``change``."""
    def call() -> None:
        plan = DecodePlan.create(GHQ, GHKV, GD, max_batch=GB, max_seq_len=GCAP,
                                 scale_mode=mode, device=DEVICE)
        plan._binder.planned(GB, GCAP)
        plan._split = StandInKernel().prepare(LaunchConfig(1, 32), plan._params)
        pointer = Pointers()
        scale = {"token": (GB, GHKV, capacity), "head": (GHKV,), "tensor": (1,)}[mode]
        arguments = {"q": fake((GB, GHQ, GD), "float16", ptr=pointer()),
                     "k_cache": fake((GB, GHKV, capacity, GD), "int8", ptr=pointer()),
                     "v_cache": fake((GB, GHKV, capacity, GD), "int8", ptr=pointer()),
                     "k_scale": fake(scale, "float32", ptr=pointer()),
                     "v_scale": fake(scale, "float32", ptr=pointer()),
                     "seq_lens": fake((GB,), "int32", ptr=pointer()),
                     "out": fake((GB, GHQ, GD), "float16", ptr=pointer()),
                     "lse": fake((GB, GHQ), "float32", ptr=pointer())}
        plan.run(**arguments | change(arguments), stream=0)
    return call


def append_arguments(mode: str = "token", rope: str | None = "neox") -> dict[str, Any]:
    pointer = Pointers()
    scale = {"token": (GB, GHKV, GCAP), "head": (GHKV,), "tensor": (1,)}[mode]
    arguments = {"k_new": fake((GB, GHKV, GD), "float16", ptr=pointer()),
                 "v_new": fake((GB, GHKV, GD), "float16", ptr=pointer()),
                 "k_cache": fake((GB, GHKV, GCAP, GD), "int8", ptr=pointer()),
                 "v_cache": fake((GB, GHKV, GCAP, GD), "int8", ptr=pointer()),
                 "k_scale": fake(scale, "float32", ptr=pointer()),
                 "v_scale": fake(scale, "float32", ptr=pointer()),
                 "seq_lens": fake((GB,), "int32", ptr=pointer())}
    if rope:
        arguments |= {"q": fake((GB, GHQ, GD), "float16", ptr=pointer()),
                      "cos_sin": fake((GCAP, GD // 2, 2), "float32", ptr=pointer())}
    return arguments


def append_call(change: Callable[[dict[str, Any]], dict[str, Any]], *, mode: str = "token",
                rope: str | None = "neox") -> Callable[[], None]:
    def call() -> None:
        plan = AppendPlan.create(GHQ, GHKV, GD, max_batch=GB, scale_mode=mode, rope=rope,
                                 device=DEVICE)
        arguments = append_arguments(mode, rope)
        plan.run(**arguments | change(arguments), stream=0)
    return call


def prompt_call(change: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[[], None]:
    def call() -> None:
        quantizer = PromptQuantizer.create(GHKV, GD, max_batch=GB, device=DEVICE)
        pointer = Pointers()
        arguments = {"k": fake((GB, 16, GHKV, GD), "float16", ptr=pointer()),
                     "v": fake((GB, 16, GHKV, GD), "float16", ptr=pointer()),
                     "k_cache": fake((GB, GHKV, GCAP, GD), "int8", ptr=pointer()),
                     "v_cache": fake((GB, GHKV, GCAP, GD), "int8", ptr=pointer()),
                     "k_scale": fake((GB, GHKV, GCAP), "float32", ptr=pointer()),
                     "v_scale": fake((GB, GHKV, GCAP), "float32", ptr=pointer()),
                     "prompt_lens": fake((GB,), "int32", ptr=pointer()),
                     "seq_lens_out": fake((GB,), "int32", ptr=pointer())}
        arguments |= change(arguments)
        if arguments.pop("function", False):
            quantize_prompt(quantizer.cache, **arguments, stream=0)
        else:
            quantizer.run(**arguments, stream=0)
    return call


def planning(config: Any = None, seq_lens: Any = (5, 9)) -> Callable[[], None]:
    return lambda: DecodePlan.create(GHQ, GHKV, GD, max_batch=GB, max_seq_len=GCAP,
                                     device=DEVICE).plan(seq_lens, config=config)


def decode_new(**changes: Any) -> Callable[[], DecodePlan]:
    options = {"num_q_heads": GHQ, "num_kv_heads": GHKV, "head_dim": GD, "max_batch": GB,
               "max_seq_len": GCAP, "device": DEVICE} | changes
    return lambda: DecodePlan.create(**options)


def append_new(**changes: Any) -> Callable[[], AppendPlan]:
    options = {"num_q_heads": GHQ, "num_kv_heads": GHKV, "head_dim": GD, "max_batch": GB,
               "device": DEVICE} | changes
    return lambda: AppendPlan.create(**options)


def case(case_id: str, call: Callable[[], Any], names: tuple[str, ...], message: str = ""
         ) -> Any:
    return pytest.param(call, names, message, id=case_id)


K_FLOAT32 = (GB, 16, GHKV, GD)
CASES = [
    # constructors: types of the integer and float options, the device
    case("DecodePlan num_q_heads=None", decode_new(num_q_heads=None), ("num_q_heads",),
         r"num_q_heads: expected an int, got NoneType None"),
    case("DecodePlan num_q_heads=8.0", decode_new(num_q_heads=8.0), ("num_q_heads",)),
    case("DecodePlan num_kv_heads='2'", decode_new(num_kv_heads="2"), ("num_kv_heads",)),
    case("DecodePlan max_batch=None", decode_new(max_batch=None), ("max_batch",)),
    case("DecodePlan max_batch=2.5", decode_new(max_batch=2.5), ("max_batch",)),
    case("DecodePlan max_batch=True", decode_new(max_batch=True), ("max_batch",)),
    case("DecodePlan max_seq_len=10.5", decode_new(max_seq_len=10.5), ("max_seq_len",)),
    case("DecodePlan head_dim=128.0", decode_new(head_dim=128.0), ("head_dim",)),
    case("AppendPlan head_dim=128.0", append_new(head_dim=128.0), ("head_dim",)),
    case("PromptQuantizer head_dim=64.0",
         lambda: PromptQuantizer.create(GHKV, 64.0, max_batch=GB, device=DEVICE),
         ("head_dim",)),
    case("DecodePlan sm_scale='x'", decode_new(sm_scale="x"), ("sm_scale",),
         r"sm_scale: expected a real number, got str 'x'"),
    case("DecodePlan sm_scale=nan", decode_new(sm_scale=float("nan")), ("sm_scale",),
         r"sm_scale: expected a finite number, got nan"),
    case("DecodePlan sm_scale=inf", decode_new(sm_scale=float("inf")), ("sm_scale",)),
    case("DecodePlan sm_scale=0", decode_new(sm_scale=0), ("sm_scale",),
         r"sm_scale: expected a finite non-zero scale"),
    case("AppendPlan rope_theta='x'", append_new(rope="neox", rope_theta="x"), ("rope_theta",)),
    case("AppendPlan rope_theta=None", append_new(rope_theta=None), ("rope_theta",)),
    case("DecodePlan dtype=np.float16 (a type)", decode_new(dtype=np.float16), ("dtype",),
         r"dtype: expected a dtype name or numpy dtype"),
    case("KVCacheSpec scale_dtype=np.float16 (a type)",
         lambda: KVCacheSpec(GHKV, GD, scale_dtype=np.float16), ("scale_dtype",),
         r"scale_dtype: expected a dtype name or numpy dtype"),
    case("DecodePlan cache=None", lambda: DecodePlan(None, GHQ, max_batch=GB, max_seq_len=GCAP,
                                                     device=DEVICE), ("cache",),
         r"cache: expected a KVCacheSpec, got NoneType None"),
    case("AppendPlan dtype=np.dtype(float32)", append_new(dtype=np.dtype("float32")),
         ("dtype",), r"dtype: expected one of \['float16', 'bfloat16'\], got dtype\('float32'\)"),
    case("DecodePlan device='cuda:0'", decode_new(device="cuda:0"), ("device",),
         r"device: expected a lowlevel_fd.driver.Device \(or None for device 0\), got str"),
    case("AppendPlan device=1", append_new(device=1), ("device",)),
    # plan()
    case("plan seq_lens ragged", planning(seq_lens=[[1, 2], [3]]), ("seq_lens",),
         r"seq_lens: expected a 1-D sequence of integer lengths, got a list numpy cannot"),
    case("plan config num_warps=3", planning(TileConfig(num_warps=3)), ("config",),
         r"config.num_warps: expected one of \[2, 4, 8\], got 3"),
    case("plan config num_warps=16", planning(TileConfig(num_warps=16)), ("config",),
         r"config.num_warps: expected one of \[2, 4, 8\], got 16$"),
    case("plan config stages=-1", planning(TileConfig(stages=-1)), ("config",)),
    case("plan config stages=1", planning(TileConfig(stages=1)), ("config",),
         r"config.stages: expected 0 \(the head_dim's default\) or at least 2, got 1"),
    case("plan config num_splits=2.5", planning(TileConfig(num_splits=2.5)), ("config",),
         r"config.num_splits: expected an int, got float 2.5"),
    case("plan config cluster of 17", planning(TileConfig(num_splits=17, cluster=True)),
         ("config",), r"config.cluster: a cluster holds 1..16 splits, got 17"),
    case("plan config fused_merge='no'", planning(TileConfig(fused_merge="no")), ("config",)),
    case("plan config not a TileConfig", planning({"num_splits": 2}), ("config",),
         r"config: expected a TileConfig, got dict"),
    # DecodePlan.run(): pointers the kernel cannot load from, outputs that overlap, capacity
    case("decode out misaligned", decode_call(lambda a: {"out": shifted(a["out"], 1)}),
         ("out",), r"out: the data pointer must be 2-byte aligned"),
    case("decode lse misaligned", decode_call(lambda a: {"lse": shifted(a["lse"], 2)}),
         ("lse",)),
    case("decode seq_lens misaligned",
         decode_call(lambda a: {"seq_lens": shifted(a["seq_lens"], 2)}), ("seq_lens",)),
    case("decode head scale misaligned",
         decode_call(lambda a: {"k_scale": shifted(a["k_scale"], 2)}, mode="head"),
         ("k_scale",)),
    case("decode out stride not a whole element",
         decode_call(lambda a: {"out": restrided(a["out"], (GHQ * GD * 2 + 1, GD * 2, 2))}),
         ("out",), r"out: the stride of axis 0 must be a multiple of 2 bytes"),
    case("decode out rows overlap",
         decode_call(lambda a: {"out": restrided(a["out"], (GHQ * GD * 2, 2, 2))}), ("out",),
         r"out: is written, so its elements must not overlap"),
    case("decode out batch stride 0",
         decode_call(lambda a: {"out": restrided(a["out"], (0, GD * 2, 2))}), ("out",)),
    case("decode capacity 2**31", decode_call(lambda a: {}, capacity=2**31), ("k_cache",),
         r"k_cache: expected fewer than 2\*\*31 tokens of capacity, got 2147483648"),
    case("decode q malformed interface",
         decode_call(lambda a: {"q": ForeignArray((GB, GHQ, GD), "<f2", 1 << 32, drop="data")}),
         ("q",), r"q: expected a __cuda_array_interface__ dict with 'shape', 'typestr' and"),
    case("decode q over host memory",
         decode_call(lambda a: {"q": ForeignArray((GB, GHQ, GD), "<f2", 1 << 32)}), ("q",),
         r"q: pointer 0x100000000 of ForeignArray is not device memory "
         r"\(cuPointerGetAttribute: CUDA_ERROR_INVALID_VALUE\)"),
    # AppendPlan.run()
    case("append token scale misaligned",
         append_call(lambda a: {"k_scale": shifted(a["k_scale"], 2)}), ("k_scale",)),
    case("append head scale not contiguous",
         append_call(lambda a: {"k_scale": restrided(a["k_scale"], (8,))}, mode="head"),
         ("k_scale",), r"k_scale: expected a C-contiguous array"),
    case("append seq_lens misaligned",
         append_call(lambda a: {"seq_lens": shifted(a["seq_lens"], 2)}), ("seq_lens",)),
    case("append cos_sin misaligned (float2 loads)",
         append_call(lambda a: {"cos_sin": shifted(a["cos_sin"], 4)}), ("cos_sin",),
         r"cos_sin: the data pointer must be 8-byte aligned"),
    case("append q_out overlaps q",
         append_call(lambda a: {"q_out": shifted(a["q"], GD * 2)}), ("q_out",),
         r"q_out: expected q itself or memory disjoint from it, got bytes \[0x"),
    case("append q rotated in place with rows that overlap",
         append_call(lambda a: {"q": restrided(a["q"], (0, GD * 2, 2))}), ("q",)),
    case("append cache batch stride 0",
         append_call(lambda a: {name: restrided(a[name], (0,) + a[name].strides[1:])
                                for name in ("k_cache", "v_cache")}), ("k_cache",)),
    case("append host_seq_lens ragged", append_call(lambda a: {"host_seq_lens": [[1], [2, 3]]}),
         ("host_seq_lens",)),
    # PromptQuantizer.run() and quantize_prompt()
    case("prompt prompt_lens misaligned",
         prompt_call(lambda a: {"prompt_lens": shifted(a["prompt_lens"], 2)}), ("prompt_lens",)),
    case("prompt seq_lens_out misaligned",
         prompt_call(lambda a: {"seq_lens_out": shifted(a["seq_lens_out"], 1)}),
         ("seq_lens_out",)),
    case("prompt host_prompt_lens ragged",
         prompt_call(lambda a: {"host_prompt_lens": [[1], [2, 3]]}), ("host_prompt_lens",)),
    case("quantize_prompt k=None", prompt_call(lambda a: {"function": True, "k": None}), ("k",),
         r"k: expected a device array, got None"),
    case("quantize_prompt k host array",
         prompt_call(lambda a: {"function": True, "k": np.zeros(K_FLOAT32, np.float16)}),
         ("k",)),
    case("quantize_prompt k float32",
         prompt_call(lambda a: {"function": True,
                                "k": fake(K_FLOAT32, "float32", ptr=a["k"].ptr)}),
         ("k",), r"k: expected dtype float16 or bfloat16, got float32"),
    case("quantize_prompt k_scale=None",
         prompt_call(lambda a: {"function": True, "k_scale": None}), ("k_scale",)),
]


def stand_in_kernels(program: Any, device: Any) -> tuple[StandInKernel, ...]:
    """load_kernels for a plan that got past its checks: kernels that pack but never launch."""
    return tuple(StandInKernel() for _ in program.kernel_names)


def test_the_helpers_make_fake_memory_on_the_plans_device():
    # shifted/restrided (fuzz_support) and fake (stand_ins) must agree on the stand-in device,
    # or a changed argument would be refused for its device, not for what was changed.
    array = fake((GB, GHQ, GD), "float16")
    assert shifted(array, 2).device is restrided(array, array.strides).device is DEVICE
    assert not shifted(array, 2).closed and not restrided(array, array.strides).closed


@pytest.mark.parametrize("call, names, message", CASES)
def test_rejected_naming_the_argument(call, names, message, monkeypatch):
    monkeypatch.setattr(decode_plan, "load_kernels", stand_in_kernels)
    text = assert_rejected(call, names)
    assert re.match(message, text), f"{text!r} does not open with {message!r}"


def test_plan_checks_the_config_before_compiling(monkeypatch):
    loaded: list[Any] = []
    monkeypatch.setattr(decode_plan, "load_kernels", lambda program, device: loaded.append(
        program) or stand_in_kernels(program, device))
    assert_rejected(planning(TileConfig(num_splits=0)), ("config",))
    assert not loaded, "config.num_splits must be checked before compiling and loading"


@pytest.mark.parametrize("tiles, error", [(3, ValueError), (0, ValueError), (2.0, TypeError)])
def test_plan_rejects_unsupported_tiles_per_step(tiles, error, monkeypatch):
    monkeypatch.setattr(decode_plan, "load_kernels", stand_in_kernels)
    with pytest.raises(error, match=r"^config\.tiles: "):
        planning(TileConfig(tiles=tiles))()


# -- what is accepted, and how it is stored -----------------------------------------------------
@pytest.mark.parametrize("make, stored", [
    (decode_new(dtype=np.dtype("float16"), scale_dtype=np.dtype("float16")),
     {"dtype": "float16", "cache.scale_dtype": "float16"}),
    (decode_new(dtype="bfloat16"), {"dtype": "bfloat16", "cache.scale_dtype": "float32"}),
    (append_new(dtype=np.dtype("bfloat16")), {"dtype": "bfloat16"}),
    (lambda: PromptQuantizer.create(GHKV, GD, max_batch=GB, dtype=np.dtype("bfloat16"),
                                    scale_dtype=np.dtype("float32"), device=DEVICE),
     {"dtype": "bfloat16", "cache.scale_dtype": "float32"}),
    (lambda: KVCacheSpec(GHKV, GD, scale_dtype=np.dtype("float16"),
                         cache_dtype=np.dtype("int8")),
     {"scale_dtype": "float16", "cache_dtype": "int8"}),
])
def test_dtype_options_are_stored_as_the_plain_names_the_variants_use(make, stored):
    plan = make()
    values = {name: operator.attrgetter(name)(plan) for name in stored}
    assert values == stored
    assert all(type(value) is str for value in values.values())


def test_numpy_integer_options_are_accepted_as_ints():
    plan = decode_new(num_q_heads=np.int64(GHQ), head_dim=np.int32(GD),
                      max_batch=np.int64(GB))()
    append = append_new(num_kv_heads=np.int64(GHKV), head_dim=np.int64(GD))()
    assert (plan.num_q_heads, plan.head_dim, plan.max_batch) == (GHQ, GD, GB)
    assert type(plan.head_dim) is int and type(append.variant.head_dim) is int
    assert (type(plan.num_q_heads), type(plan.max_batch)) == (int, int)
    assert type(append.num_kv_heads) is int


def test_a_device_stand_in_needs_an_int_ordinal_and_a_compute_capability():
    assert decode_new()().device is DEVICE
    assert_rejected(decode_new(device=type("NoCapability", (), {"ordinal": 0})()),
                    ("device",))


def test_q_out_may_be_q_itself_or_disjoint_from_it():
    plan = AppendPlan.create(GHQ, GHKV, GD, max_batch=GB, rope="neox", device=DEVICE)
    launches: list[Any] = []
    plan._launch = lambda grid, stream: launches.append(grid)
    arguments = append_arguments()
    q = arguments["q"]
    for q_out in (q, restrided(q, q.strides), shifted(q, q.nbytes), shifted(q, -q.nbytes)):
        plan.run(**arguments, q_out=q_out, stream=0)
    assert launches == [(GB,)] * 4


def test_a_misaligned_address_fault_says_what_to_check():
    error = CudaError("cuStreamSynchronize", raw.CUresult.CUDA_ERROR_MISALIGNED_ADDRESS)
    assert "a pointer is not aligned to its element size" in str(error)
