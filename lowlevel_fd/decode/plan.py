"""DecodePlan: ``plan()`` does the host work once, ``run()`` only launches (graph-capturable)."""
from __future__ import annotations

import math
import weakref
from dataclasses import replace
from typing import Any

import numpy as np

from ..driver import Device, DeviceArray, Kernel, LaunchConfig, Module, PreparedLaunch
from ..driver.stream import StreamLike
from . import validate as check
from .bind import bind_append_arguments, bind_arguments
from .params import ROPE_IDS, DecodeParams
from .planner import MAX_CLUSTER, MAX_SPLITS, TileConfig, Workload, choose
from .variants import GROUP_SIZES, HEAD_DIMS, DecodeVariant

KV_LAYOUTS = ("bnsh", "bsnh")
SCALE_MODES = ("tensor", "head", "token")
_LOG2E = 1.4426950408889634
_loaded: dict[tuple[int, DecodeVariant], tuple[Module, Kernel, Kernel]] = {}


def load_variant(variant: DecodeVariant, device: Device) -> tuple[Kernel, Kernel, Kernel]:
    """Compile (cached on disk) and load a variant once per process and device: its split
    kernel, its combine kernel and the fused-append step's length bump."""
    key = (device.ordinal, variant)
    if key not in _loaded:
        program = variant.compile(device.arch)
        module = Module(program.cubin, device)
        split = module.get_kernel(program.symbol(variant.split_kernel))
        combine = module.get_kernel(program.symbol(variant.combine_kernel))
        advance = module.get_kernel(program.symbol(variant.advance_kernel))
        if variant.cluster:
            split.allow_large_clusters()
        _loaded[key] = (module, split, combine, advance)
    _, split, combine, advance = _loaded[key]
    return split, combine, advance


