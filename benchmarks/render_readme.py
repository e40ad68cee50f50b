"""Render the figures table of ``benchmarks/README.md`` from ``benchmarks/results/*.json``, and the
main command's figures in the top-level ``README.md`` from the replay's results files.

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

__all__ = ["BEGIN", "END", "MAIN_BEGIN", "MAIN_END", "README", "TOP_README", "build_parser", "differences",
           "load_results", "main_differences", "render", "render_main", "render_main_table", "render_table"]

README = Path(__file__).resolve().parent / "README.md"
BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"
TOP_README = Path(__file__).resolve().parents[1] / "README.md"
MAIN_BEGIN = "<!-- main-figures:begin -->"
MAIN_END = "<!-- main-figures:end -->"
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


def _by_name(docs: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    return {d["name"]: d for d in docs}


def _median(values: Sequence[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def render_main_table(docs: Sequence[Mapping[str, Any]]) -> str:
    """The main command's figures (``replay_ttft_mean`` and ``replay_ttft_p99``): each run, then the
    medians and the median of the per-run ratios, as the results files hold them."""
    by = _by_name(docs)
    mean, p99 = by["replay_ttft_mean"], by["replay_ttft_p99"]
    runs = mean["details"]["runs"]
    rows = [("| run | vLLM alone TTFT mean | vLLM + NexusKV | ratio | p99 alone | p99 NexusKV | ratio "
             "| prompt tokens recomputed (NexusKV / alone) | differing outputs | loads completed / planned "
             "| median TTFT prediction error |"),
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, (r, m, p) in enumerate(zip(runs, mean["runs"], p99["runs"], strict=True), 1):
        rows.append(f"| {i} | {m['baseline']:.3f} s | {m['value']:.3f} s | {m['ratio']:.3f} | {p['baseline']:.3f} s "
                    f"| {p['value']:.3f} s | {p['ratio']:.3f} | {r['recomputed_tokens_ratio']:.3f} "
                    f"| {r['differing_outputs']} | {r['transfers_completed']} / {r['transfers_planned']} "
                    f"| {r['median_ttft_rel_error']:.0%} |")
    rows.append(f"| **median** | {mean['baseline']['value']:.3f} s | {mean['value']:.3f} s | **{mean['ratio']:.3f}** "
                f"| {p99['baseline']['value']:.3f} s | {p99['value']:.3f} s | **{p99['ratio']:.3f}** "
                f"| {_median([r['recomputed_tokens_ratio'] for r in runs]):.3f} "
                f"| {sum(r['differing_outputs'] for r in runs)} | "
                f"{sum(r['transfers_completed'] for r in runs)} / {sum(r['transfers_planned'] for r in runs)} "
                f"| {_median([r['median_ttft_rel_error'] for r in runs]):.0%} |")
    return "\n".join(rows) + (f"\n\n`{mean['command']}`, {str(mean['date'])[:10]} "
                              f"(`benchmarks/results/replay_ttft_mean.json`, `replay_ttft_p99.json`).")


def _split_main(readme: str) -> tuple[str, str, str]:
    start, end = readme.find(MAIN_BEGIN), readme.find(MAIN_END)
    if start < 0 or end < 0 or end < start:
        raise ValueError(f"README needs the markers {MAIN_BEGIN} and {MAIN_END}, in that order")
    return readme[:start + len(MAIN_BEGIN)], readme[start + len(MAIN_BEGIN):end], readme[end:]


def render_main(readme: str, docs: Sequence[Mapping[str, Any]]) -> str:
    head, _, tail = _split_main(readme)
    return f"{head}\n{render_main_table(docs)}\n{tail}"


def main_differences(readme: str, docs: Sequence[Mapping[str, Any]]) -> list[str]:
    """What the top-level README's main figures get wrong against the results files."""
    if MAIN_BEGIN not in readme and MAIN_END not in readme:
        return []  # a README without the block (the real one has it: its test says so)
    try:
        _, block, _ = _split_main(readme)
    except ValueError as e:
        return [str(e)]
    by = _by_name(docs)
    if "replay_ttft_mean" not in by or "replay_ttft_p99" not in by:
        return ["the main command's figures need replay_ttft_mean.json and replay_ttft_p99.json"]
    return [] if block.strip() == render_main_table(docs).strip() else [
        "the main command's figures differ from replay_ttft_mean.json / replay_ttft_p99.json"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.render_readme", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 naming each row that differs")
    ap.add_argument("--readme", type=Path, default=README)
    ap.add_argument("--results", type=Path, default=RESULTS_DIR)
    ap.add_argument("--top-readme", type=Path, default=TOP_README)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    readme = args.readme.read_text(encoding="utf-8")
    docs = load_results(args.results)
    top = args.top_readme.read_text(encoding="utf-8")
    if args.check:
        problems = [f"{args.readme}: {p}" for p in differences(readme, docs)]
        problems += [f"{args.top_readme}: {p}" for p in main_differences(top, docs)]
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("run: python -m benchmarks.render_readme", file=sys.stderr)
        return 1 if problems else 0
    out = render(readme, docs)
    if out != readme:
        args.readme.write_text(out, encoding="utf-8")
        print(f"wrote {args.readme} ({len(docs)} figures)")
    out = render_main(top, docs) if MAIN_BEGIN in top else top
    if out != top:
        args.top_readme.write_text(out, encoding="utf-8")
        print(f"wrote {args.top_readme} (the main command's figures)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
