"""Where the token-major kernel's time goes. Builds of multi_tm.cu with
parts removed (results wrong, timing only), L2-honest graph replay, us per layer."""
import os, re, sys, time
import torch
from benchlib.multi_torch import time_graph
from lowlevel_fd import MultiPlan
from lowlevel_fd.compiler.nvrtc import KERNEL_DIR, CompileOptions, compile_source
from lowlevel_fd.multi import variants as V

BASE = (KERNEL_DIR / "multi_tm.cu").read_text()
SUBS = {
    "base": [],
    "noexp": [("fast_exp2(fmaf(s[4 * jj + k], rc[i], -offset))", "fmaf(s[4 * jj + k], rc[i], -offset)")],
    "nofence": [("      store_probabilities(buffer, pp, w, lane);\n      fence_proxy_async();",
                 "      store_probabilities(buffer, pp, w, lane);")],
    "nostore": [("      store_probabilities(buffer, pp, w, lane);\n      fence_proxy_async();",
                 "      if (pp[0] == 0x12345u) store_probabilities(buffer, pp, w, lane);")],
    "noslow": [("team_sync_any(team, grows)", "team_sync_any(team, j == 0)")],
    "nogemm2": [("    load_value_fragments<HEAD_DIM>(vf, stage, w, g, c);", ""),
                ("    issue_values_tm(o, vf, buffer);", "")],
    "nogemm1": [("    issue_scores<HEAD_DIM>(s, kf, base + L::kQ);  // S^T = K Q^T",
                 "    for (int i_ = 0; i_ < 32; ++i_) s[i_] = __uint_as_float(kf[i_ / 4][i_ % 4] & 0x3fffffffu) * 1e-30f;")],
    "nogemms": [("    load_value_fragments<HEAD_DIM>(vf, stage, w, g, c);", ""),
                ("    issue_values_tm(o, vf, buffer);", ""),
                ("    issue_scores<HEAD_DIM>(s, kf, base + L::kQ);  // S^T = K Q^T",
                 "    for (int i_ = 0; i_ < 32; ++i_) s[i_] = __uint_as_float(kf[i_ / 4][i_ % 4] & 0x3fffffffu) * 1e-30f;")],
}
current = {"text": BASE}
orig = V.MultiVariant.compile
def patched(self, arch):
    if not self.token_major:
        return orig(self, arch)
    return compile_source(current["text"], "multi_tm.cu", CompileOptions(arch="sm_90a"), self.kernel_names)
V.MultiVariant.compile = patched

S, D, HQ = 4096, 128, 64
g = torch.Generator(device="cuda").manual_seed(0)
shapes = {}
for batch in (128, 32):
    kv = batch * S * (2 * D + 8)
    layers = max(2, min(64, -(-200 * 2**20 // kv)))
    caches = [(torch.randint(-127, 128, (batch, 1, S, D), dtype=torch.int8, device="cuda", generator=g),
               torch.randint(-127, 128, (batch, 1, S, D), dtype=torch.int8, device="cuda", generator=g),
               torch.rand((batch, 1, S), device="cuda", generator=g) * 0.008 + 0.004,
               torch.rand((batch, 1, S), device="cuda", generator=g) * 0.008 + 0.004) for _ in range(layers)]
    lens = torch.full((batch,), S, dtype=torch.int32, device="cuda")
    q = torch.randn((batch, HQ, D), dtype=torch.float16, device="cuda")
    shapes[batch] = (kv, layers, caches, lens, q, torch.empty_like(q))
from lowlevel_fd.core import loader
for name, subs in SUBS.items():
    text = BASE
    for a, b in subs:
        assert a in text, (name, a)
        text = text.replace(a, b)
    current["text"] = text
    for key in [k for k in loader._loaded if getattr(k[1], "token_major", False)]:
        del loader._loaded[key]  # the module stays loaded (leaked: scratch)
    for batch, (kv, layers, caches, lens, q, out) in shapes.items():
        for splits in ((None, 8) if batch == 32 else (None,)):
            plan = MultiPlan.create(HQ, 1, D, max_batch=batch, max_seq_len=S).plan(
                None, [S] * batch, causal=False, token_major=True, num_splits=splits)
            t = time_graph(lambda: [plan.run(q, *c, lens, None, out, stream=torch.cuda.current_stream())
                                    for c in caches], iters=30, warmup=5, per=layers)
            print(f"B={batch} splits={plan.describe()['num_splits']} {name:9s} {t['median_us']:.1f} us "
                  f"[{t['p20_us']:.1f}, {t['p80_us']:.1f}] pct {kv / 1e3 / 3141 * 100 / t['median_us']:.1f}",
                  flush=True)
            plan.close()
