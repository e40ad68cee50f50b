"""The NexusKV run of a replay: the baseline's engines plus NexusKV, on one bus.

What runs, all started here and stopped at the end:

* the bus — ``NEXUSKV_BROKER``, or an embedded broker — and NexusKV's topics;
* the index worker, the node's index sidecar (the engines' connectors ask it), calibration agent
  and planner service, as ``nexuskv up`` starts them (their
  logs under ``<out>/nexuskv/logs``), and the decision sink in this process, writing into the
  replay's decision store;
* with ``save_tier`` remote (the skewed shape's default), the shared remote tier: the
  deployment's (``NEXUSKV_REMOTE_TIER``) or a Mooncake Store started for the run
  (``remote_tier_bytes``; its logs beside the services'), which every engine's connector reads;
* per engine: vLLM with NexusKV's KV connector (the README's ``--kv-transfer-config``: saves to
  the worker's disk tier, or to the shared remote tier, and loads what the planner decides) and vLLM's ZMQ KV-event publisher, and
  ``python -m streams.bridge`` forwarding those events to ``nexuskv.kv-events``;
* routing: each request's canonical keys and the engines' queues go to the planner as a plan
  request; the request goes where the decision says (:class:`~streams.app.replay.routing.PlannerRouter`).
* tracing, with ``config.trace_to``: the services export to it (``NEXUSKV_OTLP_ENDPOINT``), the
  engines too (``--otlp-traces-endpoint``), and the router's spans are this process's
  (:mod:`~streams.app.replay.tracing`).

The model's State Descriptor comes from its ``config.json`` (:func:`nexuskv.hf_config.descriptor_from_hf_config`,
what ``nexuskv descriptor`` writes for the bridges and what the connector derives inside vLLM), so
the engines, the bridges and the router key blocks in one scope. Calibration publishes a fitted
entry after ``MIN_OBSERVATIONS`` prefills (the warm-up), so the planner prices this machine's
engines from measurements, not from the shipped H200 profiles.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from analytics.store import DecisionStore
from nexuskv.config import Settings
from nexuskv.dataplane.remote_store import parse_store_address
from nexuskv.descriptor import StateDescriptor
from nexuskv.errors import NexusKVError
from nexuskv.hf_config import descriptor_from_hf_config
from streams.app.replay.engines import CONNECTOR_CLASS, CONNECTOR_MODULE
from streams.app.replay.routing import PlannerRouter
from streams.app.replay.runs import SERVED_NAME, RunResult, RunSetup, serve_stream, start_engines
from streams.app.replay.tracing import ReplayTracing, service_trace_env
from streams.app.replay.workload import Workload
from streams.app.services import SERVICES, start_services
from streams.bus.broker import open_bus
from streams.bus.process import ManagedProcess, free_port
from streams.bus.topics import ensure_topics
from streams.remote_tier import RemoteTierStore, local_address
from streams.sink import DecisionSink

__all__ = ["CPU_PROFILE", "MIN_OBSERVATIONS", "replay_descriptor", "run_nexuskv"]

CPU_PROFILE = "vllm-cpu"  # the hardware profile NexusKV's connector reports on vLLM's CPU platform
MIN_OBSERVATIONS = 6  # prefills before calibration publishes a fit (the warm-up covers them)
LAYOUT = "paged_hn_kvd"  # vLLM's CPU attention backend's block layout
SERVICE_NAMES = ("index-worker", "index-sidecar", "calibration", "planner")
_ROOT = Path(__file__).resolve().parents[3]  # the folder holding the streams and connectors packages


def replay_descriptor(model_dir: Path, *, block_size: int, tenant: str, dtype: str = "auto") -> StateDescriptor:
    """The descriptor the replay's engines, bridges and router share (the connector's default model
    name is vLLM's ``--model``, the folder; its KV dtype vLLM's ``--dtype`` unless auto). The
    connector checks it against the KV cache vLLM allocated and refuses to start on a mismatch."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    return descriptor_from_hf_config(config, model=str(model_dir), block_size=block_size, tenant=tenant,
                                     engine_family="vllm", layout=LAYOUT,
                                     kv_dtype=None if dtype == "auto" else dtype)


