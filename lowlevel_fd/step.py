"""DecodeStep: one decode step of an L-layer model, [append -> attention] per layer, as one
CUDA graph (or the same launches issued eagerly), with the lengths advancing on the device.

Fused (the default): one launch per layer, ``DecodePlan.append_and_run``, rotates the layer's
new token and query at position ``seq_lens[b]``, writes the token into the cache and attends
the ``seq_lens[b] + 1`` tokens (two or three launches where the plan routes a large group to
the multi-token kernels: the append kernel, attention, and the split merge's kernel where its
splits are merged by one); every layer reads the same
``seq_lens``, and one ``advance_lengths`` launch after the last layer bumps them:

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
the S_max tokens it has, and ``error_flags()`` has ERROR_OUTSIDE_CACHE set.

Every layer's buffers are validated once, by ``capture``/``eager``/``validate``, into prepared
calls of the plans; issuing the step launches those calls with no further checks. The plans
are shared by the layers. That is safe because a launch copies its parameter block
when it is issued (and a captured kernel node keeps that copy), and because the attention
workspace (split partials, merge counters, reset by the merging CTA) is only ever used by one
layer at a time: all launches go to one stream, in order. Graph replay and ``eager`` issue the
same launches with the same parameters in the same order, so their outputs are bitwise equal.

A model whose layer i + 1 needs layer i's output cannot have all L attention launches issued
back to back. ``bind`` validates the same buffers into the same prepared calls and returns them
as a ``BoundStep``: ``begin(stream)``, then ``layer(i, stream)`` for i = 0 .. L-1 in order, with
the model's own work (projections, MLP) enqueued in between on the same stream, then
``end(stream)``. Those are exactly the launches of ``eager``, in its order, so a model's step
that issues them inside its own CUDA graph (torch's, say) keeps every guarantee above. Early
reads hold as long as the work between layers writes neither ``seq_lens``, ``cos_sin`` nor a
cache or scale of the layer that follows it.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

import numpy as np

from .append import AppendPlan
from .core import validate as check
from .core.binding import layout_strides
from .core.resources import close_all
from .core.spec import KVCacheSpec, cache_spec
from .decode import DecodePlan
from .driver import Device, DeviceArray, Graph, capture
from .driver.stream import StreamLike
from .step_bound import BoundStep


@dataclass(frozen=True)
class LayerBuffers:
    """One layer's device buffers for a step. q, out: ``[B, Hq, D]`` fp16/bf16 (the unfused
    step rotates q in place when it applies RoPE; the fused one leaves it); k_new, v_new:
    ``[B, Hkv, D]``; caches and scales as in ``DecodePlan.run``; cos_sin: optional fp32 RoPE
    table; lse: optional fp32 ``[B, Hq]``; block_table: int32 ``[B, max_pages]`` for a paged
    spec (the fused step needs one table, and pools of one size, in every layer: it advances
    the lengths once)."""

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
    block_table: Any = None


_FIELDS = tuple(f.name for f in fields(LayerBuffers))


class DecodeStep:
    """L layers' decode step: per layer, the RoPE + quantize + append of the new token and
    attention over the cache including it; one launch per layer (``fused``, plus one per step
    for the lengths) or two (AppendPlan then DecodePlan). ``plan`` does the host work,
    ``capture`` returns a Graph that replays the whole step, ``eager`` issues the same
    launches without one, ``bind`` returns them to be issued one layer at a time (a model's
    own work in between). ``allow_int8_q``: DecodePlan's (q in int8 where it pays, Hadamard
    keys only)."""

    def __init__(self, cache: KVCacheSpec, num_layers: int, num_q_heads: int, *,
                 max_batch: int, max_seq_len: int, dtype: str = "float16",
                 sm_scale: float | None = None, fused: bool = True, early_reads: bool = True,
                 device: Device | None = None, allow_int8_q: bool = False) -> None:
        self.cache = cache_spec(cache)
        self.num_layers = check.positive("num_layers", num_layers)
        self.fused = check.flag("fused", fused)
        # fused: append_and_run(early_reads=...) for the layers after the first
        self.early_reads = check.flag("early_reads", early_reads)
        device = check.device_option(device)  # the plans share it
        self.attention = DecodePlan(self.cache, num_q_heads, max_batch=max_batch,
                                    max_seq_len=max_seq_len, dtype=dtype, sm_scale=sm_scale,
                                    device=device, allow_int8_q=allow_int8_q)
        self.append = None if fused else AppendPlan(self.cache, num_q_heads,
                                                    max_batch=max_batch, dtype=dtype,
                                                    device=device)
        self.num_q_heads, self.max_batch = self.attention.num_q_heads, max_batch
        self.max_seq_len, self.dtype, self.device = max_seq_len, self.attention.dtype, device
        self._host_lengths: np.ndarray | None = None
        self._arrays: dict[str, DeviceArray] = {}
        self._finalizer = weakref.finalize(self, close_all, self._arrays)

    @classmethod
    def create(cls, num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int, *,
               max_batch: int, max_seq_len: int, dtype: str = "float16",
               kv_layout: str = "bnsh", scale_mode: str = "token", scale_dtype: str = "float32",
               rope: str | None = None, rope_theta: float = 10000.0,
               page_size: int | None = None, key_transform: str = "none",
               sm_scale: float | None = None,
               fused: bool = True, early_reads: bool = True,
               device: Device | None = None, allow_int8_q: bool = False) -> "DecodeStep":
        """The keyword form: builds the KVCacheSpec from the cache options."""
        spec = KVCacheSpec(num_kv_heads, head_dim, kv_layout, scale_mode, scale_dtype, rope,
                           rope_theta, page_size=page_size, key_transform=key_transform)
        return cls(spec, num_layers, num_q_heads, max_batch=max_batch, max_seq_len=max_seq_len,
                   dtype=dtype, sm_scale=sm_scale, fused=fused, early_reads=early_reads,
                   device=device, allow_int8_q=allow_int8_q)

    # -- plan ---------------------------------------------------------------------------------
    def plan(self, seq_lens: Any) -> "DecodeStep":
        """Plan for these host lengths ``[B]`` (tokens in the cache before the step): attention
        is planned for ``L + 1`` tokens, the kernels are compiled and loaded, the positions
        buffer is allocated. Recapture any graph afterwards."""
        self._require_open()
        lengths = check.host_lengths("seq_lens", seq_lens, self.max_batch, self.max_seq_len)
        if self.fused:
            self.attention.plan(lengths, append=True)  # rejects a full sequence
        else:
            check.room_for_new_token("seq_lens", lengths, self.max_seq_len)
            self.attention.plan(lengths + 1)
            assert self.append is not None
            self.append.load()
            if "positions" not in self._arrays:
                self._arrays["positions"] = DeviceArray.full(self.max_batch, 0, np.int32,
                                                             self.device)
        self._host_lengths = lengths
        return self

    # -- validation ---------------------------------------------------------------------------
    def validate(self, layers: Sequence[Any], seq_lens: Any) -> None:
        """Check every layer's buffers and ``seq_lens`` (int32 ``[B]`` on the device) against
        the plan; ValueError/TypeError name the layer and the argument. Launches nothing."""
        self._prepared(layers, seq_lens)

    def _prepared(self, layers: Sequence[Any], seq_lens: Any) -> tuple[list, DeviceArray, int]:
        """Every layer's launches, validated; the lengths; the caches' capacity S_max."""
        self._require_open()
        if self._host_lengths is None:
            raise RuntimeError("DecodeStep: call plan(seq_lens) first")
        batch = int(self._host_lengths.size)
        if isinstance(layers, (str, bytes, Mapping)) or not isinstance(layers, Sequence):
            raise TypeError(f"layers: expected a sequence of {self.num_layers} LayerBuffers, "
                            f"got {type(layers).__name__}")
        if len(layers) != self.num_layers:
            raise ValueError(f"layers: expected {self.num_layers} layers' buffers (num_layers), "
                             f"got {len(layers)}")
        lengths = check.device_lengths("seq_lens", seq_lens, self.device, batch)
        prepared = [self._layer(i, layer, lengths) for i, layer in enumerate(layers)]
        capacities = sorted({capacity for _, capacity, _ in prepared})
        if self.fused and len(capacities) > 1:  # one advance_lengths serves every layer
            raise ValueError(f"layers: expected caches of one capacity S_max in every layer "
                             f"(the fused step advances the lengths once), got {capacities}")
        pages = {(table.ptr, num_pages): (table, num_pages)
                 for _, _, (table, num_pages) in prepared if table is not None}
        if self.fused and len(pages) > 1:
            raise ValueError(f"layers: expected one block_table and pools of one size in every "
                             f"layer (the fused step advances the lengths once), got (table "
                             f"address, num_pages) {sorted(pages)}")
        table, num_pages = next(iter(pages.values()), (None, None))
        advance = {"capacity": capacities[0], "block_table": table, "num_pages": num_pages}
        return [calls for calls, _, _ in prepared], lengths, advance

    def _advance(self, lengths: DeviceArray, advance: dict, stream: StreamLike) -> None:
        """The fused step's one advance_lengths (``advance``: from ``_prepared``)."""
        pages = {} if advance["block_table"] is None else {
            "block_table": advance["block_table"], "num_pages": advance["num_pages"]}
        self.attention.advance_lengths(lengths, advance["capacity"], stream=stream, **pages)

    def _layer(self, index: int, layer: Any,
               lengths: DeviceArray) -> tuple[tuple, int, tuple[Any, int | None]]:
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
        caches = (layer.k_cache, layer.v_cache, layer.k_scale, layer.v_scale)
        pages = {"block_table": layer.block_table}
        try:
            capacity = self._capacity(layer.k_cache, layer.block_table, lengths.shape[0])
            if self.fused:
                calls: tuple = (self.attention.prepare_append_and_run(
                    layer.q, layer.k_new, layer.v_new, *caches, lengths, layer.out,
                    cos_sin=layer.cos_sin, lse=layer.lse,
                    early_reads=self.early_reads and index > 0, **pages),)
            else:
                assert self.append is not None
                first = index == 0
                positions = lengths if first else self._arrays["positions"][:lengths.shape[0]]
                calls = (self.append.prepare_run(
                    layer.k_new, layer.v_new, *caches, positions,
                    q=layer.q if self.cache.rope else None, cos_sin=layer.cos_sin,
                    advance=first, **pages),
                    self.attention.prepare_run(layer.q, *caches, lengths, layer.out,
                                               lse=layer.lse, **pages))
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{name}.{exc}") from None
        if not self.cache.paged:
            return calls, capacity, (None, None)
        # validated by the calls above
        table = check.device_array("block_table", layer.block_table, self.device)
        return calls, capacity, (table, check.device_array("k_cache", layer.k_cache,
                                                           self.device).shape[0])

    def _capacity(self, k_cache: Any, block_table: Any, batch: int) -> int:
        """The cache capacity (S_max, or the block table's pages times page_size), checked
        against the planned host lengths first (a more precise message than the binder's); a
        malformed cache or table is left to the binder."""
        k = check.device_array("k_cache", k_cache, self.device)
        if k.ndim != 4:
            return 0
        if self.cache.paged:
            if block_table is None:
                return 0
            table = check.device_array("block_table", block_table, self.device)
            if table.ndim != 2:
                return 0
            capacity = table.shape[1] * self.cache.page_size
        else:
            capacity = layout_strides(self.cache, k)[0]
        check.host_within("seq_lens", self._host_lengths, batch, capacity - 1,
                          f"the new token must land below the cache capacity S_max={capacity}")
        return capacity

    def bind(self, layers: Sequence[Any], seq_lens: Any) -> "BoundStep":
        """Validate every layer's buffers and ``seq_lens`` (as ``validate``) and return the
        step's launches one layer at a time, for a model that runs its own work between layers:
        ``begin``, ``layer(0)`` .. ``layer(L-1)``, ``end``, all on one stream. Launches nothing;
        valid until the next ``plan``."""
        calls, lengths, capacity = self._prepared(layers, seq_lens)
        return BoundStep(self, calls, lengths, capacity)

    # -- run ----------------------------------------------------------------------------------
    def capture(self, layers: Sequence[Any], seq_lens: Any, stream: StreamLike) -> Graph:
        """Validate, then capture the whole step on ``stream`` (not the legacy stream) into a
        Graph. Each ``graph.launch(stream)`` is one step: it reads the buffers in place and
        advances ``seq_lens`` by one. Valid until the next ``plan``."""
        calls, lengths, capacity = self._prepared(layers, seq_lens)
        with capture(stream) as graph:
            self._issue(calls, lengths, capacity, stream)
        return graph

    def eager(self, layers: Sequence[Any], seq_lens: Any, stream: StreamLike) -> None:
        """Validate, then enqueue the step's launches on ``stream`` one by one: the same
        launches, in the same order, as a replay of ``capture``'s graph."""
        calls, lengths, capacity = self._prepared(layers, seq_lens)
        self._issue(calls, lengths, capacity, stream)

    def _issue(self, calls: list, seq_lens: DeviceArray, capacity: dict,
               stream: StreamLike) -> None:
        if not self.fused and self.num_layers > 1:
            self._arrays["positions"][:seq_lens.shape[0]].copy_from(seq_lens, stream)
        for layer_calls in calls:
            for call in layer_calls:
                call.launch(stream)
        if self.fused:
            self._advance(seq_lens, capacity, stream)

    # -- introspection and lifetime -----------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """Launches per layer, graph nodes per step besides them, and the attention plan."""
        attention = self.attention.describe()
        if self.fused:  # append_and_run per layer, advance_lengths once
            per_layer, per_step, copies = attention.get("append_launches", 1), 1, 0
        else:  # append + attention per layer, the positions copy once
            per_layer, per_step, copies = 1 + attention.get("launches", 1), 0, int(
                self.num_layers > 1)
        return {"num_layers": self.num_layers, "fused": self.fused,
                "launches_per_layer": per_layer, "launches_per_step": per_step,
                "copies_per_step": copies,
                "nodes_per_step": copies + per_step + self.num_layers * per_layer,
                "attention": attention}

    def error_flags(self, *, stream: StreamLike, clear: bool = True) -> int:
        """The error bits of the step's kernels, ORed: ERROR_OUTSIDE_CACHE when a sequence's
        length left no room in a cache (nothing written, not advanced) or exceeded it
        (clamped). Waits for the work enqueued on ``stream``, then clears on it."""
        flags = self.attention.error_flags(stream=stream, clear=clear)
        if self.append is not None:
            flags |= self.append.error_flags(stream=stream, clear=clear)
        return flags

    def _require_open(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("DecodeStep is closed")

    def close(self) -> None:
        """Free the positions buffer and the plans; the step cannot run afterwards."""
        self._finalizer()
        if self.append is not None:
            self.append.close()
        self.attention.close()
        self._host_lengths = None

    def __enter__(self) -> "DecodeStep":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
