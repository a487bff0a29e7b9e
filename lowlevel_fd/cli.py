"""python -m lowlevel_fd {info,compile,demo}: inspect the set-up, build every shipped kernel,
run the demo. The benchmarks live in the source checkout's tools/ (tools/bench.py)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from . import __version__, demo as demo_job
from .append import shipped_variants as append_variants
from .compiler import (KERNEL_DIR, CompiledProgram, CompileError, CompileOptions, cache_dir,
                       compile_source, nvrtc_compiles, nvrtc_version)
from .core.support import WARP_COUNTS
from .decode import shipped_variants as decode_variants
from .decode.planner import DEFAULT_WARPS
from .multi import shipped_variants as multi_variants
from .driver import Device, device_count, driver_version


@dataclass(frozen=True)
class KernelFamily:
    """A kernel family and the programs it ships. ``variants(num_warps)`` yields objects with
    ``compile(arch) -> CompiledProgram`` and ``kernel_names`` (their entry points)."""

    name: str
    variants: Callable[[tuple[int, ...]], Iterable[Any]]


# Everything `compile` builds; a new kernel family adds itself here.
FAMILIES: list[KernelFamily] = [
    KernelFamily("decode", decode_variants),
    KernelFamily("append", append_variants),
    KernelFamily("multi", multi_variants),
]


def _arch(value: str) -> str:
    try:
        CompileOptions(arch=value).flags()
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _default_arch() -> str:
    """The first GPU's arch, or sm_90 (the tuning target) when there is none."""
    return Device(0).arch if device_count() > 0 else "sm_90"


def _cuda_version(version: int | None) -> str:
    return "none" if version is None else f"{version // 1000}.{version % 1000 // 10}"


def _bindings_version() -> str:
    try:
        from importlib.metadata import version
        return version("cuda-bindings")
    except Exception:  # an unusual install without metadata
        import cuda.bindings
        return str(getattr(cuda.bindings, "__version__", "unknown"))


# -- info -------------------------------------------------------------------------------------
def info(_: argparse.Namespace) -> int:
    rows = [("lowlevel_fd", __version__), ("cuda-bindings", _bindings_version()),
            ("NVRTC", "%d.%d" % nvrtc_version()), ("CUDA driver", _cuda_version(driver_version()))]
    count = device_count()
    if count == 0:
        why = "no NVIDIA driver found" if driver_version() is None else "the driver sees none"
        rows.append(("GPU", f"no CUDA GPU visible ({why})"))
    else:
        gpu = Device(0).info
        rows += [("GPUs", str(count)), ("device 0", gpu.name), ("arch", gpu.arch),
                 ("SMs", str(gpu.sm_count)), ("L2", f"{gpu.l2_bytes / 2**20:.1f} MiB"),
                 ("shared memory (opt-in)", f"{gpu.max_shared_per_block_optin // 1024} KiB"),
                 ("memory", f"{gpu.total_memory / 2**30:.1f} GiB")]
    rows.append(("cache dir", str(cache_dir())))
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


# -- compile ----------------------------------------------------------------------------------
_HEADER = ("kernel", "regs", "spill-st", "spill-ld", "stack", "smem")
# Programs of one source per NVRTC run by default: each run costs ~0.08 s beyond its kernels
# (a quarter of a decode program's compile), and ptxas reports every kernel the same way.
BATCH = 24


def _compile_one(variant: Any, arch: str) -> CompiledProgram | CompileError:
    try:
        return variant.compile(arch)
    except CompileError as exc:  # reported with the others once every variant has been tried
        return exc


def _compile_batch(variants: Sequence[Any], arch: str) -> CompiledProgram | CompileError:
    """One NVRTC run for the kernels of several programs of one source (no compile cache)."""
    source = variants[0].source
    names = [name for variant in variants for name in variant.kernel_names]
    target = getattr(variants[0], "target_arch", lambda a: a)(arch)  # e.g. sm_90a for wgmma
    try:
        return compile_source((KERNEL_DIR / source).read_text(), source,
                              CompileOptions(arch=target), names)
    except CompileError as exc:
        return exc


def _batches(jobs: list, size: int) -> list[list[int]]:
    """Job indices in runs of at most ``size`` programs of one source (size 0: one each)."""
    if not size:
        return [[index] for index in range(len(jobs))]
    by_source: dict[str, list[int]] = {}
    for index, (_, variant) in enumerate(jobs):
        by_source.setdefault(variant.source, []).append(index)
    return [indices[i:i + size] for indices in by_source.values()
            for i in range(0, len(indices), size)]


