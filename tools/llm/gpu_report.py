"""SmolLM2-135M-Instruct on the GPU through lowlevel_fd's INT8 KV cache, against torch SDPA over
fp32 and fp16 caches: accuracy (teacher-forced decode), greedy generation and decode
throughput, written as JSON and markdown to --out and printed.

    PYTHONPATH=.:tools python3 tools/llm/gpu_report.py --out results/llm [--quick]

The INT8 caches live in pages (`--storage hnd` by default or `nhd`, `--page-size 16`: pages
in a seeded random physical order behind one block table) or contiguous (`--storage contiguous`); the prompt's
attention runs in the library's MultiPlan over the INT8 cache (`--prefill multi`), in torch
SDPA over the un-quantized K/V (`sdpa`), or both (`both`: every INT8 backend also as
`<name>+sdpa-prefill` in the accuracy and generation sections).

Each section runs on its own: a failure is recorded with its traceback in the JSON and the
other sections still run. Exit status 1 if any section (or any backend in one) failed.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `llm` importable from tools/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llm.int8_storage import (DEFAULT_PAGE_SIZE, DEFAULT_STORAGE, PAGE_SIZES,  # noqa: E402
                              STORAGES)

QUESTIONS = ["What is the capital of France?",
             "Explain in two sentences why the sky is blue.",
             "Write a short poem about the sea.",
             "What are three tips for learning a new language?",
             "How does a refrigerator keep food cold?"]

FULL = {"chunks": 4, "chunk_tokens": 1056, "prompt_tokens": 32, "questions": 5,
        "new_tokens": 128, "batches": (1, 16, 64), "contexts": (1024, 4096, 8192),
        "warmup": 10, "iters": 50}
QUICK = {"chunks": 2, "chunk_tokens": 96, "prompt_tokens": 16, "questions": 2,
         "new_tokens": 16, "batches": (1, 16), "contexts": (1024,), "warmup": 3, "iters": 10}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for llm_report.json/.md")
    parser.add_argument("--quick", action="store_true", help="a smoke test: few tokens")
    parser.add_argument("--gguf", help="the GGUF file (default: locate.py's lookup)")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16",
                        help="the model's weights and activations")
    parser.add_argument("--sections", default="accuracy,generation,throughput")
    parser.add_argument("--static-margin", type=float, default=1.0,
                        help="head/tensor scales: prompt absmax x this / 127")
    parser.add_argument("--storage", choices=STORAGES, default=DEFAULT_STORAGE,
                        help="the INT8 cache: pages in nhd or hnd order, or contiguous bnsh")
    parser.add_argument("--page-size", type=int, choices=PAGE_SIZES, default=DEFAULT_PAGE_SIZE,
                        metavar="N", help="tokens per page (paged storage; default 16)")
    parser.add_argument("--page-seed", type=int, default=0,
                        help="seed of the random physical page order")
    parser.add_argument("--prefill", choices=("multi", "sdpa", "both"), default="multi",
                        help="the INT8 backends' prompt attention: the library's MultiPlan "
                             "over the INT8 cache, torch SDPA over fp16 K/V, or both")
    return parser.parse_args(argv)


def int8_options(args: argparse.Namespace) -> dict:
    """The INT8 backends' options (make_attention's) from the command line (contiguous
    storage ignores the page options)."""
    return {"storage": args.storage, "page_size": args.page_size, "page_seed": args.page_seed,
            "prefill": "sdpa" if args.prefill == "sdpa" else "multi"}


def backend_names(names, int8, prefill: str) -> tuple:
    """The accuracy and generation sections' backends: `names`, and with `--prefill both`
    every INT8 one again with its prompt attended in torch SDPA."""
    extra = tuple(f"{name}+sdpa-prefill" for name in int8) if prefill == "both" else ()
    return tuple(names) + extra


def log(message: str) -> None:
    print(message, flush=True)


def environment() -> dict:
    import torch

    import lowlevel_fd
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "lowlevel_fd": lowlevel_fd.__version__, "date": time.strftime("%Y-%m-%d %H:%M")}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from llm import locate
    from llm.backends import HADAMARD, INT8, NAMES, english_text
    from llm.report_tables import markdown
    from llm.tokenizer import Tokenizer
    from llm.torch_model import DTYPES, TorchLlama
    from llm.weights import load_weights, open_gguf

    settings = dict(QUICK if args.quick else FULL)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    options = int8_options(args)
    names = backend_names(NAMES + HADAMARD, INT8 + HADAMARD, args.prefill)
    report = {"settings": {**settings, "dtype": args.dtype, "quick": args.quick,
                           "static_margin": args.static_margin, "storage": args.storage,
                           "page_size": args.page_size if args.storage != "contiguous" else None,
                           "page_seed": args.page_seed, "prefill": args.prefill},
              "environment": environment(), "sections": {}}
    if not torch.cuda.is_available():
        log("gpu_report: no CUDA device visible to torch")
        return 2
    started = time.perf_counter()
    path = locate.find_gguf(args.gguf)
    reader = open_gguf(path)
    tokenizer = Tokenizer.from_gguf(reader)
    model = TorchLlama(load_weights(reader), dtype=DTYPES[args.dtype], device="cuda")
    report["model"] = str(path)
    log(f"model {path} loaded in {time.perf_counter() - started:.1f} s ({args.dtype})")
    failed = False

    def section(name, run):
        nonlocal failed
        if name not in args.sections.split(","):
            return
        log(f"{name} ...")
        begun = time.perf_counter()
        try:
            report["sections"][name] = run()
            result = report["sections"][name]
            failed |= any("error" in row for row in result.get("rows", []))
            failed |= bool(result.get("failures"))
        except Exception as exc:
            failed = True
            report["sections"][name] = {"error": f"{type(exc).__name__}: {exc}",
                                        "traceback": traceback.format_exc()}
            log(f"{name} FAILED:\n{traceback.format_exc()}")
        report["sections"][name]["seconds"] = time.perf_counter() - begun
        _write(out, report, markdown)

    def accuracy():
        from llm.measure import accuracy as run
        source, text = english_text()
        ids = tokenizer.encode(text, special=False)
        c, n = settings["chunks"], settings["chunk_tokens"]
        if len(ids) < c * n:
            n = len(ids) // c
        chunks = torch.tensor(ids[:c * n], dtype=torch.int64).view(c, n).cuda()
        result = run(model, names, chunks, settings["prompt_tokens"],
                     static_margin=args.static_margin, int8_options=options, log=log)
        result["text"] = {"source": source, "tokens": len(ids)}
        return result

    def generation():
        from llm.measure import generation as run
        return run(model, tokenizer, names, QUESTIONS[:settings["questions"]],
                   settings["new_tokens"], static_margin=args.static_margin,
                   int8_options=options, log=log)

    def throughput():
        from llm.throughput import throughput as run
        return run(model, ("sdpa-fp16", INT8[0], HADAMARD[0]), settings["batches"],
                   settings["contexts"],
                   warmup=settings["warmup"], iters=settings["iters"], int8_options=options,
                   log=log)

    # Everything on a created stream: the library's launches go to torch's current stream,
    # and the legacy default stream is no place for them (nor can it be captured).
    with torch.cuda.stream(torch.cuda.Stream()):
        section("accuracy", accuracy)
        section("generation", generation)
        section("throughput", throughput)
    report["seconds"] = time.perf_counter() - started
    text = _write(out, report, markdown)
    print(text, flush=True)
    log(f"wrote {out / 'llm_report.json'} and {out / 'llm_report.md'} "
        f"in {report['seconds']:.0f} s")
    return 1 if failed else 0


def _write(out: Path, report: dict, markdown) -> str:
    (out / "llm_report.json").write_text(json.dumps(report, indent=1, default=str))
    text = markdown(report)
    (out / "llm_report.md").write_text(text)
    return text


if __name__ == "__main__":
    sys.exit(main())
