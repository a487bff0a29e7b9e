"""The fuzzed ``run()`` calls (a plain module: pytest collects nothing here): a valid call on fake
device memory, checked to pass, and the same call with one argument broken (fuzz_support)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from hypothesis import strategies as st

from fuzz_support import (DEVICE, DTYPES, LAYOUTS, PARTNERS, PICKS, ROPES, SCALES, Broken,
                          Pointers, Spec, StandInKernel, bad_host_lengths, fake, mutate,
                          outer_axes, overlapping_strides, shifted)
from lowlevel_fd.append import AppendPlan, PromptQuantizer
from lowlevel_fd.core.support import GROUP_SIZES, HEAD_DIMS
from lowlevel_fd.decode import DecodePlan
from lowlevel_fd.decode.params import DecodeParams
from lowlevel_fd.driver import DeviceArray, LaunchConfig

Special = Callable[[str], tuple[str, dict[str, Any], tuple[str, ...]]]


@dataclass
class RunCase:
    """A valid run() call on fake memory and the same call with one argument broken."""
    make: Callable[[], Any]         # a fresh plan, in the state run() needs
    valid: dict[str, Any]
    broken: Broken
    setup: dict[str, Any]

    def __repr__(self) -> str:
        return f"RunCase({self.setup}, {self.broken!r})"


# -- the KV cache: shared by the three entry points --------------------------------------------
def cache_shapes(layout: str, batch: int, heads: int, capacity: int, pad: int, head_dim: int
                 ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int | None, ...]]:
    """(view shape, pool shape, spec shape) of a KV cache in ``layout``."""
    if layout == "bnsh":
        return ((batch, heads, capacity, head_dim), (batch, heads, capacity + pad, head_dim),
                (batch, heads, None, head_dim))
    return ((batch, capacity, heads, head_dim), (batch, capacity + pad, heads, head_dim),
            (batch, None, heads, head_dim))


def kv_arrays(draw: st.DrawFn, pointer: Pointers, *, layout: str, batch: int, heads: int,
              capacity: int, head_dim: int, mode: str, scale_dtype: str, decode: bool
              ) -> tuple[dict[str, DeviceArray], dict[str, Spec]]:
    """Caches (prefixes of longer pools) and scales, with their specs: decode reads them, the
    writers write the caches and per-token scales. Every plan binds them alike (the shared
    cache binder), so only whether they are written differs."""
    pad = draw(st.sampled_from([0, 2, 16]))
    view, pool, spec_shape = cache_shapes(layout, batch, heads, capacity, pad, head_dim)
    cache_spec = Spec(("int8",), spec_shape, align=16, stride_align=16, aligned_axes=(0, 1, 2),
                      written=not decode)
    arrays = {"k_cache": fake(view, "int8", ptr=pointer(), pool=pool),
              "v_cache": fake(view, "int8", ptr=pointer(), pool=pool)}
    if mode == "token":
        # decode reads token scales 4 bytes at a time: their rows start 4-byte aligned, for
        # every plan (the writers' caches are the ones decode reads).
        scale_spec = Spec((scale_dtype,), (batch, heads, capacity), align=4, stride_align=4,
                          aligned_axes=(0, 1), written=not decode)
        for name in ("k_scale", "v_scale"):
            arrays[name] = fake((batch, heads, capacity), scale_dtype, ptr=pointer(),
                                pool=(batch, heads, capacity + pad))
    else:
        count = 1 if mode == "tensor" else heads
        scale_spec = Spec(("float32",), (count,), align=4, dense=True)
        for name in ("k_scale", "v_scale"):
            arrays[name] = fake((count,), "float32", ptr=pointer())
    return arrays, {"k_cache": cache_spec, "v_cache": cache_spec, "k_scale": scale_spec,
                    "v_scale": scale_spec}


def pair_strides(goods: dict[str, DeviceArray], name: str) -> dict[str, Any]:
    """``name`` with the strides of a pool twice as long as its partner's."""
    good = goods[name]
    strides = (good.strides[0] * 2,) + good.strides[1:]
    return {name: fake(good.shape, good.dtype.name, ptr=good.ptr, strides=strides)}


