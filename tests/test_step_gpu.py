"""DecodeStep on the GPU: 20 steps of 4 layers (B=2, ragged) eagerly and by graph replay,
bitwise equal to each other and within tolerance of the float64 oracle run on a host mirror
of every layer's cache; the lengths advance once per step; errors raise before capture."""
from __future__ import annotations

import numpy as np
import pytest

from lowlevel_fd import ERROR_OUTSIDE_CACHE
from lowlevel_fd.append.reference import append_ref
from lowlevel_fd.driver import DeviceArray, dtypes, is_capturing
from lowlevel_fd.reference import decode_attention_ref, rope_table
from lowlevel_fd.step import DecodeStep, LayerBuffers

pytestmark = pytest.mark.gpu

LAYERS, STEPS, HQ, HKV, D = 4, 20, 16, 4, 128
LENGTHS, CAPACITY = [37, 300], 336  # ragged; room for STEPS new tokens; even (fp16 scales)
CACHES = ("k_cache", "v_cache", "k_scale", "v_scale")
# (kv_layout, scale_mode, scale_dtype, rope, RoPE angles from a table?)
CONFIGS = [("bnsh", "token", "float32", "neox", True), ("bsnh", "token", "float16", "gptj", False),
           ("bnsh", "head", "float32", None, False), ("bsnh", "tensor", "float32", "neox", True)]


class Model:
    """Host initial state and device buffers of LAYERS layers, and per-step random inputs."""

    def __init__(self, rng, kv_layout, scale_mode, scale_dtype, rope, table, *,
                 lengths=LENGTHS, capacity=CAPACITY, layers=LAYERS, steps=STEPS, fused=True,
                 early_reads=True):
        self.kv_layout, self.scale_mode, self.scale_dtype = kv_layout, scale_mode, scale_dtype
        self.rope, batch = rope, len(lengths)
        shape = ((batch, HKV, capacity, D) if kv_layout == "bnsh"
                 else (batch, capacity, HKV, D))
        scale_shape = {"token": (batch, HKV, capacity), "head": (HKV,), "tensor": (1,)}
        self.initial = []
        for _ in range(layers):
            host = {name: rng.integers(-127, 128, shape, dtype=np.int8)
                    for name in ("k_cache", "v_cache")}
            for name in ("k_scale", "v_scale"):
                dtype = np.dtype(scale_dtype) if scale_mode == "token" else np.float32
                host[name] = rng.uniform(0.004, 0.012, scale_shape[scale_mode]).astype(dtype)
            self.initial.append(host)
        self.lengths = np.asarray(lengths, np.int32)
        self.table = rope_table(capacity, D) if rope and table else None
        fp16 = dtypes.as_dtype("float16")
        self.inputs = [[tuple(rng.standard_normal((batch, heads, D)).astype(fp16)
                              for heads in (HQ, HKV, HKV)) for _ in range(layers)]
                       for _ in range(steps)]
        self.device = [{name: DeviceArray.from_numpy(value) for name, value in host.items()}
                       for host in self.initial]
        for d in self.device:
            d.update(q=DeviceArray.empty((batch, HQ, D), fp16),
                     k_new=DeviceArray.empty((batch, HKV, D), fp16),
                     v_new=DeviceArray.empty((batch, HKV, D), fp16),
                     out=DeviceArray.empty((batch, HQ, D), fp16))
        self.seq_lens = DeviceArray.from_numpy(self.lengths)
        cos_sin = None if self.table is None else DeviceArray.from_numpy(self.table)
        self.buffers = [LayerBuffers(cos_sin=cos_sin, **{k: v for k, v in d.items()
                                                         if k in LayerBuffers.__annotations__})
                        for d in self.device]
        self.step = DecodeStep.create(layers, HQ, HKV, D, max_batch=batch, max_seq_len=capacity,
                                      kv_layout=kv_layout, scale_mode=scale_mode,
                                      scale_dtype=scale_dtype, rope=rope, fused=fused,
                                      early_reads=early_reads).plan(self.lengths)
        self.fused = fused

    def restore(self, stream):
        for host, d in zip(self.initial, self.device):
            for name in CACHES:
                d[name].copy_from_numpy(host[name], stream=stream)
        self.seq_lens.copy_from_numpy(self.lengths, stream=stream)

    def run(self, launch, stream, steps=None):
        """From the initial state: per step, upload the inputs, poison the outputs, launch;
        returns per step and layer (out, rotated q) and the final caches and lengths."""
        self.restore(stream)
        results = []
        for inputs in self.inputs[:steps]:
            for d, (q, k, v) in zip(self.device, inputs):
                for name, value in (("q", q), ("k_new", k), ("v_new", v)):
                    d[name].copy_from_numpy(value, stream=stream)
                d["out"].fill(float("nan"), stream)
            launch()
            results.append([(d["out"].numpy(stream=stream), d["q"].numpy(stream=stream))
                            for d in self.device])
        final = [{name: d[name].numpy(stream=stream) for name in CACHES} for d in self.device]
        return results, final, self.seq_lens.numpy(stream=stream)

    def eager(self, stream):
        return lambda: self.step.eager(self.buffers, self.seq_lens, stream)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("kv_layout, scale_mode, scale_dtype, rope, table", CONFIGS)
