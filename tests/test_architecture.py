"""Dependencies point one way (pyproject.toml ``[tool.importlinter]``), and the public surface is ``__all__``.

``lint-imports`` checks the contracts: the layers ``streams -> connectors | analytics -> nexuskv``,
with the bus layer ``streams.bus`` below the engine adapters and the services; the engine adapters
free of services, Faust, DuckDB and the OpenTelemetry SDK; the deciding core free of I/O, the data
plane and the reference engine; the decision store off the bus; the engine adapters independent.
Running it here makes a wrong arrow fail CI. What an engine process really loads is checked too,
by importing the adapters in a fresh interpreter.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IO_SUBPACKAGES = ("dataplane", "reference_engine")


def _lint(cwd: Path, config: Path | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    argv = [exe, "--no-cache"] + (["--config", str(config)] if config else [])
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(cwd), "PATH": str(Path(sys.executable).parent)})


def test_import_contracts_are_kept():
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_every_core_module_is_under_the_no_io_contract():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    core = next(c for c in contracts if c["name"].startswith("The deciding core"))
    listed = set(core["source_modules"])
    missing = []
    for path in sorted((ROOT / "nexuskv").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) > 1 and parts[1] in IO_SUBPACKAGES + ("native",):
            continue
        name = ".".join(parts)
        parent = ".".join(parts[:-1])
        if name not in listed and f"{parent}.*" not in listed:
            missing.append(name)
    assert not missing, f"classify these in pyproject.toml's no-I/O contract: {missing}"


def test_a_wrong_arrow_fails_the_lint(tmp_path):
    # The same kinds of contract on a two-package tree whose lower layer imports the upper one.
    for pkg, body in {"low": "import high.thing\n", "high": ""}.items():
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
        (tmp_path / pkg / "thing.py").write_text(body)
    config = tmp_path / "contracts.toml"
    config.write_text(textwrap.dedent("""
        [tool.importlinter]
        root_packages = ["high", "low"]
        [[tool.importlinter.contracts]]
        name = "high above low"
        type = "layers"
        layers = ["high", "low"]
    """))
    done = _lint(tmp_path, config)
    assert done.returncode != 0 and "1 broken" in done.stdout, done.stdout


def test_importing_the_core_loads_no_io_library():
    code = ("import sys, nexuskv, nexuskv.contracts, nexuskv.compat, nexuskv.models, nexuskv.schemas, nexuskv.planner;"
            "bad = [m for m in ('aiokafka','faust','duckdb','zmq','torch') if m in sys.modules];"
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"


def test_public_surface():
    import nexuskv

    for name in nexuskv.__all__:
        assert hasattr(nexuskv, name), name
    assert "Settings" in nexuskv.__all__ and "StateDescriptor" in nexuskv.__all__


#: Modules an engine process must never load (DESIGN.md, "Layers"): services, the composition root,
#: the decision store, Faust, DuckDB, the OpenTelemetry SDK.
ENGINE_FORBIDDEN = ("faust", "mode", "duckdb", "opentelemetry.sdk", "analytics", "streams.app")
ENGINE_ADAPTERS = ("connectors.vllm.connector", "connectors.sglang.hicache", "connectors.index_client",
                   "connectors.bus_thread", "connectors.vllm.wiring", "connectors.sglang.hicache_core")


def _loaded_by(code: str) -> list[str]:
    probe = code + textwrap.dedent(f"""
        import sys
        forbidden = {ENGINE_FORBIDDEN!r}
        bad = sorted(m for m in sys.modules
                     if any(m == f or m.startswith(f + ".") for f in forbidden)
                     or (m.startswith("streams.") and not m.startswith("streams.bus")))
        print(",".join(bad))
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [m for m in done.stdout.strip().split(",") if m]


def test_an_engine_process_loads_no_service_faust_duckdb_or_otel_sdk():
    assert _loaded_by("".join(f"import {m}\n" for m in ENGINE_ADAPTERS)) == []


def test_the_vllm_shell_class_loads_no_service_either():
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        import pytest

        pytest.skip("vLLM is not installed (infra/engines/install_vllm.sh)")
    assert _loaded_by("from connectors.vllm.connector import NexusKVConnector\n") == []
