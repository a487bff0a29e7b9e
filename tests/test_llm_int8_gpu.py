"""The INT8 backend of the GPU runner (tools/llm/int8_attention.py) on the GPU: paged storage
(nhd and hnd, pages in a random physical order) gives bitwise the logits, ids and cache bytes
of the contiguous cache; the prompt's multi-token attention (MultiPlan) is attention over the
dequantized INT8 cache it reads, and close to the older torch SDPA prefill; throughput's
random fill works over pages. Skipped without torch, a CUDA device or (where the model is
used) the GGUF; every test is marked `gpu`."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the GPU runner (tools/llm/torch_*.py) needs torch; "
                            "CI installs none")

from llm import locate  # noqa: E402
from lowlevel_fd import hadamard  # noqa: E402
from llm.backends import english_text, make_attention  # noqa: E402
from llm.torch_attention import causal_prompt_attention, rope_neox, split_qkv  # noqa: E402

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not CUDA, reason="torch sees no CUDA device")]
TEXT = "The capital of France is Paris. The capital of Germany is Berlin, and"
CACHE = ("k", "v", "k_scale", "v_scale")
# A model-shaped config that needs no weights: SmolLM2's heads, two layers.
SMALL = type("Config", (), {"n_layers": 2, "n_heads": 9, "n_kv_heads": 3, "head_dim": 64,
                            "rope_theta": 1e5})()


@pytest.fixture(scope="module")
def gguf_reader():
    from llm.weights import open_gguf
    try:
        return open_gguf(locate.find_gguf())
    except locate.ModelUnavailableError as exc:
        pytest.skip(f"SmolLM2 GGUF unavailable: {exc}")


@pytest.fixture(scope="module")
def tok(gguf_reader):
    from llm.tokenizer import Tokenizer
    return Tokenizer.from_gguf(gguf_reader)


@pytest.fixture(scope="module")
def model(gguf_reader):
    from llm.torch_model import TorchLlama
    from llm.weights import load_weights
    return TorchLlama(load_weights(gguf_reader), dtype=torch.float16, device="cuda")


@pytest.fixture(autouse=True)
def created_stream():
    """On a created torch stream, as gpu_report.py runs (the library launches on torch's
    current stream; the legacy default stream cannot be captured)."""
    with torch.cuda.stream(torch.cuda.Stream()):
        yield
    torch.cuda.synchronize()


def run_short(model, attention, prompt, lengths, feed) -> list:
    """The prefill's logits of every position, then one graph-replayed step per `feed` row."""
    from llm.graph_step import GraphStep

    logits = [model.prefill(prompt, lengths, attention, all_logits=True)]
    attention.prepare_decode(max(lengths) + len(feed) - 1)
    graph = GraphStep(model, attention)
    logits += [graph.step(tokens).clone() for tokens in feed]
    graph.close()
    torch.cuda.synchronize()
    return logits


# (storage, page_size): the contiguous cache first, the reference of the paged ones
STORAGES = [("contiguous", 16), ("nhd", 16), ("hnd", 4), ("nhd", 1)]


@pytest.mark.parametrize("name", ["int8-token-fp32", "int8-token-fp16", "int8-head",
                                  "int8-token-fp32+hadamard"])
def test_paged_storage_gives_the_contiguous_logits_and_cache_bitwise(model, tok, name):
    ids = tok.encode(TEXT)
    lengths, steps = [9, 6], 4
    prompt = torch.tensor([ids[:9], ids[:9]]).cuda()
    feed = [torch.tensor([ids[9 + j], ids[6 + j]]).cuda() for j in range(steps)]
    runs = {}
    for storage, page_size in STORAGES:
        attention = make_attention(name, model.config, batch=2, capacity=32, dtype=model.dtype,
                                   storage=storage, page_size=page_size, page_seed=7)
        try:
            logits = run_short(model, attention, prompt, lengths, feed)
            assert attention.error_flags() == 0, storage
            assert attention.positions.tolist() == [9 + steps, 6 + steps]
            assert attention.settings()["storage"] == storage
            cache = attention.cache
            if cache.layout.paged:  # pages in a random physical order
                assert not (cache.host_table.ravel()[1:] > cache.host_table.ravel()[:-1]).all()
            caches = {n: torch.stack([cache.contiguous(i, n)
                                      for i in range(model.config.n_layers)]) for n in CACHE}
            runs[(storage, page_size)] = logits, caches
        finally:
            attention.close()
    want_logits, want_caches = runs[STORAGES[0]]
    for key, (logits, caches) in list(runs.items())[1:]:
        for j, (got, want) in enumerate(zip(logits, want_logits)):
            assert torch.equal(got, want), (key, "prefill" if j == 0 else f"step {j}",
                                            (got - want).abs().max().item())
        for n in CACHE:
            assert torch.equal(caches[n], want_caches[n]), (key, n)