def test_graph_replay_equals_eager_bitwise_and_the_oracle(rng, stream, kv_layout, scale_mode,
                                                          scale_dtype, rope, table, fused):
    model = Model(rng, kv_layout, scale_mode, scale_dtype, rope, table, fused=fused)
    eager, eager_final, eager_lens = model.run(model.eager(stream), stream)
    graph = model.step.capture(model.buffers, model.seq_lens, stream)
    replay, graph_final, graph_lens = model.run(lambda: graph.launch(stream), stream)

    # -- bitwise: every step, every layer, and the state the two passes end in --
    for step, (by_eager, by_graph) in enumerate(zip(eager, replay)):
        for layer, ((out, q), (g_out, g_q)) in enumerate(zip(by_eager, by_graph)):
            assert np.array_equal(out.view(np.uint16), g_out.view(np.uint16)), (step, layer)
            assert np.array_equal(q.view(np.uint16), g_q.view(np.uint16)), (step, layer)
    for layer, (a, b) in enumerate(zip(eager_final, graph_final)):
        for name in CACHES:
            assert np.array_equal(a[name].view(np.uint8), b[name].view(np.uint8)), (layer, name)
    # The lengths advanced once per step, not once per layer.
    assert eager_lens.tolist() == graph_lens.tolist() == (model.lengths + STEPS).tolist()
    assert model.step.error_flags(stream=stream) == 0

    # -- the oracle on a host mirror: append at L in every layer, attend L + 1 tokens --
    mirror = [{name: host[name].copy() for name in CACHES} for host in model.initial]
    lengths = model.lengths.copy()
    angle_atol = 1e-5 if model.table is not None else 1e-3
    for step, (inputs, outputs) in enumerate(zip(model.inputs, eager)):
        for layer, ((q, k, v), (out, q_rot), m) in enumerate(zip(inputs, outputs, mirror)):
            q_ref = append_ref(m["k_cache"], m["v_cache"], m["k_scale"], m["v_scale"],
                               lengths.copy(), k, v, kv_layout=kv_layout, scale_mode=scale_mode,
                               scale_dtype=np.dtype(scale_dtype), rope=rope,
                               cos_sin=model.table, q=q)
            if model.fused:  # q is left as given; the kernel rotates a copy
                assert np.array_equal(q_rot.view(np.uint16), q.view(np.uint16))
                q_rot = q_ref.astype(np.float16)
            np.testing.assert_allclose(q_rot.astype(np.float64), q_ref, rtol=2.0**-10,
                                       atol=angle_atol, err_msg=f"step {step} layer {layer}")
            ref, _ = decode_attention_ref(q_rot.astype(np.float32), m["k_cache"], m["v_cache"],
                                          m["k_scale"], m["v_scale"], lengths + 1,
                                          kv_layout=kv_layout, scale_mode=scale_mode)
            error = float(np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max())
            assert error <= 2e-3, f"step {step} layer {layer}: {error:.3e}"
        lengths += 1
    for layer, (got, m) in enumerate(zip(eager_final, mirror)):
        np.testing.assert_array_equal(got["v_cache"], m["v_cache"], err_msg=f"layer {layer}")
        np.testing.assert_array_equal(got["v_scale"], m["v_scale"], err_msg=f"layer {layer}")
        k_diff = np.abs(got["k_cache"].astype(np.int32) - m["k_cache"])
        assert k_diff.max() <= (1 if rope else 0), f"layer {layer}"  # fp32 vs float64 RoPE
        # RoPE'd absmax may differ by fp32 ulps: one fp16 scale step is at most 2^-10.
        np.testing.assert_allclose(got["k_scale"], m["k_scale"], rtol=1e-3 if rope else 0)
    graph.close()
    model.step.close()


@pytest.mark.parametrize("kv_layout, scale_mode, scale_dtype, rope, table", CONFIGS[:2])
def test_early_reads_change_no_bit(stream, kv_layout, scale_mode, scale_dtype, rope, table):
    # Layers > 0 start reading their lengths and caches while the previous layer's kernel
    # finishes (programmatic launch); the results must be those of waiting first.
    results = []
    for early_reads in (False, True):
        model = Model(np.random.default_rng(7), kv_layout, scale_mode, scale_dtype, rope, table,
                      early_reads=early_reads)
        graph = model.step.capture(model.buffers, model.seq_lens, stream)
        results.append(model.run(lambda: graph.launch(stream), stream)
                       + model.run(model.eager(stream), stream))
        graph.close()
        model.step.close()
    (waited, waited_final, waited_lens, *waited_eager), (early, early_final, early_lens,
                                                         *early_eager) = results
    for by_wait, by_early in ((waited, early), (waited_eager[0], early_eager[0])):
        for step, (a, b) in enumerate(zip(by_wait, by_early)):
            for layer, ((out, _), (e_out, _)) in enumerate(zip(a, b)):
                assert np.array_equal(out.view(np.uint16), e_out.view(np.uint16)), (step, layer)
    for a, b in zip(waited_final, early_final):
        for name in CACHES:
            assert np.array_equal(a[name].view(np.uint8), b[name].view(np.uint8)), name
    assert waited_lens.tolist() == early_lens.tolist()


