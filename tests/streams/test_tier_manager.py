"""The tier manager service: hints in, tier facts and tier state out, copies through its executor.

* Unit: every hint kind has a consumer (:func:`handle_hint`); a cancel stops a running copy
  between blocks, the destination is left as it was and its room is given back; the planner
  charges the price a tier manager published.
* Apache Kafka (``kafka_url``): the service's pieces over the real bus, tiers overfilled several
  times by saves through the in-process API: every save answered, usage within capacity, pins,
  prefetch room and cancels honoured from hints, and an index rebuilt from the published
  ``nexuskv.kv-events`` equal to what the tiers hold at the end.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest

from nexuskv.config import Settings
from nexuskv.contracts import encode
from nexuskv.contracts.decisions import Action
from nexuskv.contracts.keyed_events import KeyedBatch
from nexuskv.contracts.kv_events import KvEventBatch
from nexuskv.contracts.placement import HintKind
from nexuskv.contracts.plans import PlanRequest, WorkerLoad
from nexuskv.contracts.tier_state import TierStateRecord
from nexuskv.contracts.topics import KV_EVENTS, PLACEMENT, TIER_STATE, TRANSFER_RESULTS, TRANSFERS
from nexuskv.contracts.transfers import TransferResult, TransferStatus
from nexuskv.dataplane.catalog import BackendCatalog
from nexuskv.dataplane.executor import TransferExecutor
from nexuskv.dataplane.memory import DeviceMemoryBackend, HostMemoryBackend
from nexuskv.dataplane.tiers import TierManager
from nexuskv.descriptor import Tier
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.index import GlobalIndex
from nexuskv.models import DescriptorRegistry, known_model
from nexuskv.planner.core import PlannerCore
from nexuskv.policy import ExecutionPolicy
from nexuskv.profiles import shipped_cost_model
from streams.bus.clients import decode_record, make_consumer, make_producer, send
from streams.bus.topics import ensure_topics
from streams.tier_manager import TierBus, build, handle_hint
from streams.tier_prices import TierPriceReplica
from streams.transfer_executor import TransferService

from tests.control_records import command as _command
from tests.control_records import hint as _hint
from tests.dataplane.tiering import BLOCK_BYTES, chain_tokens, save_blocks
from tests.planning import KeyIndex

TIMEOUT_S = 60


def test_every_hint_kind_has_a_consumer():
    host = HostMemoryBackend(8 * BLOCK_BYTES, pin=False)
    device = DeviceMemoryBackend(8 * BLOCK_BYTES)
    catalog = BackendCatalog("w0", [device, host])
    manager = TierManager(catalog)
    ex = TransferExecutor(catalog, tiers=manager)
    try:
        chain = save_blocks(chain_tokens(1, 3))
        assert manager.save(chain, Tier.HOST, tenant="acme").ok
        keys = [b.key for b in chain]
        until = time.time() + 60
        assert handle_hint(_hint(HintKind.ROUTE, "w0"), manager, ex, worker="w0") is None
        assert handle_hint(_hint(HintKind.PIN, "other", keys=keys), manager, ex, worker="w0") is None
        assert "3 blocks pinned" in handle_hint(_hint(HintKind.PIN, "w0", keys=keys, transfer_id="t-1",
                                                      expires_at=until), manager, ex, worker="w0")
        assert next(u for u in manager.usage() if u.tier is Tier.HOST).pinned_bytes == 3 * BLOCK_BYTES
        assert "3 blocks" in handle_hint(_hint(HintKind.UNPIN, "w0", keys=keys, transfer_id="t-1"), manager, ex,
                                         worker="w0")
        assert next(u for u in manager.usage() if u.tier is Tier.HOST).pinned_bytes == 0
        done = handle_hint(_hint(HintKind.PREFETCH, "w0", tier=Tier.GPU, transfer_id="t-2", nbytes=2 * BLOCK_BYTES,
                                 expires_at=until), manager, ex, worker="w0")
        assert "room held" in done and device.free_bytes() == 6 * BLOCK_BYTES
        assert "released" in handle_hint(_hint(HintKind.CANCEL, "w0", tier=Tier.GPU, transfer_id="t-2"), manager, ex,
                                          worker="w0")
        assert device.free_bytes() == 8 * BLOCK_BYTES
        out = ex.submit(_command("t-3", "w0", keys, Tier.HOST, Tier.GPU)).result(30)
        assert out.status is TransferStatus.COMPLETED
        # A late copy: demote it (by the transfer it landed with), or evict it.
        assert "3 moved" in handle_hint(_hint(HintKind.DEMOTE, "w0", tier=Tier.GPU, transfer_id="t-3",
                                              to_tier=Tier.HOST), manager, ex, worker="w0")
        assert device.keys() == [] and len(host.keys()) == 3
        assert "3 dropped" in handle_hint(_hint(HintKind.EVICT, "w0", keys=keys, tier=Tier.HOST), manager, ex,
                                          worker="w0")
        assert host.keys() == []
    finally:
        ex.close()


def _refused(kind: str, reason: str) -> float:
    from streams.bus.metrics import REGISTRY

    return REGISTRY.get_sample_value("nexuskv_hints_refused_total", {"kind": kind, "reason": reason}) or 0.0


def test_a_hint_acts_only_in_the_tenant_scope_it_names():
    """The attack of issue 23: a hint naming another tenant's blocks evicted 32 of 32 of them."""
    host = HostMemoryBackend(64 * BLOCK_BYTES, pin=False)
    device = DeviceMemoryBackend(64 * BLOCK_BYTES)
    catalog = BackendCatalog("w0", [device, host])
    manager = TierManager(catalog)
    ex = TransferExecutor(catalog, tiers=manager)
    try:
        chain = save_blocks(chain_tokens(1, 32))
        assert manager.save(chain, Tier.HOST, tenant="acme").ok
        keys = [b.key for b in chain]
        before = {k: _refused(k, "tenant") for k in ("evict", "demote", "pin")}
        done = handle_hint(_hint(HintKind.EVICT, "w0", keys=keys, tenant="mallory"), manager, ex, worker="w0")
        assert "0 (left alone: 32 tenant) dropped" in done, done
        done = handle_hint(_hint(HintKind.DEMOTE, "w0", keys=keys, to_tier=Tier.DISK, tenant="mallory"), manager, ex,
                           worker="w0")
        assert "0 (left alone: 32 tenant) moved" in done, done
        pin = handle_hint(_hint(HintKind.PIN, "w0", keys=keys, transfer_id="t-m", expires_at=time.time() + 60,
                                tenant="mallory"), manager, ex, worker="w0")
        assert "none pinned" in pin
        assert all(manager.holds(k, Tier.HOST) for k in keys) and len(host.keys()) == 32
        assert next(u for u in manager.usage() if u.tier is Tier.HOST).pinned_bytes == 0
        assert _refused("evict", "tenant") - before["evict"] == 32
        assert _refused("demote", "tenant") - before["demote"] == 32
        assert _refused("pin", "tenant") - before["pin"] == 1
        # acme's own room is not another tenant's to release
        assert handle_hint(_hint(HintKind.PREFETCH, "w0", tier=Tier.GPU, transfer_id="t-a", nbytes=4 * BLOCK_BYTES,
                                 expires_at=time.time() + 30), manager, ex, worker="w0").endswith("room held")
        assert "released" not in handle_hint(_hint(HintKind.CANCEL, "w0", tier=Tier.GPU, transfer_id="t-a",
                                                   tenant="mallory"), manager, ex, worker="w0")
        assert device.free_bytes() == 60 * BLOCK_BYTES
        # the tenant itself may
        assert "32 dropped" in handle_hint(_hint(HintKind.EVICT, "w0", keys=keys), manager, ex, worker="w0")
    finally:
        ex.close()


