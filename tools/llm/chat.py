"""Answers a question with SmolLM2-135M-Instruct on the CPU: the end-to-end check that the
weights, the RoPE layout, the tokenizer and the chat template are all right (a mistake in any of
them shows as gibberish, not as a slightly worse answer).

    python3 tools/llm/chat.py "What is the capital of France?" --max-tokens 64
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `llm` importable from tools/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from llm import locate
from llm.reference import Llama
from llm.tokenizer import Tokenizer
from llm.weights import load_weights, open_gguf, read_config


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default="What is the capital of France?")
    parser.add_argument("--system", help="a system message (default: the template's own)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    parser.add_argument("--gguf", help=f"the GGUF file (default: ${locate.ENV_PATH}, the "
                        f"installed {locate.PACKAGE}, or a one-time download)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    return args


def load(gguf: str | None, dtype: str) -> tuple[Path, Tokenizer, Llama]:
    """The GGUF's path, its tokenizer and the reference model over its weights."""
    path = locate.find_gguf(gguf)
    reader = open_gguf(path)
    config = read_config(reader)
    return path, Tokenizer.from_gguf(reader), Llama(load_weights(reader, config, np.dtype(dtype)))


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    try:
        path, tokenizer, model = load(args.gguf, args.dtype)
    except (locate.ModelUnavailableError, FileNotFoundError) as exc:
        print(f"chat: {exc}", file=sys.stderr)
        return 2
    config = model.config
    loaded = time.perf_counter() - started
    print(f"model: {path} ({config.n_layers} layers, hidden {config.hidden}, "
          f"{config.n_heads}/{config.n_kv_heads} heads, {args.dtype}), loaded in {loaded:.1f} s")

    messages = ([{"role": "system", "content": args.system}] if args.system else [])
    messages.append({"role": "user", "content": args.question})
    prompt = tokenizer.encode_chat(messages)
    stop = {tokenizer.eos_id, tokenizer.token_id("<|endoftext|>")}
    print(f"user: {args.question}\nassistant: ", end="", flush=True)

    generated: list[int] = []
    shown = ""
    started = time.perf_counter()
    first_token_s = None
    for token in model.generate(prompt, args.max_tokens, stop=stop):
        if first_token_s is None:
            first_token_s = time.perf_counter() - started
        generated.append(token)
        text = tokenizer.decode(generated, skip_special=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a split UTF-8 character
            print(text[len(shown):], end="", flush=True)
            shown = text
    total_s = time.perf_counter() - started
    print(tokenizer.decode(generated, skip_special=True)[len(shown):])
    steps = len(generated) - 1  # the first token comes from the prefill
    decode_rate = steps / (total_s - first_token_s) if steps else float("nan")
    print(f"[prompt {len(prompt)} tokens, prefill {first_token_s:.3f} s; {len(generated)} tokens "
          f"generated, {decode_rate:.1f} tokens/s decode, "
          f"{len(generated) / total_s:.1f} tokens/s overall; numpy {args.dtype} on the CPU]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
