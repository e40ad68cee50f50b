"""``nexuskv`` — the command line. The composition root: it wires settings to the edges.

Commands:

* ``nexuskv up`` — start the bus (``NEXUSKV_BROKER`` or an embedded broker), create the topics,
  start the stream workers, run until SIGINT/SIGTERM, then stop everything it started. If a
  service dies, ``up`` says which (with its log tail), stops the rest and exits with status 1.
* ``nexuskv publisher-key NAME`` — print the signing key of publisher NAME under
  ``NEXUSKV_BUS_SECRET``, for an engine host's ``NEXUSKV_PUBLISHER_KEYS``; ``--control`` prints a
  control producer's key instead (``executor/<worker>``, ``planner/<service>``: placement hints,
  transfer commands and results), for a host that should hold only its own.
* ``nexuskv broker`` — run an embedded broker (Tansu; ``--apache-kafka`` for a local Apache
  Kafka) and print its URL until interrupted.
* ``nexuskv jaeger`` — build Jaeger on first use (Go; cached), run it on loopback with memory
  storage and print the ``NEXUSKV_OTLP_ENDPOINT`` to export to and its query API until interrupted.
* ``nexuskv topics create|list`` — create NexusKV's topics idempotently, or list the broker's.
* ``nexuskv schemas`` — export every wire contract's JSON Schema (to ``infra/schemas/``).
* ``nexuskv replay TRACE`` — a Mooncake trace through vLLM alone, then through vLLM + NexusKV
  (connector, bridges, index, calibration, planner, decision sink), same requests and arrivals;
  both runs into one DuckDB file, then the side-by-side report (``--engine reference``: the same
  replay on NexusKV's reference engine, one NexusKV run, for the attention families vLLM's CPU
  build cannot run).
* ``nexuskv report [DB]`` — print a decision store's key tables and write its PNG plots (default:
  the live store's snapshot, else the latest replay).
* ``nexuskv config`` — print the settings table (environment variable, default, meaning).
* ``nexuskv descriptor CONFIG`` — the State Descriptor of a model from its Hugging Face
  ``config.json`` (what the vLLM connector derives from the same config), for the event bridge's
  ``--descriptor`` and the router.

Errors print one line, ``nexuskv: error: ...``, and exit non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from nexuskv.config import Settings, setting_rows
from nexuskv.errors import ConfigError, NexusKVError
from streams.telemetry import quiet_libraries

__all__ = ["main"]

log = logging.getLogger("nexuskv")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_env()
        logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        quiet_libraries(settings.log_level)
        return int(args.func(args, settings) or 0)
    except ConfigError as exc:
        print(f"nexuskv: error: {exc}", file=sys.stderr)
        return 2
    except NexusKVError as exc:
        print(f"nexuskv: error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nexuskv", description="NexusKV: the Model State Intelligence Layer.")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start the bus, topics and stream workers; stop on SIGINT/SIGTERM")
    up.add_argument("--no-workers", action="store_true", help="start only the bus and topics")
    up.set_defaults(func=_cmd_up)

    pkey = sub.add_parser("publisher-key", help="print a publisher's kv-events signing key (NEXUSKV_BUS_SECRET)")
    pkey.add_argument("publisher", help="the publisher name its batches carry (e.g. vllm/10.0.0.5:8000/dp0)")
    pkey.add_argument("--control", action="store_true",
                      help="a control producer's key (executor/<worker>, planner/<service>) instead")
    pkey.set_defaults(func=_cmd_publisher_key)

    broker = sub.add_parser("broker", help="run an embedded broker and print its URL")
    broker.add_argument("--apache-kafka", action="store_true", help="run Apache Kafka (KRaft) instead of Tansu")
    broker.add_argument("--port", type=int, default=None, help="listen port (default: a free one)")
    broker.set_defaults(func=_cmd_broker)

    jaeger = sub.add_parser("jaeger", help="run a local Jaeger (built with Go on first use) and print its endpoints")
    jaeger.add_argument("--otlp-http-port", type=int, default=None, help="OTLP/HTTP port (default: a free one)")
    jaeger.add_argument("--query-port", type=int, default=None, help="query API and UI port (default: a free one)")
    jaeger.set_defaults(func=_cmd_jaeger)

    topics = sub.add_parser("topics", help="create or list topics")
    topics.add_argument("action", choices=["create", "list"])
    topics.set_defaults(func=_cmd_topics)

    schemas = sub.add_parser("schemas", help="export the wire contracts' JSON Schemas")
    schemas.add_argument("--out", type=Path, default=Path("infra/schemas"))
    schemas.set_defaults(func=_cmd_schemas)

    replay = sub.add_parser("replay", help="a trace through vLLM alone and vLLM + NexusKV, side by side, then report")
    replay.add_argument("trace", type=Path, help="a Mooncake JSONL trace (benchmarks/data has slices)")
    replay.add_argument("--requests", type=int, default=None, metavar="N",
                        help="cap on the requests replayed (default 48 for vLLM, 200 for the reference engine)")
    replay.add_argument("--conversations", type=int, default=0, metavar="N",
                        help="only the first N multi-turn conversations, every turn")
    replay.add_argument("--in-order", action="store_true",
                        help="the trace's first requests as they come, instead of its multi-turn conversations")
    replay.add_argument("--workers", type=int, default=None, help="engines (default 2 vLLM, 4 reference)")
    replay.add_argument("--time-scale", type=float, default=None,
                        help="trace time divided by this (default 6 for vLLM, 10 for the reference engine)")
    replay.add_argument("--warmup", type=int, default=12, help="first requests served but not counted (calibration)")
    replay.add_argument("--model", type=Path, default=None, metavar="DIR",
                        help="a Hugging Face model folder for vLLM to serve (default: a random Llama built locally)")
    replay.add_argument("--model-size", default="replay", choices=["replay", "tiny"],
                        help="the random model's shape when --model is not given")
    replay.add_argument("--dtype", default=None,
                        help="vLLM's --dtype (default: float32 for the random models, auto for --model)")
    replay.add_argument("--engine-blocks", "--gpu-pages", type=int, default=160, dest="engine_blocks",
                        help="each engine's own KV cache (the reference engine's page pool), in blocks of 32 tokens")
    replay.add_argument("--hash-block-tokens", type=int, default=32, help="tokens per 512-token trace block")
    replay.add_argument("--max-prompt-tokens", type=int, default=2048)
    replay.add_argument("--max-output-tokens", type=int, default=8)
    replay.add_argument("--runs", default=None,
                        help="which runs, comma separated, in this order: baseline (vLLM alone), nexuskv, affinity "
                             "(vLLM behind a KV-event prefix- and load-aware router, Dynamo's cost rule), equal-bytes "
                             "(vLLM alone with engine caches as large as NexusKV's tiers) (default: baseline,nexuskv; "
                             "the reference engine: nexuskv)")
    replay.add_argument("--shape", default="default", choices=["default", "skewed"],
                        help="default: the trace's multi-turn conversations at trace time; skewed: a few hot "
                             "conversations behind one shared prefix, openers then a burst (state must move)")
    replay.add_argument("--hot", type=int, default=6, help="skewed shape: hot conversations")
    replay.add_argument("--save-tier", default=None, choices=["disk", "remote"],
                        help="where NexusKV's connectors save (default: disk; the skewed shape: remote, the shared "
                             "tier every engine reads, a Mooncake Store started for the run unless NEXUSKV_REMOTE_TIER)")
    replay.add_argument("--engine-reports", default=None, choices=["on", "off"],
                        help="NexusKV's router adds each engine's own load gauges (vLLM's /metrics, every 0.1 s) "
                             "to the loads it plans with (default: on for the skewed shape, off otherwise)")
    replay.add_argument("--engine", default="vllm", choices=["vllm", "reference"],
                        help="vllm (default), or NexusKV's reference engine for what vLLM's CPU build cannot "
                             "run: --reference-variant mla|hybrid (one run, no baseline)")
    replay.add_argument("--reference-variant", default="gqa", choices=["gqa", "mla", "hybrid"])
    replay.add_argument("--out", type=Path, default=None, help="folder for the DuckDB file, logs and plots")
    replay.add_argument("--no-progress", action="store_true")
    replay.add_argument("--trace-to", default=None, metavar="URL",
                        help="export one OpenTelemetry trace per request of both runs (vLLM's own span included) "
                             "to this OTLP/HTTP base URL, e.g. a `nexuskv jaeger`'s http://127.0.0.1:4318 "
                             "(default: NEXUSKV_OTLP_ENDPOINT; unset: no export)")
    replay.set_defaults(func=_cmd_replay)

    report = sub.add_parser("report", help="print a decision store's key tables and write its plots")
    report.add_argument("db", type=Path, nargs="?", default=None,
                        help="DuckDB file (default: the decision store's snapshot)")
    report.add_argument("--out", type=Path, default=None, help="folder for the PNG plots (default: beside the db)")
    report.set_defaults(func=_cmd_report)

    desc = sub.add_parser("descriptor", help="a model's State Descriptor from its Hugging Face config.json")
    desc.add_argument("config", type=Path, help="the model's config.json, or its folder")
    desc.add_argument("--model", required=True,
                      help="the model's name in the identity scope (what the engine serves: vLLM's --model)")
    desc.add_argument("--block-size", type=int, required=True, help="the engine's block (page) size in tokens")
    desc.add_argument("--revision", default=None, help="model revision (default: main)")
    desc.add_argument("--tokenizer-revision", default=None, help="tokenizer revision (default: the model's)")
    desc.add_argument("--tenant", default="default")
    desc.add_argument("--engine", choices=["vllm", "sglang"], default="vllm")
    desc.add_argument("--kv-dtype", default=None, help="the engine's KV cache dtype when not the model's")
    desc.add_argument("--layout", default="paged_nhd",
                      help="block layout: paged_nhd (vLLM on GPU), paged_hn_kvd (vLLM's CPU build), paged_hnd")
    desc.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size (shards the KV heads)")
    desc.add_argument("--out", type=Path, default=None, help="write the JSON here (default: stdout)")
    desc.set_defaults(func=_cmd_descriptor)

    config = sub.add_parser("config", help="print the settings table")
    config.add_argument("--markdown", action="store_true", help="as the README's markdown table")
    config.set_defaults(func=_cmd_config)
    return p


class _Stop:
    """Turns SIGINT/SIGTERM into an event the main thread waits on."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal: int | None = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        self.signal = signum
        self.event.set()

    def wait(self) -> None:
        while not self.event.wait(0.5):
            pass


