"""Forged control records against a worker's tier manager and transfer executor, on Apache Kafka
(issue 23): an outsider who can read ``nexuskv.kv-events`` (where version 2 carries the block
keys) and write to ``nexuskv.placement`` and ``nexuskv.transfers``.

Each run starts the worker's services twice, in process, on the same broker — a
:class:`~streams.tier_manager.TierBus` and a :class:`~streams.transfer_executor.TransferService`
over one :class:`~nexuskv.dataplane.tiers.TierManager` (a 64-block device tier, a 128-block host
tier) — and sends both the same records:

* **baseline**: the unsigned path, as before signing: no bus secret (every record is taken), and
  prefetch room bounded at 100 % of a tier and ten years (the old behaviour: whatever the sender
  said);
* **NexusKV**: a bus secret (hints and commands taken only from a planner's valid signature, once)
  and the default bounds (25 % of a tier, 60 s).

The outsider's records (nine): an evict hint naming the victim's 32 host blocks, unsigned and
again signed with a key not the planner's; a prefetch hint sized to the whole device tier for ten
years, unsigned and forged; four transfer commands copying the victim's blocks to the device
tier (two unsigned, one forged, one signed by an executor, which commands do not entitle); and a
genuine planner prefetch replayed byte for byte after the planner cancelled it.

* ``reliability_control_outsider_applied`` — outsider records taken past the door (not
  dead-lettered) and acted on. Goal: 0. The details say what they did: the victim's blocks
  evicted, device blocks displaced, device room held and for how long, copies run, saves of
  32 legitimate blocks refused afterwards.
* ``reliability_prefetch_share_held`` — the share of the device tier one prefetch hint from a
  *genuine* (signed) planner can hold, sized to the whole tier for ten years (an insider gone
  wrong): bounded by ``NEXUSKV_TIER_PREFETCH_FRACTION``, refused beyond it; the baseline takes
  all of it. The details also give how long a legal-sized one (an eighth of the tier) asking for
  ten years is held: ``NEXUSKV_TIER_PREFETCH_MAX`` at most.

Run: ``python -m benchmarks.attack_control_records --runs 3`` (``NEXUSKV_BROKER`` to use a running
broker; otherwise a local Apache Kafka is started).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid

from nexuskv.contracts.control_signature import ControlVerifier
from nexuskv.contracts.placement import HintKind, PlacementHint
from nexuskv.contracts.topics import PLACEMENT, TRANSFERS
from nexuskv.dataplane.catalog import BackendCatalog
from nexuskv.dataplane.executor import TransferExecutor
from nexuskv.dataplane.memory import DeviceMemoryBackend, HostMemoryBackend
from nexuskv.dataplane.tiers import TierManager
from nexuskv.descriptor import Tier
from streams.bus.clients import ControlSigner, make_producer
from streams.bus.metrics import REGISTRY
from streams.bus.topics import ensure_topics
from streams.tier_manager import TierBus
from streams.transfer_executor import TransferService

from benchmarks._attack_broker import attack_broker
from benchmarks._result import Run, write_result
from tests.control_records import command, hint, signer
from tests.control_records import record as _record
from tests.dataplane.tiering import BLOCK_BYTES, chain_tokens, save_blocks

BUS = b"the-bus-secret-of-the-control-attack"
TEN_YEARS = 10 * 365 * 86400.0
DEVICE_BLOCKS, HOST_BLOCKS, VICTIM = 64, 128, 32
OUTSIDER_RECORDS = 9


def _signer(producer: str, secret: bytes = BUS) -> ControlSigner:
    return signer(producer, secret)


def _hint(kind: HintKind, worker: str, **kw) -> PlacementHint:
    return hint(kind, worker, reason="attack", **kw)


def _refused(service: str, topic: str) -> float:
    total = 0.0
    for metric in REGISTRY.collect():
        if metric.name == "nexuskv_records_refused":
            for s in metric.samples:
                if s.name.endswith("_total") and s.labels.get("service") == service and s.labels.get("topic") == topic:
                    total += s.value
    return total


async def _until(cond, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def scenario(url, *, signed: bool) -> dict:
    """One worker's services under the records of the module docstring; what they did."""
    worker = f"w-{uuid.uuid4().hex[:8]}"
    device, host = DeviceMemoryBackend(DEVICE_BLOCKS * BLOCK_BYTES), HostMemoryBackend(HOST_BLOCKS * BLOCK_BYTES,
                                                                                          pin=False)
    catalog = BackendCatalog(worker, [device, host])
    bounds = {} if signed else {"prefetch_fraction": 1.0, "prefetch_max_s": TEN_YEARS}
    manager = TierManager(catalog, **bounds)
    executor = TransferExecutor(catalog, tiers=manager)
    verifier = (lambda: ControlVerifier(BUS)) if signed else (lambda: ControlVerifier(b""))
    bus = TierBus(url, manager, worker=worker, executor=executor, group_id=f"atk-t-{worker}", verifier=verifier(),
                  heartbeat=False)
    service = TransferService(url, executor, worker=worker, group_id=f"atk-x-{worker}", verifier=verifier(),
                              control=_signer(f"executor/{worker}") if signed else ControlSigner(worker, key=None))
    stop = asyncio.Event()
    tasks = [asyncio.create_task(bus.run(stop)), asyncio.create_task(service.run(stop))]
    producer = make_producer(url, client_id=f"attacker-{worker}")
    await producer.start()
    planner = _signer("planner/nexuskv-planner") if signed else None  # the genuine planner (unsigned before)
    mallory, executor_x = _signer("planner/nexuskv-planner", b"m" * 32), _signer(f"executor/{worker}")
    refused_before = _refused("transfer-executor", TRANSFERS.name)
    out: dict = {"scenario": "signed, bounded" if signed else "unsigned path, unbounded"}
    try:
        await asyncio.wait_for(asyncio.gather(bus.ready.wait(), service.ready.wait()), 60)
        victim_host = save_blocks(chain_tokens(1, VICTIM))
        victim_gpu = save_blocks(chain_tokens(2, VICTIM))
        assert (await asyncio.to_thread(manager.save, victim_host, Tier.HOST, tenant="acme")).ok
        assert (await asyncio.to_thread(manager.save, victim_gpu, Tier.GPU, tenant="acme")).ok
        hkeys, gkeys = [b.key for b in victim_host], [b.key for b in victim_gpu]
        hkey = f"acme/{worker}"
        # The genuine planner's prefetch and cancel, then the outsider's records.
        prefetch = _hint(HintKind.PREFETCH, worker, tier=Tier.HOST, transfer_id="t-genuine", nbytes=4 * BLOCK_BYTES,
                         expires_at=time.time() + 30)  # in the host tier: the device tier is the grab's
        genuine = _record(PLACEMENT, hkey, prefetch, planner)
        cancel = _record(PLACEMENT, hkey, _hint(HintKind.CANCEL, worker, tier=Tier.HOST, transfer_id="t-genuine"),
                         planner)
        evict = _hint(HintKind.EVICT, worker, tier=Tier.HOST, keys=hkeys)
        grab = lambda tid: _hint(HintKind.PREFETCH, worker, tier=Tier.GPU, transfer_id=tid,  # noqa: E731
                                 nbytes=DEVICE_BLOCKS * BLOCK_BYTES, expires_at=time.time() + TEN_YEARS)
        hints = [genuine, cancel, genuine,  # the replay, byte for byte, after the cancel
                 _record(PLACEMENT, hkey, evict, None), _record(PLACEMENT, hkey, evict, mallory),
                 _record(PLACEMENT, hkey, grab("t-grab-1"), None), _record(PLACEMENT, hkey, grab("t-grab-2"), mallory)]
        for topic, key, payload, headers in hints:
            await producer.send_and_wait(topic, payload, key=key, headers=headers or None)
        await _until(lambda: bus.hints + bus.rejected >= len(hints))
        await asyncio.sleep(0.3)
        gpu = next(u for u in manager.usage() if u.tier is Tier.GPU)
        held = {tid: h.expires_at for tid, h in manager._held.items()}  # noqa: SLF001 - what the attack holds
        grabbed = [e for tid, e in held.items() if tid.startswith("t-grab")]
        out.update(victim_blocks_evicted=sum(not manager.holds(k, Tier.HOST) for k in hkeys),
                   device_blocks_displaced=sum(not manager.holds(k, Tier.GPU) for k in gkeys),
                   device_reserved_blocks=gpu.reserved_bytes // BLOCK_BYTES,
                   device_hold_s=round(max((e - time.time() for e in grabbed), default=0.0), 1),
                   replayed_prefetch_held="t-genuine" in held)
        hints_taken = len(hints) - bus.rejected
        commands = [_record(TRANSFERS, worker, command(f"t-x{i}", worker, hkeys[8 * i:8 * i + 8]), s)
                    for i, s in enumerate((None, None, mallory, executor_x))]
        for topic, key, payload, headers in commands:
            await producer.send_and_wait(topic, payload, key=key, headers=headers or None)
        # (this executor's group reads the topic from its start, so it refuses earlier runs' records too:
        # refusals only tell when to stop waiting; what ran is what this worker's executor published)
        await _until(lambda: service.handled >= len(commands)
                     or _refused("transfer-executor", TRANSFERS.name) - refused_before >= len(commands), 60)
        await asyncio.sleep(1.0)
        out["copies_run"] = commands_taken = service.handled
        # 3 genuine hints (prefetch, cancel, the replay counts as the outsider's); taken outsider records:
        out["outsider_applied"] = (hints_taken - 2) + commands_taken
        legit = await asyncio.to_thread(manager.save, save_blocks(chain_tokens(3, VICTIM)), Tier.GPU, tenant="acme")
        out["legit_saves_refused"] = legit.refused + legit.failed
        # An insider: the genuine planner, gone wrong, asks for the whole device tier for ten years.
        # (the room the outsider's grab holds in the baseline is released first: the insider asks afresh)
        for tid in ("t-grab-1", "t-grab-2", "t-genuine"):
            manager.release(tid)
        eighth = _hint(HintKind.PREFETCH, worker, tier=Tier.GPU, transfer_id="t-insider-eighth",
                        nbytes=DEVICE_BLOCKS * BLOCK_BYTES // 8, expires_at=time.time() + TEN_YEARS)
        for rec in (_record(PLACEMENT, hkey, eighth, planner), _record(PLACEMENT, hkey, grab("t-insider"), planner)):
            taken = bus.hints
            await producer.send_and_wait(rec[0], rec[2], key=rec[1], headers=rec[3] or None)
            await _until(lambda: bus.hints > taken)  # noqa: B023 - awaited here, in this iteration
            h = manager._held.get("t-insider-eighth")  # noqa: SLF001
            if h is not None:
                out["insider_eighth_hold_s"] = round(h.expires_at - time.time(), 1)
                manager.release("t-insider-eighth")  # the whole-tier ask comes to an empty tier
        h = manager._held.get("t-insider")  # noqa: SLF001
        out["insider_share"] = round(h.reservation.remaining / device.capacity_bytes, 3) if h is not None else 0.0
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        await producer.stop()
        executor.close()
        manager.close()
    return out


async def _main(args) -> None:
    with attack_broker() as url:
        await ensure_topics(url, partitions=2)
        applied, shares, details = [], [], []
        for i in range(args.runs):
            before = await scenario(url, signed=False)
            after = await scenario(url, signed=True)
            print(f"run {i + 1}: before {before}\n       after  {after}", flush=True)
            applied.append(Run(after["outsider_applied"], before["outsider_applied"]))
            shares.append(Run(after["insider_share"], before["insider_share"]))
            details.append({"before": before, "after": after})
    if args.no_write:
        return
    load = os.getloadavg()[0]
    command = f"python -m benchmarks.attack_control_records --runs {args.runs}"
    common = {"runs": details, "load_average_1m": round(load, 1), "cpus": os.cpu_count(),
              "baseline_is": "today's services with the checks off (no bus secret: every record taken; prefetch room "
                             "bounded at 100 % of a tier and ten years), same run, same broker"}
    write_result("reliability_control_outsider_applied",
                 f"outsider control records taken and acted on, of {OUTSIDER_RECORDS} (evicts, whole-tier "
                 "prefetches, transfer commands: unsigned, forged, wrong producer; a replayed genuine hint)",
                 "records", applied, "the unsigned path (no bus secret), same run", command, details=common)
    write_result("reliability_prefetch_share_held",
                 "share of the device tier one signed prefetch hint holds when it asks for all of it for ten years",
                 "share", shares, "prefetch room unbounded (the sender's size and expiry), same run", command,
                 details=common)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print, do not write the results files")
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
