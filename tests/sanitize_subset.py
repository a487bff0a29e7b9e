"""A small run of every kernel path, for compute-sanitizer (tools/sanitize.sh runs it under
memcheck, racecheck, initcheck and synccheck).

Decode: odd lengths, a ragged batch with empty sequences, every scale mode in both layouts with
fp16 and bf16, the three head dims, forced split configs (fused merge, the separate combine
kernel, clusters on sm_90), graph replay, device lengths beyond the capacity. Append: every scale
mode in both layouts, both RoPE styles from a table and from theta, bf16, positions outside the
cache. Prompts: both prompt layouts, RoPE, lengths clamped to the prompt and the capacity.
Fused append: both RoPE styles from a table and from theta, the three merges, head_dim 256,
positions outside the cache, advance_lengths. Paged storage (tests/test_paged_gpu.py's cases):
page sizes 1, 16 and 256 in both layouts, bad page ids in attention and in every writer, the
fused append across page edges, prompts in chunks, pools that are views (K and V in one
allocation, scales inline after each row). Multi-token attention (tests/test_multi_gpu.py's
cases): every head dim, contiguous and paged, ragged with empty rows, KV splits and their
merge, group sizes 5 and 71, RoPE of q, graph replay, the device guards, bad page ids; decode
rows (DecodePlan's route): empty sequences on every multi-token kernel, paged.

Every result is checked against the oracle, so a silent failure is caught too. Outputs are
NaN-poisoned and caches fully uploaded first, so initcheck only sees initialized memory.
Not a pytest file. Usage: ``python3 tests/sanitize_subset.py [-k SUBSTRING] [--list]``; the
last line reads "sanitize_subset: N passed, M failed" and the exit status is 1 on a failure.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
import traceback
import zlib
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # the repository's lowlevel_fd

from decode_case import TOLERANCE, Case  # noqa: E402  (tests/ is this script's directory)
from append_case import cache_state  # noqa: E402
from test_fused_append_gpu import Fused  # noqa: E402

from lowlevel_fd import ERROR_OUTSIDE_CACHE, ERROR_PROMPT_LENGTH  # noqa: E402
from lowlevel_fd.append import AppendPlan, PromptQuantizer  # noqa: E402
from lowlevel_fd.append.reference import append_ref, prompt_ref  # noqa: E402
from lowlevel_fd.decode import TileConfig  # noqa: E402
from lowlevel_fd.driver import Device, DeviceArray, Stream, capture, dtypes  # noqa: E402
from lowlevel_fd.reference import rope_table  # noqa: E402

MODES = [("tensor", "float32"), ("head", "float32"), ("token", "float32"), ("token", "float16")]
LAYOUTS = ("bnsh", "bsnh")
CASES: list[tuple[str, Callable[[np.random.Generator, Stream], None]]] = []


def case(name: str, run: Callable[[np.random.Generator, Stream], None]) -> None:
    CASES.append((name, run))


# -- decode ------------------------------------------------------------------------------------
def runnable(config: TileConfig | None, options: dict) -> bool:
    """False (and says so) for a cluster merge before sm_90; fills in the small default heads."""
    if getattr(config, "cluster", False) and Device(0).compute_capability < (9, 0):
        print("     (cluster merge needs sm_90: skipped)")
        return False
    options.setdefault("num_q_heads", 8)
    options.setdefault("num_kv_heads", 2)
    return True


def decode(lengths: list[int], *, config: TileConfig | None = None, lse: bool = True,
           **options: object) -> Callable[[np.random.Generator, Stream], None]:
    def run(rng: np.random.Generator, stream: Stream) -> None:
        if not runnable(config, options):
            return
        c = Case.random(rng, lengths, **options)
        d = c.upload()
        with c.make_plan() as plan:
            if lse:
                c.check(*c.run(plan, stream, config=config))
            else:  # the optional lse left out: only out is written
                plan.plan(c.lengths, config=config)
                d["out"].fill(float("nan"))
                plan.run(d["q"], d["k"], d["v"], d["k_scale"], d["v_scale"], d["seq_lens"],
                         d["out"], stream=stream)
                stream.synchronize()
                reference, _ = c.reference()
                out = d["out"].numpy().astype(np.float64)
                error = np.abs(out - reference).max() / np.abs(reference).max()
                assert error <= TOLERANCE[c.dtype], f"max|out-ref|/max|ref| = {error:.3e}"
            assert plan.error_flags(stream=stream) == 0
    return run


def decode_graph_replay(rng: np.random.Generator, stream: Stream) -> None:
    c = Case.random(rng, [300, 20, 0], num_q_heads=16, num_kv_heads=4, capacity=1100)
    d = c.upload()
    with c.make_plan() as plan:
        plan.plan([1100] * 3)
        with capture(stream) as graph:
            plan.run(d["q"], d["k"], d["v"], d["k_scale"], d["v_scale"], d["seq_lens"],
                     d["out"], lse=d["lse"], stream=stream)
        for lengths in ([300, 20, 0], [1, 1099, 65], [1100, 0, 17]):
            c.lengths, c.host["seq_lens"] = lengths, np.asarray(lengths, np.int32)
            d["seq_lens"].copy_from_numpy(c.host["seq_lens"])
            d["out"].fill(float("nan"))
            d["lse"].fill(float("nan"))
            graph.launch(stream)
            stream.synchronize()
            c.check(d["out"].numpy().astype(np.float64), d["lse"].numpy().astype(np.float64))
        graph.close()


def decode_guard(config: TileConfig | None) -> Callable[[np.random.Generator, Stream], None]:
    def run(rng: np.random.Generator, stream: Stream) -> None:
        capacity = 83  # the last 16-token tile straddles the capacity
        device_lengths = [capacity, capacity + 1, 2**31 - 1, -5, 17]
        clamped = [min(max(n, 0), capacity) for n in device_lengths]
        c = Case.random(rng, clamped, num_q_heads=8, num_kv_heads=2, capacity=capacity)
        d = c.upload()
        d["seq_lens"].copy_from_numpy(np.asarray(device_lengths, np.int32))
        with c.make_plan() as plan:
            out, lse = c.run(plan, stream, config=config)
            assert plan.error_flags(stream=stream) & ERROR_OUTSIDE_CACHE, (
                "lengths beyond the capacity are flagged")
            c.check(out, lse)
    return run


for layout in LAYOUTS:
    for mode, scale_dtype in MODES:
        for dtype in ("float16", "bfloat16"):
            case(f"decode {layout} {mode}/{scale_dtype} {dtype}",
                 decode([65, 1, 0, 300], kv_layout=layout, scale_mode=mode,
                        scale_dtype=scale_dtype, dtype=dtype))
case("decode odd lengths 1 63 65 1025", decode([1, 63, 65, 1025]))
case("decode ragged batch with empty sequences", decode([0, 5, 1025, 0, 77], kv_layout="bsnh"))
case("decode head_dim 64 group 16", decode([129, 7], num_q_heads=32, head_dim=64))
case("decode head_dim 256 group 8", decode([129, 7], num_q_heads=16, head_dim=256))
case("decode without lse", decode([65, 2], lse=False))
# Query groups that are not 1, 2, 4, 8, 16: masked heads, and chunks of 16 heads per KV head.
case("decode group 3 masked, cluster merge",
     decode([0, 700, 33], config=TileConfig(num_warps=8, num_splits=4, min_split_tokens=128,
                                            cluster=True), num_q_heads=6, num_kv_heads=2))
case("decode group 24 in two chunks, global merge",
     decode([1025, 0, 9], config=TileConfig(num_warps=8, num_splits=3, min_split_tokens=128),
            num_q_heads=24, num_kv_heads=1))
case("decode group 71 in five chunks, combine kernel",
     decode([513, 70], config=TileConfig(num_warps=4, num_splits=3, min_split_tokens=64,
                                         fused_merge=False), num_q_heads=71, num_kv_heads=1))
FORCED = {"2 warps 1 split": TileConfig(2, 1),
          "8 warps 3 splits fused": TileConfig(8, 3),
          "16 splits fused merge": TileConfig(4, 16, 16, True),
          "7 splits combine kernel": TileConfig(4, 7, 16, False),
          "128 splits combine kernel": TileConfig(8, 128, 16, False)}
if "cluster" in {f.name for f in dataclasses.fields(TileConfig)}:
    FORCED["8 splits cluster merge (sm_90)"] = TileConfig(4, 8, 16, True, cluster=True)
for label, forced in FORCED.items():
    case(f"decode {label}", decode([1025, 1, 300, 2048], config=forced))
case("decode graph replay with new device lengths", decode_graph_replay)
case("decode lengths beyond the capacity", decode_guard(None))
case("decode lengths beyond the capacity, combine kernel",
     decode_guard(TileConfig(4, 5, 16, False)))


# -- append and prompts ------------------------------------------------------------------------

def tokens(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtypes.as_dtype(dtype))


def append(kv_layout: str, scale_mode: str, scale_dtype: str, *, dtype: str = "float16",
           rope: str | None = None, table: bool = False,
           lengths: tuple[int, ...] = (0, 5, 39, 17, 40, -1)
           ) -> Callable[[np.random.Generator, Stream], None]:
    """One appended token per sequence; positions 40 and -1 lie outside the cache."""
    def run(rng: np.random.Generator, stream: Stream) -> None:
        batch, heads, group, head_dim, capacity = len(lengths), 2, 2, 128, 40
        host = cache_state(rng, batch=batch, heads=heads, head_dim=head_dim, capacity=capacity,
                           kv_layout=kv_layout, scale_mode=scale_mode, scale_dtype=scale_dtype,
                           lengths=list(lengths))
        d = {name: DeviceArray.from_numpy(value) for name, value in host.items()}
        k_new, v_new = (tokens(rng, (batch, heads, head_dim), dtype) for _ in range(2))
        q = tokens(rng, (batch, heads * group, head_dim), dtype)
        d_q, d_q_out = DeviceArray.from_numpy(q), DeviceArray.full(q.shape, np.nan, q.dtype)
        cos_sin = rope_table(capacity, head_dim) if table else None
        extra = {}
        if rope:
            extra = {"q": d_q, "q_out": d_q_out,
                     "cos_sin": DeviceArray.from_numpy(cos_sin) if table else None}
        with AppendPlan.create(heads * group, heads, head_dim, max_batch=batch,
                               kv_layout=kv_layout, scale_mode=scale_mode,
                               scale_dtype=scale_dtype, dtype=dtype, rope=rope) as plan:
            plan.run(DeviceArray.from_numpy(k_new), DeviceArray.from_numpy(v_new), d["k_cache"],
                     d["v_cache"], d["k_scale"], d["v_scale"], d["seq_lens"], advance=True,
                     stream=stream, **extra)
            assert plan.error_flags(stream=stream) & ERROR_OUTSIDE_CACHE, (
                "positions 40 and -1 are flagged")
        got = {name: array.numpy() for name, array in d.items()}
        q_ref = append_ref(host["k_cache"], host["v_cache"], host["k_scale"], host["v_scale"],
                           host["seq_lens"], k_new, v_new, kv_layout=kv_layout,
                           scale_mode=scale_mode, scale_dtype=scale_dtype, rope=rope,
                           cos_sin=cos_sin, q=q if rope else None, advance=True)
        np.testing.assert_array_equal(got["seq_lens"], host["seq_lens"])
        np.testing.assert_array_equal(got["v_cache"], host["v_cache"])
        np.testing.assert_array_equal(got["v_scale"], host["v_scale"])
        if rope is None:  # bit-exact without RoPE
            np.testing.assert_array_equal(got["k_cache"], host["k_cache"])
            np.testing.assert_array_equal(got["k_scale"], host["k_scale"])
            return
        # fp32 RoPE against float64: K within one int8 step, q within a rounding (+ angle).
        assert np.abs(got["k_cache"].astype(np.int32) - host["k_cache"]).max() <= 1
        # fp32 scales: a few ulps of the rotation; fp16 ones: one fp16 rounding (2**-10).
        np.testing.assert_allclose(got["k_scale"].astype(np.float64), host["k_scale"],
                                   rtol=5e-4 if scale_dtype == "float32" else 2e-3)
        valid = (np.asarray(lengths) >= 0) & (np.asarray(lengths) < capacity)
        rotated = d_q_out.numpy().astype(np.float64)
        np.testing.assert_allclose(rotated[valid], q_ref[valid],
                                   rtol=2.0**-7 if dtype == "bfloat16" else 2.0**-10, atol=1e-3)
        assert np.isnan(rotated[~valid]).all(), "q_out rows of skipped sequences are untouched"
    return run


def prompt(prompt_layout: str, kv_layout: str, *, scale_mode: str = "token",
           scale_dtype: str = "float32", rope: str | None = None,
           lengths: tuple[int, ...] = (0, 1, 37, 20), capacity: int = 48
           ) -> Callable[[np.random.Generator, Stream], None]:
    def run(rng: np.random.Generator, stream: Stream) -> None:
        batch, heads, head_dim, tokens_per_prompt = len(lengths), 2, 64, 37
        host = cache_state(rng, batch=batch, heads=heads, head_dim=head_dim, capacity=capacity,
                           kv_layout=kv_layout, scale_mode=scale_mode, scale_dtype=scale_dtype,
                           lengths=list(lengths))
        shape = ((batch, tokens_per_prompt, heads, head_dim) if prompt_layout == "bsnh"
                 else (batch, heads, tokens_per_prompt, head_dim))
        k, v = (tokens(rng, shape, "float16") for _ in range(2))
        d = {name: DeviceArray.from_numpy(value) for name, value in host.items()}
        written = DeviceArray.full(batch, -7, np.int32)
        with PromptQuantizer.create(heads, head_dim, max_batch=batch, kv_layout=kv_layout,
                                    prompt_layout=prompt_layout, scale_mode=scale_mode,
                                    scale_dtype=scale_dtype, rope=rope) as quantizer:
            quantizer.run(DeviceArray.from_numpy(k), DeviceArray.from_numpy(v), d["k_cache"],
                          d["v_cache"], d["k_scale"], d["v_scale"], d["seq_lens"],
                          seq_lens_out=written, stream=stream)
            flags = quantizer.error_flags(stream=stream)
        expected = prompt_ref(host["k_cache"], host["v_cache"], host["k_scale"],
                              host["v_scale"], host["seq_lens"], k, v, kv_layout=kv_layout,
                              prompt_layout=prompt_layout, scale_mode=scale_mode,
                              scale_dtype=scale_dtype, rope=rope)
        clipped = np.clip(lengths, 0, tokens_per_prompt)
        assert flags == (ERROR_PROMPT_LENGTH * int((clipped != np.asarray(lengths)).any())
                         | ERROR_OUTSIDE_CACHE * int((clipped > capacity).any()))
        assert written.numpy().tolist() == expected.tolist()
        got = {name: d[name].numpy() for name in ("k_cache", "v_cache", "k_scale", "v_scale")}
        np.testing.assert_array_equal(got["v_cache"], host["v_cache"])
        np.testing.assert_array_equal(got["v_scale"], host["v_scale"])
        if rope is None:
            np.testing.assert_array_equal(got["k_cache"], host["k_cache"])
            np.testing.assert_array_equal(got["k_scale"], host["k_scale"])
        else:
            assert np.abs(got["k_cache"].astype(np.int32) - host["k_cache"]).max() <= 1
            np.testing.assert_allclose(got["k_scale"], host["k_scale"], rtol=5e-5)
    return run


for layout in LAYOUTS:
    for mode, scale_dtype in MODES:
        case(f"append {layout} {mode}/{scale_dtype}", append(layout, mode, scale_dtype))
for style in ("neox", "gptj"):
    case(f"append rope {style} table", append("bnsh", "token", "float32", rope=style, table=True))
    case(f"append rope {style} theta bf16",
         append("bsnh", "token", "float16", rope=style, dtype="bfloat16"))
case("append bf16 head scales", append("bnsh", "head", "float32", dtype="bfloat16"))
for prompt_layout in ("bsnh", "bnsh"):
    for layout in LAYOUTS:
        case(f"prompt {prompt_layout} into {layout}", prompt(prompt_layout, layout))
case("prompt rope neox, per-head scales",
     prompt("bsnh", "bsnh", scale_mode="head", rope="neox"))
case("prompt lengths beyond the prompt and the capacity",
     prompt("bnsh", "bnsh", lengths=(60, 35, 10, -3), capacity=32))


# -- the fused append (DecodePlan.append_and_run) ----------------------------------------------
def fused(positions: list[int], config: TileConfig | None = None, **options: object
          ) -> Callable[[np.random.Generator, Stream], None]:
    def run(rng: np.random.Generator, stream: Stream) -> None:
        if not runnable(config, options):
            return
        call = Fused(rng, positions, capacity=1090, **options)
        call.check(*call.run(stream, config))
        outside = any(not 0 <= x < 1090 for x in positions)
        assert bool(call.plan.error_flags(stream=stream) & ERROR_OUTSIDE_CACHE) == outside
        lengths = DeviceArray.from_numpy(np.asarray(positions, np.int32))
        call.plan.advance_lengths(lengths, 1090, stream=stream)
        expected = [x + 1 if 0 <= x < 1090 else x for x in positions]
        assert lengths.numpy(stream=stream).tolist() == expected
        call.plan.close()
    return run


case("fused append neox table, cluster merge",
     fused([0, 63, 1025], TileConfig(num_warps=8, num_splits=8, min_split_tokens=128,
                                     cluster=True), rope="neox", table=True))
case("fused append gptj theta fp16 scales bsnh bf16, global merge",
     fused([17, 1089], TileConfig(num_warps=8, num_splits=5, min_split_tokens=128),
           rope="gptj", kv_layout="bsnh", scale_dtype="float16", dtype="bfloat16"))
case("fused append tensor scales, combine kernel, head_dim 256",
     fused([300, 2], TileConfig(num_warps=4, num_splits=3, min_split_tokens=64,
                                fused_merge=False), scale_mode="tensor", head_dim=256))
case("fused append positions outside the cache", fused([1090, -1, 5], rope="neox"))
case("fused append group 24 in two chunks, one writer",
     fused([0, 700, 1089], rope="neox", num_q_heads=24, num_kv_heads=1))
case("fused append group 7 masked, cluster merge",
     fused([5, 1025], TileConfig(num_warps=8, num_splits=4, min_split_tokens=128, cluster=True),
           num_q_heads=14, num_kv_heads=2, rope="gptj", table=True))


# -- paged storage (the GPU tests' own cases: each compares with a contiguous twin) -------------
import test_paged_gpu as paged  # noqa: E402

case("paged decode page 1 hnd fp16 token scales",
     lambda rng, stream: paged.test_decode_over_pages_equals_contiguous_bitwise_and_the_oracle(
         rng, stream, 1, "hnd", "token", "float16"))
case("paged decode page 16 nhd fp32 token scales",
     lambda rng, stream: paged.test_decode_over_pages_equals_contiguous_bitwise_and_the_oracle(
         rng, stream, 16, "nhd", "token", "float32"))
case("paged decode page 256 hnd head scales",
     lambda rng, stream: paged.test_decode_over_pages_equals_contiguous_bitwise_and_the_oracle(
         rng, stream, 256, "hnd", "head", "float32"))
case("paged decode bad page ids", paged.test_bad_page_ids_set_the_flag_and_touch_nothing_outside)
case("paged fused append across page edges",
     lambda rng, stream: paged.test_fused_append_over_pages_writes_the_contiguous_bytes(
         rng, stream, "hnd", 1, "token", "float16"))
case("paged fused append, table window and past it, page 1",
     lambda rng, stream: paged.test_fused_append_reads_page_ids_inside_and_past_its_table_window(
         rng, stream, "hnd", 1))
case("paged append and prompt kernels",
     lambda rng, stream: paged.test_append_and_prompt_kernels_write_pages_as_contiguous(
         rng, stream, "nhd", 16))
case("paged bad page ids in every writer", paged.test_bad_page_ids_in_the_writers)
case("paged prompt in chunks (starts), hnd page 16",
     lambda rng, stream: paged.test_a_prompt_written_in_chunks_equals_the_prompt_written_at_once(
         rng, stream, "hnd", 16))
case("pools as views: K and V in one allocation, inline scales",
     paged.test_pools_as_views_shared_allocation_and_inline_scales)


# -- driver --------------------------------------------------------------------------------------
# -- multi-token attention (MultiPlan: the GPU tests' own cases) -------------------------------
import test_multi_gpu as multi  # noqa: E402

case("extend d128 fp16 token/fp16 scales bnsh, ragged with empty rows",
     lambda rng, stream: multi.test_matrix_matches_the_oracle(
         rng, stream, 128, "float16", "token", "float16", "bnsh", None))
case("extend d64 bf16 head scales paged hnd page 1",
     lambda rng, stream: multi.test_matrix_matches_the_oracle(
         rng, stream, 64, "bfloat16", "head", "float32", "hnd", 1))
case("extend d256 fp16 tensor scales paged nhd page 16",
     lambda rng, stream: multi.test_matrix_matches_the_oracle(
         rng, stream, 256, "float16", "tensor", "float32", "nhd", 16))
case("extend speculative drafts, KV splits merged",
     lambda rng, stream: multi.test_speculative_shapes_split_the_kv_and_merge(
         rng, stream, 8, True, "hnd", 16))
case("extend group 5, group 71", lambda rng, stream: (
    multi.test_every_group_size(rng, stream, 5, 1), multi.test_every_group_size(rng, stream,
                                                                               71, 1)))
case("extend rotate q neox table",
     lambda rng, stream: multi.test_rotate_q_at_the_rows_positions(rng, stream, "neox", True,
                                                                    multi.MMA))
case("extend graph replay",
     lambda rng, stream: multi.test_graph_replay_follows_new_lengths_and_matches_eager(
         rng, stream, multi.MMA))
for rows, kernel in zip(multi.WG_ROWS, multi.WG):
    case(f"extend wgmma {rows} rows: rotate q gptj, graph replay, negative scale (sm_90)",
         lambda rng, stream, kernel=kernel: len(multi.wgmma_choices()) > 1 and (
             multi.test_rotate_q_at_the_rows_positions(rng, stream, "gptj", False, kernel),
             multi.test_graph_replay_follows_new_lengths_and_matches_eager(rng, stream, kernel),
             multi.test_any_sign_of_the_score_scale(rng, stream, kernel, -0.1, 1.0)))
case("extend early reads after the chunk's writer, paged hnd page 16 early reads",
     lambda rng, stream: (
         multi.test_early_reads_see_the_chunk_written_just_before(rng, stream, multi.MMA),
         multi.test_early_reads_change_no_bit(rng, stream, "hnd", 16, multi.MMA)))
for rows, kernel in zip(multi.WG_ROWS, multi.WG):
    case(f"extend wgmma {rows} rows: early reads after the chunk's writer, paged nhd page 1 "
         f"early reads (sm_90)",
         lambda rng, stream, kernel=kernel: len(multi.wgmma_choices()) > 1 and (
             multi.test_early_reads_see_the_chunk_written_just_before(rng, stream, kernel),
             multi.test_early_reads_change_no_bit(rng, stream, "nhd", 1, kernel)))
case("extend device guards",
     lambda rng, stream: multi.test_device_guards_flag_and_write_nothing(rng, stream, multi.MMA))
case("extend bad page ids",
     lambda rng, stream: multi.test_bad_page_ids_are_never_read(rng, stream, multi.MMA))
for rows, kernel in zip(multi.WG_ROWS, multi.WG):
    case(f"extend wgmma {rows} rows: device guards, bad page ids, KV splits (sm_90)",
         lambda rng, stream, kernel=kernel, rows=rows: len(multi.wgmma_choices()) > 1 and (
             multi.test_device_guards_flag_and_write_nothing(rng, stream, kernel),
             multi.test_bad_page_ids_are_never_read(rng, stream, kernel),
             multi.test_wgmma_splits_merge(rng, stream, True, rows)))
import test_multi_cluster_gpu as cluster  # noqa: E402

for rows in multi.WG_ROWS:
    case(f"extend wgmma {rows} rows: KV splits merged in a cluster, ragged (sm_90)",
         lambda rng, stream, rows=rows: len(multi.wgmma_choices()) > 1 and
         cluster.test_cluster_merge_is_the_global_merge(rng, stream, rows, 128, 5))
case("extend cluster merge: graph replay over the active splits, pages with bad ids (sm_90)",
     lambda rng, stream: len(multi.wgmma_choices()) > 1 and (
         cluster.test_graph_replay_follows_the_active_splits(rng, stream),
         cluster.test_cluster_merge_over_pages_and_bad_page_ids(rng, stream, "nhd", 1)))
import test_multi_combine_gpu as combine  # noqa: E402

case("extend merge kernel: mma.sync d256 and d64, 32 splits, ragged, against the last split",
     lambda rng, stream: (
         combine.test_the_merge_kernel_is_the_last_splits_merge(
             rng, stream, dict(head_dim=256, ksplit=2, wgmma=False), 32),
         combine.test_the_merge_kernel_is_the_last_splits_merge(
             rng, stream, dict(head_dim=64, ksplit=1, wgmma=False), 5)))
case("extend merge kernel: wgmma 128 and 64 rows, pages, graph replay over the active splits",
     lambda rng, stream: (
         len(multi.wgmma_choices()) > 1 and (
             combine.test_the_merge_kernel_is_the_last_splits_merge(
                 rng, stream, dict(head_dim=128, wg_rows=128), 5),
             combine.test_the_merge_kernel_is_the_last_splits_merge(
                 rng, stream, dict(head_dim=64, wg_rows=64), 2)),
         combine.test_the_merge_kernel_over_pages(rng, stream, "nhd", 1),
         combine.test_graph_replay_follows_the_active_splits(rng, stream)))
import test_decode_route_gpu as route  # noqa: E402

case("decode rows: empty sequences, every multi kernel, KV splits, early reads",
     lambda rng, stream: route.test_multi_decode_rows_match_the_decode_oracle_on_every_kernel(
         rng, stream, Device(0), 128, 71, 3))
case("decode rows: DecodePlan routed append_and_run, positions outside the cache",
     lambda rng, stream:
     route.test_routed_append_outside_the_cache_writes_nothing_and_raises_the_flag(rng, stream))
case("decode rows: DecodePlan routed over pages (hnd, page 1)",
     lambda rng, stream: route.test_routed_decode_over_pages_matches_the_oracle(
         rng, stream, "hnd", 1, "token", "float32"))
import test_tree_mask_gpu as tree  # noqa: E402

case("extend tree mask, arbitrary bits, paged nhd page 1, d256",
     lambda rng, stream: tree.test_tree_masks_match_the_oracle(
         rng, stream, 256, "float16", "token", "float16", "nhd", 1, False, True))
case("extend tree mask, KV splits, split warps",
     lambda rng, stream: tree.test_tree_masks_under_kv_splits_and_row_tiles(
         rng, stream, 128, 5))

import test_multi_q8_gpu as q8  # noqa: E402



def hopper() -> bool:
    return Device(0).arch in q8.WG_ARCHS


case("int8 q: decode rows group 17 fp16/fp32 scales bnsh, group 64 bf16/fp16 scales bsnh "
     "(sm_90)",
     lambda rng, stream: hopper() and (
         q8.test_int8_q_decode_rows_match_the_oracle(rng, stream, 17, "float16", "float32",
                                                     "bnsh"),
         q8.test_int8_q_decode_rows_match_the_oracle(rng, stream, 64, "bfloat16", "float16",
                                                     "bsnh")))
case("int8 q: splits by the merge kernel and the last split, device guards, group 71 (sm_90)",
     lambda rng, stream: hopper() and (
         q8.test_int8_q_splits_merge(rng, stream, 3, None),
         q8.test_int8_q_splits_merge(rng, stream, 3, False),
         q8.test_int8_q_device_guards_clamp_and_flag(rng, stream),
         q8.test_int8_q_forced_on_other_groups(rng, stream, 71)))
case("int8 q: DecodePlan routed append_and_run gptj theta bf16, graph replay (sm_90)",
     lambda rng, stream: hopper() and (
         q8.test_int8_q_routed_append_and_run_matches_the_fused_oracle(
             rng, stream, "gptj", False, "bfloat16"),
         q8.test_int8_q_prepared_call_replays_in_a_graph_as_lengths_change(rng, stream)))

# -- Hadamard keys (key_transform="hadamard": the writers and the q sides) --------------------
import test_key_transform_gpu as hadamard_keys  # noqa: E402

case("hadamard append d256 bf16 token/fp16 scales",
     lambda rng, stream: hadamard_keys.test_append_writes_hadamard_keys_bit_exactly(
         rng, stream, 256, "bfloat16", "token", "float16"))
case("hadamard prompt d64 paged hnd page 1",
     lambda rng, stream: hadamard_keys.test_prompt_writes_hadamard_keys_bit_exactly(
         rng, stream, 64, "hnd", 1))
case("hadamard fused append neox table, cluster merge",
     fused([0, 63, 1025], TileConfig(num_warps=8, num_splits=8, min_split_tokens=128,
                                     cluster=True), rope="neox", table=True,
           key_transform="hadamard"))
case("hadamard chunked prefill: prompt chunks, appends, MultiPlan rotate_q d256",
     lambda rng, stream: multi.test_chunked_prefill_end_to_end_writes_the_append_bytes(
         rng, stream, "hadamard", 256))


# -- driver --------------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="run only cases whose name contains this")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    options = parser.parse_args(argv)
    selected = [(name, run) for name, run in CASES if options.k in name]
    if options.list:
        print("\n".join(name for name, _ in selected))
        return 0
    device = Device(0)
    failures: list[str] = []
    with Stream(device) as stream:
        for name, run in selected:
            start = time.perf_counter()
            try:
                run(np.random.default_rng(zlib.crc32(name.encode())), stream)
            except Exception:  # report, and run the rest: the sanitizer should see every kernel
                traceback.print_exc()
                failures.append(name)
                print(f"FAIL {name}", flush=True)
            else:
                print(f"ok   {name} ({time.perf_counter() - start:.1f} s)", flush=True)
            gc.collect()  # free this case's arrays before the next (memcheck's leak check)
    device.synchronize()
    for name in failures:
        print(f"failed: {name}")
    print(f"sanitize_subset: {len(selected) - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
