"""The planner service: plan requests in; decisions, placement hints and transfer commands out.

Consumes ``nexuskv.plan-requests`` (and ``nexuskv.transfer-results``, which complete or fail the
transfers it ordered), decides with the pure planner against in-process replicas — the index
(any :class:`~nexuskv.lookup.IndexView`, injected) and the cost model
(:class:`streams.bus.cost_models.CostModelReplica`, fed by ``nexuskv.cost-models``) — and produces
``nexuskv.decisions`` (keyed by request id), ``nexuskv.placement`` (keyed by tenant and prefix
root) and ``nexuskv.transfers`` (keyed by destination worker). Input that cannot be planned — a
payload that does not decode, a descriptor the planner does not know, token ids that cannot be
keyed — goes to ``nexuskv.dead-letter`` with the reason.

Signed control records: under a bus secret the hints and commands it sends are signed as
``planner/<service>`` (:class:`~streams.bus.clients.ControlSigner`), and a transfer result is acted
on only when the executor of its destination worker signed it (``executor/<worker>``: another
worker's executor never ran it), it was not taken before, and it matches the command's request,
source and destination; any other (unsigned, forged, from a planner, an engine or another worker's
executor, replayed, mismatched) is dead-lettered with the reason and changes nothing
(:func:`~streams.bus.clients.check_control`, counted on ``nexuskv_records_refused``).

Prices: a replica of ``nexuskv.tier-state`` (:class:`streams.tier_prices.TierPriceReplica`) gives
each worker's displacement price, which the planner charges a prefetch into that worker's GPU tier
as ``C_pollution`` (the policy's flat default where a worker publishes none).

Deadlines: a ticker abandons transfers whose deadline passed (a superseding recompute decision,
revision + 1, and a ``cancel`` hint), and turns copies that land late into ``demote`` hints
(:mod:`nexuskv.planner.prefetch`). The execution policy file is re-read when it changes; a bad edit is
logged field by field and the last valid policy stays in force (a reload never raises: a file
nested too deeply or cut short is a refused edit like any other).

Supervision: the serve, cost-model follower, ticker and committer tasks run under a
:class:`streams.supervisor.Supervisor` (with the index replica's apply task, when ``main`` wires
one): if one fails, the others stop, :meth:`PlannerService.wait` raises, and the process exits
non-zero instead of answering ``/metrics`` while it no longer plans. A broker outage is not a
failure: sends and commits wait it out (readiness says so meanwhile) and go on when it is back. Readiness (partitions held,
cost models followed) is on ``/readyz``; liveness on ``/livez``. A tick that fails on one
transfer's bookkeeping is logged and the next tick goes on.

Delivery is at least once: a batch's offsets are committed only after the records it produced
were acknowledged, by a background task every ``commit_s`` (a commit awaited in the loop is a broker
round trip in front of the next request). A request id seen again by this process is skipped (its records already went out);
a restarted process plans it again, deterministically, with the same record ids.

Why aiokafka and not Faust: the goal is request -> decision in ≤ 20 ms on loopback, and Faust's
consumer fetches with a hard-coded 1.5 s wait that Tansu answers only after half of it (~0.75 s
per hop, ``streams/bus/tuning.py``); a plain consumer with a 10 ms wait and a producer without linger
(``tuning.LOW_LATENCY_*``) keep the bus to a few milliseconds per hop. Faust's tables would add
nothing here: the planner keeps no state of its own beyond transfers in flight.

The index: :func:`main` wires an in-process :class:`~streams.replica.IndexReplica` (every
kv-events partition, bootstrapped from the index workers' checkpoints), so a lookup never crosses
the bus; its lag lands in each decision. Tests inject any IndexView (:class:`NullIndexView` makes
every lookup a miss).

Run: ``python -m streams.planner_service`` (``nexuskv up`` starts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from nexuskv.config import BrokerUrl, Settings
from nexuskv.contracts import codec
from nexuskv.contracts.decisions import Decision
from nexuskv.contracts.topics import (
    PLAN_REQUESTS,
    TRANSFER_RESULTS,
)
from nexuskv.cost import CostModel
from nexuskv.errors import BrokerError, ContractError, NexusKVError
from nexuskv.lookup import IndexView, LookupResult
from nexuskv.models import DescriptorRegistry
from nexuskv.planner.core import Outgoing, PlannerCore
from nexuskv.policy import ExecutionPolicy
from nexuskv.profiles import shipped_cost_model
from streams.bus import tuning
from streams.bus.clients import (
    CONTROL_TOPICS,
    ControlSigner,
    ControlVerifier,
    DeadLetterQueue,
    check_control,
    control_verifier,
    dead_letter_for,
    is_transient,
    make_consumer,
    make_producer,
    retry_transient,
)
from streams.bus.cost_models import CostModelReplica
from streams.bus.health import HEALTH
from streams.bus.metrics import METRICS
from streams.bus.policy_file import PolicyFile
from streams.bus.process import freeze_startup_heap
from streams.bus.tracing import carrier_headers, finite_attributes, span_from_record, tracer
from streams.supervisor import Supervisor, run_service
from streams.telemetry import decision_attributes, init_service, reason_code
from streams.tier_prices import TierPriceReplica

__all__ = ["SERVICE", "PlannerService", "main"]

SERVICE = "nexuskv-planner"
log = logging.getLogger(__name__)
# The core's own refusals of a signed result (PlannerCore.on_result), counted beside check_control's.
_CORE_REFUSALS = ("not_owner:", "mismatch:")


def _traced_match(lookup: Callable[[], LookupResult]) -> LookupResult:
    """The index match as a span of the request's trace, with what it found."""
    with tracer(SERVICE).start_as_current_span("index.match") as span:
        result = lookup()
        best = result.best_certain_prefix()
        span.set_attributes(finite_attributes({
            "nexuskv.service": "index-replica", "nexuskv.blocks": result.num_blocks,
            "nexuskv.locations": len(result.matches), "nexuskv.best_prefix_blocks": best.prefix_blocks if best else 0,
            "nexuskv.index_lag_events": result.lag_events, "nexuskv.index_lag_ms": result.lag_ms}))
    return result