def _cmd_broker(args: argparse.Namespace, settings: Settings) -> int:
    from streams.bus.broker import ApacheKafkaBroker, TansuBroker

    stop = _Stop()
    kind = ApacheKafkaBroker if args.apache_kafka else TansuBroker
    broker = kind(port=args.port, start_timeout_s=max(settings.broker_start_timeout_s, 90 if args.apache_kafka else 0))
    with broker:
        print(broker.url, flush=True)
        stop.wait()
    return 0


def _cmd_jaeger(args: argparse.Namespace, settings: Settings) -> int:
    from streams.app.jaeger import JAEGER_VERSION, JaegerPorts, JaegerServer, provision_jaeger

    binary = provision_jaeger()  # before the signal handlers: Ctrl-C stops a first build at once
    stop = _Stop()
    ports = JaegerPorts.free(otlp_http=args.otlp_http_port, query_http=args.query_port)
    with JaegerServer(binary=binary, ports=ports) as jaeger:
        print(f"nexuskv: Jaeger {JAEGER_VERSION} ready (memory storage); Ctrl-C to stop", flush=True)
        print(f"NEXUSKV_OTLP_ENDPOINT={jaeger.otlp_http_url}", flush=True)
        print(f"query API: {jaeger.query_url}/api/traces?service=NAME  (UI: {jaeger.ui_url})", flush=True)
        stop.wait()
    return 0


