"""The Llama model in a GGUF file: its configuration from the metadata and its tensors,
dequantized to numpy (float32 by default) in Hugging Face's layout.

RoPE layout, decided here: llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute)
reorders the rows of every head of attn_q and attn_k,

    W.reshape(n_head, 2, head_dim // 2, n_in).swapaxes(1, 2).reshape(W.shape)

so that the HF "rotate half" pairs (i, i + head_dim/2) become adjacent rows (2i, 2i + 1), the
pairs llama.cpp's normal (GPT-J style) RoPE rotates. We undo that permutation on load and rotate
with NeoX (rotate-half) RoPE, because then q, k and the KV cache hold exactly what Hugging Face
transformers computes for this checkpoint: the cache can be compared with any HF-layout reference
channel by channel, and a GPU runner uses lowlevel_fd's rope="neox" like it would for the
original model. Keeping the GGUF order with GPT-J rotation gives the same attention scores (both
q and k carry the same channel permutation, and each rotated pair is the same two channels); the
tests check that equivalence on the real weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class ModelConfig:
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_hidden: int
    rope_theta: float
    rms_eps: float
    vocab_size: int
    context_length: int

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.n_heads // self.n_kv_heads


@dataclass
class LayerWeights:
    """One decoder block; matrices are (out_features, in_features) like torch.nn.Linear."""
    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    ffn_norm: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray


@dataclass
class ModelWeights:
    config: ModelConfig
    embedding: np.ndarray   # (vocab, hidden)
    layers: list[LayerWeights]
    final_norm: np.ndarray
    lm_head: np.ndarray     # (vocab, hidden); the embedding itself when the model ties them


def open_gguf(path: str | Path):
    """A gguf.GGUFReader over `path` (memory-mapped; nothing is dequantized yet)."""
    import gguf  # imported here so that `locate` works on machines without the package

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path: no GGUF file at {path}")
    return gguf.GGUFReader(path)


def field(reader, key: str, default=None):
    """A metadata value as a Python str, int, float, bool or list (None, or `default`, if the key
    is absent). Read through `parts`/`data`, the reader's representation in every gguf release."""
    entry = reader.fields.get(key)
    if entry is None:
        return default
    import gguf

    kind = entry.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        inner = entry.types[-1]
        return [_scalar(entry.parts[i], inner) for i in entry.data]
    return _scalar(entry.parts[entry.data[0]], kind)


def _scalar(part: np.ndarray, kind):
    import gguf

    if kind == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    value = part.tolist()[0]
    return bool(value) if kind == gguf.GGUFValueType.BOOL else value


