"""gpu_report.py's JSON as markdown tables (accuracy, generation, throughput)."""
from __future__ import annotations

TOKEN_TOP1_TARGET, TOKEN_PPL_TARGET = 0.985, 0.01


def markdown(report: dict) -> str:
    env, settings = report.get("environment", {}), report.get("settings", {})
    lines = [f"SmolLM2-135M-Instruct ({settings.get('dtype')} weights), "
             f"{env.get('gpu', 'no GPU')}, torch {env.get('torch')}, lowlevel_fd "
             f"{env.get('lowlevel_fd')}, {env.get('date')}"
             + (" (--quick)" if settings.get("quick") else ""), ""]
    if "storage" in settings:
        lines += [_int8_settings(settings), ""]
    sections = report.get("sections", {})
    for name, render in (("accuracy", _accuracy), ("generation", _generation),
                         ("throughput", _throughput)):
        if name not in sections:
            continue
        result = sections[name]
        if "error" in result:
            lines += [f"**{name} failed**: `{result['error']}`", ""]
            continue
        lines += render(result) + [""]
    return "\n".join(lines)


def _int8_settings(settings: dict) -> str:
    """One line: where the INT8 backends keep their cache and how they attend the prompt."""
    storage = settings["storage"]
    where = ("contiguous per sequence ([B, Hkv, S, D])" if storage == "contiguous" else
             f"pages of {settings.get('page_size')} tokens in {storage} order, assigned in a "
             f"random physical order (seed {settings.get('page_seed')}) through one block table")
    prefill = {"multi": "the library's MultiPlan over the INT8 cache",
               "sdpa": "torch SDPA over the un-quantized K/V",
               "both": "the library's MultiPlan over the INT8 cache (`+sdpa-prefill`: torch "
                       "SDPA over the un-quantized K/V)"}.get(settings.get("prefill"),
                                                             settings.get("prefill"))
    return f"INT8 caches: {where}; the prompt's attention: {prefill}."


def _accuracy(result: dict) -> list[str]:
    chunks, text = result.get("chunks", [0, 0]), result.get("text", {})
    lines = [f"Teacher-forced decode over {text.get('source')} ({text.get('tokens')} tokens): "
             f"{chunks[0]} sequences of {chunks[1]} tokens, the first "
             f"{result['prompt_tokens']} of each its prompt, every later token appended and "
             f"attended by a graph-captured decode step; scored: the decode steps' predictions. "
             f"Reference: fp32 KV cache, fp32 SDPA. Static scales: prompt absmax x "
             f"{result.get('static_margin')} / 127.", "",
             "| KV cache | scored tokens | top-1 agreement with fp32 KV | PPL | PPL fp32 KV | "
             "ΔPPL | top-1 = text | target |",
             "|---|--:|--:|--:|--:|--:|--:|---|"]
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row['backend']} | failed: `{row['error']}` |||||||")
            continue
        target = ""
        if row["backend"].startswith("int8-token"):
            met = (row["top1_agreement"] >= TOKEN_TOP1_TARGET
                   and abs(row["delta_ppl"]) <= TOKEN_PPL_TARGET)
            target = ("met" if met else "MISSED") + " (≥98.5%, ≤1%)"
        flags = f" (error flags {row['error_flags']})" if row.get("error_flags") else ""
        lines.append(f"| {row['backend']}{flags} | {row['scored_tokens']} | "
                     f"{100 * row['top1_agreement']:.2f}% | {row['ppl']:.3f} | "
                     f"{row['ref_ppl']:.3f} | {100 * row['delta_ppl']:+.2f}% | "
                     f"{100 * row['top1_vs_text']:.2f}% | {target} |")
    return lines


def _generation(result: dict) -> list[str]:
    rows = result["rows"]
    backends = [b for b in dict.fromkeys(r["backend"] for r in rows) if b != "sdpa-fp32"]
    prompts = sorted({r["prompt"] for r in rows})
    by = {(r["backend"], r["prompt"]): r for r in rows}
    lines = [f"Greedy generation, {result['new_tokens']} new tokens per prompt (ChatML, the "
             f"prompts batched): the first position (0-based, within the reference's answer "
             f"up to its end-of-turn token) where each KV cache's output differs from the "
             f"fp32-KV reference; 'none' = identical.", "",
             "| prompt | " + " | ".join(backends) + " |",
             "|---|" + "--:|" * len(backends)]
    for k in prompts:
        question = by[("sdpa-fp32", k)]["question"] if ("sdpa-fp32", k) in by else k
        cells = []
        for b in backends:
            diff = by.get((b, k), {}).get("first_difference", "n/a")
            cells.append("none" if diff is None else str(diff))
        lines.append(f"| {question} | " + " | ".join(cells) + " |")
    for failure in result.get("failures", []):
        lines.append(f"\n{failure['backend']} failed: `{failure['error']}`")
    lines += ["", "Answers (fp32-KV reference, then each backend that differs; first 160 "
              "characters):", ""]
    for k in prompts:
        ref = by.get(("sdpa-fp32", k))
        if ref is None:
            continue
        lines.append(f"- {ref['question']}\n  - sdpa-fp32: {_short(ref['text'])}")
        for b in backends:
            row = by.get((b, k))
            if row and row["first_difference"] is not None:
                lines.append(f"  - {b} (from token {row['first_difference']}): "
                             f"{_short(row['text'])}")
    return lines


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[:limit] + "…")


def _throughput(result: dict) -> list[str]:
    rows = result["rows"]
    fp16 = {(r["batch"], r["context"]): r for r in rows
            if r["backend"] == "sdpa-fp16" and "error" not in r}
    lines = [f"Decode throughput: the whole step (30 layers + LM head) as one CUDA graph, "
             f"median of {result['iters']} event-timed replays after {result['warmup']} "
             f"(p20-p80), each sequence at about the context length. Attention: a graph of "
             f"only the attention work of a step (INT8: 30 append_and_run + advance_lengths; "
             f"fp16: RoPE, cache writes, mask, SDPA), timed alone.", "",
             "| B | context | KV cache | step ms (p20-p80) | tokens/s | vs fp16 SDPA | "
             "attention ms | attention share | KV bytes/token |",
             "|--:|--:|---|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['context']} | {r['backend']} | failed: "
                         f"`{r['error']}` ||||||")
            continue
        step, attn = r["step_ms"], r["attention_ms"]
        base = fp16.get((r["batch"], r["context"]))
        speedup = (f"{base['step_ms']['median_ms'] / step['median_ms']:.2f}x"
                   if base and r["backend"] != "sdpa-fp16" else "")
        lines.append(f"| {r['batch']} | {r['context']} | {r['backend']} | "
                     f"{step['median_ms']:.3f} ({step['p20_ms']:.3f}-{step['p80_ms']:.3f}) | "
                     f"{r['tokens_per_s']:,.0f} | {speedup} | {attn['median_ms']:.3f} | "
                     f"{100 * r['attention_share']:.0f}% | {r['kv_bytes_per_token']:,} |")
    return lines
