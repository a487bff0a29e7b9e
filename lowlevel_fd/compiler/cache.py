"""Compile cache: in process, then on disk, keyed by everything that changes the CUBIN.

The key is sha256 over the kernel source and the headers it includes (their names and bytes,
never their absolute paths: a checkout and an installed package share entries), the NVRTC flags
without the include path, the name expressions and the NVRTC version; the flags carry the arch.
The sources are read once per process. A disk entry is written to a
temporary file and ``os.replace``d into place, so readers never see half an entry, and two
processes compiling the same variant both succeed. Each entry carries a checksum of its
payload: a corrupt or truncated entry is a miss and is recompiled.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from .nvrtc import (KERNEL_DIR, CompiledProgram, CompileOptions, KernelResources,
                    compile_source, nvrtc_version)

_MAGIC = b"LLFDCUBIN1\n"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
# In-process entries by (kernel dir, source, options, names), and sources' digests.
_memory: dict[tuple, CompiledProgram] = {}
_digests: dict[tuple[Path, str], bytes] = {}
_lock = threading.Lock()
_disk_disabled_reason: str | None = None
_nvrtc_compiles = 0


def cache_dir() -> Path:
    """``$LOWLEVEL_FD_CACHE_DIR``, else ``$XDG_CACHE_HOME/lowlevel_fd``, else ~/.cache/..."""
    if os.environ.get("LOWLEVEL_FD_CACHE_DIR"):
        return Path(os.environ["LOWLEVEL_FD_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lowlevel_fd"


def _sources_digest(source_file: str) -> bytes:
    """sha256 over ``source_file`` and every header it includes from the kernel directory,
    transitively (names and bytes); memoised per process."""
    memo = (KERNEL_DIR, source_file)
    if memo in _digests:
        return _digests[memo]
    digest, seen, pending = hashlib.sha256(), set(), [source_file]
    while pending:
        name = pending.pop()
        if name in seen or not (KERNEL_DIR / name).is_file():
            continue  # a system header, or one NVRTC resolves elsewhere
        seen.add(name)
        pending.extend(_INCLUDE.findall((KERNEL_DIR / name).read_text()))
    for name in sorted(seen):
        digest.update(name.encode() + b"\0" + (KERNEL_DIR / name).read_bytes() + b"\0")
    return _digests.setdefault(memo, digest.digest())


def cache_key(source_file: str, options: CompileOptions, name_expressions: Sequence[str]) -> str:
    digest = hashlib.sha256(_sources_digest(source_file))
    flags = [flag for flag in options.flags() if not flag.startswith("-I")]
    digest.update(repr((flags, tuple(name_expressions), nvrtc_version())).encode())
    return digest.hexdigest()


def _encode(program: CompiledProgram) -> bytes:
    meta = json.dumps({"log": program.log, "arch": program.arch,
                       "lowered_names": program.lowered_names,
                       "resources": {k: asdict(v) for k, v in program.resources.items()}}).encode()
    payload = len(meta).to_bytes(8, "little") + meta + program.cubin
    return _MAGIC + hashlib.sha256(payload).digest() + payload


def _decode(blob: bytes) -> CompiledProgram | None:
    """The entry, or None when it is corrupt, truncated or from another format."""
    head = len(_MAGIC) + 32
    if len(blob) < head + 8 or not blob.startswith(_MAGIC):
        return None
    payload = blob[head:]
    if hashlib.sha256(payload).digest() != blob[len(_MAGIC):head]:
        return None
    size = int.from_bytes(payload[:8], "little")
    try:
        meta = json.loads(payload[8:8 + size])
    except ValueError:
        return None
    return CompiledProgram(
        cubin=payload[8 + size:], log=meta["log"], arch=meta["arch"],
        lowered_names=meta["lowered_names"],
        resources={k: KernelResources(**v) for k, v in meta["resources"].items()})


def _disable_disk(reason: str) -> None:
    global _disk_disabled_reason
    if _disk_disabled_reason is None:
        warnings.warn(f"lowlevel_fd: compile cache directory unusable ({reason}); "
                      f"caching compiled kernels in memory only", RuntimeWarning, stacklevel=3)
    _disk_disabled_reason = reason


def _read(path: Path) -> CompiledProgram | None:
    try:
        return _decode(path.read_bytes())
    except OSError:
        return None


def _write(path: Path, program: CompiledProgram) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(_encode(program))
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError as exc:  # read-only or full directory: keep working from memory
        _disable_disk(f"{type(exc).__name__}: {exc.strerror or exc}")


def compile_cached(source_file: str, options: CompileOptions,
                   name_expressions: Sequence[str] = ()) -> CompiledProgram:
    """Compile ``lowlevel_fd/cu/<source_file>`` unless this process or the disk has it."""
    global _nvrtc_compiles
    memo = (KERNEL_DIR, source_file, options, tuple(name_expressions))
    with _lock:
        if memo in _memory:
            return _memory[memo]
    key = cache_key(source_file, options, name_expressions)
    path = cache_dir() / f"{Path(source_file).stem}-{options.arch}-{key[:32]}.bin"
    program = _read(path) if _disk_disabled_reason is None else None
    if program is None:
        source = (KERNEL_DIR / source_file).read_text()
        program = compile_source(source, source_file, options, name_expressions)
        with _lock:
            _nvrtc_compiles += 1
        if _disk_disabled_reason is None:
            _write(path, program)
    with _lock:
        return _memory.setdefault(memo, program)


def nvrtc_compiles() -> int:
    """How many programs this process has handed to NVRTC (cache misses)."""
    return _nvrtc_compiles


def clear_memory_cache() -> None:
    """Forget in-process entries and source digests (tests use it to exercise the disk cache)."""
    global _disk_disabled_reason
    with _lock:
        _memory.clear()
        _digests.clear()
    _disk_disabled_reason = None
