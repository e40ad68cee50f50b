"""Dependencies point one way, and the public surface is what __all__ says."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN_IN_CORE = {"aiokafka", "faust", "mode", "duckdb", "zmq", "vllm", "sglang", "streams", "connectors",
                     "analytics", "kafka", "opentelemetry"}
# The data plane and reference engine may use torch; the deciding core may not.
TORCH_ALLOWED = ("nexuskv/dataplane/", "nexuskv/reference_engine/")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", sorted((ROOT / "nexuskv").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_imports_no_edge(path):
    found = _imports(path)
    rel = str(path.relative_to(ROOT))
    bad = found & FORBIDDEN_IN_CORE
    if not rel.startswith(TORCH_ALLOWED):
        bad |= found & {"torch"}
    assert not bad, f"{rel} imports {sorted(bad)}"


@pytest.mark.parametrize("package", ["streams", "connectors", "analytics"])
def test_edges_do_not_import_each_other_cyclically(package):
    # streams may be imported by connectors and analytics (it is the bus); nothing imports back.
    for path in (ROOT / package).rglob("*.py"):
        found = _imports(path)
        if package == "streams":
            allowed_lazy = path.name == "cli.py"  # the composition root
            assert allowed_lazy or not (found & {"connectors", "analytics"}), path


def test_importing_the_core_loads_no_io_library():
    code = ("import sys, nexuskv, nexuskv.contracts, nexuskv.compat, nexuskv.models, nexuskv.schemas;"
            "bad = [m for m in ('aiokafka','faust','duckdb','zmq','torch') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_public_surface():
    import nexuskv

    for name in nexuskv.__all__:
        assert hasattr(nexuskv, name), name
    assert "Settings" in nexuskv.__all__ and "StateDescriptor" in nexuskv.__all__
