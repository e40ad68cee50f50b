"""Decision-store ingestion: rows per second into a file-backed DuckDB, three ways, same run.

All three write the same decision rows (34 columns, as :func:`analytics.store.decision_row` makes
them) into a fresh file-backed table with its primary key, in batches of ``--batch`` rows:

* NexusKV: ``DecisionStore.write`` — an Arrow batch, ``INSERT OR IGNORE ... SELECT`` (idempotent
  on the primary key, which the at-least-once sink needs);
* appender: DuckDB 2.0's Python ``Appender.append_rows`` (fast, but a re-delivered row fails the
  whole batch on the key instead of being ignored);
* baseline: ``executemany(INSERT ...)`` in one transaction per batch.

Writes ``benchmarks/results/sink_rows_per_s.json`` (ours against executemany).
Run: ``python -m benchmarks.bench_sink [--rows 20000] [--batch 2000] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import duckdb

from analytics.schema import TABLES
from analytics.store import COLUMNS, DecisionStore, decision_row
from nexuskv.contracts.decisions import Action

from benchmarks._result import Run, write_result
from tests.analytics.test_store import decision


def _rows(n: int) -> list[dict]:
    base = [decision(i, Action.TRANSFER if i % 2 else Action.RECOMPUTE, reused=256, eg=0.1) for i in range(50)]
    rows = []
    for i in range(n):
        row = decision_row(base[i % 50])
        row["request_id"] = f"r{i}"
        rows.append(row)
    return rows


def _ours(path: Path, rows: list[dict], batch: int) -> float:
    store = DecisionStore(path)
    start = time.perf_counter()
    for i in range(0, len(rows), batch):
        store.write("decisions", rows[i:i + batch])
    elapsed = time.perf_counter() - start
    store.close()
    return len(rows) / elapsed


def _plain(path: Path, rows: list[dict], batch: int, how: str) -> float:
    con = duckdb.connect(str(path))
    con.execute(TABLES["decisions"])
    cols = COLUMNS["decisions"]
    tuples = [tuple(r[c] for c in cols) for r in rows]
    start = time.perf_counter()
    for i in range(0, len(tuples), batch):
        chunk = tuples[i:i + batch]
        if how == "appender":
            appender = con.appender("decisions")
            appender.append_rows(chunk)
            appender.flush()
        else:
            con.execute("BEGIN")
            con.executemany(f"INSERT INTO decisions VALUES ({', '.join('?' * len(cols))})", chunk)
            con.execute("COMMIT")
    elapsed = time.perf_counter() - start
    con.close()
    return len(rows) / elapsed


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_sink", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20000, help="decision rows per repeat (default 20000)")
    ap.add_argument("--batch", type=int, default=2000, help="rows per insert batch (default 2000)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="repeats, each writing with every method into fresh files; one run each (default 3)")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    rows = _rows(args.rows)
    runs: dict[str, list[float]] = {"arrow": [], "appender": [], "executemany": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            runs["arrow"].append(_ours(Path(tmp) / f"a{r}.duckdb", rows, args.batch))
            runs["appender"].append(_plain(Path(tmp) / f"p{r}.duckdb", rows, args.batch, "appender"))
            small = rows[: max(args.batch, len(rows) // 10)]  # executemany is ~100x slower: a tenth suffices
            runs["executemany"].append(_plain(Path(tmp) / f"e{r}.duckdb", small, args.batch, "executemany"))
    med = {k: statistics.median(v) for k, v in runs.items()}
    for k, v in med.items():
        print(f"{k:<28}{v:>14,.0f} rows/s")
    print(f"ratio (arrow INSERT OR IGNORE / executemany): {med['arrow'] / med['executemany']:.1f}")
    print(f"ratio (arrow INSERT OR IGNORE / appender):    {med['arrow'] / med['appender']:.2f}")
    path = write_result("sink_rows_per_s", "decision rows per second into a file-backed DuckDB with its key", "rows/s", [Run(a, e) for a, e in zip(runs["arrow"], runs["executemany"])], "executemany in one transaction per batch", f"python -m benchmarks.bench_sink --rows {args.rows} --batch {args.batch} "
                        f"--repeats {args.repeats}", details={"runs": runs, "appender_median": med["appender"], "batch": args.batch,
                                                            "load_average": os.getloadavg()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
