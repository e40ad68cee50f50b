"""Signed control topics on a real Apache Kafka (issue 23): under a bus secret, an unsigned, forged,
wrong-producer or replayed record on ``nexuskv.placement``, ``nexuskv.transfers`` or
``nexuskv.transfer-results`` is dead-lettered with its reason and changes nothing, while the
genuine records around it are acted on — by the tier manager, the transfer executor and the
planner, each as ``nexuskv up`` runs them.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from nexuskv.config import Settings
from nexuskv.contracts import codec
from nexuskv.contracts.control_signature import ControlVerifier, Envelope
from nexuskv.contracts.dead_letter import DeadLetter
from nexuskv.contracts.decisions import Action, Decision
from nexuskv.contracts.placement import HintKind
from nexuskv.contracts.topics import DEAD_LETTER, DECISIONS, PLACEMENT, PLAN_REQUESTS, TRANSFER_RESULTS, TRANSFERS
from nexuskv.contracts.transfers import TransferCommand, TransferResult, TransferStatus
from nexuskv.descriptor import Tier
from nexuskv.errors import ContractError
from nexuskv.policy import ExecutionPolicy
from nexuskv.profiles import shipped_cost_model
from streams.bus.clients import ControlSigner, make_consumer, make_producer
from streams.bus.metrics import REGISTRY
from streams.bus.topics import ensure_topics
from streams.planner_service import PlannerService
from streams.tier_manager import TierBus, build
from streams.transfer_executor import TransferService

from tests.control_records import record as _record
from tests.control_records import send as _send
from tests.control_records import signer
from tests.dataplane.tiering import BLOCK_BYTES, chain_tokens, save_blocks
from tests.planning import NOW
from tests.streams.test_planner_service import _scenario
from tests.streams.test_tier_manager import _command, _hint

pytestmark = pytest.mark.broker
BUS = b"the-bus-secret-of-the-control-tests"
TIMEOUT_S = 60


def _signer(producer: str, secret: bytes = BUS, clock=time.time) -> ControlSigner:
    return signer(producer, secret, clock)


async def _letters(url, source: str, key: bytes, want: int) -> list[DeadLetter]:
    consumer = make_consumer(url, DEAD_LETTER, client_id="control-test-dl", group_id=f"dl-{uuid.uuid4().hex[:6]}")
    await consumer.start()
    found: list[DeadLetter] = []
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while len(found) < want and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=300)).values():
                for r in records:
                    letter = DeadLetter.model_validate_json(r.value)
                    if letter.source_topic == source and letter.key == key:
                        found.append(letter)
        await asyncio.sleep(1.0)  # and nothing more than wanted arrives
        for records in (await consumer.getmany(timeout_ms=500)).values():
            for r in records:
                letter = DeadLetter.model_validate_json(r.value)
                if letter.source_topic == source and letter.key == key:
                    found.append(letter)
    finally:
        await consumer.stop()
    return sorted(found, key=lambda le: le.offset)


def _codes(letters: list[DeadLetter]) -> list[str]:
    return [le.reason.split(":", 1)[0] for le in letters]


def _refused(service: str, topic: str, reason: str) -> float:
    return REGISTRY.get_sample_value("nexuskv_records_refused_total",
                                     {"service": service, "topic": topic, "reason": reason}) or 0.0


async def _until(cond, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {TIMEOUT_S}s: {what}")
        await asyncio.sleep(0.05)


async def test_outsider_hints_and_commands_change_nothing_on_a_worker(kafka_url, tmp_path):
    """The attack of issue 23 on a worker's tier manager and executor, now refused at the door."""
    await ensure_topics(kafka_url, partitions=2)
    worker = f"w-{uuid.uuid4().hex[:8]}"
    settings = Settings.from_env({"NEXUSKV_DATA_DIR": str(tmp_path), "NEXUSKV_WORKER": worker,
                                  "NEXUSKV_TIER_DEVICE_BYTES": str(8 * BLOCK_BYTES),
                                  "NEXUSKV_TIER_HOST_BYTES": str(16 * BLOCK_BYTES),
                                  "NEXUSKV_TIER_DISK_BYTES": str(16 * BLOCK_BYTES)})
    manager, executor = build(settings, publish=lambda b: None)
    bus = TierBus(kafka_url, manager, worker=worker, executor=executor, group_id=f"t-{worker}",
                  verifier=ControlVerifier(BUS), heartbeat=False)
    results_signer = _signer(f"executor/{worker}")
    transfers = TransferService(kafka_url, executor, worker=worker, group_id=f"x-{worker}",
                                verifier=ControlVerifier(BUS), control=results_signer)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(bus.run(stop)), asyncio.create_task(transfers.run(stop))]
    producer = make_producer(kafka_url, client_id="control-test")
    await producer.start()
    planner, mallory, executor_x = _signer("planner/p"), _signer("planner/p", b"x" * 32), _signer("executor/x")
    before = {c: _refused("tier-manager", PLACEMENT.name, c) for c in ("unsigned", "forged", "not_entitled", "replayed")}
    try:
        await asyncio.wait_for(asyncio.gather(bus.ready.wait(), transfers.ready.wait()), TIMEOUT_S)
        victim = save_blocks(chain_tokens(1, 4))
        assert (await asyncio.to_thread(manager.save, victim, Tier.HOST, tenant="acme")).ok
        keys = [b.key for b in victim]
        hkey = f"acme/{worker}"
        evict = _hint(HintKind.EVICT, worker, keys=keys, tier=Tier.HOST)
        prefetch = _hint(HintKind.PREFETCH, worker, tier=Tier.GPU, transfer_id="t-pre", nbytes=2 * BLOCK_BYTES,
                         expires_at=time.time() + 60)
        genuine_prefetch = _record(PLACEMENT, hkey, prefetch, planner)
        await _send(producer, [
            _record(PLACEMENT, hkey, evict, None),  # unsigned
            _record(PLACEMENT, hkey, evict, mallory),  # forged: a planner's name, not its key
            _record(PLACEMENT, hkey, evict, executor_x),  # genuinely signed, by a producer hints do not entitle
            genuine_prefetch,
            _record(PLACEMENT, hkey, _hint(HintKind.CANCEL, worker, tier=Tier.GPU, transfer_id="t-pre"), planner),
            genuine_prefetch,  # the genuine prefetch again, byte for byte: it would hold the room once more
        ])
        await _until(lambda: bus.hints >= 2 and bus.rejected >= 4, "2 hints taken, 4 refused")
        await asyncio.sleep(0.5)
        reservations = manager.counters["reservations"]
        assert reservations == 1  # the genuine prefetch; its replay reserved nothing
        assert next(u for u in manager.usage() if u.tier is Tier.GPU).reserved_bytes == 0  # the cancel released it

        # Transfers: the same three outsiders, one genuine command, and the genuine one replayed.
        host_keys = [b.key for b in victim]
        cmd = lambda tid, ks: _command(tid, worker, ks, Tier.HOST, Tier.GPU)  # noqa: E731
        genuine_cmd = _record(TRANSFERS, worker, cmd("t-good", host_keys[:2]), planner)
        await _send(producer, [
            _record(TRANSFERS, worker, cmd("t-unsigned", host_keys[2:]), None),
            _record(TRANSFERS, worker, cmd("t-forged", host_keys[2:]), mallory),
            _record(TRANSFERS, worker, cmd("t-exec", host_keys[2:]), executor_x),
            genuine_cmd,
            genuine_cmd,
        ])
        await _until(lambda: transfers.handled >= 1, "the genuine command ran")
        await asyncio.sleep(1.0)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)
        await producer.stop()
        executor.close()

    # Nothing an outsider sent changed anything: the victim's blocks are all held, the room the
    # genuine prefetch held was released by its cancel and not held again by its replay.
    assert all(manager.holds(k, Tier.HOST) for k in keys)
    gpu = next(u for u in manager.usage() if u.tier is Tier.GPU)
    assert gpu.reserved_bytes == 0
    assert sorted(k.key for k in manager.keys(Tier.GPU)) == sorted(k.key for k in host_keys[:2])
    assert transfers.handled == 1

    placement = await _letters(kafka_url, PLACEMENT.name, hkey.encode(), 4)
    assert _codes(placement) == ["unsigned", "forged", "not_entitled", "replayed"], [le.reason for le in placement]
    assert all(le.service == "tier-manager" for le in placement)
    for code in before:
        assert _refused("tier-manager", PLACEMENT.name, code) - before[code] == 1
    commands = await _letters(kafka_url, TRANSFERS.name, worker.encode(), 4)
    assert _codes(commands) == ["unsigned", "forged", "not_entitled", "replayed"], [le.reason for le in commands]
    assert commands[-1].error_type == "ReplayedError"

    # The one result is the genuine command's, signed as this worker's executor.
    consumer = make_consumer(kafka_url, TRANSFER_RESULTS, client_id="control-test-results",
                             group_id=f"r-{uuid.uuid4().hex[:6]}")
    await consumer.start()
    mine = []
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not mine:
            for records in (await consumer.getmany(timeout_ms=300)).values():
                for r in records:
                    try:
                        value = codec.decode(TRANSFER_RESULTS, r.value)
                    except ContractError:
                        continue
                    if isinstance(value, TransferResult) and value.destination.worker == worker:
                        mine.append((r, value))
    finally:
        await consumer.stop()
    assert [v.transfer_id for _r, v in mine] == ["t-good"] and mine[0][1].status is TransferStatus.COMPLETED
    env = ControlVerifier(BUS).check(TRANSFER_RESULTS.name, mine[0][0].key, mine[0][0].value, mine[0][0].headers,
                                     now=time.time())
    assert isinstance(env, Envelope) and env.producer == f"executor/{worker}"


