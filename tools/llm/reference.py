"""The Llama forward pass in numpy, with a KV cache: the CPU reference for the GPU runner.

Per layer: x += o_proj(attention(rope(q), rope(k), v)) over RMSNorm(x), then
x += down(silu(gate(h)) * up(h)) with h = RMSNorm(x); at the end RMSNorm and the (tied) LM head.
Everything runs in the weights' dtype (float32, or float64 for a tighter reference). The
attention over the cache is delegated to a `KVAttention` backend (attention.py), the piece a
lowlevel_fd runner swaps in.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from .attention import CpuKVAttention, KVAttention
from .weights import LayerWeights, ModelWeights


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class Llama:
    """A Llama model with one sequence's state: `prefill` starts a sequence, `step` extends it."""

    def __init__(self, weights: ModelWeights, attention: KVAttention | None = None):
        self.weights = weights
        self.config = c = weights.config
        self.dtype = weights.embedding.dtype
        self.attention = attention or CpuKVAttention(
            c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.rope_theta, c.context_length,
            dtype=self.dtype)
        self.position = 0  # tokens in the cache: the next token's position

    def reset(self) -> None:
        self.position = 0
        self.attention.reset()

    def forward(self, tokens: Iterable[int]) -> np.ndarray:
        """Appends `tokens` to the sequence and returns their logits (T, vocab)."""
        ids = np.asarray(list(tokens), dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError("tokens must be a non-empty sequence of token ids")
        c = self.config
        if ids.min() < 0 or ids.max() >= c.vocab_size:
            raise ValueError(f"tokens: ids must lie in [0, {c.vocab_size}), "
                             f"got {ids.min()}..{ids.max()}")
        if self.position + ids.size > c.context_length:
            raise ValueError(f"tokens: {self.position} + {ids.size} tokens exceed the context "
                             f"length {c.context_length}")
        x = self.weights.embedding[ids]
        for i, layer in enumerate(self.weights.layers):
            x = x + self._attention_block(i, layer, rms_norm(x, layer.attn_norm, c.rms_eps))
            x = x + self._mlp(layer, rms_norm(x, layer.ffn_norm, c.rms_eps))
        self.position += ids.size
        x = rms_norm(x, self.weights.final_norm, c.rms_eps)
        return x @ self.weights.lm_head.T

    def prefill(self, tokens: Iterable[int]) -> np.ndarray:
        """Starts a new sequence with `tokens` (the prompt); returns the last token's logits."""
        self.reset()
        return self.forward(tokens)[-1]

    def step(self, token: int) -> np.ndarray:
        """Appends one token; returns its logits (vocab,)."""
        return self.forward([int(token)])[0]

    def generate(self, prompt: Iterable[int], max_new_tokens: int,
                 stop: Iterable[int] = ()) -> Iterator[int]:
        """Greedy decoding: yields up to `max_new_tokens` ids, ending after a `stop` id."""
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        stop = set(stop)
        if max_new_tokens == 0:
            return
        logits = self.prefill(prompt)
        for n in range(max_new_tokens):
            token = int(np.argmax(logits))
            yield token
            if token in stop or n + 1 == max_new_tokens:
                return
            logits = self.step(token)

    def _attention_block(self, index: int, layer: LayerWeights, h: np.ndarray) -> np.ndarray:
        c = self.config
        t = h.shape[0]
        q = (h @ layer.wq.T).reshape(t, c.n_heads, c.head_dim)
        k = (h @ layer.wk.T).reshape(t, c.n_kv_heads, c.head_dim)
        v = (h @ layer.wv.T).reshape(t, c.n_kv_heads, c.head_dim)
        out = self.attention(index, q, k, v, self.position)
        return out.reshape(t, c.n_heads * c.head_dim) @ layer.wo.T

    @staticmethod
    def _mlp(layer: LayerWeights, h: np.ndarray) -> np.ndarray:
        return (silu(h @ layer.w_gate.T) * (h @ layer.w_up.T)) @ layer.w_down.T
