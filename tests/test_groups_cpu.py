"""Specification of how a query group of any size (1..128) is served, without a GPU: the
kernels' heads per CTA, the CTAs per KV head, and the heads each CTA owns."""
from __future__ import annotations

import ctypes

import pytest

from lowlevel_fd import DecodePlan, KVCacheSpec, TileConfig
from lowlevel_fd.core import support
from lowlevel_fd.decode.params import DecodeParams
from lowlevel_fd.decode.planner import check_config
from lowlevel_fd.decode.variants import (CTA_HEADS, MASKED_CTA_HEADS, DecodeVariant, head_chunks,
                                         shipped_variants)

from stand_ins import DEVICE

GROUPS = list(range(1, 17)) + [24, 32, 48, 64, 71, 128]


@pytest.mark.parametrize("group", support.GROUP_SIZES)
def test_every_group_is_covered_exactly_once_by_its_chunks(group):
    cta_heads, chunks, chunk_heads = head_chunks(group)
    assert cta_heads in CTA_HEADS and chunk_heads <= cta_heads
    covered = [min(chunk_heads, group - c * chunk_heads) for c in range(chunks)]
    assert sum(covered) == group and all(h >= 1 for h in covered)  # no empty CTA
    if group <= 16:  # one CTA of the next power of two
        assert chunks == 1 and cta_heads == 1 << (group - 1).bit_length()
    else:  # CTAs of 16, as few as possible; all but the last take ceil(group / chunks)
        assert cta_heads == 16 and chunks == -(-group // 16)
        assert covered[:-1] == [chunk_heads] * (chunks - 1) and chunk_heads == -(-group // chunks)


@pytest.mark.parametrize("group, expected", [
    (1, (1, 1, 1)), (3, (4, 1, 3)), (5, (8, 1, 5)), (7, (8, 1, 7)), (9, (16, 1, 9)),
    (16, (16, 1, 16)), (17, (16, 2, 9)), (24, (16, 2, 12)), (32, (16, 2, 16)),
    (71, (16, 5, 15)), (128, (16, 8, 16))])
def test_head_chunks_of_some_groups(group, expected):
    assert head_chunks(group) == expected


@pytest.mark.parametrize("group, cta_heads, expected", [
    (4, 8, (8, 1, 4)), (16, 8, (8, 2, 8)), (12, 4, (4, 3, 4)), (7, 2, (2, 4, 2)),
    (32, 16, (16, 2, 16))])
def test_a_tile_config_may_ask_for_other_ctas(group, cta_heads, expected):
    assert head_chunks(group, cta_heads) == expected


def test_groups_share_the_power_of_two_kernels():
    """The variant count does not grow with the groups: a power of two up to 16 has its exact
    kernel, every other group one of three masked ones (4, 8 or 16 heads per CTA)."""
    spec = KVCacheSpec(8, 128)
    planned = {group: DecodeVariant.planned(spec, group, "float16", TileConfig())
               for group in support.GROUP_SIZES}
    assert len({v.split_kernel for v in planned.values()}) == len(CTA_HEADS) + 3
    for group, variant in planned.items():
        assert variant.masked == (group not in CTA_HEADS)
        assert variant.cta_heads == (group if group in CTA_HEADS else head_chunks(group)[0])
    shipped = {(v.cta_heads, v.masked) for v in shipped_variants()
               if isinstance(v, DecodeVariant)}
    assert shipped == {(n, False) for n in CTA_HEADS} | {(n, True) for n in MASKED_CTA_HEADS}
    assert {(v.cta_heads, v.masked) for v in planned.values()} <= shipped


@pytest.mark.parametrize("group", GROUPS)
def test_decode_plan_takes_every_group(group):
    plan = DecodePlan.create(2 * group, 2, 128, max_batch=1, max_seq_len=64, device=DEVICE)
    assert plan.group_size == group
    cta_heads, chunks, _ = head_chunks(group)
    assert (plan.cta_heads, plan.head_chunks) == (cta_heads, chunks)


def test_groups_beyond_128_are_refused():
    with pytest.raises(ValueError, match=r"^group size \(num_q_heads // num_kv_heads\): "
                                         r"expected 1\.\.128, got 129$"):
        KVCacheSpec(1, 128).group_size(129)


@pytest.mark.parametrize("cta_heads", [3, 32, -1])
def test_tile_config_cta_heads_is_one_of_the_kernels(cta_heads):
    with pytest.raises(ValueError, match=r"^config\.cta_heads: expected one of "
                                         r"\[0, 1, 2, 4, 8, 16\], got"):
        check_config(TileConfig(cta_heads=cta_heads))


def test_decode_params_carry_the_group_after_the_append_fields():
    fields = dict((name, getattr(DecodeParams, name)) for name, _ in DecodeParams._fields_)
    assert fields["group_size"].offset == 272 and fields["head_chunks"].offset == 276
    assert fields["chunk_heads"].offset == 280 and ctypes.sizeof(DecodeParams) == 320