def huge_caches(setup: dict[str, Any], goods: dict[str, DeviceArray]) -> dict[str, DeviceArray]:
    """Caches of 2**31 tokens: positions no longer fit the kernels' int32."""
    view, _, _ = cache_shapes(setup["layout"], setup["batch"], setup["heads"], 2**31, 0,
                              setup["head_dim"])
    return {name: fake(view, "int8", ptr=goods[name].ptr) for name in ("k_cache", "v_cache")}


def overlapping_pair(draw: st.DrawFn, goods: dict[str, DeviceArray], first: str, second: str
                     ) -> dict[str, DeviceArray]:
    """Both arrays of a written pair (caches, token scales) with rows that overlap."""
    good = goods[first]
    strides = overlapping_strides(draw, good)
    return {name: fake(good.shape, good.dtype.name, ptr=goods[name].ptr, strides=strides)
            for name in (first, second)}


def writer_targets(goods: dict[str, DeviceArray], mode: str, rope: str | None) -> list[str]:
    """The special targets AppendPlan and PromptQuantizer share."""
    targets = ["huge capacity", "v_cache strides"]
    targets += ["overlapping caches"] if outer_axes(goods["k_cache"]) else []
    targets += ["v_scale strides"] if mode == "token" else []
    targets += ["overlapping scales"] if mode == "token" and outer_axes(goods["k_scale"]) else []
    return targets + (["short table"] if rope else [])


def writer_special(draw: st.DrawFn, target: str, s: dict[str, Any],
                   goods: dict[str, DeviceArray]) -> tuple[str, dict[str, Any], tuple[str, ...]]:
    if target == "huge capacity":
        return target, huge_caches(s, goods), ("k_cache",)
    if target == "overlapping caches":
        return target, overlapping_pair(draw, goods, "k_cache", "v_cache"), ("k_cache",)
    if target == "overlapping scales":
        return target, overlapping_pair(draw, goods, "k_scale", "v_scale"), ("k_scale",)
    if target == "short table":
        table = goods["cos_sin"]
        rows = draw(st.integers(0, s["capacity"] - 1))
        return target, {"cos_sin": fake((rows,) + table.shape[1:], "float32", ptr=table.ptr)}, (
            "cos_sin",)
    name = target.split()[0]  # "v_cache strides", "v_scale strides"
    return target, pair_strides(goods, name), (name,)


