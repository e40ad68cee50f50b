"""``python -m streams.tier_manager``: the tier manager of one worker, and its transfer executor.

Names: this module is the tier manager **service** (one process per worker, on the bus);
:class:`~nexuskv.dataplane.tiers.TierManager` is the in-process object it runs, the same one an
engine adapter builds inside its engine (the in-engine adapter's tier manager). Either is the one
authority of the tier folder it manages: a second one on the same folder fails at start with
:class:`~nexuskv.errors.TierLockedError`, naming the folder and the holder's pid.

One process per worker (``NEXUSKV_WORKER``) owns that worker's tiers — device memory (CUDA, or a
host-memory stand-in that says so), host DRAM and local disk (:func:`~streams.transfer_executor.
catalog_from_settings`) — through a :class:`~nexuskv.dataplane.tiers.TierManager`, and runs the
transfer executor on them in the same process (the executor's copies are admissions into those
tiers, and memory tiers live in the process that holds them). On the bus (:class:`TierBus`):

* **in** — ``nexuskv.placement`` hints addressed to this worker: ``pin``/``unpin`` (within the
  tier's pinned quota), ``prefetch`` (room held until the copy lands or the hint expires),
  ``demote``/``evict`` (a copy that landed late), ``cancel`` (the executor stops the copy; its
  ``cancelled`` result follows). ``route`` hints are the router's. A hint that does not decode goes
  to ``nexuskv.dead-letter``; one that cannot be honoured is logged with the reason.
* **out** — ``nexuskv.kv-events`` batches of the manager's publisher (the worker's name: every
  block admitted, moved or dropped), so the index holds what the tiers hold; and, every
  ``NEXUSKV_TIER_STATE_INTERVAL`` seconds, one ``nexuskv.tier-state`` record per managed tier —
  usage, pinned and in-flight bytes, and the displacement price planners charge a prefetch.

Transfer commands go through :class:`~streams.transfer_executor.TransferService` as before.

An engine adapter that writes tiers of its own (the vLLM connector's worker disk, the SGLang
backend's tier) does the same in its own process: a :class:`~nexuskv.dataplane.tiers.TierManager`
over its tiers, saving with :meth:`~nexuskv.dataplane.tiers.TierManager.save` (a
:class:`~nexuskv.dataplane.tiers.SaveOutcome` says what was admitted, refused and why), reading
with :meth:`~nexuskv.dataplane.tiers.TierManager.read`, and a :class:`TierBus` on its bus loop.

Its tasks are supervised (:mod:`streams.supervisor`): one that fails stops the service, which
exits 1 (``nexuskv up`` then names it); readiness waits for the hints' and commands' partitions.
On SIGINT/SIGTERM the service stops the executor (queued and running copies get ``cancelled``
results), publishes a last state, and writes ``tiers/<worker>/audit.json`` under
``NEXUSKV_DATA_DIR``: what each tier holds (announced, by key), what the ledger and the tiers
disagree on (nothing, when it is right) and the counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from nexuskv.admission import EVICTION_POLICIES, ReuseModel, block_gains
from nexuskv.config import BrokerUrl, Settings
from nexuskv.contracts.keyed_events import KeyedBatch
from nexuskv.contracts.placement import HintKind, PlacementHint
from nexuskv.contracts.tier_state import TierStateRecord
from nexuskv.contracts.topics import PLACEMENT, TIER_STATE
from nexuskv.cost import CostModel, page_bytes_of
from nexuskv.dataplane.executor import TransferExecutor
from nexuskv.dataplane.payload import PayloadKey
from nexuskv.dataplane.tier_facts import TierFacts
from nexuskv.dataplane.tiers import GainFn, TierManager
from nexuskv.descriptor import StateDescriptor, Tier
from nexuskv.errors import ConfigError, ContractError, NexusKVError
from nexuskv.policy import ExecutionPolicy
from streams.bus.clients import (
    ControlVerifier,
    check_control,
    control_verifier,
    dead_letter_for,
    decode_record,
    make_consumer,
    make_producer,
    send,
    send_dead_letter,
)
from streams.bus.health import HEALTH
from streams.bus.metrics import METRICS
from streams.bus.outbox import EventOutbox
from streams.bus.topic_keys import route
from streams.supervisor import Supervisor, run_service
from streams.telemetry import init_service

__all__ = ["SERVICE", "TierBus", "cost_model_gains", "handle_hint", "state_records", "write_audit", "main"]

log = logging.getLogger("nexuskv.tier_manager")
SERVICE = "tier-manager"


def cost_model_gains(model: Callable[[], CostModel], descriptors: Callable[[str], StateDescriptor | None], *,
                     profile: str, tiers: tuple[Tier, ...]) -> GainFn:
    """Per-block EG from the current cost model (:func:`nexuskv.admission.block_gains`).

    A descriptor this process does not know, or a model without a compute cost on ``profile``,
    values every tier at 1 s per block (utilities then rank by reuse and bytes alone); a tier
    without a link to the GPU in the cost model cannot serve a reuse and is worth nothing.
    """
    cache: dict[tuple, Mapping[Tier, float]] = {}

    def gains(key: PayloadKey, position: int, nbytes: int) -> Mapping[Tier, float]:
        m = model()
        d = descriptors(key.descriptor_id)
        if d is None:
            return {t: 1.0 for t in tiers}
        memo = (m.version, key.descriptor_id, position, nbytes)
        hit = cache.get(memo)
        if hit is not None:
            return hit
        compute = m.compute_for(d.model, profile)
        links = {t: (None if t is Tier.GPU else m.link(profile, t, Tier.GPU, page_bytes_of(nbytes, 1))) for t in tiers}
        usable = {t: link for t, link in links.items() if t is Tier.GPU or link is not None}
        out = block_gains(compute, usable, block_tokens=d.block_size, position=position, nbytes=nbytes)
        if len(cache) > 65_536:
            cache.clear()
        cache[memo] = out
        return out
    return gains


def _keys(hint: PlacementHint) -> list[PayloadKey]:
    if not hint.keys or hint.descriptor_id is None:
        return []
    return [PayloadKey(hint.descriptor_id, k, hint.group) for k in hint.keys]


def _refused(hint: PlacementHint, reason: str, detail: str, blocks: int = 1) -> None:
    """Count (``nexuskv_hints_refused``) and log a hint, or some of its blocks, left undone."""
    METRICS.hints_refused.labels(hint.kind.value, reason).inc(blocks)
    log.warning("hint %s (%s, tenant %s): %s", hint.hint_id[:80], hint.kind.value, hint.tenant_namespace[:80], detail)


def _reason_code(why: str) -> str:
    """The metric label of a TierManager refusal (its reasons start with a known word where they can)."""
    head = why.split(":", 1)[0].strip()
    return {"prefetch share": "size", "tenant": "tenant", "nothing to reserve": "expiry"}.get(head, "other")


def handle_hint(hint: PlacementHint, manager: TierManager, executor: TransferExecutor | None, *,
                worker: str) -> str | None:
    """Act on one hint addressed to ``worker``; returns what was done (None: not this worker's, or a route).

    A hint acts only within the tenant scope it names (:mod:`nexuskv.dataplane.tiers`: pins,
    unpins, demotions, evictions and releases touch that tenant's blocks and room only), an evict or
    demote never touches pinned, busy or anchored state, and a prefetch's room is bounded in size
    and time by the manager; whatever a hint could not do is counted on ``nexuskv_hints_refused``
    (by kind and reason) and logged with the reason."""
    if hint.worker != worker or hint.kind is HintKind.ROUTE:
        return None
    kind = hint.kind
    tenant = hint.tenant_namespace
    if kind is HintKind.CANCEL:
        released = manager.release(hint.transfer_id, tenant=tenant) if hint.transfer_id else False
        stopped = executor.cancel(hint.transfer_id, f"cancelled: {hint.reason}", tenant=tenant) \
            if executor and hint.transfer_id else False
        return f"cancel {hint.transfer_id}: {'stopping the copy' if stopped else 'not running here'}" + (
            ", its room released" if released else "")
    if kind is HintKind.PIN:
        until = hint.expires_at if hint.expires_at is not None else hint.issued_at
        owner = hint.transfer_id or hint.hint_id
        out = manager.pin(owner, _keys(hint), until=until, tenant=tenant, tier=hint.tier)
        if not out.ok or "tenant:" in out.reason:
            _refused(hint, "tenant" if "tenant:" in out.reason else "quota", f"pin {owner}: {out.reason}")
        return f"pin {owner}: {out.reason}"
    if kind is HintKind.UNPIN:
        owner = hint.transfer_id or hint.hint_id.removesuffix("/unpin")
        return f"unpin {owner}: {manager.unpin(owner, tenant=tenant)} blocks"
    if kind is HintKind.PREFETCH:
        if hint.transfer_id is None or hint.tier is None or hint.bytes <= 0 or hint.expires_at is None:
            _refused(hint, "other", "prefetch hint without transfer, tier, bytes or expiry")
            return "prefetch hint without transfer, tier, bytes or expiry: nothing to reserve"
        shortened = manager.counters["reservations_shortened"]
        why = manager.reserve(hint.transfer_id, hint.tier, hint.bytes, tenant=tenant, expires_at=hint.expires_at)
        if manager.counters["reservations_shortened"] > shortened:
            _refused(hint, "expiry", f"prefetch {hint.transfer_id}: expiry {hint.expires_at:.3f} cut to "
                                     f"{manager.prefetch_max_s:.0f} s from now")
        if why is not None:
            _refused(hint, _reason_code(why), f"prefetch {hint.transfer_id}: no room held ({why})")
        return f"prefetch {hint.transfer_id}: " + ("room held" if why is None else f"no room held ({why})")
    keys = _keys(hint) or (manager.landed_keys(hint.transfer_id) if hint.transfer_id else [])
    if hint.tier is None:
        _refused(hint, "no_tier", f"{kind.value} hint without a tier")
        return f"{kind.value} hint without a tier"
    if kind is HintKind.DEMOTE:
        to = hint.to_tier or Tier.HOST
        effect = manager.demote(keys, hint.tier, to, tenant=tenant)
        done = f"demote {len(keys)} blocks {hint.tier.value} -> {to.value}: {effect.describe()} moved"
    elif kind is HintKind.EVICT:
        effect = manager.evict(keys, hint.tier, tenant=tenant)
        done = f"evict {len(keys)} blocks from {hint.tier.value}: {effect.describe()} dropped"
    else:
        return None
    for reason, n in effect.refused.items():
        METRICS.hints_refused.labels(kind.value, reason).inc(n)
    if effect.refused:
        log.warning("hint %s (%s, tenant %s): %s", hint.hint_id[:80], kind.value, tenant[:80], done)
    return done


def state_records(manager: TierManager, *, now: float) -> list[TierStateRecord]:
    return [TierStateRecord(worker=u.worker, tier=u.tier, backend=u.backend, policy=manager.policy.name,
                            capacity_bytes=u.capacity_bytes, used_bytes=u.used_bytes, reserved_bytes=u.reserved_bytes,
                            pinned_bytes=u.pinned_bytes, in_flight_bytes=u.in_flight_bytes, blocks=u.blocks,
                            unannounced_blocks=u.unannounced_blocks, price_s_per_gib=u.price_s_per_gib,
                            price_bytes=u.price_bytes, counters=dict(u.counters), published_at=now)
            for u in manager.usage()]


def write_audit(manager: TierManager, path: Path) -> dict:
    """What the tiers hold, what the ledger disagrees on, and the counters, as JSON at ``path``."""
    contents = {f"{tier.value}/g{group}": sorted(f"{k.descriptor_id}/{k.key:032x}" for k in keys)
                for (tier, group), keys in manager.contents().items()}
    held = {b.label: len(b.keys()) for b in manager.backends()}
    doc = {"worker": manager.worker, "publisher": manager.facts.publisher,
           "incarnation": manager.facts.incarnation, "policy": manager.policy.name, "contents": contents,
           "held_blocks": held, "ledger_vs_tiers": {k: list(v) for k, v in manager.audit().items()},
           "usage": [json.loads(r.model_dump_json()) for r in state_records(manager, now=time.time())],
           "counters": dict(manager.counters), "batches": manager.facts.batches}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
    tmp.replace(path)
    return doc


class TierBus:
    """A tier manager on the bus: hints in; its tier events and tier state out; ``run`` until ``stop``.

    ``publish_batch`` is the thread-safe hook to give the manager's :class:`TierFacts`: batches are
    queued from any thread and sent in order by one task, each acknowledged before the next.
    """

    def __init__(self, url: BrokerUrl, manager: TierManager, *, worker: str,
                 executor: TransferExecutor | None = None, state_interval_s: float = 1.0,
                 group_id: str | None = None, clock: Callable[[], float] = time.time,
                 heartbeat: bool = True, verifier: ControlVerifier | None = None) -> None:
        self.url = url
        # A hint is acted on only when a planner signed it and it was not taken before (under a bus
        # secret; nexuskv.contracts.control_signature). From the environment unless given.
        self.verifier = verifier if verifier is not None else control_verifier(Settings.from_env())
        self.manager = manager
        self.worker = worker
        self.executor = executor
        self.state_interval_s = state_interval_s
        self.group_id = group_id or f"nexuskv-{SERVICE}-{worker}"
        self.clock = clock
        self.heartbeat = heartbeat  # False where another supervisor of this process beats it
        self.ready = asyncio.Event()
        self.hints = 0
        self.rejected = 0
        self.outbox = EventOutbox()  # the tier facts' batches, from the ledger's threads

    def publish_batch(self, batch: KeyedBatch) -> None:
        """Queue one batch of the manager's publisher (any thread)."""
        self.outbox.put(batch)

    @property
    def batches_sent(self) -> int:
        return self.outbox.sent

    async def run(self, stop: asyncio.Event) -> None:
        self.outbox.bind()
        client = f"{SERVICE}-{self.worker}-{uuid.uuid4().hex[:6]}"
        producer = make_producer(self.url, client_id=client)
        await producer.start()
        consumer = make_consumer(self.url, PLACEMENT, client_id=client, group_id=self.group_id,
                                 auto_offset_reset="latest")
        await consumer.start()
        supervisor = Supervisor(SERVICE, heartbeat=self.heartbeat)
        supervisor.spawn(self.outbox.run(producer), name=f"{client}-events")
        supervisor.spawn(self._states(producer), name=f"{client}-state")
        supervisor.spawn(self._hints(consumer, producer), name=f"{client}-hints")
        try:
            await supervisor.until(stop)  # a failed task raises ServiceFailed: the service exits 1
        finally:
            await supervisor.stop()
            await self._drain(producer)
            with contextlib.suppress(Exception):
                for r in state_records(self.manager, now=self.clock()):
                    await send(producer, *route(r), r)
            await consumer.stop()
            await producer.stop()

    async def _hints(self, consumer, producer: AIOKafkaProducer) -> None:
        while True:
            batch = await consumer.getmany(timeout_ms=200, max_records=512)
            if consumer.assignment() and not self.ready.is_set():
                self.ready.set()
                HEALTH.set_ready("placement", True, "partitions assigned")
            for records in batch.values():
                for record in records:
                    await self._hint(producer, record)
            if batch:
                try:
                    await consumer.commit()
                except KafkaError as exc:  # not committed now: a restart re-reads hints, which are idempotent
                    log.warning("hint offsets not committed (%s: %s)", type(exc).__name__, exc)

    async def _hint(self, producer: AIOKafkaProducer, record) -> None:
        try:
            check_control(self.verifier, PLACEMENT, record, now=self.clock(), service=SERVICE)
            hint = decode_record(PLACEMENT, record)
        except ContractError as exc:
            self.rejected += 1
            letter = dead_letter_for(PLACEMENT.name, record, exc, service=SERVICE, now=self.clock())
            await send_dead_letter(producer, letter)
            log.warning("placement record %d/%d refused: %s", record.partition, record.offset, letter.reason)
            return
        if not isinstance(hint, PlacementHint) or hint.worker != self.worker or hint.kind is HintKind.ROUTE:
            return
        try:
            done = await asyncio.to_thread(handle_hint, hint, self.manager, self.executor, worker=self.worker)
        except NexusKVError as exc:
            log.warning("hint %s (%s) not honoured: %s", hint.hint_id, hint.kind.value, exc)
            return
        if done is not None:
            self.hints += 1
            log.debug("hint %s: %s", hint.hint_id, done)

    async def _drain(self, producer: AIOKafkaProducer) -> None:
        await asyncio.to_thread(self.manager.flush)
        await self.outbox.drain(producer)

    async def _states(self, producer: AIOKafkaProducer) -> None:
        while True:
            await asyncio.to_thread(self.manager.tick)
            now = self.clock()
            for r in await asyncio.to_thread(state_records, self.manager, now=now):
                await send(producer, TIER_STATE, r.key, r)
                METRICS.tier_bytes.labels(r.tier.value, "used").set(r.used_bytes)
                METRICS.tier_bytes.labels(r.tier.value, "reserved").set(r.reserved_bytes)
                METRICS.tier_bytes.labels(r.tier.value, "pinned").set(r.pinned_bytes)
                METRICS.tier_bytes.labels(r.tier.value, "capacity").set(r.capacity_bytes)
            await asyncio.sleep(self.state_interval_s)


def build(settings: Settings, *, publish: Callable[[KeyedBatch], None],
          model: Callable[[], CostModel] | None = None) -> tuple[TierManager, TransferExecutor]:
    """This worker's tiers under a tier manager, and the executor that copies into them."""
    from nexuskv.models import DescriptorRegistry
    from streams.transfer_executor import catalog_from_settings

    catalog = catalog_from_settings(settings)
    policy = EVICTION_POLICIES[settings.tier_policy]()
    descriptors = DescriptorRegistry.with_known_models()
    execution = ExecutionPolicy(version="builtin")
    profile = execution.planner.default_hardware_profile
    if model is None:
        from nexuskv.profiles import shipped_cost_model

        shipped = shipped_cost_model()
        model = lambda: shipped
    tiers = tuple(b.capabilities.tier for b in catalog.backends if not b.capabilities.shared)
    gains = cost_model_gains(model, descriptors.get, profile=profile, tiers=tiers)
    facts = TierFacts(settings.worker, publish, include_tokens=settings.kv_event_tokens)
    manager = TierManager(catalog, facts=facts, policy=policy, reuse=ReuseModel(settings.tier_reuse_half_life_s),
                          gains=gains, pin_fraction=settings.tier_pin_fraction, lease_s=settings.tier_lease_s,
                          tenant_pin_quota=lambda tenant: execution.quota_for(tenant).max_pinned_bytes,
                          prefetch_fraction=settings.tier_prefetch_fraction, prefetch_max_s=settings.tier_prefetch_max_s)
    executor = TransferExecutor(catalog, lanes=settings.transfer_lanes, jobs=settings.transfer_jobs, tiers=manager)
    return manager, executor


async def serve(settings: Settings, url: BrokerUrl, stop: asyncio.Event) -> TierManager:
    from nexuskv.profiles import shipped_cost_model
    from streams.bus.cost_models import CostModelReplica
    from streams.transfer_executor import TransferService

    replica = CostModelReplica(url, shipped_cost_model(), service=f"{SERVICE}-{settings.worker}")
    holder: list[TierBus] = []
    manager, executor = build(settings, publish=lambda b: holder[0].publish_batch(b), model=lambda: replica.model)
    bus = TierBus(url, manager, worker=settings.worker, executor=executor,
                  state_interval_s=settings.tier_state_interval_s, heartbeat=False)
    holder.append(bus)
    for b in manager.backends():
        c = b.capabilities
        log.info("tier %s: %s, %d bytes, device %s, policy %s%s", c.tier.value, b.label, b.capacity_bytes, c.device,
                 manager.policy.name, f" ({c.note})" if c.note else "")
    transfers = TransferService(url, executor, worker=settings.worker)
    await replica.start(timeout_s=settings.broker_start_timeout_s)
    cost_producer = make_producer(url, client_id=f"{SERVICE}-{settings.worker}-cost-models")
    await cost_producer.start()
    models = Supervisor(SERVICE, heartbeat=False)  # the transfer service's supervisor beats the heartbeat
    models.spawn(replica.run(cost_producer), name="tier-manager-cost-models")
    tasks = [asyncio.create_task(bus.run(stop), name="tier-bus"),
             asyncio.create_task(transfers.run(stop), name="transfer-service"),
             asyncio.create_task(models.until(stop), name="cost-models")]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        stop.set()  # one part stopped (or broke): stop the others, then report what broke
        await asyncio.wait(tasks)
        for t in tasks:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
    finally:
        await models.stop()
        await replica.stop()
        await cost_producer.stop()
        manager.close()
        write_audit(manager, Path(settings.data_dir) / "tiers" / settings.worker / "audit.json")
    return manager


def main() -> int:
    try:
        settings = Settings.from_env()
        init_service(SERVICE, settings)
        url = settings.broker_url
        if url is None:
            raise ConfigError("NEXUSKV_BROKER", "the tier manager needs a broker (nexuskv up sets it)")
    except NexusKVError as exc:
        print(f"nexuskv tier manager: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1

    async def run(stop: asyncio.Event) -> None:
        await serve(settings, url, stop)

    return run_service(SERVICE, run)


if __name__ == "__main__":
    sys.exit(main())
