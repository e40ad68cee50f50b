"""The native core's own checks: ``cargo clippy --all-targets -- -D warnings`` and ``cargo test``
in ``nexuskv/native`` (the table and core unit tests, the unsafe buffer code included).

Slow (a cold build compiles PyO3: about a minute here). The build goes to its own target folder
under ``nexuskv/native/target/`` so it never races the install's build; ``cargo test`` builds
without the ``extension-module`` feature (the test binary links libpython itself).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CRATE = Path(__file__).resolve().parents[2] / "nexuskv" / "native"


def _cargo() -> str:
    cargo = shutil.which("cargo") or str(Path.home() / ".cargo" / "bin" / "cargo")
    if not Path(cargo).exists():
        pytest.fail("cargo is not installed: the native core's checks need a Rust toolchain with clippy "
                    "(https://rustup.rs, then `rustup component add clippy`)")
    return cargo


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CARGO_TARGET_DIR": str(CRATE / "target" / "pytest"), "CARGO_TERM_COLOR": "never"}
    return subprocess.run([_cargo(), *args], cwd=CRATE, env=env, capture_output=True, text=True, timeout=1800,
                          check=False)


def _tail(done: subprocess.CompletedProcess) -> str:
    return (done.stdout + done.stderr)[-6000:]


def test_clippy_finds_nothing():
    probe = _run("clippy", "--version")
    if probe.returncode != 0:
        pytest.fail(f"cargo clippy is not installed (`rustup component add clippy`):\n{_tail(probe)}")
    done = _run("clippy", "--all-targets", "--", "-D", "warnings")
    assert done.returncode == 0, f"cargo clippy --all-targets -- -D warnings failed:\n{_tail(done)}"


def test_cargo_test_passes():
    done = _run("test")
    assert done.returncode == 0, f"cargo test failed:\n{_tail(done)}"
    assert "test result: ok" in done.stdout, _tail(done)
