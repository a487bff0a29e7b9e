"""Specification of the compiler: NVRTC to CUBIN per arch, the resource report, CompileError,
the disk cache (hit, miss, corruption, read-only fallback, atomic writes, two processes), its key
(the sources a program includes, never their paths) and what the Python side shares with the
kernels (the support matrix's ids, the DecodeParams layout)."""
from __future__ import annotations

import ctypes
import hashlib
import multiprocessing
import os
import queue
import re
import shutil
import stat
import time
from pathlib import Path

import pytest

import lowlevel_fd
from lowlevel_fd.compiler import (KERNEL_DIR, CompileError, CompileOptions, cache, cache_key,
                                  clear_memory_cache, compile_source, nvrtc, nvrtc_compiles)
from lowlevel_fd.core import support
from lowlevel_fd.decode import CombineVariant, DecodeVariant
from lowlevel_fd.decode.params import DecodeParams
from lowlevel_fd.decode.variants import LENGTHS

ARCHS = ("sm_80", "sm_90")
TINY = 'extern "C" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }\n'
BAD = ('extern "C" __global__ void broken(float* x) {\n'
       '  x[0] = undefined_name;\n'
       '}\n')
# Corners of the support matrix: the smallest tile, the largest, the demo's, bf16 + fp16 scales.
DECODE_SAMPLE = (
    DecodeVariant(64, 1, "float16", "tensor"),
    DecodeVariant(128, 4, "float16", "token", "float32"),
    DecodeVariant(256, 16, "bfloat16", "token", "float16"),
    DecodeVariant(128, 8, "bfloat16", "head"),
    DecodeVariant(128, 4, "float16", "token", num_warps=8, cluster=True, tiles=2, append=True),
    # Masked kernels, for a group other than the CTA's heads: 3 of 4 heads, 24 as 2 x 12 of 16.
    DecodeVariant(128, 4, "bfloat16", "token", "float16", cluster=True, masked=True),
    DecodeVariant(128, 16, "float16", "token", append=True, masked=True),
    # Paged: fp16 token scales as words, the two-tile cluster kernel, head_dim 64 and 256.
    DecodeVariant(128, 4, "float16", "token", "float16", append=True, paged=True),
    DecodeVariant(128, 8, "bfloat16", "token", cluster=True, tiles=2, paged=True),
    DecodeVariant(64, 2, "float16", "head", paged=True),
    DecodeVariant(256, 16, "float16", "token", "float16", append=True, masked=True, paged=True),
)
# Their merges (one program per head_dim, heads per CTA, dtype and masked) and the length bump,
# each a program of its own.
COMBINE_SAMPLE = tuple(dict.fromkeys(CombineVariant(v.head_dim, v.cta_heads, v.dtype, v.masked)
                                     for v in DECODE_SAMPLE))
