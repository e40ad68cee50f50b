"""``nexuskv replay TRACE --engine reference``: a Mooncake trace on NexusKV's reference engine.

The engine for the attention families vLLM's CPU build cannot run (``--reference-variant mla`` or
``hybrid``, recurrent checkpoints); one run, no baseline (the vLLM replay, :mod:`streams.app.replay`,
is the measurement of what NexusKV is for).

What runs (all on one bus — the embedded broker unless ``NEXUSKV_BROKER`` names one):

* **services, as their own processes** — the index stream worker, the remote tier, the
  calibration agent and the planner service (with its in-process index replica), exactly as
  ``nexuskv up`` starts them;
* **engines, in this process** — ``--workers`` reference engines (:mod:`nexuskv.reference_engine`, the
  tiny GQA transformer), each with its own device-tier stand-in and host tier, all sharing the
  remote tier, each with a transfer executor (:mod:`streams.transfer_executor`) that moves real
  tensors between those tiers on the planner's transfer commands. Engines publish their
  lifecycle events and prefill observations (labelled with the request id) to the bus;
* **the decision sink, in this process** — :class:`~streams.sink.DecisionSink` writing
  ``nexuskv.decisions``, ``nexuskv.transfer-results`` and ``nexuskv.observations`` into DuckDB.

For each request, in trace order: its prompt (each 512-token hash id of the trace becomes
``hash_block_tokens`` deterministic tokens, so prefix sharing is kept and prompts shrink 16x),
its canonical keys, and the engines' current load go to the planner as a plan request; the
decision comes back; the chosen engine waits for its transfer when the plan moves state, loads
what arrived, prefills (its own prefix cache applies as an engine's would), and offloads the
prompt's blocks to its host tier and the shared remote tier. Each request is one trace.

Time: arrivals follow the trace's timestamps divided by ``time_scale`` on a *virtual* clock;
each engine's queue is virtual too (it is busy for the prefill and transfer times it really
took), and the planner sees it as ``queued_prefill_tokens``. Everything else — planning,
transfers, prefill — runs for real.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

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
from streams.app.traces import TraceRequest, load_trace
from streams.bus.clients import make_consumer, make_producer, send
from streams.bus.runtime_publisher import BusPublisher
from streams.bus.tracing import tracer
from streams.sink import DecisionSink
from streams.transfer_executor import TransferService

__all__ = ["ReplayConfig", "ReplayResult", "run_replay", "REPLAY_SERVICES"]

#: The stream workers a replay starts as processes (the rest runs in the replay's process).
REPLAY_SERVICES = ("index-worker", "remote-tier", "calibration", "planner")


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    trace: Path
    db: Path
    requests: int = 200
    workers: int = 4
    time_scale: float = 10.0  # virtual arrivals = trace time / time_scale
    hash_block_tokens: int = 32  # tokens per 512-token hash id of the trace
    max_prompt_tokens: int = 2048
    gpu_pages: int = 160  # each engine's page pool, in blocks of block_size tokens
    host_bytes: int = 32 << 20
    block_size: int = 16
    decision_timeout_s: float = 60.0  # the first plan waits for the services to join their groups
    tenant: str = "default"
    conversations: int = 0  # > 0: only the first N multi-turn conversations (every turn), in time order
    variant: str = "gqa"  # the reference engine's attention: gqa, mla or hybrid (recurrent checkpoints)


@dataclass(slots=True)
class ReplayResult:
    requests: int = 0
    decisions: int = 0
    actions: Counter = field(default_factory=Counter)
    transfers: Counter = field(default_factory=Counter)
    reused_tokens: int = 0
    prompt_tokens: int = 0
    mean_ttft_s: float = 0.0
    wall_s: float = 0.0
    db: Path | None = None


class _Engine:
    """One simulated serving worker: a reference engine, its tiers and its transfer executor."""

    def __init__(self, index: int, spec: ReferenceModelSpec, config: ReplayConfig, remote: str, publisher: BusPublisher,
                 url: BrokerUrl) -> None:
        self.runtime = ReferenceEngine(spec, worker=f"w{index}", tenant_namespace=config.tenant,
                                        num_pages=config.gpu_pages, profile=REFERENCE_CPU, publisher=publisher)
        self.name = self.runtime.publisher_id
        block_bytes = max(1, self.runtime.describe().state_bytes(spec.block_size))
        self.device = DeviceMemoryBackend(config.gpu_pages * block_bytes * 4, label=f"{self.name}-device")
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
    """Decisions and transfer results of this replay's requests, as they arrive."""

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


def select_requests(trace: list[TraceRequest], limit: int, conversations: int = 0) -> list[TraceRequest]:
    """The first ``limit`` requests, or every turn of the first ``conversations`` multi-turn ones.

    A conversation is keyed by its second hash id (the first is the trace's shared system
    prompt). In the conversation trace a follow-up turn arrives minutes after its first, so the
    first few hundred requests hold almost no multi-turn reuse; taking the first N
    conversations that have two or more turns, with all their turns in time order, gives a short
    replay that exercises reuse, routing and transfers — and compresses time, since the other
    requests between the turns are dropped.
    """
    if conversations <= 0:
        return trace[:limit]
    turns: dict[int, int] = {}
    for r in trace:
        if len(r.hash_ids) > 1:
            turns[r.hash_ids[1]] = turns.get(r.hash_ids[1], 0) + 1
    chosen: list[int] = []
    for r in trace:
        key = r.hash_ids[1] if len(r.hash_ids) > 1 else None
        if key is not None and turns[key] >= 2 and key not in chosen and len(chosen) < conversations:
            chosen.append(key)
    keep = set(chosen)
    return [r for r in trace if len(r.hash_ids) > 1 and r.hash_ids[1] in keep][:limit]


