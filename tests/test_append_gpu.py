"""AppendPlan and PromptQuantizer on the GPU against the numpy reference, and 100 decode steps
(append + attention) against the float64 oracle, eager and through one captured CUDA graph."""
from __future__ import annotations

import numpy as np
import pytest
from append_case import cache_state

from lowlevel_fd import ERROR_OUTSIDE_CACHE, ERROR_PROMPT_LENGTH, KVCacheSpec
from lowlevel_fd.append import AppendPlan, PromptQuantizer
from lowlevel_fd.append.reference import append_ref, prompt_ref
from lowlevel_fd.decode import DecodePlan
from lowlevel_fd.driver import DeviceArray, capture, dtypes
from lowlevel_fd.reference import decode_attention_ref, rope_ref, rope_table

pytestmark = pytest.mark.gpu

MODES = [("tensor", "float32"), ("head", "float32"), ("token", "float32"), ("token", "float16")]
# One rounding of the rotated q to the storage type, relative to the element.
Q_RTOL = {"float16": 2.0**-10, "bfloat16": 2.0**-7}


def upload(host):
    return {name: DeviceArray.from_numpy(value) for name, value in host.items()}


def download(device, names=("k_cache", "v_cache", "k_scale", "v_scale", "seq_lens")):
    return {name: device[name].numpy() for name in names}


def new_tokens(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtypes.as_dtype(dtype))


def cache_args(d):
    return (d["k_cache"], d["v_cache"], d["k_scale"], d["v_scale"], d["seq_lens"])


