"""Run one decode workload a few times (for ncu / compute-sanitizer). Usage:
PYTHONPATH=. python3 tools/profile_one.py B S [CONFIG], CONFIG as in probe_configs.py:
"w,splits,min,stages,fused[,cluster[,pdl[,tiles]]]" (default: the planner's choice)."""
from __future__ import annotations

import argparse

import numpy as np
from probe_configs import CACHE, HEADS, HEAD_DIM, KV_HEADS, parse_configs

from lowlevel_fd import DecodePlan, DeviceArray, Stream


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split(". Usage")[0])
    parser.add_argument("batch", type=int, metavar="B")
    parser.add_argument("length", type=int, metavar="S")
    parser.add_argument("config", nargs="?", help="'w,splits,min,stages,fused[,cluster[,pdl"
                                                  "[,tiles]]]' (default: the planner's)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = parse_configs(args.config)[0] if args.config else None
    except (TypeError, ValueError) as exc:
        parser.error(f"config: {exc}")
    batch, length = args.batch, args.length
    rng = np.random.default_rng(0)
    shape = (batch, KV_HEADS, length, HEAD_DIM)
    arrays = [DeviceArray.from_numpy(rng.integers(-127, 128, shape, dtype=np.int8))
              for _ in range(2)]
    scales = [DeviceArray.from_numpy(rng.uniform(0.004, 0.012, shape[:3]).astype(np.float32))
              for _ in range(2)]
    q = DeviceArray.from_numpy(rng.standard_normal((batch, HEADS, HEAD_DIM)).astype(np.float16))
    out = DeviceArray.empty((batch, HEADS, HEAD_DIM), np.float16)
    lens = DeviceArray.from_numpy(np.full(batch, length, np.int32))
    stream = Stream()
    plan = DecodePlan(CACHE, HEADS, max_batch=batch, max_seq_len=length).plan([length] * batch,
                                                                              config=config)
    print(plan.describe())
    for _ in range(3):
        plan.run(q, arrays[0], arrays[1], scales[0], scales[1], lens, out, stream=stream)
    stream.synchronize()


if __name__ == "__main__":
    main()
