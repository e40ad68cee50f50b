"""One result file per benchmark figure, in one shape: ``benchmarks/results/<name>.json``.

Shape::

    {"name", "metric", "unit", "value", "baseline": {"name", "value"}, "ratio",
     "runs": [{"value", "baseline", "ratio"}, ...], "command", "date"}

plus ``"details"`` when given. A figure is measured several times (these machines are shared and
noisy): ``runs`` holds every repeat, the figure and its baseline from the same run, and that run's
``ratio`` (``value / baseline``; null when the baseline is 0). The top-level ``value`` and
``baseline.value`` are the medians over the runs, and ``ratio`` is the **median of the per-run
ratios** — never the ratio of two medians, which can pair one run's figure with another run's
baseline. ``date`` is the UTC time of writing in ISO 8601; ``command`` is the shell command that
reproduces the whole file (every run).

:func:`check_result` says what is wrong with a file (the test over ``benchmarks/results`` runs it).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = ["RESULTS_DIR", "Run", "check_result", "load_result", "write_result"]

RESULTS_DIR = Path(__file__).resolve().parent / "results"
_KEYS = ("name", "metric", "unit", "value", "baseline", "ratio", "runs", "command", "date")


@dataclass(frozen=True, slots=True)
class Run:
    """One repeat of a benchmark: its figure and the baseline's, measured in the same run."""

    value: float
    baseline: float

    @property
    def ratio(self) -> float | None:
        return self.value / self.baseline if self.baseline else None  # JSON has no NaN


def _median(values: Sequence[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def write_result(name: str, metric: str, unit: str, runs: Sequence[Run], baseline_name: str, command: str,
                 details: Mapping[str, Any] | None = None, *, results_dir: Path | None = None) -> Path:
    """Write ``<results_dir>/<name>.json`` (``benchmarks/results`` by default) and return its path.

    ``runs``: every repeat, each a :class:`Run` of the same run's figure and baseline."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"bad result name {name!r}")
    if not runs:
        raise ValueError(f"{name}: a result needs at least one run")
    runs = [Run(float(r.value), float(r.baseline)) for r in runs]
    ratios = [r.ratio for r in runs if r.ratio is not None]
    result: dict[str, Any] = {
        "name": name,
        "metric": metric,
        "unit": unit,
        "value": _median([r.value for r in runs]),
        "baseline": {"name": baseline_name, "value": _median([r.baseline for r in runs])},
        "ratio": _median(ratios),
        "runs": [{"value": r.value, "baseline": r.baseline, "ratio": r.ratio} for r in runs],
        "command": command,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if details is not None:
        result["details"] = dict(details)
    out_dir = results_dir or RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def load_result(name: str, *, results_dir: Path | None = None) -> dict[str, Any]:
    """The result file ``name`` as written."""
    return json.loads(((results_dir or RESULTS_DIR) / f"{name}.json").read_text(encoding="utf-8"))


def check_result(result: Mapping[str, Any]) -> list[str]:
    """What is wrong with a result file's content (empty: nothing)."""
    problems = [f"missing {k!r}" for k in _KEYS if k not in result]
    if problems:
        return problems
    runs = result["runs"]
    if not isinstance(runs, list) or not runs:
        return ["'runs' must list every repeat"]
    for i, r in enumerate(runs):
        if not {"value", "baseline", "ratio"} <= set(r):
            problems.append(f"runs[{i}] needs value, baseline and ratio")
            continue
        want = r["value"] / r["baseline"] if r["baseline"] else None
        if (want is None) != (r["ratio"] is None) or (want is not None and abs(want - r["ratio"]) > 1e-9 * abs(want)):
            problems.append(f"runs[{i}].ratio is not its value / baseline")
    if problems:
        return problems
    checks = {"value": _median([r["value"] for r in runs]),
              "baseline.value": _median([r["baseline"] for r in runs]),
              "ratio": _median([r["ratio"] for r in runs if r["ratio"] is not None])}
    got = {"value": result["value"], "baseline.value": result["baseline"].get("value"), "ratio": result["ratio"]}
    for key, want in checks.items():
        have = got[key]
        if (want is None) != (have is None) or (want is not None and abs(want - have) > 1e-9 * max(1.0, abs(want))):
            problems.append(f"{key} {have!r} is not the median over the runs ({want!r})")
    if not str(result["command"]).startswith("python -m benchmarks."):
        problems.append(f"command {result['command']!r} does not rerun a benchmark (python -m benchmarks....)")
    return problems
