"""Builds random decode inputs on the host and the device, runs a plan, compares to the oracle."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lowlevel_fd.decode import DecodePlan, TileConfig
from lowlevel_fd.driver import DeviceArray, dtypes
from lowlevel_fd.reference import decode_attention_ref
from lowlevel_fd.reference_multi import int8_query_rows

# fp16 output rounding is 2^-11 of an element and P is rounded to fp16 once: 2e-3 of max|ref|
# holds with margin. bf16 keeps 8 significant bits, so rounding the output alone costs up to
# 2^-9 = 2e-3; with the rest of the error budget, 8e-3.
TOLERANCE = {"float16": 2e-3, "bfloat16": 8e-3}


@dataclass
class Case:
    batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    lengths: list[int]
    capacity: int
    kv_layout: str = "bnsh"
    scale_mode: str = "token"
    scale_dtype: str = "float32"
    dtype: str = "float16"  # of q and out (the plans' ``dtype``)
    int8_q: bool = False  # the oracle rounds q as the int8-q kernel does (int8_query_rows)
    host: dict[str, np.ndarray] = field(default_factory=dict)
    device: dict[str, DeviceArray] = field(default_factory=dict)

    @classmethod
    def random(cls, rng: np.random.Generator, lengths: list[int], *, num_q_heads: int = 32,
               num_kv_heads: int = 8, head_dim: int = 128, capacity: int | None = None,
               **options: Any) -> "Case":
        if capacity is None:  # fp16 token-scale rows must start 4-byte aligned: even S_max
            capacity = max(max(lengths), 1)
            capacity += capacity % 2 if options.get("scale_dtype") == "float16" else 0
        case = cls(len(lengths), num_q_heads, num_kv_heads, head_dim, list(lengths), capacity,
                   **options)
        case.fill_host(rng)
        return case

    def cache_shape(self) -> tuple[int, ...]:
        if self.kv_layout == "bnsh":
            return (self.batch, self.num_kv_heads, self.capacity, self.head_dim)
        return (self.batch, self.capacity, self.num_kv_heads, self.head_dim)

    def scale_shape(self) -> tuple[int, ...]:
        return {"tensor": (1,), "head": (self.num_kv_heads,),
                "token": (self.batch, self.num_kv_heads, self.capacity)}[self.scale_mode]

    def fill_host(self, rng: np.random.Generator) -> None:
        qt = dtypes.as_dtype(self.dtype)
        h = self.host
        h["q"] = rng.standard_normal((self.batch, self.num_q_heads, self.head_dim)).astype(qt)
        h["k"] = rng.integers(-127, 128, self.cache_shape(), dtype=np.int8)
        h["v"] = rng.integers(-127, 128, self.cache_shape(), dtype=np.int8)
        scale_dtype = np.float16 if self.scale_mode == "token" and self.scale_dtype == "float16" \
            else np.float32
        # K scales near 1/127 of a unit-variance key: scores of order one, softmax not flat.
        h["k_scale"] = rng.uniform(0.004, 0.012, self.scale_shape()).astype(scale_dtype)
        h["v_scale"] = rng.uniform(0.004, 0.012, self.scale_shape()).astype(scale_dtype)
        h["seq_lens"] = np.asarray(self.lengths, dtype=np.int32)

    def set_lengths(self, lengths: list[int]) -> None:
        """New lengths for the oracle and, once uploaded, the device copy the kernels read."""
        self.lengths = list(lengths)
        self.host["seq_lens"] = np.asarray(lengths, np.int32)
        if "seq_lens" in self.device:
            self.device["seq_lens"].copy_from_numpy(self.host["seq_lens"])

    def upload(self) -> dict[str, DeviceArray]:
        for name, value in self.host.items():
            self.device[name] = DeviceArray.from_numpy(value)
        qt = dtypes.as_dtype(self.dtype)
        self.device["out"] = DeviceArray.empty(self.host["q"].shape, qt)
        self.device["lse"] = DeviceArray.empty((self.batch, self.num_q_heads), np.float32)
        return self.device

    def make_plan(self, **options: Any) -> DecodePlan:
        """A DecodePlan for this case (``options``: DecodePlan.create's, e.g. rope, sm_scale)."""
        return DecodePlan.create(self.num_q_heads, self.num_kv_heads, self.head_dim,
                                 max_batch=max(self.batch, options.pop("max_batch", 1)),
                                 max_seq_len=self.capacity, dtype=self.dtype,
                                 kv_layout=self.kv_layout, scale_mode=self.scale_mode,
                                 scale_dtype=self.scale_dtype, **options)

    def run(self, plan: DecodePlan, stream: Any, *, config: TileConfig | None = None,
            replan: bool = True, multi: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Poison the outputs with NaN, run, return (out, lse) as float64 host arrays."""
        if not self.device:
            self.upload()
        d = self.device
        if replan:
            plan.plan(self.lengths, config=config, multi=multi)
        d["out"].fill(float("nan"))
        d["lse"].fill(float("nan"))
        plan.run(d["q"], d["k"], d["v"], d["k_scale"], d["v_scale"], d["seq_lens"], d["out"],
                 lse=d["lse"], stream=stream)
        stream.synchronize()
        return d["out"].numpy().astype(np.float64), d["lse"].numpy().astype(np.float64)

    def reference(self, sm_scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        h = self.host
        q = h["q"].astype(np.float32)
        return decode_attention_ref(int8_query_rows(q) if self.int8_q else q, h["k"], h["v"], h["k_scale"],
                                    h["v_scale"], h["seq_lens"], kv_layout=self.kv_layout,
                                    scale_mode=self.scale_mode, sm_scale=sm_scale)

    def check(self, out: np.ndarray, lse: np.ndarray, sm_scale: float | None = None) -> float:
        """Assert no NaN, the error bound and the LSE; returns the relative error."""
        ref_out, ref_lse = self.reference(sm_scale)
        assert not np.isnan(out).any(), "an output element was not written (NaN poison left)"
        assert not np.isnan(lse).any(), "an lse element was not written"
        scale = max(np.abs(ref_out).max(), 1e-30)
        error = float(np.abs(out - ref_out).max() / scale)
        assert error <= TOLERANCE[self.dtype], f"max|out-ref|/max|ref| = {error:.3e}"
        finite = np.isfinite(ref_lse)
        assert np.array_equal(np.isfinite(lse), finite), "lse: -inf exactly for empty rows"
        np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-4, atol=1e-3)
        empty = np.asarray(self.lengths) == 0
        assert (out[empty] == 0).all(), "empty sequences give all-zero rows"
        return error
