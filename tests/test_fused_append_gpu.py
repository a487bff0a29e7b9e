"""DecodePlan.append_and_run on the GPU: the new token is rotated, quantized, written and attended
in one launch. Checked against the float64 oracle on a host mirror (append_ref, then attention
over positions + 1 tokens with the rotated query), against the unfused path (AppendPlan then
DecodePlan.run: the cache bytes are identical), over the support matrix, the forced launch
configurations, ragged and odd positions, and positions outside the cache."""
from __future__ import annotations

import numpy as np
import pytest
from decode_case import TOLERANCE, Case

from lowlevel_fd import ERROR_OUTSIDE_CACHE
from lowlevel_fd.append import AppendPlan
from lowlevel_fd.append.reference import append_ref
from lowlevel_fd.decode import TileConfig
from lowlevel_fd.driver import DeviceArray, capture, dtypes
from lowlevel_fd.quant import hadamard_rows
from lowlevel_fd.reference import decode_attention_ref, rope_table
from lowlevel_fd.reference_multi import int8_query_rows

pytestmark = pytest.mark.gpu

THETA = 500000.0
POSITIONS = [0, 63, 1024, 4097]  # the first token, a tile edge, a split edge, odd and long
CAPACITY = 4100  # even (fp16 token scales), room for every new token