def _cmd_topics(args: argparse.Namespace, settings: Settings) -> int:
    from streams.bus.broker import open_bus
    from streams.bus.topics import ensure_topics, list_topics

    with open_bus(settings.broker, start_timeout_s=settings.broker_start_timeout_s) as url:
        if args.action == "create":
            states = asyncio.run(ensure_topics(url, partitions=settings.topic_partitions,
                                               replication=settings.topic_replication))
            for s in states:
                print(f"{s.name}\t{s.partitions}\t{'created' if s.created else 'exists'}")
        else:
            for name, parts in asyncio.run(list_topics(url)).items():
                print(f"{name}\t{parts}")
    return 0


def _cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    from streams.app.services import start_services
    from streams.bus.broker import open_bus
    from streams.bus.topics import ensure_topics
    from streams.remote_tier import local_address

    stop = _Stop()
    with open_bus(settings.broker, start_timeout_s=settings.broker_start_timeout_s) as url:
        asyncio.run(ensure_topics(url, partitions=settings.topic_partitions, replication=settings.topic_replication))
        print(f"nexuskv: bus at {url}; topics ready", flush=True)
        # The remote tier's store and the executors that use it must agree on its address.
        remote = settings.remote_tier or local_address()
        with start_services(url, settings, enabled=not args.no_workers, env={"NEXUSKV_REMOTE_TIER": remote}) as running:
            names = ", ".join(s.name for s in running) or "none"
            print(f"nexuskv: stream workers: {names}; Ctrl-C to stop", flush=True)
            while not stop.event.wait(0.5):
                dead = running.dead()
                if dead:
                    for d in dead:
                        print(f"nexuskv: error: {d.describe()}", file=sys.stderr, flush=True)
                    print("nexuskv: stopping the other services", file=sys.stderr, flush=True)
                    return 1
            print("nexuskv: stopping", flush=True)
    return 0


def _cmd_publisher_key(args: argparse.Namespace, settings: Settings) -> int:
    from nexuskv.contracts.control_signature import producer_key
    from nexuskv.contracts.kv_signature import publisher_key

    if not settings.bus_secret:
        raise ConfigError("NEXUSKV_BUS_SECRET", "is empty: set the deployment's bus secret to derive publisher keys")
    derive = producer_key if args.control else publisher_key
    print(f"{args.publisher}={derive(settings.bus_secret_bytes, args.publisher).hex()}")
    return 0


