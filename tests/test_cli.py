"""Specification of ``python -m lowlevel_fd``: info and demo without a GPU, compile of every
shipped kernel (each once) with no spills, the plumbing of compile, and no bench subcommand.

The CLI runs in a subprocess from a temporary directory, with the lowlevel_fd that this test
process imported first on its path: never the checkout by accident.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lowlevel_fd
from lowlevel_fd import append, cli, decode, demo, multi
from lowlevel_fd.compiler import (CompiledProgram, CompileError, KernelResources,
                                  nvrtc_version)
from lowlevel_fd.core.support import WARP_COUNTS
from lowlevel_fd.decode import DecodeVariant, Workload, choose
from lowlevel_fd.decode.planner import DEFAULT_WARPS

from conftest import HAS_GPU

REPO = Path(__file__).resolve().parents[1]
PACKAGE_ROOT = Path(lowlevel_fd.__file__).resolve().parents[1]  # what this process imported
ROW = re.compile(r"^(llfd::\S.*?)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$")
PROGRESS = re.compile(r"^  (\d+)/(\d+) programs, \d+ s$", re.M)
# Every kernel `compile` builds for sm_90 by default: the planner's warps.
FAMILY_VARIANTS = (decode.shipped_variants, append.shipped_variants, multi.shipped_variants)
SHIPPED = [name for variants in FAMILY_VARIANTS for variant in variants()
           for name in variant.kernel_names]
SHIPPED_PROGRAMS = sum(len(list(variants())) for variants in FAMILY_VARIANTS)


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli-kernel-cache")


@pytest.fixture(scope="session")
def elsewhere(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CLI's working directory: no lowlevel_fd to import from there."""
    return tmp_path_factory.mktemp("cli-cwd")


def cli_env(cache: Path) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, LOWLEVEL_FD_CACHE_DIR=str(cache), PYTHONPATH=path)


def run_python(*args: str, cache: Path, cwd: Path,
               timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=cli_env(cache),
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="session")
def run_cli(elsewhere: Path):
    def run(*args: str, cache: Path, timeout: float = 900) -> subprocess.CompletedProcess:
        return run_python("-m", "lowlevel_fd", *args, cache=cache, cwd=elsewhere,
                          timeout=timeout)
    return run


def test_the_cli_runs_the_lowlevel_fd_under_test(session_cache, elsewhere):
    result = run_python("-c", "import lowlevel_fd; print(lowlevel_fd.__file__)",
                        cache=session_cache, cwd=elsewhere)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).resolve() == Path(lowlevel_fd.__file__).resolve()


@pytest.mark.skipif(os.environ.get("LOWLEVEL_FD_REQUIRE_INSTALLED") != "1",
                    reason="LOWLEVEL_FD_REQUIRE_INSTALLED=1 is not set (CI sets it)")
def test_the_installed_package_is_under_test_not_the_checkout():
    package = Path(lowlevel_fd.__file__).resolve()
    assert REPO not in package.parents, (
        f"the tests imported lowlevel_fd from the checkout ({package}), not the installed one")


# -- info and demo -----------------------------------------------------------------------------
def test_info_reports_versions_and_the_cache_dir(run_cli, session_cache):
    result = run_cli("info", cache=session_cache)
    assert result.returncode == 0, result.stderr
    major, minor = nvrtc_version()
    assert re.search(rf"^NVRTC\s+{major}\.{minor}$", result.stdout, re.M)
    assert re.search(rf"^lowlevel_fd\s+{re.escape(lowlevel_fd.__version__)}$", result.stdout,
                     re.M)
    assert re.search(r"^cuda-bindings\s+\d+\.", result.stdout, re.M)
    assert re.search(rf"^cache dir\s+{re.escape(str(session_cache))}$", result.stdout, re.M)
    if HAS_GPU:
        assert re.search(r"^arch\s+sm_\d+", result.stdout, re.M)
    else:
        assert "no CUDA GPU visible" in result.stdout


def test_the_demos_kernel_is_the_planners_pick_for_an_h100():
    heads, group = demo.HEADS, demo.HEADS // demo.KV_HEADS
    work = Workload(1, demo.KV_HEADS, demo.LENGTH, 132, 0, group, demo.HEAD_DIM)
    expected = DecodeVariant.planned(demo.CACHE, group, "float16", choose(work, clusters=True))
    assert demo.planned_variant() == expected
    assert (demo.CACHE.num_kv_heads, demo.CACHE.head_dim, heads) == (8, 128, 32)
    assert expected.num_warps == DEFAULT_WARPS


