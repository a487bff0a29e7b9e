"""The GPU runner of tools/llm (torch): on the CPU, its Llama forward pass against the numpy
reference, its SDPA backend against the CPU attention, and the INT8 backend's host side (option
checks, the packing of ragged prompts for MultiPlan, the block table in every call) with the
library's plans replaced by fakes; on the GPU, the INT8 backend through lowlevel_fd against the
fp32-KV reference, and a graph-captured step against the eager one (test_llm_int8_gpu.py: paged
storage and the multi-token prefill).
Skipped without torch (CI installs none) and, like test_llm_cpu.py, without the model."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the GPU runner (tools/llm/torch_*.py) needs torch; "
                            "CI installs none")

from llm import gpu_report, locate  # noqa: E402
from llm.attention import CpuKVAttention  # noqa: E402
from llm.backends import INT8, NAMES, english_text, make_attention  # noqa: E402
from llm.measure import first_difference  # noqa: E402
from llm.reference import Llama  # noqa: E402
from llm.report_tables import markdown  # noqa: E402
from llm.torch_attention import SdpaAttention, split_qkv  # noqa: E402
from llm.torch_model import TorchLlama  # noqa: E402

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="torch sees no CUDA device")


@pytest.fixture(scope="module")
def weights():
    try:
        path = locate.find_gguf()
    except locate.ModelUnavailableError as exc:
        pytest.skip(f"SmolLM2 GGUF unavailable: {exc}")
    from llm.weights import load_weights, open_gguf
    return load_weights(open_gguf(path))


@pytest.fixture(scope="module")
def tok():
    from llm.tokenizer import Tokenizer
    from llm.weights import open_gguf
    try:
        return Tokenizer.from_gguf(open_gguf(locate.find_gguf()))
    except locate.ModelUnavailableError as exc:
        pytest.skip(f"SmolLM2 GGUF unavailable: {exc}")


TEXT = "The capital of France is Paris. The capital of Germany is Berlin, and"


# -- CPU: the torch forward pass and the SDPA backend ------------------------------------------
def test_torch_forward_matches_the_numpy_reference(weights, tok):
    ids = tok.encode(TEXT)
    full = Llama(weights).forward(ids)                          # [T, vocab], float32
    scale = np.abs(full).max()
    model = TorchLlama(weights, dtype=torch.float32, device="cpu")
    attention = SdpaAttention(weights.config, batch=2, capacity=32, dtype=torch.float32,
                              device="cpu")
    prompt = torch.tensor([ids[:7], ids[:7]])
    logits = model.prefill(prompt, [7, 4], attention, all_logits=True)  # ragged: 7 and 4
    assert np.abs(logits[0].numpy() - full[:7]).max() <= 1e-5 * scale
    assert np.abs(logits[1, :4].numpy() - full[:4]).max() <= 1e-5 * scale
    positions = [7, 4]
    for _ in range(4):                                          # decode, each at its own position
        step = model.decode(torch.tensor([ids[p] for p in positions]), attention)
        for b, p in enumerate(positions):
            assert np.abs(step[b].numpy() - full[p]).max() <= 1e-5 * scale, (b, p)
        positions = [p + 1 for p in positions]
    assert attention.positions.tolist() == positions


def test_last_token_logits_of_a_ragged_prefill(weights, tok):
    ids = tok.encode(TEXT)
    model = TorchLlama(weights, dtype=torch.float32, device="cpu")
    attention = make_attention("sdpa-fp32", weights.config, batch=2, capacity=16,
                               dtype=torch.float32, device="cpu")
    prompt = torch.tensor([ids[:6], ids[:6]])
    last = model.prefill(prompt, [6, 3], attention)
    full = model.prefill(prompt, [6, 3], attention, all_logits=True)
    # one row vs T rows through the LM head: the same values up to float32 rounding
    torch.testing.assert_close(last, torch.stack([full[0, 5], full[1, 2]]), rtol=0, atol=1e-4)


@pytest.mark.parametrize("cache_dtype, tolerance", [(torch.float32, 1e-5),
                                                     (torch.float16, 3e-3)])
def test_sdpa_backend_matches_the_cpu_attention(cache_dtype, tolerance):
    rng = np.random.default_rng(0)
    config = type("Config", (), {"n_layers": 2, "n_heads": 6, "n_kv_heads": 2, "head_dim": 64,
                                 "rope_theta": 1e5})()
    cpu = CpuKVAttention(2, 6, 2, 64, 1e5, 64)
    sdpa = SdpaAttention(config, batch=1, capacity=64, dtype=torch.float32,
                         cache_dtype=cache_dtype, device="cpu")
    q, k, v = (rng.standard_normal((5, h, 64)).astype(np.float32) for h in (6, 2, 2))
    sdpa.start([5])
    for layer in range(2):
        want = cpu(layer, q, k, v, 0)
        got = sdpa.prefill(layer, *(torch.from_numpy(x)[None] for x in (q, k, v)))[0]
        np.testing.assert_allclose(got.float().numpy(), want, atol=tolerance, rtol=tolerance)
    for position in range(5, 9):
        q, k, v = (rng.standard_normal((1, h, 64)).astype(np.float32) for h in (6, 2, 2))
        sdpa.begin_step()
        for layer in range(2):
            want = cpu(layer, q, k, v, position)[0]
            got = sdpa.decode(layer, *(torch.from_numpy(x) for x in (q, k, v)))[0]
            np.testing.assert_allclose(got.float().numpy(), want, atol=tolerance,
                                       rtol=tolerance)
        sdpa.end_step()
    assert sdpa.positions.tolist() == [9]


def test_split_qkv_views_one_projection_buffer():
    qkv = torch.arange(2 * 15 * 4, dtype=torch.float16).view(2, 60)
    q, k, v = split_qkv(qkv, 9, 3, 4)
    assert q.shape == (2, 9, 4) and k.shape == v.shape == (2, 3, 4)
    assert q.data_ptr() == qkv.data_ptr() and k.stride() == (60, 4, 1)
    assert torch.equal(v[1, 2], qkv[1, 56:60])


def test_backend_names():
    assert NAMES[0] == "sdpa-fp32" and len(NAMES) == 6
    config = type("Config", (), {"n_layers": 1, "n_heads": 9, "n_kv_heads": 3, "head_dim": 64,
                                 "rope_theta": 1e5})()
    sdpa = make_attention("sdpa-fp16", config, batch=1, capacity=16, dtype=torch.float32,
                          device="cpu")
    assert sdpa.name == "sdpa-float16" and sdpa.kv_bytes_per_token() == 2 * 3 * 64 * 2
    with pytest.raises(ValueError, match="name: expected one of"):
        make_attention("int8-page", config, batch=1, capacity=16, dtype=torch.float16)


def test_backend_name_variants_set_int8_options():
    from llm.backends import split_name
    assert split_name("int8-head") == ("int8-head", {})
    assert split_name("int8-token-fp16+sdpa-prefill+hnd") == (
        "int8-token-fp16", {"prefill": "sdpa", "storage": "hnd"})
    assert split_name("sdpa-fp32") == ("sdpa-fp32", {})
    assert split_name("int8-token-fp32+hadamard") == (
        "int8-token-fp32", {"key_transform": "hadamard"})
    for bad in ("sdpa-fp16+hadamard", "sdpa-fp16+hnd", "int8-head+flash", "int8-head+",
                "int8-page+nhd"):
        with pytest.raises(ValueError, match="name: expected one of"):
            split_name(bad)


def test_int8_options_are_checked_before_any_gpu_work():
    from llm.int8_attention import Int8Attention
    config = type("Config", (), {"n_layers": 1, "n_heads": 9, "n_kv_heads": 3, "head_dim": 64,
                                 "rope_theta": 1e5})()
    for options, message in (({"storage": "paged"}, "storage: expected one of"),
                             ({"page_size": 24}, "page_size: expected a power of two"),
                             ({"storage": "hnd", "page_size": 0}, "page_size: expected"),
                             ({"prefill": "flash"}, "prefill: expected one of"),
                             ({"scale_mode": "page"}, "scale_mode: expected one of"),
                             ({"key_transform": "walsh"}, "key_transform: expected one of")):
        with pytest.raises(ValueError, match=message):
            Int8Attention(config, batch=1, capacity=16, device="cpu", **options)
    with pytest.raises(ValueError, match="storage: expected one of"):
        make_attention("int8-head", config, batch=1, capacity=16, dtype=torch.float16,
                       device="cpu", storage="paged")


def test_first_difference_cuts_each_output_after_its_stop_token():
    stop = {2}
    assert first_difference([5, 6, 2, 9], [5, 6, 2, 7], stop) is None
    assert first_difference([5, 7, 2], [5, 6, 2], stop) == 1
    assert first_difference([5, 6, 8, 2], [5, 6, 2], stop) == 2
    assert first_difference([5, 6], [5, 6, 4], stop) == 2


def test_english_text_falls_back_to_docstrings(monkeypatch, tmp_path):
    import llm.backends as backends
    monkeypatch.setattr(backends, "GPL3", tmp_path / "missing")
    source, text = english_text(20000)
    assert source.startswith("the docstrings of") and len(text) >= 20000


def test_report_tables_render_every_section_and_failures():
    report = {"settings": {"dtype": "float16"}, "environment": {"gpu": "GPU"}, "sections": {
        "accuracy": {"chunks": [2, 40], "prompt_tokens": 8, "static_margin": 1.0,
                     "text": {"source": "text", "tokens": 99}, "rows": [
                         {"backend": "int8-token-fp32", "scored_tokens": 62,
                          "top1_agreement": 0.99, "top1_vs_text": 0.5, "ppl": 10.0,
                          "ref_ppl": 10.05, "delta_ppl": -0.005, "error_flags": 0},
                         {"backend": "int8-head", "error": "RuntimeError: x"}]},
        "generation": {"new_tokens": 4, "failures": [], "rows": [
            {"backend": "sdpa-fp32", "prompt": 0, "question": "Q?", "first_difference": None,
             "text": "A."},
            {"backend": "int8-tensor", "prompt": 0, "question": "Q?", "first_difference": 3,
             "text": "B."}]},
        "throughput": {"error": "CudaError: y"}}}
    text = markdown(report)
    assert "| int8-token-fp32 | 62 | 99.00% |" in text and "met" in text
    assert "int8-head | failed: `RuntimeError: x`" in text
    assert "| Q? | 3 |" in text and "int8-tensor (from token 3): 'B.'" in text
    assert "**throughput failed**: `CudaError: y`" in text


def test_report_without_a_gpu_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_report.main(["--out", str(tmp_path), "--quick"]) == 2


# -- CPU: the INT8 backend's host side, the library's plans replaced by fakes ----------------
class _FakePlan:
    """Records the calls the INT8 backend makes (PromptQuantizer, MultiPlan, DecodeStep)."""

    calls: list = []

    def __init__(self, spec, *args, **kwargs):
        self.spec = spec

    def __getattr__(self, name):
        def call(*args, **kwargs):
            _FakePlan.calls.append((type(self).__name__, name, args, kwargs))
            if name == "run" and type(self).__name__ == "FakeMulti":
                args[7].copy_(args[0])  # out = q rows: shows the packing and unpacking
        return call


@pytest.mark.parametrize("storage", ["contiguous", "nhd", "hnd"])
def test_int8_prefill_packs_ragged_prompts_for_the_multi_plan(monkeypatch, storage):
    import lowlevel_fd
    import llm.int8_attention as int8

    fakes = {name: type(name, (_FakePlan,), {}) for name in ("FakeMulti", "FakeQuantizer",
                                                                "FakeStep")}
    monkeypatch.setattr(lowlevel_fd, "MultiPlan", fakes["FakeMulti"])
    monkeypatch.setattr(lowlevel_fd, "PromptQuantizer", fakes["FakeQuantizer"])
    monkeypatch.setattr(lowlevel_fd, "DecodeStep", fakes["FakeStep"])
    monkeypatch.setattr(int8, "current_stream", lambda: 7)
    _FakePlan.calls = []
    config = type("Config", (), {"n_layers": 2, "n_heads": 9, "n_kv_heads": 3, "head_dim": 64,
                                 "rope_theta": 1e5})()
    attention = int8.Int8Attention(config, batch=3, capacity=32, device="cpu", storage=storage,
                                   page_size=8, page_seed=5)
    assert attention.spec.kv_layout == ("bnsh" if storage == "contiguous" else storage)
    assert attention.spec.page_size == (None if storage == "contiguous" else 8)
    table = attention.block_table
    if storage != "contiguous":
        assert table.shape == (3, 4) and table.dtype == torch.int32
        assert attention.cache.k.shape[:2] == (2, 12) and attention.settings()["num_pages"] == 12
    lengths, t = [5, 1, 3], 5
    attention.start(lengths)
    qkv = torch.randn(3, t, 15 * 64).half()
    q, k, v = split_qkv(qkv, 9, 3, 64)
    for layer in range(2):
        out = attention.prefill(layer, q, k, v)
        assert out.shape == (3, t, 9, 64) and out.dtype == torch.float16
        for b, n in enumerate(lengths):
            assert torch.equal(out[b, :n], q[b, :n]) and not out[b, n:].any()
    names = [(owner, name) for owner, name, _, _ in _FakePlan.calls]
    assert names == [("FakeQuantizer", "run"), ("FakeMulti", "plan"), ("FakeMulti", "run"),
                     ("FakeQuantizer", "run"), ("FakeMulti", "run")]  # planned once
    _, _, args, kwargs = _FakePlan.calls[1]
    assert args[0].tolist() == [0, 5, 6, 9] and args[1].tolist() == lengths
    assert kwargs == {"causal": True}
    for _, name, args, kwargs in _FakePlan.calls:
        if name == "run":
            assert kwargs["block_table"] is table and kwargs["stream"] == 7
    _, _, args, kwargs = _FakePlan.calls[3]  # the quantizer, layer 1
    assert args[2].data_ptr() == attention.cache.k[1].data_ptr() and args[6] is attention.seq_lens
    _, _, args, kwargs = _FakePlan.calls[-1]  # the multi-token attention, layer 1
    assert kwargs["rotate_q"] is True and args[5] is attention.seq_lens
    assert args[6].tolist() == [0, 5, 6, 9] and args[0].shape == (9, 9, 64)
    assert args[1].data_ptr() == attention.cache.k[1].data_ptr()
    attention.prepare_decode(8)
    layers = [c for c in _FakePlan.calls if c[1] == "bind"][0][2][0]
    assert len(layers) == 2 and all(layer.block_table is table for layer in layers)
    assert layers[1].k_cache.data_ptr() == attention.cache.k[1].data_ptr()


def test_int8_cache_gathers_pages_through_the_table():
    from llm.int8_storage import Int8Cache, cache_layout

    for storage in ("nhd", "hnd"):
        layout = cache_layout(storage, 4, batch=2, capacity=12, kv_heads=3, head_dim=64)
        cache = Int8Cache(layout, 1, device="cpu", page_seed=1)
        cache.fill_random(torch.Generator().manual_seed(0))
        k, scale = cache.contiguous(0, "k"), cache.contiguous(0, "k_scale")
        assert k.shape == (2, 3, 12, 64) and scale.shape == (2, 3, 12)
        for b in range(2):
            for pos in range(12):
                page, slot = int(cache.host_table[b, pos // 4]), pos % 4
                want = cache.k[0, page, slot] if storage == "nhd" else cache.k[0, page, :, slot]
                assert torch.equal(k[b, :, pos], want), (storage, b, pos)
                want = (cache.k_scale[0, page, slot] if storage == "nhd"
                        else cache.k_scale[0, page, :, slot])
                assert torch.equal(scale[b, :, pos], want)


# -- GPU: the INT8 backend through lowlevel_fd ------------------------------------------------
@pytest.fixture(scope="module")
def gpu_model(weights):
    if not CUDA:
        pytest.skip("torch sees no CUDA device")
    return TorchLlama(weights, dtype=torch.float16, device="cuda")


@pytest.fixture(autouse=True)
def created_stream(request):
    """GPU tests run on a created torch stream, as gpu_report.py does (the library's launches
    go to torch's current stream; the legacy default stream cannot be captured)."""
    if not CUDA or "gpu" not in request.keywords:
        yield
        return
    with torch.cuda.stream(torch.cuda.Stream()):
        yield
    torch.cuda.synchronize()


@pytest.mark.gpu
@needs_cuda
def test_int8_token_mode_agrees_with_the_fp32_reference(gpu_model, tok):
    from llm.measure import accuracy

    ids = tok.encode(english_text()[1], special=False)[:2 * 160]
    chunks = torch.tensor(ids).view(2, 160).cuda()
    result = accuracy(gpu_model, ["int8-token-fp32", "int8-token-fp16"], chunks, 16,
                      log=lambda message: None)
    rows = {row["backend"]: row for row in result["rows"]}
    for name in ("int8-token-fp32", "int8-token-fp16"):
        row = rows[name]
        assert row["scored_tokens"] == 2 * 143 and row["error_flags"] == 0
        assert row["top1_agreement"] >= 0.95, row
        assert abs(row["delta_ppl"]) <= 0.03, row


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["int8-token-fp32", "int8-head", "sdpa-fp16"])
def test_a_graph_step_is_bitwise_the_eager_step(gpu_model, tok, name):
    from llm.graph_step import GraphStep

    ids = tok.encode(TEXT)
    model, steps = gpu_model, 6
    attention = make_attention(name, model.config, batch=2, capacity=64, dtype=model.dtype)
    prompt = torch.tensor([ids[:8], ids[:8]]).cuda()
    model.prefill(prompt, [8, 5], attention)
    attention.prepare_decode(8 + steps)
    start = attention.save()
    feed = [torch.tensor([ids[8 + j], ids[5 + j]]).cuda() for j in range(steps)]
    eager = [model.decode(tokens, attention).clone() for tokens in feed]
    after_eager = attention.save()
    attention.restore(start)
    graph = GraphStep(model, attention)
    replayed = [graph.step(tokens).clone() for tokens in feed]
    torch.cuda.synchronize()
    for j, (a, b) in enumerate(zip(eager, replayed)):
        assert torch.equal(a, b), f"step {j}"
    assert torch.equal(attention.save(), after_eager)
    assert after_eager.tolist() == [8 + steps, 5 + steps]
    if hasattr(attention, "error_flags"):
        assert attention.error_flags() == 0
        attention.close()


@pytest.mark.gpu
@needs_cuda
def test_greedy_generation_answers_through_the_int8_cache(gpu_model, tok):
    from llm.measure import generation

    result = generation(gpu_model, tok, ["int8-token-fp32"],
                        ["What is the capital of France?"], 12, log=lambda message: None)
    answers = {row["backend"]: row["text"] for row in result["rows"]}
    assert "Paris" in answers["int8-token-fp32"] and "Paris" in answers["sdpa-fp32"]
    json.dumps(result)  # the report writes it as JSON


@pytest.mark.gpu
@needs_cuda
def test_every_int8_mode_runs_a_step(gpu_model):
    for name in INT8:
        attention = make_attention(name, gpu_model.config, batch=1, capacity=32,
                                   dtype=gpu_model.dtype)
        logits = gpu_model.prefill(torch.tensor([[1, 2, 3, 4]]).cuda(), [4], attention)
        attention.prepare_decode(4)
        step = gpu_model.decode(logits.argmax(-1), attention)
        assert torch.isfinite(step).all() and attention.positions.tolist() == [5]
        assert attention.error_flags() == 0
        attention.close()
