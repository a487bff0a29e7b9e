"""MultiPlan without a GPU: the host checks of plan() (qo_indptr and the lengths), the planner's
splits and warps per row group, the argument checks of run() (MultiBinder over stand-in device
memory), the parameter block's layout, and the shipped variants."""
from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np
import pytest
from stand_ins import DEVICE, StandInDevice, fake

from lowlevel_fd import KVCacheSpec, MultiPlan
from lowlevel_fd.core import support
from lowlevel_fd.multi import MultiVariant, MultiWorkload, choose_splits, shipped_variants
from lowlevel_fd.multi.bind import MultiBinder
from lowlevel_fd.multi.params import MultiParams
from lowlevel_fd.multi.bind import host_queries
from lowlevel_fd.multi.planner import (MAX_CLUSTER_SPLITS, MAX_SPLITS, choose_cluster,
                                       choose_ksplit, choose_merge, cluster_merge_fits)
from lowlevel_fd.multi.variants import ksplits, tile_tokens

CU = Path(__file__).resolve().parents[1] / "lowlevel_fd" / "cu"


# -- plan(): the host copies -------------------------------------------------------------------
@pytest.mark.parametrize("indptr, lens, message", [
    ([0, 3, 2], [5, 5], r"^qo_indptr: expected a non-decreasing array, got qo_indptr\[2\]=2 < "
                        r"qo_indptr\[1\]=3$"),
    ([1, 3], [5], r"^qo_indptr: expected qo_indptr\[0\] == 0, got 1$"),
    ([0, 6], [5], r"^qo_indptr: sequence 0 has qo_len 6 > seq_lens\[0\]=5 \(seq_lens counts"),
    ([0, 2, 4], [5], r"^seq_lens: expected 2 lengths \(one per qo_indptr interval\), got 1$"),
    ([0], [], r"^qo_indptr: expected an integer \[B \+ 1\] array with B >= 1"),
    ([0.0, 2.0], [5], r"^qo_indptr: expected an integer \[B \+ 1\] array"),
    ([0, 2], [9000], r"^seq_lens: expected lengths in \[0, max_seq_len=8192\]"),
])
def test_host_queries_reject_bad_input(indptr, lens, message):
    with pytest.raises(ValueError, match=message):
        host_queries(indptr, lens, 4, 8192)


def test_host_queries_accept_empty_rows_and_return_the_lengths():
    qo, kv = host_queries(np.array([0, 0, 5, 5, 6]), [0, 9, 3000, 1], 4, 8192)
    assert qo.tolist() == [0, 5, 0, 1] and kv.tolist() == [0, 9, 3000, 1]


def test_host_queries_without_qo_indptr_are_decode_rows_and_allow_empty_sequences():
    qo, kv = host_queries(None, [0, 9, 3000], 4, 8192)
    assert qo.tolist() == [1, 1, 1] and kv.tolist() == [0, 9, 3000]
    with pytest.raises(ValueError, match="seq_lens"):
        host_queries(None, [9000], 4, 8192)


def test_host_queries_want_host_arrays():
    with pytest.raises(TypeError, match=r"^qo_indptr: plan\(\) needs the host copy"):
        host_queries(fake((3,), "int32"), [1, 1], 4, 8192)


# -- the constructor and plan()'s options: checked before anything is compiled or loaded ----
@pytest.mark.parametrize("options, error, message", [
    ({"max_batch": 0}, ValueError, r"^max_batch: expected an int in \[1, 65536\), got 0$"),
    ({"max_batch": 70000}, ValueError,
     r"^max_batch: expected an int in \[1, 65536\), got 70000$"),  # the batch is grid.z
    ({"sm_scale": 0.0}, ValueError, r"^sm_scale: expected a finite non-zero scale, got 0.0$"),
    ({"dtype": "float32"}, ValueError,
     r"^dtype: expected one of \['float16', 'bfloat16'\], got 'float32'$"),
    ({"num_q_heads": 30}, ValueError, r"^num_q_heads: expected a multiple of num_kv_heads=8"),
])
def test_constructor_rejects_bad_options(options, error, message):
    options = {"max_batch": 2, "max_seq_len": 64, "device": DEVICE} | options
    with pytest.raises(error, match=message):
        MultiPlan.create(options.pop("num_q_heads", 32), 8, 128, **options)


