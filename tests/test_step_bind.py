"""DecodeStep.bind: the step's validated launches handed out one layer at a time (BoundStep),
for a model that runs its own work between layers. Without a GPU: the checks are validate()'s
and the launch sequence is _issue()'s. On the GPU: a bound step, with host work interleaved
between its layers, eagerly and captured, is bitwise the eager step."""
from __future__ import annotations

import numpy as np
import pytest
from stand_ins import DEVICE, fake

from lowlevel_fd.driver import DeviceArray
from lowlevel_fd.step import BoundStep, DecodeStep

LAYERS, B, HQ, HKV, D, CAPACITY = 3, 2, 9, 3, 64, 64
HOST_LENGTHS = np.array([10, 40])
SEQ_LENS = fake((B,), "int32")


class NotLaunched:
    def launch(self, stream):
        pytest.fail("a kernel was launched")


def planned(fused: bool = True, num_layers: int = LAYERS) -> DecodeStep:
    """A step in the state plan(HOST_LENGTHS) leaves, minus the GPU work (as test_step_cpu)."""
    step = DecodeStep.create(num_layers, HQ, HKV, D, max_batch=4, max_seq_len=CAPACITY,
                             rope="neox", fused=fused, device=DEVICE)
    step._host_lengths = HOST_LENGTHS.copy()
    step.attention._binder.planned(B, int(HOST_LENGTHS.max()) + 1)
    step.attention._split = NotLaunched()
    step.attention._split_append = NotLaunched() if fused else None
    if not fused:
        step.append._kernel = NotLaunched()
        step._arrays["positions"] = fake((4,), "int32")
    return step


def layer(**replace) -> dict:
    buffers = {"q": fake((B, HQ, D), "float16"), "k_new": fake((B, HKV, D), "float16"),
               "v_new": fake((B, HKV, D), "float16"),
               "k_cache": fake((B, HKV, CAPACITY, D), "int8"),
               "v_cache": fake((B, HKV, CAPACITY, D), "int8"),
               "k_scale": fake((B, HKV, CAPACITY), "float32"),
               "v_scale": fake((B, HKV, CAPACITY), "float32"),
               "out": fake((B, HQ, D), "float16")}
    return buffers | replace


def test_bind_validates_like_validate_and_names_the_layer():
    bound = planned().bind([layer() for _ in range(LAYERS)], SEQ_LENS)
    assert isinstance(bound, BoundStep) and bound.num_layers == LAYERS
    bad = [layer(), layer(k_new=fake((B, HKV, D), "bfloat16")), layer()]
    with pytest.raises(TypeError, match=r"layers\[1\]\.k_new: expected dtype float16"):
        planned().bind(bad, SEQ_LENS)
    with pytest.raises(RuntimeError, match=r"call plan\(seq_lens\) first"):
        DecodeStep.create(LAYERS, HQ, HKV, D, max_batch=4, max_seq_len=CAPACITY,
                          device=DEVICE).bind([layer()] * LAYERS, SEQ_LENS)


def _record(monkeypatch, step, log):
    p = step.attention._params
    monkeypatch.setattr(step.attention, "_launch", lambda append, stream: log.append(
        ("attention", append, p.out, p.early_reads)))
    monkeypatch.setattr(step.attention, "advance_lengths", lambda lengths, capacity, **kw:
                        log.append(("advance", lengths.ptr, capacity)))
    if step.append is not None:
        monkeypatch.setattr(step.append, "_launch", lambda grid, stream: log.append(
            ("append", step.append._params.advance)))
    monkeypatch.setattr(DeviceArray, "copy_from", lambda dst, src, stream=None: log.append(
        ("copy", dst.ptr, src.ptr)))


@pytest.mark.parametrize("fused", [True, False])
def test_begin_layers_end_issue_the_launches_of_eager_in_its_order(monkeypatch, fused):
    step = planned(fused=fused)
    buffers = [layer() for _ in range(LAYERS)]
    issued, bound_log = [], []
    _record(monkeypatch, step, issued)
    calls, lengths, capacity = step._prepared(buffers, SEQ_LENS)
    step._issue(calls, lengths, capacity, stream=None)
    _record(monkeypatch, step, bound_log)
    bound = step.bind(buffers, SEQ_LENS)
    bound.begin(None)
    for i in range(LAYERS):
        bound_log.append(("model work", i))  # what a model enqueues between layers
        bound.layer(i, None)
    bound.end(None)
    assert [entry for entry in bound_log if entry[0] != "model work"] == issued
    assert issued[-1] == (("advance", SEQ_LENS.ptr, CAPACITY) if fused else
                          ("attention", False, buffers[-1]["out"].ptr, 0))