# -- DecodePlan.run() --------------------------------------------------------------------------
@st.composite
def decode_run_cases(draw: st.DrawFn) -> RunCase:
    pick = draw(PICKS)
    head_dim, heads = draw(st.sampled_from(HEAD_DIMS)), draw(st.integers(1, 4))
    q_heads = heads * draw(st.sampled_from(GROUP_SIZES))
    dtype, layout = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(LAYOUTS))
    mode, scale_dtype = draw(st.sampled_from(SCALES))
    batch, capacity = draw(st.integers(1, 4)), draw(st.integers(1, 300))
    capacity += capacity % 2 if scale_dtype == "float16" else 0  # fp16 scale rows 4-aligned
    planned = draw(st.integers(0, capacity))
    max_batch, max_seq_len = batch + draw(st.integers(0, 3)), capacity + draw(st.integers(0, 64))
    combine = draw(st.booleans())

    def make() -> DecodePlan:
        plan = DecodePlan.create(q_heads, heads, head_dim, max_batch=max_batch,
                                 max_seq_len=max_seq_len, dtype=dtype, kv_layout=layout,
                                 scale_mode=mode, scale_dtype=scale_dtype, device=DEVICE)
        plan._binder.planned(batch, planned)  # what plan() would have set
        plan._split = StandInKernel().prepare(LaunchConfig(1, 32), plan._params)
        if combine:
            plan._combine = StandInKernel().prepare(LaunchConfig(1, 128), plan._params)
        return plan

    pointer = Pointers()
    goods, specs = kv_arrays(draw, pointer, layout=layout, batch=batch, heads=heads,
                             capacity=capacity, head_dim=head_dim, mode=mode,
                             scale_dtype=scale_dtype, decode=True)
    rows = (batch, q_heads + draw(st.integers(0, 2)), head_dim)  # q and out: padded heads
    goods |= {"q": fake((batch, q_heads, head_dim), dtype, ptr=pointer(), pool=rows),
              "out": fake((batch, q_heads, head_dim), dtype, ptr=pointer(), pool=rows),
              "seq_lens": fake((batch,), "int32", ptr=pointer()),
              "lse": fake((batch, q_heads), "float32", ptr=pointer())}
    specs |= {"q": Spec((dtype,), (batch, q_heads, head_dim), align=16, stride_align=16,
                        aligned_axes=(0, 1)),
              "out": Spec((dtype,), (batch, q_heads, head_dim), align=2, written=True),
              "seq_lens": Spec(("int32",), (batch,), align=4, dense=True),
              "lse": Spec(("float32",), (batch, q_heads), align=4, dense=True, written=True,
                          optional=True)}
    arguments = dict(goods)
    if draw(st.booleans()):
        arguments["lse"] = None
    make()._binder.bind(DecodeParams(), **arguments)  # the starting point is valid
    setup = {"head_dim": head_dim, "q_heads": q_heads, "heads": heads, "dtype": dtype,
             "layout": layout, "mode": mode, "scale_dtype": scale_dtype, "batch": batch,
             "capacity": capacity, "planned": planned}

    def special(target: str) -> tuple[str, dict[str, Any], tuple[str, ...]]:
        if target == "capacity":  # the caches shorter than the planned longest sequence
            short = draw(st.integers(0, planned - 1))
            view, _, _ = cache_shapes(layout, batch, heads, short, 0, head_dim)
            changes = {name: fake(view, "int8", ptr=goods[name].ptr)
                       for name in ("k_cache", "v_cache")}
            if mode == "token":  # a consistent short cache: its per-token scales are short too
                changes |= {name: fake((batch, heads, short), scale_dtype, ptr=goods[name].ptr,
                                       strides=goods[name].strides)
                            for name in ("k_scale", "v_scale")}
            return target, changes, ("k_cache",)
        if target == "huge capacity":  # DecodeParams.capacity is int32
            return target, huge_caches(setup, goods), ("k_cache",)
        name = target.split()[0]  # "v_cache strides", "v_scale strides"
        return target, pair_strides(goods, name), (name,)

    targets = list(specs) + ["v_cache strides", "huge capacity"]
    targets += ["capacity"] if planned else []
    targets += ["v_scale strides"] if mode == "token" else []
    return RunCase(make, arguments, mutate(draw, pick, goods, specs, arguments, targets, special),
                   setup)


# -- AppendPlan.run() and PromptQuantizer.run() ------------------------------------------------
def runner_setup(draw: st.DrawFn) -> dict[str, Any]:
    mode, scale_dtype = draw(st.sampled_from(SCALES))
    setup = {"head_dim": draw(st.sampled_from(HEAD_DIMS)), "heads": draw(st.integers(1, 4)),
             "dtype": draw(st.sampled_from(DTYPES)), "layout": draw(st.sampled_from(LAYOUTS)),
             "mode": mode, "scale_dtype": scale_dtype, "rope": draw(st.sampled_from(ROPES)),
             "batch": draw(st.integers(1, 4)), "capacity": draw(st.integers(1, 300))}
    if scale_dtype == "float16":  # fp16 scale rows 4-byte aligned (as decode reads them)
        setup["capacity"] += setup["capacity"] % 2
    return setup


def rope_arrays(draw: st.DrawFn, pointer: Pointers, setup: dict[str, Any]
                ) -> tuple[dict[str, DeviceArray], dict[str, Spec]]:
    """The cos/sin table, loaded as float2: 8-byte aligned."""
    half = setup["head_dim"] // 2
    rows = setup["capacity"] + draw(st.integers(0, 8))
    return ({"cos_sin": fake((rows, half, 2), "float32", ptr=pointer())},
            {"cos_sin": Spec(("float32",), (None, half, 2), align=8, dense=True, optional=True)})


def host_lengths_case(draw: st.DrawFn, name: str, count: int, limit: int
                      ) -> tuple[str, dict[str, Any], tuple[str, ...]]:
    kind, value = draw(bad_host_lengths(count, limit))
    if kind in ("none", "device array"):  # None means "no host copy"; arrays are read as such
        kind, value = "length", [0] * (count + 1)
    return kind, {name: value}, (name,)


def valid_for(make: Callable[[], Any], arguments: dict[str, Any]) -> None:
    """The starting point is valid: run() on a plan whose launch does nothing passes."""
    plan = make()
    plan._launch = lambda grid, stream: None
    plan.run(**arguments, stream=0)