def test_constructor_takes_a_spec():
    with pytest.raises(TypeError, match=r"^cache: expected a KVCacheSpec, got str 'x'$"):
        MultiPlan("x", 32, max_batch=2, max_seq_len=64, device=DEVICE)


@pytest.mark.parametrize("options, error, message", [
    ({"causal": 1}, TypeError, r"^causal: expected a bool, got int 1$"),
    ({"num_splits": 0}, ValueError, r"^num_splits: expected an int in \[1, 33\), got 0$"),
    ({"num_splits": 33}, ValueError, r"^num_splits: expected an int in \[1, 33\), got 33$"),
    ({"ksplit": 3}, ValueError, r"^ksplit: expected one of \(1, 2\) at head_dim 128, got 3$"),
    ({"tree": 1}, TypeError, r"^tree: expected a bool, got int 1$"),
    ({"tree": True, "ksplit": 1}, ValueError,
     r"^ksplit: expected one of \(2,\) at head_dim 128 with tree=True, got 1$"),
    ({"wgmma": 1}, TypeError, r"^wgmma: expected a bool, got int 1$"),
    ({"cluster": 1}, TypeError, r"^cluster: expected a bool, got int 1$"),
    ({"combine": 1}, TypeError, r"^combine: expected a bool, got int 1$"),
    ({"combine": True, "cluster": True}, ValueError,
     r"^combine: the merge kernel and the cluster merge exclude each other, got combine=True "
     r"with cluster=True$"),
    ({"wgmma": True, "ksplit": 2}, ValueError,
     r"^wgmma: the warpgroup-MMA kernel takes whole tiles \(ksplit 1, no tree masks\), got "
     r"ksplit 2, tree=False$"),
    ({"wgmma": True, "tree": True}, ValueError,
     r"^wgmma: the warpgroup-MMA kernel takes whole tiles \(ksplit 1, no tree masks\), got "
     r"ksplit None, tree=True$"),
    ({"wg_rows": 32}, ValueError, r"^wg_rows: expected one of \(128, 64\), got 32$"),
    ({"wg_rows": True}, ValueError, r"^wg_rows: expected one of \(128, 64\), got True$"),
    ({"wg_rows": 64, "wgmma": False}, ValueError,
     r"^wg_rows: the warpgroup kernel's rows, given with wgmma=False \(got wg_rows=64\)$"),
    ({"wg_rows": 64, "ksplit": 2}, ValueError,
     r"^wgmma: the warpgroup-MMA kernel takes whole tiles \(ksplit 1, no tree masks\), got "
     r"ksplit 2, tree=False$"),
])
def test_plan_rejects_bad_options_before_loading(options, error, message):
    # A stand-in device: reaching the compiler or the driver would fail differently.
    plan = MultiPlan.create(32, 8, 128, max_batch=2, max_seq_len=64, device=DEVICE)
    with pytest.raises(error, match=message):
        plan.plan([0, 2], [5], **options)


def device_of(arch: str) -> StandInDevice:
    device = StandInDevice(0)
    device.arch = arch
    return device


@pytest.mark.parametrize("arch, head_dim", [("sm_80", 128), ("sm_100", 64), ("sm_90", 256)])
def test_wgmma_needs_hopper_and_head_dim_64_or_128(arch, head_dim):
    device = device_of(arch)
    plan = MultiPlan.create(32, 8, head_dim, max_batch=2, max_seq_len=64, device=device)
    with pytest.raises(ValueError, match=rf"^wgmma: the warpgroup-MMA kernel needs an sm_90 "
                                         rf"device and head_dim 64 or 128, got {arch} and "
                                         rf"head_dim {head_dim}$"):
        plan.plan([0, 2], [5], wgmma=True)


MMA = (False, 128)


