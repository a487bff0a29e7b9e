"""The GPU runner's attention backends by name, and the text the accuracy runs read.

    sdpa-fp32        float32 KV cache, SDPA (math backend) in float32: the reference
    sdpa-fp16        float16 KV cache, SDPA in float16
    int8-token-fp32  lowlevel_fd, INT8 cache, one fp32 scale per token and KV head
    int8-token-fp16  ... one fp16 scale per token and KV head
    int8-head        ... one fp32 scale per KV head and layer (calibrated on the prompt)
    int8-tensor      ... one fp32 scale per layer for K and one for V (calibrated on the prompt)

The INT8 backends take their storage and prefill from keyword options (`make_attention(...,
storage=, page_size=, page_seed=, prefill=)`; defaults: pages of 16 tokens in "hnd" order,
the prompt attended by the library's MultiPlan). A name may end in a variant suffix
(VARIANTS): `int8-head+sdpa-prefill` is int8-head with the prompt attended in torch SDPA.
"""
from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import torch

from .int8_attention import Int8Attention
from .torch_attention import SdpaAttention

REFERENCE = "sdpa-fp32"
INT8 = ("int8-token-fp32", "int8-token-fp16", "int8-head", "int8-tensor")
NAMES = (REFERENCE, "sdpa-fp16") + INT8
# Name suffixes of the INT8 backends and the options they set (over the caller's).
VARIANTS = {"+sdpa-prefill": {"prefill": "sdpa"}, "+multi-prefill": {"prefill": "multi"},
            "+contiguous": {"storage": "contiguous"}, "+nhd": {"storage": "nhd"},
            "+hnd": {"storage": "hnd"}, "+hadamard": {"key_transform": "hadamard"}}
# Per-token INT8 with Hadamard-transformed keys (KVCacheSpec key_transform="hadamard").
HADAMARD = ("int8-token-fp32+hadamard", "int8-token-fp16+hadamard")

GPL3 = Path("/usr/share/common-licenses/GPL-3")
# Fallback text: the docstrings of these standard-library modules, in this order.
DOC_MODULES = ("argparse", "collections", "json", "os", "pathlib", "re", "subprocess",
               "textwrap", "threading", "functools", "itertools", "logging", "decimal",
               "fractions", "statistics", "datetime", "email.message", "http.client",
               "urllib.parse", "zipfile", "tarfile", "shutil", "typing", "dataclasses")


def split_name(name: str) -> tuple[str, dict]:
    """(base name, INT8 options) of a backend name: NAMES, or an INT8 name followed by
    VARIANTS suffixes (`int8-token-fp32+sdpa-prefill+hnd`)."""
    base, *suffixes = name.split("+")
    options: dict = {}
    for suffix in suffixes:
        if "+" + suffix not in VARIANTS or base not in INT8:
            raise ValueError(f"name: expected one of {NAMES}, an INT8 one followed by "
                             f"{list(VARIANTS)}, got {name!r}")
        options.update(VARIANTS["+" + suffix])
    if base not in NAMES:
        raise ValueError(f"name: expected one of {NAMES}, got {name!r}")
    return base, options


def make_attention(name: str, config, *, batch: int, capacity: int, dtype: torch.dtype,
                   device="cuda", static_margin: float = 1.0, **int8_options):
    """A fresh backend `name` (NAMES, or an INT8 name with VARIANTS suffixes) for `batch`
    sequences of up to `capacity` tokens. `int8_options` (storage, page_size, page_seed,
    prefill: Int8Attention's) apply to the INT8 backends, the name's suffixes over them; the
    SDPA backends ignore them."""
    base, variant = split_name(name)
    if base.startswith("sdpa-"):
        cache_dtype = {"sdpa-fp32": torch.float32, "sdpa-fp16": torch.float16}[base]
        return SdpaAttention(config, batch=batch, capacity=capacity, dtype=dtype,
                             cache_dtype=cache_dtype, device=device)
    mode = base.removeprefix("int8-")
    scale_mode, scale_dtype = (("token", "float" + mode[-2:]) if mode.startswith("token")
                               else (mode, "float32"))
    return Int8Attention(config, batch=batch, capacity=capacity, dtype=dtype,
                         scale_mode=scale_mode, scale_dtype=scale_dtype,
                         static_margin=static_margin, device=device,
                         **{**int8_options, **variant})


def english_text(min_chars: int = 40000) -> tuple[str, str]:
    """(source, text): GPL-3 from Debian's common-licenses when the machine has it, else the
    docstrings of DOC_MODULES (and of their public members) up to `min_chars` characters."""
    if GPL3.is_file():
        return str(GPL3), GPL3.read_text(encoding="utf-8")
    parts: list[str] = []
    used: list[str] = []
    size = 0
    for module_name in DOC_MODULES:
        used.append(module_name)
        module = importlib.import_module(module_name)
        docs = [inspect.getdoc(module)]
        for attribute in sorted(vars(module)):
            member = getattr(module, attribute)
            if attribute.startswith("_") or getattr(member, "__module__", None) != module_name:
                continue
            docs.append(inspect.getdoc(member))
        for doc in docs:
            if doc:
                parts.append(doc)
                size += len(doc) + 2
        if size >= min_chars:
            break
    return "the docstrings of " + ", ".join(used), "\n\n".join(parts)
