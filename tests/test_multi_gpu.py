"""MultiPlan on the GPU against the float64 oracle: packed ragged query chunks over the INT8
cache (prefill, chunked prefill, speculative verification), over the support matrix (head dims,
dtypes, scale modes, contiguous and paged layouts, group sizes), causal and not, split and not,
eager and in a graph, and the device guards."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import HAS_GPU
from multi_case import TOLERANCE, MultiCase, relative_error

from lowlevel_fd import ERROR_BAD_PAGE, ERROR_OUTSIDE_CACHE, ERROR_QUERY_RANGE
from lowlevel_fd.append.reference import rotate
from lowlevel_fd.driver import Device, DeviceArray, capture
from lowlevel_fd.multi.variants import WG_ROWS, ksplits, wgmma_available

pytestmark = pytest.mark.gpu

SCALES = [("tensor", "float32"), ("head", "float32"), ("token", "float32"),
          ("token", "float16")]
LAYOUTS = [("bnsh", None), ("bsnh", None), ("nhd", 16), ("hnd", 1), ("hnd", 64)]
# Ragged: a lone token, a chunk over a prefix crossing tiles, an empty row, a fresh prefill
# (qo_len = kv_len) over page and tile edges, a short chunk over a longer prefix.
QO = [1, 5, 0, 70, 17]
KV = [1, 37, 10, 70, 300]


MMA = {"wgmma": False}  # plan() keywords: the mma.sync kernel, the warpgroup kernels
WG = [{"wgmma": True, "wg_rows": rows} for rows in WG_ROWS]


def kernels(head_dim: int) -> list[dict]:
    """plan() keywords of every kernel a plan may pick at this head_dim on this device."""
    picks = [{"ksplit": ksplit, "wgmma": False} for ksplit in ksplits(head_dim)]
    if wgmma_available(Device(0).arch, head_dim):
        picks += [{"ksplit": 1, **kernel} for kernel in WG]
    return picks


def wgmma_choices() -> list[dict]:
    """The kernels for whole-tile chunks: mma.sync, and the warpgroup ones where the device
    has them (collection time: no device is touched without a GPU)."""
    return [MMA] + WG if HAS_GPU and wgmma_available(Device(0).arch, 128) else [MMA]


def kernel_id(kernel: dict) -> str:
    return f"wg{kernel['wg_rows']}" if kernel.get("wgmma") else "mma"


def check(case: MultiCase, *, causal: bool = True, q: np.ndarray | None = None) -> None:
    ref_out, ref_lse = case.reference(causal=causal, q=q)
    out = case.device["out"].numpy()
    lse = case.device["lse"].numpy()
    err = relative_error(out, ref_out)
    assert err <= TOLERANCE[case.dtype], f"out: relative error {err:.2e}"
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=2e-3)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("scale_mode, scale_dtype", SCALES)
@pytest.mark.parametrize("layout, page_size", LAYOUTS)
def test_matrix_matches_the_oracle(rng, stream, head_dim, dtype, scale_mode, scale_dtype,
                                   layout, page_size):
    case = MultiCase(QO, KV, 8, 2, head_dim, layout, page_size, scale_mode, scale_dtype,
                     dtype).fill(rng)
    case.upload(rng)
    for causal, kernel in itertools.product((True, False), kernels(head_dim)):
        with case.make_plan() as plan:
            plan.plan(case.indptr, case.kv_lens, causal=causal, **kernel)
            case.run(plan, stream)
            stream.synchronize()
            check(case, causal=causal)
            assert plan.error_flags(stream=stream) == 0


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(3, 3), (6, 2), (5, 1), (14, 2),
                                                       (64, 1), (71, 1), (40, 8)])
def test_every_group_size(rng, stream, num_q_heads, num_kv_heads):
    case = MultiCase([3, 1, 40], [200, 1, 40], num_q_heads, num_kv_heads).fill(rng)
    case.upload(rng)
    for kernel in kernels(128):
        with case.make_plan() as plan:
            plan.plan(case.indptr, case.kv_lens, **kernel)
            case.run(plan, stream)
            stream.synchronize()
            check(case)


@pytest.mark.parametrize("qo_len, causal", [(4, False), (8, True), (16, False), (1, True)])
@pytest.mark.parametrize("layout, page_size", [("bnsh", None), ("hnd", 16)])
def test_speculative_shapes_split_the_kv_and_merge(rng, stream, qo_len, causal, layout,
                                                   page_size):
    """Few rows over a long KV: the planner splits each tile's KV; the merge matches the oracle
    and the unsplit launch."""
    B = 6
    case = MultiCase([qo_len] * B, [4099, 777, 4096, qo_len, 2048, 1000], 32, 8, 128, layout,
                     page_size).fill(rng)
    case.upload(rng)
    results = []
    for splits in (None, 1):
        with case.make_plan() as plan:
            plan.plan(case.indptr, case.kv_lens, causal=causal, num_splits=splits)
            if splits is None:
                assert plan.describe()["num_splits"] > 1
            case.run(plan, stream)
            stream.synchronize()
            check(case, causal=causal)
            results.append(case.device["out"].numpy().astype(np.float64))
    assert relative_error(results[0], results[1]) < 2e-3


@pytest.mark.parametrize("layout, page_size", [("bnsh", None), ("hnd", 16), ("nhd", 1)])
@pytest.mark.parametrize("kernel", wgmma_choices(), ids=kernel_id)
def test_early_reads_change_no_bit(rng, stream, layout, page_size, kernel):
    """run(early_reads=True), eager and in a graph, against the waiting run: the same bits,
    on every kernel. Splits whose first tiles reach the chunk (short sequences) prime after
    the wait, the others before it; a zero-length chunk flags nothing."""
    case = MultiCase([4, 4, 1, 8, 0], [4099, 777, 4096, 2048, 5], 32, 8, 128, layout,
                     page_size).fill(rng)
    d = case.upload(rng)
    with case.make_plan() as plan:
        plan.plan(case.indptr, case.kv_lens, **kernel)
        assert plan.describe()["programmatic"]
        results = []
        for early in (False, True):
            case.run(plan, stream, early_reads=early)
            stream.synchronize()
            check(case)
            results.append(d["out"].numpy().tobytes() + d["lse"].numpy().tobytes())
        with capture(stream) as graph:
            case.run(plan, stream, early_reads=True)
        d["out"].fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
        graph.close()
        results.append(d["out"].numpy().tobytes() + d["lse"].numpy().tobytes())
        assert results[0] == results[1] == results[2]
        assert plan.error_flags(stream=stream) == 0


@pytest.mark.parametrize("kernel", wgmma_choices(), ids=kernel_id)
def test_early_reads_see_the_chunk_written_just_before(rng, stream, kernel):
    """The step's append (PromptQuantizer writing each chunk at its start) right before
    run(early_reads=True) on the stream: the chunk's rows held garbage until then and are
    read after it, on every kernel; the result matches the oracle over the cache as written."""
    from lowlevel_fd import PromptQuantizer
    qo, kv = [4, 8, 4], [4096, 1500, 70]
    B, HQ, HKV, D = len(qo), 32, 8, 128
    case = MultiCase(qo, kv, HQ, HKV, D).fill(rng)
    d = case.upload(rng)
    chunk_k = rng.standard_normal((B, max(qo), HKV, D)).astype(np.float16)
    chunk_v = rng.standard_normal((B, max(qo), HKV, D)).astype(np.float16)
    quantizer = PromptQuantizer.create(HKV, D, max_batch=B)
    with case.make_plan() as plan:
        plan.plan(case.indptr, case.kv_lens, **kernel)
        d["out"].fill(np.nan, stream)
        d["lse"].fill(np.nan, stream)
        quantizer.run(DeviceArray.from_numpy(chunk_k), DeviceArray.from_numpy(chunk_v),
                      d["k_cache"], d["v_cache"], d["k_scale"], d["v_scale"],
                      DeviceArray.from_numpy(np.asarray(qo, np.int32)),
                      starts=DeviceArray.from_numpy(np.subtract(kv, qo).astype(np.int32)),
                      stream=stream)
        plan.run(d["q"], d["k_cache"], d["v_cache"], d["k_scale"], d["v_scale"],
                 d["seq_lens"], d["qo_indptr"], d["out"], lse=d["lse"], early_reads=True,
                 stream=stream)
        stream.synchronize()
        for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
            written = d[name].numpy()
            assert not np.array_equal(written, case.host[name]), name  # the chunk changed
            case.host[name] = written
        check(case)
        assert plan.error_flags(stream=stream) == 0
    quantizer.close()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("wg_rows", WG_ROWS)
def test_wgmma_splits_merge(rng, stream, causal, wg_rows):
    """The warpgroup kernels with their KV cut into splits (forced) against the oracle and
    their unsplit run: a 160-row chunk over a long prefix, a short one, an empty row."""
    if len(wgmma_choices()) == 1:
        pytest.skip("the warpgroup-MMA kernels need an sm_90 GPU")
    case = MultiCase([40, 3, 0], [5000, 900, 7], 32, 8, 128).fill(rng)
    case.upload(rng)
    results = []
    for splits in (5, 1):
        with case.make_plan() as plan:
            plan.plan(case.indptr, case.kv_lens, causal=causal, num_splits=splits,
                      wg_rows=wg_rows)
            case.run(plan, stream)
            stream.synchronize()
            check(case, causal=causal)
            results.append(case.device["out"].numpy().astype(np.float64))
    assert relative_error(results[0], results[1]) < 2e-3


@pytest.mark.parametrize("num_q_heads, num_kv_heads, qo_lens", [
    (64, 1, [1] * 6), (32, 1, [1] * 6), (48, 1, [1, 1, 0, 1, 1, 1]), (32, 2, [2] * 6),
    (32, 1, [1, 3, 1, 1, 2, 1])])
@pytest.mark.parametrize("causal", [True, False])
def test_wgmma_row_tiles_of_at_most_64_rows(rng, stream, num_q_heads, num_kv_heads, qo_lens,
                                            causal):
    """Row tiles of at most 64 rows in the 128-row kernel (multi-query decode, drafts: its
    second computing warpgroup has no rows). KV of one tile, two, an odd and an even count, a
    partial last tile; mixed with tiles of more than 64 rows (3 x 32); split and unsplit
    against the oracle and each other."""
    if len(wgmma_choices()) == 1:
        pytest.skip("the warpgroup-MMA kernels need an sm_90 GPU")
    case = MultiCase(qo_lens, [3, 64, 65, 191, 4096, 1000], num_q_heads, num_kv_heads,
                     128).fill(rng)
    case.upload(rng)
    results = []
    for splits in (None, 3, 1):
        with case.make_plan() as plan:
            plan.plan(case.indptr, case.kv_lens, causal=causal, num_splits=splits,
                      wgmma=True, wg_rows=128)
            case.run(plan, stream)
            stream.synchronize()
            check(case, causal=causal)
            assert plan.error_flags(stream=stream) == 0
            results.append(case.device["out"].numpy().astype(np.float64))
    assert relative_error(results[1], results[2]) < 2e-3


def test_long_prefill_rows_match_the_oracle(rng, stream):
    """qo_len 16384 (B=1, fresh prefill) and a 2048-token chunk over a 6000-token prefix:
    sampled rows, including the first and last of each sequence, against the oracle."""
    case = MultiCase([16384, 2048], [16384, 8048], 8, 2, 128).fill(rng)
    case.upload(rng)
    with case.make_plan() as plan:
        plan.plan(case.indptr, case.kv_lens)
        case.run(plan, stream)
        stream.synchronize()
    rows = np.unique(np.concatenate([[0, 63, 64, 16383, 16384, 18431],
                                     rng.integers(0, case.total_q, 40)]))
    out = case.device["out"].numpy()[rows]
    err = relative_error(out, case.row_reference(rows))
    assert err <= TOLERANCE["float16"], f"relative error {err:.2e}"


@pytest.mark.parametrize("kernel", wgmma_choices(), ids=kernel_id)
def test_65536_query_rows(rng, stream, kernel):
    """total_q = 65536: four fresh 16384-token prefills in one launch; sampled rows, including
    each sequence's first and last and the launch's last, against the oracle."""
    case = MultiCase([16384] * 4, [16384] * 4, 8, 2, 64).fill(rng)
    case.upload(rng)
    with case.make_plan() as plan:
        plan.plan(case.indptr, case.kv_lens, **kernel)
        case.run(plan, stream)
        stream.synchronize()
        assert plan.error_flags(stream=stream) == 0
    assert case.total_q == 65536
    edges = [b * 16384 + i for b in range(4) for i in (0, 16383)]
    rows = np.unique(np.concatenate([edges, rng.integers(0, case.total_q, 24)]))
    out = case.device["out"].numpy()[rows]
    err = relative_error(out, case.row_reference(rows))
    assert err <= TOLERANCE["float16"], f"relative error {err:.2e}"


@pytest.mark.parametrize("rope", ["neox", "gptj"])
@pytest.mark.parametrize("table", [False, True])
@pytest.mark.parametrize("kernel", wgmma_choices(), ids=kernel_id)
def test_rotate_q_at_the_rows_positions(rng, stream, rope, table, kernel):
    from lowlevel_fd.reference import rope_table
    case = MultiCase([7, 64], [50, 64], 8, 2, 128).fill(rng)
    d = case.upload(rng)
    cos_sin = DeviceArray.from_numpy(rope_table(case.capacity, 128)) if table else None
    positions = np.concatenate([np.arange(43, 50), np.arange(64)])
    rotated = rotate(case.host["q"], positions, rope)
    with case.make_plan(rope=rope) as plan:
        plan.plan(case.indptr, case.kv_lens, **kernel)
        case.run(plan, stream, rotate_q=True, cos_sin=cos_sin)
        stream.synchronize()
        check(case, q=rotated)
    assert d["q"].numpy().tobytes() == case.host["q"].tobytes()  # q itself is not modified


@pytest.mark.parametrize("kernel", wgmma_choices(), ids=kernel_id)
def test_graph_replay_follows_new_lengths_and_matches_eager(rng, stream, kernel):
    case = MultiCase([4, 4, 4], [900, 300, 40], 32, 8, 128, capacity=1024).fill(rng)
    d = case.upload(rng)
    with case.make_plan() as plan:
        # ksplit 1: 128 rows per tile, room for 32 tokens x the group (4) per sequence
        plan.plan(case.indptr, [1024, 1024, 1024], ksplit=1, **kernel)
        with capture(stream) as graph:
            case.run(plan, stream)
        for qo, kv in (([4, 4, 4], [900, 300, 40]), ([1, 8, 3], [1024, 8, 3]),
                       ([0, 12, 0], [5, 700, 0])):
            case.qo_lens, case.kv_lens = qo, kv
            case.host["seq_lens"] = np.asarray(kv, np.int32)
            d["seq_lens"].copy_from_numpy(case.host["seq_lens"])
            d["qo_indptr"].copy_from_numpy(case.indptr)
            d["out"].fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            check(case)
            replayed = d["out"].numpy().copy()
            case.run(plan, stream)
            stream.synchronize()
            assert d["out"].numpy().tobytes() == replayed.tobytes()
        graph.close()
        assert plan.error_flags(stream=stream) == 0


@pytest.mark.parametrize("kernel", wgmma_choices(), ids=kernel_id)
@pytest.mark.parametrize("sm_scale, k_scale", [(-0.1, 1.0), (0.1, -1.0), (0.1, 0.0),
                                               (-0.05, -2.0)])
def test_any_sign_of_the_score_scale(rng, stream, kernel, sm_scale, k_scale):
    """A negative sm_scale or per-head K scale, or a zero one, against the oracle (the
    warpgroup kernel takes the row maximum before the scale: it flips q's sign instead)."""
    case = MultiCase([70, 33], [200, 33], 8, 2, 128, scale_mode="head").fill(rng)
    case.host["k_scale"] = (case.host["k_scale"] * np.float32(k_scale)).astype(np.float32)
    case.upload(rng)
    with case.make_plan(sm_scale=sm_scale) as plan:
        plan.plan(case.indptr, case.kv_lens, ksplit=1, **kernel)
        case.run(plan, stream)
        stream.synchronize()
    ref_out, ref_lse = case.reference(sm_scale=sm_scale)
    out = case.device["out"].numpy()
    assert relative_error(out, ref_out) <= TOLERANCE["float16"]
    np.testing.assert_allclose(case.device["lse"].numpy(), ref_lse, rtol=0, atol=2e-3)


@pytest.mark.parametrize("kernel", wgmma_choices(), ids=kernel_id)
def test_device_guards_flag_and_write_nothing(rng, stream, kernel):
    case = MultiCase([3, 4, 5], [10, 20, 30], 8, 2, 64).fill(rng)
    d = case.upload(rng)
    with case.make_plan() as plan:
        plan.plan(case.indptr, case.kv_lens, ksplit=1 if kernel["wgmma"] else None, **kernel)
        # A chunk longer than its KV: sequence 0 writes nothing (its rows keep the NaN
        # poison); the others are exact.
        d["seq_lens"].copy_from_numpy(np.array([2, 20, 30], np.int32))
        case.run(plan, stream)
        assert plan.error_flags(stream=stream) == ERROR_QUERY_RANGE
        out, lse = d["out"].numpy(), d["lse"].numpy()
        assert np.isnan(out[:3]).all() and np.isnan(lse[:3]).all()
        ref, _ = case.reference()
        assert relative_error(out[3:], ref[3:]) <= TOLERANCE["float16"]
        # Not monotone / past total_q: those sequences' rows zero.
        d["seq_lens"].copy_from_numpy(case.host["seq_lens"])
        d["qo_indptr"].copy_from_numpy(np.array([0, 3, 2, 99], np.int32))
        case.run(plan, stream)
        assert plan.error_flags(stream=stream) == ERROR_QUERY_RANGE
        assert np.isfinite(d["out"].numpy()[:3]).all()
        # A length past the cache is clamped.
        d["qo_indptr"].copy_from_numpy(case.indptr)
        d["seq_lens"].copy_from_numpy(np.array([10, 20, 1 << 20], np.int32))
        case.run(plan, stream)
        assert plan.error_flags(stream=stream) == ERROR_OUTSIDE_CACHE


@pytest.mark.parametrize("kernel", wgmma_choices(), ids=kernel_id)
def test_bad_page_ids_are_never_read(rng, stream, kernel):
    case = MultiCase([5, 9], [40, 90], 8, 2, 128, "nhd", 16).fill(rng)
    d = case.upload(rng)
    table = d["block_table"].numpy()
    table[1, 2] = -5
    table[0, 1] = 1 << 30
    d["block_table"].copy_from_numpy(table)
    with case.make_plan() as plan:
        plan.plan(case.indptr, case.kv_lens, **kernel)
        case.run(plan, stream)
        assert plan.error_flags(stream=stream) == ERROR_BAD_PAGE
        assert np.isfinite(d["out"].numpy()).all()


@pytest.mark.parametrize("key_transform, D", [("none", 128), ("hadamard", 128),
                                               ("hadamard", 64), ("hadamard", 256)])
def test_chunked_prefill_end_to_end_writes_the_append_bytes(rng, stream, key_transform, D):
    """A prompt written in two chunks by PromptQuantizer(starts=) holds the bytes AppendPlan
    writes token by token (RoPE neox, per-token scales; keys Hadamard-transformed or not);
    MultiPlan over the second chunk, with q rotated (and transformed) in the kernel, matches
    the oracle over that cache."""
    from lowlevel_fd import AppendPlan, PromptQuantizer
    from lowlevel_fd.driver import dtypes
    B, HKV, HQ, S = 2, 2, 8, 96
    lens = np.array([80, 45], np.int32)
    first = np.array([33, 16], np.int32)  # the first chunk; the second is the rest
    qt = dtypes.as_dtype("float16")
    k = rng.standard_normal((B, S, HKV, D)).astype(qt)
    v = rng.standard_normal((B, S, HKV, D)).astype(qt)

    def empty():
        return {"k_cache": DeviceArray.from_numpy(np.zeros((B, HKV, S, D), np.int8)),
                "v_cache": DeviceArray.from_numpy(np.zeros((B, HKV, S, D), np.int8)),
                "k_scale": DeviceArray.from_numpy(np.zeros((B, HKV, S), np.float32)),
                "v_scale": DeviceArray.from_numpy(np.zeros((B, HKV, S), np.float32))}
    names = ("k_cache", "v_cache", "k_scale", "v_scale")
    chunked, appended = empty(), empty()
    quantizer = PromptQuantizer.create(HKV, D, max_batch=B, rope="neox",
                                       key_transform=key_transform)
    cached = DeviceArray.from_numpy(np.zeros(B, np.int32))
    for start, count in ((np.zeros(B, np.int32), first), (first, lens - first)):
        part_k, part_v = np.zeros_like(k), np.zeros_like(v)
        for b in range(B):
            part_k[b, :count[b]] = k[b, start[b]:start[b] + count[b]]
            part_v[b, :count[b]] = v[b, start[b]:start[b] + count[b]]
        quantizer.run(DeviceArray.from_numpy(part_k), DeviceArray.from_numpy(part_v),
                      *(chunked[n] for n in names), DeviceArray.from_numpy(count),
                      starts=DeviceArray.from_numpy(start), seq_lens_out=cached,
                      stream=stream)
        stream.synchronize()
    appender = AppendPlan.create(HQ, HKV, D, max_batch=B, rope="neox",
                                 key_transform=key_transform)
    positions = DeviceArray.from_numpy(np.zeros(B, np.int32))
    for t in range(int(lens.max())):
        # a finished sequence's position is past the cache: nothing written (flagged)
        positions.copy_from_numpy(np.where(t < lens, t, S).astype(np.int32))
        appender.run(DeviceArray.from_numpy(np.ascontiguousarray(k[:, t])),
                     DeviceArray.from_numpy(np.ascontiguousarray(v[:, t])),
                     *(appended[n] for n in names), positions, stream=stream)
        stream.synchronize()
    stream.synchronize()
    assert quantizer.error_flags(stream=stream) == 0
    assert cached.numpy().tolist() == lens.tolist()
    for n in names:
        assert chunked[n].numpy().tobytes() == appended[n].numpy().tobytes(), n

    # Attention of the second chunk over the cache, q rotated at its positions in the kernel.
    case = MultiCase(list(lens - first), list(lens), HQ, HKV, D, capacity=S)
    case.fill(rng)
    for n in names:
        case.host[n] = chunked[n].numpy()
    d = case.upload(rng)
    positions_q = np.concatenate([np.arange(first[b], lens[b]) for b in range(B)])
    q_ref = rotate(case.host["q"], positions_q, "neox", key_transform=key_transform)
    with case.make_plan(rope="neox", key_transform=key_transform) as plan:
        plan.plan(case.indptr, case.kv_lens)
        case.run(plan, stream, rotate_q=True)
        stream.synchronize()
        check(case, q=q_ref)
        assert d["out"].numpy().shape == (case.total_q, HQ, D)
        # rotate_q=False: the caller passes q rotated and transformed (as fp16), same result
        rotated = DeviceArray.from_numpy(q_ref.astype(case.host["q"].dtype))
        plan.run(rotated, *(d[n] for n in names), d["seq_lens"], d["qo_indptr"], d["out"],
                 lse=d["lse"], stream=stream)
        stream.synchronize()
        check(case, q=q_ref)