@pytest.mark.parametrize("arch, head_dim, rows, tiles, tree, ksplit, expected", [
    ("sm_90", 128, 400, 8, False, None, (True, 128)),
    ("sm_90", 64, 400, 8, False, None, (True, 128)),
    ("sm_90a", 128, 400, 8, False, None, (True, 128)),
    ("sm_90", 128, 65, 512, False, None, (True, 128)),  # more than a 64-row CTA holds
    ("sm_90", 128, 64, 128, False, None, (True, 128)),  # multi-query, B=128: 128-row CTAs
    ("sm_90", 128, 33, 263, False, None, (True, 128)),
    ("sm_90", 128, 64, 264, False, None, (True, 64)),   # two 64-row CTAs per SM (132 SMs)
    ("sm_90", 128, 33, 512, False, None, (True, 64)),   # 16 drafts, B=64
    ("sm_90", 128, 32, 8, False, None, MMA),            # drafts of 32 rows: split warps
    ("sm_90", 128, 16, 512, False, None, MMA),
    ("sm_90", 128, 400, 8, False, 2, MMA),              # split warps asked for
    ("sm_90", 128, 400, 8, True, None, MMA),            # tree masks: split warps
    ("sm_90", 256, 400, 8, False, None, MMA), ("sm_80", 128, 400, 8, False, None, MMA),
    ("sm_100", 128, 400, 8, False, None, MMA),
])
def test_the_planner_picks_wgmma_for_whole_tiles_on_hopper(arch, head_dim, rows, tiles, tree,
                                                          ksplit, expected):
    """planner.choose_wg_rows: split warps up to 32 rows per KV head, then the 128-row CTA,
    but 64-row CTAs where 33-64 rows come in row tiles for two per SM."""
    plan = MultiPlan.create(32, 8, head_dim, max_batch=2, max_seq_len=64,
                            device=device_of(arch))
    assert plan._wgmma_choice(None, None, ksplit, tree, rows, tiles) == expected


@pytest.mark.parametrize("wgmma, wg_rows, rows, expected", [
    (True, None, 64, (True, 64)), (True, None, 65, (True, 128)), (True, None, 16, (True, 64)),
    (None, 128, 16, (True, 128)), (True, 64, 4000, (True, 64)), (False, None, 4000, MMA),
])
def test_forced_warpgroup_kernels(wgmma, wg_rows, rows, expected):
    """wgmma=True picks the smaller CTA that holds a sequence's rows; wg_rows picks one."""
    plan = MultiPlan.create(32, 8, 128, max_batch=2, max_seq_len=64, device=device_of("sm_90"))
    assert plan._wgmma_choice(wgmma, wg_rows, None, False, rows) == expected


def test_wgmma_variants_build_for_hopper_only():
    variant = MultiVariant(128, wgmma=True)
    assert variant.builds_for("sm_90") and variant.builds_for("sm_90a")
    assert not variant.builds_for("sm_80") and not variant.builds_for("sm_100")
    assert variant.target_arch("sm_90") == "sm_90a"
    assert MultiVariant(128).target_arch("sm_80") == "sm_80"
    with pytest.raises(ValueError, match=r"^arch: the wgmma kernel needs sm_90, got 'sm_80'$"):
        variant.target_arch("sm_80")
    with pytest.raises(ValueError, match=r"^the wgmma kernel takes ksplit 1 and head_dim"):
        MultiVariant(256, wgmma=True)
    with pytest.raises(ValueError, match=r"^the wgmma kernel takes ksplit 1 and head_dim"):
        MultiVariant(128, ksplit=2, wgmma=True)


@pytest.mark.parametrize("value", [1, None, "yes"])
def test_early_reads_must_be_a_bool(value):
    plan = MultiPlan.create(32, 8, 128, max_batch=2, max_seq_len=64, device=DEVICE)
    with pytest.raises(TypeError, match=r"^early_reads: expected a bool, got "):
        plan.run(*[None] * 8, early_reads=value, stream=0)
    plan.close()


def test_run_needs_a_plan_and_an_open_plan():
    plan = MultiPlan.create(32, 8, 128, max_batch=2, max_seq_len=64, device=DEVICE)
    with pytest.raises(RuntimeError, match=r"^run: call plan\(qo_indptr, seq_lens\) first$"):
        plan.run(*[None] * 8, stream=0)
    plan.close()
    with pytest.raises(RuntimeError, match=r"^MultiPlan is closed$"):
        plan.plan([0, 2], [5])


# -- the planner -------------------------------------------------------------------------------
def work(qo, kv, group=4, heads=8, head_dim=128, ksplit=1):
    rows = MultiVariant(head_dim, ksplit=ksplit).rows_per_cta
    return MultiWorkload(np.asarray(qo), np.asarray(kv), group, heads,
                         tile_tokens(head_dim, ksplit), rows)


