"""The replay's run on NexusKV's reference engine (``nexuskv replay TRACE --engine reference``).

The engine for the attention families vLLM's CPU build cannot run (``--reference-variant mla`` or
``hybrid``, recurrent checkpoints); one run, ``nexuskv``, no baseline (the vLLM replay is the
measurement of what NexusKV is for). The request stream is the replay's own
(:mod:`~streams.app.replay.workload`: the same selection, the same trace-to-token function, the
same arrivals), its tokens drawn below the reference model's vocabulary.

What runs (all on one bus — the embedded broker unless ``NEXUSKV_BROKER`` names one):

* **services, as their own processes** — the index stream worker, the remote tier, the
  calibration agent and the planner service (with its in-process index replica), exactly as
  ``nexuskv up`` starts them (their logs under ``<out>/logs``);
* **engines, in this process** — ``workers`` reference engines (:mod:`nexuskv.reference_engine`,
  the tiny transformer of ``variant``), each with its own device-tier stand-in and host tier, all
  sharing the remote tier, each with a transfer executor (:mod:`streams.transfer_executor`) that
  moves real tensors between those tiers on the planner's transfer commands. Engines publish their
  lifecycle events and prefill observations (labelled with the request id) to the bus;
* **the decision sink, in this process** — :class:`~streams.sink.DecisionSink` writing
  ``nexuskv.decisions``, ``nexuskv.transfer-results`` and ``nexuskv.observations`` into the
  replay's decision store.

For each request, in stream order: its tokens, their canonical keys, and the engines' current load
go to the planner as a plan request; the decision comes back; the chosen engine waits for its
transfer when the plan moves state, loads what arrived, prefills (its own prefix cache applies as
an engine's would), and offloads the prompt's blocks to its host tier and the shared remote tier.
Each request is one trace. Warm-up requests are served like the others (they only mark figures).

Time: arrivals are the workload's (trace time divided by ``time_scale``, long gaps shortened) on a
*virtual* clock; each engine's queue is virtual too (it is busy for the prefill and transfer times
it really took), and the planner sees it as ``queued_prefill_tokens``. Everything else —
planning, transfers, prefill — runs for real.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from analytics.store import DecisionStore
from nexuskv.config import BrokerUrl, Settings
from nexuskv.contracts import codec
from nexuskv.contracts.decisions import Action, Decision
from nexuskv.contracts.plans import PlanRequest, WorkerLoad
from nexuskv.contracts.topics import DECISIONS, PLAN_REQUESTS, TRANSFER_RESULTS
from nexuskv.contracts.transfers import TransferResult, TransferStatus
from nexuskv.dataplane.catalog import BackendCatalog
from nexuskv.dataplane.executor import TransferExecutor
from nexuskv.dataplane.memory import DeviceMemoryBackend, HostMemoryBackend
from nexuskv.dataplane.remote import RemoteBackend
from nexuskv.errors import NexusKVError
from nexuskv.profiles import REFERENCE_CPU
from nexuskv.reference_engine.engine import ReferenceEngine
from nexuskv.reference_engine.spec import ReferenceModelSpec
from streams.app.replay.workload import ReplayRequest, Workload
from streams.app.services import SERVICES, start_services
from streams.bus.broker import open_bus
from streams.bus.clients import make_consumer, make_producer, send
from streams.bus.runtime_publisher import BusPublisher
from streams.bus.topics import ensure_topics
from streams.bus.tracing import tracer
from streams.remote_tier import local_address
from streams.sink import DecisionSink
from streams.transfer_executor import TransferService

__all__ = ["SERVICE_NAMES", "ReferenceRunResult", "reference_spec", "run_reference"]

#: The stream workers the reference run starts as processes (the rest runs in the replay's process).
SERVICE_NAMES = ("index-worker", "remote-tier", "calibration", "planner")
FIRST_DECISION_TIMEOUT_S = 60.0  # the first plan waits for the services to join their groups
DECISION_TIMEOUT_S = 30.0


@dataclass(slots=True)
class ReferenceRunResult:
    """The reference run's figures (its records are in the decision store)."""

    name: str = "nexuskv"
    requests: int = 0
    decisions: int = 0
    actions: Counter = field(default_factory=Counter)
    transfers: Counter = field(default_factory=Counter)
    reused_tokens: int = 0
    prompt_tokens: int = 0
    mean_ttft_s: float = 0.0  # on the virtual clock
    wall_s: float = 0.0

    def describe(self) -> str:
        return (f"{self.requests} requests, {self.decisions} decided in {self.wall_s:.1f}s; actions "
                f"{dict(self.actions)}; transfers {dict(self.transfers)}; reused {self.reused_tokens} of "
                f"{self.prompt_tokens} prompt tokens; mean virtual TTFT {self.mean_ttft_s * 1000:.1f} ms")


def reference_spec(variant: str, block_size: int) -> ReferenceModelSpec:
    if variant == "mla":
        return ReferenceModelSpec.mla(block_size=block_size)
    if variant == "hybrid":
        return ReferenceModelSpec.hybrid(block_size=block_size, checkpoint_interval=4 * block_size)
    return ReferenceModelSpec.gqa(block_size=block_size)