class Fused:
    """One append_and_run call: host mirror, device buffers, the plan."""

    def __init__(self, rng, positions, *, capacity=CAPACITY, rope=None, table=False,
                 num_q_heads=32, num_kv_heads=8, head_dim=128, key_transform="none",
                 **options):
        self.case = Case.random(rng, positions, capacity=capacity, num_q_heads=num_q_heads,
                                num_kv_heads=num_kv_heads, head_dim=head_dim, **options)
        c, qt = self.case, dtypes.as_dtype(self.case.dtype)
        shape = (c.batch, num_kv_heads, head_dim)
        # K of unit variance, V twice as large: per-token scales differ from the cache's.
        self.k_new = rng.standard_normal(shape).astype(qt)
        self.v_new = (2 * rng.standard_normal(shape)).astype(qt)
        self.rope = rope
        self.table = rope_table(capacity, head_dim, THETA) if table else None
        self.positions = np.asarray(positions, np.int64)
        self.key_transform = key_transform
        self.round_query = True
        self.plan = c.make_plan(rope=rope, rope_theta=THETA, key_transform=key_transform)
        self.device = c.upload()
        self.device["k_new"] = DeviceArray.from_numpy(self.k_new)
        self.device["v_new"] = DeviceArray.from_numpy(self.v_new)
        self.device["cos_sin"] = (None if self.table is None
                                  else DeviceArray.from_numpy(self.table))

    STATE = ("out", "lse", "k", "v", "k_scale", "v_scale", "q")  # what a call may write

    def state(self) -> dict[str, bytes]:
        return {name: self.device[name].numpy().tobytes() for name in self.STATE}

    def prepare(self, early_reads: bool):
        """prepare_append_and_run over the case's buffers (RoPE from its table)."""
        d = self.device
        return self.plan.prepare_append_and_run(
            d["q"], d["k_new"], d["v_new"], d["k"], d["v"], d["k_scale"], d["v_scale"],
            d["seq_lens"], d["out"], cos_sin=d["cos_sin"], lse=d["lse"],
            early_reads=early_reads)

    def launch_from_the_start(self, prepared, stream, *, graph: bool = False) -> None:
        """The caches as before the append, out and lse poisoned, then ``prepared`` launched
        (captured in a graph and replayed with ``graph``), and the stream synchronized."""
        d = self.device
        for name in ("k", "v", "k_scale", "v_scale"):
            d[name].copy_from_numpy(self.case.host[name])
        d["out"].fill(float("nan"))
        d["lse"].fill(float("nan"))
        if graph:
            with capture(stream) as captured:
                prepared.launch(stream)
            captured.launch(stream)
        else:
            prepared.launch(stream)
        stream.synchronize()
        if graph:
            captured.close()

    def attended(self) -> np.ndarray:
        pos, cap = self.positions, self.case.capacity
        return np.where((pos >= 0) & (pos < cap), pos + 1, np.clip(pos, 0, cap))

    def planned(self) -> np.ndarray:
        """The host lengths to plan with: plan(append=True) takes the cached lengths and plans
        for one more token each, so a position in the cache is planned as itself. A position
        outside it (the device length a graph replay may meet) is planned as the nearest
        valid one: S_max - 1 (planned to attend the S_max tokens the kernel clamps to) or 0."""
        return np.clip(self.positions, 0, self.case.capacity - 1)

    def run(self, stream, config: TileConfig | None = None, multi: bool | None = None,
            int8_q: bool | None = None):
        d = self.device
        self.plan.plan(self.planned(), config=config, append=True, multi=multi, int8_q=int8_q)
        d["out"].fill(float("nan"))
        d["lse"].fill(float("nan"))
        self.plan.append_and_run(d["q"], d["k_new"], d["v_new"], d["k"], d["v"], d["k_scale"],
                                 d["v_scale"], d["seq_lens"], d["out"], cos_sin=d["cos_sin"],
                                 lse=d["lse"], stream=stream)
        stream.synchronize()
        return d["out"].numpy().astype(np.float64), d["lse"].numpy().astype(np.float64)

    def oracle(self):
        """(out, lse, host caches after the append) from the float64 mirror."""
        c, h = self.case, self.case.host
        mirror = {name: h[name].copy() for name in ("k", "v", "k_scale", "v_scale")}
        scale_dtype = np.dtype(c.scale_dtype) if c.scale_mode == "token" else np.float32
        q_rot = append_ref(mirror["k"], mirror["v"], mirror["k_scale"], mirror["v_scale"],
                           self.positions.copy(), self.k_new, self.v_new,
                           kv_layout=c.kv_layout, scale_mode=c.scale_mode,
                           scale_dtype=scale_dtype, rope=self.rope, cos_sin=self.table,
                           theta=THETA, q=h["q"], key_transform=self.key_transform)
        # The kernel rounds the rotated query once to the query dtype, as append_token does
        # (round_query; the multi-token route keeps it in fp16 scaled per row instead).
        q_used = (q_rot.astype(dtypes.as_dtype(c.dtype)).astype(np.float32) if self.round_query
                  else q_rot.astype(np.float32))
        if c.int8_q:  # the int8-q kernel's rounding of the rotated row
            q_used = int8_query_rows(q_used)
        out, lse = decode_attention_ref(q_used, mirror["k"], mirror["v"], mirror["k_scale"],
                                        mirror["v_scale"], self.attended(),
                                        kv_layout=c.kv_layout, scale_mode=c.scale_mode)
        return out, lse, mirror

    def check(self, out, lse):
        ref, ref_lse, mirror = self.oracle()
        assert not np.isnan(out).any() and not np.isnan(lse).any(), "NaN poison left"
        error = float(np.abs(out - ref).max() / np.abs(ref).max())
        assert error <= TOLERANCE[self.case.dtype], f"max|out-ref|/max|ref| = {error:.3e}"
        finite = np.isfinite(ref_lse)
        assert np.array_equal(np.isfinite(lse), finite)
        np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-4, atol=1e-3)
        d = self.device
        got = {name: d[name].numpy() for name in ("k", "v", "k_scale", "v_scale")}
        np.testing.assert_array_equal(got["v"], mirror["v"])
        k_diff = np.abs(got["k"].astype(np.int32) - mirror["k"])
        assert k_diff.max() <= (1 if self.rope else 0)  # fp32 vs float64 rotation
        if self.case.scale_mode == "token":
            np.testing.assert_array_equal(got["v_scale"], mirror["v_scale"])
            np.testing.assert_allclose(got["k_scale"], mirror["k_scale"],
                                       rtol=1e-3 if self.rope else 0)
        assert np.array_equal(d["q"].numpy().view(np.uint16),
                              self.case.host["q"].view(np.uint16)), "q must not be modified"
        return error


