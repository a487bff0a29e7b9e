"""The multi-token oracle (prefill, chunked prefill, speculative verification) against the
decode oracle: query i of a chunk of n over L cached tokens is a decode over L - n + i + 1."""
from __future__ import annotations

import numpy as np
import pytest

from lowlevel_fd.reference import decode_attention_ref
from lowlevel_fd.reference_multi import multi_token_attention_ref

HQ, HKV, D, S = 8, 2, 64, 40


def cache(rng, layout="bnsh"):
    shape = (3, HKV, S, D) if layout == "bnsh" else (3, S, HKV, D)
    k = rng.integers(-127, 128, shape, dtype=np.int8)
    v = rng.integers(-127, 128, shape, dtype=np.int8)
    ks = rng.uniform(0.004, 0.012, (3, HKV, S)).astype(np.float32)
    vs = rng.uniform(0.004, 0.012, (3, HKV, S)).astype(np.float32)
    return k, v, ks, vs


@pytest.mark.parametrize("layout", ["bnsh", "bsnh"])
@pytest.mark.parametrize("causal", [True, False])
def test_each_query_row_is_a_decode_over_its_visible_prefix(rng, layout, causal):
    k, v, ks, vs = cache(rng, layout)
    lengths = np.array([40, 7, 3])
    qo_len = np.array([40, 4, 0])  # fresh prefill, a chunk over a prefix, no new tokens
    indptr = np.concatenate([[0], np.cumsum(qo_len)])
    q = rng.standard_normal((int(indptr[-1]), HQ, D))
    out, lse = multi_token_attention_ref(q, indptr, k, v, ks, vs, lengths, kv_layout=layout,
                                         causal=causal)
    for b in range(3):
        for i in range(qo_len[b]):
            row = indptr[b] + i
            visible = lengths[b] - qo_len[b] + i + 1 if causal else lengths[b]
            ref, ref_lse = decode_attention_ref(
                q[row][None].repeat(3, 0), k, v, ks, vs,
                np.array([visible if x == b else 0 for x in range(3)]), kv_layout=layout)
            np.testing.assert_allclose(out[row], ref[b], rtol=0, atol=1e-12)
            np.testing.assert_allclose(lse[row], ref_lse[b], rtol=0, atol=1e-12)


def test_one_new_token_per_sequence_is_decode(rng):
    k, v, ks, vs = cache(rng)
    lengths = np.array([5, 40, 1])
    q = rng.standard_normal((3, HQ, D))
    out, lse = multi_token_attention_ref(q, [0, 1, 2, 3], k, v, ks, vs, lengths)
    ref, ref_lse = decode_attention_ref(q, k, v, ks, vs, lengths)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(lse, ref_lse)


def test_the_first_prefill_token_sees_itself_only(rng):
    k, v, ks, vs = cache(rng)
    q = rng.standard_normal((6, HQ, D))
    out, lse = multi_token_attention_ref(q, [0, 6, 6, 6], k, v, ks, vs, [6, 0, 0])
    # One visible token: the output is its dequantized V, lse its score.
    v0 = v[0, :, 0].astype(np.float64) * vs[0, :, 0, None]
    np.testing.assert_allclose(out[0].reshape(HKV, HQ // HKV, D), v0[:, None].repeat(4, 1),
                               rtol=1e-12)


@pytest.mark.parametrize("indptr, message", [
    ([0, 2, 1, 3], r"qo_indptr: expected non-decreasing offsets, got 2 then 1 at sequence 1"),
    ([1, 2, 3, 3], r"qo_indptr: expected to start at 0 and end at total_q=3"),
    ([0, 1, 2], r"qo_indptr: expected shape \[B \+ 1\]=\(4,\)"),
    ([0, 3, 3, 3], r"qo_indptr: sequence 0 has 3 new tokens but seq_lens\[0\] = 2"),
    ([0.0, 1.0, 2.0, 3.0], r"qo_indptr: expected integers"),
])
def test_bad_qo_indptr_is_rejected(rng, indptr, message):
    k, v, ks, vs = cache(rng)
    with pytest.raises(ValueError, match=message):
        multi_token_attention_ref(rng.standard_normal((3, HQ, D)), indptr, k, v, ks, vs,
                                  [2, 5, 5])


# -- speculative trees ---------------------------------------------------------------------------
def tree_rows(parents: list[int]) -> np.ndarray:
    """One uint32 word per draft: bits of the draft's ancestors and itself."""
    rows = np.zeros((len(parents), 1), np.uint32)
    for i, parent in enumerate(parents):
        rows[i, 0] = (rows[parent, 0] if parent >= 0 else 0) | (1 << i)
    return rows


def test_a_full_lower_triangle_is_the_causal_mask(rng):
    k, v, ks, vs = cache(rng)
    lengths, qo_len = np.array([40, 7, 3]), np.array([5, 7, 0])
    indptr = np.concatenate([[0], np.cumsum(qo_len)])
    q = rng.standard_normal((int(indptr[-1]), HQ, D))
    mask = np.concatenate([tree_rows(list(range(-1, n - 1))) for n in qo_len])  # chains
    causal, _ = multi_token_attention_ref(q, indptr, k, v, ks, vs, lengths, causal=True)
    tree, _ = multi_token_attention_ref(q, indptr, k, v, ks, vs, lengths, causal=False,
                                        tree_mask=mask)
    np.testing.assert_array_equal(tree, causal)


def test_a_tree_row_sees_the_prefix_its_ancestors_and_itself(rng):
    k, v, ks, vs = cache(rng)
    lengths, qo_len = np.array([30, 5, 1]), np.array([5, 5, 0])
    indptr = np.concatenate([[0], np.cumsum(qo_len)])
    q = rng.standard_normal((int(indptr[-1]), HQ, D))
    parents = [-1, 0, 0, 1, 2]  # drafts 1 and 2 are siblings; 3 under 1, 4 under 2
    mask = np.concatenate([tree_rows(parents), tree_rows(parents)])
    out, lse = multi_token_attention_ref(q, indptr, k, v, ks, vs, lengths, causal=True,
                                         tree_mask=mask)
    for b, prefix in ((0, 25), (1, 0)):
        for i, seen in enumerate(([0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4])):
            row = indptr[b] + i
            tokens = list(range(prefix)) + [prefix + j for j in seen]
            picked = [x[b:b + 1, :, tokens] for x in (k, v, ks, vs)]
            ref, ref_lse = decode_attention_ref(q[row][None], *picked, [len(tokens)])
            np.testing.assert_allclose(out[row], ref[0], rtol=0, atol=1e-12)
            np.testing.assert_allclose(lse[row], ref_lse[0], rtol=0, atol=1e-12)


def test_a_row_that_sees_nothing_is_zero_with_lse_minus_infinity(rng):
    k, v, ks, vs = cache(rng)
    lengths, indptr = np.array([2, 1, 1]), np.array([0, 2, 2, 2])
    q = rng.standard_normal((2, HQ, D))
    mask = np.array([[0], [0b10]], np.uint32)  # row 0 hides itself; row 1 sees only itself
    out, lse = multi_token_attention_ref(q, indptr, k, v, ks, vs, lengths, causal=False,
                                         tree_mask=mask)
    assert not out[0].any() and np.isneginf(lse[0]).all()
    ref, _ = decode_attention_ref(q[1][None], *(x[0:1, :, 1:2] for x in (k, v, ks, vs)), [1])
    np.testing.assert_allclose(out[1], ref[0], rtol=0, atol=1e-12)