def test_prefill_is_not_split_and_tiles_count_packed_rows():
    w = work([16384], [16384])
    assert w.max_tiles == 16384 * 4 // 128  # two 16-row blocks per warp, four warps
    assert choose_splits(w, 132, 2) == (1, 16 * 32)


def test_drafts_over_a_long_kv_are_split_into_runs_of_at_least_16_tiles():
    w = work([4] * 8, [4096] * 8, ksplit=4)
    splits, min_tokens = choose_splits(w, 132, 3)
    assert (splits, min_tokens) == (4, 1024)  # 4096 / 1024: one wave would want 7
    # 8 drafts: two 16-row tiles per KV head, 128 CTAs: 3 splits fill one wave of 396, 4 would
    # start a second
    assert choose_splits(work([8] * 8, [4096] * 8, ksplit=4), 132, 3) == (3, 1024)
    # beyond one wave: toward two (B=64, 4 drafts: 512 CTAs -> 2 splits)
    assert choose_splits(work([4] * 64, [4096] * 64, ksplit=4), 132, 3)[0] == 2
    assert choose_splits(work([4] * 8, [900] * 8, ksplit=4), 132, 3)[0] == 1
    assert choose_splits(work([1], [10**6], ksplit=4), 132, 3)[0] == MAX_SPLITS
    # the shipped head_dim-128 layout (ksplit 2, 32-row CTAs, 2 per SM): B=64 drafts are 512
    # CTAs in 264 slots, 1.94 waves: unsplit (measured 193.8 us against 216.4 with 2 splits)
    assert choose_splits(work([4] * 64, [4096] * 64, ksplit=2), 132, 2)[0] == 1
    assert choose_splits(work([8] * 8, [4096] * 8, ksplit=2), 132, 2) == (4, 1024)


def test_splits_merge_in_clusters_only_where_residency_is_kept():
    # B=32 multi-query: 128 CTAs of one per SM in clusters of 4; the device holds 32 clusters
    assert cluster_merge_fits(4, 128, 132, 32)
    assert not cluster_merge_fits(4, 128, 132, 31)  # 124 resident of 128: a second wave
    assert cluster_merge_fits(4, 128, 132, 33)
    # a grid over one wave needs as many resident CTAs as the plain launch holds
    assert cluster_merge_fits(2, 512, 264, 132)
    assert not cluster_merge_fits(2, 512, 264, 120)
    # one split has nothing to merge; past the portable cluster size: the global merge
    assert not cluster_merge_fits(1, 128, 132, 132)
    assert not cluster_merge_fits(MAX_CLUSTER_SPLITS + 1, 9, 132, 14)
    assert cluster_merge_fits(MAX_CLUSTER_SPLITS, 8, 132, 1)


def test_the_cluster_choice_and_its_errors():
    def never() -> int:
        raise AssertionError("the device was asked")
    assert not choose_cluster(False, "warpgroup", "sm_90", True, 4, 32, 132, never)
    assert not choose_cluster(None, "mma.sync", "sm_90", True, 4, 32, 132, never)
    assert not choose_cluster(None, "warpgroup", "sm_80", False, 4, 32, 132, never)
    assert not choose_cluster(None, "warpgroup", "sm_90", True, 1, 32, 132, never)
    assert choose_cluster(None, "warpgroup", "sm_90", True, 4, 32, 132, lambda: 30)
    assert not choose_cluster(None, "warpgroup", "sm_90", True, 4, 128, 132, lambda: 30)
    assert choose_cluster(True, "warpgroup", "sm_90", True, 4, 128, 132, lambda: 30)
    needs = (r"^cluster: the cluster merge needs the warpgroup kernels \(sm_90\) and 2 to 8 "
             r"splits, got the ")
    with pytest.raises(ValueError, match=needs + r"mma.sync kernel on sm_90 with 4 split\(s\)$"):
        choose_cluster(True, "mma.sync", "sm_90", True, 4, 32, 132, never)
    with pytest.raises(ValueError, match=needs + r"warpgroup kernel on sm_80 with 4 split\(s\)$"):
        choose_cluster(True, "warpgroup", "sm_80", False, 4, 32, 132, never)
    with pytest.raises(ValueError, match=needs + r"warpgroup kernel on sm_90 with 9 split\(s\)$"):
        choose_cluster(True, "warpgroup", "sm_90", True, MAX_CLUSTER_SPLITS + 1, 32, 132, never)
    with pytest.raises(ValueError,
                       match=r"^cluster: the device holds no cluster of 8 CTAs of this kernel$"):
        choose_cluster(True, "warpgroup", "sm_90", True, 8, 32, 132, lambda: 0)


