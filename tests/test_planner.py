"""Specification of the split-KV planner (``decode.planner``) and of the decode variant set."""
from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowlevel_fd.core.spec import KVCacheSpec
from lowlevel_fd.core.support import DTYPES, HEAD_DIMS, WARP_COUNTS
from lowlevel_fd.decode import CombineVariant, DecodeVariant, shipped_variants
from lowlevel_fd.decode.planner import (CLUSTER_MAX_CTA_HEADS, DEFAULT_WARPS, MAX_CLUSTER,
                                        MAX_GLOBAL_SPLITS, MAX_PORTABLE_SPLITS,
                                        MAX_SPLIT_TOKENS, MAX_SPLITS,
                                        SPLIT_TOKENS, TileConfig, Workload, choose,
                                        default_min_split_tokens, routes_to_multi, split_tokens,
                                        workspace_pairs_bound)
from lowlevel_fd.decode.route import wants_multi
from lowlevel_fd.decode.variants import CTA_HEADS, MASKED_CTA_HEADS, head_chunks
from lowlevel_fd.decode.variants import LENGTHS as LENGTHS_PROGRAM

H100_SMS, A100_SMS = 132, 108
# Peak DRAM bandwidth as DeviceInfo computes it (memory clock x bus width x 2), bytes/s.
H100_BANDWIDTH, H200_BANDWIDTH = 3.352e12, 4.814e12
LENGTHS = (1, 15, 16, 127, 128, 129, 500, 1024, 2047, 4096, 8191, 32768, 131072)


def plan_for(batch: int, num_kv_heads: int, max_len: int, sm_count: int = H100_SMS,
             group_size: int = 4, **options) -> TileConfig:
    return choose(Workload(batch, num_kv_heads, max_len, sm_count, ctas_per_sm=2,
                           group_size=group_size), **options)


def splits(*args, **kwargs) -> int:
    return plan_for(*args, **kwargs).num_splits


# -- choose ------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch, num_kv_heads", [(64, 8), (17, 8), (132, 1), (256, 1)])
@pytest.mark.parametrize("max_len", [128, 1024, SPLIT_TOKENS * 2 - 1])
def test_one_split_when_the_pairs_fill_the_gpu_and_sequences_are_short(batch, num_kv_heads,
                                                                        max_len):
    # 17 x 8 = 136 (sequence, kv head) pairs already give each of the 132 SMs a CTA.
    assert splits(batch, num_kv_heads, max_len) == 1


@pytest.mark.parametrize("batch, num_kv_heads", [(64, 8), (17, 8), (256, 1)])
@pytest.mark.parametrize("max_len", LENGTHS)
def test_with_many_pairs_splits_stay_long(batch, num_kv_heads, max_len):
    count = splits(batch, num_kv_heads, max_len)
    assert count == 1 or count * SPLIT_TOKENS <= max_len