def test_an_evict_or_demote_never_touches_pinned_or_busy_state():
    host = HostMemoryBackend(16 * BLOCK_BYTES, pin=False)
    device = DeviceMemoryBackend(16 * BLOCK_BYTES)
    catalog = BackendCatalog("w0", [device, host])
    manager = TierManager(catalog)
    try:
        pinned, read = save_blocks(chain_tokens(1, 4)), save_blocks(chain_tokens(2, 4))
        assert manager.save(pinned + read, Tier.HOST, tenant="acme").ok
        pk, rk = [b.key for b in pinned], [b.key for b in read]
        assert "4 blocks pinned" in handle_hint(_hint(HintKind.PIN, "w0", keys=pk, transfer_id="t-p",
                                                      expires_at=time.time() + 60), manager, None, worker="w0")
        with manager.reading(host, rk):  # a transfer or a reader is using these now
            done = handle_hint(_hint(HintKind.EVICT, "w0", keys=pk + rk), manager, None, worker="w0")
            assert "0 (left alone: 4 busy, 4 pinned) dropped" in done, done
            done = handle_hint(_hint(HintKind.DEMOTE, "w0", keys=pk + rk, to_tier=Tier.DISK), manager, None,
                               worker="w0")
            assert "left alone: 4 busy, 4 pinned" in done, done
        assert all(manager.holds(k, Tier.HOST) for k in pk + rk)
    finally:
        manager.close()