def _record_decisions(span: Any, produced: Iterable[Outgoing]) -> None:
    """Each decision's numbers on the span, and in the decision counters."""
    for o in produced:
        if isinstance(o.value, Decision):
            span.set_attributes(decision_attributes(o.value))
            METRICS.decisions.labels(o.value.action.value, reason_code(o.value.reason)).inc()


class PlannerService:
    """The planner on the bus: consume, decide, produce, commit."""

    def __init__(self, url: BrokerUrl, index: IndexView, *, base_model: CostModel | None = None,
                 policy: ExecutionPolicy | None = None, policy_file: Path | None = None,
                 descriptors: DescriptorRegistry | None = None,
                 clock: Callable[[], float] = time.time, service: str = SERVICE, group_id: str | None = None,
                 policy_reload_s: float = 1.0, tick_s: float = 0.02, commit_s: float = 0.1,
                 control: ControlSigner | None = None, verifier: ControlVerifier | None = None) -> None:
        self.url = url
        self.service = service
        # Hints and commands are signed as this planner (planner/<service>); results are taken only
        # from executors, each once (nexuskv.contracts.control_signature). Both from the environment's
        # bus secret unless given.
        self.control = control if control is not None else ControlSigner.from_env(f"planner/{service}", clock=clock)
        self.verifier = verifier if verifier is not None else control_verifier(Settings.from_env())
        self.group_id = group_id or service
        self.clock = clock
        self.policy_file = PolicyFile(policy_file) if policy_file is not None else None
        self._policy = policy or (self.policy_file.current if self.policy_file else ExecutionPolicy(version="builtin"))
        self.replica = CostModelReplica(url, base_model or shipped_cost_model(), service=service, clock=clock)
        self.tier_prices = TierPriceReplica(url, service=service, clock=clock)
        self.core = PlannerCore(index, model=lambda: self.replica.model, policy=lambda: self.policy,
                                descriptors=descriptors or DescriptorRegistry.with_known_models(),
                                prices=self.tier_prices.prices)
        self.core.observe_match = _traced_match
        self.policy_reload_s = policy_reload_s
        self.tick_s = tick_s
        self.commit_s = commit_s
        self._acked: dict[TopicPartition, int] = {}  # next offset to commit, once its outputs are acked
        self.rejected = 0
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._letters: DeadLetterQueue | None = None
        self.supervisor: Supervisor | None = None
        self.tick_failures = 0

    @property
    def policy(self) -> ExecutionPolicy:
        return self._policy

    async def start(self, *, timeout_s: float = 30.0) -> None:
        """Connect, join the group, start following the cost models; returns once partitions are held."""
        self._producer = make_producer(self.url, client_id=self.service, **tuning.LOW_LATENCY_PRODUCER)
        await self._producer.start()
        await self.replica.start(timeout_s=timeout_s)
        await self.tier_prices.start(timeout_s=timeout_s)
        self._consumer = make_consumer(self.url, PLAN_REQUESTS, TRANSFER_RESULTS, client_id=self.service,
                                       group_id=self.group_id, **tuning.LOW_LATENCY_CONSUMER)
        await self._consumer.start()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self._consumer.assignment():
            if asyncio.get_running_loop().time() > deadline:
                raise NexusKVError(f"{self.service}: no partitions assigned within {timeout_s:.0f}s")
            await asyncio.sleep(0.02)
        self._letters = DeadLetterQueue(self._producer)
        sup = self.supervisor = Supervisor(self.service)
        sup.spawn(self._serve(), name=f"{self.service}-serve")
        sup.spawn(self.replica.run(self._producer), name=f"{self.service}-cost-models")
        sup.spawn(self.tier_prices.run(self._producer), name=f"{self.service}-tier-prices")
        sup.spawn(self._tick(), name=f"{self.service}-tick")
        sup.spawn(self._commit_loop(), name=f"{self.service}-commit")
        HEALTH.set_ready("plan-requests", True, "partitions assigned")
        log.info("%s: serving with policy %s, cost model %s", self.service, self.policy.tag, self.replica.model.version)

    def watch(self, task: asyncio.Task | None, *, name: str) -> None:
        """Supervise another task of this process (the index replica's apply task) with ours."""
        if task is not None and self.supervisor is not None:
            self.supervisor.watch(task, name=name)

    async def wait(self) -> None:
        """Return never while the service works; raise ServiceFailed once a supervised task failed."""
        if self.supervisor is None:
            raise BrokerError(f"{self.service}: not started")
        await self.supervisor.wait()

    @property
    def alive(self) -> bool:
        return self.supervisor is not None and self.supervisor.alive

    async def stop(self) -> None:
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self._letters is not None:
            with contextlib.suppress(Exception):
                await self._letters.flush()
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await self._commit()
            await self._consumer.stop()
        await self.replica.stop()
        await self.tier_prices.stop()
        if self._producer is not None:
            await self._producer.stop()

    async def _send_all(self, records: list[Outgoing]) -> None:
        """Send and wait for every acknowledgement; a broker outage is waited out (records sent
        again: delivery is at least once, and record ids let consumers drop the repeats)."""
        producer = self._producer
        if producer is None:
            raise BrokerError(f"{self.service}: not started")
        if not records:
            return

        async def once() -> None:
            futures = []
            for r in records:  # signed again on each attempt: a resent record is a new one (see control_signature)
                key, payload = r.key.encode(), codec.encode(r.topic, r.value)
                headers = list(r.headers)
                signed = self.control.header(r.topic, key, payload) if r.topic.name in CONTROL_TOPICS else None
                if signed is not None:
                    headers.append(signed)
                futures.append(await producer.send(r.topic.name, payload, key=key, headers=headers or None))
            await asyncio.gather(*futures)

        await retry_transient(once, what=f"{self.service}: publishing {len(records)} records")

    async def _serve(self) -> None:
        consumer, producer = self._consumer, self._producer
        if consumer is None or producer is None:
            raise BrokerError(f"{self.service}: not started")
        while True:
            batches = await consumer.getmany(timeout_ms=200, max_records=512)
            if not batches:
                continue
            out: list[Outgoing] = []
            for records in batches.values():
                for rec in records:
                    now = self.clock()
                    name = "planner.decide" if rec.topic == PLAN_REQUESTS.name else "planner.transfer_result"
                    try:
                        with span_from_record(self.service, name, rec.headers) as span:
                            if rec.topic == PLAN_REQUESTS.name:
                                produced = self.core.on_request(rec.value, now=now)
                            else:  # a result completes a transfer only if an executor signed it, once
                                env = check_control(self.verifier, TRANSFER_RESULTS, rec, now=now,
                                                    service=self.service)
                                produced = self.core.on_result(rec.value, now=now,
                                                               producer=env.producer if env else None)
                            _record_decisions(span, produced)
                            headers = tuple(carrier_headers())
                            out.extend(dataclasses.replace(o, headers=headers) for o in produced)
                    except Exception as exc:  # noqa: BLE001 - bad input (or a bug) must not stop the service
                        self.rejected += 1
                        if isinstance(exc, ContractError) and str(exc).startswith(_CORE_REFUSALS):
                            METRICS.records_refused.labels(self.service, rec.topic, str(exc).partition(":")[0]).inc()
                        if isinstance(exc, NexusKVError):
                            log.warning("%s: rejected %s@%d/%d: %s", self.service, rec.topic, rec.partition,
                                        rec.offset, exc)
                        else:
                            log.exception("%s: failed on %s@%d/%d", self.service, rec.topic, rec.partition, rec.offset)
                        assert self._letters is not None
                        await self._letters.put(dead_letter_for(rec.topic, rec, exc, service=self.service, now=now))
            await self._send_all(out)
            if self._letters is not None:
                await self._letters.flush()  # acknowledged before the offsets below may be committed
            for tp, records in batches.items():
                self._acked[tp] = records[-1].offset + 1

    async def _commit(self) -> None:
        if self._acked and self._consumer is not None:
            offsets, self._acked = self._acked, {}
            try:
                await self._consumer.commit(offsets)
            except KafkaError as exc:
                if is_transient(exc):  # try again with the next commit (later offsets win)
                    for tp, off in offsets.items():
                        self._acked[tp] = max(off, self._acked.get(tp, 0))
                log.warning("%s: offset commit failed (%s: %s)%s", self.service, type(exc).__name__, exc,
                            "; retrying" if is_transient(exc) else "; the partitions moved, their new owner goes on")

    async def _commit_loop(self) -> None:
        while True:
            await asyncio.sleep(self.commit_s)
            await self._commit()

    async def _tick(self) -> None:
        last_reload = self.clock()
        while True:
            await asyncio.sleep(self.tick_s)
            now = self.clock()
            try:
                records = self.core.on_tick(now=now)
            except Exception:  # noqa: BLE001 - one tick's bookkeeping must not stop deadlines for good
                self.tick_failures += 1
                log.exception("%s: deadline tick failed; the next tick goes on", self.service)
                records = []
            if records:
                await self._send_all(records)
            if self.policy_file is not None and now - last_reload >= self.policy_reload_s:
                last_reload = now
                self._reload_policy()

    def _reload_policy(self) -> None:
        outcome = self.policy_file.poll() if self.policy_file is not None else None
        if outcome is None:
            return
        if outcome.error is not None:
            log.error("%s: policy edit refused, %s stays in force:\n%s", self.service, self.policy.tag,
                      outcome.error.describe())
            return
        if outcome.changed:
            self._policy = outcome.policy
            self.core.scheduler.update_policy(outcome.policy)
            log.info("%s: policy %s in force", self.service, outcome.policy.tag)


