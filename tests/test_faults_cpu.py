"""Faults of the compile cache, without a GPU (issue 6).

A compile that fails or is interrupted leaves no entry and no temporary file, and is not cached.
A cache directory that is full, read-only or over quota, at any step of the write, falls back to
the in-process cache with one RuntimeWarning, and the compile still succeeds. Threads racing on
one variant share one program and leave one entry; a temporary file left by a crashed writer is
never read.

test_compiler.py covers the rest: two processes compiling one variant (one valid entry),
corrupt entries, and a real read-only directory (skipped as root, hence the errno cases here).
"""
from __future__ import annotations

import errno
import os
import tempfile
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from lowlevel_fd.compiler import (CompiledProgram, CompileError, CompileOptions, cache,
                                  cache_key, clear_memory_cache, compile_cached, nvrtc)

OPTIONS = CompileOptions(arch="sm_90")
GOOD = 'extern "C" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }\n'
OTHER = 'extern "C" __global__ void thrice(float* x) { x[threadIdx.x] *= 3.0f; }\n'
BAD = ('extern "C" __global__ void broken(float* x) {\n'
       '  x[0] = undefined_name;\n'
       '}\n')
FULL = {"ENOSPC": errno.ENOSPC, "EROFS": errno.EROFS, "EACCES": errno.EACCES,
        "EDQUOT": errno.EDQUOT}


