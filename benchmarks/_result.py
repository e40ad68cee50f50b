"""One result file per benchmark figure, in one shape: ``benchmarks/results/<name>.json``.

Shape::

    {"name", "metric", "unit", "value", "baseline": {"name", "value"}, "ratio", "command", "date"}

plus ``"details"`` when given. ``ratio`` is ``value / baseline.value`` (null when the baseline is
0); ``date`` is the UTC time of writing in ISO 8601; ``command`` is the shell command that
reproduces the figure.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = ["RESULTS_DIR", "write_result"]

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def write_result(name: str, metric: str, unit: str, value: float, baseline_name: str, baseline_value: float,
                 command: str, details: dict[str, Any] | None = None, *, results_dir: Path | None = None) -> Path:
    """Write ``<results_dir>/<name>.json`` (``benchmarks/results`` by default) and return its path."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"bad result name {name!r}")
    value, baseline_value = float(value), float(baseline_value)
    ratio = value / baseline_value if baseline_value else None  # JSON has no NaN
    result: dict[str, Any] = {
        "name": name,
        "metric": metric,
        "unit": unit,
        "value": value,
        "baseline": {"name": baseline_name, "value": baseline_value},
        "ratio": ratio,
        "command": command,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if details is not None:
        result["details"] = details
    out_dir = results_dir or RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path
