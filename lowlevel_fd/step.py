"""DecodeStep: one decode step of an L-layer model, [append -> attention] per layer, as one
CUDA graph (or the same launches issued eagerly), with the lengths advancing on the device.

Fused (the default): one launch per layer, ``DecodePlan.append_and_run``, rotates the layer's
new token and query at position ``seq_lens[b]``, writes the token into the cache and attends
the ``seq_lens[b] + 1`` tokens; every layer reads the same ``seq_lens``, and one
``advance_lengths`` launch after the last layer bumps them:

    layer i   append_and_run at seq_lens              (writes at L, attends L + 1)
    advance   seq_lens[b] += 1 where the write happened

q is not modified (the rotated query lives in the kernel's shared memory). Layers after the
first pass ``early_reads`` (Hopper): each reads its lengths and cache while the previous
layer's kernel finishes, since that kernel writes neither (``early_reads=False`` waits).

Unfused (``fused=False``): the append kernel (AppendPlan, which also rotates q in place) then
attention. The append kernel writes the new token at ``lengths[b]`` and can bump that same
array; attention reads ``lengths[b]`` tokens. Every layer must write at the step's position L
and attend L + 1 tokens, yet only one launch may bump the lengths. So the step issues:

    copy      positions <- seq_lens                   (4*B bytes; skipped for one layer)
    layer 0   append at seq_lens, advance=True        (seq_lens: L -> L + 1)
              attention over seq_lens                 (L + 1 tokens: sees the new token)
    layer i   append at positions, advance=False      (positions is still L)
    (i >= 1)  attention over seq_lens                 (L + 1)

``positions`` is a device array the step owns. Re-copying it every step (instead of bumping a
second counter) keeps ``seq_lens`` the single source of truth: the caller may rewrite it between
steps (a new request, a rollback) and the next step follows. A full cache stays consistent in
both modes: if ``seq_lens[b]`` is S_max, no layer writes, nothing advances, every layer attends
the S_max tokens it has, and bit 0 of the error flags is set (``error_flags()["append"]``
unfused, ``["attention"]`` fused).

The plans are shared by the layers. That is safe because a launch copies its parameter block
when it is issued (and a captured kernel node keeps that copy), and because the attention
workspace (split partials, merge counters, reset by the merging CTA) is only ever used by one
layer at a time: all launches go to one stream, in order. Graph replay and ``eager`` issue the
same launches with the same parameters in the same order, so their outputs are bitwise equal.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

import numpy as np

from .append import AppendPlan
from .append import bind as append_bind
from .decode import DecodePlan
from .decode import validate as check
from .decode.bind import bind_arguments
from .decode.params import DecodeParams
from .driver import Device, DeviceArray, Graph, capture
from .driver.stream import StreamLike


@dataclass(frozen=True)
class LayerBuffers:
    """One layer's device buffers for a step. q, out: ``[B, Hq, D]`` fp16/bf16 (the unfused
    step rotates q in place when it applies RoPE; the fused one leaves it); k_new, v_new:
    ``[B, Hkv, D]``; caches and scales as in ``DecodePlan.run``; cos_sin: optional fp32 RoPE
    table; lse: optional fp32 ``[B, Hq]``."""

    q: Any
    k_new: Any
    v_new: Any
    k_cache: Any
    v_cache: Any
    k_scale: Any
    v_scale: Any
    out: Any
    cos_sin: Any = None
    lse: Any = None


_FIELDS = tuple(f.name for f in fields(LayerBuffers))


def _close(arrays: dict[str, DeviceArray]) -> None:
    for array in arrays.values():
        array.close()
    arrays.clear()


class DecodeStep:
    """L layers' decode step: per layer, the RoPE + quantize + append of the new token and
    attention over the cache including it; one launch per layer (``fused``, plus one per step
    for the lengths) or two (AppendPlan then DecodePlan). ``plan`` does the host work,
    ``capture`` returns a Graph that replays the whole step, ``eager`` issues the same
    launches without one."""

    def __init__(self, num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int, *,
                 max_batch: int, max_seq_len: int, kv_layout: str = "bnsh",
                 scale_mode: str = "token", scale_dtype: str = "float32",
                 dtype: str = "float16", rope: str | None = None, rope_theta: float = 10000.0,
                 sm_scale: float | None = None, fused: bool = True,
                 early_reads: bool = True, device: Device | None = None) -> None:
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
            raise ValueError(f"num_layers: expected a positive int, got {num_layers!r}")
        self.fused = check.flag("fused", fused)
        # fused: append_and_run(early_reads=...) for the layers after the first
        self.early_reads = check.flag("early_reads", early_reads)
        device = check.device_option(device)  # both plans share it
        self.num_layers = num_layers
        self.append = AppendPlan(num_q_heads, num_kv_heads, head_dim, max_batch=max_batch,
                                 kv_layout=kv_layout, scale_mode=scale_mode,
                                 scale_dtype=scale_dtype, dtype=dtype, rope=rope,
                                 rope_theta=rope_theta, device=device)
        self.attention = DecodePlan(num_q_heads, num_kv_heads, head_dim, max_batch=max_batch,
                                    max_seq_len=max_seq_len, q_dtype=dtype, kv_layout=kv_layout,
                                    scale_mode=scale_mode, scale_dtype=scale_dtype,
                                    sm_scale=sm_scale, rope=rope, rope_theta=rope_theta,
                                    device=device)
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.max_batch, self.max_seq_len, self.rope = max_batch, max_seq_len, rope
        self.device = device
        self._host_lengths: np.ndarray | None = None
        self._arrays: dict[str, DeviceArray] = {}
        self._finalizer = weakref.finalize(self, _close, self._arrays)

    # -- plan ---------------------------------------------------------------------------------
    def plan(self, host_lengths: Any) -> "DecodeStep":
        """Plan for these host lengths ``[B]`` (tokens in the cache before the step): attention
        is planned for ``L + 1`` tokens, both kernels are compiled and loaded, the positions
        buffer is allocated. Recapture any graph afterwards."""
        self._require_open()
        lengths = check.host_lengths("host_lengths", host_lengths, self.max_batch,
                                     self.max_seq_len)
        full = np.flatnonzero(lengths >= self.max_seq_len)
        if full.size:
            b = int(full[0])
            raise ValueError(f"host_lengths: sequence {b} has length {int(lengths[b])}, leaving "
                             f"no room for the step's new token (max_seq_len="
                             f"{self.max_seq_len})")
        self.attention.plan(lengths + 1, append=self.fused)
        if not self.fused:
            self.append.load()
        if "positions" not in self._arrays and not self.fused:
            self._arrays["positions"] = DeviceArray.full(self.max_batch, 0, np.int32,
                                                         self.device)
        self._host_lengths = lengths
        return self

    # -- validation ---------------------------------------------------------------------------
    def validate(self, layers: Sequence[Any], seq_lens: Any) -> tuple[list[LayerBuffers], Any]:
        """Check every layer's buffers and ``seq_lens`` (int32 ``[B]`` on the device) against
        the plan; ValueError/TypeError name the layer and the argument. Launches nothing."""
        bound, lengths, _ = self._checked(layers, seq_lens)
        return bound, lengths

    def _checked(self, layers: Sequence[Any], seq_lens: Any
                 ) -> tuple[list[LayerBuffers], DeviceArray, int]:
        """validate(), plus the layers' cache capacity S_max (of the first layer)."""
        self._require_open()
        if self._host_lengths is None:
            raise RuntimeError("DecodeStep: call plan(host_lengths) first")
        batch = int(self._host_lengths.size)
        if isinstance(layers, (str, bytes, Mapping)) or not isinstance(layers, Sequence):
            raise TypeError(f"layers: expected a sequence of {self.num_layers} LayerBuffers, "
                            f"got {type(layers).__name__}")
        if len(layers) != self.num_layers:
            raise ValueError(f"layers: expected {self.num_layers} layers' buffers (num_layers), "
                             f"got {len(layers)}")
        lengths = append_bind.lengths("seq_lens", seq_lens, self.append, batch)
        checked = [self._layer(i, layer, lengths, batch) for i, layer in enumerate(layers)]
        capacities = {capacity for _, capacity in checked}
        if self.fused and len(capacities) > 1:  # one advance_lengths serves every layer
            raise ValueError(f"layers: expected caches of one capacity S_max in every layer "
                             f"(the fused step advances the lengths once), got "
                             f"{sorted(capacities)}")
        return [layer for layer, _ in checked], lengths, checked[0][1]

    def _layer(self, index: int, layer: Any, lengths: DeviceArray,
               batch: int) -> tuple[LayerBuffers, int]:
        name = f"layers[{index}]"
        if isinstance(layer, Mapping):
            unknown = sorted(set(layer) - set(_FIELDS))
            missing = [f for f in _FIELDS[:8] if f not in layer]
            if unknown or missing:
                raise TypeError(f"{name}: unknown buffers {unknown}, missing {missing}; "
                                f"expected the fields of LayerBuffers {list(_FIELDS)}")
            layer = LayerBuffers(**layer)
        elif not isinstance(layer, LayerBuffers):
            raise TypeError(f"{name}: expected LayerBuffers or a mapping, got "
                            f"{type(layer).__name__}")
        append, Hkv, Hq = self.append, self.num_kv_heads, self.num_q_heads
        try:
            append_bind.token_rows("k_new", layer.k_new, append, Hkv, "[B, Hkv, D]", batch)
            append_bind.token_rows("v_new", layer.v_new, append, Hkv, "[B, Hkv, D]", batch)
            q = append_bind.token_rows("q", layer.q, append, Hq, "[B, Hq, D]", batch)
            kc, vc, capacity, _ = append_bind.caches(append, layer.k_cache, layer.v_cache,
                                                     batch)
            ks, vs = append_bind.scales(append, layer.k_scale, layer.v_scale, batch, capacity)
            append_bind.rope_table(append, layer.cos_sin, capacity)
            append_bind.host_positions(
                "host_lengths", self._host_lengths, batch, capacity - 1,
                f"the new token must land below the cache capacity S_max={capacity}")
            bind_arguments(self.attention, DecodeParams(), q, kc, vc, ks, vs, lengths,
                           layer.out, layer.lse)  # a scratch block: only the checks matter
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{name}.{exc}") from None
        return layer, capacity

    # -- run ----------------------------------------------------------------------------------
    def capture(self, layers: Sequence[Any], seq_lens: Any, stream: StreamLike) -> Graph:
        """Validate, then capture the whole step on ``stream`` (not the legacy stream) into a
        Graph. Each ``graph.launch(stream)`` is one step: it reads the buffers in place and
        advances ``seq_lens`` by one. Valid until the next ``plan``."""
        bound, lengths, capacity = self._checked(layers, seq_lens)
        with capture(stream) as graph:
            self._issue(bound, lengths, capacity, stream)
        return graph

    def eager(self, layers: Sequence[Any], seq_lens: Any, stream: StreamLike) -> None:
        """Validate, then enqueue the step's launches on ``stream`` one by one: the same
        launches, in the same order, as a replay of ``capture``'s graph."""
        bound, lengths, capacity = self._checked(layers, seq_lens)
        self._issue(bound, lengths, capacity, stream)

    def _issue(self, layers: list[LayerBuffers], seq_lens: DeviceArray, capacity: int,
               stream: StreamLike) -> None:
        if self.fused:
            for index, layer in enumerate(layers):
                # Layer i > 0 follows layer i - 1's kernel, which writes neither the lengths
                # nor this layer's cache: its cache reads may start during that kernel's tail.
                self.attention.append_and_run(
                    layer.q, layer.k_new, layer.v_new, layer.k_cache, layer.v_cache,
                    layer.k_scale, layer.v_scale, seq_lens, layer.out, cos_sin=layer.cos_sin,
                    lse=layer.lse, early_reads=self.early_reads and index > 0, stream=stream)
            self.attention.advance_lengths(seq_lens, capacity, stream=stream)
            return
        positions = self._arrays["positions"][:seq_lens.shape[0]]
        if self.num_layers > 1:
            positions.copy_from(seq_lens, stream)
        for index, layer in enumerate(layers):
            first = index == 0
            self.append.run(layer.k_new, layer.v_new, layer.k_cache, layer.v_cache,
                            layer.k_scale, layer.v_scale, seq_lens if first else positions,
                            q=layer.q if self.rope else None, cos_sin=layer.cos_sin,
                            advance=first, stream=stream)
            self.attention.run(layer.q, layer.k_cache, layer.v_cache, layer.k_scale,
                               layer.v_scale, seq_lens, layer.out, lse=layer.lse, stream=stream)

    # -- introspection and lifetime -----------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """Launches per layer, graph nodes per step besides them, and the attention plan."""
        attention = self.attention.describe()
        if self.fused:  # append_and_run per layer, advance_lengths once
            per_layer, per_step, copies = attention.get("launches", 1), 1, 0
        else:  # append + attention per layer, the positions copy once
            per_layer, per_step, copies = 1 + attention.get("launches", 1), 0, int(
                self.num_layers > 1)
        return {"num_layers": self.num_layers, "fused": self.fused,
                "launches_per_layer": per_layer, "launches_per_step": per_step,
                "copies_per_step": copies,
                "nodes_per_step": copies + per_step + self.num_layers * per_layer,
                "attention": attention}

    def error_flags(self, *, stream: StreamLike, clear: bool = True) -> dict[str, int]:
        """``append`` bit 0 (unfused): a position fell outside a cache (not written, not
        advanced); ``attention`` bit 0: a length exceeded the capacity (clamped), or, fused, a
        position fell outside a cache (not written, not advanced). Synchronous."""
        return {"append": self.append.error_flags(stream=stream, clear=clear),
                "attention": self.attention.error_flags(clear=clear)}

    def _require_open(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("DecodeStep is closed")

    def close(self) -> None:
        """Free the positions buffer and both plans; the step cannot run afterwards."""
        self._finalizer()
        self.append.close()
        self.attention.close()
        self._host_lengths = None

    def __enter__(self) -> "DecodeStep":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
