"""A few eager launches of the token-major kernel (B=128, group 64, S=4096) for ncu."""
import numpy as np
from lowlevel_fd import DeviceArray, MultiPlan, Stream
B, S, D = 128, 4096, 128
rng = np.random.default_rng(0)
k, v = (DeviceArray.from_numpy(rng.integers(-127, 128, (B, 1, S, D), dtype=np.int8)) for _ in range(2))
ks, vs = (DeviceArray.from_numpy(rng.uniform(0.004, 0.012, (B, 1, S)).astype(np.float32)) for _ in range(2))
q = DeviceArray.from_numpy(rng.standard_normal((B, 64, D)).astype(np.float16))
out = DeviceArray.empty((B, 64, D), np.float16)
lens = DeviceArray.from_numpy(np.full(B, S, np.int32))
plan = MultiPlan.create(64, 1, D, max_batch=B, max_seq_len=S).plan(None, [S] * B, causal=False, token_major=True)
with Stream() as stream:
    for _ in range(3):
        plan.run(q, k, v, ks, vs, lens, None, out, stream=stream)
    stream.synchronize()
print(plan.describe()["registers"], plan.describe()["shared_bytes"])
