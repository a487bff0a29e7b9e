"""Specification of the benchmark tools' host-side logic (no GPU): which workloads run, how
many layers keep a timing L2-honest, which bytes a layer must move, and how results print."""
from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

# tools/ is on sys.path through pytest's pythonpath setting (pyproject.toml).
import bench
import sweep_splits
import tune
from benchlib import kernels, report, stats, workloads
from benchlib.workloads import GIB, L2_HONEST_BYTES, MAX_LAYERS, MIB, Workload, layer_count
from benchlib.pages import PAGE_ORDERS, page_ids
from lowlevel_fd.compiler import KERNEL_DIR
from lowlevel_fd.decode.planner import DEFAULT_WARPS, TileConfig

ROOT = Path(__file__).resolve().parent.parent


# -- the layer-count rule ---------------------------------------------------------------------
@pytest.mark.parametrize("nbytes", [1, 2 * MIB, 3 * MIB + 5, 4 * MIB, 16 * MIB, 64 * MIB,
                                    199 * MIB, 200 * MIB, 300 * MIB, GIB, 8 * GIB])
def test_layer_count_is_the_fewest_layers_over_200_mib_between_2_and_64(nbytes):
    layers = layer_count(nbytes)
    assert 2 <= layers <= MAX_LAYERS
    if math.ceil(L2_HONEST_BYTES / nbytes) <= MAX_LAYERS:
        assert layers * nbytes >= L2_HONEST_BYTES
        assert layers == 2 or (layers - 1) * nbytes < L2_HONEST_BYTES  # no more than needed
    else:
        assert layers == MAX_LAYERS


def test_layer_count_respects_the_memory_cap_even_over_an_override():
    assert layer_count(30 * GIB) == 1
    assert layer_count(15 * GIB) == 2
    assert layer_count(MIB, footprint_per_layer=20 * GIB) == 2
    assert layer_count(MIB, override=5) == 5
    assert layer_count(15 * GIB, override=8) == 2


def test_is_l2_honest():
    assert workloads.is_l2_honest(4, 50 * MIB)
    assert not workloads.is_l2_honest(64, 2 * MIB)


# -- bytes accounting -------------------------------------------------------------------------
B, S, HQ, HKV, D = 2, 64, 8, 2, 128
KV = B * HKV * S * D * 2
Q_OUT = 2 * B * HQ * D * 2


@pytest.mark.parametrize("mode, scale_dtype, scale_bytes", [
    ("tensor", "float32", 2 * 4),
    ("head", "float32", 2 * HKV * 4),
    ("token", "float32", B * HKV * S * 2 * 4),
    ("token", "float16", B * HKV * S * 2 * 2),
])
@pytest.mark.parametrize("layout", ["bnsh", "bsnh"])
def test_bytes_per_layer_are_kv_plus_scales_plus_q_and_out(mode, scale_dtype, scale_bytes,
                                                           layout):
    w = Workload(B, S, HQ, HKV, D, layout, mode, scale_dtype)
    assert w.kv_bytes == KV
    assert w.scale_bytes == scale_bytes
    assert w.q_out_bytes == Q_OUT
    assert w.bytes_per_layer == KV + scale_bytes + Q_OUT
    assert w.footprint_per_layer == w.bytes_per_layer  # full lengths: allocation == traffic
    assert w.baseline_bytes_per_layer == 2 * KV + Q_OUT


def test_ragged_bytes_count_live_tokens_only():
    w = Workload(16, 1000, ragged=True)
    lengths = w.seq_lens()
    assert lengths[0] == 1000 and lengths.min() >= 500 and lengths.max() <= 1000
    assert np.array_equal(lengths, w.seq_lens())  # deterministic
    assert w.kv_bytes == int(lengths.sum()) * 8 * 128 * 2
    assert w.scale_bytes == int(lengths.sum()) * 8 * 2 * 4
    assert w.footprint_per_layer > w.bytes_per_layer


def test_bf16_queries_count_two_bytes():
    assert Workload(1, 16, q_dtype="bfloat16").q_out_bytes == 2 * 32 * 128 * 2


# -- flags --------------------------------------------------------------------------------------
def test_parse_shapes():
    assert workloads.parse_shapes("1,1024;8,4096") == [(1, 1024), (8, 4096)]
    assert workloads.parse_shapes(" 2, 64 ; ") == [(2, 64)]


