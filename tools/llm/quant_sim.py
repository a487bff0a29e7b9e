"""CPU simulation of measure.py's teacher-forced accuracy with a fake-quantized INT8 KV cache:
how much top-1 agreement per-token INT8 K and V cost on their own, with no kernel involved
(tools/results/llm_quant_sim_cpu.json; README "A real model"). Needs torch (CPU is enough).

    PYTHONPATH=.:tools python3 tools/llm/quant_sim.py --out quant_sim.json


Teacher-forced decode with a causal model is exactly a full-sequence forward in which
  * prompt positions (< P) attend over the exact (unquantized) prompt K/V (the prefill), and
  * decode positions (>= P) attend over the cache as it is at that step: every earlier token's
    K/V, and the token's own, as written (here: fake-quantized) -- causal mask.
So each variant is one batched forward over [B, N]; the logits of positions P .. N-2 are the
N-P-1 decode steps of measure.py (checked against a step-by-step decode by --check).

Quantization: per token and KV head, symmetric: scale = absmax/127 (fp32),
q = clamp(round_half_even(x/scale), -127, 127), x_hat = q*scale. K after RoPE.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/: the llm package
from llm import locate  # noqa: E402
from lowlevel_fd.quant import hadamard  # noqa: E402
from llm.backends import english_text  # noqa: E402
from llm.tokenizer import Tokenizer  # noqa: E402
from llm.torch_attention import rope_neox, rope_table, split_qkv, SdpaAttention  # noqa: E402
from llm.torch_model import TorchLlama, rms_norm  # noqa: E402
from llm.weights import load_weights, open_gguf  # noqa: E402


def quantize_rows(x: torch.Tensor, scale_dtype=torch.float32
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D]: per-row (token, head) symmetric INT8: the integers (as fp32) and the row
    scales [..., 1]."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / 127.0
    scale = scale.to(scale_dtype).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.clamp(torch.round(x / safe), -127, 127), scale  # torch.round: half to even


def fake_quant(x: torch.Tensor, scale_dtype=torch.float32) -> torch.Tensor:
    """x [..., D]: per-row (token, head) symmetric INT8 fake quantization in fp32."""
    q, scale = quantize_rows(x, scale_dtype)
    return q * scale


VARIANTS = {
    # name: (quantize K, quantize V, smooth K, extra)
    "ref": dict(k=False, v=False, smooth=False),
    "a_kv": dict(k=True, v=True, smooth=False),
    "b_k": dict(k=True, v=False, smooth=False),
    "c_v": dict(k=False, v=True, smooth=False),
    "d_smoothK_v": dict(k=True, v=True, smooth=True),
    "e_smoothK_only": dict(k=True, v=False, smooth=True),
    "f_fp16kv": dict(k=False, v=False, smooth=False, fp16kv=True),
    "g_kv_fp16scale": dict(k=True, v=True, smooth=False, scale_fp16=True),
    # extras (not in the brief): oracle mean over all tokens; per-channel K equalization
    "h_smoothAllMean_v": dict(k=True, v=True, smooth=True, mean_all=True),
    "i_smoothK_eq0.5_v": dict(k=True, v=True, smooth=True, eq=0.5),
    "j_smoothK_eq1.0_v": dict(k=True, v=True, smooth=True, eq=1.0),
    # KVCacheSpec(key_transform="hadamard"): K stored as H RoPE(k), q transformed alike
    "k_hadamardK_v": dict(k=True, v=True, smooth=False, hadamard=True),
    # An all-integer attention path (PERF_NOTES v29): q quantized per (token, head) row like K,
    # so that Q K^T runs as an int8 x int8 MMA; and the probabilities of P V as unsigned
    # 8-bit steps of the row's largest (with V's per-token scales folded in, as the kernels
    # fold them), so that P V runs as a u8 x s8 MMA. Worst case: steps of the final maximum,
    # where an online softmax would use the running one.
    "l_hadamardK_v_q8": dict(k=True, v=True, smooth=False, hadamard=True, q8=True),
    "m_hadamardK_v_q8_p8": dict(k=True, v=True, smooth=False, hadamard=True, q8=True,
                                p8=True),
    "n_kv_q8": dict(k=True, v=True, smooth=False, q8=True),
}


def make_cache(kr, v, P, var):
    """kr, v: [B, N, Hkv, D] fp32 (K rotated). Returns (K_hat, V_hat) as the decode steps see
    them."""
    sd = torch.float16 if var.get("scale_fp16") else torch.float32
    if var.get("fp16kv"):
        return kr.half().float(), v.half().float()
    kc = kr
    if var["smooth"]:
        span = kr if var.get("mean_all") else kr[:, :P]
        mean = span.mean(dim=1, keepdim=True)    # per seq, KV head, channel over prompt
        kc = kr - mean
    if var.get("hadamard"):  # quantize H k, attend with H q: the same as (Q(H k)) H^T with q
        h = torch.from_numpy(hadamard(kc.shape[-1])).float()
        return fake_quant(kc @ h, sd) @ h, (fake_quant(v, sd) if var["v"] else v)
    if var.get("eq"):
        # per-channel equalization calibrated on the prompt: k' = kc / s, k_hat = Q(k') * s
        # (exact rescale, foldable into q): s_c = (prompt absmax_c)^alpha
        s = kc[:, :P].abs().amax(dim=1, keepdim=True).clamp(min=1e-6) ** var["eq"]
        return fake_quant(kc / s, sd) * s, (fake_quant(v, sd) if var["v"] else v)
    kh = fake_quant(kc, sd) if var["k"] else kc
    vh = fake_quant(v, sd) if var["v"] else v
    return kh, vh


@torch.no_grad()
def forward(model: TorchLlama, tokens: torch.Tensor, P: int, var: dict, attn_dtype):
    """tokens [B, N]; returns logits of positions P .. N-2: [B, N-P-1, vocab] fp32."""
    c = model.config
    b, n = tokens.shape
    cos, sin = rope_table(c.rope_theta, c.head_dim, n, "cpu")
    cos, sin = cos[None], sin[None]
    group = c.n_heads // c.n_kv_heads
    # decode queries at positions P..n-1 see keys 0..pos
    mask = (torch.arange(n)[None, :] <= torch.arange(P, n)[:, None])  # [n-P, n]
    x = model.embedding[tokens]
    for layer in model.layers:
        h = rms_norm(x, layer.attn_norm, c.rms_eps)
        q, k, v = split_qkv(h @ layer.w_qkv.t(), c.n_heads, c.n_kv_heads, c.head_dim)
        qr, kr = rope_neox(q, cos, sin), rope_neox(k, cos, sin)    # fp32 [B,N,H,D]
        v = v.float()
        out = torch.empty(b, n, c.n_heads, c.head_dim, dtype=torch.float32)
        # prefill: exact prompt K/V, causal (as both the reference and the INT8 backend do)
        qp, kp, vp = (t[:, :P].transpose(1, 2).to(attn_dtype) for t in (qr, kr, v))
        kp, vp = kp.repeat_interleave(group, 1), vp.repeat_interleave(group, 1)
        out[:, :P] = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True) \
            .transpose(1, 2).float()
        # decode steps over the cache as written
        kh, vh = make_cache(kr, v, P, var)
        qd = qr[:, P:].transpose(1, 2).to(attn_dtype)                     # [B,Hq,n-P,D]
        kd = kh.transpose(1, 2).to(attn_dtype).repeat_interleave(group, 1)  # [B,Hq,n,D]
        vd = vh.transpose(1, 2).to(attn_dtype).repeat_interleave(group, 1)
        if var.get("q8"):
            qd = quantize_query(qd.float(), var).to(attn_dtype)
        if var.get("p8"):
            out[:, P:] = u8_probability_attention(qd, kd, v, mask, group).transpose(1, 2)
        else:
            out[:, P:] = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask) \
                .transpose(1, 2).float()
        x = x + out.reshape(b, n, -1).to(model.dtype) @ layer.w_o.t()
        x = x + model._mlp(layer, rms_norm(x, layer.ffn_norm, c.rms_eps))
    return model._logits(x[:, P:n - 1])


def quantize_query(q: torch.Tensor, var: dict) -> torch.Tensor:
    """q [B, Hq, T, D]: per-row INT8 fake quantization, in the basis K is stored in (the
    Hadamard one with key_transform), mapped back: scores are then Q(q') . Q(k')."""
    if var.get("hadamard"):
        h = torch.from_numpy(hadamard(q.shape[-1])).float()
        return fake_quant(q @ h) @ h
    return fake_quant(q)


def u8_probability_attention(q, k, v, mask, group):
    """softmax(q k^T / sqrt(D)) V with V int8 per (token, head) and the probabilities, V's
    token scales folded in relative to their largest, in steps of 1/255 of the row's largest;
    the normaliser from the unrounded probabilities. q, k [B, Hq, T or N, D] (k as the cache
    holds it), v [B, N, Hkv, D] fp32 (unquantized). Returns [B, Hq, T, D] fp32."""
    v8, scale = quantize_rows(v)                                            # scale [B, N, Hkv, 1]
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.exp(scores - scores.amax(-1, keepdim=True))                   # [B, Hq, T, N]
    l = p.sum(-1, keepdim=True)
    sv = scale[..., 0].transpose(1, 2).repeat_interleave(group, 1)          # [B, Hq, N]
    ref = sv.amax(-1, keepdim=True)[..., None]                              # [B, Hq, 1, 1]
    folded = p * (sv[:, :, None, :] / ref)
    top = folded.amax(-1, keepdim=True).clamp(min=1e-30)
    folded = torch.round(folded / top * 255.0) / 255.0 * top
    values = v8.transpose(1, 2).repeat_interleave(group, 1)                 # [B, Hq, N, D]
    return (folded @ values) * ref / l


class FakeQuantSdpa(SdpaAttention):
    """Step-by-step check backend: SdpaAttention (fp32 cache) that writes fake-quantized K/V."""

    def __init__(self, *a, var, P, **kw):
        super().__init__(*a, **kw)
        self.var, self.P, self.means = var, P, {}

    def _q(self, layer, kr, v):  # kr, v [B, T, Hkv, D]
        var = self.var
        if var["smooth"]:
            kr = kr - self.means[layer]
        kh = fake_quant(kr) if var["k"] else kr
        vh = fake_quant(v) if var["v"] else v.float()
        return kh, vh

    def prefill(self, layer, q, k, v):
        t = q.shape[1]
        cos, sin = self.cos[None, :t], self.sin[None, :t]
        kr = rope_neox(k, cos, sin)
        self.means[layer] = kr.mean(dim=1, keepdim=True)
        out = super().prefill(layer, q, k, v)
        kh, vh = self._q(layer, kr, v)
        self.k_cache[layer, :, :, :t] = kh.transpose(1, 2)
        self.v_cache[layer, :, :, :t] = vh.transpose(1, 2)
        return out

    def decode(self, layer, q, k, v):
        c = self.config
        kr = rope_neox(k, self._cos, self._sin)[:, None]
        kh, vh = self._q(layer, kr, v[:, None])
        group = c.n_heads // c.n_kv_heads
        q_rot = rope_neox(q, self._cos, self._sin)
        keys, values = self.k_cache[layer], self.v_cache[layer]
        keys[self._batch_index, :, self._write_at] = kh[:, 0]
        values[self._batch_index, :, self._write_at] = vh[:, 0]
        queries = q_rot.view(self.batch, c.n_kv_heads, group, c.head_dim)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=self._mask,
                                             scale=1.0 / math.sqrt(c.head_dim))
        return out.reshape(self.batch, c.n_heads, c.head_dim).to(self.dtype)


def check(model, chunks, P, n_check=80):
    """Batched forward vs step-by-step decode (model.decode) on a short prefix."""
    tok = chunks[:, :n_check]
    for name in ("ref", "a_kv", "d_smoothK_v"):
        var = VARIANTS[name]
        batched = forward(model, tok, P, var, torch.float32)
        att = FakeQuantSdpa(model.config, batch=tok.shape[0], capacity=n_check, dtype=model.dtype,
                            cache_dtype=torch.float32, device="cpu", var=var, P=P)
        with torch.no_grad():
            model.prefill(tok[:, :P], [P] * tok.shape[0], att)
            steps = []
            for j in range(n_check - P - 1):
                att.begin_step()
                steps.append(model.decode(tok[:, P + j], att))
        stepwise = torch.stack(steps, 1)
        diff = (batched - stepwise).abs().max().item()
        agree = (batched.argmax(-1) == stepwise.argmax(-1)).float().mean().item()
        print(f"check {name}: max |logit diff| {diff:.2e}, argmax agreement {agree:.4f}",
              flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--chunk-tokens", type=int, default=1056)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--model-dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--attn-dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--out", default="quant_sim.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    torch.set_num_threads(2)
    reader = open_gguf(locate.find_gguf(download=False))
    tokenizer = Tokenizer.from_gguf(reader)
    mdt = getattr(torch, args.model_dtype)
    model = TorchLlama(load_weights(reader), dtype=mdt, device="cpu")
    source, text = english_text()
    ids = tokenizer.encode(text, special=False)
    c, n = args.chunks, args.chunk_tokens
    if len(ids) < c * n:
        n = len(ids) // c
    chunks = torch.tensor(ids[:c * n], dtype=torch.int64).view(c, n)
    P = args.prompt
    print(f"text {source}: {len(ids)} tokens; chunks {c}x{n}, prompt {P}; "
          f"setup {time.perf_counter() - t0:.1f}s", flush=True)
    if args.check:
        check(model, chunks, P)
    attn_dtype = getattr(torch, args.attn_dtype)
    targets = chunks[:, P + 1:]                                   # [B, steps]
    res = {}
    for name in ["ref"] + [v for v in args.variants.split(",") if v != "ref"]:
        t1 = time.perf_counter()
        tops, logps, margins = [], [], []
        for bi in range(c):  # one sequence at a time (memory)
            logits = forward(model, chunks[bi:bi + 1], P, VARIANTS[name], attn_dtype)[0]
            lsm = torch.log_softmax(logits.double(), -1)
            tops.append(logits.argmax(-1))
            logps.append(lsm.gather(1, targets[bi][:, None])[:, 0])
            top2 = logits.topk(2, -1).values
            margins.append(top2[:, 0] - top2[:, 1])
        res[name] = {"top": torch.stack(tops), "logp": torch.stack(logps),
                     "margin": torch.stack(margins)}
        ref = res["ref"]
        r = res[name]
        agree = (r["top"] == ref["top"]).double()
        ppl = math.exp(-r["logp"].mean().item())
        rppl = math.exp(-ref["logp"].mean().item())
        r["summary"] = {"scored_tokens": r["top"].numel(),
                        "top1_agreement": agree.mean().item(),
                        "per_seq": agree.mean(1).tolist(),
                        "disagreements": int((1 - agree).sum().item()),
                        "top1_vs_text": (r["top"] == targets).double().mean().item(),
                        "ppl": ppl, "ref_ppl": rppl, "delta_ppl": ppl / rppl - 1,
                        "seconds": time.perf_counter() - t1}
        s = r["summary"]
        print(f"{name:16s} top1 {s['top1_agreement']*100:6.2f}% ({s['disagreements']} of "
              f"{s['scored_tokens']}) per-seq {[round(x*100, 2) for x in s['per_seq']]} "
              f"PPL {ppl:.4f} (ref {rppl:.4f}) dPPL {s['delta_ppl']*100:+.3f}% "
              f"vs-text {s['top1_vs_text']*100:.2f}% {s['seconds']:.0f}s", flush=True)
    # near-tie analysis: reference logit margin of disagreeing positions
    refm = res["ref"]["margin"]
    print("reference top1-top2 logit margin quantiles (all scored):",
          [round(refm.flatten().quantile(qq).item(), 3) for qq in (0.01, 0.02, 0.05, 0.1)])
    for name, r in res.items():
        if name == "ref":
            continue
        dis = r["top"] != res["ref"]["top"]
        if dis.any():
            m = refm[dis]
            print(f"{name:16s} disagreeing positions' ref margin: median {m.median().item():.3f}"
                  f" max {m.max().item():.3f}")
    out = {k: v["summary"] for k, v in res.items() if "summary" in v}
    out["settings"] = vars(args) | {"seconds": time.perf_counter() - t0, "source": source,
                                     "text_tokens": len(ids)}
    Path(args.out).write_text(json.dumps(out, indent=1))
    torch.save({k: {kk: vv for kk, vv in v.items() if kk != "summary"} for k, v in res.items()},
               Path(args.out).with_suffix(".pt"))
    print(f"total {time.perf_counter() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
