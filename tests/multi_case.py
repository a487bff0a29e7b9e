"""Random multi-token attention inputs (packed ragged queries over an INT8 cache, contiguous
or paged), a MultiPlan run over them, and the float64 oracle to compare with."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from paged_case import paginate

from lowlevel_fd import MultiPlan
from lowlevel_fd.driver import DeviceArray, dtypes
from lowlevel_fd.reference import _softmax_attention
from lowlevel_fd.reference_multi import multi_token_attention_ref

# As for decode (decode_case.py): fp16 output rounding and P in fp16 once; bf16 keeps 8 bits.
TOLERANCE = {"float16": 2e-3, "bfloat16": 8e-3}
CACHE = ("k_cache", "v_cache", "k_scale", "v_scale")


@dataclass
class MultiCase:
    qo_lens: list[int]
    kv_lens: list[int]
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    kv_layout: str = "bnsh"
    page_size: int | None = None
    scale_mode: str = "token"
    scale_dtype: str = "float32"
    dtype: str = "float16"
    capacity: int = 0
    host: dict[str, np.ndarray] = field(default_factory=dict)
    device: dict[str, DeviceArray] = field(default_factory=dict)

    @property
    def batch(self) -> int:
        return len(self.kv_lens)

    @property
    def indptr(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.qo_lens)]).astype(np.int32)

    @property
    def total_q(self) -> int:
        return int(sum(self.qo_lens))

    def fill(self, rng: np.random.Generator) -> "MultiCase":
        """Random normal queries, random int8 caches ``[B, Hkv, S, D]`` and scales of the
        mode (kept as bnsh in ``host``; ``upload`` lays them out)."""
        if not self.capacity:
            self.capacity = max(max(self.kv_lens), 1)
            self.capacity += self.capacity % 2  # fp16 token-scale rows start 4-byte aligned
        B, Hkv, S, D = self.batch, self.num_kv_heads, self.capacity, self.head_dim
        h = self.host
        h["q"] = rng.standard_normal((self.total_q, self.num_q_heads, D)).astype(
            dtypes.as_dtype(self.dtype))
        h["k_cache"] = rng.integers(-127, 128, (B, Hkv, S, D), dtype=np.int8)
        h["v_cache"] = rng.integers(-127, 128, (B, Hkv, S, D), dtype=np.int8)
        shape = {"tensor": (1,), "head": (Hkv,), "token": (B, Hkv, S)}[self.scale_mode]
        scale_type = np.float16 if self.scale_mode == "token" and self.scale_dtype == "float16" \
            else np.float32
        h["k_scale"] = rng.uniform(0.004, 0.012, shape).astype(scale_type)
        h["v_scale"] = rng.uniform(0.004, 0.012, shape).astype(scale_type)
        h["seq_lens"] = np.asarray(self.kv_lens, np.int32)
        return self

    def upload(self, rng: np.random.Generator) -> dict[str, DeviceArray]:
        h, d = self.host, self.device
        if self.page_size:
            pages = paginate(rng, h, self.kv_layout, self.page_size,
                             token_scales=self.scale_mode == "token")
            d.update(pages.upload())
        else:
            for name in CACHE:
                value = h[name]
                if self.kv_layout == "bsnh" and name in ("k_cache", "v_cache"):
                    value = np.ascontiguousarray(value.transpose(0, 2, 1, 3))
                d[name] = DeviceArray.from_numpy(value)
            d["block_table"] = None
        d["q"] = DeviceArray.from_numpy(h["q"])
        d["seq_lens"] = DeviceArray.from_numpy(h["seq_lens"])
        d["qo_indptr"] = DeviceArray.from_numpy(self.indptr)
        d["out"] = DeviceArray.empty(h["q"].shape, dtypes.as_dtype(self.dtype))
        d["lse"] = DeviceArray.empty(h["q"].shape[:2], np.float32)
        return d

    def make_plan(self, **options: Any) -> MultiPlan:
        rope = options.pop("rope", None)
        return MultiPlan.create(self.num_q_heads, self.num_kv_heads, self.head_dim,
                                max_batch=self.batch, max_seq_len=self.capacity,
                                dtype=self.dtype, kv_layout=self.kv_layout,
                                scale_mode=self.scale_mode, scale_dtype=self.scale_dtype,
                                page_size=self.page_size, rope=rope, **options)

    def run(self, plan: MultiPlan, stream: Any, **options: Any) -> None:
        """Poison out and lse with NaN, then run the plan on the device arrays."""
        d = self.device
        d["out"].fill(np.nan, stream)
        d["lse"].fill(np.nan, stream)
        plan.run(d["q"], d["k_cache"], d["v_cache"], d["k_scale"], d["v_scale"],
                 d["seq_lens"], d["qo_indptr"], d["out"], lse=d["lse"],
                 block_table=d["block_table"], stream=stream, **options)

    def reference(self, *, causal: bool = True, q: np.ndarray | None = None,
                  sm_scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        h = self.host
        return multi_token_attention_ref(h["q"] if q is None else q, self.indptr,
                                         h["k_cache"], h["v_cache"], h["k_scale"],
                                         h["v_scale"], h["seq_lens"], kv_layout="bnsh",
                                         scale_mode=self.scale_mode, causal=causal,
                                         sm_scale=sm_scale)

    def row_reference(self, rows: np.ndarray, *, causal: bool = True) -> np.ndarray:
        """The oracle for selected query rows only (long prefills): ``[len(rows), Hq, D]``."""
        h, indptr = self.host, self.indptr
        out = np.zeros((len(rows),) + h["q"].shape[1:])
        scale = 1.0 / np.sqrt(self.head_dim)
        for n, row in enumerate(rows):
            b = int(np.searchsorted(indptr, row, side="right") - 1)
            length, count = int(self.kv_lens[b]), int(self.qo_lens[b])
            visible = length - count + (row - indptr[b]) + 1 if causal else length
            k = self._dequantized("k", b, visible)
            v = self._dequantized("v", b, visible)
            out[n] = _softmax_attention(h["q"][row].astype(np.float64), k, v, scale)[0]
        return out

    def _dequantized(self, which: str, b: int, tokens: int) -> np.ndarray:
        h = self.host
        values = h[f"{which}_cache"][b, :, :tokens].astype(np.float64)
        scale = h[f"{which}_scale"].astype(np.float64)
        if self.scale_mode == "token":
            return values * scale[b, :, :tokens, None]
        if self.scale_mode == "head":
            return values * scale[:, None, None]
        return values * scale[0]


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """max |out - ref| over max |ref| (NaN anywhere: inf)."""
    out = out.astype(np.float64)
    if not np.isfinite(out).all():
        return float("inf")
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


def check_decode_replays(case: MultiCase, plan: MultiPlan, stream: Any,
                         lengths: list[list[int]]) -> None:
    """A plan of decode rows (planned for ``case.kv_lens``) captured once, replayed over each
    set of device ``lengths`` (0: an empty sequence, out 0 and lse -inf): against the oracle,
    and bitwise equal to an eager run of the same lengths."""
    from lowlevel_fd.driver import capture
    d = case.device

    def launch():
        plan.run(d["q"], d["k_cache"], d["v_cache"], d["k_scale"], d["v_scale"],
                 d["seq_lens"], None, d["out"], lse=d["lse"], stream=stream)
    with capture(stream) as graph:
        launch()
    for kv in lengths:
        d["seq_lens"].copy_from_numpy(np.asarray(kv, np.int32))
        case.kv_lens = [max(n, 1) for n in kv]  # the oracle takes no empty sequence
        case.host["seq_lens"] = np.asarray(case.kv_lens, np.int32)
        d["out"].fill(np.nan)
        d["lse"].fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
        out, lse = d["out"].numpy().copy(), d["lse"].numpy().copy()
        ref_out, ref_lse = case.reference(causal=False)
        empty = np.asarray(kv) == 0
        assert relative_error(out[~empty], ref_out[~empty]) <= TOLERANCE[case.dtype]
        np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=0, atol=2e-3)
        assert (out[empty] == 0).all() and np.isneginf(lse[empty]).all()
        launch()
        stream.synchronize()
        assert d["out"].numpy().tobytes() == out.tobytes()
        assert d["lse"].numpy().tobytes() == lse.tobytes()
    graph.close()
