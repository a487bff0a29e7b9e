"""Specification of DecodeStep's checks without a GPU: the constructor, plan()'s host lengths,
and the per-layer buffers that capture() and eager() validate before anything is captured or
launched. Every error names the layer and the argument."""
from __future__ import annotations

import numpy as np
import pytest
from stand_ins import DEVICE, fake

from lowlevel_fd import KVCacheSpec
from lowlevel_fd.append.runner import PreparedAppend
from lowlevel_fd.decode import PreparedCall
from lowlevel_fd.driver import DeviceArray
from lowlevel_fd.step import DecodeStep, LayerBuffers

LAYERS, B, HQ, HKV, D, CAPACITY = 3, 2, 8, 2, 128, 64
HOST_LENGTHS = np.array([10, 40])


def make_step(**overrides) -> DecodeStep:
    options = dict(max_batch=4, max_seq_len=CAPACITY, device=DEVICE) | overrides
    return DecodeStep.create(options.pop("num_layers", LAYERS), options.pop("num_q_heads", HQ),
                             options.pop("num_kv_heads", HKV), options.pop("head_dim", D),
                             **options)


class NotLaunched:
    """A loaded kernel's launch that a test must never reach."""

    def launch(self, stream):
        pytest.fail("a kernel was launched")


def planned(**overrides) -> DecodeStep:
    """A step in the state plan(HOST_LENGTHS) leaves, minus the GPU work."""
    step = make_step(**overrides)
    step._host_lengths = HOST_LENGTHS.copy()
    attention = step.attention
    attention._binder.planned(B, int(HOST_LENGTHS.max()) + 1)  # L + 1 tokens attended
    attention._split = NotLaunched()
    attention._split_append = NotLaunched() if step.fused else None
    if not step.fused:
        step.append._kernel = NotLaunched()  # loaded: prepare_run() skips load()
        step._arrays["positions"] = fake((4,), "int32")
    return step


def layer(scale_mode="token", capacity=CAPACITY, **replace) -> dict:
    scale = {"token": (B, HKV, capacity), "head": (HKV,), "tensor": (1,)}[scale_mode]
    buffers = {"q": fake((B, HQ, D), "float16"), "k_new": fake((B, HKV, D), "float16"),
               "v_new": fake((B, HKV, D), "float16"),
               "k_cache": fake((B, HKV, capacity, D), "int8"),
               "v_cache": fake((B, HKV, capacity, D), "int8"),
               "k_scale": fake(scale, "float32"), "v_scale": fake(scale, "float32"),
               "out": fake((B, HQ, D), "float16")}
    return buffers | replace


def layers(count=LAYERS, **replace_in_last) -> list:
    return [layer() for _ in range(count - 1)] + [layer(**replace_in_last)]


SEQ_LENS = fake((B,), "int32")


# -- the constructor and plan() ----------------------------------------------------------------
@pytest.mark.parametrize("overrides, error, message", [
    ({"num_layers": 0}, ValueError,
     r"^num_layers: expected an int in \[1, 2147483648\), got 0$"),
    ({"num_layers": 2.0}, TypeError, r"^num_layers: expected an int, got float 2.0$"),
    ({"num_layers": True}, TypeError, r"^num_layers: expected an int, got bool True$"),
    ({"num_q_heads": 5}, ValueError,
     r"^num_q_heads: expected a multiple of num_kv_heads=2, got 5$"),
    ({"num_q_heads": 258}, ValueError,
     r"^group size \(num_q_heads // num_kv_heads\): expected 1\.\.128, got 129$"),
    ({"num_q_heads": 512}, ValueError,
     r"^group size \(num_q_heads // num_kv_heads\): expected 1\.\.128, got 256$"),
    ({"num_q_heads": 257}, ValueError,
     r"^num_q_heads: expected a multiple of num_kv_heads=2, got 257$"),
    ({"head_dim": 96}, ValueError, r"head_dim: expected one of \[64, 128, 256\], got 96"),
    ({"rope": "alibi"}, ValueError,
     r"rope: expected one of \[None, 'neox', 'gptj'\], got 'alibi'"),
    ({"scale_mode": "head", "scale_dtype": "float16"}, ValueError,
     r"scale_dtype: expected one of \['float32'\], got 'float16'"),
    ({"max_seq_len": 0}, ValueError,
     r"^max_seq_len: expected an int in \[1, 2147483648\), got 0$"),
    ({"max_batch": 0}, ValueError, r"^max_batch: expected an int in \[1, 2147483648\), got 0$"),
    ({"dtype": "float32"}, ValueError, r"^dtype: expected one of \['float16', 'bfloat16'\]"),
])
@pytest.mark.parametrize("fused", [True, False])
def test_constructor_rejects_unsupported_configurations(overrides, error, message, fused):
    with pytest.raises(error, match=message):
        make_step(fused=fused, **overrides)


