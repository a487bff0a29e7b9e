"""Specification of ``python -m lowlevel_fd``: info and demo without a GPU, compile of every
shipped kernel with no spills, and the plumbing of compile and bench."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from lowlevel_fd import cli
from lowlevel_fd.compiler import (CompiledProgram, CompileError, KernelResources,
                                  nvrtc_version)
from lowlevel_fd.decode import shipped_variants
from lowlevel_fd.decode.variants import PLANNER_WARPS

from conftest import HAS_GPU

REPO = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^(llfd::\S.*?)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$")


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli-kernel-cache")


def run_cli(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, LOWLEVEL_FD_CACHE_DIR=str(cache),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "lowlevel_fd", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)


# -- info and demo -----------------------------------------------------------------------------
def test_info_reports_versions_and_the_cache_dir(session_cache):
    result = run_cli("info", cache=session_cache)
    assert result.returncode == 0, result.stderr
    major, minor = nvrtc_version()
    assert re.search(rf"^NVRTC\s+{major}\.{minor}$", result.stdout, re.M)
    assert re.search(r"^lowlevel_fd\s+\d+\.\d+", result.stdout, re.M)
    assert re.search(r"^cuda-bindings\s+\d+\.", result.stdout, re.M)
    assert re.search(rf"^cache dir\s+{re.escape(str(session_cache))}$", result.stdout, re.M)
    if HAS_GPU:
        assert re.search(r"^arch\s+sm_\d+", result.stdout, re.M)
    else:
        assert "no CUDA GPU visible" in result.stdout


@pytest.mark.skipif(HAS_GPU, reason="with a GPU the demo runs for real")
def test_demo_without_a_gpu_compiles_and_says_it_needs_one(session_cache):
    result = run_cli("demo", cache=session_cache)
    assert result.returncode == 0, result.stderr
    assert "compiled the demo's kernel" in result.stdout
    assert "needs a CUDA GPU" in result.stdout


def test_no_command_is_a_usage_error(session_cache):
    result = run_cli(cache=session_cache)
    assert result.returncode == 2 and "usage:" in result.stderr


# -- compile -----------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def compiled_sm90(session_cache: Path) -> subprocess.CompletedProcess:
    """`compile --arch sm_90`, run once for the session (about 120 NVRTC compiles)."""
    return run_cli("compile", "--arch", "sm_90", cache=session_cache)


def test_compile_builds_every_shipped_kernel_for_sm90(compiled_sm90):
    rows = [ROW.match(line) for line in compiled_sm90.stdout.splitlines()]
    names = [row.group(1) for row in rows if row]
    expected = [name for family in cli.FAMILIES for variant in family.variants(PLANNER_WARPS)
                for name in family.kernels(variant)]
    decode = [n for v in shipped_variants() for n in (v.split_kernel, v.combine_kernel)]
    assert sorted(names) == sorted(expected)
    assert set(decode) <= set(names)
    assert all(int(row.group(2)) > 0 for row in rows if row), "every kernel reports registers"


def test_compile_sm90_has_no_spills_and_no_stack_frames(compiled_sm90):
    assert compiled_sm90.returncode == 0, compiled_sm90.stderr
    spilling = [row.group(1) for row in map(ROW.match, compiled_sm90.stdout.splitlines())
                if row and (int(row.group(3)) or int(row.group(4)) or int(row.group(5)))]
    assert spilling == []
    assert re.search(r"^\d+ kernels for sm_90: no spills, no stack frames", compiled_sm90.stdout,
                     re.M)


@pytest.mark.parametrize("arch", ["sm90", "compute_90", "90"])
def test_compile_rejects_a_bad_arch(session_cache, arch):
    result = run_cli("compile", "--arch", arch, cache=session_cache)
    assert result.returncode == 2
    assert "arch: expected a real architecture like 'sm_90'" in result.stderr


class FakeVariant:
    """Stands in for a kernel variant: ``compile`` returns a canned ptxas report."""

    def __init__(self, name: str, resources: KernelResources) -> None:
        self.name, self.resources = name, resources

    def compile(self, arch: str) -> CompiledProgram:
        return CompiledProgram(cubin=b"\x7fELF", log="", arch=arch,
                               lowered_names={self.name: f"_Z{self.name}"},
                               resources={f"_Z{self.name}": self.resources})


def fake_family(*variants: FakeVariant) -> cli.KernelFamily:
    return cli.KernelFamily("fake", lambda warps: variants, lambda v: (v.name,))


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
    assert cli.main(["compile", "--arch", "sm_90"]) == 1
    captured = capsys.readouterr()
    assert re.search(rf"^  spiller: .*{problem}", captured.err, re.M)
    assert "clean" not in captured.err
    assert re.search(r"^spiller\s+\d+", captured.out, re.M), "the table still lists it"


class BrokenVariant:
    def compile(self, arch: str) -> CompiledProgram:
        raise CompileError("broken.cu", arch, "broken.cu(3): error: expected a \";\"")


def test_compile_reports_a_variant_that_does_not_compile(monkeypatch, capsys):
    family = fake_family(FakeVariant("clean", CLEAN), BrokenVariant())
    monkeypatch.setattr(cli, "FAMILIES", [family])
    assert cli.main(["compile", "--arch", "sm_90"]) == 1
    err = capsys.readouterr().err
    assert re.search(r"^  fake .*BrokenVariant.*: does not compile$", err, re.M)
    assert re.search(r"broken\.cu\(3\): error", err)


def test_compile_passes_every_warp_count_with_all_warps(monkeypatch, capsys):
    seen: list[tuple[int, ...]] = []
    family = cli.KernelFamily("fake", lambda warps: seen.append(warps) or [], lambda v: ())
    monkeypatch.setattr(cli, "FAMILIES", [family])
    assert cli.main(["compile", "--arch", "sm_80", "--all-warps"]) == 0
    assert cli.main(["compile", "--arch", "sm_80"]) == 0
    assert seen == [(2, 4, 8), PLANNER_WARPS]


# -- bench -------------------------------------------------------------------------------------
def test_bench_passes_its_arguments_through(monkeypatch, tmp_path):
    script = tmp_path / "tools" / "bench.py"
    script.parent.mkdir()
    script.write_text("import sys\n"
                      "def main(argv):\n"
                      "    sys.modules['lowlevel_fd_bench_test'].argv = argv\n"
                      "    return 7\n")
    monkeypatch.setattr(cli, "BENCH_SCRIPT", script)
    monkeypatch.setitem(sys.modules, "lowlevel_fd_bench_test", SimpleNamespace())
    assert cli.main(["bench", "--batch", "4", "-h", "x"]) == 7
    assert sys.modules["lowlevel_fd_bench_test"].argv == ["--batch", "4", "-h", "x"]


def test_bench_without_the_script_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "BENCH_SCRIPT", tmp_path / "tools" / "bench.py")
    assert cli.main(["bench"]) == 2
    assert "bench.py not found" in capsys.readouterr().err
