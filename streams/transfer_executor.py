"""``python -m streams.transfer_executor``: the data plane's transfer service for one worker.

Consumes ``nexuskv.transfers`` (commands keyed by destination worker), runs the commands whose
destination is this worker (``NEXUSKV_WORKER``) on a
:class:`~nexuskv.dataplane.executor.TransferExecutor` over this worker's tiers, and publishes
each outcome on ``nexuskv.transfer-results`` (keyed by request id) and its timing on
``nexuskv.observations``. A command that cannot be decoded goes to ``nexuskv.dead-letter`` with
the reason; so does, under a bus secret, one that a planner did not sign or that was taken
before (:func:`~streams.bus.clients.check_control`): it runs nothing. Results are signed as
``executor/<worker>``. Commands for other workers are skipped: each executor reads the topic in its own
consumer group (``nexuskv-transfer-executor-<worker>``), so every executor sees every command
and none is lost to a partition assigned elsewhere.

Offsets are committed only up to the oldest command whose result is not yet published, so a
crash re-runs (never drops) a command; re-running one is harmless, as blocks already at the
destination are not copied again. On SIGINT/SIGTERM the executor cancels what is queued or
running, publishes those ``cancelled`` results, commits, and exits.

Supervised: a broker outage is waited out (results are published when it is back); a command
whose result cannot be published for another reason is not marked done, so its offset is never committed; the service then stops and exits
non-zero (a restarted executor runs the command again). Readiness — partitions assigned — and
liveness are on ``/readyz`` and ``/livez``.

Tiers (:func:`catalog_from_settings`): device memory (CUDA, or a host-memory stand-in that says
so), host DRAM, local disk under ``NEXUSKV_DATA_DIR/tiers/<worker>/disk``, and the remote tier at
``NEXUSKV_REMOTE_TIER`` when set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata, TopicPartition
from opentelemetry import trace
from opentelemetry.trace import Span

from nexuskv.config import BrokerUrl, Settings
from nexuskv.contracts.topics import TRANSFERS
from nexuskv.contracts.transfers import TransferCommand
from nexuskv.dataplane.catalog import BackendCatalog
from nexuskv.dataplane.disk import DiskBackend
from nexuskv.dataplane.executor import TransferExecutor, TransferOutcome
from nexuskv.dataplane.memory import DeviceMemoryBackend, HostMemoryBackend
from nexuskv.dataplane.remote import RemoteBackend
from nexuskv.errors import ConfigError, ContractError, NexusKVError
from streams.bus.clients import (
    ControlSigner,
    ControlVerifier,
    DeadLetterQueue,
    check_control,
    control_verifier,
    dead_letter_for,
    decode_record,
    make_consumer,
    make_producer,
    retry_transient,
    send,
)
from streams.bus.health import HEALTH
from streams.bus.metrics import METRICS
from streams.bus.topic_keys import route
from streams.bus.tracing import start_span_from_record
from streams.supervisor import ServiceFailed, Supervisor, run_service
from streams.telemetry import init_service

__all__ = ["TransferService", "catalog_from_settings", "main"]

log = logging.getLogger("nexuskv.transfer_executor")
SERVICE = "transfer-executor"


class _Offsets:
    """Per partition: the next offset that is safe to commit (all earlier ones finished)."""

    def __init__(self) -> None:
        self._pending: dict[TopicPartition, set[int]] = {}
        self._next: dict[TopicPartition, int] = {}

    def begin(self, tp: TopicPartition, offset: int) -> None:
        self._pending.setdefault(tp, set()).add(offset)
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)

    def done(self, tp: TopicPartition, offset: int) -> None:
        self._pending.get(tp, set()).discard(offset)

    def committable(self) -> dict[TopicPartition, int]:
        return {tp: min(self._pending[tp]) if self._pending.get(tp) else nxt for tp, nxt in self._next.items()}


class TransferService:
    """Bus glue around one worker's executor; :meth:`run` until ``stop`` is set."""

    def __init__(self, url: BrokerUrl, executor: TransferExecutor, *, worker: str, group_id: str | None = None,
                 clock: Callable[[], float] = time.time, control: ControlSigner | None = None,
                 verifier: ControlVerifier | None = None) -> None:
        self.url = url
        # Results are signed as executor/<worker>; a command is run only when a planner signed it and
        # it was not taken before (nexuskv.contracts.control_signature). From the environment unless given.
        self.control = control if control is not None else ControlSigner.from_env(f"executor/{worker}", clock=clock)
        self.verifier = verifier if verifier is not None else control_verifier(Settings.from_env())
        self.executor = executor
        self.worker = worker
        self._key = worker.encode("utf-8")  # commands are keyed by their destination worker
        self.group_id = group_id or f"nexuskv-{SERVICE}-{worker}"
        self.clock = clock
        self.ready = asyncio.Event()  # set once the consumer has joined and got its partitions
        self.handled = 0
        self.failure: ServiceFailed | None = None
        self._letters: DeadLetterQueue | None = None

    async def run(self, stop: asyncio.Event) -> None:
        client = f"{SERVICE}-{self.worker}-{uuid.uuid4().hex[:6]}"
        consumer = make_consumer(self.url, TRANSFERS, client_id=client, group_id=self.group_id)
        producer = make_producer(self.url, client_id=client)
        await producer.start()
        await consumer.start()
        self._letters = DeadLetterQueue(producer)
        offsets = _Offsets()
        committed: dict[TopicPartition, int] = {}
        tasks: set[asyncio.Task] = set()
        supervisor = Supervisor(SERVICE)

        def finished(task: asyncio.Task, tp: TopicPartition, offset: int) -> None:
            tasks.discard(task)
            if task.cancelled() or task.exception() is not None:
                if self.failure is None:  # not done: its offset is never committed, a restart re-runs it
                    error = None if task.cancelled() else task.exception()
                    self.failure = ServiceFailed(SERVICE, f"publish of {tp.topic}@{tp.partition}/{offset}", error)
                    HEALTH.fail(str(self.failure))
                    log.error("%s", self.failure, exc_info=error)
                return
            offsets.done(tp, offset)

        try:
            while not stop.is_set():
                if self.failure is not None:
                    raise self.failure
                if supervisor.failure is not None:
                    raise supervisor.failure
                batch = await consumer.getmany(timeout_ms=200, max_records=256)
                if consumer.assignment():
                    self.ready.set()
                    HEALTH.set_ready("partitions", True)
                for tp, records in batch.items():
                    for record in records:
                        offsets.begin(tp, record.offset)
                        task = self._handle(record)
                        if task is None:
                            offsets.done(tp, record.offset)
                        else:
                            tasks.add(task)
                            task.add_done_callback(lambda t, tp=tp, o=record.offset: finished(t, tp, o))
                await self._letters.flush()
                await self._commit(consumer, offsets, committed)
        finally:
            await supervisor.stop()
            await asyncio.to_thread(self.executor.close, "the transfer executor is stopping")
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            if self.failure is None:
                with contextlib.suppress(Exception):
                    await self._letters.flush()
                await self._commit(consumer, offsets, committed)
            await consumer.stop()
            await producer.stop()

    def _handle(self, record) -> asyncio.Task | None:
        """Start one record's work; None when it is finished at once (skipped, or its dead letter
        queued: the loop flushes the queue before it commits)."""
        producer = self._letters.producer if self._letters is not None else None
        # A command is keyed by its destination worker; one keyed to another is never run here, so it
        # is checked for a signature only (an old genuine one is not stale *here*: each executor reads
        # every command, and a fresh one reads the topic's whole retention).
        ours = record.key is not None and bytes(record.key) == self._key
        try:
            check_control(self.verifier, TRANSFERS, record, now=self.clock(), service=SERVICE, admit=ours)
            command = decode_record(TRANSFERS, record)
        except ContractError as exc:
            letter = dead_letter_for(TRANSFERS.name, record, exc, service=SERVICE, now=self.clock())
            return asyncio.create_task(self._dead_letter(letter))
        if not isinstance(command, TransferCommand) or command.destination.worker != self.worker or not ours:
            return None
        span = start_span_from_record(SERVICE, "transfer.execute", record.headers, {
            "nexuskv.request_id": command.request_id, "nexuskv.transfer_id": command.transfer_id,
            "nexuskv.link": f"{command.source.tier.value}->{command.destination.tier.value}",
            "nexuskv.blocks": len(command.keys), "nexuskv.bytes": command.bytes,
            "nexuskv.deadline_at": command.deadline_at})
        future = asyncio.wrap_future(self.executor.submit(command))
        return asyncio.create_task(self._publish(producer, future, span))

    async def _publish(self, producer, future: asyncio.Future, span: Span) -> None:
        with trace.use_span(span, end_on_exit=True):
            outcome: TransferOutcome = await future
            result = outcome.result
            span.set_attributes({"nexuskv.status": result.status.value, "nexuskv.bytes_moved": result.bytes_moved,
                                 "nexuskv.duration_s": result.duration_s})
            METRICS.transfers.labels(result.status.value,
                                     f"{result.source.tier.value}->{result.destination.tier.value}").inc()
            await retry_transient(lambda: send(producer, *route(result), result, control=self.control),
                                  what=f"publishing transfer result {result.transfer_id}")
            if outcome.observation is not None:
                obs = outcome.observation
                await retry_transient(lambda: send(producer, *route(obs), obs), what="publishing a transfer timing")
        self.handled += 1
        log.info("transfer %s: %s (%d blocks, %d bytes, %.4fs)%s", result.transfer_id, result.status.value,
                 result.blocks_moved, result.bytes_moved, result.duration_s,
                 f": {result.error}" if result.error else "")

    async def _dead_letter(self, letter) -> None:
        assert self._letters is not None
        await self._letters.put(letter)
        log.warning("dead-lettered a transfers record at offset %d: %s", letter.offset, letter.reason)

    @staticmethod
    async def _commit(consumer, offsets: _Offsets, committed: dict[TopicPartition, int]) -> None:
        due = {tp: o for tp, o in offsets.committable().items() if committed.get(tp) != o}
        if due:
            try:
                await consumer.commit({tp: OffsetAndMetadata(o, "") for tp, o in due.items()})
            except KafkaError as exc:  # not committed now: the next loop tries again (a rerun is harmless)
                log.warning("offset commit failed (%s: %s)", type(exc).__name__, exc)
                return
            committed.update(due)