# (head_dim, Hq, Hkv, kv_layout, scale_mode, scale_dtype, dtype, rope, table)
MATRIX = [
    (128, 32, 8, "bnsh", "token", "float32", "float16", "neox", True),
    (128, 32, 8, "bsnh", "token", "float16", "float16", "gptj", False),
    (128, 32, 8, "bnsh", "head", "float32", "bfloat16", None, False),
    (128, 32, 8, "bsnh", "tensor", "float32", "bfloat16", "neox", False),
    (128, 8, 8, "bnsh", "token", "float32", "float16", "gptj", True),     # group 1
    (128, 16, 2, "bsnh", "token", "float32", "bfloat16", "neox", True),   # group 8
    (128, 32, 2, "bnsh", "token", "float16", "float16", "neox", False),   # group 16
    (64, 16, 4, "bnsh", "token", "float32", "float16", "neox", True),
    (64, 8, 1, "bsnh", "head", "float32", "bfloat16", "gptj", False),
    (64, 4, 2, "bnsh", "tensor", "float32", "float16", None, False),
    (256, 16, 4, "bnsh", "token", "float32", "bfloat16", "gptj", True),
    (256, 16, 1, "bsnh", "token", "float16", "float16", "neox", False),  # group 16
    (256, 8, 8, "bnsh", "head", "float32", "float16", "neox", True),
]


@pytest.mark.parametrize("head_dim, hq, hkv, kv_layout, scale_mode, scale_dtype, dtype, rope, "
                         "table", MATRIX)
def test_append_and_run_matches_the_oracle(rng, stream, head_dim, hq, hkv, kv_layout, scale_mode,
                                           scale_dtype, dtype, rope, table):
    fused = Fused(rng, POSITIONS, rope=rope, table=table, num_q_heads=hq, num_kv_heads=hkv,
                  head_dim=head_dim, kv_layout=kv_layout, scale_mode=scale_mode,
                  scale_dtype=scale_dtype, dtype=dtype)
    fused.check(*fused.run(stream))
    assert fused.plan.error_flags(stream=stream) == 0
    fused.plan.close()


@pytest.mark.parametrize("head_dim, hq, hkv, kv_layout, scale_mode, scale_dtype, dtype, rope, "
                         "table", MATRIX[::2])
def test_append_and_run_with_hadamard_keys_matches_the_oracle(
        rng, stream, head_dim, hq, hkv, kv_layout, scale_mode, scale_dtype, dtype, rope, table):
    """key_transform="hadamard": K written as H RoPE(k) (bit-exact with quant.hadamard_rows
    without RoPE), q rotated and transformed in the kernel when the spec has RoPE."""
    fused = Fused(rng, POSITIONS, rope=rope, table=table, num_q_heads=hq, num_kv_heads=hkv,
                  head_dim=head_dim, kv_layout=kv_layout, scale_mode=scale_mode,
                  scale_dtype=scale_dtype, dtype=dtype, key_transform="hadamard")
    if not rope:  # the kernel leaves q alone: the caller passes it transformed
        q = fused.case.host["q"]
        fused.case.host["q"] = hadamard_rows(q).astype(q.dtype)
        fused.device["q"] = DeviceArray.from_numpy(fused.case.host["q"])
    fused.check(*fused.run(stream))
    assert fused.plan.error_flags(stream=stream) == 0
    fused.plan.close()


CONFIGS = {
    "cluster s8": TileConfig(num_warps=8, num_splits=8, min_split_tokens=128, cluster=True),
    "two tiles s8": TileConfig(num_warps=8, num_splits=8, min_split_tokens=256, cluster=True,
                               tiles=2),
    "global merge s5": TileConfig(num_warps=8, num_splits=5, min_split_tokens=128),
    "combine kernel s3": TileConfig(num_warps=4, num_splits=3, min_split_tokens=64,
                                    fused_merge=False),
    "one split": TileConfig(num_warps=8, num_splits=1, min_split_tokens=128),
    "two warps s16": TileConfig(num_warps=2, num_splits=16, min_split_tokens=32, stages=3),
}


@pytest.mark.parametrize("positions", [[1, 65, 1025, 3000], [15, 16, 17, 127], [4099, 0, 2, 129],
                                       [1023, 63, 4096, 1024]])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_every_launch_configuration_places_the_new_token(rng, stream, config, positions):
    """The new token lands in the last active split wherever that split starts: right after a
    tile, alone in its split, at position 0, at the last slot of the cache."""
    fused = Fused(rng, positions, rope="neox", table=True)
    fused.check(*fused.run(stream, config))
    fused.plan.close()


def test_positions_outside_the_cache_write_nothing_and_raise_the_flag(rng, stream):
    fused = Fused(rng, [CAPACITY, -1, 5, CAPACITY + 7], rope="gptj")
    out, lse = fused.run(stream)
    fused.check(out, lse)  # the oracle attends min(max(pos, 0), S_max) with q unrotated
    assert (out[1] == 0).all() and np.isneginf(lse[1]).all()
    assert fused.plan.error_flags(stream=stream) & ERROR_OUTSIDE_CACHE
    fused.plan.close()


