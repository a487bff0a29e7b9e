"""The GPU runner's accuracy and generation measurements (gpu_report.py prints them).

Teacher-forced decode: the text is cut into B chunks of N tokens, run as B sequences. Each
chunk's first P tokens are its prompt (prefill: the INT8 backends write it with the library's
prompt quantizer, calibrate their static scales on it and attend it with the library's
multi-token attention over the INT8 cache); then N - P - 1 graph-captured decode
steps feed the text's next token to every sequence, each appended to the cache and attended.
Only the decode steps' predictions are scored: per backend the top-1 token at every position
and the log-probability of the true next token, so that top-1 agreement with the fp32-KV
reference and each backend's perplexity come from the same positions.

Greedy generation: B chat prompts batched (a right-padded prefill of ragged prompts), the
first token from the prefill's logits, the rest from graph-captured decode steps fed their own
argmax.
"""
from __future__ import annotations

import math
import time

import torch

from .backends import REFERENCE, make_attention
from .graph_step import GraphStep
from .int8_attention import capacity_for


def guarded(section: str, name: str, call, failures: list, log):
    """``call()``, or None after recording its failure in ``failures``: one backend's failure
    keeps the others' numbers (the reference's failure is raised: nothing compares without
    it)."""
    log(f"  {section}: {name} ...")
    try:
        return call()
    except Exception as exc:
        if name == REFERENCE:
            raise
        import traceback
        failures.append({"backend": name, "error": f"{type(exc).__name__}: {exc}",
                         "traceback": traceback.format_exc()})
        log(f"  {section}: {name} FAILED: {exc}")
        return None


def backend_settings(attention) -> dict:
    """The INT8 backend's storage and prefill (Int8Attention.settings) for a report row; {} for
    the SDPA backends."""
    return attention.settings() if hasattr(attention, "settings") else {}


def teacher_forced(model, name: str, chunks: torch.Tensor, prompt_tokens: int, *,
                   static_margin: float = 1.0, int8_options: dict | None = None) -> dict:
    """Backend `name` over `chunks` `[B, N]` (int64 ids on the model's device): the top-1 ids
    `[steps, B]` and the log-probabilities of the true tokens `[steps, B]` of the decode steps
    (on the device), the steps, the library's error flags (INT8), the backend's settings and
    the time taken. `int8_options`: make_attention's options of the INT8 backends."""
    started = time.perf_counter()
    batch, n = chunks.shape
    steps = n - prompt_tokens - 1
    if prompt_tokens < 1 or steps < 1:
        raise ValueError(f"chunks of {n} tokens leave no decode step after a "
                         f"{prompt_tokens}-token prompt")
    attention = make_attention(name, model.config, batch=batch, capacity=capacity_for(n),
                               dtype=model.dtype, device=model.device,
                               static_margin=static_margin, **(int8_options or {}))
    columns = chunks.t().contiguous()                               # [N, B]: one row per step
    try:
        model.prefill(chunks[:, :prompt_tokens], [prompt_tokens] * batch, attention)
        attention.prepare_decode(prompt_tokens + steps - 1)
        graph = GraphStep(model, attention)
        top = torch.empty(steps, batch, dtype=torch.int64, device=model.device)
        logp = torch.empty(steps, batch, dtype=torch.float32, device=model.device)
        for j in range(steps):
            logits = graph.step(columns[prompt_tokens + j])
            top[j] = logits.argmax(-1)
            target = columns[prompt_tokens + j + 1]
            logp[j] = torch.log_softmax(logits, -1).gather(1, target[:, None])[:, 0]
        torch.cuda.synchronize()
        flags = attention.error_flags() if hasattr(attention, "error_flags") else 0
        graph.close()
        return {"top": top, "logp": logp, "steps": steps, "error_flags": flags,
                "settings": backend_settings(attention),
                "seconds": time.perf_counter() - started}
    finally:
        if hasattr(attention, "close"):
            attention.close()


