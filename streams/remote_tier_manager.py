"""``python -m streams.remote_tier_manager``: the one owner of the shared remote tier's capacity.

Every worker reads and writes the remote tier (Mooncake Store, ``NEXUSKV_REMOTE_TIER``), and every
worker's tier manager passes it through unmanaged (its capacity is shared). This service owns it,
with a :class:`~nexuskv.dataplane.remote_ledger.RemoteLedger` deciding by the local tiers' utility
(expected gain per byte from the cost model's remote -> GPU link, decayed reuse; pinned and
in-flight blocks kept), per-tenant quotas (``NEXUSKV_REMOTE_TIER_TENANT_QUOTAS``) and a low/high
watermark of free headroom (``NEXUSKV_REMOTE_TIER_LOW_WATERMARK``/``_HIGH_WATERMARK``), so
writers' puts find room and a full store evicts by utility instead of refusing every save.
On the bus (:class:`RemoteTierBus`):

* **in** — ``nexuskv.tier-offers``: a writer put its objects and offers them; the owner reads
  each object's stored header back (it must name the offered key, size and checksum), then
  admits it or refuses it (deleting the object), evicting cheaper blocks where it must.
  ``nexuskv.placement`` pin/unpin hints addressed to the owner (the planner pins a transfer's
  remote source), ``nexuskv.transfers`` commands that read the remote tier (their blocks stay
  until the deadline or their ``nexuskv.transfer-results`` record). Under a bus secret each of
  these is taken only when signed by a producer its topic entitles (offers: ``writer/<worker>``;
  :mod:`nexuskv.contracts.control_signature`), once. A record that does not decode or is refused
  goes to ``nexuskv.dead-letter`` with the reason (transfers and results refused here are only
  ignored: their consumers dead-letter them).
* **out** — ``nexuskv.kv-events`` batches under the owner's own publisher
  (``NEXUSKV_REMOTE_TIER_OWNER``): every block admitted, evicted, collected or lost, so the index
  holds what the store holds; and every ``NEXUSKV_TIER_STATE_INTERVAL`` seconds one
  ``nexuskv.tier-state`` record for the remote tier (worker = the owner's name): usage, unoffered
  bytes (as reserved), pinned and in-flight bytes, and its displacement price.

Every few seconds it lists the store: objects no offer named within
``NEXUSKV_REMOTE_TIER_OFFER_LEASE`` seconds are collected (a writer that died between its put
and its offer, an executor's copy into the remote tier, which carries keys, not identities);
blocks the ledger holds but the store lost are announced removed. At start the store's objects
are unoffered (the ledger is not kept across processes): they are collected after the lease.
On SIGINT/SIGTERM it publishes a last state and writes ``tiers/<owner>/audit.json`` under
``NEXUSKV_DATA_DIR``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from nexuskv.admission import EVICTION_POLICIES, ReuseModel, block_gains
from nexuskv.config import BrokerUrl, Settings
from nexuskv.contracts.keyed_events import KeyedBatch
from nexuskv.contracts.placement import HintKind, PlacementHint
from nexuskv.contracts.tier_offers import TierOffer
from nexuskv.contracts.tier_state import TierStateRecord
from nexuskv.contracts.topics import PLACEMENT, TIER_OFFERS, TIER_STATE, TRANSFER_RESULTS, TRANSFERS
from nexuskv.contracts.transfers import TransferCommand, TransferResult
from nexuskv.cost import CostModel
from nexuskv.dataplane.backend import TierBackend
from nexuskv.dataplane.payload import HEADER_BYTES, PayloadKey
from nexuskv.dataplane.remote_ledger import (
    HeadroomDecision,
    OfferDecision,
    OfferedBlock,
    RemoteGainFn,
    RemoteLedger,
    SweepDecision,
)
from nexuskv.dataplane.tier_facts import BlockIdentity, TierChange, TierFacts
from nexuskv.descriptor import StateDescriptor, Tier
from nexuskv.errors import ConfigError, ContractError, NexusKVError, TierUnavailableError
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
from streams.supervisor import Supervisor, run_service
from streams.telemetry import init_service

__all__ = ["SERVICE", "RemoteTierBus", "RemoteTierOwner", "main", "remote_gains"]

log = logging.getLogger("nexuskv.remote_tier_manager")
SERVICE = "remote-tier-manager"


def remote_gains(model: Callable[[], CostModel], descriptors: Callable[[str], StateDescriptor | None], *,
                 profile: str) -> RemoteGainFn:
    """EG in seconds of reusing one block from the remote tier (:func:`nexuskv.admission.block_gains`
    over the cost model's remote -> GPU link on ``profile``). Without a descriptor, a compute cost or
    that link (never observed, nothing shipped) every block is worth 1 s: utilities then rank by
    reuse and bytes alone, rather than refusing everything as worthless."""
    cache: dict[tuple, float] = {}

    def gains(key: PayloadKey, position: int, nbytes: int) -> float:
        m = model()
        d = descriptors(key.descriptor_id)
        link = m.link(profile, Tier.REMOTE, Tier.GPU)
        if d is None or link is None:
            return 1.0
        memo = (m.version, key.descriptor_id, position, nbytes)
        hit = cache.get(memo)
        if hit is None:
            compute = m.compute_for(d.model, profile)
            hit = block_gains(compute, {Tier.REMOTE: link}, block_tokens=d.block_size, position=position,
                              nbytes=nbytes)[Tier.REMOTE]
            if len(cache) > 65_536:
                cache.clear()
            cache[memo] = hit
        return hit
    return gains


class RemoteTierOwner:
    """The ledger acting on the store: checks offers against stored headers, deletes what leaves,
    and hands every change to the owner's publisher. Thread-safe.

    An offer's header checks, the ledger's decision and its deletes run as one step (``_act``),
    and so do the housekeeping rounds: otherwise an offer checked before a round evicted its block,
    and admitted after, would be held by the ledger while the round deletes its object. Pins and
    transfers only touch the ledger (``_lock``), so the bus loop never waits for the store."""

    def __init__(self, backend: TierBackend, ledger: RemoteLedger, facts: TierFacts, *, name: str,
                 clock: Callable[[], float] = time.time) -> None:
        self.backend = backend
        self.ledger = ledger
        self.facts = facts
        self.name = name
        self.clock = clock
        self._lock = threading.Lock()
        self._act = threading.Lock()
        self.counters: dict[str, int] = dict.fromkeys(
            ("offers", "blocks_offered", "header_mismatch", "deleted", "delete_failed", "sweeps"), 0)

    # -- offers -----------------------------------------------------------------------------------

    def handle_offer(self, offer: TierOffer) -> OfferDecision:
        """Check each offered object's stored header, then let the ledger decide; delete what it
        refused or evicted; announce the rest. A block whose object is missing or is not what the
        writer offered is refused and left alone (it is not the writer's to delete; unoffered, it is
        collected after the lease)."""
        with self._act:
            return self._handle_offer(offer)

    def _handle_offer(self, offer: TierOffer) -> OfferDecision:
        keys = [PayloadKey(offer.descriptor_id, b.key, offer.group) for b in offer.blocks]
        heads = self.backend.headers(keys)
        checked: list[OfferedBlock] = []
        mismatched: list[tuple[PayloadKey, str]] = []
        for key, b, head in zip(keys, offer.blocks, heads):
            if head is None:
                mismatched.append((key, "no object of it in the store"))
                continue
            if head.nbytes != b.nbytes or head.checksum != b.checksum:
                mismatched.append((key, (f"the stored header ({head.nbytes} bytes, checksum {head.checksum:032x}) "
                                        f"is not the offered one ({b.nbytes} bytes, {b.checksum:032x})")))
                continue
            identity = BlockIdentity(offer.identity, (), offer.block_size, parent=b.parent,
                                     tenant_namespace=offer.tenant_namespace
                                     if offer.tenant_namespace != offer.identity.tenant_namespace else None,
                                     lora=offer.lora, cache_salt=offer.cache_salt)
            checked.append(OfferedBlock(key, b.nbytes, b.position, identity))
        self.counters["offers"] += 1
        self.counters["blocks_offered"] += len(keys)
        self.counters["header_mismatch"] += len(mismatched)
        with self._lock:
            decision = self.ledger.offer(checked, offer_id=offer.offer_id, tenant=offer.tenant_namespace,
                                         now=self.clock())
            self._announce(decision.changes)
        self._delete(decision.delete)
        self.facts.flush()
        for outcome, n in (("admitted", len(decision.admitted)), ("already", len(decision.already)),
                           ("refused", len(decision.refused) + len(mismatched)), ("evicted", len(decision.evicted))):
            if n:
                METRICS.remote_tier_blocks.labels(outcome).inc(n)
        for key, why in [*mismatched, *decision.refused]:
            log.info("offer %s from %s: block %s refused: %s", offer.offer_id, offer.writer, key, why)
        if mismatched:
            decision = OfferDecision(decision.offer_id, decision.tenant, decision.admitted, decision.already,
                                     tuple(mismatched) + decision.refused, decision.evicted, decision.changes)
        return decision

    def _announce(self, changes: tuple[TierChange, ...]) -> None:
        if changes:
            self.facts.apply(changes)  # under the lock: in the order the ledger made them

    def _delete(self, keys) -> None:
        for key in keys:
            try:
                self.backend.delete(key)
                self.counters["deleted"] += 1
            except TierUnavailableError as exc:  # still in the store: unoffered now, collected by a sweep
                self.counters["delete_failed"] += 1
                log.warning("deleting %s from the remote tier failed: %s", key, exc)

    # -- time -------------------------------------------------------------------------------------

    def keep_headroom(self) -> HeadroomDecision:
        with self._act:
            return self._keep_headroom()

    def _keep_headroom(self) -> HeadroomDecision:
        used = self.backend.used_bytes()
        with self._lock:
            decision = self.ledger.keep_headroom(used, now=self.clock())
            self._announce(decision.changes)
        self._delete(decision.delete)
        self.facts.flush()
        if decision.evicted:
            METRICS.remote_tier_blocks.labels("evicted").inc(len(decision.evicted))
            log.info("headroom: store at %d bytes > %d: %d blocks evicted by utility%s", used,
                     self.ledger.high_bytes, len(decision.evicted),
                     f" ({decision.short_bytes} bytes short: pinned, read, chained from or not offered yet)"
                     if decision.short_bytes else "")
        return decision

    def sweep(self) -> SweepDecision:
        """List the store and reconcile: collect what no one offered within the lease, forget what is gone."""
        with self._act:
            return self._sweep()

    def _sweep(self) -> SweepDecision:
        listed_at = self.clock()
        keys = self.backend.keys()
        with self._lock:
            unknown = [k for k in keys if not self.ledger.holds(k)]
        sizes = {k: (h.nbytes + HEADER_BYTES if h is not None else HEADER_BYTES)
                 for k, h in zip(unknown, self.backend.headers(unknown) if unknown else [])}
        listed = {k: sizes.get(k, 0) for k in keys}
        with self._lock:
            decision = self.ledger.sweep(listed, listed_at=listed_at, now=self.clock())
            self._announce(decision.changes)
        self._delete(decision.collected)
        self.facts.flush()
        self.counters["sweeps"] += 1
        for outcome, n in (("collected", len(decision.collected)), ("lost", len(decision.lost))):
            if n:
                METRICS.remote_tier_blocks.labels(outcome).inc(n)
        if decision.collected or decision.lost:
            log.info("sweep: %d unoffered objects collected, %d lost blocks forgotten", len(decision.collected),
                     len(decision.lost))
        return decision

    # -- hints and transfers ----------------------------------------------------------------------

    def hint(self, hint: PlacementHint) -> str | None:
        """A pin or unpin addressed to the owner; None for anything else."""
        if hint.worker != self.name or hint.kind not in (HintKind.PIN, HintKind.UNPIN):
            return None
        now = self.clock()
        with self._lock:
            if hint.kind is HintKind.UNPIN:
                owner = hint.transfer_id or hint.hint_id.removesuffix("/unpin")
                return f"unpin {owner}: {self.ledger.unpin(owner)} blocks"
            keys = [PayloadKey(hint.descriptor_id, k, hint.group) for k in hint.keys] if hint.descriptor_id else []
            until = hint.expires_at if hint.expires_at is not None else hint.issued_at
            _ok, why = self.ledger.pin(hint.transfer_id or hint.hint_id, keys, until=until, now=now)
        return f"pin: {why}"

    def transfer(self, command: TransferCommand) -> int:
        """A command reading the remote tier: its blocks stay until its deadline or its result."""
        if command.source.tier is not Tier.REMOTE:
            return 0
        keys = [PayloadKey(command.descriptor_id, k, command.source.group) for k in command.keys]
        with self._lock:
            return self.ledger.reading(command.transfer_id, keys, until=command.deadline_at, now=self.clock())

    def result(self, result: TransferResult) -> int:
        if result.source.tier is not Tier.REMOTE:
            return 0
        with self._lock:
            return self.ledger.done(result.transfer_id)

    # -- state ------------------------------------------------------------------------------------

    def state_record(self) -> TierStateRecord:
        now = self.clock()
        with self._lock:
            u = self.ledger.usage(now)
        counters = {**u.counters, **{f"store_{k}": v for k, v in self.counters.items()}}
        return TierStateRecord(
            worker=self.name, tier=Tier.REMOTE, backend=self.backend.label, policy=self.ledger.policy.name,
            capacity_bytes=u.capacity_bytes, used_bytes=u.used_bytes, reserved_bytes=u.unoffered_bytes,
            pinned_bytes=u.pinned_bytes, in_flight_bytes=u.in_flight_bytes, blocks=u.blocks,
            unannounced_blocks=u.unoffered_blocks, price_s_per_gib=u.price_s_per_gib, price_bytes=u.price_bytes,
            counters=counters, published_at=now)

    def audit(self, path: Path) -> dict:
        """What the ledger holds and the store lists, and the counters, as JSON at ``path``."""
        with self._lock:
            held = {f"remote/g{g}": sorted(f"{k.descriptor_id}/{k.key:032x}" for k in keys)
                    for g, keys in self.ledger.contents().items()}
            mine = set(self.ledger.keys())
        try:
            real = set(self.backend.keys())
            disagree = [len(mine - real), len(real - mine)]
        except TierUnavailableError as exc:
            disagree = None
            log.warning("audit: the store cannot be listed: %s", exc)
        doc = {"owner": self.name, "publisher": self.facts.publisher, "incarnation": self.facts.incarnation,
               "contents": held, "ledger_vs_store": disagree,
               "state": json.loads(self.state_record().model_dump_json()),
               "counters": dict(self.ledger.counters), "store_counters": dict(self.counters),
               "batches": self.facts.batches}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
        tmp.replace(path)
        return doc


class RemoteTierBus:
    """The owner on the bus: offers, pins and transfers in; its tier events and tier state out."""

    def __init__(self, url: BrokerUrl, owner: RemoteTierOwner, *, state_interval_s: float = 1.0,
                 sweep_interval_s: float = 5.0, group_id: str | None = None,
                 clock: Callable[[], float] = time.time, verifier: ControlVerifier | None = None) -> None:
        self.url = url
        self.owner = owner
        self.state_interval_s = state_interval_s
        self.sweep_interval_s = sweep_interval_s
        self.group_id = group_id or f"nexuskv-{SERVICE}"
        self.clock = clock
        # Offers, hints, commands and results are taken only when a producer their topic entitles
        # signed them, once (under a bus secret; from the environment unless given).
        self.verifier = verifier if verifier is not None else control_verifier(Settings.from_env())
        self._signals_verifier = control_verifier(Settings.from_env()) if verifier is None else verifier
        self.ready = asyncio.Event()
        self.offers = 0
        self.rejected = 0
        self.outbox = EventOutbox()  # the tier facts' batches, from the ledger's threads

    def publish_batch(self, batch: KeyedBatch) -> None:
        """Queue one batch of the owner's publisher (any thread); sent in order by one task."""
        self.outbox.put(batch)

    @property
    def batches_sent(self) -> int:
        return self.outbox.sent

    async def run(self, stop: asyncio.Event) -> None:
        self.outbox.bind()
        client = f"{SERVICE}-{uuid.uuid4().hex[:6]}"
        producer = make_producer(self.url, client_id=client)
        await producer.start()
        offers = make_consumer(self.url, TIER_OFFERS, client_id=f"{client}-offers", group_id=self.group_id,
                               auto_offset_reset="earliest", enable_auto_commit=False)
        signals = make_consumer(self.url, PLACEMENT, TRANSFERS, TRANSFER_RESULTS, client_id=f"{client}-signals",
                                group_id=f"{self.group_id}-signals", auto_offset_reset="latest")
        await offers.start()
        await signals.start()
        supervisor = Supervisor(SERVICE)
        supervisor.spawn(self.outbox.run(producer), name=f"{client}-events")
        supervisor.spawn(self._states(producer), name=f"{client}-state")
        supervisor.spawn(self._offers(offers, producer), name=f"{client}-offers")
        supervisor.spawn(self._signals(signals, producer), name=f"{client}-signals")
        try:
            await supervisor.until(stop)
        finally:
            await supervisor.stop()
            await self._drain(producer)
            with contextlib.suppress(Exception):
                r = self.owner.state_record()
                await send(producer, TIER_STATE, r.key, r)
            await offers.stop()
            await signals.stop()
            await producer.stop()

    async def _offers(self, consumer, producer: AIOKafkaProducer) -> None:
        while True:
            batch = await consumer.getmany(timeout_ms=200, max_records=256)
            if consumer.assignment() and not self.ready.is_set():
                self.ready.set()
                HEALTH.set_ready("tier-offers", True, "partitions assigned")
            for records in batch.values():
                for record in records:
                    await self._offer(producer, record)
            if batch:
                try:
                    await consumer.commit()
                except KafkaError as exc:  # re-read after a restart: an offer of held blocks counts a use
                    log.warning("offer offsets not committed (%s: %s)", type(exc).__name__, exc)

    async def _offer(self, producer: AIOKafkaProducer, record) -> None:
        try:
            check_control(self.verifier, TIER_OFFERS, record, now=self.clock(), service=SERVICE)
            offer = decode_record(TIER_OFFERS, record)
        except ContractError as exc:
            await self._dead_letter(producer, TIER_OFFERS.name, record, exc)
            return
        assert isinstance(offer, TierOffer)
        try:
            decision = await asyncio.to_thread(self.owner.handle_offer, offer)
        except TierUnavailableError as exc:  # the store did not answer: nothing admitted; collected later
            log.warning("offer %s from %s not decided: %s", offer.offer_id, offer.writer, exc)
            METRICS.remote_tier_blocks.labels("undecided").inc(len(offer.blocks))
            return
        self.offers += 1
        log.debug("offer %s from %s: %d admitted, %d already, %d refused, %d evicted", offer.offer_id, offer.writer,
                  len(decision.admitted), len(decision.already), len(decision.refused), len(decision.evicted))

    async def _dead_letter(self, producer: AIOKafkaProducer, topic: str, record, exc: BaseException) -> None:
        self.rejected += 1
        METRICS.events_rejected.labels(SERVICE, topic).inc()
        await send_dead_letter(producer, dead_letter_for(topic, record, exc, service=SERVICE, now=self.clock()))
        log.warning("dead-lettered a %s record at offset %d: %s", topic, record.offset, exc)

    async def _signals(self, consumer, producer: AIOKafkaProducer) -> None:
        topics = {t.name: t for t in (PLACEMENT, TRANSFERS, TRANSFER_RESULTS)}
        while True:
            batch = await consumer.getmany(timeout_ms=200, max_records=512)
            for tp, records in batch.items():
                topic = topics[tp.topic]
                for record in records:
                    try:
                        check_control(self._signals_verifier, topic, record, now=self.clock(), service=SERVICE)
                        value = decode_record(topic, record)
                    except ContractError as exc:
                        if topic is PLACEMENT:  # transfers and results are dead-lettered by their owners
                            await self._dead_letter(producer, topic.name, record, exc)
                        continue
                    if isinstance(value, PlacementHint):
                        done = self.owner.hint(value)
                        if done is not None:
                            log.debug("hint %s: %s", value.hint_id, done)
                    elif isinstance(value, TransferCommand):
                        self.owner.transfer(value)
                    elif isinstance(value, TransferResult):
                        self.owner.result(value)

    async def _drain(self, producer: AIOKafkaProducer) -> None:
        await asyncio.to_thread(self.owner.facts.flush)
        await self.outbox.drain(producer)

    async def _states(self, producer: AIOKafkaProducer) -> None:
        last_sweep = 0.0
        while True:
            try:
                await asyncio.to_thread(self.owner.keep_headroom)
                if self.clock() - last_sweep >= self.sweep_interval_s:
                    await asyncio.to_thread(self.owner.sweep)
                    last_sweep = self.clock()
            except TierUnavailableError as exc:  # the store is down or slow: try again next round
                log.warning("remote tier housekeeping skipped: %s", exc)
            r = await asyncio.to_thread(self.owner.state_record)
            await send(producer, TIER_STATE, r.key, r)
            METRICS.tier_bytes.labels(Tier.REMOTE.value, "used").set(r.used_bytes)
            METRICS.tier_bytes.labels(Tier.REMOTE.value, "reserved").set(r.reserved_bytes)
            METRICS.tier_bytes.labels(Tier.REMOTE.value, "pinned").set(r.pinned_bytes)
            METRICS.tier_bytes.labels(Tier.REMOTE.value, "capacity").set(r.capacity_bytes)
            await asyncio.sleep(self.state_interval_s)


def build(settings: Settings, backend: TierBackend, *, publish: Callable[[KeyedBatch], None],
          model: Callable[[], CostModel] | None = None) -> RemoteTierOwner:
    """The owner of the store ``backend`` reaches, from settings."""
    from nexuskv.models import DescriptorRegistry
    from nexuskv.policy import ExecutionPolicy

    if model is None:
        from nexuskv.profiles import shipped_cost_model

        shipped = shipped_cost_model()
        model = lambda: shipped
    profile = ExecutionPolicy(version="builtin").planner.default_hardware_profile
    gains = remote_gains(model, DescriptorRegistry.with_known_models().get, profile=profile)
    ledger = RemoteLedger(backend.capacity_bytes, low_watermark=settings.remote_tier_low_watermark,
                          high_watermark=settings.remote_tier_high_watermark,
                          tenant_shares=settings.remote_tier_quota_shares, lease_s=settings.remote_tier_offer_lease_s,
                          policy=EVICTION_POLICIES[settings.tier_policy](),
                          reuse=ReuseModel(settings.tier_reuse_half_life_s), gains=gains,
                          pin_fraction=settings.tier_pin_fraction)
    facts = TierFacts(settings.remote_tier_owner, publish, include_tokens=settings.kv_event_tokens)
    return RemoteTierOwner(backend, ledger, facts, name=settings.remote_tier_owner)


async def serve(settings: Settings, url: BrokerUrl, stop: asyncio.Event) -> RemoteTierOwner:
    from nexuskv.dataplane.remote import RemoteBackend
    from nexuskv.profiles import shipped_cost_model
    from streams.bus.cost_models import CostModelReplica

    if not settings.remote_tier:
        raise ConfigError("NEXUSKV_REMOTE_TIER",
                          "the remote-tier manager needs the store's address (nexuskv up sets it)")
    backend = await asyncio.to_thread(RemoteBackend.connect, settings.remote_tier,
                                      wait_s=settings.broker_start_timeout_s, label="remote-mooncake")
    replica = CostModelReplica(url, shipped_cost_model(), service=SERVICE)
    holder: list[RemoteTierBus] = []
    owner = build(settings, backend, publish=lambda b: holder[0].publish_batch(b), model=lambda: replica.model)
    bus = RemoteTierBus(url, owner, state_interval_s=settings.tier_state_interval_s)
    holder.append(bus)
    log.info("remote tier %s: %d bytes, owner %s, watermarks %.2f/%.2f, tenant shares %s, offer lease %.0fs, "
             "policy %s", settings.remote_tier, backend.capacity_bytes, owner.name, settings.remote_tier_low_watermark,
             settings.remote_tier_high_watermark, settings.remote_tier_tenant_quotas,
             settings.remote_tier_offer_lease_s, owner.ledger.policy.name)
    await replica.start(timeout_s=settings.broker_start_timeout_s)
    cost_producer = make_producer(url, client_id=f"{SERVICE}-cost-models")
    await cost_producer.start()
    models = Supervisor(SERVICE, heartbeat=False)
    models.spawn(replica.run(cost_producer), name=f"{SERVICE}-cost-models")
    tasks = [asyncio.create_task(bus.run(stop), name="remote-tier-bus"),
             asyncio.create_task(models.until(stop), name="cost-models")]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        stop.set()
        await asyncio.wait(tasks)
        for t in tasks:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
    finally:
        await models.stop()
        await replica.stop()
        await cost_producer.stop()
        with contextlib.suppress(NexusKVError, OSError):
            owner.audit(Path(settings.data_dir) / "tiers" / owner.name / "audit.json")
        backend.close()
    return owner


def main() -> int:
    try:
        settings = Settings.from_env()
        init_service(SERVICE, settings)
        url = settings.broker_url
        if url is None:
            raise ConfigError("NEXUSKV_BROKER", "the remote-tier manager needs a broker (nexuskv up sets it)")
        if not settings.remote_tier:
            raise ConfigError("NEXUSKV_REMOTE_TIER", "the remote-tier manager needs the store's address")
    except NexusKVError as exc:
        print(f"nexuskv remote-tier manager: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1

    async def run(stop: asyncio.Event) -> None:
        await serve(settings, url, stop)

    return run_service(SERVICE, run)


if __name__ == "__main__":
    sys.exit(main())
