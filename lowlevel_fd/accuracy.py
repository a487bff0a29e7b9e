"""How much accuracy each INT8 scale mode costs: decode attention over a quantized cache
against attention over the unquantized fp16 K/V, both evaluated in float64 (pure numpy, CPU,
deterministic for a seed).

The only error measured is the quantization's: the quantized cache comes from ``quant`` (the
kernels' bit-exact math), the oracle from ``reference``. Two kinds of data:

* ``gaussian``: q, K and V i.i.d. standard normal.
* ``outliers``: the same, with a few K channels (the same ones in every head and token, as in
  real models' keys) scaled up 20x. One outlier inflates the scale of every value sharing it:
  a per-tensor scale is set by the largest outlier anywhere, a per-token-per-head scale only by
  the largest in that token's head, so the ordinary channels keep more of their resolution.

In both kinds q is divided by K's RMS, so the scores have unit variance, as a trained model's
temperature keeps them: the kinds then differ only in what the quantizer sees. (Without it the
20x channels alone make the softmax nearly one-hot, and the few tokens it picks are the ones
with the largest outliers, whose per-token scales are as coarse as the per-tensor one.)

``token-fp32-hadamard`` is ``token-fp32`` with ``key_transform="hadamard"``: K stored as
``H k`` and q multiplied by H alike (scores unchanged), so an outlier channel is spread over
the whole row before the per-token scale is taken.

max|out-ref|/max|ref| is one element's error, so it is noisy between seeds; the mean and L2
errors are the stable comparison between modes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from .quant import hadamard_rows, quantize_cache
from .reference import attention_ref_fp, decode_attention_ref

# Table name -> (scale_mode, scale_dtype), in the order the table lists them.
SCALE_MODES = {"tensor": ("tensor", "float32"), "head": ("head", "float32"),
               "token-fp32": ("token", "float32"), "token-fp16": ("token", "float16"),
               "token-fp32-hadamard": ("token", "float32")}
DATA_KINDS = ("gaussian", "outliers")


@dataclass(frozen=True)
class Shape:
    """The measured problem: B sequences of S tokens, GQA heads Hq/Hkv, head_dim D."""

    batch: int = 2
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    seq_len: int = 1024
    outlier_channels: int = 4
    outlier_scale: float = 20.0


@dataclass(frozen=True)
class Data:
    """fp16 q ``[B, Hq, D]``, K and V ``[B, Hkv, S, D]`` (bnsh), the lengths ``[B]``."""

    kind: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    seq_lens: np.ndarray


@dataclass(frozen=True)
class ErrorRow:
    """One table row. max_rel: max|out-ref| / max|ref|; mean_rel: mean|out-ref| / mean|ref|;
    rel_l2: ||out-ref||_2 / ||ref||_2; ``path`` says which implementation produced ``out``."""

    data: str
    mode: str
    max_rel: float
    mean_rel: float
    rel_l2: float
    path: str = "cpu"


def make_data(kind: str, shape: Shape = Shape(), seed: int = 0) -> Data:
    """Random fp16 inputs of one kind (see the module docstring); same seed, same data."""
    if kind not in DATA_KINDS:
        raise ValueError(f"kind: expected one of {list(DATA_KINDS)}, got {kind!r}")
    rng = np.random.default_rng(seed)
    B, Hq, Hkv, D, S = (shape.batch, shape.num_q_heads, shape.num_kv_heads, shape.head_dim,
                        shape.seq_len)
    q = rng.standard_normal((B, Hq, D))
    k = rng.standard_normal((B, Hkv, S, D))
    v = rng.standard_normal((B, Hkv, S, D))
    if kind == "outliers":
        channels = rng.choice(D, size=shape.outlier_channels, replace=False)
        k[..., channels] *= shape.outlier_scale
    q /= np.sqrt(np.mean(np.square(k)))  # unit-variance scores (see the module docstring)
    seq_lens = np.full(B, S, dtype=np.int64)
    return Data(kind, q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), seq_lens)


def reference_output(data: Data) -> np.ndarray:
    """float64 ``[B, Hq, D]`` attention over the unquantized fp16 K/V."""
    out, _ = attention_ref_fp(data.q, data.k, data.v, data.seq_lens)
    return out


def quantized_output(data: Data, mode: str) -> np.ndarray:
    """float64 ``[B, Hq, D]`` attention over K/V quantized with scale mode ``mode`` (a key of
    SCALE_MODES); tensor/head scales are calibrated on the cache itself (its absmax)."""
    if mode not in SCALE_MODES:
        raise ValueError(f"mode: expected one of {list(SCALE_MODES)}, got {mode!r}")
    scale_mode, scale_dtype = SCALE_MODES[mode]
    q, k = data.q, data.k
    if key_transform(mode) == "hadamard":  # q rounded to fp16 after H, as a caller passes it
        q, k = transformed_query(q), hadamard_rows(k)
    k8, k_scale = quantize_cache(k, scale_mode, scale_dtype=scale_dtype)
    v8, v_scale = quantize_cache(data.v, scale_mode, scale_dtype=scale_dtype)
    out, _ = decode_attention_ref(q, k8, v8, k_scale, v_scale, data.seq_lens,
                                  scale_mode=scale_mode)
    return out


def key_transform(mode: str) -> str:
    """The KVCacheSpec key_transform of a table mode."""
    return "hadamard" if mode.endswith("-hadamard") else "none"


def transformed_query(q: np.ndarray) -> np.ndarray:
    """fp16 ``q @ H``: the query a caller passes for a Hadamard-key cache."""
    return hadamard_rows(q.astype(np.float32)).astype(np.float16)


def errors(out: np.ndarray, ref: np.ndarray, *, data: str, mode: str,
           path: str = "cpu") -> ErrorRow:
    """The three relative errors of ``out`` against ``ref`` (any float dtypes)."""
    out64, ref64 = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if out64.shape != ref64.shape:
        raise ValueError(f"out: expected shape {ref64.shape} like ref, got {out64.shape}")
    diff = np.abs(out64 - ref64)
    tiny = np.finfo(np.float64).tiny
    return ErrorRow(data=data, mode=mode,
                    max_rel=float(diff.max() / max(np.abs(ref64).max(), tiny)),
                    mean_rel=float(diff.mean() / max(np.abs(ref64).mean(), tiny)),
                    rel_l2=float(np.linalg.norm(diff) / max(np.linalg.norm(ref64), tiny)),
                    path=path)


def measure(shape: Shape = Shape(), *, seed: int = 0, kinds: Iterable[str] = DATA_KINDS,
            modes: Iterable[str] = tuple(SCALE_MODES)) -> list[ErrorRow]:
    """Every (data kind, scale mode) row on the CPU, data kind major."""
    rows = []
    modes = list(modes)
    for kind in kinds:
        data = make_data(kind, shape, seed)
        ref = reference_output(data)
        rows.extend(errors(quantized_output(data, mode), ref, data=kind, mode=mode)
                    for mode in modes)
    return rows


def markdown_table(rows: Sequence[ErrorRow], shape: Shape = Shape()) -> str:
    """The rows as a markdown table, preceded by one line naming the problem."""
    head = (f"Decode attention over the INT8 cache vs. attention over the unquantized fp16 "
            f"K/V (float64): B={shape.batch}, Hq={shape.num_q_heads}, "
            f"Hkv={shape.num_kv_heads}, D={shape.head_dim}, S={shape.seq_len}; outliers = "
            f"{shape.outlier_channels} of {shape.head_dim} K channels x{shape.outlier_scale:g}; "
            f"q scaled to unit-variance scores.")
    lines = [head, "",
             "| data | scale mode | path | max\\|out-ref\\|/max\\|ref\\| "
             "| mean\\|out-ref\\|/mean\\|ref\\| | rel. L2 |",
             "|---|---|---|---:|---:|---:|"]
    lines += [f"| {r.data} | {r.mode} | {r.path} | {r.max_rel:.2e} | {r.mean_rel:.2e} "
              f"| {r.rel_l2:.2e} |" for r in rows]
    return "\n".join(lines)