def test_the_merge_choice():
    assert choose_merge(None, False, 1) is None and choose_merge(True, False, 1) is None
    assert choose_merge(None, True, 4) == "cluster"
    assert choose_merge(None, False, 4) == choose_merge(True, False, 4) == "kernel"
    assert choose_merge(False, False, 4) == "last split"


def test_merge_kernels_serve_every_attention_shape_once():
    from lowlevel_fd.multi.variants import CombineVariant, MultiVariant, shipped_variants
    shipped = list(shipped_variants())
    attention = [v for v in shipped if isinstance(v, MultiVariant)]
    combines = [v for v in shipped if isinstance(v, CombineVariant)]
    assert len(combines) == len(set(combines)) == 18
    assert {CombineVariant.of(v) for v in attention} == set(combines)
    for c in combines:  # a CTA's rows lie in one row tile; one quad per thread
        assert c.rows % c.rows_per_cta == 0 and c.rows_per_cta * c.head_dim // 4 == c.threads
    assert CombineVariant(128, 64, 64).grid(32, 8) == (32, 16, 8)


@pytest.mark.parametrize("qo, group, head_dim, ksplit", [
    ([4, 1], 4, 128, 2), ([8], 4, 128, 2), ([9], 4, 128, 1), ([1], 32, 64, 4),
    ([1], 64, 128, 1), ([2], 8, 256, 2), ([0, 0], 4, 128, 2), ([4], 4, 64, 4)])
def test_ksplit_when_the_rows_fit_two_warps(qo, group, head_dim, ksplit):
    assert choose_ksplit(np.asarray(qo), group, head_dim) == ksplit
    assert ksplit in ksplits(head_dim)


# -- run(): MultiBinder over stand-in memory ---------------------------------------------------
SPEC = KVCacheSpec(2, 64)
B, TOTAL, HQ = 2, 7, 8


def arrays(**overrides):
    a = dict(q=fake((TOTAL, HQ, 64), "float16"), k_cache=fake((B, 2, 64, 64), "int8"),
             v_cache=fake((B, 2, 64, 64), "int8"), k_scale=fake((B, 2, 64), "float32"),
             v_scale=fake((B, 2, 64), "float32"), seq_lens=fake((B,), "int32"),
             qo_indptr=fake((B + 1,), "int32"), out=fake((TOTAL, HQ, 64), "float16"),
             lse=None, block_table=None, cos_sin=None, rotate_q=False, tree_mask=None)
    a.update(overrides)
    return a


def bind(**overrides):
    binder = MultiBinder(SPEC, HQ, "float16", DEVICE)
    binder.planned(B, TOTAL, 50, 40, tree=overrides.pop("tree", True))
    p = MultiParams()
    a = arrays(**overrides)
    binder.bind(p, a["q"], a["k_cache"], a["v_cache"], a["k_scale"], a["v_scale"],
                a["seq_lens"], a["qo_indptr"], a["out"], a["lse"], a["block_table"],
                a["cos_sin"], a["rotate_q"], a["tree_mask"])
    return p


def test_bind_writes_pointers_and_strides():
    p = bind()
    assert p.q_token_stride == HQ * 64 and p.q_head_stride == 64 and p.capacity == 64
    assert p.rope == 0 and p.block_table == 0 and p.tree_mask == 0 and p.tree_words == 0
    mask = fake((TOTAL, 2), "uint32")
    p = bind(tree_mask=mask)
    assert p.tree_mask == mask.ptr and p.tree_words == 2
    bind(tree_mask=fake((TOTAL, 3), "int32"))  # more words than needed, int32 bits