def test_the_fused_graph_has_one_kernel_per_layer_and_one_advance(rng, stream):
    model = Model(rng, *CONFIGS[0], steps=1)
    model.run(model.eager(stream), stream)
    described = model.step.describe()
    assert described["launches_per_layer"] == 1  # append_and_run with the fused merge
    with model.step.capture(model.buffers, model.seq_lens, stream) as graph:
        assert graph.node_kinds() == {"kernel": LAYERS + 1}
        assert graph.node_count == described["nodes_per_step"] == LAYERS + 1
    model.step.close()


def test_the_unfused_graph_has_two_kernels_per_layer_and_one_copy(rng, stream):
    model = Model(rng, *CONFIGS[0], steps=1, fused=False)
    model.run(model.eager(stream), stream)
    described = model.step.describe()
    assert described["launches_per_layer"] == 2  # append + attention with the fused merge
    with model.step.capture(model.buffers, model.seq_lens, stream) as graph:
        assert graph.node_kinds() == {"kernel": 2 * LAYERS, "memcpy": 1}
        assert graph.node_count == described["nodes_per_step"] == 2 * LAYERS + 1
    model.step.close()


def test_rewritten_lengths_are_followed_by_the_next_replay(rng, stream):
    """seq_lens is the only state: resetting it replays the first step bit for bit."""
    model = Model(rng, *CONFIGS[1], steps=1)
    first, _, _ = model.run(model.eager(stream), stream)
    graph = model.step.capture(model.buffers, model.seq_lens, stream)
    for _ in range(3):
        graph.launch(stream)
    model.seq_lens.copy_from_numpy(model.lengths, stream=stream)
    for d, (q, k, v) in zip(model.device, model.inputs[0]):
        for name, value in (("q", q), ("k_new", k), ("v_new", v)):
            d[name].copy_from_numpy(value, stream=stream)
    graph.launch(stream)
    for d, (out, _) in zip(model.device, first[0]):
        assert np.array_equal(d["out"].numpy(stream=stream).view(np.uint16), out.view(np.uint16))
    assert model.seq_lens.numpy().tolist() == (model.lengths + 1).tolist()
    graph.close()
    model.step.close()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_a_full_cache_stops_writing_and_advancing_in_every_layer(rng, stream, fused):
    model = Model(rng, *CONFIGS[2], lengths=[CAPACITY - 1, 3], layers=2, steps=2, fused=fused)
    _, final, lengths = model.run(model.eager(stream), stream)
    assert lengths.tolist() == [CAPACITY, 5]  # step 2 found sequence 0 full
    assert model.step.error_flags(stream=stream, clear=False) & ERROR_OUTSIDE_CACHE
    # The bit comes from the kernel that skipped the write: append_and_run's (the attention
    # plan's word) fused, the append kernel's unfused. A fused step builds no AppendPlan.
    assert (model.step.append is None) == fused
    writer = model.step.attention if fused else model.step.append
    assert writer.error_flags(stream=stream) & ERROR_OUTSIDE_CACHE
    assert model.step.error_flags(stream=stream) == 0  # both words read and cleared
    model.step.close()


def test_bad_buffers_raise_before_capture_and_launch_nothing(rng, stream):
    model = Model(rng, *CONFIGS[0], steps=1)
    model.run(model.eager(stream), stream)
    before = model.seq_lens.numpy(stream=stream)
    bad = list(model.buffers)
    bad[2] = LayerBuffers(**{**bad[2].__dict__, "out": DeviceArray.empty((2, HQ, D), np.float32)})
    assert model.step.validate(model.buffers, model.seq_lens) is None
    with pytest.raises(TypeError, match=r"layers\[2\]\.out: expected dtype float16, got float32"):
        model.step.validate(bad, model.seq_lens)
    with pytest.raises(TypeError, match=r"layers\[2\]\.out: expected dtype float16, got float32"):
        model.step.capture(bad, model.seq_lens, stream)
    assert not is_capturing(stream)
    with pytest.raises(TypeError, match=r"layers\[2\]\.out: expected dtype float16"):
        model.step.eager(bad, model.seq_lens, stream)
    assert model.seq_lens.numpy(stream=stream).tolist() == before.tolist()
    model.step.close()