class _Engine:
    """One simulated serving worker: a reference engine, its tiers and its transfer executor."""

    def __init__(self, index: int, spec: ReferenceModelSpec, config, remote: str, publisher: BusPublisher,
                 url: BrokerUrl) -> None:
        self.runtime = ReferenceEngine(spec, worker=f"w{index}", tenant_namespace=config.tenant,
                                       num_pages=config.engine_blocks, profile=REFERENCE_CPU, publisher=publisher)
        self.name = self.runtime.publisher_id
        block_bytes = max(1, self.runtime.describe().state_bytes(spec.block_size))
        self.device = DeviceMemoryBackend(config.engine_blocks * block_bytes * 4, label=f"{self.name}-device")
        self.host = HostMemoryBackend(config.host_bytes, label=f"{self.name}-host", pin=False)
        self.remote = RemoteBackend.connect(remote, wait_s=30.0, label="shared-remote")
        self.catalog = BackendCatalog(self.name, [self.device, self.host, self.remote])
        self.executor = TransferService(url, TransferExecutor(self.catalog), worker=self.name,
                                        group_id=f"replay-executor-{self.name}-{uuid.uuid4().hex[:6]}")
        self.free_at = 0.0  # virtual time when the engine's queue drains
        self._work: list[tuple[float, float, int]] = []  # (start, finish, uncached tokens) on the virtual clock

    def backlog_tokens(self, now_v: float) -> int:
        """Prefill tokens still ahead of a request arriving at ``now_v`` (what an engine reports)."""
        self._work = [w for w in self._work if w[1] > now_v]
        total = 0.0
        for start, finish, tokens in self._work:
            total += tokens * min(1.0, (finish - now_v) / max(finish - start, 1e-9))
        return int(total)

    def occupy(self, arrival_v: float, seconds: float, tokens: int) -> tuple[float, float]:
        """Queue work of ``seconds`` behind what is there; returns (virtual start, finish)."""
        start = max(arrival_v, self.free_at)
        self.free_at = start + seconds
        self._work.append((start, self.free_at, tokens))
        return start, self.free_at


class _Outcomes:
    """Decisions and transfer results of this run's requests, as they arrive."""

    def __init__(self) -> None:
        self.decisions: dict[str, Decision] = {}
        self.results: dict[str, TransferResult] = {}
        self.changed = asyncio.Event()

    async def follow(self, url: BrokerUrl, prefix: str) -> None:
        consumer = make_consumer(url, DECISIONS, TRANSFER_RESULTS, client_id=f"replay-{prefix}", group_id=None,
                                 auto_offset_reset="latest")
        await consumer.start()
        try:
            while True:
                for tp, records in (await consumer.getmany(timeout_ms=100)).items():
                    for record in records:
                        if not (record.key or b"").startswith(prefix.encode()):
                            continue
                        value = codec.decode(DECISIONS if tp.topic == DECISIONS.name else TRANSFER_RESULTS,
                                             record.value)
                        if isinstance(value, Decision):
                            prior = self.decisions.get(value.request_id)
                            if prior is None or value.revision >= prior.revision:
                                self.decisions[value.request_id] = value
                        elif isinstance(value, TransferResult):
                            self.results[value.request_id] = value
                        self.changed.set()
        finally:
            await consumer.stop()

    async def wait(self, check, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while (found := check()) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), remaining)
        return found


def run_reference(config, workload: Workload, settings: Settings, store: DecisionStore, replay_id: str,
                  progress: Callable[[int], None], *, say: Callable[[str], None] = print) -> ReferenceRunResult:
    """The reference run of ``workload``: the bus, its topics and the services started here, stopped at
    the end; every request's records in ``store`` (request ids ``<replay_id>/<request id>``)."""
    local = settings.model_copy(update={"data_dir": config.out})
    remote = local_address()
    services = tuple(s for s in SERVICES if s.name in SERVICE_NAMES)
    with open_bus(settings.broker, start_timeout_s=settings.broker_start_timeout_s) as url:
        asyncio.run(ensure_topics(url, partitions=settings.topic_partitions, replication=settings.topic_replication))
        say(f"nexuskv replay: {config.workers} {config.variant} reference engines on {url}")
        env = {"NEXUSKV_REMOTE_TIER": remote, "NEXUSKV_DATA_DIR": str(config.out)}
        with start_services(url, local, services=services, env=env):
            return asyncio.run(_serve(config, workload, url, remote, store, replay_id, progress))


