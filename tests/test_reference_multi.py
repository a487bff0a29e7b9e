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