def read_config(reader) -> ModelConfig:
    """The configuration from the `llama.*` metadata. Features this runner does not implement
    (partial rotary dimensions, RoPE scaling) raise instead of producing a subtly wrong model."""
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"reader: general.architecture is {arch!r}; "
                         "this runner implements 'llama'")

    def need(key: str):
        value = field(reader, f"llama.{key}")
        if value is None:
            raise ValueError(f"reader: the GGUF has no llama.{key}")
        return value

    hidden, n_heads = int(need("embedding_length")), int(need("attention.head_count"))
    n_kv_heads = int(field(reader, "llama.attention.head_count_kv", n_heads))
    head_dim = int(field(reader, "llama.attention.key_length", hidden // n_heads))
    rope_dim = int(field(reader, "llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"reader: llama.rope.dimension_count {rope_dim} != head_dim {head_dim} "
                         "(partial rotary embeddings are not implemented)")
    scaling = field(reader, "llama.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"reader: llama.rope.scaling.type {scaling!r} is not implemented")
    if n_heads % n_kv_heads:
        raise ValueError(f"reader: {n_heads} query heads are not a multiple of "
                         f"{n_kv_heads} KV heads")
    vocab = field(reader, "llama.vocab_size")
    if vocab is None:  # older converters leave it out; the vocabulary itself is authoritative
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelConfig(
        n_layers=int(need("block_count")), hidden=hidden, n_heads=n_heads,
        n_kv_heads=n_kv_heads, head_dim=head_dim, ffn_hidden=int(need("feed_forward_length")),
        rope_theta=float(field(reader, "llama.rope.freq_base", 10000.0)),
        rms_eps=float(need("attention.layer_norm_rms_epsilon")), vocab_size=int(vocab),
        context_length=int(need("context_length")))


def unpermute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverts llama.cpp's q/k row permutation: rows (2i, 2i+1) of each head go back to
    (i, i + head_dim/2), the Hugging Face order that NeoX RoPE rotates."""
    out, n_in = weight.shape
    half = out // n_heads // 2
    return np.ascontiguousarray(
        weight.reshape(n_heads, half, 2, n_in).swapaxes(1, 2).reshape(out, n_in))


def permute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation itself (HF order to adjacent pairs), for the layout tests."""
    out, n_in = weight.shape
    half = out // n_heads // 2
    return np.ascontiguousarray(
        weight.reshape(n_heads, 2, half, n_in).swapaxes(1, 2).reshape(out, n_in))


def load_tensor(reader, name: str, dtype=np.float32) -> np.ndarray:
    """One tensor dequantized by gguf.quants (Q4_1, Q8_0, F32, ...), shaped like numpy/torch:
    GGUF lists dimensions innermost first, so (n_in, n_out) there is (n_out, n_in) here."""
    import gguf

    tensor = _tensor_index(reader).get(name)
    if tensor is None:
        raise KeyError(f"name: the GGUF has no tensor {name!r}")
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.ascontiguousarray(values.reshape(shape), dtype=dtype)


def _tensor_index(reader) -> dict:
    index = getattr(reader, "_llm_tensor_index", None)
    if index is None:
        index = {t.name: t for t in reader.tensors}
        reader._llm_tensor_index = index
    return index


def load_weights(reader, config: ModelConfig | None = None, dtype=np.float32) -> ModelWeights:
    """Every tensor of the model, dequantized to `dtype` (float32 or float64), q/k un-permuted."""
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"dtype must be float32 or float64, not {dtype}")
    config = config or read_config(reader)

    def get(name: str) -> np.ndarray:
        return load_tensor(reader, name, dtype)

    layers = []
    for i in range(config.n_layers):
        p = f"blk.{i}."
        layers.append(LayerWeights(
            attn_norm=get(p + "attn_norm.weight"),
            wq=unpermute_qk(get(p + "attn_q.weight"), config.n_heads),
            wk=unpermute_qk(get(p + "attn_k.weight"), config.n_kv_heads),
            wv=get(p + "attn_v.weight"), wo=get(p + "attn_output.weight"),
            ffn_norm=get(p + "ffn_norm.weight"), w_gate=get(p + "ffn_gate.weight"),
            w_up=get(p + "ffn_up.weight"), w_down=get(p + "ffn_down.weight")))
    embedding = get("token_embd.weight")
    # Tied embeddings (SmolLM2): the converter writes no output.weight, the LM head is the table.
    tied = "output.weight" not in _tensor_index(reader)
    weights = ModelWeights(config=config, embedding=embedding, layers=layers,
                           final_norm=get("output_norm.weight"),
                           lm_head=embedding if tied else get("output.weight"))
    _check_shapes(weights)
    return weights


def cast(weights: ModelWeights, dtype) -> ModelWeights:
    """The same weights in another float dtype (float64 for a tighter reference), without
    dequantizing again; a tied LM head stays the embedding table itself."""
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"dtype must be float32 or float64, not {dtype}")
    embedding = weights.embedding.astype(dtype)
    tied = weights.lm_head is weights.embedding
    layers = [LayerWeights(**{name: getattr(layer, name).astype(dtype)
                              for name in LayerWeights.__dataclass_fields__})
              for layer in weights.layers]
    return ModelWeights(config=weights.config, embedding=embedding, layers=layers,
                        final_norm=weights.final_norm.astype(dtype),
                        lm_head=embedding if tied else weights.lm_head.astype(dtype))


def _check_shapes(w: ModelWeights) -> None:
    c = w.config
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    expected = {"wq": (q, c.hidden), "wk": (kv, c.hidden), "wv": (kv, c.hidden),
                "wo": (c.hidden, q), "w_gate": (c.ffn_hidden, c.hidden),
                "w_up": (c.ffn_hidden, c.hidden), "w_down": (c.hidden, c.ffn_hidden)}
    for name, shape in expected.items():
        got = getattr(w.layers[0], name).shape
        if got != shape:
            raise ValueError(f"reader: blk.0 {name} has shape {got}, the config implies {shape}")
    if w.embedding.shape != (c.vocab_size, c.hidden):
        raise ValueError(f"reader: token_embd has shape {w.embedding.shape}, "
                         f"the config implies {(c.vocab_size, c.hidden)}")