class _Bridge:
    def __init__(self, i: int, pub: int, replay: int, descriptor_file: Path, tenant: str, block_size: int,
                 env: dict[str, str], log_dir: Path) -> None:
        self.log = log_dir / f"bridge{i}.log"
        self.proc = ManagedProcess(
            [sys.executable, "-m", "streams.bridge", "--engine", "vllm", "--endpoint", f"tcp://127.0.0.1:{pub}",
             "--replay-endpoint", f"tcp://127.0.0.1:{replay}", "--descriptor", str(descriptor_file),
             "--tenant", tenant, "--block-size", str(block_size),
             "--state-file", str(log_dir.parent / f"bridge{i}-state.json")],
            name=f"bridge{i}", log_path=self.log, env=env)

    def start(self) -> None:
        self.proc.start()

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.proc.alive():
                raise NexusKVError(f"the KV-event bridge exited at start; log tail:\n{self.proc.log_tail(30)}")
            if self.log.exists() and "bridge ready" in self.log.read_text(errors="replace"):
                return
            time.sleep(0.2)
        raise NexusKVError(f"the KV-event bridge was not ready in {timeout_s:.0f}s; log tail:\n{self.proc.log_tail(30)}")


async def _serve_with_sink(url, store: DecisionStore, workload: Workload, engines, router: PlannerRouter,
                           progress, served_name: str, tracing: ReplayTracing,
                           baseline_ttft: dict[str, float], engine_reports: bool = False) -> RunResult:
    stop = asyncio.Event()
    sink = DecisionSink(url, store, group_id=f"{router.prefix}-sink", flush_interval_s=0.25)
    sink_task = asyncio.create_task(sink.run(stop))
    try:
        result = await serve_stream(workload, engines, served_name, router, name="nexuskv", progress=progress,
                                    tracing=tracing, baseline_ttft=baseline_ttft,
                                    engine_reports=engine_reports)
        expected = {f"{router.prefix}/{r.request_id}" for r in workload.requests}
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:  # the records of every request are stored before anything stops
            sql = f"SELECT count(DISTINCT request_id) FROM decisions WHERE request_id LIKE '{router.prefix}/%'"
            stored = (await asyncio.to_thread(store.query, sql))[0][0]
            if stored >= len(expected) or sink_task.done():
                break
            await asyncio.sleep(0.25)
        await asyncio.sleep(1.0)  # the connectors' last observations and decisions
        return result
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(sink_task, 30)