# -- (i) one token for a ragged batch, the whole support matrix --------------------------------
@pytest.mark.parametrize("scale_mode,scale_dtype", MODES)
@pytest.mark.parametrize("kv_layout", ["bnsh", "bsnh"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_append_matches_reference(rng, stream, head_dim, dtype, kv_layout, scale_mode,
                                  scale_dtype):
    batch, heads, group, capacity = 4, 2, 2, 40
    host = cache_state(rng, batch=batch, heads=heads, head_dim=head_dim, capacity=capacity,
                       kv_layout=kv_layout, scale_mode=scale_mode, scale_dtype=scale_dtype,
                       lengths=[0, 5, capacity - 1, 17])
    d = upload(host)
    # k and v are strided views into one fused qkv projection output.
    fused = new_tokens(rng, (batch, heads * (group + 2), head_dim), dtype)
    d_fused = DeviceArray.from_numpy(fused)
    q_heads = heads * group
    k_new, v_new = fused[:, q_heads:q_heads + heads], fused[:, q_heads + heads:]
    with AppendPlan.create(q_heads, heads, head_dim, max_batch=batch, kv_layout=kv_layout,
                           scale_mode=scale_mode, scale_dtype=scale_dtype,
                           dtype=dtype) as plan:
        plan.run(d_fused[:, q_heads:q_heads + heads], d_fused[:, q_heads + heads:],
                 *cache_args(d), stream=stream)
        stream.synchronize()
        assert plan.error_flags(stream=stream) == 0
    got = download(d)
    append_ref(host["k_cache"], host["v_cache"], host["k_scale"], host["v_scale"],
               host["seq_lens"].copy(), k_new, v_new, kv_layout=kv_layout,
               scale_mode=scale_mode, scale_dtype=scale_dtype)
    for name, expected in host.items():  # bitwise, NaN poison included: only row seq_len moved
        np.testing.assert_array_equal(got[name], expected, err_msg=name)


# -- (ii) RoPE in both styles, table and theta --------------------------------------------------
@pytest.mark.parametrize("source", ["table", "theta"])
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rope_on_q_and_k(rng, stream, head_dim, dtype, style, source):
    batch, heads, group, capacity, theta = 3, 2, 4, 1024, 500000.0
    host = cache_state(rng, batch=batch, heads=heads, head_dim=head_dim, capacity=capacity,
                       kv_layout="bnsh", scale_mode="token", scale_dtype="float32",
                       lengths=[0, 7, 1000])
    d = upload(host)
    q = new_tokens(rng, (batch, heads * group, head_dim), dtype)
    k_new, v_new = (new_tokens(rng, (batch, heads, head_dim), dtype) for _ in range(2))
    table = rope_table(capacity, head_dim, theta) if source == "table" else None
    d_q, d_q_out = DeviceArray.from_numpy(q), DeviceArray.empty(q.shape, q.dtype)
    with AppendPlan.create(heads * group, heads, head_dim, max_batch=batch, dtype=dtype,
                           rope=style, rope_theta=theta) as plan:
        plan.run(DeviceArray.from_numpy(k_new), DeviceArray.from_numpy(v_new), *cache_args(d),
                 q=d_q, q_out=d_q_out if style == "gptj" else None,
                 cos_sin=None if table is None else DeviceArray.from_numpy(table),
                 stream=stream)
        stream.synchronize()
    rotated = (d_q_out if style == "gptj" else d_q).numpy().astype(np.float64)
    if style == "gptj":  # q_out given: q itself is left alone
        np.testing.assert_array_equal(d_q.numpy(), q)
    got = download(d)
    q_ref = append_ref(host["k_cache"], host["v_cache"], host["k_scale"], host["v_scale"],
                       host["seq_lens"].copy(), k_new, v_new, kv_layout="bnsh",
                       scale_mode="token", rope=style, cos_sin=table, theta=theta, q=q)
    np.testing.assert_allclose(q_ref, rope_ref(q, host["seq_lens"], style=style, cos_sin=table,
                                               theta=theta))
    # The theta path rounds the angle pos * inv_freq to fp32: up to ~1e-4 rad at position 1000,
    # times the pair's magnitude. The table path differs from float64 by fp32 rounding only.
    angle_error = 1e-3 if source == "theta" else 1e-5
    np.testing.assert_allclose(rotated, q_ref, rtol=Q_RTOL[dtype], atol=angle_error)
    # Rotated K may cross an int8 rounding boundary: one step at most, and rarely.
    positions = host["seq_lens"]
    k_diff = np.stack([got["k_cache"][b, :, t].astype(np.int32) - host["k_cache"][b, :, t]
                       for b, t in enumerate(positions)])
    assert np.abs(k_diff).max() <= 1 and np.count_nonzero(k_diff) <= k_diff.size // 10 + 2
    for b, t in enumerate(positions):  # every other row is untouched
        got["k_cache"][b, :, t] = host["k_cache"][b, :, t]
    np.testing.assert_array_equal(got["k_cache"], host["k_cache"])
    np.testing.assert_allclose(got["k_scale"], host["k_scale"],
                               rtol=5e-4 if source == "theta" else 1e-5)
    np.testing.assert_array_equal(got["v_cache"], host["v_cache"])  # V is never rotated
    np.testing.assert_array_equal(got["v_scale"], host["v_scale"])


# -- (iii) saturation ---------------------------------------------------------------------------
@pytest.mark.parametrize("scale_mode", ["head", "tensor"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_values_beyond_127_scales_saturate_and_never_wrap(rng, stream, dtype, scale_mode):
    batch, heads, head_dim, capacity = 2, 4, 128, 16
    host = cache_state(rng, batch=batch, heads=heads, head_dim=head_dim, capacity=capacity,
                       kv_layout="bnsh", scale_mode=scale_mode, scale_dtype="float32",
                       lengths=[3, 9])
    host["k_scale"][:] = host["v_scale"][:] = 0.01  # |x| up to ~400 steps: most saturate
    d = upload(host)
    k_new, v_new = (new_tokens(rng, (batch, heads, head_dim), dtype, 4.0) for _ in range(2))
    k_new[0, 0, :4] = [1e4, -1e4, 60000, -60000]
    with AppendPlan.create(heads, heads, head_dim, max_batch=batch, dtype=dtype,
                           scale_mode=scale_mode) as plan:
        plan.run(DeviceArray.from_numpy(k_new), DeviceArray.from_numpy(v_new), *cache_args(d),
                 stream=stream)
        stream.synchronize()
    got = download(d)
    for b, pos in enumerate(host["seq_lens"]):
        for cache, x in ((got["k_cache"], k_new), (got["v_cache"], v_new)):
            row, value = cache[b, :, pos].astype(np.int32), x[b].astype(np.float32)
            assert row.min() >= -127 and row.max() <= 127
            beyond = np.abs(value) >= 127.5 * 0.01
            assert beyond.mean() > 0.5
            np.testing.assert_array_equal(row[beyond], np.sign(value[beyond]) * 127)
    assert got["k_cache"][0, 0, 3, :4].tolist() == [127, -127, 127, -127]
    append_ref(host["k_cache"], host["v_cache"], host["k_scale"], host["v_scale"],
               host["seq_lens"].copy(), k_new, v_new, kv_layout="bnsh", scale_mode=scale_mode)
    np.testing.assert_array_equal(got["k_cache"], host["k_cache"])
    np.testing.assert_array_equal(got["v_cache"], host["v_cache"])


# -- (iv) capacity and (v) advance ---------------------------------------------------------------
def small_setup(rng, lengths, capacity=8, rope=None):
    host = cache_state(rng, batch=len(lengths), heads=2, head_dim=64, capacity=capacity,
                       kv_layout="bsnh", scale_mode="token", scale_dtype="float32",
                       lengths=lengths)
    k_new, v_new = (new_tokens(rng, (len(lengths), 2, 64), "float16") for _ in range(2))
    plan = AppendPlan.create(4, 2, 64, max_batch=len(lengths), kv_layout="bsnh", rope=rope)
    return host, upload(host), DeviceArray.from_numpy(k_new), DeviceArray.from_numpy(v_new), plan


def test_capacity_exceeded_is_caught_on_the_host_before_launch(rng, stream):
    host, d, k_new, v_new, plan = small_setup(rng, [8, 2])
    with plan, pytest.raises(ValueError, match="host_seq_lens: sequence 0 has length 8, "
                                               r"outside \[0, 7\]"):
        plan.run(k_new, v_new, *cache_args(d), host_seq_lens=host["seq_lens"], stream=stream)
    stream.synchronize()
    for name, value in download(d).items():
        np.testing.assert_array_equal(value, host[name], err_msg=name)


def test_full_cache_is_guarded_on_the_device(rng, stream):
    host, d, k_new, v_new, plan = small_setup(rng, [8, 2, 10**6, -1], rope="neox")
    q = new_tokens(rng, (4, 4, 64), "float16")
    d_q = DeviceArray.from_numpy(q)
    with plan:
        plan.run(k_new, v_new, *cache_args(d), q=d_q, advance=True, stream=stream)
        assert plan.error_flags(stream=stream) & ERROR_OUTSIDE_CACHE
        assert plan.error_flags(stream=stream) == 0  # cleared by the read
    got = download(d)
    assert got["seq_lens"].tolist() == [8, 3, 10**6, -1]  # only the sequence written advanced
    for name in ("k_cache", "v_cache"):
        changed = np.any(got[name] != host[name], axis=(1, 2, 3))
        assert np.flatnonzero(changed).tolist() == [1], name
    for name in ("k_scale", "v_scale"):  # NaN-poisoned: written scales are numbers
        assert np.flatnonzero(~np.isnan(got[name]).all(axis=(1, 2))).tolist() == [1], name
    rotated = d_q.numpy()
    np.testing.assert_array_equal(rotated[[0, 2, 3]], q[[0, 2, 3]])  # untouched
    assert not np.array_equal(rotated[1], q[1])


def test_advance_bumps_the_device_lengths(rng, stream):
    host, d, k_new, v_new, plan = small_setup(rng, [0, 5, 6])
    with plan:
        for _ in range(2):
            plan.run(k_new, v_new, *cache_args(d), advance=True, stream=stream)
        stream.synchronize()
    got = download(d)
    assert got["seq_lens"].tolist() == [2, 7, 8]
    lengths = host["seq_lens"].copy()
    for _ in range(2):
        append_ref(host["k_cache"], host["v_cache"], host["k_scale"], host["v_scale"], lengths,
                   k_new.numpy(), v_new.numpy(), kv_layout="bsnh", scale_mode="token",
                   advance=True)
    for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
        np.testing.assert_array_equal(got[name], host[name], err_msg=name)


def test_prepared_run_launches_bitwise_what_run_launches(rng, stream):
    """AppendPlan.prepare_run validates run()'s arguments once; each launch(stream) writes what
    run() writes with the same arguments (caches, scales, rotated q, advanced lengths, the
    flag at a full cache), also when run() went to other buffers in between. After close()
    the prepared call raises RuntimeError."""
    batch, heads, group, head_dim, capacity = 4, 2, 2, 64, 8
    host = cache_state(rng, batch=batch, heads=heads, head_dim=head_dim, capacity=capacity,
                       kv_layout="bsnh", scale_mode="token", scale_dtype="float32",
                       lengths=[0, 5, capacity - 1, 3])
    q = new_tokens(rng, (batch, heads * group, head_dim), "float16")
    k_new, v_new = (new_tokens(rng, (batch, heads, head_dim), "float16") for _ in range(2))
    d_k, d_v = DeviceArray.from_numpy(k_new), DeviceArray.from_numpy(v_new)
    d_table = DeviceArray.from_numpy(rope_table(capacity, head_dim))
    by_run, by_prepared = upload(host), upload(host)
    by_run["q"], by_prepared["q"] = DeviceArray.from_numpy(q), DeviceArray.from_numpy(q)
    names = ("k_cache", "v_cache", "k_scale", "v_scale", "seq_lens", "q")
    plan = AppendPlan.create(heads * group, heads, head_dim, max_batch=batch, kv_layout="bsnh",
                             rope="neox")
    with plan:
        prepared = plan.prepare_run(d_k, d_v, *cache_args(by_prepared), q=by_prepared["q"],
                                    cos_sin=d_table, advance=True)
        for step in range(2):  # step 1 finds sequence 2 full: nothing written, flagged
            plan.run(d_k, d_v, *cache_args(by_run), q=by_run["q"], cos_sin=d_table,
                     advance=True, stream=stream)
            prepared.launch(stream)
            got, expected = download(by_prepared, names), download(by_run, names)
            for name in names:
                assert np.array_equal(got[name].view(np.uint8), expected[name].view(np.uint8)), (
                    step, name)
            assert bool(plan.error_flags(stream=stream) & ERROR_OUTSIDE_CACHE) == (step == 1)
        assert got["seq_lens"].tolist() == [2, 7, capacity, 5]
        # The oracle: the same two appends on the host (RoPE within one int8 step).
        lengths = host["seq_lens"].copy()
        for _ in range(2):
            append_ref(host["k_cache"], host["v_cache"], host["k_scale"], host["v_scale"],
                       lengths, k_new, v_new, kv_layout="bsnh", scale_mode="token",
                       rope="neox", cos_sin=rope_table(capacity, head_dim), advance=True)
        assert lengths.tolist() == got["seq_lens"].tolist()
        assert np.abs(got["k_cache"].astype(np.int32) - host["k_cache"]).max() <= 1
        np.testing.assert_array_equal(got["v_cache"], host["v_cache"])
        np.testing.assert_array_equal(got["v_scale"], host["v_scale"])  # NaN poison included
        np.testing.assert_allclose(got["k_scale"], host["k_scale"], rtol=1e-5)
    with pytest.raises(RuntimeError, match="closed"):
        prepared.launch(stream)


@pytest.mark.parametrize("group", [1, 5, 16, 24])  # exact, masked and chunked groups
@pytest.mark.parametrize("head_dim", [64, 256])
def test_q_rope_for_every_group_size(rng, stream, head_dim, group):
    """Up to 16 query heads per KV head: more rows than one round of the CTA holds."""
    batch, heads = 2, 4
    host = cache_state(rng, batch=batch, heads=heads, head_dim=head_dim, capacity=64,
                       kv_layout="bnsh", scale_mode="token", scale_dtype="float32",
                       lengths=[63, 11])
    d = upload(host)
    q = new_tokens(rng, (batch, heads * group, head_dim), "float16")
    k_new, v_new = (new_tokens(rng, (batch, heads, head_dim), "float16") for _ in range(2))
    d_q = DeviceArray.from_numpy(q)
    with AppendPlan.create(heads * group, heads, head_dim, max_batch=batch,
                           rope="neox") as plan:
        plan.run(DeviceArray.from_numpy(k_new), DeviceArray.from_numpy(v_new), *cache_args(d),
                 q=d_q, stream=stream)
        stream.synchronize()
    expected = rope_ref(q, host["seq_lens"], style="neox")
    np.testing.assert_allclose(d_q.numpy().astype(np.float64), expected, rtol=2.0**-10,
                               atol=1e-4)


# -- (vi) 100 decode steps: append + attention, eager and one captured graph --------------------
STEPS = 100


@pytest.mark.parametrize("fused", [False, True], ids=["append-then-attention", "fused"])
def test_hundred_decode_steps_eager_and_graph_replay(rng, stream, fused):
    batch, q_heads, heads, head_dim, capacity = 3, 32, 8, 128, 1152
    shape = (batch, heads, capacity, head_dim)
    initial = {"k_cache": rng.integers(-127, 128, shape, dtype=np.int8),
               "v_cache": rng.integers(-127, 128, shape, dtype=np.int8),
               "k_scale": rng.uniform(0.004, 0.012, shape[:3]).astype(np.float32),
               "v_scale": rng.uniform(0.004, 0.012, shape[:3]).astype(np.float32),
               "seq_lens": np.array([5, 300, 1000], np.int32)}  # ragged
    table = rope_table(capacity, head_dim)
    inputs = [(new_tokens(rng, (batch, q_heads, head_dim), "float16"),
               new_tokens(rng, (batch, heads, head_dim), "float16"),
               new_tokens(rng, (batch, heads, head_dim), "float16")) for _ in range(STEPS)]
    d = upload(initial)
    d_q, d_k, d_v = (DeviceArray.empty(x.shape, np.float16) for x in inputs[0])
    d_out, d_table = DeviceArray.empty(d_q.shape, np.float16), DeviceArray.from_numpy(table)
    spec = KVCacheSpec(heads, head_dim, rope="neox")  # one cache description for both plans
    append = AppendPlan(spec, q_heads, max_batch=batch)
    attention = DecodePlan(spec, q_heads, max_batch=batch, max_seq_len=capacity)
    # One plan for both passes: same splits, same bits. Both plan for the longest sequence
    # attending the whole capacity: plan(append=True) takes the cached lengths (it plans for
    # one more token each), so a full cache is planned as capacity - 1 cached tokens.
    if fused:
        attention.plan([capacity - 1] * batch, append=True)
    else:
        attention.plan([capacity] * batch)

    def decode_step():
        if fused:  # one launch appends and attends; q stays as given
            attention.append_and_run(d_q, d_k, d_v, d["k_cache"], d["v_cache"], d["k_scale"],
                                     d["v_scale"], d["seq_lens"], d_out, cos_sin=d_table,
                                     stream=stream)
            attention.advance_lengths(d["seq_lens"], capacity, stream=stream)
            return
        append.run(d_k, d_v, *cache_args(d), q=d_q, cos_sin=d_table, advance=True,
                   stream=stream)
        attention.run(d_q, d["k_cache"], d["v_cache"], d["k_scale"], d["v_scale"],
                      d["seq_lens"], d_out, stream=stream)

    def run_steps(launch):
        """All steps from the initial state; returns per-step (out, rotated q)."""
        for name, value in initial.items():
            d[name].copy_from_numpy(value, stream=stream)
        results = []
        for q, k, v in inputs:
            for dst, src in ((d_q, q), (d_k, k), (d_v, v)):
                dst.copy_from_numpy(src, stream=stream)
            d_out.fill(float("nan"), stream)
            launch()
            results.append((d_out.numpy(stream=stream), d_q.numpy()))
        return results

    eager = run_steps(decode_step)
    with capture(stream) as graph:  # the eager pass loaded and warmed both plans
        decode_step()
    replayed = run_steps(lambda: graph.launch(stream))
    for step, ((out, q_rot), (graph_out, graph_q)) in enumerate(zip(eager, replayed)):
        assert np.array_equal(graph_out.view(np.uint16), out.view(np.uint16)), f"step {step}"
        assert np.array_equal(graph_q.view(np.uint16), q_rot.view(np.uint16)), f"step {step}"

    mirror = {name: value.copy() for name, value in initial.items()}
    for step, ((q, k, v), (out, q_rot)) in enumerate(zip(inputs, eager)):
        q_ref = append_ref(mirror["k_cache"], mirror["v_cache"], mirror["k_scale"],
                           mirror["v_scale"], mirror["seq_lens"], k, v, kv_layout="bnsh",
                           scale_mode="token", rope="neox", cos_sin=table, q=q, advance=True)
        if fused:  # the kernel rotated a copy of q, rounded to fp16 as the append kernel does
            assert np.array_equal(q_rot.view(np.uint16), q.view(np.uint16))
            q_rot = q_ref.astype(np.float16)
        np.testing.assert_allclose(q_rot.astype(np.float64), q_ref, rtol=2.0**-10, atol=1e-5)
        ref, _ = decode_attention_ref(q_rot.astype(np.float32), mirror["k_cache"],
                                      mirror["v_cache"], mirror["k_scale"], mirror["v_scale"],
                                      mirror["seq_lens"])
        error = float(np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max())
        assert error <= 2e-3, f"step {step}: max|out-ref|/max|ref| = {error:.3e}"
    final = download(d)  # after the graph pass, which must end where the eager pass did
    assert final["seq_lens"].tolist() == (initial["seq_lens"] + STEPS).tolist()
    assert np.abs(final["k_cache"].astype(np.int32) - mirror["k_cache"]).max() <= 1
    np.testing.assert_array_equal(final["v_cache"], mirror["v_cache"])
    np.testing.assert_array_equal(final["v_scale"], mirror["v_scale"])
    np.testing.assert_allclose(final["k_scale"], mirror["k_scale"], rtol=1e-5)
    graph.close()
    append.close()
    attention.close()


# -- (vii) prompt quantization -------------------------------------------------------------------
def prompt_case(rng, *, prompt_layout, kv_layout, scale_mode="token", scale_dtype="float32",
                lengths=(0, 1, 37, 20), tokens=37, capacity=48, head_dim=128, dtype="float16",
                rope=None):
    batch, heads = len(lengths), 2
    host = cache_state(rng, batch=batch, heads=heads, head_dim=head_dim, capacity=capacity,
                       kv_layout=kv_layout, scale_mode=scale_mode, scale_dtype=scale_dtype,
                       lengths=lengths)
    shape = ((batch, tokens, heads, head_dim) if prompt_layout == "bsnh"
             else (batch, heads, tokens, head_dim))
    k, v = (new_tokens(rng, shape, dtype) for _ in range(2))
    quantizer = PromptQuantizer.create(heads, head_dim, max_batch=batch, kv_layout=kv_layout,
                                       prompt_layout=prompt_layout, scale_mode=scale_mode,
                                       scale_dtype=scale_dtype, dtype=dtype, rope=rope)
    return host, k, v, quantizer


@pytest.mark.parametrize("scale_mode,scale_dtype", MODES)
@pytest.mark.parametrize("kv_layout", ["bnsh", "bsnh"])
@pytest.mark.parametrize("prompt_layout", ["bsnh", "bnsh"])
def test_prompt_quantization_matches_reference(rng, stream, prompt_layout, kv_layout,
                                               scale_mode, scale_dtype):
    host, k, v, quantizer = prompt_case(rng, prompt_layout=prompt_layout, kv_layout=kv_layout,
                                        scale_mode=scale_mode, scale_dtype=scale_dtype)
    d = upload(host)
    d_written = DeviceArray.full(len(host["seq_lens"]), -7, np.int32)
    with quantizer:
        quantizer.run(DeviceArray.from_numpy(k), DeviceArray.from_numpy(v), *cache_args(d),
                      seq_lens_out=d_written, host_prompt_lens=host["seq_lens"], stream=stream)
        assert quantizer.error_flags(stream=stream) == 0
    got = download(d)
    written = prompt_ref(host["k_cache"], host["v_cache"], host["k_scale"], host["v_scale"],
                         host["seq_lens"], k, v, kv_layout=kv_layout,
                         prompt_layout=prompt_layout, scale_mode=scale_mode,
                         scale_dtype=scale_dtype)
    assert d_written.numpy().tolist() == written.tolist() == [0, 1, 37, 20]
    for name, expected in host.items():
        np.testing.assert_array_equal(got[name], expected, err_msg=name)


@pytest.mark.parametrize("source", ["table", "theta"])
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_prompt_quantization_with_rope(rng, stream, dtype, style, source):
    host, k, v, quantizer = prompt_case(rng, prompt_layout="bsnh", kv_layout="bsnh",
                                        dtype=dtype, head_dim=64, rope=style)
    table = rope_table(48, 64) if source == "table" else None
    d = upload(host)
    with quantizer:
        quantizer.run(DeviceArray.from_numpy(k), DeviceArray.from_numpy(v), *cache_args(d),
                      cos_sin=None if table is None else DeviceArray.from_numpy(table),
                      stream=stream)
        stream.synchronize()
    got = download(d)
    prompt_ref(host["k_cache"], host["v_cache"], host["k_scale"], host["v_scale"],
               host["seq_lens"], k, v, kv_layout="bsnh", scale_mode="token", rope=style,
               cos_sin=table)
    k_diff = got["k_cache"].astype(np.int32) - host["k_cache"]
    assert np.abs(k_diff).max() <= 1 and np.count_nonzero(k_diff) <= 58 * 2 * 64 // 10
    np.testing.assert_allclose(got["k_scale"], host["k_scale"], rtol=5e-5)
    np.testing.assert_array_equal(got["v_cache"], host["v_cache"])
    np.testing.assert_array_equal(got["v_scale"], host["v_scale"])


def test_prompt_lengths_are_clamped_and_flagged(rng, stream):
    host, k, v, quantizer = prompt_case(rng, prompt_layout="bnsh", kv_layout="bnsh",
                                        lengths=(60, 35, 10, -3), tokens=37, capacity=32)
    d = upload(host)
    with quantizer:
        quantizer.run(DeviceArray.from_numpy(k), DeviceArray.from_numpy(v), *cache_args(d),
                      seq_lens_out=d["seq_lens"], stream=stream)  # in place
        # ERROR_PROMPT_LENGTH: 60 > S and -3 < 0 were clamped; ERROR_OUTSIDE_CACHE: 37 and 35
        # > S_max were cut
        assert quantizer.error_flags(stream=stream) == ERROR_OUTSIDE_CACHE | ERROR_PROMPT_LENGTH
    got = download(d)
    written = prompt_ref(host["k_cache"], host["v_cache"], host["k_scale"], host["v_scale"],
                         host["seq_lens"], k, v, kv_layout="bnsh", prompt_layout="bnsh",
                         scale_mode="token")
    assert got["seq_lens"].tolist() == written.tolist() == [32, 32, 10, 0]
    for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
        np.testing.assert_array_equal(got[name], host[name], err_msg=name)
