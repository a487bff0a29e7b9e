"""Every query-group size on the GPU: decode attention, the fused append and DecodeStep for
groups 1 to 16 and 24, 32, 48, 64, 71, 128 (one CTA of the next power of two, or chunks of
16 heads per KV head), against the float64 oracle, over every merge path."""
from __future__ import annotations

import numpy as np
import pytest
from decode_case import Case
from test_fused_append_gpu import Fused

from lowlevel_fd import DecodeStep, LayerBuffers, TileConfig
from lowlevel_fd.decode.variants import head_chunks
from lowlevel_fd.driver import DeviceArray, dtypes

pytestmark = pytest.mark.gpu

GROUPS = list(range(1, 17)) + [24, 32, 48, 64, 71, 128]
LENGTHS = [0, 37, 1000, 2049]  # an empty row, a partial tile, a split edge, odd and long
CONFIGS = {
    "planner": None,
    "global merge s5": TileConfig(num_warps=8, num_splits=5, min_split_tokens=128),
    "combine kernel s3": TileConfig(num_warps=4, num_splits=3, min_split_tokens=64,
                                    fused_merge=False),
    "cluster s4": TileConfig(num_warps=8, num_splits=4, min_split_tokens=128, cluster=True),
    "one split": TileConfig(num_warps=8, num_splits=1, min_split_tokens=128),
}


def heads(group: int) -> tuple[int, int]:
    """(Hq, Hkv): two KV heads for the groups one CTA holds, one (multi-query) beyond."""
    kv_heads = 2 if group <= 16 else 1
    return group * kv_heads, kv_heads


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("group", GROUPS)
def test_decode_matches_the_oracle_for_every_group(rng, stream, group, config):
    hq, hkv = heads(group)
    case = Case.random(rng, LENGTHS, num_q_heads=hq, num_kv_heads=hkv, capacity=2050)
    plan = case.make_plan(max_batch=4)
    case.check(*case.run(plan, stream, config=config))
    cta_heads, chunks, _ = head_chunks(group)
    described = plan.describe()
    assert (described["cta_heads"], described["head_chunks"]) == (cta_heads, chunks)
    assert described["grid"][0] == hkv * chunks
    assert plan.error_flags(stream=stream) == 0
    plan.close()


# (group, head_dim, kv_layout, scale_mode, scale_dtype, dtype)
MATRIX = [
    (3, 64, "bsnh", "token", "float16", "bfloat16"),
    (5, 256, "bnsh", "head", "float32", "float16"),
    (6, 128, "bsnh", "tensor", "float32", "bfloat16"),
    (7, 64, "bnsh", "token", "float32", "float16"),
    (12, 256, "bsnh", "token", "float16", "float16"),
    (24, 64, "bnsh", "token", "float32", "bfloat16"),
    (71, 128, "bsnh", "head", "float32", "float16"),
    (128, 256, "bnsh", "token", "float32", "float16"),
]


@pytest.mark.parametrize("group, head_dim, kv_layout, scale_mode, scale_dtype, dtype", MATRIX)
def test_groups_across_the_support_matrix(rng, stream, group, head_dim, kv_layout, scale_mode,
                                          scale_dtype, dtype):
    hq, hkv = heads(group)
    case = Case.random(rng, [513, 0, 77], num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                       kv_layout=kv_layout, scale_mode=scale_mode, scale_dtype=scale_dtype,
                       dtype=dtype, capacity=516)
    plan = case.make_plan(max_batch=3)
    case.check(*case.run(plan, stream))
    plan.close()


@pytest.mark.parametrize("group, cta_heads", [(4, 8), (4, 16), (16, 8), (16, 4), (7, 2),
                                              (12, 4), (3, 1), (32, 8)])
