"""Quick L2-honest probe of DecodePlan tile configs (development aid; tools/tune.py is the
full sweep). Usage: PYTHONPATH=. python3 tools/probe_configs.py
[--configs "w,splits,min,stages,fused[,cluster[,pdl[,tiles]]];..."] [--pad TOKENS] B,S [B,S ...].
--pad allocates the caches with that many spare tokens per head."""
from __future__ import annotations

import argparse

import numpy as np

from lowlevel_fd import DecodePlan, DeviceArray, KVCacheSpec, Stream, TileConfig
from lowlevel_fd.timing import time_graph

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
CACHE = KVCacheSpec(KV_HEADS, HEAD_DIM)  # bnsh, per-token fp32 scales


def layers_for(nbytes: int) -> int:
    return max(2, min(64, -(-200 * 2**20 // nbytes)))


def probe(batch: int, length: int, configs: list[TileConfig | None], pad: int = 0) -> None:
    rng = np.random.default_rng(0)
    shape = (batch, KV_HEADS, length + pad, HEAD_DIM)
    kv = batch * KV_HEADS * length * (2 * HEAD_DIM + 8)  # int8 K and V, fp32 scales
    num_layers = layers_for(kv)
    stream = Stream()
    lens = DeviceArray.from_numpy(np.full(batch, length, np.int32))
    chunk = rng.integers(-127, 128, 1 << 24, dtype=np.int8)
    layers = []
    for _ in range(num_layers):
        k = DeviceArray.empty(shape, np.int8)
        v = DeviceArray.empty(shape, np.int8)
        flat_k, flat_v = k.reshape(-1), v.reshape(-1)
        for off in range(0, k.size, chunk.size):
            n = min(chunk.size, k.size - off)
            flat_k[off:off + n].copy_from_numpy(chunk[:n])
            flat_v[off:off + n].copy_from_numpy(chunk[::-1][:n])
        ks = DeviceArray.from_numpy(rng.uniform(0.004, 0.012, shape[:3]).astype(np.float32))
        vs = DeviceArray.from_numpy(rng.uniform(0.004, 0.012, shape[:3]).astype(np.float32))
        q = DeviceArray.from_numpy(rng.standard_normal((batch, HEADS, HEAD_DIM)).astype(np.float16))
        out = DeviceArray.empty((batch, HEADS, HEAD_DIM), np.float16)
        layers.append((q, k, v, ks, vs, out))
    for config in configs:
        plan = DecodePlan(CACHE, HEADS, max_batch=batch, max_seq_len=length)
        plan.plan([length] * batch, config=config)
        def step() -> None:
            for q, k, v, ks, vs, out in layers:
                plan.run(q, k, v, ks, vs, lens, out, stream=stream)

        times = [ms * 1e3 / num_layers for ms in time_graph(step, stream, warmup=5, iters=30)]
        med = float(np.median(times))
        d = plan.describe()
        print(f"B={batch:4d} S={length:6d} L={num_layers:2d} warps={d['num_warps']} "
              f"splits={d['num_splits']:3d} min={d['min_split_tokens']:4d} "
              f"stages={d['stages']} fused={int(d['fused_merge'])} cl={int(d['cluster'])} "
              f"pdl={int(d['programmatic'])} tok={d['tile_tokens']} occ={d['ctas_per_sm']} "
              f"regs={d['registers']}  {med:8.2f} us  "
              f"{kv / med / 1e3:7.0f} GB/s", flush=True)
        plan.close()


def parse_configs(text: str) -> list[TileConfig | None]:
    """"w,splits,min,stages,fused[,cluster[,pdl[,tiles]]];..." -> TileConfigs ("auto": the
    planner's choice)."""
    configs: list[TileConfig | None] = []
    for item in text.split(";"):
        if item == "auto":
            configs.append(None)
            continue
        w, sp, mn, st, fu, *flags = (int(x) for x in item.split(","))
        cluster, programmatic, tiles = (flags + [0, 1, 1][len(flags):])[:3]
        configs.append(TileConfig(w, sp, mn, bool(fu), st, bool(cluster), bool(programmatic),
                                  tiles))
    return configs


def parse_shape(text: str) -> tuple[int, int]:
    try:
        batch, length = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected B,S (e.g. 1,32768), got {text!r}") from None
    return batch, length


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split(". Usage")[0])
    parser.add_argument("shapes", nargs="+", type=parse_shape, metavar="B,S")
    parser.add_argument("--configs", help="'w,splits,min,stages,fused[,cluster[,pdl[,tiles]]];"
                                          "...' ('auto': the planner's); default: a grid")
    parser.add_argument("--pad", type=int, default=0,
                        help="spare tokens per head in the caches (default 0)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        explicit = parse_configs(args.configs) if args.configs else None
    except (TypeError, ValueError) as exc:
        parser.error(f"--configs: {exc}")
    for batch, length in args.shapes:
        if explicit is not None:
            probe(batch, length, explicit, args.pad)
            continue
        configs: list[TileConfig | None] = [None]
        for warps in (4, 8):
            for splits in (1, 8, 16, 32):
                for stages in (2, 4, 6):
                    configs.append(TileConfig(warps, splits, 16, True, stages))
            configs.append(TileConfig(warps, 16, 16, False))
        probe(batch, length, configs, args.pad)


if __name__ == "__main__":
    main()