@st.composite
def append_run_cases(draw: st.DrawFn) -> RunCase:
    pick = draw(PICKS)
    s = runner_setup(draw)
    batch, capacity, heads, head_dim, dtype = (s[k] for k in ("batch", "capacity", "heads",
                                                                "head_dim", "dtype"))
    q_heads = heads * draw(st.sampled_from(GROUP_SIZES))
    max_batch = batch + draw(st.integers(0, 3))

    def make() -> AppendPlan:
        return AppendPlan.create(q_heads, heads, head_dim, max_batch=max_batch,
                                 kv_layout=s["layout"], scale_mode=s["mode"],
                                 scale_dtype=s["scale_dtype"], dtype=dtype, rope=s["rope"],
                                 device=DEVICE)

    pointer = Pointers()
    goods, specs = kv_arrays(draw, pointer, layout=s["layout"], batch=batch, heads=heads,
                             capacity=capacity, head_dim=head_dim, mode=s["mode"],
                             scale_dtype=s["scale_dtype"], decode=False)
    tokens, query = (batch, heads, head_dim), (batch, q_heads, head_dim)
    fused = (batch, q_heads + 2 * heads, head_dim)  # k and v: views of a fused qkv output
    goods |= {"k_new": fake(tokens, dtype, ptr=pointer(), pool=fused),
              "v_new": fake(tokens, dtype, ptr=pointer(), pool=fused),
              "seq_lens": fake((batch,), "int32", ptr=pointer()),
              "q": fake(query, dtype, ptr=pointer()), "q_out": fake(query, dtype, ptr=pointer())}
    table, table_spec = rope_arrays(draw, pointer, s)
    goods, specs = goods | table, specs | table_spec
    arguments = {name: goods[name] for name in ("k_new", "v_new", "k_cache", "v_cache",
                                                "k_scale", "v_scale", "seq_lens")}
    arguments["advance"] = draw(st.booleans())
    if draw(st.booleans()):
        arguments["host_seq_lens"] = draw(st.lists(st.integers(0, capacity - 1),
                                                   min_size=batch, max_size=batch))
    if s["rope"]:  # without RoPE, q, q_out and cos_sin are errors (fuzzed below)
        for name in ("q", "cos_sin"):
            if draw(st.booleans()):
                arguments[name] = goods[name]
        if "q" in arguments and draw(st.booleans()):
            arguments["q_out"] = goods["q_out"]
    valid_for(make, arguments)
    rows = {"align": 16, "stride_align": 16, "aligned_axes": (0, 1)}
    specs |= {"k_new": Spec((dtype,), (None, heads, head_dim), **rows),
              "v_new": Spec((dtype,), tokens, **rows),
              "seq_lens": Spec(("int32",), (batch,), align=4, dense=True, written=True),
              # q is rotated in place unless a q_out is given
              "q": Spec((dtype,), query, optional=True, written="q_out" not in arguments,
                        **rows),
              "q_out": Spec((dtype,), query, optional=True, written=True, **rows)}

    def special(target: str) -> tuple[str, dict[str, Any], tuple[str, ...]]:
        if target == "over max_batch":
            shape = (max_batch + draw(st.integers(1, 3)), heads, head_dim)
            return target, {"k_new": fake(shape, dtype, ptr=goods["k_new"].ptr)}, ("k_new",)
        if target == "host_seq_lens":
            return host_lengths_case(draw, target, batch, capacity - 1)
        if target == "advance":
            return target, {target: draw(st.sampled_from([1, 0, "yes", 1.0, "False"]))}, (target,)
        if target == "q_out overlaps q":  # neither q itself nor disjoint from it
            q = goods["q"]
            by = 16 * draw(st.integers(1, q.nbytes // 16 - 1)) * draw(st.sampled_from([1, -1]))
            return target, {"q": q, "q_out": shifted(q, by)}, ("q_out",)
        return writer_special(draw, target, s, goods)

    targets = list(specs) + ["over max_batch", "host_seq_lens", "advance"]
    targets += writer_targets(goods, s["mode"], s["rope"])
    targets += ["q_out overlaps q"] if s["rope"] else []
    s["q_heads"] = q_heads
    broken = mutate(draw, pick, goods, specs, arguments, targets, special)
    return RunCase(make, arguments, broken, s)


@st.composite
def prompt_run_cases(draw: st.DrawFn, *, for_function: bool = False) -> RunCase:
    pick = draw(PICKS)
    s = runner_setup(draw)
    s["prompt_layout"] = draw(st.sampled_from(("bsnh", "bnsh")))
    batch, capacity, heads, head_dim, dtype = (s[k] for k in ("batch", "capacity", "heads",
                                                                "head_dim", "dtype"))
    tokens, max_batch = draw(st.integers(1, 40)), batch + draw(st.integers(0, 3))

    def make() -> PromptQuantizer:
        return PromptQuantizer.create(heads, head_dim, max_batch=max_batch,
                                      kv_layout=s["layout"], prompt_layout=s["prompt_layout"],
                                      scale_mode=s["mode"], scale_dtype=s["scale_dtype"],
                                      dtype=dtype, rope=s["rope"], device=DEVICE)

    def prompt_shape(b: Any, t: Any) -> tuple[Any, ...]:
        return (b, t, heads, head_dim) if s["prompt_layout"] == "bsnh" else (b, heads, t, head_dim)

    pointer = Pointers()
    goods, specs = kv_arrays(draw, pointer, layout=s["layout"], batch=batch, heads=heads,
                             capacity=capacity, head_dim=head_dim, mode=s["mode"],
                             scale_dtype=s["scale_dtype"], decode=False)
    pool = prompt_shape(batch, tokens + draw(st.sampled_from([0, 1, 8])))
    goods |= {"k": fake(prompt_shape(batch, tokens), dtype, ptr=pointer(), pool=pool),
              "v": fake(prompt_shape(batch, tokens), dtype, ptr=pointer(), pool=pool),
              "prompt_lens": fake((batch,), "int32", ptr=pointer()),
              "seq_lens_out": fake((batch,), "int32", ptr=pointer())}
    rows = {"align": 16, "stride_align": 16, "aligned_axes": (0, 1, 2)}
    lengths = {"align": 4, "dense": True}
    specs |= {"k": Spec((dtype,), prompt_shape(None, None), **rows),
              "v": Spec((dtype,), prompt_shape(batch, tokens), **rows),
              "prompt_lens": Spec(("int32",), (batch,), **lengths),
              "seq_lens_out": Spec(("int32",), (batch,), optional=True, written=True,
                                   **lengths)}
    table, table_spec = rope_arrays(draw, pointer, s)
    goods, specs = goods | table, specs | table_spec
    arguments = {name: goods[name] for name in ("k", "v", "k_cache", "v_cache", "k_scale",
                                                "v_scale", "prompt_lens")}
    for name in ("seq_lens_out",) + (("cos_sin",) if s["rope"] else ()):
        if draw(st.booleans()):
            arguments[name] = goods[name]
    if draw(st.booleans()):
        arguments["host_prompt_lens"] = draw(st.lists(
            st.integers(0, min(tokens, capacity)), min_size=batch, max_size=batch))
    valid_for(make, arguments)

    def special(target: str) -> tuple[str, dict[str, Any], tuple[str, ...]]:
        k = goods["k"]
        if target == "over max_batch":
            shape = prompt_shape(max_batch + draw(st.integers(1, 3)), tokens)
            return target, {"k": fake(shape, dtype, ptr=k.ptr)}, ("k",)
        if target == "too many tokens":
            return target, {"k": fake(prompt_shape(batch, 2**31), dtype, ptr=k.ptr)}, ("k",)
        if target == "host_prompt_lens":
            return host_lengths_case(draw, target, batch, min(tokens, capacity))
        return writer_special(draw, target, s, goods)

    targets = list(specs) + ["host_prompt_lens"] + writer_targets(goods, s["mode"], s["rope"])
    partners = dict(PARTNERS)
    if for_function:
        # quantize_prompt takes the cache (heads, head_dim, scales) from its spec and the rest
        # off k: its batch, its dtype and its device. A k on another device (or of the other
        # half type) moves the plan, so that v is the argument on the wrong device (of the
        # wrong dtype).
        partners["k"] = ("v",)
    else:
        targets += ["over max_batch", "too many tokens"]
    s["tokens"] = tokens
    broken = mutate(draw, pick, goods, specs, arguments, targets, special, partners)
    return RunCase(make, arguments, broken, s)
