"""Run one multi-token workload a few times (for ncu / compute-sanitizer). Usage:
PYTHONPATH=. python3 tools/profile_multi.py QO_LEN KV_LEN [--batch B] [--ksplit K]
(Hq=32, Hkv=8, D=128, fp16, per-token fp32 scales, causal)."""
from __future__ import annotations

import argparse

import numpy as np

from lowlevel_fd import DeviceArray, MultiPlan, Stream


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split(". Usage")[0])
    parser.add_argument("qo_len", type=int)
    parser.add_argument("kv_len", type=int)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--ksplit", type=int, default=None)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    B, qo, kv = args.batch, args.qo_len, args.kv_len
    rng = np.random.default_rng(0)
    q = DeviceArray.from_numpy(rng.standard_normal((B * qo, 32, 128)).astype(np.float16))
    k = DeviceArray.from_numpy(rng.integers(-127, 128, (B, 8, kv, 128), dtype=np.int8))
    v = DeviceArray.from_numpy(rng.integers(-127, 128, (B, 8, kv, 128), dtype=np.int8))
    ks = DeviceArray.from_numpy(rng.uniform(0.004, 0.012, (B, 8, kv)).astype(np.float32))
    vs = DeviceArray.from_numpy(rng.uniform(0.004, 0.012, (B, 8, kv)).astype(np.float32))
    lens = DeviceArray.from_numpy(np.full(B, kv, np.int32))
    indptr_host = np.arange(B + 1, dtype=np.int32) * qo
    indptr = DeviceArray.from_numpy(indptr_host)
    out = DeviceArray.empty((B * qo, 32, 128), np.float16)
    with Stream() as stream, MultiPlan.create(32, 8, 128, max_batch=B, max_seq_len=kv) as plan:
        plan.plan(indptr_host, [kv] * B, ksplit=args.ksplit)
        print(plan.describe())
        for _ in range(args.runs):
            plan.run(q, k, v, ks, vs, lens, indptr, out, stream=stream)
        stream.synchronize()


if __name__ == "__main__":
    main()