@pytest.mark.skipif(HAS_GPU, reason="with a GPU the demo runs for real")
def test_demo_without_a_gpu_compiles_and_says_it_needs_one(run_cli, tmp_path):
    kernel = re.escape(demo.planned_variant().split_kernel)
    fresh = run_cli("demo", cache=tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    assert re.search(rf"^compiled: the demo's kernel {kernel} for sm_90 \(\d+ bytes of "
                     rf"CUBIN\)$", fresh.stdout, re.M), fresh.stdout
    assert "the demo needs a CUDA GPU to run" in fresh.stdout
    again = run_cli("demo", cache=tmp_path)  # the same cache: nothing to compile
    assert again.returncode == 0, again.stderr
    assert re.search(rf"^found in the compile cache: the demo's kernel {kernel} for sm_90 ",
                     again.stdout, re.M), again.stdout
    assert "compiled:" not in again.stdout
    assert "the demo needs a CUDA GPU to run" in again.stdout


def test_no_command_is_a_usage_error(run_cli, session_cache):
    result = run_cli(cache=session_cache)
    assert result.returncode == 2 and "usage:" in result.stderr


def test_there_is_no_bench_command(run_cli, session_cache):
    # The benchmarks are the checkout's tools/bench.py, run directly.
    result = run_cli("bench", cache=session_cache)
    assert result.returncode == 2
    assert re.search(r"invalid choice: '?bench'?", result.stderr), result.stderr
    assert not hasattr(cli, "BENCH_SCRIPT")


# -- compile -----------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def compiled_sm90(run_cli, tmp_path_factory) -> subprocess.CompletedProcess:
    """`compile --arch sm_90` on a fresh cache, run once for the session (1839 NVRTC
    programs)."""
    # 16-18 minutes on CI's two cores (1907 kernels): a limit with room for a slow machine.
    return run_cli("compile", "--arch", "sm_90", cache=tmp_path_factory.mktemp("compile-cache"),
                   timeout=2400)


def test_compile_builds_every_shipped_kernel_once_for_sm90(compiled_sm90):
    lines = compiled_sm90.stdout.splitlines()
    assert lines[0] == (f"compiling {SHIPPED_PROGRAMS} programs (decode, append, multi) for "
                        f"sm_90")
    # 1585 decode programs (the split variants of 5 CTA sizes, those of 4, 8 and 16 heads also
    # masked, each over a contiguous and a paged cache, a cluster merge only up to 8 heads per
    # CTA as the planner picks it, and their merges) + 72 append programs
    # + 164 multi-token programs (3 head dims x 2 dtypes x 4 scale modes x 2 storages x 2
    # KSPLITs on mma.sync, the two wgmma kernels at head_dim 64 and 128: 2 x 2 x 2 x 4 x 2,
    # and the int8-q kernel: 2 dtypes x 2 scale dtypes)
    # + their 18 split merges (multi_combine: one per head_dim, rows per CTA, tile and dtype).
    assert SHIPPED_PROGRAMS == 1839
    rows = [ROW.match(line) for line in lines]
    names = [row.group(1) for row in rows if row]
    assert len(names) == len(set(names)), "a kernel is listed twice"
    assert len(names) == len(SHIPPED) == 1911
    assert sorted(names) == sorted(SHIPPED)
    expected = [name for family in cli.FAMILIES for variant in family.variants((DEFAULT_WARPS,))
                for name in variant.kernel_names]
    assert sorted(names) == sorted(expected)
    assert all(int(row.group(2)) > 0 for row in rows if row), "every kernel reports registers"


def test_compile_reports_progress_on_stderr(compiled_sm90):
    progress = [(int(done), int(total)) for done, total in PROGRESS.findall(compiled_sm90.stderr)]
    assert progress and all(total == SHIPPED_PROGRAMS for _, total in progress)
    assert progress[-1] == (SHIPPED_PROGRAMS, SHIPPED_PROGRAMS)
    assert [done for done, _ in progress] == sorted({done for done, _ in progress})
    assert len(progress) >= 10, "a line per tenth of the programs"
    assert not PROGRESS.search(compiled_sm90.stdout), "stdout holds only the report"


def test_compile_sm90_has_no_spills_and_no_stack_frames(compiled_sm90):
    assert compiled_sm90.returncode == 0, compiled_sm90.stderr
    spilling = [row.group(1) for row in map(ROW.match, compiled_sm90.stdout.splitlines())
                if row and (int(row.group(3)) or int(row.group(4)) or int(row.group(5)))]
    assert spilling == []
    assert re.search(rf"^{len(SHIPPED)} kernels for sm_90: no spills, no stack frames "
                     rf"\(\d+\.\d s\)$", compiled_sm90.stdout, re.M)


@pytest.mark.parametrize("arch", ["sm90", "compute_90", "90"])
def test_compile_rejects_a_bad_arch(run_cli, session_cache, arch):
    result = run_cli("compile", "--arch", arch, cache=session_cache)
    assert result.returncode == 2
    assert "arch: expected a real architecture like 'sm_90'" in result.stderr


def test_all_warps_help_names_the_other_warp_counts(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exited:
        cli.build_parser("lowlevel-fd").parse_args(["compile", "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    others = [w for w in WARP_COUNTS if w != DEFAULT_WARPS]
    assert others == [2, 4]
    assert re.search(r"--all-warps\s.*2 and 4 warps", text), text
    assert f"the planner picks {DEFAULT_WARPS}" in text


class FakeVariant:
    """Stands in for a kernel variant: ``compile`` returns a canned ptxas report (these tests
    use ``--cache``: one ``compile`` per program, the path a fake can take)."""

    def __init__(self, name: str, resources: KernelResources) -> None:
        self.name, self.resources = name, resources
        self.kernel_names = (name,)

    def compile(self, arch: str) -> CompiledProgram:
        return CompiledProgram(cubin=b"\x7fELF", log="", arch=arch,
                               lowered_names={self.name: f"_Z{self.name}"},
                               resources={f"_Z{self.name}": self.resources})


def fake_family(*variants) -> cli.KernelFamily:
    return cli.KernelFamily("fake", lambda warps: variants)


CLEAN = KernelResources(registers=40, spill_store_bytes=0, spill_load_bytes=0, stack_bytes=0,
                        shared_bytes=0)


@pytest.mark.parametrize("problem, resources", [
    ("4 B spill stores", KernelResources(255, 4, 0, 0, 0)),
    ("8 B spill loads", KernelResources(255, 0, 8, 0, 0)),
    ("16 B stack", KernelResources(64, 0, 0, 16, 0)),
])
def test_compile_fails_and_names_a_kernel_that_spills(monkeypatch, capsys, problem, resources):
    family = fake_family(FakeVariant("clean", CLEAN), FakeVariant("spiller", resources))
    monkeypatch.setattr(cli, "FAMILIES", [family])
    assert cli.main(["compile", "--arch", "sm_90", "--cache"]) == 1
    captured = capsys.readouterr()
    assert re.search(rf"^  spiller: .*{problem}", captured.err, re.M)
    assert "clean" not in captured.err
    assert re.search(r"^spiller\s+\d+", captured.out, re.M), "the table still lists it"


class BrokenVariant:
    kernel_names = ("broken",)

    def compile(self, arch: str) -> CompiledProgram:
        raise CompileError("broken.cu", arch, "broken.cu(3): error: expected a \";\"")


def test_compile_reports_a_variant_that_does_not_compile(monkeypatch, capsys):
    family = fake_family(FakeVariant("clean", CLEAN), BrokenVariant())
    monkeypatch.setattr(cli, "FAMILIES", [family])
    assert cli.main(["compile", "--arch", "sm_90", "--cache"]) == 1
    err = capsys.readouterr().err
    assert re.search(r"^  fake .*BrokenVariant.*: does not compile$", err, re.M)
    assert re.search(r"broken\.cu\(3\): error", err)


def test_compile_lists_each_kernel_once_in_the_order_of_the_families(monkeypatch, capsys):
    first, second = FakeVariant("first", CLEAN), FakeVariant("second", CLEAN)
    monkeypatch.setattr(cli, "FAMILIES", [fake_family(first), fake_family(second)])
    assert cli.main(["compile", "--arch", "sm_90", "--cache"]) == 0
    captured = capsys.readouterr()
    listed = [line.split()[0] for line in captured.out.splitlines()
              if line.split() and line.split()[0] in ("first", "second")]
    assert listed == ["first", "second"]
    assert captured.out.splitlines()[0] == "compiling 2 programs (fake, fake) for sm_90"
    assert re.search(r"^2 kernels for sm_90: no spills", captured.out, re.M)
    assert PROGRESS.search(captured.err) and not PROGRESS.search(captured.out)


def test_compile_passes_every_warp_count_with_all_warps(monkeypatch, capsys):
    seen: list[tuple[int, ...]] = []
    family = cli.KernelFamily("fake", lambda warps: seen.append(warps) or [])
    monkeypatch.setattr(cli, "FAMILIES", [family])
    assert cli.main(["compile", "--arch", "sm_80", "--all-warps", "--cache"]) == 0
    assert cli.main(["compile", "--arch", "sm_80", "--cache"]) == 0
    assert seen == [WARP_COUNTS, (DEFAULT_WARPS,)] == [(2, 4, 8), (8,)]


def test_batched_compile_reports_what_one_program_per_run_reports(capsys, monkeypatch, tmp_path):
    """The default `compile` puts up to cli.BATCH programs of one source into one NVRTC run:
    the same rows as compiling each program on its own (and nothing goes to the cache)."""
    monkeypatch.setenv("LOWLEVEL_FD_CACHE_DIR", str(tmp_path / "cache"))
    picked = [v for v in decode.shipped_variants()][:3] + list(append.shipped_variants())[:2]
    family = cli.KernelFamily("some", lambda warps: picked)
    tables = []
    for batch in (0, 2):
        assert cli.compile_families([family], "sm_90", (DEFAULT_WARPS,), batch=batch) == 0
        tables.append([line for line in capsys.readouterr().out.splitlines()
                       if ROW.match(line)])
    assert tables[0] == tables[1] and len(tables[0]) == 7  # 3 split kernels + 2 x 2 append
    assert cli._batches([(None, v) for v in picked], 2) == [[0, 1], [2], [3, 4]]


def test_compile_help_explains_the_cache_flag(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser("lowlevel-fd").parse_args(["compile", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert re.search(r"--cache\s.*into the compile cache", text), text
