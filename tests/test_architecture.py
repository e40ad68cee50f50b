"""Dependencies point one way (pyproject.toml ``[tool.importlinter]``), and the public surface is ``__all__``.

``lint-imports`` checks the contracts: the layers ``connectors -> streams -> analytics -> nexuskv``;
the deciding core free of I/O, the data plane and the reference engine; the decision store off the
bus; the engine adapters independent. Running it here makes a wrong arrow fail CI.
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
