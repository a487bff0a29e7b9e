"""Run one decode workload a few times (for ncu / compute-sanitizer). Usage:
profile_one.py B S [CONFIG], CONFIG as in probe_configs.py: "w,splits,min,stages,fused[,cluster
[,pdl[,tiles]]]" (default: the planner's choice)."""
from __future__ import annotations

import sys

import numpy as np
from probe_configs import parse_configs

from lowlevel_fd.decode import DecodePlan
from lowlevel_fd.driver import DeviceArray, Stream


def main() -> None:
    batch, length = int(sys.argv[1]), int(sys.argv[2])
    config = parse_configs(sys.argv[3])[0] if len(sys.argv) > 3 else None
    rng = np.random.default_rng(0)
    shape = (batch, 8, length, 128)
    arrays = [DeviceArray.from_numpy(rng.integers(-127, 128, shape, dtype=np.int8))
              for _ in range(2)]
    scales = [DeviceArray.from_numpy(rng.uniform(0.004, 0.012, shape[:3]).astype(np.float32))
              for _ in range(2)]
    q = DeviceArray.from_numpy(rng.standard_normal((batch, 32, 128)).astype(np.float16))
    out = DeviceArray.empty((batch, 32, 128), np.float16)
    lens = DeviceArray.from_numpy(np.full(batch, length, np.int32))
    stream = Stream()
    plan = DecodePlan(32, 8, 128, max_batch=batch, max_seq_len=length).plan([length] * batch,
                                                                            config=config)
    print(plan.describe())
    for _ in range(3):
        plan.run(q, arrays[0], arrays[1], scales[0], scales[1], lens, out, stream=stream)
    stream.synchronize()


if __name__ == "__main__":
    main()