def test_a_bound_step_is_stale_after_a_new_plan_and_after_close():
    step = planned()
    bound = step.bind([layer() for _ in range(LAYERS)], SEQ_LENS)
    step.attention._generation += 1  # what plan() does
    with pytest.raises(RuntimeError, match=r"BoundStep: the step was planned again"):
        bound.layer(0, None)
    step.close()
    with pytest.raises(RuntimeError, match=r"DecodeStep is closed"):
        bound.end(None)


# -- on the GPU --------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_a_bound_step_with_work_between_layers_is_bitwise_the_eager_step(rng, stream, fused):
    from lowlevel_fd.driver import capture, dtypes

    fp16 = dtypes.as_dtype("float16")
    lengths = np.array([17, 50], np.int32)
    step = DecodeStep.create(LAYERS, HQ, HKV, D, max_batch=B, max_seq_len=CAPACITY,
                             rope="neox", fused=fused).plan(lengths)
    initial = [{name: rng.integers(-127, 128, (B, HKV, CAPACITY, D), dtype=np.int8)
                for name in ("k_cache", "v_cache")} for _ in range(LAYERS)]
    for host in initial:
        for name in ("k_scale", "v_scale"):
            host[name] = rng.uniform(0.004, 0.012, (B, HKV, CAPACITY)).astype(np.float32)
    inputs = [{"q": rng.standard_normal((B, HQ, D)).astype(fp16),
               "k_new": rng.standard_normal((B, HKV, D)).astype(fp16),
               "v_new": rng.standard_normal((B, HKV, D)).astype(fp16)} for _ in range(LAYERS)]
    device = [{name: DeviceArray.from_numpy(value) for name, value in host.items()}
              | {"out": DeviceArray.empty((B, HQ, D), fp16)}
              | {name: DeviceArray.empty(value.shape, fp16) for name, value in given.items()}
              for host, given in zip(initial, inputs)]
    seq_lens = DeviceArray.from_numpy(lengths)

    def run(issue):
        """From the initial state; the inputs of layer i are uploaded by `issue` (eager: all
        before the step; bound: right before layer i, as a model's projection would be)."""
        for host, d in zip(initial, device):
            for name, value in host.items():
                d[name].copy_from_numpy(value, stream=stream)
        seq_lens.copy_from_numpy(lengths, stream=stream)
        issue()
        stream.synchronize()
        return ([d["out"].numpy() for d in device],
                [{n: d[n].numpy() for n in initial[0]} for d in device], seq_lens.numpy())

    staged = [{name: DeviceArray.from_numpy(value) for name, value in given.items()}
              for given in inputs]

    def upload(i):  # device to device: capturable, unlike a copy from pageable host memory
        for name, source in staged[i].items():
            device[i][name].copy_from(source, stream)

    def eager():
        for i in range(LAYERS):
            upload(i)
        step.eager(device, seq_lens, stream)

    bound = step.bind(device, seq_lens)

    def interleaved():
        bound.begin(stream)
        for i in range(LAYERS):
            upload(i)
            bound.layer(i, stream)
        bound.end(stream)

    expected = run(eager)
    for issue in (interleaved, None):
        if issue is None:  # the same, captured as one graph (uploads as memcpy nodes)
            with capture(stream) as graph:
                interleaved()
            issue = lambda: graph.launch(stream)  # noqa: E731
        got = run(issue)
        for a, b in zip(expected[0], got[0]):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
        for a, b in zip(expected[1], got[1]):
            for name in a:
                assert np.array_equal(a[name].view(np.uint8), b[name].view(np.uint8)), name
        assert expected[2].tolist() == got[2].tolist() == (lengths + 1).tolist()
    assert step.error_flags(stream=stream) == 0