def _cmd_schemas(args: argparse.Namespace, settings: Settings) -> int:
    from nexuskv.schemas import export_schemas

    for path in export_schemas(args.out):
        print(path)
    return 0


def _cmd_replay(args: argparse.Namespace, settings: Settings) -> int:
    from analytics.report import report
    from streams.app.replay import ReplayConfig, WorkloadShape, default_replay_dir, run_replay

    if not args.trace.is_file():
        raise ConfigError("trace", f"no trace file at {args.trace}")
    out = args.out or default_replay_dir(settings)
    out.mkdir(parents=True, exist_ok=True)
    vllm = args.engine == "vllm"
    shape = WorkloadShape(max_requests=args.requests or (48 if vllm else 200), conversations=args.conversations,
                          follow_ups=not args.in_order, hash_block_tokens=args.hash_block_tokens,
                          max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_output_tokens,
                          time_scale=args.time_scale or (6.0 if vllm else 10.0), warmup=args.warmup,
                          hot=args.hot if args.shape == "skewed" else 0)
    runs = tuple(r.strip() for r in (args.runs or "").split(",") if r.strip())
    config = ReplayConfig(trace=args.trace, out=out, shape=shape, engine=args.engine,
                          workers=args.workers or (2 if vllm else 4), model_dir=args.model,
                          model_size=args.model_size, engine_blocks=args.engine_blocks, dtype=args.dtype, runs=runs,
                          trace_to=args.trace_to or (settings.otlp_endpoint if vllm else None),
                          variant=args.reference_variant,
                          save_tier=args.save_tier or ("remote" if args.shape == "skewed" else "disk"),
                          engine_reports=(args.engine_reports or ("on" if args.shape == "skewed" else "off")) == "on")
    outcome = run_replay(config, settings, progress=not args.no_progress)
    if not vllm:
        print(f"nexuskv: {outcome.runs['nexuskv'].describe()}", flush=True)
    tables, plots = report(config.db, out / "report")
    print(tables)
    for path in plots:
        print(f"wrote {path}")
    print(f"decision store: {config.db} (replay {outcome.replay_id}, {outcome.wall_s:.0f} s)")
    return 0


def _latest_replay_db(settings: Settings) -> Path | None:
    root = Path(settings.data_dir) / "replays"
    found = sorted(root.glob("*/decisions.duckdb"), key=lambda p: p.stat().st_mtime) if root.is_dir() else []
    return found[-1] if found else None


def _cmd_report(args: argparse.Namespace, settings: Settings) -> int:
    from analytics.report import report

    db = args.db
    if db is None:  # the live store's snapshot when a deployment writes one, else the latest replay
        live = settings.decision_db or Path(settings.data_dir) / "decisions.duckdb"
        db = live.with_name(live.stem + "-snapshot.duckdb")
        if not db.is_file():
            db = _latest_replay_db(settings) or db
    if not db.is_file():
        raise ConfigError("db", f"no decision store at {db} and no replay under {Path(settings.data_dir) / 'replays'}")
    out = args.out or db.parent / f"{db.stem}-report"
    tables, plots = report(db, out)
    print(tables)
    for path in plots:
        print(f"wrote {path}")
    return 0


def _cmd_descriptor(args: argparse.Namespace, settings: Settings) -> int:
    from nexuskv.hf_config import descriptor_from_hf_config

    path = args.config / "config.json" if args.config.is_dir() else args.config
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError("config", f"{path} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError("config", f"{path} is not a config object")
    d = descriptor_from_hf_config(config, model=args.model, block_size=args.block_size, model_revision=args.revision,
                                  tokenizer_revision=args.tokenizer_revision, tenant=args.tenant,
                                  engine_family=args.engine, kv_dtype=args.kv_dtype, layout=args.layout,
                                  tp_size=args.tp_size)
    text = d.model_dump_json(indent=2)
    if args.out is None:
        print(text)
    else:
        args.out.write_text(text + "\n", encoding="utf-8")
        print(f"{d.descriptor_id} -> {args.out}", file=sys.stderr)
    return 0


def _cmd_config(args: argparse.Namespace, settings: Settings) -> int:
    rows = setting_rows()
    if args.markdown:
        print("| variable | default | meaning |\n|---|---|---|")
        for var, default, doc in rows:
            print(f"| `{var}` | {default} | {doc} |")
    else:
        shown = settings.model_dump(mode="json")
        for secret in ("identity_secret", "index_api_tokens", "bus_secret", "publisher_keys"):
            if shown.get(secret):
                shown[secret] = "***"
        print(json.dumps(shown, indent=2))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