@pytest.mark.parametrize("text", ["", "1", "1,x", "1,2,3", "0,16", ";"])
def test_parse_shapes_rejects_malformed_input(text):
    with pytest.raises(ValueError, match="--shapes"):
        workloads.parse_shapes(text)


def test_parse_heads():
    assert workloads.parse_heads("32,8") == (32, 8)
    with pytest.raises(ValueError, match="--heads: Hq must be a multiple"):
        workloads.parse_heads("32,5")
    with pytest.raises(ValueError, match="--heads: expected 'Hq,Hkv'"):
        workloads.parse_heads("32")


def test_parse_config():
    assert workloads.parse_config("4,16,128,1") == TileConfig(4, 16, 128, True)
    assert workloads.parse_config("2,1,32,false") == TileConfig(2, 1, 32, False)
    for bad in ("4,16,128", "3,16,128,1", "4,0,128,1", "4,16,100,1", "4,16,128,yes",
                "16,16,128,1", "4,16,128,1,1", "4,32,128,1,2,1"):
        with pytest.raises(ValueError, match="--config"):
            workloads.parse_config(bad)


def test_default_sweep_is_the_issues_sweep():
    sweep = workloads.default_sweep()
    main = [(w.batch, w.seq_len) for w in sweep
            if (w.num_q_heads, w.num_kv_heads, w.kv_layout, w.mode_label) == (32, 8, "bnsh",
                                                                               "tok-f32")]
    assert main == list(workloads.DEFAULT_SHAPES)
    assert Workload(32, 4096, 16, 1) in sweep
    at_8_4096 = {(w.kv_layout, w.mode_label) for w in sweep if (w.batch, w.seq_len) == (8, 4096)
                 and w.num_kv_heads == 8}
    assert at_8_4096 == {(l, m) for l in ("bnsh", "bsnh")
                         for m in ("tensor", "head", "tok-f32", "tok-f16")}
    assert len(sweep) == len(set(sweep)) == 16
    assert all(w.head_dim == 128 and w.q_dtype == "float16" for w in sweep)


def test_flags_replace_the_default_sweep_by_a_product():
    args, sweep, _ = bench.parse(["--shapes", "1,1024;2,64", "--layout", "all",
                                  "--scale-mode", "tensor,token-fp16", "--q-dtype", "bf16"])
    assert len(sweep) == 2 * 2 * 2
    assert {w.q_dtype for w in sweep} == {"bfloat16"}
    assert {(w.scale_mode, w.scale_dtype) for w in sweep} == {("tensor", "float32"),
                                                             ("token", "float16")}
    _, only_heads, _ = bench.parse(["--heads", "16,1"])
    assert [(w.batch, w.seq_len) for w in only_heads] == list(workloads.DEFAULT_SHAPES)
    assert {w.num_kv_heads for w in only_heads} == {1}


