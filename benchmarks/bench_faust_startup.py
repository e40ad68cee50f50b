"""Faust start-up: process start -> first event consumed by an agent, before and after tuning.

For each broker kind (Tansu, Apache Kafka) it starts the broker once, warms it up (one consumer
group join, so that Kafka's ``__consumer_offsets`` exists before the first timed run), then for
each run and each mode (``default``: Faust's defaults; ``tuned``: ``streams.faust_app``):

1. creates a fresh topic (``tuning.TOPIC_PARTITIONS`` partitions) and produces one event to it;
2. starts ``benchmarks/_faust_probe_app.py`` (a Faust worker with one agent on that topic, its own
   consumer group) in a subprocess, noting the wall clock just before the fork;
3. waits for the agent's ``event`` milestone and records its time since the fork (also the
   milestones on the way: interpreter up, Faust imported, partitions assigned);
4. stops the worker (SIGTERM to its process group).

Modes alternate within a run so machine noise hits both alike. It prints a table, the medians and
the before/after ratios, and writes ``benchmarks/results/faust_time_to_first_event.json``
(value: tuned median on Apache Kafka; baseline: Faust defaults on Apache Kafka).

    python -m benchmarks.bench_faust_startup            # 3 runs per mode and broker (~2.5 min)
    python -m benchmarks.bench_faust_startup --runs 5 --brokers tansu,kafka3s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
_REPO = _HERE.parent
if str(_REPO) not in sys.path:  # also runnable as a script
    sys.path.insert(0, str(_REPO))

from nexuskv.config import BrokerUrl  # noqa: E402
from nexuskv.contracts.dead_letter import DeadLetter  # noqa: E402
from nexuskv.contracts.topics import Topic  # noqa: E402
from streams.bus import tuning  # noqa: E402
from streams.bus.broker import ApacheKafkaBroker, TansuBroker  # noqa: E402
from streams.bus.clients import make_consumer, make_producer  # noqa: E402
from streams.bus.process import ManagedProcess, free_port  # noqa: E402
from streams.bus.topics import ensure_topics  # noqa: E402

from benchmarks._result import Run, write_result  # noqa: E402


class KafkaWithJoinDelay(ApacheKafkaBroker):
    """Apache Kafka with the broker's own default ``group.initial.rebalance.delay.ms`` (3 s).

    The test broker sets it to 0; production brokers usually keep 3 s, which every new group's
    first join waits and no client setting can shorten. Optional kind ``kafka3s``.
    """

    name = "apache-kafka-3s"

    def _prepare(self) -> None:
        super()._prepare()
        props = self._props.read_text()
        self._props.write_text(props.replace("group.initial.rebalance.delay.ms=0",
                                             "group.initial.rebalance.delay.ms=3000"))


NAME = "faust_time_to_first_event"
PROBE = _HERE / "_faust_probe_app.py"
BROKERS = {"tansu": TansuBroker, "kafka": ApacheKafkaBroker, "kafka3s": KafkaWithJoinDelay}
BROKER_LABEL = {"tansu": "Tansu 0.6 (memory)", "kafka": "Apache Kafka 4.2 (KRaft, test config: no initial join delay)",
                "kafka3s": "Apache Kafka 4.2 (KRaft, group.initial.rebalance.delay.ms=3000, the broker default)"}
# mode -> (probe mode, extra Faust settings)
MODES: dict[str, tuple[str, dict[str, Any]]] = {
    "default": ("default", {}),
    "tuned": ("tuned", {}),
}
DEFAULT_MODES = "default,tuned"
PHASES = ("python", "imported", "assigned", "event")


def probe_topic(name: str) -> Topic:
    return Topic(name, "none", DeadLetter, "json", "faust start-up probe")


async def prepare_topic(url: BrokerUrl, name: str, *, produce: bool = True) -> None:
    """Create ``name`` and (optionally) put one event on it."""
    topic = probe_topic(name)
    await ensure_topics(url, partitions=tuning.TOPIC_PARTITIONS, topics=(topic,))
    if not produce:
        return
    producer = make_producer(url, client_id="faust-probe-producer")
    await producer.start()
    try:
        await producer.send_and_wait(name, b"first-event", key=b"k")
    finally:
        await producer.stop()


async def warm_up(url: BrokerUrl) -> float:
    """One group join on a throw-away topic; returns its seconds."""
    name = f"faust-warmup-{uuid.uuid4().hex[:8]}"
    await prepare_topic(url, name)
    start = time.monotonic()
    consumer = make_consumer(url, probe_topic(name), client_id="faust-warmup", group_id=f"warmup-{name}")
    await consumer.start()
    try:
        await consumer.getone()
    finally:
        await consumer.stop()
    return time.monotonic() - start


def read_marks(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    complete = text.split("\n")[:-1]  # a line still being written has no newline yet
    return [json.loads(line) for line in complete if line.strip()]


def start_probe(url: BrokerUrl, *, mode: str, topic: str, app_id: str, work: Path,
                overrides: dict[str, Any] | None = None, tag: str = "") -> tuple[ManagedProcess, Path]:
    """Start a probe worker; returns the process and its milestones file."""
    out = work / f"{app_id}{tag}.marks"
    env = dict(os.environ)
    env.update(
        PROBE_BROKER=url.url, PROBE_TOPIC=topic, PROBE_APP=app_id, PROBE_MODE=mode, PROBE_OUT=str(out),
        PROBE_DATADIR=str(work / f"{app_id}{tag}-data"), PROBE_WEB_PORT=str(free_port()),
        PROBE_OVERRIDES=json.dumps(overrides or {}),
        PYTHONPATH=os.pathsep.join(p for p in (str(_REPO), env.get("PYTHONPATH", "")) if p),
    )
    proc = ManagedProcess([sys.executable, str(PROBE)], name=f"faust-{app_id}{tag}",
                          log_path=work / f"{app_id}{tag}.log", env=env, cwd=work)
    proc.start()
    return proc, out


def measure_once(url: BrokerUrl, *, kind: str, mode: str, run: int, work: Path, timeout_s: float) -> dict[str, Any]:
    """One fresh topic, one event, one worker; seconds from fork to each milestone."""
    app_id = f"probe-{kind}-{mode}-{run}-{uuid.uuid4().hex[:6]}"
    asyncio.run(prepare_topic(url, app_id))
    t0 = time.time()
    probe_mode, overrides = MODES[mode]
    proc, marks_path = start_probe(url, mode=probe_mode, topic=app_id, app_id=app_id, work=work, overrides=overrides)
    result: dict[str, Any] = {"broker": kind, "mode": mode, "run": run, "app": app_id}
    error = f"no event within {timeout_s:.0f}s"
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            marks = read_marks(marks_path)
            if any(m["phase"] == "event" for m in marks):
                break
            if not proc.alive():
                error = "the worker exited before its first event"
                break
            time.sleep(0.02)
        marks = read_marks(marks_path)
        for phase in PHASES:
            times = [m["t"] for m in marks if m["phase"] == phase]
            result[phase] = round(min(times) - t0, 3) if times else None
        result["assignments"] = sum(1 for m in marks if m["phase"] == "assigned")
    finally:
        stop_start = time.monotonic()
        proc.stop()
        result["stop_s"] = round(time.monotonic() - stop_start, 2)
    if result["event"] is None:
        result["error"] = error
        print(f"  ! {kind}/{mode} run {run}: {error}; log tail:\n{proc.log_tail(15)}", file=sys.stderr)
    return result


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def run_benchmark(kinds: list[str], modes: list[str], runs: int, timeout_s: float) -> dict[str, Any]:
    all_runs: list[dict[str, Any]] = []
    brokers: dict[str, Any] = {}
    for kind in kinds:
        with tempfile.TemporaryDirectory(prefix="nexuskv-faust-bench-") as tmp, BROKERS[kind]() as broker:
            work = Path(tmp)
            warm = asyncio.run(warm_up(broker.url))
            brokers[kind] = {"label": BROKER_LABEL[kind], "broker_startup_s": round(broker.startup_s or 0, 2),
                             "warmup_group_join_s": round(warm, 2)}
            print(f"{kind}: broker up in {broker.startup_s:.1f}s, warm-up group join {warm:.2f}s", flush=True)
            for run in range(runs):
                for mode in modes:
                    r = measure_once(broker.url, kind=kind, mode=mode, run=run, work=work, timeout_s=timeout_s)
                    all_runs.append(r)
                    print(f"  {kind:7} {mode:18} run {run}: " + "  ".join(
                        f"{p}={r[p]:.2f}s" if r[p] is not None else f"{p}=-" for p in PHASES), flush=True)
    medians: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        medians[kind] = {}
        for mode in modes:
            rs = [r for r in all_runs if r["broker"] == kind and r["mode"] == mode]
            medians[kind][mode] = {p: median([r[p] for r in rs if r[p] is not None]) for p in PHASES}
            medians[kind][mode]["failures"] = sum(1 for r in rs if r["event"] is None)
    return {"brokers": brokers, "medians": medians, "runs": all_runs}


def print_table(report: dict[str, Any], modes: list[str]) -> None:
    med = report["medians"]
    print()
    print(f"{'broker':8} {'settings':18} {'python':>7} {'imported':>9} {'assigned':>9} {'first event':>12}  failures")
    for kind, by_mode in med.items():
        for mode in modes:
            m = by_mode[mode]
            cells = [f"{m[p]:.2f}" if m[p] is not None else "-" for p in PHASES]
            print(f"{kind:8} {mode:18} {cells[0]:>7} {cells[1]:>9} {cells[2]:>9} {cells[3]:>12}  {m['failures']}")
    print("(seconds from worker process start; medians)")
    for kind, by_mode in med.items():
        if "default" in by_mode and "tuned" in by_mode:
            before, after = by_mode["default"]["event"], by_mode["tuned"]["event"]
            if before and after:
                print(f"{kind}: tuned/default = {after:.2f}/{before:.2f} = {after / before:.3f} "
                      f"({before / after:.1f}x faster)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_faust_startup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", "--runs", dest="runs", type=int, default=3,
                        help="repeats per broker, each starting a worker in every mode in turn; the results file "
                             "holds each Apache Kafka repeat as a run of tuned against defaults (default 3)")
    parser.add_argument("--brokers", default="tansu,kafka",
                        help="comma-separated: tansu, kafka, kafka3s (Kafka with its default 3 s initial join delay)")
    parser.add_argument("--modes", default=DEFAULT_MODES,
                        help=f"comma-separated, of {','.join(MODES)} (default {DEFAULT_MODES})")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for the first event")
    parser.add_argument("--no-write", action="store_true", help="do not write the result file")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    kinds = [k.strip() for k in args.brokers.split(",") if k.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [k for k in kinds if k not in BROKERS] + [m for m in modes if m not in MODES]
    if unknown or args.runs < 1:
        parser.error(f"unknown broker(s) or mode(s) {unknown}" if unknown else "--runs must be >= 1")
    started = time.monotonic()
    report = run_benchmark(kinds, modes, args.runs, args.timeout)
    print_table(report, modes)
    print(f"total {time.monotonic() - started:.0f}s")
    if args.no_write:
        return 0
    if "kafka" not in report["medians"] or not {"default", "tuned"} <= set(modes):
        print("not writing the result file: it reports both modes on Apache Kafka")
        return 0
    kafka = report["medians"]["kafka"]
    if kafka["tuned"]["event"] is None or kafka["default"]["event"] is None:
        print("not writing the result file: a mode never got its first event", file=sys.stderr)
        return 1
    command = f"python -m benchmarks.bench_faust_startup --runs {args.runs} --brokers {args.brokers}" + (
        f" --modes {args.modes}" if args.modes != DEFAULT_MODES else "")
    kafka_runs = {(r["mode"], r["run"]): r.get("event") for r in report["runs"] if r["broker"] == "kafka"}
    runs = [Run(kafka_runs[("tuned", i)], kafka_runs[("default", i)]) for i in range(args.runs)
            if kafka_runs.get(("tuned", i)) is not None and kafka_runs.get(("default", i)) is not None]
    details = {
        "runs_per_mode": args.runs,
        "topic_partitions": tuning.TOPIC_PARTITIONS,
        "tuned_settings": dict(tuning.FAUST),
        "modes": {"default": "faust-streaming defaults (broker, raw values, data folder and a free web port set)",
                  "tuned": "streams.faust_app.make_faust_app (streams.bus.tuning.FAUST)"},
        "brokers": report["brokers"],
        "medians_s": report["medians"],
        "runs": report["runs"],
        "load_average": os.getloadavg(),
        "note": "seconds from worker process start (fork) to each milestone: python = interpreter up, "
                "imported = faust imported, assigned = first partition assignment, event = first event in "
                "the agent. One event was produced before the worker started. Apache Kafka runs with "
                "group.initial.rebalance.delay.ms=0 (the test broker's config).",
    }
    path = write_result(NAME, "Faust worker start-up: process start to first event consumed by an agent, Apache Kafka, median", "s", runs, "faust-streaming 0.15.3 defaults", command, details)
    print(f"wrote {path.relative_to(_REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