@pytest.fixture
def kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A private kernel source directory, an empty cache directory, an empty process cache."""
    sources, directory = tmp_path / "cu", tmp_path / "kernel-cache"
    sources.mkdir()
    monkeypatch.setattr(cache, "KERNEL_DIR", sources)
    monkeypatch.setattr(nvrtc, "KERNEL_DIR", sources)
    monkeypatch.setenv("LOWLEVEL_FD_CACHE_DIR", str(directory))
    clear_memory_cache()
    (sources / "good.cu").write_text(GOOD)
    (sources / "other.cu").write_text(OTHER)
    yield SimpleNamespace(sources=sources, cache=directory)
    clear_memory_cache()  # also re-enables the disk cache for the next test



def files(directory: Path) -> list[str]:
    """Everything in the cache directory: entries and temporary files alike."""
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def entry_path(directory: Path, source_file: str) -> Path:
    key = cache_key(source_file, OPTIONS, ())
    return directory / f"{Path(source_file).stem}-{OPTIONS.arch}-{key[:32]}.bin"


def disk_error(code: int) -> OSError:
    return OSError(code, os.strerror(code))


# -- a failed compile ---------------------------------------------------------------------------
def test_failed_compile_leaves_no_entry_no_temporary_file_and_is_not_cached(kernels,
                                                                           nvrtc_calls):
    (kernels.sources / "bad.cu").write_text(BAD)
    for attempt in (1, 2):
        with pytest.raises(CompileError, match=r"bad\.cu\(2\): error: identifier "
                                               r"\"undefined_name\""):
            compile_cached("bad.cu", OPTIONS)
        assert files(kernels.cache) == []
        assert len(nvrtc_calls) == attempt, "a failure is not cached: the next call recompiles"

    (kernels.sources / "bad.cu").write_text(GOOD)  # fixed: a new key, compiled and stored
    program = compile_cached("bad.cu", OPTIONS)
    assert program.cubin.startswith(b"\x7fELF")
    assert files(kernels.cache) == [entry_path(kernels.cache, "bad.cu").name]


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, MemoryError, RuntimeError])
def test_compile_interrupted_mid_way_leaves_nothing(kernels, monkeypatch, interruption):
    def interrupted(*args, **kwargs):
        raise interruption("stopped inside NVRTC")

    with monkeypatch.context() as patch:
        patch.setattr(cache, "compile_source", interrupted)
        with pytest.raises(interruption):
            compile_cached("good.cu", OPTIONS)
    assert files(kernels.cache) == []
    assert compile_cached("good.cu", OPTIONS).cubin.startswith(b"\x7fELF")  # not poisoned
    assert files(kernels.cache) == [entry_path(kernels.cache, "good.cu").name]


# -- a full or read-only cache directory, at each step of the write ------------------------------
def fail_at(step: str, code: int, patch: pytest.MonkeyPatch, temporaries: list[str]) -> None:
    """Make the cache's write fail with ``code`` at ``step``; ``temporaries`` records the
    temporary files it creates."""
    real_mkstemp, real_fdopen = tempfile.mkstemp, os.fdopen

    def mkstemp(*args, **kwargs):
        if step == "mkstemp":
            raise disk_error(code)
        fd, name = real_mkstemp(*args, **kwargs)
        temporaries.append(name)
        return fd, name

    class HalfWriter:
        """Writes half the entry, then the disk is full."""

        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, data):
            self.handle.write(data[: len(data) // 2])
            self.handle.flush()
            raise disk_error(code)

    def replace(source, destination):
        raise disk_error(code)

    patch.setattr(cache.tempfile, "mkstemp", mkstemp)
    if step == "mkdir":
        patch.setattr(cache.Path, "mkdir", lambda self, *a, **k: (_ for _ in ()).throw(
            disk_error(code)))
    if step == "write":
        patch.setattr(cache.os, "fdopen", lambda fd, mode: HalfWriter(real_fdopen(fd, mode)))
    if step == "replace":
        patch.setattr(cache.os, "replace", replace)


@pytest.mark.parametrize("step", ["mkdir", "mkstemp", "write", "replace"])
@pytest.mark.parametrize("error", FULL.values(), ids=FULL.keys())
def test_unusable_cache_directory_falls_back_to_memory_with_one_warning(kernels, nvrtc_calls,
                                                                         step, error):
    temporaries: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        fail_at(step, error, patch, temporaries)
        with pytest.warns(RuntimeWarning, match=rf"compile cache directory unusable \(\w+Error: "
                                                rf"{os.strerror(error)}\); caching compiled "
                                                r"kernels in memory only"):
            program = compile_cached("good.cu", OPTIONS)
        assert program.cubin.startswith(b"\x7fELF"), "the compile itself succeeds"
        assert files(kernels.cache) == [], "no entry and no (half-written) temporary file"
        assert not any(Path(name).exists() for name in temporaries)

        # From now on this process keeps kernels in memory: one warning, no more disk writes.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert compile_cached("good.cu", OPTIONS) is program
            other = compile_cached("other.cu", OPTIONS)
        assert [w for w in caught if issubclass(w.category, RuntimeWarning)] == []
        assert other.cubin.startswith(b"\x7fELF") and nvrtc_calls == ["good.cu", "other.cu"]
        assert len(temporaries) <= 1 and files(kernels.cache) == []

    clear_memory_cache()  # re-enables the disk: once it has room again, entries are written
    compile_cached("good.cu", OPTIONS)
    assert files(kernels.cache) == [entry_path(kernels.cache, "good.cu").name]


def test_interrupted_write_removes_its_temporary_file(kernels, nvrtc_calls, monkeypatch):
    temporaries: list[str] = []
    real_mkstemp = tempfile.mkstemp

    def mkstemp(*args, **kwargs):
        fd, name = real_mkstemp(*args, **kwargs)
        temporaries.append(name)
        return fd, name

    def interrupted(source, destination):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(cache.tempfile, "mkstemp", mkstemp)
        patch.setattr(cache.os, "replace", interrupted)
        with pytest.raises(KeyboardInterrupt):
            compile_cached("good.cu", OPTIONS)
    assert len(temporaries) == 1 and not Path(temporaries[0]).exists()
    assert files(kernels.cache) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an interruption is not a broken disk: no fallback
        compile_cached("good.cu", OPTIONS)
    assert files(kernels.cache) == [entry_path(kernels.cache, "good.cu").name]
    assert len(nvrtc_calls) == 2


# -- concurrency and leftovers ------------------------------------------------------------------
def test_threads_compiling_one_variant_share_one_program_and_one_entry(kernels):
    threads, barrier = 6, threading.Barrier(6)
    results: list[CompiledProgram] = []
    errors: list[BaseException] = []

    def compile_one() -> None:
        try:
            barrier.wait(timeout=60)
            results.append(compile_cached("good.cu", OPTIONS))
        except BaseException as exc:  # reported below, on the main thread
            errors.append(exc)

    workers = [threading.Thread(target=compile_one) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert errors == [] and len(results) == threads
    assert all(result is results[0] for result in results), "one program for the process"
    assert files(kernels.cache) == [entry_path(kernels.cache, "good.cu").name]
    clear_memory_cache()
    assert compile_cached("good.cu", OPTIONS).cubin == results[0].cubin, "the entry is valid"


def test_a_crashed_writers_temporary_file_is_never_read(kernels, nvrtc_calls):
    entry = entry_path(kernels.cache, "good.cu")
    kernels.cache.mkdir()
    # A complete, well-formed entry for a bogus program, left under a temporary name.
    bogus = CompiledProgram(cubin=b"\x7fELF bogus", log="", arch="sm_90")
    leftover = kernels.cache / f"{entry.name}k3x9q1.tmp"
    leftover.write_bytes(cache._encode(bogus))

    program = compile_cached("good.cu", OPTIONS)
    assert nvrtc_calls == ["good.cu"] and program.cubin != bogus.cubin
    assert entry.exists() and cache._decode(entry.read_bytes()).cubin == program.cubin