def test_page_sizes_add_paged_rows_beside_the_contiguous_ones():
    _, sweep, _ = bench.parse(["--shapes", "4,100", "--page-size", "0,16,1",
                               "--layout", "bnsh,nhd,hnd"])
    assert [(w.kv_layout, w.page_size) for w in sweep] == [
        ("bnsh", 0), ("nhd", 16), ("nhd", 1), ("hnd", 16), ("hnd", 1)]
    paged = sweep[1]
    assert paged.pages_per_seq == 7 and paged.num_pages == 28
    assert paged.cache_shape == (28, 16, 8, 128) and sweep[3].cache_shape == (28, 8, 16, 128)
    assert paged.scale_shape == (28, 16, 8) and sweep[3].scale_shape == (28, 8, 16)
    assert paged.kv_bytes == sweep[0].kv_bytes  # the live tokens, not the pool
    assert paged.label.endswith("page 16") and report.storage_label(paged.as_dict()) == "nhd/16"
    _, ordered, _ = bench.parse(["--shapes", "4,100", "--page-size", "64",
                                 "--page-order", "ordered"])
    assert [(w.kv_layout, w.page_size, w.page_order) for w in ordered] == [
        ("nhd", 64, "ordered")]
    assert report.storage_label(ordered[0].as_dict()) == "nhd/64o"
    for bad in ("3", "512", "x"):
        with pytest.raises(SystemExit):
            bench.parse(["--page-size", bad])
    _, slots, _ = bench.parse(["--shapes", "4,100", "--page-size", "0,16", "--layout",
                               "bnsh,hnd", "--page-slot", "--scale-mode", "token,head"])
    assert [(w.kv_layout, w.scale_mode, w.page_slot) for w in slots] == [
        ("bnsh", "token", False), ("bnsh", "head", False), ("hnd", "token", True),
        ("hnd", "head", False)]  # a slot holds per-token scales: paged token rows only
    assert report.storage_label(slots[2].as_dict()) == "hnd/16s"
    assert slots[2].footprint_per_layer == 28 * slots[2].slot().nbytes + slots[2].q_out_bytes


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("page,itemsize", [(1, 4), (16, 4), (16, 2)])
def test_page_slot_views_read_back_the_pools(layout, page, itemsize):
    """benchlib.pages.PageSlot: K, V and both scales written through the slot's views (as
    numpy strided views of one buffer) are the pools they stand for, and do not overlap."""
    from benchlib.pages import PageSlot
    N, H, D = 5, 8, 64
    slot = PageSlot(layout, page, H, D, itemsize)
    assert slot.nbytes % 128 == 0 and slot.nbytes >= 2 * page * H * (D + itemsize)
    if itemsize == 4:  # docs/contract.md's table ("One slot per page")
        hnd = layout == "hnd"
        assert slot.offsets() == {"k": 0, "v": page * H * D, "k_scale": 2 * page * H * D,
                                  "v_scale": 2 * page * H * D + (4 * page if hnd else 4)}
        assert slot.row_strides == (slot.nbytes, page * D if hnd else H * D, D, 1)
        assert slot.scale_strides == ((slot.nbytes, 8 * page, 4) if hnd
                                      else (slot.nbytes, 8 * H, 8))
    rng = np.random.default_rng(page)
    shape = (N, page, H) if layout == "nhd" else (N, H, page)
    pools = {n: rng.integers(-128, 128, shape + (D,), dtype=np.int8) for n in ("k", "v")}
    dtype = np.float32 if itemsize == 4 else np.float16
    pools.update({n: rng.random(shape).astype(dtype) for n in ("k_scale", "v_scale")})
    flat = np.zeros(N * slot.nbytes + 64, np.uint8)
    at = slot.offsets()
    blocks = slot.scale_block(pools["k_scale"], pools["v_scale"]).view(np.uint8)
    flat[:N * slot.nbytes].reshape(N, slot.nbytes)[:, at["k_scale"]:][:, :blocks.shape[1]] = blocks

    def view(name):
        base = flat[at[name]:]
        if name in ("k", "v"):
            return np.lib.stride_tricks.as_strided(base.view(np.int8), shape + (D,),
                                                   slot.row_strides)
        return np.lib.stride_tricks.as_strided(base.view(dtype), shape, slot.scale_strides)

    for name in ("k", "v"):
        view(name)[...] = pools[name]
    for name, pool in pools.items():
        np.testing.assert_array_equal(view(name), pool, err_msg=name)