@pytest.mark.parametrize("overrides, message", [
    ({"q": fake((TOTAL + 1, HQ, 64), "float16")},
     r"^q: expected total_q=7 rows \(the planned qo_indptr\[-1\]\), got 8$"),
    ({"out": fake((TOTAL, HQ, 64), "bfloat16")}, r"^out: expected dtype float16"),
    ({"qo_indptr": fake((B,), "int32")}, r"^qo_indptr: expected shape \[B \+ 1\]"),
    ({"qo_indptr": fake((B + 1,), "int64")}, r"^qo_indptr: expected dtype int32"),
    ({"seq_lens": fake((B + 1,), "int32")}, r"^seq_lens: expected shape \[B\]"),
    ({"lse": fake((TOTAL, HQ), "float16")}, r"^lse: expected dtype float32"),
    ({"lse": fake((TOTAL, HQ + 1), "float32")}, r"^lse: expected shape \[total_q, Hq\]"),
    ({"k_cache": fake((B, 2, 32, 64), "int8"), "v_cache": fake((B, 2, 32, 64), "int8"),
      "k_scale": fake((B, 2, 32), "float32"), "v_scale": fake((B, 2, 32), "float32")},
     r"^k_cache: capacity 32 tokens is below the planned longest sequence 50$"),
    ({"rotate_q": True}, r"^rotate_q: the cache spec applies no RoPE"),
    ({"cos_sin": fake((64, 32, 2), "float32")}, r"^cos_sin: only used to rotate q"),
    ({"block_table": fake((B, 4), "int32")}, r"^block_table: the cache spec is contiguous"),
    ({"tree_mask": fake((TOTAL, 2), "float32")},
     r"^tree_mask: expected dtype uint32 or int32, got float32$"),
    ({"tree_mask": fake((TOTAL + 1, 2), "uint32")},
     r"^tree_mask: expected shape \[total_q, words\]=\(7, '\*'\), got \(8, 2\)$"),
    ({"tree_mask": fake((TOTAL, 1), "uint32")},
     r"^tree_mask: expected at least 2 32-bit words per row \(the planned longest chunk has "
     r"40 tokens\), got 1$"),
    ({"tree_mask": fake((TOTAL, 2), "uint32", strides=(16, 4))},
     r"^tree_mask: expected a C-contiguous array, got strides \(16, 4\)$"),
])
def test_bind_rejects_bad_arguments_naming_them(overrides, message):
    error = TypeError if "dtype" in message else ValueError
    with pytest.raises(error, match=message):
        bind(**overrides)


def test_decode_rows_bind_without_qo_indptr_and_appended_only_there():
    binder = MultiBinder(SPEC, HQ, "float16", DEVICE)
    binder.planned(B, B, 50, 1, decode_rows=True)
    a = arrays(q=fake((B, HQ, 64), "float16"), out=fake((B, HQ, 64), "float16"))
    args = [a[name] for name in ("q", "k_cache", "v_cache", "k_scale", "v_scale", "seq_lens")]
    tail = [a[name] for name in ("lse", "block_table", "cos_sin", "rotate_q", "tree_mask")]
    p = MultiParams()
    binder.bind(p, *args, None, a["out"], *tail)
    assert p.decode_rows == 1 and p.qo_indptr == 0
    binder.bind(p, *args, None, a["out"], *tail, appended=True)
    assert p.decode_rows == 2
    with pytest.raises(ValueError, match=r"^qo_indptr: the plan was made with qo_indptr=None"):
        binder.bind(p, *args, a["qo_indptr"], a["out"], *tail)
    with pytest.raises(ValueError, match=r"^qo_indptr: expected an int32 \[B \+ 1\] device"):
        bind(qo_indptr=None)
    with pytest.raises(ValueError, match=r"^appended: only for decode rows"):
        packed = MultiBinder(SPEC, HQ, "float16", DEVICE)
        packed.planned(B, TOTAL, 50, 40)
        b = arrays()
        packed.bind(MultiParams(), *[b[name] for name in ("q", "k_cache", "v_cache", "k_scale",
                                                          "v_scale", "seq_lens", "qo_indptr",
                                                          "out", "lse", "block_table",
                                                          "cos_sin", "rotate_q", "tree_mask")],
                    appended=True)


def test_tree_masks_need_a_tree_plan():
    with pytest.raises(ValueError, match=r"^tree_mask: the plan takes no tree masks; plan with "
                                         r"plan\(\.\.\., tree=True\)$"):
        bind(tree=False, tree_mask=fake((TOTAL, 2), "uint32"))


def test_out_may_be_q_itself_but_not_overlap_it():
    q = fake((TOTAL, HQ, 64), "float16")
    bind(q=q, out=q)
    shifted = fake((TOTAL, HQ, 64), "float16", ptr=q.ptr + 128)
    with pytest.raises(ValueError, match=r"^out: expected q itself or memory disjoint"):
        bind(q=q, out=shifted)