async def _run(settings: Settings, url: BrokerUrl, stop: asyncio.Event) -> None:  # pragma: no cover - `nexuskv up`
    from streams.replica import IndexReplica

    # The planner's index: an in-process replica of every kv-events partition, bootstrapped from the
    # index workers' checkpoints, so lookups never cross the bus.
    replica = IndexReplica(url, secret=settings.identity_secret_bytes, max_memberships=settings.index_max_memberships,
                           checkpoint_dir=settings.data_dir / "index" / "nexuskv-index",
                           client_id="nexuskv-planner-index", bus_secret=settings.bus_secret_bytes,
                           expected_blocks=settings.index_expected_blocks)
    await replica.start(timeout_s=settings.broker_start_timeout_s)
    service = PlannerService(url, replica, policy_file=settings.policy_file, policy_reload_s=settings.policy_reload_s)
    try:
        await service.start(timeout_s=settings.broker_start_timeout_s)
        service.watch(replica.task, name="index-replica")
        freeze_startup_heap()
        assert service.supervisor is not None
        await service.supervisor.until(stop)
    finally:
        await service.stop()
        await replica.stop()


def main() -> int:  # pragma: no cover - exercised by `nexuskv up`
    from streams.bus.broker import open_bus

    settings = Settings.from_env()
    init_service(SERVICE, settings)
    with open_bus(settings.broker, start_timeout_s=settings.broker_start_timeout_s) as url:
        return run_service(SERVICE, lambda stop: _run(settings, url, stop))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