def test_a_prefetch_reservation_is_bounded_in_size_and_time():
    """The attack of issue 23: one prefetch sized to the whole tier, for ten years."""
    device = DeviceMemoryBackend(64 * BLOCK_BYTES)
    host = HostMemoryBackend(64 * BLOCK_BYTES, pin=False)
    catalog = BackendCatalog("w0", [device, host])
    clock = [1000.0]
    manager = TierManager(catalog, clock=lambda: clock[0], prefetch_fraction=0.25, prefetch_max_s=60.0)
    try:
        chain = save_blocks(chain_tokens(1, 32))
        assert manager.save(chain, Tier.GPU, tenant="acme").ok
        size_before, expiry_before = _refused("prefetch", "size"), _refused("prefetch", "expiry")
        whole = _hint(HintKind.PREFETCH, "w0", tier=Tier.GPU, transfer_id="t-all", nbytes=64 * BLOCK_BYTES,
                      expires_at=clock[0] + 10 * 365 * 86400.0, tenant="mallory")
        done = handle_hint(whole, manager, None, worker="w0")
        assert "no room held (prefetch share" in done, done
        assert all(manager.holds(b.key, Tier.GPU) for b in chain)  # nothing displaced
        assert _refused("prefetch", "size") - size_before == 1
        # within the share (16 of 64 blocks), and held 60 s at most, not ten years
        part = _hint(HintKind.PREFETCH, "w0", tier=Tier.GPU, transfer_id="t-part", nbytes=16 * BLOCK_BYTES,
                     expires_at=clock[0] + 10 * 365 * 86400.0)
        assert handle_hint(part, manager, None, worker="w0").endswith("room held")
        assert _refused("prefetch", "expiry") - expiry_before == 1
        more = _hint(HintKind.PREFETCH, "w0", tier=Tier.GPU, transfer_id="t-more", nbytes=BLOCK_BYTES,
                     expires_at=clock[0] + 30)
        assert "prefetch share" in handle_hint(more, manager, None, worker="w0")  # the share is for all of them
        clock[0] += 61
        manager.tick()
        assert manager.counters["reservations_expired"] == 1
        assert next(u for u in manager.usage() if u.tier is Tier.GPU).reserved_bytes == 0
        # legitimate saves are not refused after it
        assert manager.save(save_blocks(chain_tokens(2, 16)), Tier.GPU, tenant="acme").ok
    finally:
        manager.close()


def test_build_takes_the_hint_bounds_from_settings(tmp_path):
    settings = Settings.from_env({"NEXUSKV_DATA_DIR": str(tmp_path), "NEXUSKV_WORKER": "w0",
                                  "NEXUSKV_TIER_PREFETCH_FRACTION": "0.1", "NEXUSKV_TIER_PREFETCH_MAX": "5"})
    manager, executor = build(settings, publish=lambda b: None)
    try:
        assert (manager.prefetch_fraction, manager.prefetch_max_s) == (0.1, 5.0)
    finally:
        executor.close()
        manager.close()


def test_the_service_does_not_start_on_a_worker_folder_another_tier_manager_holds(tmp_path):
    """The service and an engine adapter of one worker share its disk folder's path: the second
    authority fails at start, naming the folder, and starts once the first has closed."""
    from nexuskv.dataplane.folder_lock import FolderLock
    from nexuskv.errors import TierLockedError

    settings = Settings.from_env({"NEXUSKV_DATA_DIR": str(tmp_path), "NEXUSKV_WORKER": "w0"})
    folder = tmp_path / "tiers" / "w0" / "disk"
    engine_side = FolderLock(folder, holder="the vLLM connector's worker side of w0")
    with pytest.raises(TierLockedError, match="the vLLM connector's worker side of w0") as err:
        build(settings, publish=lambda b: None)
    assert str(folder) in str(err.value)
    engine_side.release()
    manager, executor = build(settings, publish=lambda b: None)
    executor.close()
    manager.close()