def run_nexuskv(config, workload: Workload, model_dir: Path, settings: Settings, store: DecisionStore, replay_id: str,
                progress, *, tracing: ReplayTracing | None = None,
                baseline_ttft: dict[str, float] | None = None) -> tuple[RunResult, list[str]]:
    tracing = tracing or ReplayTracing.start(None)
    root = config.out / "nexuskv"
    data_dir, log_dir = root / "data", root / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    descriptor = replay_descriptor(model_dir, block_size=config.block_size, tenant=config.tenant,
                                   dtype=config.engine_dtype)
    descriptor_file = root / "descriptor.json"
    descriptor_file.write_text(descriptor.model_dump_json(indent=2) + "\n", encoding="utf-8")
    ports = [free_port() for _ in range(config.workers)]
    events = [(free_port(), free_port()) for _ in range(config.workers)]
    workers = [f"vllm/127.0.0.1:{p}/dp0" for p in ports]
    local = settings.model_copy(update={"data_dir": root})
    # The engines' connectors ask the node's index sidecar over a Unix socket (a path of at most
    # 107 bytes: a short folder of its own, whatever the replay's folder is called).
    run_dir = Path(tempfile.mkdtemp(prefix="nexuskv-replay-", dir="/tmp"))
    socket = run_dir / "index.sock"
    service_env = {"NEXUSKV_DATA_DIR": str(data_dir), "NEXUSKV_CALIBRATION_MIN_OBSERVATIONS": str(MIN_OBSERVATIONS),
                   "NEXUSKV_CALIBRATION_PUBLISH": "0.5", "NEXUSKV_INDEX_SOCKET": str(socket),
                   **service_trace_env(config.trace_to)}
    with contextlib.ExitStack() as stack:
        remote = settings.remote_tier
        if config.save_tier == "remote" and not remote:
            remote = local_address()
            store_ = RemoteTierStore(parse_store_address(remote), config.remote_tier_bytes, log_dir=log_dir)
            stack.callback(store_.stop)
            store_.start(60.0)
        if remote:
            service_env["NEXUSKV_REMOTE_TIER"] = remote
        url = stack.enter_context(open_bus(settings.broker, start_timeout_s=settings.broker_start_timeout_s))
        asyncio.run(ensure_topics(url, partitions=settings.topic_partitions, replication=settings.topic_replication))
        engine_env = {"NEXUSKV_BROKER": str(url), "NEXUSKV_DATA_DIR": str(data_dir),
                      "NEXUSKV_INDEX_SOCKET": str(socket), **({"NEXUSKV_REMOTE_TIER": remote} if remote else {}),
                      # vLLM imports the connector by module name: the same NexusKV as this process.
                      "PYTHONPATH": os.pathsep.join(p for p in (str(_ROOT), os.environ.get("PYTHONPATH")) if p)}

        def connector(i: int, worker: str) -> dict:
            return {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                    # The bridges' descriptor file: engines, bridges and the router key blocks in
                    # one scope by construction (the connector checks it against vLLM's KV cache).
                    "kv_connector_extra_config": {"worker": worker, "tenant": config.tenant,
                                                  "descriptor": str(descriptor_file),
                                                  "save_tier": config.save_tier, "profile": CPU_PROFILE}}

        def kv_events(i: int, worker: str) -> dict:
            pub, replay = events[i]
            return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                    "replay_endpoint": f"tcp://*:{replay}", "topic": f"kv@127.0.0.1:{ports[i]}@{model_dir}"}

        setup = RunSetup("nexuskv", model_dir, SERVED_NAME, config.workers, config.block_size,
                         config.engine_blocks, config.max_model_len, log_dir, dtype=config.engine_dtype,
                         kv_transfer_config=connector,
                         kv_events_config=kv_events, engine_env=engine_env, trace_to=config.trace_to)
        services = tuple(s for s in SERVICES if s.name in SERVICE_NAMES)
        with start_services(url, local, services=services, env=service_env):
            bridge_env = dict(os.environ, **engine_env)
            bridges = [_Bridge(i, events[i][0], events[i][1], descriptor_file, config.tenant, config.block_size,
                               bridge_env, log_dir) for i in range(config.workers)]
            engines = start_engines(setup, workers, ports, os.cpu_count() or 1)
            try:
                for b in bridges:
                    b.start()
                ready = [e.wait_ready(config.start_timeout_s) for e in engines]
                for b in bridges:
                    b.wait_ready(60.0)
                _wait_for(socket, 60.0, "the index sidecar's socket")
                router = PlannerRouter(url, descriptor, tuple(workers), CPU_PROFILE, prefix=replay_id,
                                       tracer=tracing.tracer, loads_shared_tiers=bool(remote))
                result = asyncio.run(_serve_with_sink(url, store, workload, engines, router, progress,
                                                      SERVED_NAME, tracing, baseline_ttft or {},
                                                      config.engine_reports))
                result.engine_ready_s = ready
            finally:
                for e in engines:
                    e.stop()
                for b in bridges:
                    b.proc.stop()
    shutil.rmtree(run_dir, ignore_errors=True)
    return result, workers


def _wait_for(path: Path, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise NexusKVError(f"replay: {what} ({path}) did not appear in {timeout_s:.0f}s")
        time.sleep(0.2)