def _spec(config: ReplayConfig) -> ReferenceModelSpec:
    if config.variant == "mla":
        return ReferenceModelSpec.mla(block_size=config.block_size)
    if config.variant == "hybrid":
        return ReferenceModelSpec.hybrid(block_size=config.block_size, checkpoint_interval=4 * config.block_size)
    return ReferenceModelSpec.gqa(block_size=config.block_size)


def _tokens(request: TraceRequest, per_hash: int, vocab: int, limit: int) -> list[int]:
    """Deterministic tokens: each hash id's tokens come from a generator seeded with the id."""
    out: list[int] = []
    for h in request.hash_ids:
        out.extend(np.random.default_rng(h).integers(0, vocab, per_hash).tolist())
    n = min(len(out), max(1, request.input_length * per_hash // 512), limit)
    return out[:n]


async def run_replay(config: ReplayConfig, url: BrokerUrl, remote: str, *, progress: bool = True) -> ReplayResult:
    """Replay ``config.requests`` requests of the trace; the services must already be running."""
    spec = _spec(config)
    requests = select_requests(load_trace(config.trace), config.requests, config.conversations)
    prefix = f"replay-{uuid.uuid4().hex[:8]}"
    producer = make_producer(url, client_id=prefix)
    await producer.start()
    publisher = BusPublisher(producer)
    engines = [_Engine(i, spec, config, remote, publisher, url) for i in range(config.workers)]
    store = DecisionStore(config.db)
    sink = DecisionSink(url, store, group_id=f"{prefix}-sink", flush_interval_s=0.25)
    outcomes = _Outcomes()
    stop = asyncio.Event()
    tasks = [asyncio.create_task(e.executor.run(stop)) for e in engines]
    tasks += [asyncio.create_task(sink.run(stop)), asyncio.create_task(outcomes.follow(url, prefix))]
    result = ReplayResult(db=config.db)
    started = time.monotonic()
    ttfts: list[float] = []
    try:
        await asyncio.wait_for(asyncio.gather(*(e.executor.ready.wait() for e in engines)), 60)
        t0 = requests[0].timestamp_ms if requests else 0
        with _progress(len(requests), progress) as bar:
            for i, request in enumerate(requests):
                ttft = await _serve_one(i, request, config, spec, engines, producer, publisher, outcomes, prefix,
                                        (request.timestamp_ms - t0) / 1000.0 / config.time_scale, result)
                ttfts.append(ttft)
                bar(1)
        await _wait_stored(store, len(requests), prefix,
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
                                       f"WHERE request_id LIKE '{prefix}-%'")[0][0]
        store.close()
    result.requests = len(requests)
    result.mean_ttft_s = sum(ttfts) / len(ttfts) if ttfts else 0.0
    result.wall_s = time.monotonic() - started
    return result


async def _serve_one(i: int, request: TraceRequest, config: ReplayConfig, spec: ReferenceModelSpec, engines: list[_Engine],
                     producer, publisher: BusPublisher, outcomes: _Outcomes, prefix: str, arrival_v: float,
                     result: ReplayResult) -> float:
    tokens = _tokens(request, config.hash_block_tokens, spec.vocab_size, config.max_prompt_tokens)
    keys = engines[0].runtime.block_keys(tokens)
    rid = f"{prefix}-{i:06d}"
    candidates = tuple(WorkerLoad(worker=e.name, queued_prefill_tokens=e.backlog_tokens(arrival_v),
                                  profile=REFERENCE_CPU) for e in engines)
    with tracer("replay").start_as_current_span("replay.request", attributes={
            "nexuskv.service": "replay", "nexuskv.request_id": rid, "nexuskv.prompt_tokens": len(tokens)}):
        plan = PlanRequest(request_id=rid, scope=engines[0].runtime.scope, block_size=spec.block_size,
                           prompt_tokens=len(tokens), keys=tuple(keys), arrival_at=time.time(),
                           candidates=candidates, expected_output_tokens=request.output_length,
                           workload="conversation", descriptor=engines[0].runtime.describe())
        await send(producer, PLAN_REQUESTS, rid, plan)
        wait_s = config.decision_timeout_s if i == 0 else 30.0
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
    transfer result the replay saw: the run's records are complete before the services stop."""
    deadline = time.monotonic() + timeout_s
    like = f"LIKE '{prefix}-%'"
    sql = (f"SELECT (SELECT count(DISTINCT request_id) FROM decisions WHERE request_id {like}), "
           f"(SELECT count(DISTINCT request_id) FROM observations WHERE kind = 'prefill' AND request_id {like}), "
           f"(SELECT count(DISTINCT request_id) FROM transfer_results WHERE request_id {like})")
    while time.monotonic() < deadline:
        decided, observed, moved = (await asyncio.to_thread(store.query, sql))[0]
        if decided >= n and observed >= n and moved >= transfers:
            return
        await asyncio.sleep(0.25)


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator:
    if not enabled:
        yield lambda n: None
        return
    from tqdm import tqdm

    with tqdm(total=total, unit="req", desc="replay", dynamic_ncols=True) as bar:
        yield bar.update


def default_replay_dir(settings: Settings) -> Path:
    return Path(settings.data_dir) / "replays" / time.strftime("%Y%m%d-%H%M%S")