def _progress(done: int, total: int, start: float) -> None:
    """One line per tenth of the programs on stderr (a rewritten line on a terminal)."""
    if sys.stderr.isatty():
        print(f"\r  {done}/{total} programs, {time.perf_counter() - start:.0f} s", end="",
              file=sys.stderr, flush=True)
        if done == total:
            print(file=sys.stderr)
    elif done == total or done % max(1, total // 10) == 0:
        print(f"  {done}/{total} programs, {time.perf_counter() - start:.0f} s",
              file=sys.stderr, flush=True)


def compile_families(families: Sequence[KernelFamily], arch: str,
                     num_warps: tuple[int, ...], *, batch: int = 0) -> int:
    """Compile every program (NVRTC drops the GIL, so threads overlap) with progress on stderr,
    print one row per kernel, and return 1 if any kernel failed, spilled or needed a stack
    frame. ``batch`` 0: each program on its own, into the compile cache; else up to ``batch``
    programs of one source per NVRTC run (their ``source``), outside the cache."""
    jobs = [(family, variant) for family in families for variant in family.variants(num_warps)
            if getattr(variant, "builds_for", lambda _: True)(arch)]
    print(f"compiling {len(jobs)} programs ({', '.join(f.name for f in families)}) for {arch}",
          flush=True)
    start = time.perf_counter()
    results: list[Any] = [None] * len(jobs)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        futures = {}
        for indices in _batches(jobs, batch):
            variants = [jobs[index][1] for index in indices]
            future = (pool.submit(_compile_batch, variants, arch) if batch
                      else pool.submit(_compile_one, variants[0], arch))
            futures[future] = indices
        done = 0
        for future in as_completed(futures):
            for index in futures[future]:
                results[index] = future.result()
                done += 1
                _progress(done, len(jobs), start)
    rows, problems, first_error = [], [], None
    for (family, variant), result in zip(jobs, results):
        if isinstance(result, CompileError):
            problems.append(f"{family.name} {variant}: does not compile")
            first_error = first_error or result
            continue
        for name in variant.kernel_names:
            r = result.resources.get(result.symbol(name))
            if r is None:
                problems.append(f"{name}: no ptxas report for this kernel")
                continue
            rows.append((name, r.registers, r.spill_store_bytes, r.spill_load_bytes,
                         r.stack_bytes, r.shared_bytes))
            if r.spill_store_bytes or r.spill_load_bytes or r.stack_bytes:
                problems.append(f"{name}: {r.spill_store_bytes} B spill stores, "
                                f"{r.spill_load_bytes} B spill loads, {r.stack_bytes} B stack")
    width = max([len(_HEADER[0])] + [len(row[0]) for row in rows])
    print(f"{_HEADER[0]:<{width}}" + "".join(f"{h:>10}" for h in _HEADER[1:]))
    for name, *numbers in rows:
        print(f"{name:<{width}}" + "".join(f"{n:>10}" for n in numbers))
    elapsed = time.perf_counter() - start
    if problems:
        print(f"FAILED: {len(problems)} of {len(rows)} kernels for {arch} spill, use a stack "
              f"frame or did not compile:", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        if first_error is not None:  # the others usually fail the same way
            print(f"the first compile error:\n{first_error}", file=sys.stderr)
        return 1
    print(f"{len(rows)} kernels for {arch}: no spills, no stack frames ({elapsed:.1f} s)")
    return 0


def compile_command(args: argparse.Namespace) -> int:
    warps = WARP_COUNTS if args.all_warps else (DEFAULT_WARPS,)
    return compile_families(FAMILIES, args.arch or _default_arch(), warps,
                            batch=0 if args.cache else BATCH)


# -- demo -------------------------------------------------------------------------------------
def demo(_: argparse.Namespace) -> int:
    if device_count() > 0:
        status = demo_job.main()
        return status if isinstance(status, int) else 0
    # No GPU: build what the demo would launch on an H100 (the planner's pick for its shape).
    variant = demo_job.planned_variant()
    before = nvrtc_compiles()
    program = variant.compile("sm_90")
    how = "compiled" if nvrtc_compiles() > before else "found in the compile cache"
    print(f"{how}: the demo's kernel {variant.split_kernel} for sm_90 ({len(program.cubin)} "
          f"bytes of CUBIN)")
    print("the demo needs a CUDA GPU to run, and none is visible")
    return 0


# -- entry point ------------------------------------------------------------------------------
def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    commands.add_parser("info", help="versions, the GPU and the compile cache directory"
                        ).set_defaults(run=info)
    build = commands.add_parser("compile", help="compile every shipped kernel and report "
                                "registers, spills and shared memory")
    build.add_argument("--arch", type=_arch, default=None,
                       help="target, e.g. sm_80 or sm_90 (default: the GPU's, else sm_90)")
    others = " and ".join(str(w) for w in WARP_COUNTS if w != DEFAULT_WARPS)
    build.add_argument("--all-warps", action="store_true",
                       help=f"also compile the decode variants of {others} warps that a "
                            f"TileConfig may ask for (the planner picks {DEFAULT_WARPS})")
    build.add_argument("--cache", action="store_true",
                       help="compile each program on its own into the compile cache (a "
                            "deployment's warm-up; slower); by default programs of one "
                            "source share an NVRTC run and nothing is cached")
    build.set_defaults(run=compile_command)
    commands.add_parser("demo", help="decode attention over an INT8 cache, checked against "
                        "the reference and timed (needs a GPU)").set_defaults(run=demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `python -m lowlevel_fd` runs __main__.py; the console script is `lowlevel-fd`.
    invoked = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    prog = "python -m lowlevel_fd" if invoked in ("", "__main__.py", "-c") else invoked
    args = build_parser(prog).parse_args(argv)
    return args.run(args)
