#!/usr/bin/env python3
"""A toy decode loop: L layers (default 32) with distinct INT8 caches, B=1, 1024 tokens of
context, N steps of DecodeStep ([RoPE + quantize + append -> attention] per layer: one fused
launch by default, or AppendPlan then DecodePlan with --unfused), run once eagerly and once by
CUDA-graph replay from the same initial state.

Prints the us per step and per layer of both (CUDA events, one pair per step, median with
p20/p80 after a warm-up), the kernel launches per layer (kernel nodes of the captured graph /
L), whether graph replay and eager ended bitwise identical, and layer 0's last output against
the float64 oracle. Exits 1 if they differ or the oracle check fails.

    PYTHONPATH=. python3 tools/decode_loop.py [--steps 100] [--layers 32] [--context 1024]
                                              [--unfused]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

TARGET_US_PER_LAYER, TARGET_LAUNCHES = 6.0, 2  # issue 4, H100, graph replay
CACHES = ("k_cache", "v_cache", "k_scale", "v_scale")


def build_parser() -> argparse.ArgumentParser:
    from benchlib.workloads import MODE_NAMES
    from lowlevel_fd.core.support import KV_LAYOUTS, ROPE_STYLES
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024, help="tokens before the loop")
    parser.add_argument("--steps", type=int, default=100, help="timed steps N")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--heads", default="32,8", help="query,kv heads (default 32,8)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--scale-mode", choices=MODE_NAMES, default="token-fp32")
    parser.add_argument("--kv-layout", choices=KV_LAYOUTS, default="bnsh",
                        help="bnsh/bsnh contiguous; nhd/hnd paged (--page-size)")
    parser.add_argument("--page-size", type=int, default=0,
                        help="paged caches: tokens per page (one block table for every "
                             "layer); 0: contiguous")
    parser.add_argument("--page-order", choices=("random", "ordered"), default="random",
                        help="paged caches: pages in random physical order (default) or in "
                             "order, each sequence's pages consecutive")
    parser.add_argument("--rope", choices=[str(style).lower() for style in ROPE_STYLES],
                        default="neox")
    parser.add_argument("--init", choices=("prompt", "random"), default="prompt",
                        help="fill the context with PromptQuantizer (default) or random bytes")
    parser.add_argument("--unfused", action="store_true",
                        help="append kernel + attention per layer (two launches)")
    parser.add_argument("--no-early-reads", action="store_true",
                        help="fused: every layer waits for the previous kernel before reading "
                             "its lengths and cache (DecodeStep(early_reads=False))")
    parser.add_argument("--splits", type=int, default=0,
                        help="force the attention's split count (0: the planner's)")
    parser.add_argument("--merge", choices=("cluster", "global"), default="cluster",
                        help="with --splits: how the splits merge")
    parser.add_argument("--key-transform", choices=("none", "hadamard"), default="none",
                        help="KVCacheSpec key_transform: keys stored as H RoPE(k)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write the raw numbers here")
    return parser


class Loop:
    """The step, every layer's buffers, and a device snapshot of the initial caches so both
    passes start from the same state."""

    def __init__(self, args: argparse.Namespace, device, stream) -> None:
        from benchlib.workloads import SCALE_MODES
        from lowlevel_fd import DecodeStep, DeviceArray, KVCacheSpec, LayerBuffers
        from lowlevel_fd.reference import rope_table

        self.args, self.device, self.stream = args, device, stream
        self.num_q_heads, self.num_kv_heads = (int(x) for x in args.heads.split(","))
        self.scale_mode, self.scale_dtype = SCALE_MODES[args.scale_mode]
        self.rope = None if args.rope == "none" else args.rope
        B, Hq, Hkv, D = args.batch, self.num_q_heads, self.num_kv_heads, args.head_dim
        ps = args.page_size
        self.cache = KVCacheSpec(Hkv, D, kv_layout=args.kv_layout, scale_mode=self.scale_mode,
                                 scale_dtype=self.scale_dtype, rope=self.rope,
                                 page_size=ps or None, key_transform=args.key_transform)
        total = args.context + args.warmup + args.steps
        unit = max(64, args.page_size)  # whole pages: the plan's capacity is pages x page_size
        self.capacity = -(-total // unit) * unit
        self.host_lengths = np.full(B, args.context, np.int32)
        self.rng = np.random.default_rng(args.seed)
        shape = {"bnsh": (B, Hkv, self.capacity, D), "bsnh": (B, self.capacity, Hkv, D)}.get(
            args.kv_layout)
        scale_shape = (B, Hkv, self.capacity) if self.scale_mode == "token" else (
            (1,) if self.scale_mode == "tensor" else (Hkv,))
        self.pages = {}
        if ps:  # pools of B * capacity / ps pages, in random physical order unless ordered
            per_seq = -(-self.capacity // ps)
            count = B * per_seq
            ids = np.arange(count) if args.page_order == "ordered" else self.rng.permutation(count)
            self.block_table = ids.reshape(B, per_seq).astype(np.int32)
            shape = (count, ps, Hkv, D) if args.kv_layout == "nhd" else (count, Hkv, ps, D)
            if self.scale_mode == "token":
                scale_shape = (count, ps, Hkv) if args.kv_layout == "nhd" else (count, Hkv, ps)
            self.pages = {"block_table": DeviceArray.from_numpy(self.block_table, device)}
        scale_dtype = np.dtype(self.scale_dtype)
        self.table = None if self.rope is None else DeviceArray.from_numpy(
            rope_table(self.capacity, D), device)
        self.layers, self.inputs, self.snapshot = [], [], []
        for _ in range(args.layers):
            arrays = {name: DeviceArray.empty(shape, np.int8, device)
                      for name in ("k_cache", "v_cache")}
            arrays.update({name: DeviceArray.empty(scale_shape, scale_dtype, device)
                           for name in ("k_scale", "v_scale")})
            new = {name: self.random((B, heads, D)) for name, heads in
                   (("q", Hq), ("k_new", Hkv), ("v_new", Hkv))}
            arrays.update({name: DeviceArray.from_numpy(x, device) for name, x in new.items()})
            arrays["out"] = DeviceArray.empty((B, Hq, D), np.float16, device)
            self.layers.append(arrays)
            self.inputs.append(new)
        self.seq_lens = DeviceArray.from_numpy(self.host_lengths, device)
        self.step = DecodeStep(self.cache, args.layers, Hq, max_batch=B,
                               max_seq_len=self.capacity, fused=not args.unfused,
                               early_reads=not args.no_early_reads, device=device)
        self.step.plan(self.host_lengths)  # the tokens cached before the first step
        if args.splits:  # the attention re-planned with a forced split count and merge
            from lowlevel_fd.decode.planner import (DEFAULT_WARPS, TileConfig,
                                                    default_min_split_tokens)
            config = TileConfig(num_splits=args.splits, cluster=args.merge == "cluster",
                                min_split_tokens=default_min_split_tokens(DEFAULT_WARPS))
            if args.unfused:
                self.step.attention.plan(self.host_lengths + 1, config=config)
            else:
                self.step.attention.plan(self.host_lengths, config=config, append=True)
        self.fill_context()
        self.buffers = [LayerBuffers(cos_sin=self.table, **self.pages, **{
            name: a[name] for name in ("q", "k_new", "v_new", "out", *CACHES)})
            for a in self.layers]
        for arrays in self.layers:
            saved = {name: DeviceArray.empty(arrays[name].shape, arrays[name].dtype, device)
                     for name in CACHES}
            for name in CACHES:
                saved[name].copy_from(arrays[name], stream)
            self.snapshot.append(saved)
        stream.synchronize()

    def random(self, shape: tuple[int, ...]) -> np.ndarray:
        return self.rng.standard_normal(shape).astype(np.float16)

    def fill_context(self) -> None:
        """The first ``context`` tokens of every layer: a random fp16 prompt quantized by
        PromptQuantizer (static scales calibrated on it), or random int8 bytes and scales."""
        from benchlib.kernels import fill_random
        from benchlib.layers import SCALE_CENTER
        from lowlevel_fd import DeviceArray, PromptQuantizer
        from lowlevel_fd.quant import calibrate_scales

        args, B, Hkv, D = self.args, self.args.batch, self.num_kv_heads, self.args.head_dim
        if args.init == "random":
            for index, arrays in enumerate(self.layers):
                for offset, name in enumerate(("k_cache", "v_cache")):
                    fill_random(arrays[name], args.seed * 1_000_003 + 2 * index + offset,
                                self.stream)
                for name in ("k_scale", "v_scale"):
                    scales = self.rng.uniform(0.5, 1.5, arrays[name].shape) * SCALE_CENTER
                    arrays[name].copy_from_numpy(scales.astype(arrays[name].dtype))
            return
        with PromptQuantizer(self.cache, max_batch=B, prompt_layout="bsnh",
                             device=self.device) as quantizer:
            for arrays in self.layers:
                prompt = [self.random((B, args.context, Hkv, D)) for _ in range(2)]
                if self.scale_mode != "token":
                    for name, x in zip(("k_scale", "v_scale"), prompt):
                        arrays[name].copy_from_numpy(calibrate_scales(x, self.scale_mode,
                                                                      kv_layout="bsnh"))
                k, v = (DeviceArray.from_numpy(x, self.device) for x in prompt)
                quantizer.run(k, v, *(arrays[name] for name in CACHES), self.seq_lens,
                              cos_sin=self.table, host_prompt_lens=self.host_lengths,
                              stream=self.stream, **self.pages)
                self.stream.synchronize()  # before k and v are freed
                k.close()
                v.close()
            if quantizer.error_flags(stream=self.stream):
                raise RuntimeError("decode_loop: prompt quantization reported an error flag")

    def restore(self) -> None:
        """The initial caches, lengths and new-token inputs (RoPE rotates q in place)."""
        for arrays, saved, new in zip(self.layers, self.snapshot, self.inputs):
            for name in CACHES:
                arrays[name].copy_from(saved[name], self.stream)
            for name, x in new.items():
                arrays[name].copy_from_numpy(x, stream=self.stream)
        self.seq_lens.copy_from_numpy(self.host_lengths, stream=self.stream)

    def final_state(self) -> list[dict[str, np.ndarray]]:
        state = [{name: arrays[name].numpy(stream=self.stream) for name in (*CACHES, "q", "out")}
                 for arrays in self.layers]
        state.append({"seq_lens": self.seq_lens.numpy(stream=self.stream)})
        return state

    def close(self) -> None:
        self.stream.synchronize()
        self.step.close()
        for arrays in (*self.layers, *self.snapshot):
            for array in arrays.values():
                array.close()
        for array in (self.seq_lens, self.table, *self.pages.values()):
            if array is not None:
                array.close()

    def contiguous(self, name: str, pool: np.ndarray) -> np.ndarray:
        """A paged layer's cache or scales as bnsh ``[B, Hkv, S, ...]`` (the oracle's form)."""
        from benchlib.pages import bnsh_from_pages
        return bnsh_from_pages(pool, self.block_table, self.args.kv_layout)


def timed_pass(loop: Loop, launch) -> tuple[list[float], list[dict[str, np.ndarray]]]:
    """From the initial state: warm-up steps, then N timed steps; (us per step, final state)."""
    from lowlevel_fd.timing import time_replays
    loop.restore()
    samples = time_replays(launch, loop.stream, warmup=loop.args.warmup, iters=loop.args.steps)
    return [1e3 * ms for ms in samples], loop.final_state()


def identical(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> bool:
    return all(np.array_equal(x[name].view(np.uint8), y[name].view(np.uint8))
               for x, y in zip(a, b) for name in x)


def oracle_error(loop: Loop, state: list[dict[str, np.ndarray]]) -> float:
    """Layer 0's last output against the float64 oracle over the final cache: the last step
    attended exactly the final lengths, with the q it had just rotated (in place unfused; the
    fused kernel rotates a copy of the unchanged q at the last position)."""
    from lowlevel_fd.quant import hadamard_rows
    from lowlevel_fd.reference import decode_attention_ref, rope_ref
    layer = state[0]
    q = layer["q"].astype(np.float32)
    if loop.step.fused and loop.rope is not None:
        positions = state[-1]["seq_lens"].astype(np.int64) - 1
        table = loop.table.numpy(stream=loop.stream)
        q = rope_ref(q, positions, style=loop.rope, cos_sin=table).astype(np.float32)
        if loop.args.key_transform == "hadamard":  # the kernel transforms the rotated q
            q = hadamard_rows(q)
        q = q.astype(np.float16)
    caches = [layer[name] for name in CACHES]
    layout = loop.args.kv_layout
    if loop.args.page_size:
        caches = [loop.contiguous(name, x) if name.endswith("cache") or
                  loop.scale_mode == "token" else x for name, x in zip(CACHES, caches)]
        layout = "bnsh"
    ref, _ = decode_attention_ref(q.astype(np.float32), *caches, state[-1]["seq_lens"],
                                  kv_layout=layout, scale_mode=loop.scale_mode)
    return float(np.abs(layer["out"].astype(np.float64) - ref).max() / np.abs(ref).max())


def main(argv: list[str] | None = None) -> int:
    from benchlib.report import write_json
    from benchlib.session import device_line, progress, run_metadata
    from benchlib.stats import summarize
    from lowlevel_fd.driver import Device, Stream

    args = build_parser().parse_args(argv)
    device = Device(0)
    print(device_line(device))
    with Stream(device) as stream:
        progress("building the layers and quantizing the context")
        loop = Loop(args, device, stream)
        try:
            progress(f"eager: {args.warmup} + {args.steps} steps")
            eager_us, eager_state = timed_pass(
                loop, lambda: loop.step.eager(loop.buffers, loop.seq_lens, stream))
            with loop.step.capture(loop.buffers, loop.seq_lens, stream) as graph:
                graph.upload(stream)
                kinds = graph.node_kinds()
                progress(f"graph: {args.warmup} + {args.steps} replays")
                graph_us, graph_state = timed_pass(loop, lambda: graph.launch(stream))
            flags = loop.step.error_flags(stream=stream)
            error = oracle_error(loop, graph_state)
            same = identical(eager_state, graph_state)
            described = loop.step.describe()
        finally:
            loop.close()

    L = args.layers
    launches = kinds.get("kernel", 0) / L
    kv_bytes = L * 2 * args.batch * loop.num_kv_heads * args.head_dim * (args.context + 1)
    print(f"{L} layers, B={args.batch}, {args.context} tokens of context (+{args.warmup} "
          f"warm-up, +{args.steps} timed steps), H={loop.num_q_heads}/{loop.num_kv_heads} "
          f"D={args.head_dim} {args.kv_layout} {args.scale_mode} rope={args.rope} "
          f"init={args.init} {'unfused' if args.unfused else 'fused'}"
          + (f" page {args.page_size} ({args.page_order} order)" if args.page_size else ""))
    print(f"L2 honesty: {kv_bytes / 2**20:.1f} MiB of int8 K/V per step in {L} distinct "
          f"caches, L2 = {device.info.l2_bytes / 2**20:.0f} MiB")
    print(f"graph: {sum(kinds.values())} nodes "
          f"{dict(kinds)}; {launches:.3g} kernel launches per layer (planned "
          f"{described['launches_per_layer']} per layer + {described['launches_per_step']} "
          f"per step); attention splits {described['attention']['num_splits']}"
          f"{' in a cluster' if described['attention'].get('cluster') else ''}")
    print(f"{'':8}{'us/step median [p20, p80]':>34}{'us/layer median [p20, p80]':>34}")
    summaries = {}
    for name, samples in (("graph", graph_us), ("eager", eager_us)):
        s = summarize(samples)
        summaries[name] = s
        print(f"{name:8}{s.median:>14.1f} [{s.p20:8.1f}, {s.p80:8.1f}]"
              f"{s.median / L:>14.2f} [{s.p20 / L:8.2f}, {s.p80 / L:8.2f}]")
    per_layer = summaries["graph"].median / L
    met = per_layer <= TARGET_US_PER_LAYER and launches <= TARGET_LAUNCHES
    print(f"target (H100, graph replay: <= {TARGET_US_PER_LAYER:g} us/layer in <= "
          f"{TARGET_LAUNCHES} launches/layer): {'PASS' if met else 'FAIL'} "
          f"({per_layer:.2f} us/layer, {launches:.3g} launches/layer, {device.info.name})")
    print(f"graph replay vs eager after {args.warmup + args.steps} steps: "
          f"{'bitwise identical' if same else 'DIFFERENT'}")
    print(f"oracle, layer 0 last step: max|out-ref|/max|ref| = {error:.2e}; error flags {flags}")
    if args.json:
        write_json(args.json, {"meta": run_metadata("tools/decode_loop.py", argv or sys.argv[1:],
                                                    device),
                               "args": vars(args), "graph_us_per_step": graph_us,
                               "eager_us_per_step": eager_us, "nodes": dict(kinds),
                               "launches_per_layer": launches, "bitwise_identical": same,
                               "oracle_max_rel_err": error, "target_met": met,
                               "error_flags": flags, "plan": described})
    ok = same and error <= 2e-3 and not flags
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