@pytest.mark.parametrize("group", [1, 3, 5, 7, 12, 16, 24, 71, 128])
@pytest.mark.parametrize("fused", [True, False])
def test_constructor_accepts_every_group_up_to_128(group, fused):
    step = make_step(num_q_heads=HKV * group, fused=fused)
    assert step.attention.group_size == group and step.attention.num_q_heads == HKV * group
    if not fused:
        assert step.append.group_size == group and step.append.num_q_heads == HKV * group


def test_one_plan_of_each_kind_is_shared_by_the_layers():
    step = make_step(rope="neox", scale_mode="token", scale_dtype="float16", dtype="bfloat16",
                     fused=False)
    assert step.cache is step.append.cache is step.attention.cache
    assert step.cache == KVCacheSpec(HKV, D, rope="neox", scale_dtype="float16")
    assert step.attention.dtype == step.append.dtype == step.dtype == "bfloat16"
    assert step.attention.max_seq_len == CAPACITY and step.device is DEVICE
    assert step.attention.device is step.append.device is DEVICE


def test_a_fused_step_builds_no_append_plan():
    step = make_step(rope="gptj")  # fused by default
    assert step.fused and step.append is None
    assert step.attention.cache.rope == "gptj"  # the attention plan rotates and appends


def test_error_flags_are_one_int_read_on_a_stream():
    for fused in (True, False):
        step = make_step(fused=fused)
        with pytest.raises(TypeError, match=r"stream"):
            step.error_flags()
        flags = step.error_flags(stream=None)  # 0 before the first plan: nothing to read
        assert flags == 0 and type(flags) is int


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("lengths, error, message", [
    ([10, CAPACITY], ValueError, r"^seq_lens: sequence 1 has length 64, leaving no room "
                                 r"for the new token \(max_seq_len=64\)$"),
    ([1, 2, 3, 4, 5], ValueError, r"^seq_lens: expected at most max_batch=4 sequences"),
    ([-1], ValueError, r"^seq_lens: expected lengths in \[0, max_seq_len=64\]"),
    (np.array([1.5]), TypeError, r"^seq_lens: expected integer lengths"),
])
def test_plan_checks_the_host_lengths_before_any_gpu_work(lengths, error, message, fused):
    with pytest.raises(error, match=message):
        make_step(fused=fused).plan(lengths)


# -- capture()/eager(): the buffers ------------------------------------------------------------
@pytest.mark.parametrize("fused", [True, False])
def test_good_buffers_pass_as_mappings_or_layer_buffers(fused):
    given = layers()
    given[1] = LayerBuffers(**given[1])
    step = planned(fused=fused)
    assert step.validate(given, SEQ_LENS) is None
    calls, lengths, capacity = step._prepared(given, SEQ_LENS)
    assert len(calls) == LAYERS and lengths.ptr == SEQ_LENS.ptr
    assert capacity == {"capacity": CAPACITY, "block_table": None, "num_pages": None}
    outs = [given[0]["out"], given[1].out, given[2]["out"]]
    for layer_calls, out in zip(calls, outs):
        kinds = [type(call) for call in layer_calls]
        assert kinds == ([PreparedCall] if fused else [PreparedAppend, PreparedCall])
        assert layer_calls[-1]._params.out == out.ptr  # the attention binds that layer's out
        assert layer_calls[-1]._params.seq_lens == SEQ_LENS.ptr


def test_validation_needs_a_plan():
    with pytest.raises(RuntimeError, match=r"DecodeStep: call plan\(seq_lens\) first"):
        make_step().validate(layers(), SEQ_LENS)