class DecodePlan:
    """Decode attention (one query token per sequence) over an INT8 KV cache.

    ``plan(seq_lens)`` picks the launch for a batch; ``run(...)`` executes it on a stream with
    no allocation, synchronisation or compilation. The log-sum-exp it can return is the
    natural logarithm (FlashInfer's is base 2).
    """

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, *, max_batch: int,
                 max_seq_len: int, q_dtype: str = "float16", kv_layout: str = "bnsh",
                 scale_mode: str = "token", scale_dtype: str = "float32",
                 sm_scale: float | None = None, rope: str | None = None,
                 rope_theta: float = 10000.0, device: Device | None = None) -> None:
        num_q_heads = check.integer("num_q_heads", num_q_heads)
        num_kv_heads = check.integer("num_kv_heads", num_kv_heads)
        head_dim = check.integer("head_dim", head_dim)
        max_batch = check.integer("max_batch", max_batch)
        max_seq_len = check.integer("max_seq_len", max_seq_len)
        check.choice("head_dim", head_dim, HEAD_DIMS)
        q_dtype = check.dtype_option("q_dtype", q_dtype, ("float16", "bfloat16"))
        check.choice("kv_layout", kv_layout, KV_LAYOUTS)
        check.choice("scale_mode", scale_mode, SCALE_MODES)
        scale_dtype = check.dtype_option(
            "scale_dtype", scale_dtype,
            ("float32", "float16") if scale_mode == "token" else ("float32",))
        if num_kv_heads < 1 or num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads: expected a multiple of num_kv_heads={num_kv_heads}, "
                             f"got {num_q_heads}")
        check.choice("group size (num_q_heads // num_kv_heads)", num_q_heads // num_kv_heads,
                     GROUP_SIZES)
        if max_batch < 1 or not 1 <= max_seq_len < 2**31:
            raise ValueError(f"max_batch/max_seq_len: expected >= 1 (and < 2**31), got "
                             f"{max_batch}/{max_seq_len}")
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.group_size = num_q_heads // num_kv_heads
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.q_dtype, self.kv_layout = q_dtype, kv_layout
        self.scale_mode, self.scale_dtype = scale_mode, scale_dtype
        if sm_scale is not None:
            sm_scale = check.real("sm_scale", sm_scale)
            if sm_scale == 0.0:
                raise ValueError("sm_scale: expected a finite non-zero scale, got 0.0")
        self.sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
        # RoPE of append_and_run's new token and query (run() never rotates).
        check.choice("rope", rope, tuple(ROPE_IDS))
        theta = check.real("rope_theta", rope_theta)
        if not theta > 1.0:
            raise ValueError(f"rope_theta: expected a finite base > 1, got {rope_theta!r}")
        self.rope, self.rope_theta = rope, theta
        self.device = check.device_option(device)
        self._workspace: dict[str, DeviceArray] = {}
        self._params = DecodeParams()
        self._split: PreparedLaunch | None = None
        self._split_append: PreparedLaunch | None = None
        self._combine: PreparedLaunch | None = None
        self._batch = 0
        self._planned_max = 0
        self._validated: tuple = ()  # the arguments run() last checked (decode/bind.py)
        self._description: dict[str, Any] = {}
        self._finalizer = weakref.finalize(self, _close_arrays, self._workspace)

    # -- plan ---------------------------------------------------------------------------------
    def plan(self, seq_lens: Any, *, config: TileConfig | None = None,
             append: bool = False) -> "DecodePlan":
        """Choose splits and tiles for these host lengths ``[B]``, compile and load the kernel
        (once per process), size the workspace. With ``append`` the fused-append kernel of
        ``append_and_run`` is loaded too (plan with the lengths it attends: positions + 1). A
        captured graph stays valid for any device lengths up to the cache's capacity, but must
        be recaptured after re-planning."""
        check.flag("append", append)
        self._require_open()
        lengths = check.host_lengths("seq_lens", seq_lens, self.max_batch, self.max_seq_len)
        if config is not None:
            check.tile_config(config)
        batch, longest = int(lengths.size), int(lengths.max())
        hopper = self.device.compute_capability >= (9, 0)
        if config is None:
            config = choose(Workload(batch, self.num_kv_heads, longest, self.device.sm_count,
                                     0, self.group_size, self.head_dim), clusters=hopper)
        variant = DecodeVariant(self.head_dim, self.group_size, self.q_dtype, self.scale_mode,
                                self.scale_dtype, config.num_warps, config.stages,
                                tiles=config.tiles)
        if config.cluster:
            if not hopper or not 1 <= config.num_splits <= MAX_CLUSTER:
                raise ValueError(f"config.cluster: needs sm_90+ and 1..{MAX_CLUSTER} splits, "
                                 f"got {self.device.arch} and {config.num_splits} splits")
            variant = replace(variant, cluster=True)
        shared, slots_offset = variant.launch_shared_bytes(config.num_splits)
        if shared > self.device.info.max_shared_per_block_optin:
            raise ValueError(f"config: {shared} bytes of shared memory per CTA exceed the "
                             f"device's {self.device.info.max_shared_per_block_optin} (fewer "
                             f"warps, stages, tiles or cluster splits)")
        split, combine, advance = load_variant(variant, self.device)
        split.allow_dynamic_shared(shared)
        ctas_per_sm = split.occupancy(variant.threads, shared)
        if not 1 <= config.num_splits <= MAX_SPLITS:
            raise ValueError(f"config.num_splits: expected 1..{MAX_SPLITS}, got "
                             f"{config.num_splits}")
        if config.min_split_tokens < 16 or config.min_split_tokens % 16:
            raise ValueError(f"config.min_split_tokens: expected a positive multiple of 16, "
                             f"got {config.min_split_tokens}")
        self._ensure_workspace(batch, config.num_splits, config.cluster)
        p = self._params
        p.partial_out = self._workspace["partial_out"].ptr
        p.partial_lse = self._workspace["partial_lse"].ptr
        p.counters = self._workspace["counters"].ptr
        p.error_flags = self._workspace["error_flags"].ptr
        p.score_scale_log2 = self.sm_scale * _LOG2E
        p.num_kv_heads = self.num_kv_heads
        p.num_splits = config.num_splits
        p.min_split_tokens = config.min_split_tokens
        p.fused_merge = int(config.fused_merge)
        grid = (self.num_kv_heads, config.num_splits, batch)
        p.cluster_slots_offset = slots_offset
        launch_config = LaunchConfig(
            grid, variant.threads, shared,
            cluster=(1, config.num_splits, 1) if config.cluster else None,
            programmatic=config.programmatic and hopper)
        self._split = split.prepare(launch_config, p)
        self._split_append = None
        if append:  # the same launch of the APPEND instantiation, on the same parameter block
            fused_split, _, _ = load_variant(replace(variant, append=True), self.device)
            fused_split.allow_dynamic_shared(shared)
            self._split_append = fused_split.prepare(launch_config, p)
        self._combine = None
        if config.num_splits > 1 and not config.fused_merge and not config.cluster:
            scratch = (MAX_SPLITS + 2) * self.group_size * 4  # decode_combine's merge weights
            self._combine = combine.prepare(
                LaunchConfig((self.num_kv_heads, batch), 128, scratch), p)
        self._advance, self._hopper = advance, hopper
        self._batch, self._planned_max = batch, longest
        self._description = {
            "batch": batch, "grid": grid, "block": variant.threads,
            "num_splits": config.num_splits, "min_split_tokens": config.min_split_tokens,
            "tiles": variant.tiles, "tile_tokens": 16 * variant.tiles,
            "num_warps": variant.num_warps,
            "stages": variant.stages,
            "fused_merge": config.fused_merge, "cluster": config.cluster,
            "programmatic": config.programmatic and hopper,
            "launches": 1 + (self._combine is not None),
            "registers": split.num_registers, "local_bytes": split.local_bytes,
            "shared_bytes": split.static_shared_bytes + shared,
            "ctas_per_sm": ctas_per_sm, "kernel": variant.split_kernel,
            "append_kernel": replace(variant, append=True).split_kernel if append else None,
        }
        return self

    def _ensure_workspace(self, batch: int, num_splits: int, cluster: bool) -> None:
        """Split partials for the global merge (none for a cluster merge); grows only."""
        pairs = 1 if cluster or num_splits == 1 else batch * self.num_kv_heads * num_splits
        ws = self._workspace
        if "partial_lse" in ws and ws["partial_lse"].shape[0] >= pairs * self.group_size:
            return
        for array in ws.values():
            array.close()
        ws["partial_out"] = DeviceArray.empty(pairs * self.group_size * self.head_dim,
                                              np.float32, self.device)
        ws["partial_lse"] = DeviceArray.empty(pairs * self.group_size, np.float32, self.device)
        ws["counters"] = DeviceArray.full(self.max_batch * self.num_kv_heads, 0, np.uint32,
                                          self.device)
        ws["error_flags"] = DeviceArray.full(1, 0, np.uint32, self.device)

    # -- run ----------------------------------------------------------------------------------
    def run(self, q: Any, k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any,
            seq_lens: Any, out: Any, *, lse: Any = None, stream: StreamLike) -> None:
        """out[b, h] = softmax(sm_scale * q[b, h] K^T) V over the first seq_lens[b] tokens.

        q, out: ``[B, Hq, D]`` fp16/bf16; caches: int8 ``[B, Hkv, S, D]`` (bnsh) or
        ``[B, S, Hkv, D]`` (bsnh); seq_lens: int32 ``[B]`` on the device; lse: optional fp32
        ``[B, Hq]`` (natural log). Enqueued on ``stream``; returns at once.
        """
        if self._split is None:
            raise RuntimeError("run: call plan(seq_lens) first")
        self._require_open()
        bind_arguments(self, self._params, q, k_cache, v_cache, k_scale, v_scale, seq_lens,
                       out, lse)
        self._params.append = self._params.early_reads = 0
        self._split.launch(stream)
        if self._combine is not None:
            self._combine.launch(stream)

    def append_and_run(self, q: Any, k_new: Any, v_new: Any, k_cache: Any, v_cache: Any,
                       k_scale: Any, v_scale: Any, positions: Any, out: Any, *,
                       cos_sin: Any = None, lse: Any = None, early_reads: bool = False,
                       stream: StreamLike) -> None:
        """One launch that appends each sequence's new token and attends over the cache with it.

        For every b with 0 <= positions[b] < S_max: rotate k_new[b] and q[b] at position
        positions[b] (RoPE per the constructor's ``rope``; q itself is not modified), quantize
        k_new[b] and v_new[b] with the plan's scale mode (writing per-token scales), write them
        at positions[b] in the caches, and set out[b, h] to the attention of the rotated q over
        the positions[b] + 1 tokens. Plan with those lengths (positions + 1). A position outside
        the cache writes nothing and attends the tokens there are (bit 0 of error_flags).
        ``positions`` is not advanced (``advance_lengths`` does that). k_new, v_new:
        ``[B, Hkv, D]`` like q; cos_sin: optional fp32 ``[max_pos >= S_max, D/2, 2]`` table
        (else the angles come from ``rope_theta``). Enqueued on ``stream``; returns at once.

        ``early_reads`` (Hopper's programmatic launch): the kernel reads ``positions``, the
        caches, their scales and ``cos_sin`` while the kernel before it on the stream is still
        finishing, so its first cache tiles stream during that kernel's tail. Only q, k_new and
        v_new wait for it, and every write does. Pass True only when that previous kernel writes
        none of those buffers (DecodeStep: every layer after the first).
        """
        check.flag("early_reads", early_reads)
        if self._split_append is None:
            raise RuntimeError("append_and_run: call plan(seq_lens, append=True) first")
        self._require_open()
        bind_append_arguments(self, self._params, q, k_new, v_new, k_cache, v_cache, k_scale,
                              v_scale, positions, out, lse, cos_sin)
        self._params.early_reads = int(early_reads)
        self._split_append.launch(stream)
        if self._combine is not None:
            self._combine.launch(stream)

    def advance_lengths(self, seq_lens: Any, capacity: int, *, stream: StreamLike) -> None:
        """seq_lens[b] += 1 where 0 <= seq_lens[b] < capacity, on the device: after the
        append_and_run calls of a step (which all read the same positions)."""
        if self._split is None:
            raise RuntimeError("advance_lengths: call plan(seq_lens) first")
        self._require_open()
        lengths = check.device_array("seq_lens", seq_lens, self.device)
        check.dtype("seq_lens", lengths, ("int32",))
        check.contiguous("seq_lens", lengths)
        if lengths.ndim != 1:
            raise ValueError(f"seq_lens: expected shape [B], got {lengths.shape}")
        capacity = check.integer("capacity", capacity)
        if not 1 <= capacity < 2**31:
            raise ValueError(f"capacity: expected the caches' S_max in [1, 2**31), got {capacity}")
        batch = lengths.shape[0]
        blocks = max(1, min(-(-batch // 256), 1024))
        self._advance.prepare(LaunchConfig(blocks, 256, programmatic=self._hopper), lengths,
                              np.int32(batch), np.int32(capacity)).launch(stream)

    # -- introspection and lifetime -----------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """The planned launch: grid, splits, tile, stages, registers, shared memory."""
        return dict(self._description)

    def error_flags(self, *, clear: bool = True) -> int:
        """Bit 0: a device length exceeded the cache capacity and was clamped. Synchronous:
        waits for all work on the device first."""
        flags = self._workspace["error_flags"]
        value = int(flags.numpy()[0])
        if clear:
            flags.fill(0)
        return value

    def _require_open(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("DecodePlan is closed")

    def close(self) -> None:
        """Free the workspace; the plan cannot run afterwards."""
        self._finalizer()
        self._split = self._split_append = self._combine = None

    def __enter__(self) -> "DecodePlan":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_arrays(arrays: dict[str, DeviceArray]) -> None:
    for array in arrays.values():
        array.close()
    arrays.clear()
