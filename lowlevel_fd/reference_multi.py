"""Float64 numpy oracle for multi-token attention over an INT8 KV cache: prefill, chunked
prefill and speculative verification (the issue's semantics).

Queries are packed ``[total_q, Hq, D]``, sequence b owning rows ``qo_indptr[b] ..
qo_indptr[b + 1] - 1``; ``seq_lens[b]`` counts the cached tokens including the new ones, so
the new tokens are the last ``qo_len[b]`` positions. Query i of sequence b (0-based in its
chunk) attends KV positions ``t <= seq_lens[b] - qo_len[b] + i`` (causal), or all
``seq_lens[b]`` (``causal=False``: every draft token sees the whole cache). Test-only, like
reference.py, whose dequantization and softmax it shares.
"""
from __future__ import annotations

import numpy as np

from .reference import (_broadcastable_scale, _cache_dims, _check_seq_lens, _live_prefix,
                        _softmax_attention)


def check_qo_indptr(qo_indptr, total_q: int, seq_lens: np.ndarray) -> np.ndarray:
    """``qo_indptr`` as int64 ``[B + 1]``: starting at 0, non-decreasing, ending at
    ``total_q``, and no sequence with more new tokens than cached ones."""
    indptr = np.asarray(qo_indptr)
    if indptr.ndim != 1 or indptr.size != seq_lens.size + 1:
        raise ValueError(f"qo_indptr: expected shape [B + 1]=({seq_lens.size + 1},), got "
                         f"{indptr.shape}")
    if not np.issubdtype(indptr.dtype, np.integer):
        raise ValueError(f"qo_indptr: expected integers, got {indptr.dtype}")
    indptr = indptr.astype(np.int64)
    if indptr[0] != 0 or indptr[-1] != total_q:
        raise ValueError(f"qo_indptr: expected to start at 0 and end at total_q={total_q}, got "
                         f"{indptr[0]} .. {indptr[-1]}")
    qo_len = np.diff(indptr)
    if (qo_len < 0).any():
        b = int(np.argmax(qo_len < 0))
        raise ValueError(f"qo_indptr: expected non-decreasing offsets, got {indptr[b]} then "
                         f"{indptr[b + 1]} at sequence {b}")
    if (qo_len > seq_lens).any():
        b = int(np.argmax(qo_len > seq_lens))
        raise ValueError(f"qo_indptr: sequence {b} has {qo_len[b]} new tokens but "
                         f"seq_lens[{b}] = {seq_lens[b]} (they are part of it)")
    return indptr


def multi_token_attention_ref(
    q: np.ndarray, qo_indptr, k_cache: np.ndarray, v_cache: np.ndarray, k_scale, v_scale,
    seq_lens, *, kv_layout: str = "bnsh", scale_mode: str = "token",
    sm_scale: float | None = None, causal: bool = True, tree_mask: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(out ``[total_q, Hq, D]``, lse ``[total_q, Hq]``) float64, lse the natural log.

    ``tree_mask`` (speculative trees): integer ``[total_q, words]``; query i of a chunk sees
    draft token j of it (position ``seq_len - qo_len + j``) only where bit ``j % 32`` of word
    ``j // 32`` of its row is set (bits past the words: 0); tokens before the chunk always.
    A row that sees nothing gives zeros and lse ``-inf``."""
    q = np.asarray(q)
    k_cache, v_cache = np.asarray(k_cache), np.asarray(v_cache)
    batch, num_kv_heads, max_seq_len, head_dim = _cache_dims(k_cache, kv_layout, "k_cache")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: expected shape {k_cache.shape} like k_cache, got "
                         f"{v_cache.shape}")
    if q.ndim != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q: expected [total_q, Hq, {head_dim}] with Hq a multiple of "
                         f"{num_kv_heads}, got {q.shape}")
    lengths = _check_seq_lens(seq_lens, batch, max_seq_len)
    indptr = check_qo_indptr(qo_indptr, q.shape[0], lengths)
    k_scale_b = _broadcastable_scale(k_scale, k_cache, kv_layout, scale_mode, "k_scale")
    v_scale_b = _broadcastable_scale(v_scale, v_cache, kv_layout, scale_mode, "v_scale")
    scale = 1.0 / np.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    q64 = q.astype(np.float64)
    out = np.zeros(q.shape, np.float64)
    lse = np.full(q.shape[:2], -np.inf, np.float64)
    bits = None
    if tree_mask is not None:
        words = np.asarray(tree_mask).astype(np.int64) & 0xFFFFFFFF
        if words.ndim != 2 or words.shape[0] != q.shape[0]:
            raise ValueError(f"tree_mask: expected [total_q={q.shape[0]}, words], got "
                             f"{words.shape}")
        shifts = np.arange(32 * words.shape[1]) % 32
        bits = ((words[:, np.arange(32 * words.shape[1]) // 32] >> shifts) & 1).astype(bool)
    for b in range(batch):
        length, first, count = int(lengths[b]), int(indptr[b]), int(indptr[b + 1] - indptr[b])
        if count == 0:
            continue
        k_row = _live_prefix(k_cache, k_scale_b, b, length, kv_layout)
        v_row = _live_prefix(v_cache, v_scale_b, b, length, kv_layout)
        prefix = length - count
        for i in range(count):
            visible = length - count + i + 1 if causal else length  # >= 1: count <= length
            tokens = np.arange(visible)
            if bits is not None:
                draft = tokens[prefix:] - prefix
                seen = np.zeros(draft.size, bool)
                known = draft < bits.shape[1]
                seen[known] = bits[first + i, draft[known]]
                tokens = np.concatenate([tokens[:prefix], tokens[prefix:][seen]])
                if tokens.size == 0:
                    continue
            out[first + i], lse[first + i] = _softmax_attention(
                q64[first + i], k_row[:, tokens], v_row[:, tokens], scale)
    return out, lse


def int8_query_rows(q: np.ndarray) -> np.ndarray:
    """q as the int8-q kernel (MultiPlan ``allow_int8_q``) uses it, per row of the last axis
    (after RoPE and the Hadamard transform where the kernel applies them): the row in fp16
    scaled by the power of two that puts its largest magnitude in [2^14, 2^15), then
    ``int8 = rint(x * inv)`` clamped to +-127 with ``inv = 127 / max|x|`` and the row's scale
    ``1 / inv``, all in fp32. Returned dequantized (float64); a zero row stays zero."""
    x = np.asarray(q, np.float32)
    top = np.abs(x).max(axis=-1, keepdims=True)
    _, exponent = np.frexp(top)  # top = m 2^e, m in [0.5, 1): floor(log2 top) = e - 1
    up = np.where(top > 0, np.exp2(15.0 - exponent), 1.0)
    y = (x * up.astype(np.float32)).astype(np.float16).astype(np.float32)
    top_y = np.abs(y).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(top_y > 0, np.float32(127) / top_y, np.float32(0)).astype(np.float32)
        step = np.where(inv > 0, np.float32(1) / inv, np.float32(0)).astype(np.float32)
    steps = np.rint((y * inv).astype(np.float32)).clip(-127, 127)
    return steps.astype(np.float64) * step.astype(np.float64) / up