def catalog_from_settings(settings: Settings, *, wait_s: float | None = None) -> BackendCatalog:
    """This worker's tiers from settings; waits up to ``wait_s`` for the remote tier to answer."""
    root = Path(settings.data_dir) / "tiers" / settings.worker / "disk"
    backends = [DeviceMemoryBackend(settings.tier_device_bytes), HostMemoryBackend(settings.tier_host_bytes),
                DiskBackend(root, settings.tier_disk_bytes)]
    if settings.remote_tier:
        backends.append(RemoteBackend.connect(settings.remote_tier,
                                              wait_s=settings.broker_start_timeout_s if wait_s is None else wait_s))
    return BackendCatalog(settings.worker, backends)


def main() -> int:
    """The executor alone, over tiers nothing manages: for embedding and tests. ``nexuskv up`` runs it
    inside the tier manager (``python -m streams.tier_manager``), which owns the tiers it writes."""
    try:
        settings = Settings.from_env()
        init_service(SERVICE, settings)
        url = settings.broker_url
        if url is None:
            raise ConfigError("NEXUSKV_BROKER", "the transfer executor needs a broker (nexuskv up sets it)")
        catalog = catalog_from_settings(settings)
    except NexusKVError as exc:
        print(f"nexuskv transfer executor: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    for b in catalog.backends:
        c = b.capabilities
        log.info("tier %s: %s, %d bytes, device %s%s", c.tier.value, b.label, b.capacity_bytes, c.device,
                 f" ({c.note})" if c.note else "")
    executor = TransferExecutor(catalog, lanes=settings.transfer_lanes, jobs=settings.transfer_jobs)
    service = TransferService(url, executor, worker=settings.worker)

    return run_service(SERVICE, service.run)


if __name__ == "__main__":
    sys.exit(main())