def test_a_tile_config_may_split_a_group_into_smaller_ctas(rng, stream, group, cta_heads):
    hq, hkv = heads(group)
    case = Case.random(rng, [0, 300, 1029], num_q_heads=hq, num_kv_heads=hkv, capacity=1030)
    plan = case.make_plan(max_batch=3)
    for config in (TileConfig(num_splits=3, min_split_tokens=128, cta_heads=cta_heads),
                   TileConfig(num_splits=2, min_split_tokens=128, cluster=True,
                              cta_heads=cta_heads),
                   TileConfig(num_warps=4, num_splits=4, min_split_tokens=64, fused_merge=False,
                              cta_heads=cta_heads)):
        case.check(*case.run(plan, stream, config=config))
        assert plan.describe()["head_chunks"] == -(-group // cta_heads)
    plan.close()


FUSED_GROUPS = [1, 3, 5, 6, 7, 9, 12, 16, 24, 32, 71, 128]


@pytest.mark.parametrize("config", [None, CONFIGS["global merge s5"],
                                    CONFIGS["combine kernel s3"]],
                         ids=["planner", "global merge s5", "combine kernel s3"])
@pytest.mark.parametrize("group", FUSED_GROUPS)
def test_append_and_run_for_every_group(rng, stream, group, config):
    """Every chunk of a KV head's query heads attends the new token; only the first writes it:
    the cache bytes are checked against the host mirror."""
    hq, hkv = heads(group)
    fused = Fused(rng, [0, 63, 1024, 2047], capacity=2050, rope="neox", table=group % 2 == 1,
                  num_q_heads=hq, num_kv_heads=hkv)
    fused.check(*fused.run(stream, config))
    assert fused.plan.error_flags(stream=stream) == 0
    fused.plan.close()


@pytest.mark.parametrize("group", [3, 24])
def test_decode_step_for_other_groups_equals_append_and_run_per_layer(rng, stream, group):
    """DecodeStep's graph and its eager launches give bitwise what per-layer append_and_run and
    one advance_lengths give (append_and_run is checked against the oracle above)."""
    layers, steps, head_dim, capacity = 3, 4, 128, 130
    hq, hkv = heads(group)
    lengths = np.array([5, 97], np.int32)
    fp16 = dtypes.as_dtype("float16")
    shape = (2, hkv, capacity, head_dim)

    def fresh_layers():
        state = np.random.default_rng(7)
        return [LayerBuffers(
            q=DeviceArray.from_numpy(state.standard_normal((2, hq, head_dim)).astype(fp16)),
            k_new=DeviceArray.from_numpy(state.standard_normal((2, hkv, head_dim)).astype(fp16)),
            v_new=DeviceArray.from_numpy(state.standard_normal((2, hkv, head_dim)).astype(fp16)),
            k_cache=DeviceArray.from_numpy(state.integers(-127, 128, shape, dtype=np.int8)),
            v_cache=DeviceArray.from_numpy(state.integers(-127, 128, shape, dtype=np.int8)),
            k_scale=DeviceArray.full((2, hkv, capacity), 0.01, np.float32),
            v_scale=DeviceArray.full((2, hkv, capacity), 0.01, np.float32),
            out=DeviceArray.empty((2, hq, head_dim), fp16)) for _ in range(layers)]

    outputs = {}
    for mode in ("graph", "eager", "per layer"):
        buffers, seq_lens = fresh_layers(), DeviceArray.from_numpy(lengths)
        step = DecodeStep.create(layers, hq, hkv, head_dim, max_batch=2, max_seq_len=capacity,
                                 rope="neox").plan(lengths)
        graph = step.capture(buffers, seq_lens, stream) if mode == "graph" else None
        for _ in range(steps):
            if graph is not None:
                graph.launch(stream)
            elif mode == "eager":
                step.eager(buffers, seq_lens, stream)
            else:
                for index, b in enumerate(buffers):
                    step.attention.append_and_run(
                        b.q, b.k_new, b.v_new, b.k_cache, b.v_cache, b.k_scale, b.v_scale,
                        seq_lens, b.out, early_reads=index > 0, stream=stream)
                step.attention.advance_lengths(seq_lens, capacity, stream=stream)
        stream.synchronize()
        outputs[mode] = ([b.out.numpy().view(np.uint16) for b in buffers]
                         + [b.k_cache.numpy() for b in buffers] + [seq_lens.numpy()])
        assert step.error_flags(stream=stream) == 0
        if graph is not None:
            graph.close()
        step.close()
    assert np.array_equal(outputs["per layer"][-1], lengths + steps)
    for mode in ("graph", "eager"):
        for got, want in zip(outputs[mode], outputs["per layer"]):
            assert np.array_equal(got, want), mode
