"""Import time of NexusKV's vLLM connector beyond vLLM's own, in fresh interpreters.

Each run is a fresh ``python`` process that times, in this order:

1. ``import vllm`` — the **baseline**: vLLM's own import, which every vLLM engine process pays;
2. vLLM's own modules the connector's shell imports from vLLM (``KVConnectorBase_V1``'s module,
   ``CacheHitSource``, ``vllm.platforms``): vLLM's code, which a vLLM engine process loads
   whether or not a connector is configured (its scheduler and model runner import the connector
   base) — timed apart (``details.vllm_connector_api_s``), not counted as ours;
3. what vLLM's connector factory then loads for ``NexusKVConnector`` in an engine process —
   ``connectors.vllm.connector``, its ``NexusKVConnector`` attribute (the vLLM shell), and
   :mod:`connectors.vllm.wiring` (the index client, the bus thread, the worker side, the data
   plane), which the shell imports when vLLM builds it — the **figure** ("ours").

It also lists the modules of the contract's forbidden set (Faust, mode, DuckDB, the OpenTelemetry
SDK, the decision store, the services' composition root) and the service modules of ``streams``
(anything but ``streams.bus``) found loaded after 3 — the goal is none — and the top-level
packages that 3 added. Each run is a new process, the same order; the machine's load average is
in ``details``.

Writes ``benchmarks/results/vllm_connector_import_s.json``.
Run: ``python -m benchmarks.bench_connector_import [--runs 5]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("faust", "mode", "duckdb", "opentelemetry.sdk", "analytics", "streams.app")

PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
import vllm  # noqa: F401
t1 = time.perf_counter()
import vllm.distributed.kv_transfer.kv_connector.v1.base, vllm.v1.metrics.cache_hit_source, vllm.platforms  # noqa
t1b = time.perf_counter()
before = set(sys.modules)
import connectors.vllm.connector as c
c.NexusKVConnector
import connectors.vllm.wiring  # noqa: F401
t2 = time.perf_counter()
added = sorted(set(sys.modules) - before)
forbidden = %r
print(json.dumps({"vllm_s": t1 - t0, "vllm_api_s": t1b - t1, "ours_s": t2 - t1b,
                  "forbidden": [m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in forbidden)],
                  "services": [m for m in sys.modules if m.startswith("streams.") and not m.startswith("streams.bus")],
                  "top_level_added": sorted({m.split(".")[0] for m in added}),
                  "modules_added": len(added)}))
""" % (FORBIDDEN,)


def one_run() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               VLLM_NO_USAGE_STATS="1", VLLM_LOGGING_LEVEL="ERROR")
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"the probe failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    from benchmarks._result import Run, write_result

    load = os.getloadavg()
    print(f"{args.runs} fresh interpreters; load {load[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'run':>4}{'import vllm s':>15}{'vLLM API s':>12}{'connector s':>13}{'ratio':>8}  forbidden / services loaded")
    results = []
    for i in range(args.runs):
        r = one_run()
        results.append(r)
        print(f"{i:>4}{r['vllm_s']:>15.2f}{r['vllm_api_s']:>12.2f}{r['ours_s']:>13.2f}{r['ours_s'] / r['vllm_s']:>8.3f}  "
              f"{r['forbidden'] or 'none'} / {r['services'] or 'none'}", flush=True)
    runs = [Run(r["ours_s"], r["vllm_s"]) for r in results]
    ours = sorted(r.value for r in runs)[len(runs) // 2]
    print(f"median: connector {ours:.2f} s beyond vLLM's own import")
    if args.no_write:
        return 0
    path = write_result(
        "vllm_connector_import_s", "import time of the vLLM connector as an engine process loads it (connector, "
        "shell, wiring), beyond vLLM's own modules, fresh interpreter", "s", runs, "import vllm alone, same process",
        f"python -m benchmarks.bench_connector_import --runs {args.runs}",
        details={"vllm_connector_api_s": [r["vllm_api_s"] for r in results],
                 "forbidden_loaded": sorted({m for r in results for m in r["forbidden"]}),
                 "service_modules_loaded": sorted({m for r in results for m in r["services"]}),
                 "top_level_packages_added": results[-1]["top_level_added"],
                 "modules_added": results[-1]["modules_added"], "loadavg_at_start": load, "cores": os.cpu_count(),
                 "forbidden_set": FORBIDDEN, "goal": "no forbidden module; at most 1 s beyond vLLM's own import",
                 "note": "shared 2-core machine, other engineers' jobs running"})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
