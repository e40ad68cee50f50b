"""Where each replayed request goes: a plain load balancer (the baseline), or NexusKV's planner.

Both see the same load: :class:`Loads` counts, per engine, the requests sent and not yet
answered with a first token (their prompt tokens are prefill still ahead of a new request). The
planner's candidates add what each engine reports itself (:mod:`connectors.engine_load`, vLLM's
scheduler gauges on ``/metrics``): requests it holds beyond the router's (waiting, or decoding
and so slowing every prefill step) and the KV blocks they hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from opentelemetry import trace

from connectors.engine_load import EngineLoad
from nexuskv.config import BrokerUrl
from nexuskv.contracts import codec
from nexuskv.contracts.decisions import Decision
from nexuskv.contracts.plans import PlanRequest, WorkerLoad
from nexuskv.contracts.topics import DECISIONS, PLAN_REQUESTS
from nexuskv.descriptor import StateDescriptor
from nexuskv.errors import NexusKVError
from nexuskv.identity import BlockKeyer, IdentityScope
from streams.bus.clients import make_consumer, make_producer, send
from streams.bus.tracing import finite_attributes

__all__ = ["LeastOutstanding", "Loads", "PlannerRouter", "Routed"]


@dataclass(slots=True)
class Loads:
    """Requests in flight per engine that have not produced their first token (prompt lengths)."""

    waiting: list[dict[str, int]]
    #: The engine's own report (an :class:`~connectors.engine_load.EngineLoadPoller`'s ``latest``);
    #: None, or a None report: the router's count alone.
    reported: Callable[[int], EngineLoad | None] | None = None
    engine_blocks: int = 0  # each engine's KV cache in blocks (what its KV usage is a share of)

    @classmethod
    def of(cls, engines: int) -> Loads:
        return cls([{} for _ in range(engines)])

    def sent(self, engine: int, rid: str, tokens: int) -> None:
        self.waiting[engine][rid] = tokens

    def first_token(self, engine: int, rid: str) -> None:
        self.waiting[engine].pop(rid, None)

    def worker_load(self, engine: int, worker: str, profile: str | None, *, loads_own_tiers: bool,
                    loads_shared_tiers: bool = False, has_executor: bool = True) -> WorkerLoad:
        ahead = list(self.waiting[engine].values())
        requests, tokens, products = len(ahead), sum(ahead), sum(t * t for t in ahead)
        active = decode_blocks = 0
        report = self.reported(engine) if self.reported is not None else None
        if report is not None:
            # Waiting in the engine and not the router's: prefills too, priced like the router's own.
            unknown = report.waiting - requests
            if unknown > 0 and requests:
                tokens += unknown * tokens // requests
                products += unknown * products // requests
            requests = max(requests, report.waiting)
            active = report.running + report.waiting
            # Running beyond the router's prefills: decoding; their share of the engine's blocks in use
            # is read once per prefill step.
            decoding = max(0, report.running - len(ahead))
            if decoding and report.running:
                decode_blocks = round(report.kv_usage * self.engine_blocks * decoding / report.running)
        return WorkerLoad(worker=worker, profile=profile, queued_prefill_tokens=tokens,
                          queued_prefill_requests=requests, queued_prefill_token_products=products,
                          decode_blocks=decode_blocks, active_requests=active, loads_own_tiers=loads_own_tiers,
                          loads_shared_tiers=loads_shared_tiers, has_executor=has_executor)


@dataclass(frozen=True, slots=True)
class Routed:
    engine: int
    decision: Decision | None = None  # the planner's, when NexusKV routed
    routing_s: float = 0.0


@dataclass(slots=True)
class LeastOutstanding:
    """The engine with the fewest requests waiting for their first token; ties go round robin."""

    engines: int
    _next: int = 0

    async def route(self, rid: str, tokens: Sequence[int], loads: Loads, arrival_at: float) -> Routed:
        counts = [len(w) for w in loads.waiting]
        fewest = min(counts)
        for k in range(self.engines):
            i = (self._next + k) % self.engines
            if counts[i] == fewest:
                self._next = (i + 1) % self.engines
                return Routed(i)
        raise AssertionError("unreachable: some engine has the fewest requests")

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


@dataclass(slots=True)
class PlannerRouter:
    """NexusKV's routing: a plan request per request to the planner service, its decision's worker.

    The request's canonical keys are computed here, at the edge that knows the scope (the same
    descriptor and tenant the engines' connectors and bridges key their blocks in), so the
    planner never sees token ids. Each route is a ``router.plan`` span of ``tracer``, current while
    the plan request is sent: the request's Kafka headers carry it to the planner, and its trace id
    goes in the plan request (the decision records name it).
    """

    url: BrokerUrl
    descriptor: StateDescriptor
    workers: tuple[str, ...]
    profile: str | None
    prefix: str
    timeout_s: float = 60.0
    loads_own_tiers: bool = True  # vLLM's NexusKV connector reads the worker's own disk tier itself
    loads_shared_tiers: bool = False  # ... and the shared remote tier, when the run has one
    has_executor: bool = False  # the replay runs no tier manager: no executor copies into an engine
    tracer: trace.Tracer = field(default_factory=trace.NoOpTracer)
    _decisions: dict[str, Decision] = field(default_factory=dict)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _producer: object = None
    _task: asyncio.Task | None = None
    _keyer: BlockKeyer | None = None

    async def start(self) -> None:
        self._keyer = BlockKeyer(IdentityScope.of(self.descriptor), self.descriptor.block_size)
        self._producer = make_producer(self.url, client_id=f"{self.prefix}-router")
        await self._producer.start()
        consumer = make_consumer(self.url, DECISIONS, client_id=f"{self.prefix}-decisions", group_id=None,
                                 auto_offset_reset="latest")
        await consumer.start()
        self._task = asyncio.create_task(self._follow(consumer))

    async def _follow(self, consumer) -> None:
        mine = self.prefix.encode()
        try:
            while True:
                for records in (await consumer.getmany(timeout_ms=100)).values():
                    for record in records:
                        if not (record.key or b"").startswith(mine):
                            continue
                        d = codec.decode(DECISIONS, record.value)
                        prior = self._decisions.get(d.request_id)
                        if prior is None or d.revision >= prior.revision:
                            self._decisions[d.request_id] = d
                            self._changed.set()
        finally:
            await consumer.stop()

    async def route(self, rid: str, tokens: Sequence[int], loads: Loads, arrival_at: float) -> Routed:
        pid = f"{self.prefix}/{rid}"
        with self.tracer.start_as_current_span("router.plan", kind=trace.SpanKind.PRODUCER,
                                               attributes={"nexuskv.service": "replay-router",
                                                           "nexuskv.request_id": pid}) as span:
            routed = await self._route(pid, tokens, loads, arrival_at, span)
            d = routed.decision
            if d is not None:
                span.set_attributes(finite_attributes({
                    "nexuskv.action": d.action.value, "nexuskv.worker": d.worker,
                    "nexuskv.reused_tokens": d.reused_tokens, "nexuskv.eg_s": d.eg_s,
                    "nexuskv.tier": d.source.tier.value if d.source is not None else "none",
                    "nexuskv.routing_s": routed.routing_s}))
            return routed

    async def _route(self, pid: str, tokens: Sequence[int], loads: Loads, arrival_at: float,
                     span: trace.Span) -> Routed:
        started = time.perf_counter()
        d = self.descriptor
        keys = self._keyer.keys(list(tokens))  # type: ignore[union-attr]
        candidates = tuple(loads.worker_load(i, w, self.profile, loads_own_tiers=self.loads_own_tiers,
                                             loads_shared_tiers=self.loads_shared_tiers,
                                             has_executor=self.has_executor)
                           for i, w in enumerate(self.workers))
        ctx = span.get_span_context()
        request = PlanRequest(request_id=pid, scope=IdentityScope.of(d), block_size=d.block_size,
                              prompt_tokens=len(tokens), keys=tuple(keys), arrival_at=arrival_at,
                              candidates=candidates, workload="replay", descriptor=d,
                              trace_id=format(ctx.trace_id, "032x") if ctx.is_valid else None)
        await send(self._producer, PLAN_REQUESTS, pid, request)
        deadline = time.monotonic() + self.timeout_s
        while (decision := self._decisions.get(pid)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NexusKVError(f"replay: no decision for {pid} within {self.timeout_s:.0f}s "
                                   "(is the planner running?)")
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        engine = self.workers.index(decision.worker) if decision.worker in self.workers else 0
        return Routed(engine, decision, time.perf_counter() - started)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._producer is not None:
            await self._producer.stop()
