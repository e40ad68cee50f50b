"""Tests that run SGLang 0.5.23's own code (see ``engine.py``).

SGLang is installed by ``bash infra/engines/install_sglang.sh`` (part of the README's install
command). Where it is missing these tests fail, saying so: they are never skipped silently. For
a quick local run without SGLang, ``NEXUSKV_SKIP_SGLANG=1`` skips them, and says why.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from importlib import metadata
from pathlib import Path

import pytest

SGLANG_VERSION = "0.5.23"
INSTALL = "bash infra/engines/install_sglang.sh"
PUBLISHERS = Path(os.environ.get("NEXUSKV_SGLANG_PUBLISHERS", Path.home() / ".cache/nexuskv/sglang-publishers"))


def _problem() -> str | None:
    try:
        have = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return f"SGLang {SGLANG_VERSION} is not installed"
    if have != SGLANG_VERSION:
        return f"SGLang {have} is installed; these tests run SGLang {SGLANG_VERSION}"
    return None


@pytest.fixture(autouse=True, scope="session")
def sglang_installed() -> None:
    if os.environ.get("NEXUSKV_SKIP_SGLANG") == "1":
        pytest.skip("NEXUSKV_SKIP_SGLANG=1: the tests that run SGLang's own code are skipped on request")
    problem = _problem()
    if problem:
        pytest.fail(f"{problem}: run `{INSTALL}` (or set NEXUSKV_SKIP_SGLANG=1 to skip these tests locally)",
                    pytrace=False)
    importlib.import_module("sglang.srt.mem_cache.hicache_storage")  # import errors surface here, once


@pytest.fixture(scope="session")
def old_publisher():
    """``old_publisher(version)``: SGLang ``version``'s own ``kv_events.py``, from its wheel (the install script)."""
    loaded: dict[str, object] = {}

    def load(version: str):
        if version in loaded:
            return loaded[version]
        path = PUBLISHERS / version / "kv_events.py"
        if not path.is_file():
            pytest.fail(f"SGLang {version}'s publisher code is missing at {path}: run `{INSTALL}`", pytrace=False)
        name = f"sglang_{version.replace('.', '_')}_kv_events"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # msgspec resolves the structs' annotations through the module
        spec.loader.exec_module(module)
        loaded[version] = module
        return module

    return load