@pytest.mark.parametrize("kv_layout, scale_mode, scale_dtype, rope, table, key_transform", [
    ("bnsh", "token", "float32", "neox", False, "none"),
    ("bsnh", "token", "float16", "gptj", True, "none"),
    ("bnsh", "tensor", "float32", None, False, "none"),
    ("bnsh", "token", "float32", "neox", True, "hadamard"),
    ("bsnh", "head", "float32", None, False, "hadamard"),
])
def test_the_cache_bytes_equal_the_unfused_append(rng, stream, kv_layout, scale_mode,
                                                  scale_dtype, rope, table, key_transform):
    """Same rows.cuh math in both kernels: identical K, V and scale bytes; outputs agree."""
    fused = Fused(rng, [7, 300, 2048], rope=rope, table=table, kv_layout=kv_layout,
                  scale_mode=scale_mode, scale_dtype=scale_dtype, key_transform=key_transform)
    c, d = fused.case, fused.device
    if key_transform != "none" and not rope:  # no RoPE: the caller passes q transformed
        c.host["q"] = hadamard_rows(c.host["q"]).astype(c.host["q"].dtype)
        d["q"] = DeviceArray.from_numpy(c.host["q"])
    copies = {name: DeviceArray.from_numpy(c.host[name]) for name in ("k", "v", "k_scale",
                                                                       "v_scale", "q")}
    out, _ = fused.run(stream)
    with AppendPlan.create(c.num_q_heads, c.num_kv_heads, c.head_dim, max_batch=c.batch,
                           kv_layout=kv_layout, scale_mode=scale_mode, scale_dtype=scale_dtype,
                           rope=rope, rope_theta=THETA, key_transform=key_transform) as append:
        positions = DeviceArray.from_numpy(c.host["seq_lens"])
        append.run(d["k_new"], d["v_new"], copies["k"], copies["v"], copies["k_scale"],
                   copies["v_scale"], positions, q=copies["q"] if rope else None,
                   cos_sin=d["cos_sin"], advance=True, stream=stream)
        unfused = DeviceArray.empty(d["out"].shape, d["out"].dtype)
        fused.plan.run(copies["q"], copies["k"], copies["v"], copies["k_scale"],
                       copies["v_scale"], positions, unfused, stream=stream)
        stream.synchronize()
    for name in ("k", "v", "k_scale", "v_scale"):
        assert np.array_equal(d[name].numpy().view(np.uint8),
                              copies[name].numpy().view(np.uint8)), name
    error = np.abs(out - unfused.numpy()).max() / np.abs(out).max()
    assert error <= 2e-3
    fused.plan.close()


def test_prepared_append_and_run_launches_bitwise_what_append_and_run_launches(rng, stream):
    """prepare_append_and_run validates append_and_run()'s arguments once; launch(stream) from
    the same starting caches writes bitwise the same out, lse and cache bytes (either
    early_reads) and raises the same flag (position S_max). After the next plan() the
    prepared call is stale (RuntimeError)."""
    fused = Fused(rng, [7, 300, 2048, CAPACITY], rope="neox", table=True)
    fused.check(*fused.run(stream))
    assert fused.plan.error_flags(stream=stream) & ERROR_OUTSIDE_CACHE
    expected = fused.state()
    for early_reads in (False, True):
        prepared = fused.prepare(early_reads)
        fused.launch_from_the_start(prepared, stream)
        for name, value in fused.state().items():
            assert value == expected[name], (early_reads, name)
        assert fused.plan.error_flags(stream=stream) & ERROR_OUTSIDE_CACHE, early_reads
    fused.plan.plan(fused.planned(), append=True)
    with pytest.raises(RuntimeError, match="planned again"):
        prepared.launch(stream)
    fused.plan.close()


def test_advance_lengths_bumps_only_positions_inside_the_cache(stream):
    case = Case.random(np.random.default_rng(3), [5], capacity=64)
    plan = case.make_plan()
    plan.plan([5])  # advance_lengths needs no fused-append kernel
    lengths = DeviceArray.from_numpy(np.array([0, 5, 63, 64, 70, -1], np.int32))
    plan.advance_lengths(lengths, 64, stream=stream)
    assert lengths.numpy(stream=stream).tolist() == [1, 6, 64, 64, 70, -1]
    plan.close()
