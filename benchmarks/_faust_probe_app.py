"""A tiny Faust worker that records when it gets going; run by ``bench_faust_startup.py``.

Run as a script (``python benchmarks/_faust_probe_app.py``), configured by the environment:

* ``PROBE_BROKER`` — ``kafka://host:port``;
* ``PROBE_TOPIC`` — the topic its one agent consumes (created beforehand);
* ``PROBE_APP`` — the app id (consumer group);
* ``PROBE_MODE`` — ``tuned`` (built by :func:`streams.faust_app.make_faust_app`) or ``default``
  (Faust's defaults; only the broker, the raw value serializer, the data folder and a free web
  port are set);
* ``PROBE_OUT`` — a file to which it appends one JSON line per milestone, ``{"phase", "t"}`` with
  ``t`` the wall clock (``time.time()``): ``python`` (interpreter up, before importing Faust),
  ``imported``, ``assigned`` (each partition assignment: ``n`` partitions of the probe topic),
  ``event`` (each event the agent receives, with its ``value``), ``unblocked`` (see below);
* ``PROBE_DATADIR`` — Faust's data folder;
* ``PROBE_WEB_PORT`` — the web port in ``default`` mode (Faust's web server is on by default);
* ``PROBE_OVERRIDES`` — optional JSON object of extra Faust settings (to try variants);
* ``PROBE_BLOCK_S`` — when set, the agent spins the CPU that many seconds on its first event,
  blocking its event loop as CPU-bound agent code would (to check that a busy worker is not
  thrown out of its group);
* ``PROBE_TABLE`` — when ``1``, the agent also counts events in a changelog-backed Table, so that
  start-up includes table recovery;
* ``PROBE_LOGLEVEL`` — the worker's log level (``INFO``; the log goes to stdout).

It never exits by itself; stop it with SIGTERM.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def mark(phase: str, **extra: object) -> None:
    record = {"phase": phase, "t": time.time(), "pid": os.getpid(), **extra}
    with open(os.environ["PROBE_OUT"], "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


mark("python")

import faust  # noqa: E402

from nexuskv.config import parse_broker_url  # noqa: E402
from streams.faust_app import faust_broker, make_faust_app  # noqa: E402

mark("imported")


def build_app() -> faust.App:
    env = os.environ
    url = parse_broker_url(env["PROBE_BROKER"])
    name, topic_name, mode = env["PROBE_APP"], env["PROBE_TOPIC"], env.get("PROBE_MODE", "tuned")
    datadir = Path(env["PROBE_DATADIR"]) if env.get("PROBE_DATADIR") else None
    overrides = json.loads(env.get("PROBE_OVERRIDES") or "{}")
    if mode == "tuned":
        app = make_faust_app(name, url, data_dir=datadir, **overrides)
    elif mode == "default":
        kwargs: dict[str, object] = {"value_serializer": "raw"}
        if datadir:
            kwargs["datadir"] = str(datadir)
        if env.get("PROBE_WEB_PORT"):
            kwargs["web_port"] = int(env["PROBE_WEB_PORT"])
        kwargs.update(overrides)
        app = faust.App(name, broker=faust_broker(url), **kwargs)
    else:
        raise SystemExit(f"unknown PROBE_MODE {mode!r}")

    topic = app.topic(topic_name, value_type=bytes)
    counts = app.Table("counts", default=int) if env.get("PROBE_TABLE") == "1" else None

    block_s = float(env.get("PROBE_BLOCK_S") or 0)

    @app.agent(topic)
    async def probe(stream):  # type: ignore[no-untyped-def]
        nonlocal block_s
        async for event in stream.events():
            value = event.value
            mark("event", value=value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value))
            if block_s:
                until = time.monotonic() + block_s
                while time.monotonic() < until:  # deliberately blocks the event loop, holding the GIL
                    pass
                mark("unblocked", seconds=block_s)
                block_s = 0
            if counts is not None:  # table keys are JSON-encoded: str, not bytes
                key = event.key
                counts[key.decode() if isinstance(key, bytes) else str(key)] += 1

    @app.on_partitions_assigned.connect
    async def on_assigned(sender, assigned, **kwargs):  # type: ignore[no-untyped-def]
        mark("assigned", n=sum(1 for tp in assigned if tp.topic == topic_name))

    return app


def main() -> None:
    app = build_app()
    level = os.environ.get("PROBE_LOGLEVEL", "INFO")
    faust.Worker(app, loglevel=level, quiet=True).execute_from_commandline()


if __name__ == "__main__":
    sys.exit(main())
