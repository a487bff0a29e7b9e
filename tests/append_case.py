"""Host-side starting state of the append tests: garbage caches, NaN token scales."""
from __future__ import annotations

import numpy as np

def cache_state(rng, *, batch, heads, head_dim, capacity, kv_layout, scale_mode, scale_dtype,
                lengths):
    """Host arrays: garbage caches, NaN per-token scales (or given scales), the lengths."""
    shape = ((batch, heads, capacity, head_dim) if kv_layout == "bnsh"
             else (batch, capacity, heads, head_dim))
    host = {"k_cache": rng.integers(-128, 128, shape, dtype=np.int8),
            "v_cache": rng.integers(-128, 128, shape, dtype=np.int8),
            "seq_lens": np.asarray(lengths, np.int32)}
    for name in ("k_scale", "v_scale"):
        if scale_mode == "token":
            host[name] = np.full((batch, heads, capacity), np.nan, np.dtype(scale_dtype))
        else:
            count = 1 if scale_mode == "tensor" else heads
            host[name] = rng.uniform(0.03, 0.05, count).astype(np.float32)
    return host