# -- the parameter block and the variants ------------------------------------------------------
def test_params_match_the_cuda_struct():
    header = (CU / "multi_params.cuh").read_text()
    assert f"sizeof(MultiParams) == {ctypes.sizeof(MultiParams)}" in header
    body = header.split("struct MultiParams {")[1].split("};")[0]
    declared = [name for line in body.splitlines()
                for name in re.findall(r"\b(\w+)\s*[,;]", line.split("//")[0])]
    assert declared == [name for name, _ in MultiParams._fields_]


def test_error_bits_match_the_header():
    header = (CU / "kv_types.cuh").read_text()
    assert f"kErrorQueryRange = {support.ERROR_QUERY_RANGE}u" in header


def test_shipped_variants_cover_the_matrix():
    from lowlevel_fd.multi.variants import MultiVariant
    variants = [v for v in shipped_variants() if isinstance(v, MultiVariant)]
    keys = {(v.head_dim, v.dtype, v.scale_mode, v.scale_dtype, v.paged, v.ksplit, v.wgmma,
             v.wg_rows, v.int8_q) for v in variants}
    # mma.sync: 3 head dims x 2 dtypes x 4 scale configurations x 2 storages x 2 KSPLITs;
    # wgmma: head_dim 64 and 128 x 2 x 4 x 2, CTAs of 128 and of 64 rows; int8 q: 2 x 2
    assert len(keys) == len(variants) == 3 * 2 * 4 * 2 * 2 + 2 * 2 * 4 * 2 * 2 + 2 * 2
    for v in variants:
        assert v.shared_bytes <= 227 * 1024
        if v.int8_q:
            assert (v.head_dim, v.scale_mode, v.paged, v.rows_per_cta, v.threads,
                    v.tile_tokens, v.source) == (128, "token", False, 64, 384, 64, "multi_q8.cu")
            assert re.fullmatch(r"llfd::multi_attend_q8<llfd::(f16|bf16), (float|uint16_t)>",
                                v.kernel)
            continue
        if v.wgmma:
            # 128 rows: a loading warpgroup and two computing ones; 64: one that does both
            assert v.rows_per_cta == v.wg_rows
            assert v.threads == (384 if v.wg_rows == 128 else 128)
            assert v.tile_tokens == 64
            # Two CTAs of 64 rows per SM: 228 KB per SM, 1 KB of it reserved per CTA.
            assert v.wg_rows == 128 or 2 * (v.shared_bytes + 1024) <= 228 * 1024
            suffix = "" if v.wg_rows == 128 else "64"
            assert v.source == f"multi_wg{suffix}.cu"
            assert re.fullmatch(rf"llfd::multi_attend_wg{suffix}<(64|128), \d, "
                                r"llfd::(f16|bf16), (float|uint16_t), (true|false)>", v.kernel)
            continue
        one_block = v.head_dim == 256 or v.ksplit > 1
        assert v.rows_per_cta == 16 * (1 if one_block else 2) * 4 // v.ksplit
        assert v.threads == 128 and v.source == "multi.cu"
        assert re.fullmatch(r"llfd::multi_attend<\d+, \d, llfd::(f16|bf16), (float|uint16_t), "
                            r"(true|false), [124]>", v.kernel)


def test_wgmma_shared_memory_matches_the_layout():
    """WgLayout: at 128 rows (multi_wg.cu) three 1 KB-aligned int8 stages, three widened tiles,
    two computing warpgroups' fp16 Q; at 64 rows (multi_wg64.cu) two stages and two widened
    tiles (Q staged in the second); 1 KB of alignment slack."""
    assert MultiVariant(128, wgmma=True).shared_bytes == 3 * 17408 + 3 * 33792 + 32768 + 1024
    assert MultiVariant(64, wgmma=True).shared_bytes == 3 * 9216 + 3 * 17408 + 16384 + 1024
    assert MultiVariant(128, wgmma=True, wg_rows=64).shared_bytes == 2 * 17408 + 2 * 33792 + 1024
    assert MultiVariant(64, wgmma=True, wg_rows=64).shared_bytes == 2 * 9216 + 2 * 17408 + 1024
    with pytest.raises(ValueError, match=r"^wg_rows: expected one of \(128, 64\), got 32$"):
        MultiVariant(128, wgmma=True, wg_rows=32)