PROGRAM_SAMPLE = DECODE_SAMPLE + COMBINE_SAMPLE + (LENGTHS,)
CORRUPTIONS = {
    "truncated": lambda blob: blob[: len(blob) // 2],
    "bit flipped": lambda blob: blob[:-100] + bytes([blob[-100] ^ 0x01]) + blob[-99:],
    "empty": lambda blob: b"",
    "foreign format": lambda blob: b"not a cache entry" + blob[17:],
}


@pytest.fixture
def cache_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A private, empty cache directory and an empty in-process cache."""
    directory = tmp_path / "kernel-cache"
    monkeypatch.setenv("LOWLEVEL_FD_CACHE_DIR", str(directory))
    clear_memory_cache()
    yield directory
    clear_memory_cache()  # also re-enables the disk for the next test



def entries(directory: Path) -> list[Path]:
    return sorted(directory.iterdir()) if directory.exists() else []


# -- compiling ---------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_inline_kernel_compiles_to_cubin_for_the_arch(arch):
    program = compile_source(TINY, "tiny.cu", CompileOptions(arch=arch))
    assert program.cubin.startswith(b"\x7fELF")
    assert program.arch == arch
    assert f"for '{arch}'" in program.log
    report = program.resources["twice"]
    assert report.registers > 0
    assert (report.spill_store_bytes, report.spill_load_bytes, report.stack_bytes) == (0, 0, 0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", PROGRAM_SAMPLE, ids=lambda v: v.kernel_names[0])
def test_decode_programs_compile_without_spills(cache_path, arch, variant):
    program = variant.compile(arch)
    assert program.cubin.startswith(b"\x7fELF") and program.arch == arch
    symbols = {program.symbol(kernel) for kernel in variant.kernel_names}
    # Each program holds its own kernels and no other: a split variant only the split kernel,
    # so no kernel is compiled again with every variant.
    assert set(program.resources) == symbols
    for kernel in variant.kernel_names:
        symbol = program.symbol(kernel)
        assert symbol.startswith("_Z"), "kernels in llfd:: get their mangled names"
        report = program.resources[symbol]
        assert report.registers > 0
        assert report.spill_store_bytes == report.spill_load_bytes == 0, kernel
        assert report.stack_bytes == 0, kernel
    if isinstance(variant, DecodeVariant):
        assert variant.kernel_names == (variant.split_kernel,)
        # The split kernel's dynamic shared memory (its pipelines) starts after the static
        # part; their bank swizzles hold only if that start is 128-byte aligned.
        split = program.resources[program.symbol(variant.split_kernel)]
        assert split.shared_bytes % 128 == 0, split.shared_bytes


def test_compile_error_carries_the_log_with_file_and_line():
    with pytest.raises(CompileError, match=r"bad\.cu\(2\): error: identifier \"undefined_name\""
                       ) as caught:
        compile_source(BAD, "bad.cu", CompileOptions(arch="sm_90"))
    assert caught.value.arch == "sm_90" and caught.value.source == "bad.cu"
    assert "undefined_name" in caught.value.log
    assert str(caught.value).startswith("NVRTC failed to compile bad.cu for sm_90:")


# -- options and keys --------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["sm90", "compute_90", "90", "sm_90x", "SM_90", ""])
def test_options_reject_an_arch_that_is_not_a_real_gpu(arch):
    with pytest.raises(ValueError, match="arch: expected a real architecture"):
        CompileOptions(arch=arch).flags()


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_90a", "sm_100f"])
def test_options_render_the_arch_into_the_flags(arch):
    assert f"-arch={arch}" in CompileOptions(arch=arch).flags()


def test_cache_key_covers_arch_defines_and_name_expressions():
    names = ("llfd::decode_combine<64, 1, llfd::f16>",)
    base = cache_key("decode_combine.cu", CompileOptions(arch="sm_90"), names)
    assert base == cache_key("decode_combine.cu", CompileOptions(arch="sm_90"), names)
    others = {
        cache_key("decode_combine.cu", CompileOptions(arch="sm_80"), names),
        cache_key("decode_combine.cu", CompileOptions(arch="sm_90", defines=(("LLFD_X", "1"),)),
                  names),
        cache_key("decode_combine.cu", CompileOptions(arch="sm_90", extra=("-G",)), names),
        cache_key("decode_combine.cu", CompileOptions(arch="sm_90"), ()),
        cache_key("decode.cu", CompileOptions(arch="sm_90"), names),  # another source
    }
    assert base not in others and len(others) == 5


# -- the key: the sources a program includes, never where they are -------------------------------
SPLIT_NAMES = (DECODE_SAMPLE[1].split_kernel,)


@pytest.fixture
def kernel_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``copy(name)``: a copy of the shipped kernel directory at tmp_path/name; ``use(path)``
    points the compiler at it (and forgets the digests of the last one)."""
    def copy(name: str) -> Path:
        return Path(shutil.copytree(KERNEL_DIR, tmp_path / name / "cu"))

    def use(directory: Path) -> None:
        monkeypatch.setattr(cache, "KERNEL_DIR", directory)
        monkeypatch.setattr(nvrtc, "KERNEL_DIR", directory)  # the -I flag too
        clear_memory_cache()

    yield copy, use
    clear_memory_cache()


def key_in(use, directory: Path, source: str = "decode.cu", names=SPLIT_NAMES) -> str:
    use(directory)
    return cache_key(source, CompileOptions(arch="sm_90"), names)


def test_cache_key_does_not_depend_on_where_the_kernels_are(kernel_copies):
    copy, use = kernel_copies
    first, second = copy("checkout"), copy("site-packages/lowlevel_fd")
    for source, names in (("decode.cu", SPLIT_NAMES),
                          ("decode_combine.cu", COMBINE_SAMPLE[0].kernel_names),
                          ("lengths.cu", LENGTHS.kernel_names)):
        keys = set()
        for directory in (first, second, KERNEL_DIR):
            keys.add(key_in(use, directory, source, names))
            assert f"-I{directory}" in CompileOptions().flags(), "the include path differs..."
        assert len(keys) == 1, f"...yet a checkout and an installed copy share {source}'s entry"


@pytest.mark.parametrize("source, header", [
    ("decode.cu", "decode.cu"),           # the source itself
    ("decode.cu", "decode_merge.cuh"),    # included by the source
    ("decode.cu", "decode_pipeline.cuh"),  # via decode_fragments.cuh
    ("decode.cu", "kv_types.cuh"),        # via decode_append.cuh -> decode_params.cuh
    ("decode.cu", "common.cuh"),          # three levels down
    ("lengths.cu", "kv_types.cuh"),
    ("append.cu", "rows.cuh"),
])
def test_cache_key_changes_with_every_header_the_source_includes(kernel_copies, source,
                                                                 header):
    copy, use = kernel_copies
    directory = copy("kernels")
    before = key_in(use, directory, source, ())
    with open(directory / header, "a") as handle:
        handle.write("\n// an edit\n")
    assert key_in(use, directory, source, ()) != before


@pytest.mark.parametrize("source, header", [
    ("decode.cu", "append_params.cuh"),   # the append family's
    ("decode.cu", "decode_combine.cu"),   # another program's source
    ("lengths.cu", "decode_merge.cuh"),   # decode's, not the length bump's
    ("decode_combine.cu", "rows.cuh"),
    ("append.cu", "decode_params.cuh"),
])
def test_cache_key_ignores_headers_the_source_does_not_include(kernel_copies, source, header):
    copy, use = kernel_copies
    directory = copy("kernels")
    before = key_in(use, directory, source, ())
    with open(directory / header, "a") as handle:
        handle.write("\n// an edit elsewhere\n")
    (directory / "unrelated.cuh").write_text("#pragma once\n")
    assert key_in(use, directory, source, ()) == before


# -- the cache ---------------------------------------------------------------------------------
# The cache is exercised on a tiny kernel of its own, so that it is tested apart from decode.cu.
TINY_SOURCE = ('#include "tiny.cuh"\n'
               "template <int N> __global__ void scale(float* x) { x[threadIdx.x] *= kBase * N; }\n")
TINY_HEADER = "constexpr float kBase = 2.0f;\n"


@pytest.fixture
def kernel_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "cu"
    directory.mkdir()
    (directory / "tiny.cu").write_text(TINY_SOURCE)
    (directory / "tiny.cuh").write_text(TINY_HEADER)
    monkeypatch.setattr(cache, "KERNEL_DIR", directory)
    return directory


def compile_tiny(kernel_dir: Path, arch: str = "sm_90", n: int = 2):
    options = CompileOptions(arch=arch, extra=(f"-I{kernel_dir}",))
    return cache.compile_cached("tiny.cu", options, (f"scale<{n}>",))


def test_miss_compiles_and_writes_one_entry_then_memory_and_disk_hit(cache_path, kernel_dir,
                                                                      nvrtc_calls):
    first = compile_tiny(kernel_dir)
    assert nvrtc_calls == ["tiny.cu"]
    [entry] = entries(cache_path)
    assert entry.name.startswith("tiny-sm_90-") and entry.suffix == ".bin"

    assert compile_tiny(kernel_dir) is first  # in-process hit
    clear_memory_cache()
    from_disk = compile_tiny(kernel_dir)  # disk hit
    assert nvrtc_calls == ["tiny.cu"]
    assert from_disk.cubin == first.cubin and from_disk.resources == first.resources
    assert from_disk.lowered_names == first.lowered_names and from_disk.log == first.log
    assert from_disk.symbol("scale<2>").startswith("_Z")


def test_an_in_process_hit_reads_no_file(cache_path, kernel_dir, nvrtc_calls, monkeypatch):
    first = compile_tiny(kernel_dir)
    reads: list[str] = []

    def no_reading(self, *args, **kwargs):
        reads.append(str(self))
        raise AssertionError(f"an in-process hit read {self}")

    with monkeypatch.context() as patch:
        for method in ("read_bytes", "read_text", "open"):
            patch.setattr(Path, method, no_reading)
        again = compile_tiny(kernel_dir)
    assert again is first and reads == [] and nvrtc_calls == ["tiny.cu"]


def test_sources_are_read_once_per_process_until_the_memory_cache_is_cleared(kernel_dir):
    clear_memory_cache()
    options, names = CompileOptions(arch="sm_90"), ("scale<2>",)
    key = cache_key("tiny.cu", options, names)
    (kernel_dir / "tiny.cuh").write_text("constexpr float kBase = 3.0f;\n")
    assert cache_key("tiny.cu", options, names) == key, "the digest is memoised per process"
    clear_memory_cache()  # forgets the digests too: the edit is seen
    assert cache_key("tiny.cu", options, names) != key


def test_nvrtc_compiles_counts_misses_only(cache_path, kernel_dir, nvrtc_calls):
    before = nvrtc_compiles()
    compile_tiny(kernel_dir)                    # miss
    assert nvrtc_compiles() == before + 1
    compile_tiny(kernel_dir)                    # in-process hit
    clear_memory_cache()
    compile_tiny(kernel_dir)                    # disk hit
    assert nvrtc_compiles() == before + 1
    compile_tiny(kernel_dir, arch="sm_80")      # misses: another arch, another instantiation
    compile_tiny(kernel_dir, n=3)
    assert nvrtc_compiles() == before + 3 == before + len(nvrtc_calls)


def test_another_arch_or_instantiation_is_another_entry(cache_path, kernel_dir, nvrtc_calls):
    compile_tiny(kernel_dir, "sm_90")
    compile_tiny(kernel_dir, "sm_80")
    compile_tiny(kernel_dir, "sm_90", n=3)
    assert len(nvrtc_calls) == 3
    assert sorted(e.name.split("-")[1] for e in entries(cache_path)) == ["sm_80", "sm_90",
                                                                          "sm_90"]


def test_editing_a_header_invalidates_the_entry(cache_path, kernel_dir, nvrtc_calls):
    compile_tiny(kernel_dir)
    (kernel_dir / "tiny.cuh").write_text("constexpr float kBase = 3.0f;\n")
    clear_memory_cache()
    compile_tiny(kernel_dir)
    assert len(nvrtc_calls) == 2 and len(entries(cache_path)) == 2


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_corrupt_entry_is_a_miss_and_is_rewritten(cache_path, kernel_dir, nvrtc_calls, corrupt):
    good = compile_tiny(kernel_dir)
    [entry] = entries(cache_path)
    entry.write_bytes(corrupt(entry.read_bytes()))
    clear_memory_cache()

    again = compile_tiny(kernel_dir)
    assert len(nvrtc_calls) == 2, "a corrupt entry must be recompiled, never loaded"
    # Not byte-equal: NVRTC embeds a temporary file name in the line info.
    assert again.cubin.startswith(b"\x7fELF") and again.resources == good.resources
    clear_memory_cache()
    compile_tiny(kernel_dir)
    assert len(nvrtc_calls) == 2, "the recompiled entry replaced the corrupt one"
    assert entries(cache_path) == [entry]


def test_unwritable_cache_directory_falls_back_to_memory_with_a_warning(cache_path, kernel_dir,
                                                                          nvrtc_calls):
    cache_path.mkdir()
    cache_path.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(cache_path, os.W_OK):
            pytest.skip("running as root: chmod does not make the directory read-only")
        with pytest.warns(RuntimeWarning, match="unusable.*in memory only"):
            program = compile_tiny(kernel_dir)
        assert program.cubin.startswith(b"\x7fELF")
        assert compile_tiny(kernel_dir) is program and len(nvrtc_calls) == 1
        assert entries(cache_path) == []
    finally:
        cache_path.chmod(stat.S_IRWXU)


def test_cache_path_under_a_file_falls_back_to_memory_with_a_warning(tmp_path, monkeypatch,
                                                                       cache_path, kernel_dir,
                                                                       nvrtc_calls):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("LOWLEVEL_FD_CACHE_DIR", str(blocker / "kernel-cache"))
    with pytest.warns(RuntimeWarning, match="compile cache directory unusable"):
        program = compile_tiny(kernel_dir)
    assert compile_tiny(kernel_dir) is program and len(nvrtc_calls) == 1


def test_failed_write_leaves_no_temporary_file(cache_path, kernel_dir, nvrtc_calls, monkeypatch):
    def disk_full(source, destination):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(cache.os, "replace", disk_full)
        with pytest.warns(RuntimeWarning, match="No space left on device"):
            compile_tiny(kernel_dir)
    assert entries(cache_path) == []


def test_successful_writes_leave_only_entries(cache_path, kernel_dir):
    for n in (1, 2, 3):
        compile_tiny(kernel_dir, n=n)
    names = [e.name for e in entries(cache_path)]
    assert len(names) == 3 and all(n.endswith(".bin") and ".tmp" not in n for n in names)


def _compile_in_child(cache_directory: str, kernel_directory: str, barrier, results) -> None:
    os.environ["LOWLEVEL_FD_CACHE_DIR"] = cache_directory
    cache.KERNEL_DIR = Path(kernel_directory)
    barrier.wait(timeout=120)  # both children reach NVRTC and the rename at about the same time
    program = compile_tiny(Path(kernel_directory))
    results.put(hashlib.sha256(program.cubin).hexdigest())


def test_two_processes_compiling_the_same_kernel_both_succeed(cache_path, kernel_dir,
                                                              nvrtc_calls):
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    children = [context.Process(target=_compile_in_child,
                                args=(str(cache_path), str(kernel_dir), barrier, results))
                for _ in range(2)]
    for child in children:
        child.start()
    digests: list[str] = []
    deadline = time.monotonic() + 300
    while len(digests) < 2 and time.monotonic() < deadline:
        try:
            digests.append(results.get(timeout=1))
        except queue.Empty:  # a child that died never answers: fail now, not at the deadline
            assert all(c.exitcode in (None, 0) for c in children), "a child process failed"
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    assert len(digests) == 2
    [entry] = entries(cache_path)  # exactly one entry, and no temporary files
    program = compile_tiny(kernel_dir)
    assert nvrtc_calls == [], "the entry the children wrote is valid"
    # The two CUBINs may differ in a few bytes (a temporary name in the line info): the
    # entry is whichever rename came last.
    assert hashlib.sha256(program.cubin).hexdigest() in digests


# -- what Python and the kernels must agree on ----------------------------------------------------
KV_TYPES = (KERNEL_DIR / "kv_types.cuh").read_text()


def cuda_enum(name: str) -> dict[str, int]:
    """The enumerators of ``enum name : int { ... }`` in kv_types.cuh."""
    body = re.search(rf"enum\s+{name}\s*:\s*int\s*\{{([^}}]*)\}}", KV_TYPES)
    assert body, f"enum {name} not found in kv_types.cuh"
    return {m.group(1): int(m.group(2))
            for m in re.finditer(r"(\w+)\s*=\s*(\d+)", body.group(1))}


def cuda_constant(name: str) -> int:
    match = re.search(rf"constexpr\s+uint32_t\s+{name}\s*=\s*(\d+)u?\s*;", KV_TYPES)
    assert match, f"{name} not found in kv_types.cuh"
    return int(match.group(1))


def test_support_ids_are_the_enums_of_kv_types():
    assert cuda_enum("ScaleMode") == {
        "kScalePer" + mode.capitalize(): i for mode, i in support.SCALE_MODE_IDS.items()}
    assert set(support.SCALE_MODE_IDS) == set(support.SCALE_MODES)
    assert cuda_enum("RopeStyle") == {
        "kRope" + (style or "none").capitalize(): i for style, i in support.ROPE_IDS.items()}
    assert set(support.ROPE_IDS) == set(support.ROPE_STYLES)
    assert cuda_constant("kErrorOutsideCache") == support.ERROR_OUTSIDE_CACHE == 1
    assert cuda_constant("kErrorPromptLength") == support.ERROR_PROMPT_LENGTH == 2
    assert cuda_constant("kErrorBadPage") == support.ERROR_BAD_PAGE == 4
    assert (lowlevel_fd.ERROR_OUTSIDE_CACHE, lowlevel_fd.ERROR_PROMPT_LENGTH,
            lowlevel_fd.ERROR_BAD_PAGE) == (
        support.ERROR_OUTSIDE_CACHE, support.ERROR_PROMPT_LENGTH, support.ERROR_BAD_PAGE)


# (field, ctypes type, byte offset): cu/decode_params.cuh, written out field by field.
DECODE_PARAMS_LAYOUT = (
    [(name, ctypes.c_uint64, 8 * i) for i, name in enumerate(
        ("q", "k_cache", "v_cache", "k_scale", "v_scale", "seq_lens", "out", "lse",
         "partial_out", "partial_lse", "counters", "error_flags"))]
    + [(name, ctypes.c_int64, 96 + 8 * i) for i, name in enumerate(
        ("q_batch_stride", "q_head_stride", "out_batch_stride", "out_head_stride",
         "kv_batch_stride", "kv_head_stride", "kv_token_stride", "scale_batch_stride",
         "scale_head_stride"))]
    + [("score_scale_log2", ctypes.c_float, 168), ("num_kv_heads", ctypes.c_int32, 172),
       ("num_splits", ctypes.c_int32, 176), ("min_split_tokens", ctypes.c_int32, 180),
       ("capacity", ctypes.c_int32, 184), ("fused_merge", ctypes.c_int32, 188),
       ("append", ctypes.c_int32, 192), ("rope", ctypes.c_int32, 196),
       ("rope_theta", ctypes.c_float, 200), ("cluster_slots_offset", ctypes.c_int32, 204),
       ("early_reads", ctypes.c_int32, 208), ("key_transform", ctypes.c_int32, 212),
       ("k_new", ctypes.c_uint64, 216), ("v_new", ctypes.c_uint64, 224),
       ("cos_sin", ctypes.c_uint64, 232),
       ("k_new_batch_stride", ctypes.c_int64, 240), ("k_new_head_stride", ctypes.c_int64, 248),
       ("v_new_batch_stride", ctypes.c_int64, 256), ("v_new_head_stride", ctypes.c_int64, 264),
       # the query heads: the group, served by head_chunks CTAs of chunk_heads heads each
       ("group_size", ctypes.c_int32, 272), ("head_chunks", ctypes.c_int32, 276),
       ("chunk_heads", ctypes.c_int32, 280),
       ("table_window", ctypes.c_int32, 284),  # the fused append's IdWindow (paged)
       # paged storage (cu/cache_pages.cuh)
       ("block_table", ctypes.c_uint64, 288), ("table_stride", ctypes.c_int64, 296),
       ("scale_token_stride", ctypes.c_int64, 304), ("num_pages", ctypes.c_int32, 312),
       ("page_shift", ctypes.c_int32, 316)])


def test_decode_params_layout_field_by_field():
    assert [(name, ctype) for name, ctype in DecodeParams._fields_] == [
        (name, ctype) for name, ctype, _ in DECODE_PARAMS_LAYOUT]
    assert {name: getattr(DecodeParams, name).offset for name, _ in DecodeParams._fields_} == {
        name: offset for name, _, offset in DECODE_PARAMS_LAYOUT}
    assert ctypes.sizeof(DecodeParams) == 320


def test_decode_params_match_the_cuda_struct_field_by_field():
    # The compiler's word: every offset and the size, as static_asserts on the real header.
    asserts = "".join(
        f"static_assert(__builtin_offsetof(llfd::DecodeParams, {name}) == "
        f"{getattr(DecodeParams, name).offset}, \"{name}\");\n"
        for name, _ in DecodeParams._fields_)
    asserts += (f"static_assert(sizeof(llfd::DecodeParams) == {ctypes.sizeof(DecodeParams)}, "
                f"\"size\");\n")
    compile_source(f'#include "decode_params.cuh"\n{asserts}', "offsets.cu",
                   CompileOptions(arch="sm_90"))