async def test_a_planner_acts_only_on_results_an_executor_signed_once(kafka_url):
    await ensure_topics(kafka_url, partitions=2)
    index, requests = _scenario()
    tag = uuid.uuid4().hex[:8]
    far = next(r for r in requests if r.request_id == "r-far").model_copy(update={"request_id": f"r-far-{tag}"})
    clock = lambda: NOW  # noqa: E731 - the scenario's time, for the planner and every signer alike
    service = PlannerService(kafka_url, index, base_model=shipped_cost_model(), policy=ExecutionPolicy(version="t"),
                             clock=clock, group_id=f"planner-{tag}", service=f"planner-{tag}",
                             control=_signer(f"planner/planner-{tag}", clock=clock), verifier=ControlVerifier(BUS))
    await service.start()
    producer = make_producer(kafka_url, client_id="control-test-planner")
    await producer.start()
    seen: dict[str, object] = {}
    out = make_consumer(kafka_url, DECISIONS, TRANSFERS, client_id="control-test-out", group_id=f"o-{tag}",
                        fetch_max_wait_ms=10)
    await out.start()

    async def read(done) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not done():
            assert time.monotonic() < deadline, f"not within {TIMEOUT_S}s: {sorted(seen)}"
            for records in (await out.getmany(timeout_ms=100)).values():
                for r in records:
                    try:
                        value = codec.decode(DECISIONS if r.topic == DECISIONS.name else TRANSFERS, r.value)
                    except ContractError:
                        continue  # other tests on the shared broker put malformed records here on purpose
                    if isinstance(value, Decision) and value.request_id == far.request_id:
                        seen[f"decision/{value.revision}"] = value
                    elif isinstance(value, TransferCommand) and value.request_id == far.request_id:
                        seen["command"] = (r, value)

    try:
        await producer.send_and_wait(PLAN_REQUESTS.name, codec.encode(PLAN_REQUESTS, far),
                                     key=far.request_id.encode())
        await read(lambda: "command" in seen and "decision/0" in seen)
        record, command = seen["command"]
        assert seen["decision/0"].action is Action.TRANSFER
        env = ControlVerifier(BUS).check(TRANSFERS.name, record.key, record.value, record.headers, now=NOW)
        assert isinstance(env, Envelope) and env.producer == f"planner/planner-{tag}"  # the planner signs

        failed = TransferResult(transfer_id=command.transfer_id, request_id=far.request_id, status="failed",
                                source=command.source, destination=command.destination, started_at=NOW,
                                finished_at=NOW + 0.01, error="remote worker gone")
        genuine = _record(TRANSFER_RESULTS, far.request_id, failed,
                          _signer(f"executor/{command.destination.worker}", clock=clock))
        await _send(producer, [
            _record(TRANSFER_RESULTS, far.request_id, failed, None),
            _record(TRANSFER_RESULTS, far.request_id, failed, _signer("executor/w-a", b"x" * 32, clock=clock)),
            _record(TRANSFER_RESULTS, far.request_id, failed, _signer("planner/p", clock=clock)),
            # validly signed, by an executor that never ran it (another worker's) ...
            _record(TRANSFER_RESULTS, far.request_id, failed,
                    _signer(f"executor/{command.destination.worker}-other", clock=clock)),
            # ... and by the right executor, for another request than the command's
            _record(TRANSFER_RESULTS, far.request_id, failed.model_copy(update={"request_id": f"r-else-{tag}"}),
                    _signer(f"executor/{command.destination.worker}", clock=clock)),
        ])
        codes = ["unsigned", "forged", "not_entitled", "not_owner", "mismatch"]
        letters = await _letters(kafka_url, TRANSFER_RESULTS.name, far.request_id.encode(), 5)
        assert _codes(letters) == codes, [le.reason for le in letters]
        assert "decision/1" not in seen and service.core.scheduler.open_tickets()  # the transfer is still open
        await _send(producer, [genuine, genuine])  # the genuine result, then its replay
        await read(lambda: "decision/1" in seen)
        letters = await _letters(kafka_url, TRANSFER_RESULTS.name, far.request_id.encode(), 6)
        assert _codes(letters) == codes + ["replayed"], [le.reason for le in letters]
        await asyncio.sleep(0.5)
        await read(lambda: True)
        assert seen["decision/1"].action is Action.RECOMPUTE and "remote worker gone" in seen["decision/1"].reason
        assert "decision/2" not in seen
    finally:
        await out.stop()
        await producer.stop()
        await service.stop()