class _SlowDevice(DeviceMemoryBackend):
    """A device tier whose commits take a while, so a copy is still running when its cancel comes."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.first = threading.Event()

    def commit(self, header, buf, reservation=None):
        handle = super().commit(header, buf, reservation)
        self.first.set()
        time.sleep(0.02)
        return handle


def test_a_cancel_stops_the_copy_between_blocks_and_gives_its_room_back():
    host = HostMemoryBackend(64 * BLOCK_BYTES, pin=False)
    device = _SlowDevice(64 * BLOCK_BYTES)
    catalog = BackendCatalog("w0", [device, host])
    manager = TierManager(catalog)
    chain = save_blocks(chain_tokens(1, 40))
    assert manager.save(chain, Tier.HOST, tenant="acme").ok
    ex = TransferExecutor(catalog, tiers=manager, lanes=1)
    try:
        future = ex.submit(_command("t-slow", "w0", [b.key for b in chain], Tier.HOST, Tier.GPU))
        assert device.first.wait(10)
        done = handle_hint(_hint(HintKind.CANCEL, "w0", tier=Tier.GPU, transfer_id="t-slow"), manager, ex, worker="w0")
        assert done.startswith("cancel t-slow: stopping the copy")
        out = future.result(30)
        assert out.status is TransferStatus.CANCELLED and "cancelled: test" in out.result.error
        assert out.result.blocks_moved == 0 and device.keys() == []  # rolled back: left as it was
        assert device.free_bytes() == device.capacity_bytes  # its room is back
        assert out.observation is not None and not out.observation.observation.ok
        assert all(manager.holds(b.key, Tier.HOST) for b in chain)  # the source was never evicted meanwhile
    finally:
        ex.close()


def test_the_planner_charges_the_price_a_tier_manager_published():
    llama = known_model("meta-llama/Llama-3.1-8B", tenant_namespace="acme")
    scope = IdentityScope.of(llama)
    keys = tuple(BlockKeyer(scope, 16).keys([(i * 31) % 50_000 for i in range(8192)]))
    index = KeyIndex()
    index.store(scope, "w-b", Tier.HOST, keys)
    replica = TierPriceReplica(None, service="test")  # type: ignore[arg-type]
    core = PlannerCore(index, model=shipped_cost_model, policy=lambda: ExecutionPolicy(version="t"),
                       descriptors=DescriptorRegistry([llama]), prices=replica.prices)

    def decide(rid: str):
        req = PlanRequest(request_id=rid, scope=scope, block_size=16, prompt_tokens=8192, keys=keys,
                          arrival_at=time.time(), candidates=(WorkerLoad(worker="w-b", profile="h200x1-rdma4x200",
                                                                         queued_prefill_tokens=50_000),))
        return core.plan_request(req, now=time.time()).decision

    cheap = decide("r-cheap")
    assert cheap.action is Action.PREFETCH, cheap.reason
    record = TierStateRecord(worker="w-b", tier=Tier.GPU, backend="device", policy="utility", capacity_bytes=1 << 30,
                             used_bytes=1 << 30, reserved_bytes=0, pinned_bytes=0, in_flight_bytes=0, blocks=100,
                             unannounced_blocks=0, price_s_per_gib=float("inf"), price_bytes=1 << 26,
                             published_at=time.time())
    replica.apply(encode(TIER_STATE, record))
    assert replica.prices() == {"w-b": 60.0}  # capped
    dear = decide("r-dear")
    assert dear.action is not Action.PREFETCH
    prefetch = next(a for a in dear.alternatives if a.action is Action.PREFETCH)
    assert prefetch.eg_s < cheap.eg_s


async def _collect(url, topic, keep, *, until, timeout_s=TIMEOUT_S):
    consumer = make_consumer(url, topic, client_id=f"test-{uuid.uuid4().hex[:6]}")
    await consumer.start()
    found = []
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for rec in records:
                    try:
                        value = decode_record(topic, rec)
                    except Exception:  # noqa: BLE001 - other tests put malformed records here on purpose
                        continue
                    if keep(value):
                        found.append(value)
            if until(found):
                return found
    finally:
        await consumer.stop()
    raise AssertionError(f"{topic.name}: condition not met in {timeout_s}s ({len(found)} records)")


@pytest.mark.broker
async def test_the_service_overfilled_on_kafka_keeps_its_index_true(kafka_url, tmp_path):
    await ensure_topics(kafka_url, partitions=2)
    worker = f"w-{uuid.uuid4().hex[:8]}"
    settings = Settings.from_env({"NEXUSKV_DATA_DIR": str(tmp_path), "NEXUSKV_WORKER": worker,
                                  "NEXUSKV_TIER_DEVICE_BYTES": str(8 * BLOCK_BYTES),
                                  "NEXUSKV_TIER_HOST_BYTES": str(16 * BLOCK_BYTES),
                                  "NEXUSKV_TIER_DISK_BYTES": str(32 * BLOCK_BYTES),
                                  "NEXUSKV_TIER_STATE_INTERVAL": "0.2", "NEXUSKV_TIER_REUSE_HALF_LIFE": "60"})
    holder: list[TierBus] = []
    manager, executor = build(settings, publish=lambda b: holder[0].publish_batch(b))
    bus = TierBus(kafka_url, manager, worker=worker, executor=executor, state_interval_s=0.2)
    holder.append(bus)
    transfers = TransferService(kafka_url, executor, worker=worker)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(bus.run(stop)), asyncio.create_task(transfers.run(stop))]
    producer = make_producer(kafka_url, client_id="test-tier-manager")
    await producer.start()
    try:
        await asyncio.wait_for(asyncio.gather(bus.ready.wait(), transfers.ready.wait()), TIMEOUT_S)
        recurring = save_blocks(chain_tokens(1, 4))
        answered = 0
        for i in range(30):  # 120 one-off blocks and a recurring chain through 48 blocks of room
            if i % 3 == 0:
                out = await asyncio.to_thread(manager.save, recurring, Tier.HOST, tenant="acme")
                answered += out.saved + out.already + out.refused
            one = await asyncio.to_thread(manager.save, save_blocks(chain_tokens(100 + i, 4)), Tier.HOST,
                                          tenant="acme")
            assert one.ok, one.reasons
            for u in manager.usage():
                assert u.used_bytes + u.reserved_bytes <= u.capacity_bytes
        assert answered == 40
        rkeys = [b.key for b in recurring]
        assert all(manager.holds(k, Tier.HOST) for k in rkeys)
        # Hints from the bus: pin the recurring chain, hold prefetch room, cancel before the command.
        await send(producer, PLACEMENT, "acme/0", _hint(HintKind.PIN, worker, keys=rkeys, transfer_id="t-pin",
                                                        expires_at=time.time() + 60))
        await send(producer, PLACEMENT, "acme/0", _hint(HintKind.PREFETCH, worker, tier=Tier.GPU, transfer_id="t-pre",
                                                        nbytes=2 * BLOCK_BYTES, expires_at=time.time() + 60))
        await send(producer, PLACEMENT, "acme/0", _hint(HintKind.CANCEL, worker, tier=Tier.GPU, transfer_id="t-x"))
        states = await _collect(kafka_url, TIER_STATE,
                                lambda r: isinstance(r, TierStateRecord) and r.worker == worker,
                                until=lambda rs: any(r.tier is Tier.GPU and r.reserved_bytes == 2 * BLOCK_BYTES
                                                     for r in rs) and any(r.tier is Tier.HOST and r.pinned_bytes
                                                                          == 4 * BLOCK_BYTES for r in rs))
        assert {r.tier for r in states} == {Tier.GPU, Tier.HOST, Tier.DISK}
        # Transfers: the recurring chain host -> gpu; one whose cancel came first.
        for cmd in (_command("t-up", worker, rkeys, Tier.HOST, Tier.GPU),
                    _command("t-x", worker, rkeys, Tier.HOST, Tier.GPU)):
            await send(producer, TRANSFERS, worker, cmd)
        results = await _collect(kafka_url, TRANSFER_RESULTS,
                                 lambda r: isinstance(r, TransferResult) and r.request_id in ("r-t-up", "r-t-x"),
                                 until=lambda rs: len({r.request_id for r in rs}) == 2)
        by_id = {r.transfer_id: r for r in results}
        assert by_id["t-up"].status is TransferStatus.COMPLETED, by_id["t-up"].error
        assert by_id["t-x"].status is TransferStatus.CANCELLED
        assert all(manager.holds(k, Tier.GPU) for k in rkeys)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)
        await producer.stop()

    # An index rebuilt from what the service published holds exactly what the tiers hold.
    index = GlobalIndex()
    batches = await _collect(kafka_url, KV_EVENTS, lambda b: isinstance(b, (KvEventBatch, KeyedBatch)) and b.publisher == worker,
                             until=lambda bs: len(bs) >= manager.facts.batches)
    for b in sorted(batches, key=lambda b: b.seq):
        index.apply(b)
    facts = {(tier, group): {k for _scope, k in members}
             for (pub, tier, group), members in index.facts().items() if pub == worker and members}
    mine = {key: {k.key for k in keys} for key, keys in manager.contents().items()}
    held = {}
    for b in manager.backends():
        for k in b.keys():
            held.setdefault((b.capabilities.tier, k.group), set()).add(k.key)
    assert facts == mine == held
    assert index.stats().unresolved_blocks == 0 and index.stats().uncertain_publishers == 0
    assert manager.counters["demoted"] > 0 and manager.counters["dropped"] > 0