def accuracy(model, names, chunks: torch.Tensor, prompt_tokens: int, *,
             static_margin: float = 1.0, int8_options: dict | None = None, log=print) -> dict:
    """Every backend in `names` (the reference first) teacher-forced over `chunks`; per
    backend: top-1 agreement with the reference, perplexity, relative perplexity change."""
    names = [REFERENCE] + [n for n in names if n != REFERENCE]
    runs, rows = {}, []
    for name in names:
        run = guarded("accuracy", name, lambda: teacher_forced(
            model, name, chunks, prompt_tokens, static_margin=static_margin,
            int8_options=int8_options), rows, log)
        if run is None:
            continue
        runs[name] = run
        ref, run = runs[REFERENCE], runs[name]
        ppl = math.exp(-run["logp"].double().mean().item())
        ref_ppl = math.exp(-ref["logp"].double().mean().item())
        targets = chunks.t()[prompt_tokens + 1:]                     # [steps, B]
        rows.append({
            "backend": name, "scored_tokens": run["top"].numel(),
            "top1_agreement": (run["top"] == ref["top"]).double().mean().item(),
            "top1_vs_text": (run["top"] == targets).double().mean().item(),
            "ppl": ppl, "ref_ppl": ref_ppl, "delta_ppl": ppl / ref_ppl - 1.0,
            "error_flags": run["error_flags"], "seconds": run["seconds"], **run["settings"]})
        log(f"  accuracy: {name}: top-1 agreement {rows[-1]['top1_agreement']:.4f}, "
            f"PPL {ppl:.3f} (ref {ref_ppl:.3f}), {run['seconds']:.1f} s")
    return {"rows": rows, "chunks": list(chunks.shape), "prompt_tokens": prompt_tokens,
            "static_margin": static_margin}


def greedy(model, name: str, prompts, new_tokens: int, *, static_margin: float = 1.0,
           int8_options: dict | None = None) -> tuple[list, int, dict]:
    """Backend `name` greedily continuing each prompt (a list of id lists) for `new_tokens`
    tokens, all prompts as one batch; returns the ids per prompt, the error flags and the
    backend's settings."""
    batch, longest = len(prompts), max(len(p) for p in prompts)
    tokens = torch.zeros(batch, longest, dtype=torch.int64)
    for b, prompt in enumerate(prompts):
        tokens[b, :len(prompt)] = torch.tensor(prompt)
    attention = make_attention(name, model.config, batch=batch,
                               capacity=capacity_for(longest + new_tokens),
                               dtype=model.dtype, device=model.device,
                               static_margin=static_margin, **(int8_options or {}))
    try:
        logits = model.prefill(tokens.to(model.device), [len(p) for p in prompts], attention)
        out = torch.empty(new_tokens, batch, dtype=torch.int64, device=model.device)
        out[0] = logits.argmax(-1)
        if new_tokens > 1:
            attention.prepare_decode(longest + new_tokens - 2)
            graph = GraphStep(model, attention)
            for j in range(1, new_tokens):
                out[j] = graph.step(out[j - 1]).argmax(-1)
            graph.close()
        torch.cuda.synchronize()
        flags = attention.error_flags() if hasattr(attention, "error_flags") else 0
        return out.t().tolist(), flags, backend_settings(attention)
    finally:
        if hasattr(attention, "close"):
            attention.close()


def first_difference(ids: list, reference: list, stop: set) -> int | None:
    """The first position where `ids` differs from `reference`, each cut after its first stop
    id (inclusive); None when they are the same."""
    def cut(seq):
        for i, token in enumerate(seq):
            if token in stop:
                return seq[:i + 1]
        return seq

    a, b = cut(ids), cut(reference)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def generation(model, tokenizer, names, questions, new_tokens: int, *,
               static_margin: float = 1.0, int8_options: dict | None = None,
               log=print) -> dict:
    """The questions as ChatML prompts, greedy `new_tokens` per backend; per INT8/fp16 backend
    and question the first position that differs from the fp32-KV reference."""
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    stop = {tokenizer.eos_id, tokenizer.token_id("<|endoftext|>")}
    names = [REFERENCE] + [n for n in names if n != REFERENCE]
    outputs, rows, failures = {}, [], []
    for name in names:
        result = guarded("generation", name, lambda: greedy(
            model, name, prompts, new_tokens, static_margin=static_margin,
            int8_options=int8_options), failures, log)
        if result is None:
            continue
        outputs[name], flags, settings = result
        for k, question in enumerate(questions):
            ids, ref = outputs[name][k], outputs[REFERENCE][k]
            rows.append({"backend": name, "prompt": k, "question": question,
                         "first_difference": first_difference(ids, ref, stop),
                         "text": tokenizer.decode(_cut(ids, stop), skip_special=True),
                         "error_flags": flags, **settings})
    return {"rows": rows, "failures": failures, "new_tokens": new_tokens,
            "prompt_tokens": [len(p) for p in prompts]}


def _cut(ids: list, stop: set) -> list:
    for i, token in enumerate(ids):
        if token in stop:
            return ids[:i]
    return ids
