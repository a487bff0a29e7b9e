"""The Llama forward pass in torch: the GPU runner's model (the numpy one in reference.py is the
CPU reference it is tested against).

`TorchLlama` holds the weights of weights.py on a device in one dtype (float16 or bfloat16 on
CUDA; float32 on the CPU for the tests), with q/k/v fused into one projection and gate/up into
another. It keeps no sequence state: the attention backend (torch_attention.py,
int8_attention.py) owns the KV cache and the positions, and a batch of B sequences runs as

    logits = model.prefill(tokens [B, T], lengths, attention)    # the prompts, right-padded
    logits = model.decode(tokens [B], attention)                 # one token per sequence

`decode` allocates nothing the backend must know about: it writes the step's q/k/v projection
into `attention.qkv`, and every shape is fixed by B, so one decode step captures into a CUDA
graph (graph_step.py) that replays as the next step.
"""
from __future__ import annotations

import numpy as np
import torch

from .torch_attention import split_qkv

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with the statistics in float32, the result in x's dtype (Hugging Face's)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _tensor(array: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A copy of a (possibly read-only, memory-mapped) numpy array as a torch tensor."""
    return torch.tensor(np.asarray(array), dtype=dtype, device=device)


class TorchLayer:
    """One decoder block's tensors: matrices as (out_features, in_features)."""

    def __init__(self, layer, dtype: torch.dtype, device: torch.device):
        def put(*arrays):
            return _tensor(np.concatenate(arrays, axis=0), dtype, device)

        self.attn_norm, self.ffn_norm = put(layer.attn_norm), put(layer.ffn_norm)
        self.w_qkv = put(layer.wq, layer.wk, layer.wv)
        self.w_o = put(layer.wo)
        self.w_gate_up = put(layer.w_gate, layer.w_up)
        self.w_down = put(layer.w_down)


class TorchLlama:
    def __init__(self, weights, *, dtype: torch.dtype = torch.float16, device="cuda"):
        self.config = c = weights.config
        self.dtype, self.device = dtype, torch.device(device)
        self.embedding = _tensor(weights.embedding, dtype, self.device)
        tied = weights.lm_head is weights.embedding
        self.lm_head = self.embedding if tied else _tensor(weights.lm_head, dtype, self.device)
        self.final_norm = _tensor(weights.final_norm, dtype, self.device)
        self.layers = [TorchLayer(layer, dtype, self.device) for layer in weights.layers]
        self.qkv_width = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim

    def prefill(self, tokens: torch.Tensor, lengths, attention, *,
                all_logits: bool = False) -> torch.Tensor:
        """Starts B sequences: `tokens` `[B, T]` (int64, on the model's device), sequence b's
        prompt its first `lengths[b]` ids (the rest padding). Returns the logits of each
        prompt's last token `[B, vocab]` (float32), or of every position `[B, T, vocab]`."""
        c = self.config
        if tokens.dim() != 2:
            raise ValueError(f"tokens: expected [B, T] ids, got shape {tuple(tokens.shape)}")
        b, t = tokens.shape
        attention.start(lengths)
        x = self.embedding[tokens]                                    # [B, T, H]
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, c.rms_eps)
            q, k, v = split_qkv(h @ layer.w_qkv.t(), c.n_heads, c.n_kv_heads, c.head_dim)
            out = attention.prefill(i, q, k, v)                       # [B, T, Hq, D]
            x = x + out.reshape(b, t, -1).to(self.dtype) @ layer.w_o.t()
            x = x + self._mlp(layer, rms_norm(x, layer.ffn_norm, c.rms_eps))
        if not all_logits:
            last = torch.as_tensor([int(n) - 1 for n in lengths], device=self.device)
            x = x[torch.arange(b, device=self.device), last]          # [B, H]
        return self._logits(x)

    def decode(self, tokens: torch.Tensor, attention) -> torch.Tensor:
        """One step: `tokens` `[B]` (int64), each appended at its sequence's position (the
        backend's); returns the logits `[B, vocab]` (float32). The backend advances the
        positions at the end (on the device)."""
        c = self.config
        x = self.embedding[tokens]                                    # [B, H]
        qkv = attention.qkv
        attention.begin_step()
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, c.rms_eps)
            torch.mm(h, layer.w_qkv.t(), out=qkv)
            q, k, v = split_qkv(qkv, c.n_heads, c.n_kv_heads, c.head_dim)
            out = attention.decode(i, q, k, v)                        # [B, Hq, D]
            x = x + out.reshape(out.shape[0], -1) @ layer.w_o.t()
            x = x + self._mlp(layer, rms_norm(x, layer.ffn_norm, c.rms_eps))
        attention.end_step()
        return self._logits(x)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        x = rms_norm(x, self.final_norm, self.config.rms_eps)
        return (x @ self.lm_head.t()).float()

    @staticmethod
    def _mlp(layer: TorchLayer, h: torch.Tensor) -> torch.Tensor:
        gate, up = (h @ layer.w_gate_up.t()).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ layer.w_down.t()