@pytest.mark.parametrize("num_kv_heads", [1, 2, 8])
@pytest.mark.parametrize("max_len", [8192, 32768, 131072])
def test_a_single_long_sequence_is_split_to_fill_the_gpu(num_kv_heads, max_len):
    config = plan_for(1, num_kv_heads, max_len)
    count = config.num_splits
    assert count > 1
    # At least half the SMs busy (splits round down to a power of two), unless the cap on
    # splits or, past 8 global splits, two tiles per warp per split is what limits them.
    by_length = 1 << ((max_len // (2 * config.min_split_tokens)).bit_length() - 1)
    assert num_kv_heads * count >= H100_SMS // 2 or count in (
        MAX_PORTABLE_SPLITS, MAX_GLOBAL_SPLITS, by_length)


@pytest.mark.parametrize("num_warps", [2, 4, 8])
@pytest.mark.parametrize("max_len", [1, 16, 32])
def test_short_sequences_are_never_split(num_warps, max_len):
    assert splits(1, 1, max_len, num_warps=num_warps) == 1  # below min_split_tokens


@pytest.mark.parametrize("num_warps", [2, 4, 8])
@pytest.mark.parametrize("min_split_tokens", [None, 16, 256])
@pytest.mark.parametrize("batch", [1, 4, 64])
@pytest.mark.parametrize("max_len", LENGTHS)
def test_no_split_is_shorter_than_min_split_tokens(num_warps, min_split_tokens, batch, max_len):
    config = plan_for(batch, 1, max_len, num_warps=num_warps, min_split_tokens=min_split_tokens)
    minimum = min_split_tokens or default_min_split_tokens(num_warps)
    assert config.min_split_tokens == minimum
    # Every split but the last gets at least `minimum` tokens (the kernel rounds up to it).
    assert (config.num_splits - 1) * minimum < max(max_len, 1)


@pytest.mark.parametrize("sm_count", [H100_SMS, A100_SMS, 1000])
@pytest.mark.parametrize("batch", [1, 2, 600])
@pytest.mark.parametrize("group_size", [1, 16])
@pytest.mark.parametrize("clusters", [False, True])
def test_never_more_than_the_split_cap(sm_count, batch, group_size, clusters):
    config = plan_for(batch, 1, 2**30, sm_count, group_size, min_split_tokens=16,
                      clusters=clusters)
    few_pairs = 2 * batch <= sm_count
    if config.cluster or not few_pairs:  # a portable cluster, or enough pairs to fill the GPU
        assert config.num_splits == MAX_PORTABLE_SPLITS
    else:  # few pairs merged through global memory: as many as fill the SMs, up to the cap
        power = 1 << ((sm_count // batch).bit_length() - 1)
        assert config.num_splits == max(MAX_PORTABLE_SPLITS, min(power, MAX_GLOBAL_SPLITS))
        assert batch * config.num_splits <= max(sm_count, MAX_PORTABLE_SPLITS * batch)


@pytest.mark.parametrize("max_len, expected", [(1024, 8), (4096, 16), (8192, 32), (32768, 64)])
def test_global_splits_past_eight_keep_two_tiles_per_warp(max_len, expected):
    config = plan_for(1, 1, max_len, H100_SMS, 16, clusters=True)  # group 16: global merge
    assert not config.cluster and config.num_splits == expected
    if expected > MAX_PORTABLE_SPLITS:
        assert max_len // config.num_splits >= 2 * config.min_split_tokens


@pytest.mark.parametrize("batch, max_len", [(1, 2**20), (1, 4096), (4, 65536), (64, 65536),
                                            (1, 64)])
def test_cluster_merges_only_when_split_and_within_a_cluster(batch, max_len):
    config = plan_for(batch, 1, max_len, clusters=True)
    assert config.num_splits <= MAX_CLUSTER
    assert config.cluster == (config.num_splits > 1)
    assert not plan_for(batch, 1, max_len, clusters=False).cluster


@pytest.mark.parametrize("batch, num_kv_heads, group_size",
                         list(itertools.product((1, 2, 5, 64), (1, 8), (4, 16))))
def test_splits_grow_monotonically_with_length(batch, num_kv_heads, group_size):
    counts = [splits(batch, num_kv_heads, n, group_size=group_size)
              for n in range(1, 131073, 97)]
    assert counts == sorted(counts)


def test_the_split_length_grows_with_memory_bandwidth():
    assert split_tokens(0) == split_tokens(H100_BANDWIDTH) == split_tokens(2.0e12) == SPLIT_TOKENS
    assert split_tokens(H200_BANDWIDTH) == 1449  # 1024 x 4.814 / 3.4
    assert split_tokens(1e15) == MAX_SPLIT_TOKENS


def h200_splits(batch: int, max_len: int, num_kv_heads: int = 8) -> int:
    return choose(Workload(batch, num_kv_heads, max_len, H100_SMS, 0, 4, 128, H200_BANDWIDTH),
                  clusters=True).num_splits


# Hkv 8, group 4: the fastest split count measured on an H200 (PERF_NOTES v36), uniform and
# ragged lengths; 20 and 24 are the wave guard's (2 splits leave 56 / 120 CTAs in a last wave).
@pytest.mark.parametrize("batch, max_len, expected", [
    (16, 4096, 2), (20, 4096, 4), (24, 4096, 4), (32, 2048, 1), (32, 4096, 2), (48, 4096, 2),
    (64, 2048, 1), (64, 8192, 4), (96, 4096, 2), (128, 2048, 1), (128, 8192, 4), (8, 4096, 2)])
def test_faster_memory_takes_longer_splits_as_measured_on_the_h200(batch, max_len, expected):
    assert h200_splits(batch, max_len) == expected


def h200_plan(batch: int, max_len: int, num_kv_heads: int = 8, head_dim: int = 128,
              group_size: int = 4) -> tuple[int, bool]:
    config = choose(Workload(batch, num_kv_heads, max_len, H100_SMS, 0, group_size, head_dim,
                             H200_BANDWIDTH), clusters=True)
    return config.num_splits, config.cluster


# Few pairs on the H200 (PERF_NOTES v37, tools/results/sweep_splits_*_h200.json): the fastest
# count and merge measured, or within 2% of it.
@pytest.mark.parametrize("batch, max_len, head_dim, expected", [
    (1, 4096, 128, (8, True)),     # 256-token splits at one CTA per SM: the merge's latency
    (1, 16384, 128, (16, False)),  # one CTA per SM, global merge
    (2, 1024, 128, (4, True)), (2, 12000, 128, (8, False)), (2, 24000, 256, (8, False)),
    (3, 3000, 128, (4, True)),     # 96 CTAs in clusters of 4 spread one per SM
    (3, 12000, 128, (8, True)), (6, 24000, 128, (4, True)),  # a quarter idle: twice the CTAs
    (6, 24000, 256, (2, True)),    # ... unless that takes a second wave (one CTA per SM)
    (4, 1024, 128, (2, True)), (4, 16384, 128, (4, False)), (4, 3000, 64, (4, False)),
    (8, 32768, 128, (2, True))])   # clusters of 2 spread at any count
def test_few_pairs_on_the_h200_fill_the_sms_without_doubled_up_clusters(batch, max_len,
                                                                          head_dim, expected):
    assert h200_plan(batch, max_len, head_dim=head_dim) == expected


def test_few_pairs_on_the_h200_keep_the_group_rule_and_the_global_cap():
    assert h200_plan(4, 16384, group_size=16) == (4, False)  # groups over 8: global anyway
    assert h200_plan(1, 32768, num_kv_heads=1)[0] == 8  # 128 splits would be 256 tokens each
    assert h200_plan(1, 131072, num_kv_heads=1) == (MAX_GLOBAL_SPLITS, False)


# Many pairs: head_dims 64 and 256 take twice head_dim 128's split length on faster memory only.
@pytest.mark.parametrize("batch, max_len, head_dim, expected", [
    (64, 8192, 64, 2), (64, 8192, 128, 4), (64, 8192, 256, 2), (32, 4096, 64, 1),
    (32, 4096, 256, 1), (16, 16384, 64, 4)])
def test_head_dims_64_and_256_take_longer_splits_on_the_h200(batch, max_len, head_dim, expected):
    assert h200_plan(batch, max_len, head_dim=head_dim)[0] == expected
    assert split_tokens(H100_BANDWIDTH, head_dim) == SPLIT_TOKENS


@pytest.mark.parametrize("batch", [1, 2, 9, 17, 20, 24, 33, 40, 64, 100, 128])
@pytest.mark.parametrize("num_kv_heads", [1, 8])
@pytest.mark.parametrize("max_len", LENGTHS)
def test_the_h100s_choices_ignore_a_known_bandwidth_and_the_wave_guard_keeps_splits_long(
        batch, num_kv_heads, max_len):
    for group_size, clusters, head_dim in itertools.product((4, 16), (False, True),
                                                            (64, 128, 256)):
        known = choose(Workload(batch, num_kv_heads, max_len, H100_SMS, 0, group_size,
                                head_dim, H100_BANDWIDTH), clusters=clusters)
        assert known == choose(Workload(batch, num_kv_heads, max_len, H100_SMS, 0, group_size,
                                        head_dim), clusters=clusters)
    count = h200_splits(batch, max_len, num_kv_heads)
    if 2 * batch * num_kv_heads > H100_SMS:  # rule 3, guard included
        assert count == 1 or count * SPLIT_TOKENS <= max_len


@pytest.mark.parametrize("num_warps", [2, 4, 8])
def test_choose_passes_its_tile_settings_through(num_warps):
    config = plan_for(1, 8, 4096, num_warps=num_warps, fused_merge=False, stages=3)
    assert isinstance(config, TileConfig)
    assert (config.num_warps, config.fused_merge, config.stages) == (num_warps, False, 3)
    assert config.min_split_tokens == default_min_split_tokens(num_warps)


# -- workspace bound ---------------------------------------------------------------------------
@pytest.mark.parametrize("sm_count", [H100_SMS, A100_SMS, 16])
@pytest.mark.parametrize("num_kv_heads", [1, 8, 32])
@pytest.mark.parametrize("max_batch", [1, 7, 64])
def test_workspace_bound_covers_every_batch_and_length(sm_count, num_kv_heads, max_batch):
    bound = workspace_pairs_bound(max_batch, num_kv_heads, sm_count)
    for batch, max_len, group_size in itertools.product(
            range(1, max_batch + 1), (1, 200, 4096, 131072), (1, 16)):
        used = batch * num_kv_heads * splits(batch, num_kv_heads, max_len, sm_count, group_size)
        assert used <= bound, (batch, max_len, group_size)


@settings(max_examples=300, deadline=None)
@given(max_batch=st.integers(1, 512), batch_fraction=st.floats(0, 1),
       num_kv_heads=st.sampled_from([1, 2, 4, 8, 16, 32, 64]), sm_count=st.integers(1, 200),
       group_size=st.sampled_from(CTA_HEADS), max_len=st.integers(0, 131072),
       num_warps=st.sampled_from([2, 4, 8]), clusters=st.booleans())
def test_workspace_bound_property(max_batch, batch_fraction, num_kv_heads, sm_count, group_size,
                                  max_len, num_warps, clusters):
    batch = max(1, round(batch_fraction * max_batch))
    config = plan_for(batch, num_kv_heads, max_len, sm_count, group_size, num_warps=num_warps,
                      clusters=clusters)
    assert 1 <= config.num_splits <= MAX_SPLITS
    assert batch * num_kv_heads * config.num_splits <= workspace_pairs_bound(
        max_batch, num_kv_heads, sm_count)


# -- variants ----------------------------------------------------------------------------------
def test_variant_names_are_the_template_instantiations():
    # <head_dim, heads per CTA, warps, scale mode id, q type, scale type, stages, cluster,
    #  tiles, append, masked, paged>
    variant = DecodeVariant(128, 4, "float16", "token", "float32", num_warps=4)
    assert variant.split_kernel == ("llfd::decode_split<128, 4, 4, 2, llfd::f16, float, 2, "
                                    "false, 1, false, false, false>")
    assert variant.kernel_names == (variant.split_kernel,), "the split kernel alone"
    # The merge is a program of its own, one per (head_dim, heads per CTA, dtype, masked).
    assert CombineVariant(128, 4, "float16").kernel_names == (
        "llfd::decode_combine<128, 4, llfd::f16, false>",)
    bf16 = DecodeVariant(64, 8, "bfloat16", "token", "float16", num_warps=8)
    assert bf16.split_kernel.startswith("llfd::decode_split<64, 8, 8, 2, llfd::bf16, ")
    assert bf16.kernel_names == (bf16.split_kernel,)
    assert CombineVariant(64, 8, "bfloat16").kernel_names == (
        "llfd::decode_combine<64, 8, llfd::bf16, false>",)
    # A group other than the CTA's heads (masked heads or head chunks): its own instantiations.
    masked = DecodeVariant(64, 8, "bfloat16", "token", "float16", num_warps=8, masked=True)
    assert masked.split_kernel == bf16.split_kernel[:-len("false, false>")] + "true, false>"
    # Over a paged cache (the last template argument).
    paged = DecodeVariant(64, 8, "bfloat16", "token", "float16", num_warps=8, paged=True)
    assert paged.split_kernel == bf16.split_kernel[:-len("false>")] + "true>"
    assert CombineVariant(64, 8, "bfloat16", True).kernel_names == (
        "llfd::decode_combine<64, 8, llfd::bf16, true>",)
    fp32_scales = DecodeVariant(64, 8, "bfloat16", "token", "float32", num_warps=8)
    assert bf16.split_kernel != fp32_scales.split_kernel
    # So is the length bump of the fused step: one kernel for every variant.
    assert LENGTHS_PROGRAM.kernel_names == ("llfd::advance_lengths",)


def test_variant_defaults_to_the_planners_warps():
    assert DEFAULT_WARPS == 8 and TileConfig().num_warps == DEFAULT_WARPS
    variant = DecodeVariant(128, 4)
    assert variant.num_warps == DEFAULT_WARPS and variant.threads == 32 * DEFAULT_WARPS
    assert variant.split_kernel.startswith("llfd::decode_split<128, 4, 8, 2, llfd::f16, float, ")
    assert (variant.dtype, variant.scale_mode, variant.scale_dtype) == ("float16", "token",
                                                                       "float32")


@pytest.mark.parametrize("mode, mode_id", [("tensor", 0), ("head", 1)])
def test_static_scales_are_always_float32(mode, mode_id):
    variant = DecodeVariant(256, 2, "float16", mode, "float16")  # 8 warps: the default
    assert variant.split_kernel.startswith(f"llfd::decode_split<256, 2, 8, {mode_id}, llfd::f16, "
                                           f"float, ")
    assert variant.split_kernel == DecodeVariant(256, 2, "float16", mode, "float32").split_kernel


SM80_SHARED_OPTIN, SM90_SHARED_OPTIN = 163 * 1024, 227 * 1024
ALL_WARP_VARIANTS = [v for v in shipped_variants(WARP_COUNTS) if isinstance(v, DecodeVariant)]


@pytest.mark.parametrize("variant", ALL_WARP_VARIANTS, ids=lambda v: v.split_kernel)
def test_variant_launch_shape_fits_the_gpus(variant):
    assert variant.threads == 32 * variant.num_warps
    # The shared memory holds each warp's fp32 partial outputs for the in-CTA merge.
    partials = variant.num_warps * variant.cta_heads * variant.head_dim * 4
    assert variant.dynamic_shared_bytes >= partials
    assert variant.dynamic_shared_bytes <= SM90_SHARED_OPTIN
    if variant.num_warps == DEFAULT_WARPS:  # the default the plan picks must also run on sm_80
        assert variant.dynamic_shared_bytes <= SM80_SHARED_OPTIN


def test_every_planned_variant_is_shipped():
    """Whatever the planner picks (any group, batch, length, SM count and bandwidth, on
    sm_90) is a program `compile` builds ahead of time and CI compiles."""
    shipped = {v for v in shipped_variants() if isinstance(v, DecodeVariant)}
    picked = set()
    for group, batch, length, sms, bandwidth in itertools.product(
            (1, 3, 4, 8, 12, 16, 32, 64), (1, 2, 8, 64), (64, 1024, 32768), (16, 132),
            (0.0, 4.8e12)):
        cta_heads, chunks, _ = head_chunks(group)
        config = choose(Workload(batch, 8 * chunks, length, sms, 0, cta_heads, 128, bandwidth),
                        clusters=True)
        picked.add((group, config))
    for (group, config), append, paged in itertools.product(picked, (False, True),
                                                           (False, True)):
        spec = (KVCacheSpec(8, 128, kv_layout="hnd", page_size=16) if paged
                else KVCacheSpec(8, 128))
        variant = DecodeVariant.planned(spec, group, "float16", config, append=append)
        assert variant in shipped, variant
    assert any(c.cluster for _, c in picked) and any(c.tiles == 2 for _, c in picked)


@pytest.mark.parametrize("num_warps", [(8,), (2, 4, 8)])
def test_shipped_variants_cover_the_support_matrix_once(num_warps):
    programs = list(shipped_variants(num_warps))
    assert len(set(programs)) == len(programs)
    # Every kernel is in exactly one program: compiling them all builds each kernel once.
    kernels = [name for program in programs for name in program.kernel_names]
    assert len(set(kernels)) == len(kernels)
    variants = [v for v in programs if isinstance(v, DecodeVariant)]
    assert all(v.kernel_names == (v.split_kernel,) for v in variants)
    # The merges, one per (head_dim, heads per CTA, dtype), exact and, for MASKED_CTA_HEADS,
    # masked, and the length bump, once: the programs are per kernel GROUP (CTA_HEADS), never
    # per query group (1..128).
    assert CTA_HEADS == (1, 2, 4, 8, 16) and MASKED_CTA_HEADS == (4, 8, 16)
    kinds = [(g, False) for g in CTA_HEADS] + [(g, True) for g in MASKED_CTA_HEADS]
    combines = [v for v in programs if isinstance(v, CombineVariant)]
    assert sorted((c.head_dim, c.cta_heads, c.dtype, c.masked) for c in combines) == sorted(
        (d, g, q, m) for d, (g, m), q in itertools.product(HEAD_DIMS, kinds, DTYPES))
    assert len(combines) == len(HEAD_DIMS) * len(kinds) * len(DTYPES)
    assert [v for v in programs if v is LENGTHS_PROGRAM] == [LENGTHS_PROGRAM]
    assert len(programs) == len(variants) + len(combines) + 1
    assert all(v.scale_dtype == "float32" for v in variants if v.scale_mode != "token")
    # Per head_dim, heads per CTA (exact or masked), q dtype and warp count: tensor, head,
    # token fp32, token fp16 scales, each with a global merge and, where the planner picks
    # one (at most CLUSTER_MAX_CTA_HEADS heads per CTA), a cluster merge.
    single = {(v.head_dim, v.cta_heads, v.masked, v.dtype, v.scale_mode, v.scale_dtype,
               v.num_warps, v.cluster) for v in variants if v.tiles == 1}
    modes = (("tensor", "float32"), ("head", "float32"), ("token", "float32"),
             ("token", "float16"))
    expected = {(d, g, m, q, mode, sd, w, cluster)
                for d, (g, m), q, w in itertools.product(HEAD_DIMS, kinds, DTYPES, num_warps)
                for mode, sd in modes for cluster in (False, True)
                if g <= CLUSTER_MAX_CTA_HEADS or not cluster}
    assert single == expected
    # Planner rule 7's two-tile variants: head_dim 128, up to 8 heads per CTA, cluster merge.
    double = {(v.head_dim, v.cta_heads, v.masked, v.dtype, v.scale_mode, v.scale_dtype,
               v.num_warps, v.cluster) for v in variants if v.tiles == 2}
    assert double == {(128, g, m, q, mode, sd, w, True)
                      for (_, g, m, q, mode, sd, w, _) in expected if g <= 8}
    assert {v.tiles for v in variants} == {1, 2}
    # Each split variant also with the fused append of append_and_run.
    assert {replace(v, append=not v.append) for v in variants} == set(variants)
    assert DecodeVariant(128, 4, "float16", "token", "float32", 8) in variants


@pytest.mark.parametrize("batch, max_len, head_dim, group_size, clusters, tiles", [
    (1, 32768, 128, 4, True, 2),     # 64 CTAs, 4096-token splits: rule 7
    (1, 16384, 128, 4, True, 2),     # 2048-token splits
    (1, 8192, 128, 4, True, 2),      # 1024-token splits: the threshold
    (1, 4096, 128, 4, True, 1),      # 512-token splits: too short
    (2, 32768, 128, 4, True, 1),     # 128 CTAs: more than half the SMs
    (1, 32768, 64, 4, True, 1),      # not measured at head_dim 64
    (1, 32768, 128, 16, True, 1),    # group 16 merges globally
    (1, 32768, 128, 4, False, 1),    # no clusters (before sm_90)
])
def test_two_tiles_only_for_few_ctas_with_long_splits(batch, max_len, head_dim, group_size,
                                                       clusters, tiles):
    config = choose(Workload(batch, 8, max_len, 132, 0, group_size, head_dim), clusters=clusters)
    assert config.tiles == tiles
    assert config.min_split_tokens == 16 * config.num_warps * tiles
    assert max_len // config.num_splits >= config.min_split_tokens
    if tiles == 2:
        assert 2 * batch * 8 * config.num_splits <= 132 and config.cluster


class _Device:
    def __init__(self, capability: tuple[int, int]) -> None:
        self.compute_capability = capability


MIB = 1 << 20


@pytest.mark.parametrize("group, head_dim, chunks, kv_mib, pairs, routed", [
    (64, 128, 4, 16, 1, True),      # 3+ chunks from 16 MiB
    (64, 128, 4, 8, 32, False),     # ... not at 8 (B=32 S=1024: decode 12.2 us, multi 19.3)
    (48, 64, 3, 16, 64, True),
    (128, 128, 8, 8, 8, False),
    (32, 128, 2, 64, 32, True),     # 2 chunks: 64 MiB over >= 32 pairs
    (32, 128, 2, 64, 16, False),    # B=16 S=16384: decode 39.9 us, multi 42.3
    (32, 128, 2, 33, 128, False),
    (16, 128, 1, 128, 128, True),   # 1 chunk: 64 MiB over >= 96 pairs
    (16, 128, 1, 128, 32, False),   # B=32 S=16384: decode 57.2 us, multi 59.2
    (8, 128, 1, 1024, 1024, False),  # decode's own groups never leave it
    (64, 256, 4, 1024, 128, False),  # head_dim 256: not measured
])
def test_rule_8_routes_large_groups_over_large_caches(group, head_dim, chunks, kv_mib, pairs,
                                                      routed):
    assert routes_to_multi(group, head_dim, chunks, kv_mib * MIB, pairs, True) is routed
    assert routes_to_multi(group, head_dim, chunks, kv_mib * MIB, pairs, False) is False


def test_wants_multi_follows_the_rule_unless_forced_or_configured():
    spec = KVCacheSpec(1, 128)
    hopper, ampere = _Device((9, 0)), _Device((8, 0))
    lengths = np.full(8, 8192)  # 16 MiB of int8 K and V
    assert wants_multi(None, spec, 64, 4, lengths, hopper, False)
    assert not wants_multi(None, spec, 64, 4, lengths, ampere, False)
    assert not wants_multi(None, spec, 64, 4, lengths, hopper, True)  # a TileConfig: decode
    assert not wants_multi(None, spec, 64, 4, lengths // 2, hopper, False)
    assert wants_multi(True, spec, 3, 1, lengths[:1], ampere, False)
    assert not wants_multi(False, spec, 64, 4, lengths, hopper, False)
    with pytest.raises(ValueError, match="multi: a TileConfig plans the decode kernel"):
        wants_multi(True, spec, 64, 4, lengths, hopper, True)
    with pytest.raises(TypeError, match="multi"):
        wants_multi(1, spec, 64, 4, lengths, hopper, False)
    with pytest.raises(ValueError, match="at most 65535 sequences"):
        wants_multi(True, spec, 64, 4, np.ones(65536, np.int64), hopper, False)


def test_the_route_table_is_the_theta_path_of_the_kernels():
    """decode/route.py theta_table: fp32 inv_freq, fp32 angle pos * inv_freq, cos and sin of
    that angle (rows.cuh rope_coefficients' theta path): position 0 is the identity, and every
    entry is within 1e-6 of cos/sin of the fp32 angle and within the fp32 angle's rounding
    (<= 2 pos 2^-24 rad: inv_freq and the angle) of the float64 table."""
    from lowlevel_fd.decode.route import theta_table
    from lowlevel_fd.reference import rope_table
    spec = KVCacheSpec(2, 64, rope="neox", rope_theta=500000.0)
    table = theta_table(spec, 4096)
    assert table.shape == (4096, 32, 2) and table.dtype == np.float32
    assert (table[0, :, 0] == 1).all() and (table[0, :, 1] == 0).all()
    inv = np.exp2(-2.0 * np.arange(32) / 64 * np.log2(500000.0)).astype(np.float32)
    angle = (np.float32(4095) * inv).astype(np.float64)
    np.testing.assert_allclose(table[4095, :, 0], np.cos(angle), atol=1e-6)
    np.testing.assert_allclose(table[4095, :, 1], np.sin(angle), atol=1e-6)
    exact = rope_table(4096, 64, 500000.0)
    assert np.abs(table - exact).max() <= 2 * 4096 * 2.0**-24 + 1e-6  # inv_freq and angle
