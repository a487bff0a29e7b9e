"""MultiPlan with a tree mask (speculative trees) on the GPU against the float64 oracle: random
draft trees over ragged chunks (empty and one-token chunks, more than 32 drafts), causal and
not, arbitrary masks, KV splits and several row tiles, contiguous and paged, a full lower
triangle bitwise equal to the causal run, graph replay after the mask is rewritten, and the
plan's rules (tree=True picks the split-warp kernel)."""
from __future__ import annotations

import numpy as np
import pytest
from multi_case import TOLERANCE, MultiCase, relative_error

from lowlevel_fd.driver import DeviceArray, capture
from lowlevel_fd.reference_multi import multi_token_attention_ref

pytestmark = pytest.mark.gpu


def tree_mask(rng, qo_lens: list[int], words: int, *, arbitrary: bool = False) -> np.ndarray:
    """Packed rows [total_q, words]: per chunk a random tree (each draft under an earlier one
    or a root) as ancestors + self, or (arbitrary) random bits anywhere in the chunk."""
    rows = []
    for n in qo_lens:
        bits = np.zeros((n, 32 * words), bool)
        for i in range(n):
            if arbitrary:
                bits[i, :n] = rng.random(n) < 0.5
            else:
                parent = int(rng.integers(-1, i)) if i else -1
                if parent >= 0:
                    bits[i] = bits[parent]
                bits[i, i] = True
        rows.append(bits)
    return pack(np.concatenate(rows), words)


def pack(bits: np.ndarray, words: int) -> np.ndarray:
    """bool [rows, 32 * words] -> uint32 [rows, words], bit j of a row in word j // 32."""
    weights = np.uint64(1) << np.arange(32, dtype=np.uint64)
    return (bits.reshape(len(bits), words, 32).astype(np.uint64) * weights).sum(-1).astype(
        np.uint32)


def check(case: MultiCase, mask: np.ndarray, causal: bool) -> None:
    h = case.host
    ref_out, ref_lse = multi_token_attention_ref(
        h["q"], case.indptr, h["k_cache"], h["v_cache"], h["k_scale"], h["v_scale"],
        h["seq_lens"], scale_mode=case.scale_mode, causal=causal, tree_mask=mask)
    out, lse = case.device["out"].numpy(), case.device["lse"].numpy()
    err = relative_error(out, ref_out)
    assert err <= TOLERANCE[case.dtype], f"out: relative error {err:.2e}"
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=2e-3)


QO = [4, 1, 0, 37, 9]          # drafts: a lone token, an empty row, 37 (two mask words)
KV = [300, 1, 10, 37, 2100]    # a fresh tree (no prefix) and a long prefix (KV splits)


@pytest.mark.parametrize("head_dim, dtype, scale_mode, scale_dtype, layout, page", [
    (128, "float16", "token", "float32", "bnsh", None),
    (64, "bfloat16", "head", "float32", "hnd", 16),
    (256, "float16", "token", "float16", "nhd", 1),
    (128, "bfloat16", "tensor", "float32", "bsnh", None),
])
@pytest.mark.parametrize("causal, arbitrary", [(True, False), (False, False), (False, True)])
def test_tree_masks_match_the_oracle(rng, stream, head_dim, dtype, scale_mode, scale_dtype,
                                     layout, page, causal, arbitrary):
    case = MultiCase(QO, KV, 16, 4, head_dim, kv_layout=layout, page_size=page,
                     scale_mode=scale_mode, scale_dtype=scale_dtype, dtype=dtype).fill(rng)
    case.upload(rng)
    mask = tree_mask(rng, QO, 2, arbitrary=arbitrary)
    with case.make_plan() as plan:
        plan.plan(case.indptr, case.kv_lens, causal=causal, tree=True)
        case.run(plan, stream, tree_mask=DeviceArray.from_numpy(mask))
        stream.synchronize()
        check(case, mask, causal)
        assert plan.error_flags(stream=stream) == 0


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("splits", [1, 5])
def test_tree_masks_under_kv_splits_and_row_tiles(rng, stream, head_dim, splits):
    """Chunks of 8 and 16 drafts x group 4: 2 and 4 row tiles of the split-warp kernel."""
    qo, kv = [8, 16, 3], [4096, 900, 3]
    case = MultiCase(qo, kv, 32, 8, head_dim).fill(rng)
    case.upload(rng)
    mask = tree_mask(rng, qo, 1)
    with case.make_plan() as plan:
        plan.plan(case.indptr, case.kv_lens, num_splits=splits, tree=True)
        case.run(plan, stream, tree_mask=DeviceArray.from_numpy(mask))
        stream.synchronize()
        check(case, mask, True)


def test_a_full_lower_triangle_is_the_causal_run_bitwise(rng, stream):
    """The same plan with and without the mask: the tree loop's arithmetic is the plain one's."""
    qo, kv = [5, 33, 1], [700, 33, 64]
    case = MultiCase(qo, kv, 32, 8, 128).fill(rng)
    d = case.upload(rng)
    chains = pack(np.concatenate([np.tri(n, 64, dtype=bool) for n in qo]), 2)
    with case.make_plan() as plan:
        plan.plan(case.indptr, case.kv_lens, tree=True)
        case.run(plan, stream)
        stream.synchronize()
        causal = d["out"].numpy().copy()
        case.run(plan, stream, tree_mask=DeviceArray.from_numpy(chains))
        stream.synchronize()
        assert d["out"].numpy().tobytes() == causal.tobytes()


def test_graph_replay_follows_a_rewritten_mask(rng, stream):
    qo, kv = [6, 6], [1500, 40]
    case = MultiCase(qo, kv, 32, 8, 128).fill(rng)
    d = case.upload(rng)
    mask = DeviceArray.from_numpy(tree_mask(rng, qo, 1))
    with case.make_plan() as plan:
        plan.plan(case.indptr, case.kv_lens, tree=True)
        with capture(stream) as graph:
            case.run(plan, stream, tree_mask=mask)
        for _ in range(3):
            host = tree_mask(rng, qo, 1)
            mask.copy_from_numpy(host)
            d["out"].fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            check(case, host, True)
            replayed = d["out"].numpy().copy()
            case.run(plan, stream, tree_mask=mask)
            stream.synchronize()
            assert d["out"].numpy().tobytes() == replayed.tobytes()
        graph.close()


def test_a_tree_plan_uses_the_split_warp_kernel_and_plain_plans_refuse_masks(rng, stream):
    case = MultiCase([4], [100], 8, 2, 128).fill(rng)
    case.upload(rng)
    mask = DeviceArray.from_numpy(tree_mask(rng, [4], 1))
    with case.make_plan() as plan:
        assert plan.plan(case.indptr, case.kv_lens, tree=True).describe()["ksplit"] == 2
        with pytest.raises(ValueError, match=r"^ksplit: expected one of \(2,\) at head_dim "
                                             r"128 with tree=True, got 1$"):
            plan.plan(case.indptr, case.kv_lens, tree=True, ksplit=1)
        plan.plan(case.indptr, case.kv_lens)
        with pytest.raises(ValueError, match=r"^tree_mask: the plan takes no tree masks"):
            case.run(plan, stream, tree_mask=mask)
