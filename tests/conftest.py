"""Test configuration: the ``gpu`` marker skips cleanly when no CUDA device is visible, and the
report header names the lowlevel_fd under test (the installed package or the checkout)."""
from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest

from lowlevel_fd.driver import gpu_available

HAS_GPU = gpu_available()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Which lowlevel_fd the run tests: CI installs the wheel and must not test the checkout
    (test_cli.py fails the run when LOWLEVEL_FD_REQUIRE_INSTALLED=1 and it does)."""
    import lowlevel_fd

    package = Path(lowlevel_fd.__file__).resolve().parent
    checkout = Path(__file__).resolve().parents[1]
    where = "the checkout" if checkout in package.parents else "installed"
    return [f"lowlevel_fd under test: {lowlevel_fd.__version__} from {package} ({where})"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator seeded from the test's name: fresh data per test, reproducible per test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def device():
    from lowlevel_fd.driver import Device
    return Device(0)


@pytest.fixture
def stream(device):
    from lowlevel_fd.driver import Stream
    with Stream(device) as s:
        yield s


@pytest.fixture
def nvrtc_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The compilations the compile cache really hands to NVRTC (names, in order)."""
    from lowlevel_fd.compiler import cache

    calls: list[str] = []
    real = cache.compile_source

    def counting(source, name, options, name_expressions=()):
        calls.append(name)
        return real(source, name, options, name_expressions)

    monkeypatch.setattr(cache, "compile_source", counting)
    return calls