def dequantized(attention, layer: int, name: str) -> torch.Tensor:
    """Layer `layer`'s K or V as the kernels read it: int8 x scale, `[B, S, Hkv, D]` fp32."""
    values = attention.cache.contiguous(layer, name).float()        # [B, Hkv, S, D]
    scale = attention.cache.contiguous(layer, name + "_scale").float()
    if attention.scale_mode == "token":
        values = values * scale[..., None]
    else:                                                             # [Hkv] or [1]
        values = values * scale[None, :, None, None]
    return values.transpose(1, 2)


@pytest.mark.parametrize("name, storage, page_size", [
    ("int8-token-fp32", "contiguous", 16), ("int8-token-fp16", "nhd", 16),
    ("int8-token-fp32", "hnd", 2), ("int8-tensor", "nhd", 4), ("int8-head", "hnd", 8),
    ("int8-token-fp32+hadamard", "hnd", 16), ("int8-head+hadamard", "contiguous", 16)])
def test_multi_prefill_is_attention_over_the_dequantized_cache(name, storage, page_size):
    lengths, t = [13, 1, 7], 13
    c = SMALL
    attention = make_attention(name, c, batch=3, capacity=32, dtype=torch.float16,
                               storage=storage, page_size=page_size, page_seed=3)
    generator = torch.Generator(device="cuda").manual_seed(0)
    try:
        attention.start(lengths)
        for layer in range(c.n_layers):
            # views of one projection, as TorchLlama.prefill passes them
            qkv = torch.randn(3, t, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim,
                              generator=generator, device="cuda").half()
            q, k, v = split_qkv(qkv, c.n_heads, c.n_kv_heads, c.head_dim)
            out = attention.prefill(layer, q, k, v)
            assert out.shape == (3, t, 9, 64) and out.dtype == torch.float16
            cos, sin = attention.cos[None, :t], attention.sin[None, :t]
            keys, values = (dequantized(attention, layer, n)[:, :t] for n in ("k", "v"))
            # a Hadamard-key cache holds H RoPE(k): scores against H RoPE(q)
            h = (torch.from_numpy(hadamard(c.head_dim)).cuda()
                 if attention.key_transform == "hadamard" else None)
            q_rot, k_rot = rope_neox(q, cos, sin), rope_neox(k, cos, sin)
            if h is not None:
                q_rot, k_rot = q_rot.float() @ h, k_rot.float() @ h
            want = causal_prompt_attention(q_rot, keys, values, torch.float32)
            for b, n in enumerate(lengths):
                error = (out[b, :n].float() - want[b, :n]).abs().max().item()
                assert error <= 5e-3 * want[b, :n].abs().max().item(), (layer, b, error)
                assert not out[b, n:].any(), (layer, b, "padding rows")
            # the cache holds the rotated prompt K (the quantizer's write the MultiPlan read)
            for b, n in enumerate(lengths):
                error = (keys[b, :n] - k_rot[b, :n]).abs().max().item()
                assert error <= 0.01 * k_rot[b, :n].abs().max().item(), (layer, b, error)
        assert attention.error_flags() == 0
        assert attention.multi.describe()["total_q"] == sum(lengths)
    finally:
        attention.close()


def test_multi_prefill_is_close_to_the_sdpa_prefill(model, tok):
    """INT8 K/V in the prompt's attention (MultiPlan) against fp16 K/V (SDPA): the same
    predictions up to quantization noise. A CPU simulation (fake-quantized K/V in fp32) gave
    93-98% top-1 agreement, KL mean ~1e-3 and max <= 0.03 on these prompts."""
    ids = tok.encode(english_text()[1], special=False)
    lengths = [48, 30]
    prompt = torch.tensor([ids[:48], ids[100:148]]).cuda()
    logits = {}
    for prefill in ("multi", "sdpa"):
        attention = make_attention("int8-token-fp32", model.config, batch=2, capacity=64,
                                   dtype=model.dtype, prefill=prefill)
        try:
            logits[prefill] = model.prefill(prompt, lengths, attention, all_logits=True)
            torch.cuda.synchronize()
            assert attention.error_flags() == 0
        finally:
            attention.close()
    for b, n in enumerate(lengths):
        want, got = logits["sdpa"][b, :n], logits["multi"][b, :n]
        assert torch.isfinite(got).all()
        agreement = (want.argmax(-1) == got.argmax(-1)).float().mean().item()
        p, q = torch.log_softmax(want, -1), torch.log_softmax(got, -1)
        kl = (p.exp() * (p - q)).sum(-1)
        assert agreement >= 0.85, (b, agreement)
        assert kl.mean().item() <= 0.01 and kl.max().item() <= 0.15, (b, kl.mean(), kl.max())


@pytest.mark.parametrize("storage, page_size", [("nhd", 16), ("hnd", 8)])
def test_a_throughput_case_runs_over_random_pages(model, storage, page_size):
    from llm.throughput import case

    row = case(model, "int8-token-fp32", 2, 64, warmup=1, iters=2,
               int8_options={"storage": storage, "page_size": page_size})
    assert row["error_flags"] == 0 and row["storage"] == storage
    assert row["page_size"] == page_size and row["num_pages"] >= 2 * (64 // page_size)
    assert row["step_ms"]["median_ms"] > 0 and row["attention_ms"]["median_ms"] > 0