async def test_a_router_follows_only_route_hints_a_planner_signed_once(kafka_url):
    from streams.router import RouteHints
    from streams.router_service import PlacementFollower

    await ensure_topics(kafka_url, partitions=2)
    tag = uuid.uuid4().hex[:8]
    hints = RouteHints()
    follower = PlacementFollower(kafka_url, hints, client_id=f"router-{tag}", verifier=ControlVerifier(BUS))
    await follower.start()
    task = asyncio.create_task(follower.run())
    producer = make_producer(kafka_url, client_id="control-test-router")
    await producer.start()
    try:
        route = lambda rid, worker: _hint(HintKind.ROUTE, worker).model_copy(  # noqa: E731
            update={"request_id": rid, "tier": None})
        genuine = _record(PLACEMENT, f"acme/{tag}", route(f"r-good-{tag}", "w-good"), _signer("planner/p"))
        await _send(producer, [
            _record(PLACEMENT, f"acme/{tag}", route(f"r-bad-{tag}", "w-mallory"), None),
            _record(PLACEMENT, f"acme/{tag}", route(f"r-forged-{tag}", "w-mallory"), _signer("planner/p", b"x" * 32)),
            genuine,
            _record(PLACEMENT, f"acme/{tag}", route(f"r-good-{tag}", "w-mallory"), _signer("executor/w0")),
        ])
        await _until(lambda: follower.refused >= 3 and hints.hint_for(f"r-good-{tag}", time.time()) is not None,
                     "3 refused, the genuine route followed")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await follower.stop()
        await producer.stop()
    assert hints.hint_for(f"r-good-{tag}", time.time()).worker == "w-good"
    assert hints.hint_for(f"r-bad-{tag}", time.time()) is None and hints.hint_for(f"r-forged-{tag}", time.time()) is None
