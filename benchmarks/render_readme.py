"""Render the figures table of ``benchmarks/README.md`` from ``benchmarks/results/*.json``.

The table sits between ``<!-- results:begin -->`` and ``<!-- results:end -->``; one row per results
file: name, metric, value, unit, baseline name and value, ratio (the median of the per-run
ratios), runs and date. Nothing in it is typed by hand::

    python -m benchmarks.render_readme           # rewrite the block
    python -m benchmarks.render_readme --check   # exit 1 naming each row that differs
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks._result import RESULTS_DIR

__all__ = ["BEGIN", "END", "README", "build_parser", "differences", "load_results", "render", "render_table"]

README = Path(__file__).resolve().parent / "README.md"
BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"
_HEADER = ("| name | metric | value | unit | baseline | baseline value | ratio | runs | date |\n"
           "|---|---|---|---|---|---|---|---|---|")


def load_results(results_dir: Path = RESULTS_DIR) -> list[dict[str, Any]]:
    """Every results file in ``results_dir``, by name."""
    return [json.loads(p.read_text(encoding="utf-8")) for p in sorted(results_dir.glob("*.json"))]


def _num(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:,.0f}" if abs(v) >= 1e4 else f"{v:.4g}"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _row(doc: Mapping[str, Any]) -> str:
    base = doc.get("baseline") or {}
    return "| " + " | ".join((
        f"`{_cell(doc['name'])}`", _cell(doc["metric"]), _num(doc["value"]), _cell(doc["unit"]),
        _cell(base.get("name", "")), _num(base.get("value")), _num(doc["ratio"]), str(len(doc["runs"])),
        _cell(str(doc["date"])[:10]),
    )) + " |"


def render_table(docs: Sequence[Mapping[str, Any]]) -> str:
    """The markdown table, one row per results file, in name order."""
    rows = [_row(d) for d in sorted(docs, key=lambda d: d["name"])]
    return "\n".join([_HEADER, *rows])


def _split(readme: str) -> tuple[str, str, str]:
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < 0 or end < start:
        raise ValueError(f"README needs the markers {BEGIN} and {END}, in that order")
    return readme[:start + len(BEGIN)], readme[start + len(BEGIN):end], readme[end:]


def render(readme: str, docs: Sequence[Mapping[str, Any]]) -> str:
    """``readme`` with the block between the markers replaced by the table of ``docs``."""
    head, _, tail = _split(readme)
    return f"{head}\n{render_table(docs)}\n{tail}"


def _rows_by_name(block: str) -> dict[str, str]:
    rows = {}
    for line in block.strip().splitlines():
        cells = line.split(" | ")
        if line.startswith("| `") and cells:
            rows[cells[0].removeprefix("| ").strip("`")] = line
    return rows


def differences(readme: str, docs: Sequence[Mapping[str, Any]]) -> list[str]:
    """What the README's block gets wrong against ``docs`` (empty: it is the rendering)."""
    try:
        _, block, _ = _split(readme)
    except ValueError as e:
        return [str(e)]
    want = render_table(docs)
    if block.strip() == want:
        return []
    have_rows, want_rows = _rows_by_name(block), _rows_by_name(want)
    out = [f"{n}: no row in the README" for n in want_rows if n not in have_rows]
    out += [f"{n}: a row but no results file" for n in have_rows if n not in want_rows]
    out += [f"{n}: the row differs from its results file" for n in want_rows
            if n in have_rows and have_rows[n] != want_rows[n]]
    return out or ["the block differs from the rendering (header or layout)"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.render_readme", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 naming each row that differs")
    ap.add_argument("--readme", type=Path, default=README)
    ap.add_argument("--results", type=Path, default=RESULTS_DIR)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    readme = args.readme.read_text(encoding="utf-8")
    docs = load_results(args.results)
    if args.check:
        problems = differences(readme, docs)
        for p in problems:
            print(f"{args.readme}: {p}", file=sys.stderr)
        if problems:
            print("run: python -m benchmarks.render_readme", file=sys.stderr)
        return 1 if problems else 0
    out = render(readme, docs)
    if out != readme:
        args.readme.write_text(out, encoding="utf-8")
        print(f"wrote {args.readme} ({len(docs)} figures)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
