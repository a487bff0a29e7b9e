"""``python -m lowlevel_fd {info,compile,demo,bench}``: inspect the set-up, build the kernels,
run the demo or the benchmark."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from . import __version__
from .compiler import CompiledProgram, CompileError, CompileOptions, cache_dir, nvrtc_version
from .decode import DecodeVariant, shipped_variants
from .decode.variants import PLANNER_WARPS, WARP_COUNTS
from .driver import Device, device_count, driver_version

BENCH_SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "bench.py"
# The demo's model shape (see lowlevel_fd/demo.py): head_dim 128, 4 query heads per KV head.
DEMO_VARIANT = DecodeVariant(head_dim=128, group_size=4, q_dtype="float16", scale_mode="token")


@dataclass(frozen=True)
class KernelFamily:
    """A kernel source and the variants it ships. ``variants(num_warps)`` yields objects with
    ``compile(arch) -> CompiledProgram``; ``kernels(variant)`` names their entry points."""

    name: str
    variants: Callable[[tuple[int, ...]], Iterable[Any]]
    kernels: Callable[[Any], Sequence[str]]


def _append_variants(num_warps: tuple[int, ...]) -> Iterable[Any]:
    from .append import shipped_variants as append_variants  # only `compile` needs it
    return append_variants(num_warps)


# Everything `compile` builds; a new kernel source adds its family here.
FAMILIES: list[KernelFamily] = [
    KernelFamily("decode", shipped_variants, lambda v: (v.split_kernel, v.combine_kernel)),
    KernelFamily("append", _append_variants, lambda v: v.kernel_names),
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


def _compile_one(variant: Any, arch: str) -> CompiledProgram | CompileError:
    try:
        return variant.compile(arch)
    except CompileError as exc:  # reported with the others once every variant has been tried
        return exc


def compile_families(families: Sequence[KernelFamily], arch: str,
                     num_warps: tuple[int, ...]) -> int:
    """Compile every variant (NVRTC drops the GIL, so threads overlap), print one row per
    kernel, and return 1 if any kernel failed, spilled or needed a stack frame."""
    jobs = [(family, variant) for family in families for variant in family.variants(num_warps)]
    print(f"compiling {len(jobs)} variants ({', '.join(f.name for f in families)}) for {arch}")
    start = time.perf_counter()
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda job: _compile_one(job[1], arch), jobs))
    rows, problems, first_error = [], [], None
    for (family, variant), result in zip(jobs, results):
        if isinstance(result, CompileError):
            problems.append(f"{family.name} {variant}: does not compile")
            first_error = first_error or result
            continue
        for name in family.kernels(variant):
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
    warps = WARP_COUNTS if args.all_warps else PLANNER_WARPS
    return compile_families(FAMILIES, args.arch or _default_arch(), warps)


# -- demo and bench ---------------------------------------------------------------------------
def demo(_: argparse.Namespace) -> int:
    if device_count() == 0:
        program = DEMO_VARIANT.compile("sm_90")
        print(f"compiled the demo's kernel {DEMO_VARIANT.split_kernel} for sm_90 "
              f"({len(program.cubin)} bytes of CUBIN)")
        print("the demo needs a CUDA GPU to run, and none is visible")
        return 0
    try:
        module = importlib.import_module("lowlevel_fd.demo")
    except ModuleNotFoundError as exc:
        if exc.name != "lowlevel_fd.demo":
            raise
        print("demo: lowlevel_fd/demo.py is not part of this install", file=sys.stderr)
        return 2
    status = module.main()
    return status if isinstance(status, int) else 0


def bench(argv: list[str]) -> int:
    """Run ``tools/bench.py``'s ``main(argv)``; it lives in the source checkout, not the wheel."""
    if not BENCH_SCRIPT.is_file():
        print(f"bench: {BENCH_SCRIPT} not found (the benchmark lives in the source checkout, "
              "not in the installed package)", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("lowlevel_fd_bench", BENCH_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    status = module.main(argv)
    return status if isinstance(status, int) else 0


# -- entry point ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lowlevel_fd", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    commands.add_parser("info", help="versions, the GPU and the compile cache directory"
                        ).set_defaults(run=info)
    build = commands.add_parser("compile", help="compile every shipped kernel variant and "
                                "report registers, spills and shared memory")
    build.add_argument("--arch", type=_arch, default=None,
                       help="target, e.g. sm_80 or sm_90 (default: the GPU's, else sm_90)")
    build.add_argument("--all-warps", action="store_true",
                       help="also compile the 2- and 8-warp variants the tuner explores")
    build.set_defaults(run=compile_command)
    commands.add_parser("demo", help="decode attention over an INT8 cache, checked against "
                        "the reference (needs a GPU)").set_defaults(run=demo)
    commands.add_parser("bench", add_help=False,
                        help="benchmark (tools/bench.py; arguments pass through)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # argparse would claim options meant for the benchmark
        return bench(argv[1:])
    args = build_parser().parse_args(argv)
    return args.run(args)