def test_bad_flags_exit_with_usage_error(capsys):
    for argv in (["--shapes", "1"], ["--layout", "nhsd"], ["--config", "4,1"],
                 ["--layers", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            bench.main(argv + ["--dry-run"])
        assert exit_info.value.code == 2
    assert "--layers: expected >= 1" in capsys.readouterr().err


def test_quick_and_iters_set_the_iteration_counts():
    _, _, full = bench.parse([])
    _, _, quick = bench.parse(["--quick"])
    _, _, custom = bench.parse(["--quick", "--iters", "7"])
    assert full.iters >= 50 and full.warmup >= 5 and full.bandwidth_iters >= 20
    assert quick.iters < full.iters and custom.iters == 7


def test_dry_run_lists_the_default_sweep(capsys):
    assert bench.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for w in workloads.default_sweep():
        assert w.label in out
    assert "read_bandwidth over 2.00 GiB" in out
    line = next(l for l in out.splitlines() if "B=1 S=1024 " in l)
    assert " 64 " in line and " no " in line  # 2 MiB x 64 layers stays below 200 MiB


# -- statistics and formatting ----------------------------------------------------------------
def test_percentile_interpolates_between_order_statistics():
    data = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert stats.percentile(data, 50) == 3.0
    assert stats.percentile(data, 20) == pytest.approx(1.8)
    assert stats.percentile(data, 80) == pytest.approx(4.2)
    assert stats.percentile([7.0], 80) == 7.0
    with pytest.raises(ValueError, match="at least one sample"):
        stats.percentile([], 50)
    summary = stats.summarize(data)
    assert (summary.median, summary.min, summary.max, summary.count) == (3.0, 1.0, 5.0, 5)


def test_timing_record_reports_bandwidth_and_percent():
    record = stats.timing_record([10.0, 10.0, 12.0], bytes_per_layer=30_000_000,
                                 bandwidth_gbps=3000.0)
    assert record["median_us"] == 10.0
    assert record["gbps"] == pytest.approx(3000.0)
    assert record["pct_of_bw"] == pytest.approx(100.0)
    assert stats.gbps(1e9, 1e6) == pytest.approx(1.0)


def _result(ok=True, error=None):
    w = Workload(8, 4096)
    timing = stats.timing_record([60.0, 61.0, 62.0], w.bytes_per_layer, 3200.0)
    return {"workload": w.as_dict(), "layers": 4, "l2_honest": True, "error": error,
            "graph": timing, "eager": timing, "baseline": {**timing, "median_us": 150.0},
            "speedup": 150.0 / 61.0,
            "check": {"max_rel_err": 1e-4 if ok else 5e-2, "ok": ok}}


def test_table_has_one_aligned_row_per_workload():
    table = report.format_table([_result(), _result(ok=False),
                                 _result(error="Traceback...\nCudaError: out of memory")])
    lines = table.splitlines()
    assert len(lines) == 2 + 3
    for column in ("B", "KV MiB", "graph us [p20-p80]", "%BW", "SDPA us", "speedup"):
        assert column in lines[0]
    assert "61.0 [60.4-61.6]" in lines[2] and "2.46x" in lines[2] and "1.0e-04" in lines[2]
    assert "FAIL 5.0e-02" in lines[3]
    assert "ERROR: CudaError: out of memory" in lines[4]
    assert "64.0" in lines[2] and "tok-f32" in lines[2]


def test_fmt_us_precision_follows_magnitude():
    assert [report.fmt_us(v) for v in (3.14159, 45.67, 1234.5, None)] == [
        "3.14", "45.7", "1234", "-"]


def test_json_holds_numpy_values(tmp_path):
    path = tmp_path / "out.json"
    report.write_json(str(path), {"x": np.float32(1.5), "n": np.int64(3),
                                  "config": TileConfig()})
    data = json.loads(path.read_text())
    assert data["x"] == 1.5 and data["n"] == 3
    assert data["config"]["num_warps"] == DEFAULT_WARPS


# -- tune's sweep -------------------------------------------------------------------------------
def test_tune_candidates_cover_the_issues_grid_and_the_planner_pick():
    auto = TileConfig(num_warps=4, num_splits=12, min_split_tokens=128, fused_merge=True)
    configs = tune.candidate_configs(auto)
    assert configs[0] == auto and len(configs) == len(set(configs))
    assert {c.num_warps for c in configs} == {2, 4, 8}
    assert {1, 2, 4, 8, 12, 16, 32, 64, 128} <= {c.num_splits for c in configs}
    assert {c.min_split_tokens // c.num_warps for c in configs if c.num_splits > 1} == {16, 32}
    assert {c.fused_merge for c in configs} == {True, False}
    assert any(c.cluster for c in configs) and all(c.num_splits <= 16 for c in configs
                                                   if c.cluster)
    assert sum(c.num_splits == 1 and c.tiles == 1 for c in configs) == 3  # one per warp count
    two = [c for c in configs if c.tiles == 2]
    assert {c.num_warps for c in two} == {2, 4, 8}
    assert all(c.min_split_tokens == 32 * c.num_warps for c in two)
    assert {c.num_splits for c in two} == {c.num_splits for c in configs if c.tiles == 1}


def test_tune_names_the_planners_tiles():
    assert tune.config_label(TileConfig(num_warps=8, num_splits=8, tiles=2)).split()[5] == "t2"


# -- the benchmark's own kernels ----------------------------------------------------------------
def test_bench_kernels_are_the_tools_own_and_compile_for_sm_90_without_spills():
    assert not (KERNEL_DIR / "bench.cu").exists()  # the wheel ships lowlevel_fd/cu only
    assert not (ROOT / "lowlevel_fd" / "cu" / "bench.cu").exists()
    assert kernels.SOURCE == ROOT / "tools" / "benchlib" / "bench.cu"
    program = kernels.bench_program("sm_90")  # NVRTC only: no GPU needed
    assert program.arch == "sm_90" and program.cubin
    assert set(program.resources) == set(kernels.KERNELS)
    for name, resources in program.resources.items():
        assert resources.spill_store_bytes == resources.spill_load_bytes == 0, name
        assert resources.stack_bytes == 0, name
    assert kernels.bench_program("sm_90") is program  # once per process and arch


def test_probe_gather_strides_are_the_cache_layouts():
    import probe_gather
    B, S, P, H, D = 2, 64, 16, probe_gather.H, probe_gather.D
    N = B * S // P
    cases = (("bnsh", 0, (B, H, S, D), (0, 1, 2), (B, H, S), (0, 1, 2)),
             ("bsnh", 0, (B, S, H, D), (0, 2, 1), (B, H, S), (0, 1, 2)),
             ("hnd", P, (N, H, P, D), (0, 1, 2), (N, H, P), (0, 1, 2)),
             ("nhd", P, (N, P, H, D), (0, 2, 1), (N, P, H), (0, 2, 1)))
    for layout, page, shape, axes, scale_shape, scale_axes in cases:
        rows, scales = probe_gather.strides(layout, S, page)
        kv, sc = np.empty(shape, np.int8), np.empty(scale_shape, np.float32)
        assert rows == tuple(kv.strides[i] for i in axes), layout
        assert scales == tuple(sc.strides[i] for i in scale_axes), layout


@pytest.mark.parametrize("order", PAGE_ORDERS)
def test_page_orders_are_permutations_with_their_locality(order):
    """benchlib.pages.page_ids: every order is a permutation of the pool's pages; "window"
    keeps each 2 MiB of pages within its 2 MiB, "runs" keeps each 2 MiB run consecutive,
    "sweep" lists each sequence's (row's) pages ascending."""
    rng = np.random.default_rng(3)
    per = (2 << 20) // 16384  # pages of 16 KiB per 2 MiB
    ids = page_ids(order, 5 * per + 7, 16384, rng, row=per + 1)
    assert sorted(ids.tolist()) == list(range(5 * per + 7))
    if order == "sweep":
        rows = ids[:5 * (per + 1)].reshape(5, per + 1)
        assert (np.diff(rows, axis=1) > 0).all()
        assert not np.array_equal(ids, np.arange(ids.size))
    if order == "window":
        assert all(ids[i] // per == i // per for i in range(ids.size))
        assert not np.array_equal(ids, np.arange(ids.size))
    if order == "runs":
        i = 0
        while i < ids.size:  # each run: an aligned 2 MiB of pages (the last one short), whole
            start = int(ids[i])
            length = min(per, ids.size - start)
            assert start % per == 0
            assert np.array_equal(ids[i:i + length], np.arange(start, start + length))
            i += length
        assert not np.array_equal(ids, np.arange(ids.size))
    with pytest.raises(ValueError, match="page order: expected one of"):
        page_ids("sorted", 4, 16384, rng)


def test_page_slots_need_pages_and_token_scales():
    from benchlib.pages import PageSlot
    from benchlib.workloads import Workload
    with pytest.raises(ValueError, match=r"^PageSlot layout: expected 'nhd' or 'hnd', got 'bnsh'$"):
        PageSlot("bnsh", 16, 8, 128, 4)
    for work in (Workload(2, 64, kv_layout="hnd", page_size=16, scale_mode="head",
                          page_slot=True),
                 Workload(2, 64, page_slot=True)):
        with pytest.raises(ValueError, match=r"^page_slot: needs pages and per-token scales, "):
            work.slot()


def test_phase_trace_records_parse_into_per_layer_phases():
    """tools/phase_trace: the marks' record layout (trace_marks.cuh) and the per-layer spans."""
    import numpy as np
    from phase_trace.phases import layer_rows, parse

    def record(kind, block, stamps):
        head = kind | block[0] << 8 | block[1] << 24 | block[2] << 40
        return [head] + list(stamps) + [0] * (7 - len(stamps))

    words = []
    for layer in range(2):
        base = 100_000 * layer
        for cta in range(3):  # loader, computing warpgroup, merge kernel of each CTA
            t0 = base + 10 * cta
            words.append(record(1, (0, cta, 5), [t0, t0 + 1000, t0 + 2000, t0 + 3000, 9000 + t0]))
            words.append(record(2, (0, cta, 5), [t0, t0 + 1000, t0 + 3000, t0 + 3100,
                                                 t0 + 19000, t0 + 20000]))
            words.append(record(3, (cta, 0, 5), [base + 19000, base + 22000, base + 25000]))
    kind, block, stamps = parse(np.array(words, dtype=np.uint64))
    assert kind.tolist() == [1, 2, 3] * 6
    assert block[5].tolist() == [1, 0, 5] and block[6].tolist() == [0, 2, 5]
    rows = layer_rows({k: stamps[kind == k] for k in (1, 2, 3)}, layers=2)
    assert [round(r["first_entry"], 1) for r in rows] == [0.0, 100.0]
    row = rows[1]
    assert (row["entry_spread"], row["wait"], row["q"], row["tile0"]) == (0.02, 1.0, 2.0, 0.1)
    assert (row["loop"], row["store"], row["att_end"]) == (15.9, 1.0, 20.02)
    assert (row["ld_wait"], row["ld_prime"], row["ld_tile0"]) == (1.0, 1.0, 1.0)
    assert (row["cb_entry"], row["cb_wait"], row["cb_end"]) == (19.0, 22.0, 25.0)


def test_decode_phase_trace_rows():
    """tools/phase_trace/phases_decode.py: per-layer phases of the decode kernel's marks
    (entry, wait, prologue, staged, loop, merged, end; ns)."""
    import numpy as np
    from phase_trace.phases_decode import layer_rows

    stamps = []
    for layer in range(3):
        for cta in range(4):
            t = 5000 * layer + 10 * cta
            stamps.append([t, t + 3000, t + 500, t + 3500, t + 4500, t + 4800, t + 5200])
    rows = layer_rows(np.array(stamps, dtype=np.int64), layers=3)
    row = rows[2]
    assert (row["period"], row["pre"], row["wait"], row["staged"]) == (5.0, 0.5, 3.0, 0.5)
    assert round(row["after_prev"], 2) == 2.77 and round(row["end"], 2) == 5.23
    assert (round(row["loop"], 2), round(row["merge"], 2), round(row["spread"], 2)) == (
        1.0, 0.3, 0.03)


@pytest.mark.parametrize("patch", ["decode_marks.patch", "multi_wg_marks.patch"])
def test_phase_trace_patches_apply_to_the_kernels(patch):
    """The marks patches still apply to lowlevel_fd/cu (the traces' procedure)."""
    import shutil
    import subprocess
    root = Path(__file__).resolve().parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("needs git and the checkout")
    result = subprocess.run(["git", "apply", "--check", f"tools/phase_trace/{patch}"],
                            cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_probe_gather_heads_together_modes():
    from probe_gather import heads_together

    assert heads_together("off") == (None, 0)
    assert heads_together("c8") == ((8, 1, 1), 0)
    assert heads_together("c2/4") == ((2, 1, 1), 4)


@pytest.mark.parametrize("layout, page", [("bnsh", 0), ("bsnh", 0), ("hnd", 16), ("nhd", 16),
                                          ("hnd", 1), ("nhd", 1), ("hnd", 64)])
@pytest.mark.parametrize("heads", [1, 2, 4, 8])
@pytest.mark.parametrize("merge", [True, False])
def test_probe_bulk_runs_cover_a_tiles_bytes_exactly(layout, page, heads, merge):
    """gather_bulk's copies of one unit of a tile (a CTA's first heads, from slot 0) are
    exactly the bytes of those heads' tokens: rows and scales, each byte once."""
    import probe_bulk
    import probe_gather
    unit_tokens = min(probe_bulk.TILE, page) if page else probe_bulk.TILE
    rows, scales = probe_gather.strides(layout, 256, page)
    for strides, item in ((rows, probe_bulk.ROW_BYTES), (scales, probe_bulk.SCALE_BYTES)):
        try:
            run = probe_bulk.side(strides, item, unit_tokens, heads, merge)
        except ValueError:  # several heads of a token row unmerged: not a layout's copy
            assert layout in ("nhd", "bsnh") and not merge and heads > 1
            continue
        _, head, token = strides
        want = sorted(h * head + t * token + i for h in range(heads)
                      for t in range(unit_tokens) for i in range(item))
        if run is None:  # runs under 16 bytes, which a bulk copy cannot take: skipped
            longest = max(len(list(group)) for _, group in itertools.groupby(
                offset - index for index, offset in enumerate(want)))
            assert longest < 16 or not merge, (layout, page, heads, merge, item)
            continue
        got = sorted(s * run.seg_stride + i for s in range(run.segs)
                     for i in range(run.seg_bytes))
        assert got == want, (layout, page, heads, merge, item)


# -- the heads-together probe kernel (tools/benchlib/heads.cu, PERF_NOTES v32) -------------------
def _swizzled_phase_conflicts(sigma) -> int:
    """The worst bank conflict of heads.cu's fragment reads on TMA's 128-byte swizzle, with
    tile rows permuted by ``sigma``: every LDS.128 phase (8 lanes) must touch 8 different
    16-byte bank groups. Line L's chunk c sits at group c ^ (L & 7); a head's lines are
    16 * head + token, so L & 7 = token & 7."""
    worst = 1
    reads = []  # per read instruction: (lane -> bank group)
    for half, u in itertools.product(range(2), range(2)):  # K: rows g, g + 8; chunks 4u + c
        reads.append([((4 * u + lane % 4) ^ ((sigma[lane // 4] + 8 * half) & 7))
                      for lane in range(32)])
    for slot in range(4):  # V: k-slots 2c, 2c + 1, 2c + 8, 2c + 9; chunk g
        reads.append([(lane // 4) ^ (sigma[2 * (lane % 4) + (slot & 1)] & 7)
                      for lane in range(32)])
    for groups in reads:
        for phase in range(4):
            lanes = groups[8 * phase:8 * phase + 8]
            worst = max(worst, max(lanes.count(x) for x in lanes))
    return worst


def test_heads_probe_token_permutation_makes_the_fragment_reads_conflict_free():
    from benchlib import heads
    assert sorted(heads.SIGMA) == list(range(8))
    packed = sum(s << (4 * r) for r, s in enumerate(heads.SIGMA))
    assert f"0x{packed:08x}u" in (ROOT / "tools" / "benchlib" / "heads_copy.cuh").read_text()
    assert _swizzled_phase_conflicts(heads.SIGMA) == 1
    assert _swizzled_phase_conflicts(tuple(range(8))) == 2  # rows in order: K reads 2-way


def test_heads_probe_maps_and_shared_memory_match_the_kernel():
    from benchlib import heads
    maps = heads.HeadsMaps
    assert [getattr(maps, name).offset for name in ("k", "v", "k_scale", "v_scale")] == \
        [0, 128, 256, 384]
    assert maps.scale_heads_inner.offset == 512 and heads.ctypes.sizeof(maps) == 576
    plain = heads.HeadsVariant(4, 4, 8, stages=4)
    # 4 stages of K and V rows (4 heads x 16 tokens x 128) and fp32 scales, 1 KiB to align
    assert plain.shared_bytes(8) == 4 * (2 * 4 * 16 * 128 + 2 * 16 * 4 * 4) + 1024
    clustered = heads.HeadsVariant(4, 4, 8, stages=4, cluster=True)
    slot = 4 * (4 * 4 * 8 * 8 * 2 + 16)  # quads of 4 heads, then 16 LSEs (HeadsSlots)
    assert clustered.shared_bytes(3) == plain.shared_bytes() + 3 * slot


def test_heads_probe_kernel_compiles_for_sm_90_without_spills():
    from benchlib import heads
    for variant in (heads.HeadsVariant(4, 4, 8, stages=4),
                    heads.HeadsVariant(8, 2, 8, stages=8, dtype="bfloat16",
                                       scale_dtype="float16", cluster=True)):
        program = variant.compile("sm_90")  # NVRTC only: no GPU needed
        (resources,) = program.resources.values()
        assert resources.spill_store_bytes == resources.spill_load_bytes == 0, variant
        assert resources.registers <= 128, variant  # 2 CTAs of 256 threads per SM


def test_the_split_sweep_times_both_merges_up_to_the_cluster_cap_and_no_short_splits():
    few = sweep_splits.candidates([1, 2, 8, 16, 32], 4096, few_pairs=True)
    assert few == [(1, False), (2, True), (2, False), (8, True), (8, False), (16, False),
                   (32, False)]
    many = sweep_splits.candidates([1, 2, 8, 16, 32], 1024, few_pairs=False)
    assert many == [(1, False), (2, True), (2, False), (8, True), (8, False)]
    assert sweep_splits.candidates([16], 1024, few_pairs=True) == []  # 64-token splits