BAD = {
    "k_new dtype": ({"k_new": fake((B, HKV, D), "bfloat16")}, TypeError,
                    r"layers\[2\]\.k_new: expected dtype float16, got bfloat16"),
    "v_new heads": ({"v_new": fake((B, HQ, D), "float16")}, ValueError,
                    r"layers\[2\]\.v_new: expected shape \[B, Hkv, D\]=\(2, 2, 128\)"),
    "q batch": ({"q": fake((B + 1, HQ, D), "float16")}, ValueError,
                r"layers\[2\]\.q: expected shape \[B, Hq, D\]=\(2, 8, 128\), got \(3, 8, 128\)"),
    "cache dtype": ({"k_cache": fake((B, HKV, CAPACITY, D), "uint8")}, TypeError,
                    r"layers\[2\]\.k_cache: expected dtype int8, got uint8"),
    "cache layout": ({"v_cache": fake((B, CAPACITY, HKV, D), "int8")}, ValueError,
                     r"layers\[2\]\.v_cache: expected the shape and strides of k_cache"),
    "scale shape": ({"k_scale": fake((B, HKV, 2 * CAPACITY), "float32")}, ValueError,
                    r"layers\[2\]\.k_scale: expected shape \[B, Hkv, S_max\]=\(2, 2, 64\)"),
    "out dtype": ({"out": fake((B, HQ, D), "float32")}, TypeError,
                  r"layers\[2\]\.out: expected dtype float16, got float32"),
    "lse shape": ({"lse": fake((B, HKV), "float32")}, ValueError,
                  r"layers\[2\]\.lse: expected shape \[B, Hq\]=\(2, 8\)"),
    "cos_sin without rope": ({"cos_sin": fake((CAPACITY, D // 2, 2), "float32")}, ValueError,
                             r"layers\[2\]\.cos_sin: the cache spec applies no RoPE"),
    "closed": ({"out": fake((B, HQ, D), "float16", owner=None)},
               ValueError, r"layers\[2\]\.out: the array is closed"),
    "host array": ({"q": np.zeros((B, HQ, D), np.float16)}, TypeError,
                   r"layers\[2\]\.q: expected a DeviceArray or an object with "
                   r"__cuda_array_interface__"),
    "missing": ({"q": None}, TypeError, r"layers\[2\]\.q: expected a device array, got None"),
}


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("replace, error, message", BAD.values(), ids=BAD.keys())
def test_a_bad_buffer_names_its_layer(replace, error, message, fused):
    with pytest.raises(error, match=message):
        planned(fused=fused).validate(layers(**replace), SEQ_LENS)


@pytest.mark.parametrize("fused", [True, False])
def test_a_cache_too_short_for_the_new_token_is_refused_before_launch(fused):
    # Sequence 1 holds 40 tokens: the new one would be the 41st; the plan attends 41.
    short = layer(capacity=40)
    with pytest.raises(ValueError, match=r"^layers\[0\]\.seq_lens: sequence 1 has length 40, "
                                         r"outside \[0, 39\] \(the new token must land below "
                                         r"the cache capacity S_max=40\); nothing was launched$"):
        planned(fused=fused).validate([short, layer(), layer()], SEQ_LENS)
    # Room for exactly the new token: accepted.
    planned(fused=fused).validate([layer(capacity=41) for _ in range(LAYERS)], SEQ_LENS)


@pytest.mark.parametrize("fused", [True, False])
def test_static_scales_follow_the_scale_mode(fused):
    step = planned(scale_mode="head", fused=fused)
    step.validate([layer("head") for _ in range(LAYERS)], SEQ_LENS)
    with pytest.raises(ValueError, match=r"layers\[0\]\.k_scale: expected shape \[Hkv\]=\(2,\) "
                                         r"for scale_mode='head', got \(1,\)"):
        step.validate([layer("tensor")] + [layer("head")] * 2, SEQ_LENS)


@pytest.mark.parametrize("given, error, message", [
    (lambda: layers(LAYERS - 1), ValueError,
     r"layers: expected 3 layers' buffers \(num_layers\), got 2"),
    (lambda: layer(), TypeError, r"layers: expected a sequence of 3 LayerBuffers, got dict"),
    (lambda: [layer(), layer(), ("q",)], TypeError,
     r"layers\[2\]: expected LayerBuffers or a mapping, got tuple"),
    (lambda: [layer(), layer(), {**layer(), "bias": None}], TypeError,
     r"layers\[2\]: unknown buffers \['bias'\], missing \[\]"),
    (lambda: [layer(), layer(), {"q": None}], TypeError,
     r"layers\[2\]: unknown buffers \[\], missing \['k_new', 'v_new', 'k_cache'"),
])
def test_the_layer_list_has_one_set_of_buffers_per_layer(given, error, message):
    with pytest.raises(error, match=message):
        planned().validate(given(), SEQ_LENS)


@pytest.mark.parametrize("seq_lens, error, message", [
    (fake((B,), "int64"), TypeError, r"^seq_lens: expected dtype int32, got int64$"),
    (fake((B + 1,), "int32"), ValueError, r"^seq_lens: expected shape \[B\]=\(2,\)"),
    (None, TypeError, r"^seq_lens: expected a device array, got None$"),
])
def test_seq_lens_is_one_device_array_for_all_layers(seq_lens, error, message):
    with pytest.raises(error, match=message):
        planned().validate(layers(), seq_lens)


@pytest.mark.parametrize("method", ["capture", "eager"])
def test_capture_and_eager_validate_before_touching_the_stream(method):
    # A stand-in stream the driver would reject: validation must fail first.
    with pytest.raises(TypeError, match=r"layers\[2\]\.k_cache: expected dtype int8"):
        getattr(planned(), method)(layers(k_cache=fake((B, HKV, CAPACITY, D), "float16")),
                                   SEQ_LENS, stream=object())


def test_describe_counts_one_launch_per_layer_and_one_per_step_when_fused():
    step = planned()
    step.attention._description = {"launches": 1}  # fused merge, as the planner picks
    described = step.describe()
    assert described["fused"] and described["launches_per_layer"] == 1
    assert described["launches_per_step"] == 1 and described["copies_per_step"] == 0
    assert described["nodes_per_step"] == 1 + LAYERS  # + advance_lengths


def test_describe_counts_two_launches_per_layer_and_one_copy_per_step_unfused():
    step = planned(fused=False)
    step.attention._description = {"launches": 1}  # fused merge, as the planner picks
    assert step.describe()["launches_per_layer"] == 2
    assert step.describe()["nodes_per_step"] == 1 + 2 * LAYERS
    single = make_step(num_layers=1, fused=False)
    single.attention._description = {"launches": 2}  # a separate combine kernel
    assert single.describe()["nodes_per_step"] == 3  # one layer needs no position copy


@pytest.mark.parametrize("option", ["fused", "early_reads"])
@pytest.mark.parametrize("value", [1, "yes", None])
def test_flags_must_be_bools(option, value):
    with pytest.raises(TypeError, match=rf"^{option}: expected a bool"):
        make_step(**{option: value})


def test_fused_step_needs_one_capacity_in_every_layer():
    buffers = [layer(), layer(capacity=CAPACITY + 16), layer()]
    with pytest.raises(ValueError, match=r"^layers: expected caches of one capacity S_max in "
                                         r"every layer .* got \[64, 80\]"):
        planned().validate(buffers, SEQ_LENS)
    planned(fused=False).validate(buffers, SEQ_LENS)  # unfused: each append checks its own


def test_a_closed_step_refuses_work():
    step = planned()
    step.close()
    with pytest.raises(RuntimeError, match=r"DecodeStep is closed"):
        step.validate(layers(), SEQ_LENS)


# -- the launch sequence, simulated on the host ------------------------------------------------
class Device32:
    """Host stand-ins for the int32 length arrays the launches read and write, keyed by address.
    The launches are the step's prepared calls: each one's parameter block says which lengths
    it reads; the append writes at ``lengths[b]`` (skipping a full cache) and bumps it when
    its block says advance."""

    def __init__(self, step, seq_lens, values, capacity):
        self.step, self.capacity, self.log = step, capacity, []
        self.memory = {seq_lens.ptr: np.array(values), step._arrays["positions"].ptr: None}

    def copy(self, dst, src, stream=None):
        self.memory[dst.ptr] = self.memory[src.ptr].copy()
        self.log.append("copy")

    def append(self, grid, stream):  # AppendPlan._launch, on the block the call copied in
        p = self.step.append._params
        lengths = self.memory[p.seq_lens]
        fits = lengths < self.capacity
        self.log.append(("append", tuple(np.where(fits, lengths, -1))))
        if p.advance:
            lengths[fits] += 1

    def attention(self, append, stream):  # DecodePlan._launch
        assert not append
        self.log.append(("attention", tuple(self.memory[self.step.attention._params.seq_lens])))


@pytest.mark.parametrize("num_layers", [1, 3])
@pytest.mark.parametrize("start, capacity", [((10, 40), CAPACITY), ((10, 63), 64),
                                             ((10, 64), 64)])
def test_each_layer_appends_at_l_and_attends_l_plus_1_and_lengths_advance_once(
        monkeypatch, num_layers, start, capacity):
    step = planned(num_layers=num_layers, fused=False)
    calls, lengths, planned_capacity = step._prepared(
        [layer(capacity=capacity) for _ in range(num_layers)], SEQ_LENS)
    assert planned_capacity["capacity"] == capacity
    sim = Device32(step, SEQ_LENS, start, capacity)  # the device lengths the step meets
    monkeypatch.setattr(DeviceArray, "copy_from", lambda dst, src, stream=None:
                        sim.copy(dst, src, stream))
    monkeypatch.setattr(step.append, "_launch", sim.append)
    monkeypatch.setattr(step.attention, "_launch", sim.attention)
    step._issue(calls, lengths, capacity, stream=None)

    L = np.array(start)
    written = tuple(np.where(L < capacity, L, -1))  # -1: full, nothing written
    after = tuple(np.minimum(L + 1, capacity))
    expected = ["copy"] if num_layers > 1 else []
    expected += [("append", written), ("attention", after)] * num_layers
    assert sim.log == expected
    assert tuple(sim.memory[SEQ_LENS.ptr]) == after  # once per step, however many layers


@pytest.mark.parametrize("num_layers", [1, 3])
def test_fused_layers_all_read_the_step_positions_then_one_advance(monkeypatch, num_layers):
    step = planned(num_layers=num_layers)
    assert step.append is None  # nothing but the attention plan's fused launches
    log = []
    p = step.attention._params
    monkeypatch.setattr(step.attention, "_launch", lambda append, stream: log.append(
        ("layer", append, p.append, p.seq_lens, p.out)))
    monkeypatch.setattr(step.attention, "advance_lengths", lambda lengths, capacity, **kw:
                        log.append(("advance", lengths.ptr, capacity)))
    buffers = [LayerBuffers(**layer()) for _ in range(num_layers)]
    calls, lengths, capacity = step._prepared(buffers, SEQ_LENS)
    step._issue(calls, lengths, capacity, stream=None)
    assert log == [("layer", True, 1, SEQ_LENS.ptr, b.out.ptr) for b in buffers] + [
        ("advance", SEQ_LENS.ptr, CAPACITY)]


@pytest.mark.parametrize("early_reads", [True, False])
def test_only_layers_after_the_first_read_early(monkeypatch, early_reads):
    # Layer 0 may follow the kernel that advanced the lengths (the previous step's), so it
    # waits for it before reading them; layer i > 0 follows layer i - 1, which writes neither
    # the lengths nor layer i's cache.
    step = planned(num_layers=3, early_reads=early_reads)
    flags = []
    monkeypatch.setattr(step.attention, "_launch", lambda append, stream: flags.append(
        bool(step.attention._params.early_reads)))
    monkeypatch.setattr(step.attention, "advance_lengths", lambda *a, **kw: None)
    calls, lengths, capacity = step._prepared([layer() for _ in range(3)], SEQ_LENS)
    step._issue(calls, lengths, capacity, stream=None)
    assert flags == [False, early_reads, early_reads]


# -- paged caches ---------------------------------------------------------------------------------
def paged_layer(table, pages=40) -> dict:
    ps = 16
    return layer(k_cache=fake((pages, ps, HKV, D), "int8"),
                 v_cache=fake((pages, ps, HKV, D), "int8"),
                 k_scale=fake((pages, ps, HKV), "float32"),
                 v_scale=fake((pages, ps, HKV), "float32"), block_table=table)


def test_a_paged_step_advances_with_its_one_table_and_pool_size():
    step = planned(kv_layout="nhd", page_size=16)
    table = fake((B, CAPACITY // 16), "int32")
    calls, lengths, advance = step._prepared([paged_layer(table) for _ in range(LAYERS)],
                                             SEQ_LENS)
    assert advance["capacity"] == CAPACITY and advance["num_pages"] == 40
    assert advance["block_table"].ptr == table.ptr
    other = fake((B, CAPACITY // 16), "int32")
    with pytest.raises(ValueError, match=r"^layers: expected one block_table and pools of one "
                                         r"size in every layer"):
        step.validate([paged_layer(table), paged_layer(other), paged_layer(table)], SEQ_LENS)
    with pytest.raises(ValueError, match=r"^layers: expected one block_table"):
        step.validate([paged_layer(table), paged_layer(table, pages=41), paged_layer(table)],
                      SEQ_LENS)
    with pytest.raises(ValueError, match=r"^layers\[1\]\.block_table: the cache spec is paged"):
        step.validate([paged_layer(table), paged_layer(None), paged_layer(table)], SEQ_LENS)