async def _serve(config, workload: Workload, url: BrokerUrl, remote: str, store: DecisionStore, replay_id: str,
                 progress: Callable[[int], None]) -> ReferenceRunResult:
    spec = reference_spec(config.variant, config.block_size)
    prefix = f"{replay_id}/"
    producer = make_producer(url, client_id=replay_id)
    await producer.start()
    publisher = BusPublisher(producer)
    engines = [_Engine(i, spec, config, remote, publisher, url) for i in range(config.workers)]
    sink = DecisionSink(url, store, group_id=f"{replay_id}-sink", flush_interval_s=0.25)
    outcomes = _Outcomes()
    stop = asyncio.Event()
    tasks = [asyncio.create_task(e.executor.run(stop)) for e in engines]
    tasks += [asyncio.create_task(sink.run(stop)), asyncio.create_task(outcomes.follow(url, prefix))]
    result = ReferenceRunResult()
    started = time.monotonic()
    ttfts: list[float] = []
    try:
        await asyncio.wait_for(asyncio.gather(*(e.executor.ready.wait() for e in engines)), 60)
        for i, request in enumerate(workload.requests):
            ttfts.append(await _serve_one(i == 0, request, spec, engines, producer, publisher, outcomes,
                                          f"{prefix}{request.request_id}", result))
            progress(1)
        await _wait_stored(store, len(workload.requests), prefix,
                           sum(v for k, v in result.transfers.items() if k != "no-result"))
    finally:
        stop.set()
        await asyncio.gather(*tasks[:-1], return_exceptions=True)
        tasks[-1].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await tasks[-1]
        for e in engines:
            e.remote.close()
        await producer.stop()
        result.decisions = store.query(f"SELECT count(DISTINCT request_id) FROM decisions "
                                       f"WHERE request_id LIKE '{prefix}%'")[0][0]
    result.requests = len(workload.requests)
    result.mean_ttft_s = sum(ttfts) / len(ttfts) if ttfts else 0.0
    result.wall_s = time.monotonic() - started
    return result


async def _serve_one(first: bool, request: ReplayRequest, spec: ReferenceModelSpec, engines: list[_Engine], producer,
                     publisher: BusPublisher, outcomes: _Outcomes, rid: str, result: ReferenceRunResult) -> float:
    tokens = list(request.tokens)
    arrival_v = request.arrival_s
    keys = engines[0].runtime.block_keys(tokens)
    candidates = tuple(WorkerLoad(worker=e.name, queued_prefill_tokens=e.backlog_tokens(arrival_v),
                                  profile=REFERENCE_CPU) for e in engines)
    with tracer("replay").start_as_current_span("replay.request", attributes={
            "nexuskv.service": "replay", "nexuskv.request_id": rid, "nexuskv.prompt_tokens": len(tokens)}):
        plan = PlanRequest(request_id=rid, scope=engines[0].runtime.scope, block_size=spec.block_size,
                           prompt_tokens=len(tokens), keys=tuple(keys), arrival_at=time.time(),
                           candidates=candidates, expected_output_tokens=request.output_tokens,
                           workload="conversation", descriptor=engines[0].runtime.describe())
        await send(producer, PLAN_REQUESTS, rid, plan)
        wait_s = FIRST_DECISION_TIMEOUT_S if first else DECISION_TIMEOUT_S
        decision = await outcomes.wait(lambda: outcomes.decisions.get(rid), wait_s)
        if decision is None:
            raise NexusKVError(f"replay: no decision for {rid} within {wait_s:.0f}s (is the planner running?)")
        result.actions[decision.action.value] += 1
        engine = next((e for e in engines if e.name == decision.worker), engines[0])
        transfer_s = 0.0
        if decision.action in (Action.TRANSFER, Action.PREFETCH):
            deadline = max(1.0, (decision.deadline_at or time.time() + 5.0) - time.time() + 1.0)
            moved = await outcomes.wait(lambda: outcomes.results.get(rid), deadline)
            status = moved.status.value if moved is not None else "no-result"
            result.transfers[status] += 1
            if moved is not None and moved.status is TransferStatus.COMPLETED:
                transfer_s = moved.duration_s
                with contextlib.suppress(NexusKVError):
                    engine.runtime.load(tokens, engine.device)
        queued_s = max(0.0, engine.free_at - arrival_v)
        done = engine.runtime.prefill(tokens, request_id=rid, queued_s=queued_s)
        for tier_backend in (engine.host, engine.remote):
            with contextlib.suppress(NexusKVError):  # a full tier keeps what it has; the engine goes on
                engine.runtime.save(tokens, tier_backend)
        await publisher.flush()
    _, finish_v = engine.occupy(arrival_v, transfer_s + done.duration_s, done.computed_tokens)
    result.reused_tokens += done.reused_tokens
    result.prompt_tokens += len(tokens)
    return finish_v - arrival_v


async def _wait_stored(store: DecisionStore, n: int, prefix: str, transfers: int, timeout_s: float = 60.0) -> None:
    """Until the sink has stored every request's decision and prefill observation, and every
    transfer result the run saw: the run's records are complete before the services stop."""
    deadline = time.monotonic() + timeout_s
    like = f"LIKE '{prefix}%'"
    sql = (f"SELECT (SELECT count(DISTINCT request_id) FROM decisions WHERE request_id {like}), "
           f"(SELECT count(DISTINCT request_id) FROM observations WHERE kind = 'prefill' AND request_id {like}), "
           f"(SELECT count(DISTINCT request_id) FROM transfer_results WHERE request_id {like})")
    while time.monotonic() < deadline:
        decided, observed, moved = (await asyncio.to_thread(store.query, sql))[0]
        if decided >= n and observed >= n and moved >= transfers:
            return
        await asyncio.sleep(0.25)
