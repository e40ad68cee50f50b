"""The transfer executor: completed only when bytes arrived and verified; every other outcome says why.

Clocks are injected where a test needs a deadline or a cancellation to land at a known block.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from nexuskv.contracts.transfers import TransferCommand, TransferResult, TransferStatus
from nexuskv.dataplane import (
    BackendCatalog,
    DeviceMemoryBackend,
    DiskBackend,
    HostMemoryBackend,
    PayloadHeader,
    PayloadKey,
    TransferExecutor,
)
from nexuskv.descriptor import Tier
from nexuskv.entries import EntryLocation

DID = "sd1-" + "f" * 32
W = "w0"
BLOCK = 8192


def _loc(tier: Tier, worker: str = W) -> EntryLocation:
    return EntryLocation(worker=worker, tier=tier)


def _command(keys, source: Tier, destination: Tier, *, deadline_in: float = 60.0, now: float | None = None,
             tid: str = "t-1", source_worker: str = W) -> TransferCommand:
    now = time.time() if now is None else now
    return TransferCommand(transfer_id=tid, request_id=f"r-{tid}", descriptor_id=DID, tenant_namespace="tenant",
                           keys=tuple(keys), source=_loc(source, source_worker), destination=_loc(destination),
                           bytes=len(keys) * BLOCK, issued_at=now, deadline_at=now + deadline_in)


def _stock(backend, keys, n: int = BLOCK) -> dict[int, torch.Tensor]:
    out = {}
    for k in keys:
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(k))
        backend.put(PayloadHeader.for_data(PayloadKey(DID, k), data.numpy()), data)
        out[k] = data
    return out


@pytest.fixture
def tiers(tmp_path):
    host = HostMemoryBackend(1 << 22)
    device = DeviceMemoryBackend(1 << 22)
    disk = DiskBackend(tmp_path / "disk", 1 << 22)
    yield {Tier.HOST: host, Tier.GPU: device, Tier.DISK: disk}
    for b in (host, device, disk):
        b.close()


@pytest.fixture
def executor(tiers):
    ex = TransferExecutor(BackendCatalog(W, tiers.values()))
    yield ex
    ex.close()


def _roundtrip(result: TransferResult) -> None:
    assert TransferResult.model_validate_json(result.model_dump_json()) == result


@pytest.mark.parametrize("route", [(Tier.DISK, Tier.HOST), (Tier.HOST, Tier.GPU), (Tier.GPU, Tier.HOST),
                                   (Tier.HOST, Tier.DISK), (Tier.GPU, Tier.DISK)], ids=lambda r: f"{r[0]}->{r[1]}")
def test_completed_means_every_block_arrived_and_verified(tiers, executor, route):
    src, dst = tiers[route[0]], tiers[route[1]]
    keys = list(range(1, 9))
    data = _stock(src, keys)
    outcome = executor.execute(_command(keys, *route))
    r = outcome.result
    assert r.status is TransferStatus.COMPLETED, r.error
    assert (r.blocks_moved, r.bytes_moved, r.device, r.error) == (8, 8 * BLOCK, "cpu", None)
    assert r.started_at <= r.finished_at
    for k in keys:
        assert dst.get(PayloadKey(DID, k))[1].equal(data[k])
    obs = outcome.observation.observation
    assert (obs.source_tier, obs.destination_tier, obs.bytes, obs.pages, obs.ok, obs.worker) == (
        route[0], route[1], 8 * BLOCK, 8, True, W)
    assert obs.duration_s > 0 and obs.link == f"{route[0].value}->{route[1].value}"
    _roundtrip(r)


def test_remote_round_trip(tiers, remote_backend):
    ex = TransferExecutor(BackendCatalog(W, [*tiers.values(), remote_backend]))
    try:
        keys = [11, 12, 13]
        data = _stock(tiers[Tier.HOST], keys)
        up = ex.execute(_command(keys, Tier.HOST, Tier.REMOTE, tid="up"))
        assert up.status is TransferStatus.COMPLETED, up.result.error
        assert sorted(k.key for k in remote_backend.keys()) == keys
        # another worker reads the shared remote tier into its own device tier
        other = TransferExecutor(BackendCatalog("w1", [DeviceMemoryBackend(1 << 20), remote_backend]))
        cmd = _command(keys, Tier.REMOTE, Tier.GPU, tid="down").model_copy(
            update={"destination": EntryLocation(worker="w1", tier=Tier.GPU)})
        down = other.execute(cmd)
        assert down.status is TransferStatus.COMPLETED, down.result.error
        obs = down.observation.observation  # what calibration fits the remote link from, per worker
        assert obs.link == "remote->gpu" and obs.worker == "w1" and obs.ok
        assert obs.pages == 3 and obs.bytes == 3 * BLOCK  # the block size is bytes / pages
        # and into a worker's host tier: the remote -> host link
        host = HostMemoryBackend(1 << 20, pin=False)
        third = TransferExecutor(BackendCatalog("w2", [host, remote_backend]))
        back = third.execute(_command(keys, Tier.REMOTE, Tier.HOST, tid="host").model_copy(
            update={"destination": EntryLocation(worker="w2", tier=Tier.HOST)}))
        assert back.status is TransferStatus.COMPLETED, back.result.error
        assert back.observation.observation.link == "remote->host" and back.observation.observation.worker == "w2"
        other.close()
        third.close()
    finally:
        ex.close()
    assert data


def test_blocks_already_there_are_not_copied_again(tiers, executor):
    keys = [1, 2, 3]
    _stock(tiers[Tier.HOST], keys)
    _stock(tiers[Tier.DISK], [2])
    r = executor.execute(_command(keys, Tier.HOST, Tier.DISK)).result
    assert r.status is TransferStatus.COMPLETED and r.blocks_moved == 2 and r.bytes_moved == 2 * BLOCK
    again = executor.execute(_command(keys, Tier.HOST, Tier.DISK, tid="t-2"))
    assert again.status is TransferStatus.COMPLETED and again.result.blocks_moved == 0
    assert again.observation is None  # nothing was copied, nothing to calibrate


def test_one_flipped_byte_at_the_source_is_an_integrity_error_and_leaves_nothing(tiers, executor):
    keys = [1, 2, 3, 4]
    _stock(tiers[Tier.DISK], keys)
    path = tiers[Tier.DISK].path(PayloadKey(DID, 3))
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x01
    path.write_bytes(bytes(raw))
    outcome = executor.execute(_command(keys, Tier.DISK, Tier.HOST))
    assert outcome.status is TransferStatus.INTEGRITY_ERROR
    assert "checksum" in outcome.result.error and outcome.result.bytes_moved == 0
    assert tiers[Tier.HOST].keys() == [] and tiers[Tier.HOST].used_bytes() == 0  # rolled back
    assert outcome.observation.observation.ok is False
    _roundtrip(outcome.result)


def test_missing_blocks_are_not_found_before_any_copy(tiers, executor):
    _stock(tiers[Tier.HOST], [1, 2])
    outcome = executor.execute(_command([1, 2, 3], Tier.HOST, Tier.GPU))
    assert outcome.status is TransferStatus.NOT_FOUND and "block 2" in outcome.result.error
    assert tiers[Tier.GPU].keys() == [] and outcome.observation is None
    none = executor.execute(_command([9], Tier.HOST, Tier.GPU, tid="t-9"))
    assert none.status is TransferStatus.NOT_FOUND and "block 0" in none.result.error


def test_a_full_destination_rejects_before_moving_a_byte(tmp_path):
    host = HostMemoryBackend(1 << 20)
    small = DeviceMemoryBackend(3 * BLOCK)
    ex = TransferExecutor(BackendCatalog(W, [host, small]))
    _stock(host, [1, 2, 3, 4])
    outcome = ex.execute(_command([1, 2, 3, 4], Tier.HOST, Tier.GPU))
    ex.close()
    assert outcome.status is TransferStatus.REJECTED_CAPACITY
    assert f"has {3 * BLOCK} of {3 * BLOCK} bytes free" in outcome.result.error
    assert small.keys() == [] and outcome.observation is None


def test_racing_transfers_into_a_small_tier_are_admitted_or_rejected_whole():
    host = HostMemoryBackend(1 << 22)
    small = DeviceMemoryBackend(6 * BLOCK)
    ex = TransferExecutor(BackendCatalog(W, [host, small]), jobs=4, lanes=2)
    batches = [list(range(10 * i + 1, 10 * i + 5)) for i in range(4)]  # 4 transfers of 4 blocks, room for 6
    for b in batches:
        _stock(host, b)
    futures = [ex.submit(_command(b, Tier.HOST, Tier.GPU, tid=f"race-{i}")) for i, b in enumerate(batches)]
    outcomes = [f.result(30) for f in futures]
    ex.close()
    held = {k.key for k in small.keys()}
    done = [b for b, o in zip(batches, outcomes) if o.status is TransferStatus.COMPLETED]
    assert len(done) == 1 and held == set(done[0]) and small.used_bytes() == 4 * BLOCK
    rejected = [o for o in outcomes if o.status is TransferStatus.REJECTED_CAPACITY]
    assert len(rejected) == 3 and all(o.observation is None for o in rejected)  # nothing moved for them
    assert small.free_bytes() == 2 * BLOCK  # no reservation leaked


def test_a_deadline_that_passed_before_the_start_moves_nothing(tiers, executor):
    _stock(tiers[Tier.HOST], [1])
    outcome = executor.execute(_command([1], Tier.HOST, Tier.GPU, now=time.time() - 10, deadline_in=5))
    assert outcome.status is TransferStatus.DEADLINE_EXCEEDED and "before the transfer started" in outcome.result.error
    assert tiers[Tier.GPU].keys() == [] and outcome.observation is None


class StepClock:
    """Each reading is one second later; ``hook(n)`` runs at the n-th reading."""

    def __init__(self, start: float = 1_000_000.0, hook=None) -> None:
        self._count = itertools.count()
        self.start = start
        self.hook = hook

    def __call__(self) -> float:
        n = next(self._count)
        if self.hook is not None:
            self.hook(n)
        return self.start + n


def test_a_deadline_that_passes_mid_copy_cancels_and_rolls_back(tiers):
    clock = StepClock()
    ex = TransferExecutor(BackendCatalog(W, tiers.values()), clock=clock, lanes=1)
    keys = list(range(1, 11))
    _stock(tiers[Tier.HOST], keys)
    # the executor reads the clock at start (t0) and before block k (t0 + k): the deadline t0 + 4.5 falls
    # after block 4
    outcome = ex.execute(_command(keys, Tier.HOST, Tier.GPU, now=clock.start, deadline_in=4.5))
    ex.close()
    assert outcome.status is TransferStatus.DEADLINE_EXCEEDED
    assert "after 4 of 10 blocks" in outcome.result.error
    assert tiers[Tier.GPU].keys() == [] and outcome.result.bytes_moved == 0
    obs = outcome.observation.observation  # the copies that did happen still calibrate the link
    assert (obs.ok, obs.pages, obs.bytes) == (False, 4, 4 * BLOCK)


def test_cancel_mid_copy_reports_cancelled_and_rolls_back(tiers):
    ex: TransferExecutor | None = None
    clock = StepClock(start=time.time(), hook=lambda n: n == 4 and ex.cancel("t-1", "planner withdrew it"))
    ex = TransferExecutor(BackendCatalog(W, tiers.values()), clock=clock, lanes=1)
    keys = list(range(1, 9))
    _stock(tiers[Tier.HOST], keys)
    outcome = ex.execute(_command(keys, Tier.HOST, Tier.GPU, now=clock.start, deadline_in=1000))
    ex.close()
    assert outcome.status is TransferStatus.CANCELLED and outcome.result.error.startswith("planner withdrew it after")
    assert tiers[Tier.GPU].keys() == []
    assert not ex.cancel("t-1")  # nothing pending any more


def test_queued_transfers_run_earliest_deadline_first_and_cancel_before_start(tiers):
    gate = threading.Event()
    started: list[str] = []

    def clock() -> float:
        gate.wait(10)
        return time.time()

    ex = TransferExecutor(BackendCatalog(W, tiers.values()), clock=clock, jobs=1, lanes=1)
    _stock(tiers[Tier.HOST], [1, 2, 3, 4])
    now = time.time()
    first = ex.submit(_command([1], Tier.HOST, Tier.GPU, tid="first", now=now, deadline_in=10))
    time.sleep(0.1)  # "first" is running and waits on the gate; the rest queue behind it
    late = ex.submit(_command([2], Tier.HOST, Tier.GPU, tid="late", now=now, deadline_in=30))
    soon = ex.submit(_command([3], Tier.HOST, Tier.GPU, tid="soon", now=now, deadline_in=20))
    dropped = ex.submit(_command([4], Tier.HOST, Tier.GPU, tid="dropped", now=now, deadline_in=25))
    assert ex.cancel("dropped")
    gate.set()
    for f in (first, late, soon, dropped):
        o = f.result(10)
        started.append((o.result.started_at, o.result.transfer_id, o.status))
    ex.close()
    order = [tid for _, tid, _ in sorted(started)]
    assert order.index("soon") < order.index("late")
    statuses = {tid: s for _, tid, s in started}
    assert statuses["dropped"] is TransferStatus.CANCELLED
    assert {statuses[t] for t in ("first", "late", "soon")} == {TransferStatus.COMPLETED}
    assert not tiers[Tier.GPU].contains(PayloadKey(DID, 4))


def test_close_cancels_what_is_still_queued(tiers):
    gate = threading.Event()
    ex = TransferExecutor(BackendCatalog(W, tiers.values()), clock=lambda: gate.wait(5) and time.time(), jobs=1)
    _stock(tiers[Tier.HOST], [1, 2])
    a = ex.submit(_command([1], Tier.HOST, Tier.GPU, tid="a"))
    b = ex.submit(_command([2], Tier.HOST, Tier.GPU, tid="b"))
    threading.Timer(0.2, gate.set).start()
    ex.close("worker shutting down")
    results = {f.result(5).result.transfer_id: f.result(5) for f in (a, b)}
    assert results["b"].status is TransferStatus.CANCELLED and "worker shutting down" in results["b"].result.error


def test_locations_this_worker_cannot_reach_fail_with_the_reason(tiers, executor):
    _stock(tiers[Tier.HOST], [1])
    outcome = executor.execute(_command([1], Tier.HOST, Tier.GPU, source_worker="w9"))
    assert outcome.status is TransferStatus.FAILED and "no backend of tier host is reachable" in outcome.result.error
    cmd = _command([1], Tier.HOST, Tier.REMOTE, tid="t-r")
    outcome = executor.execute(cmd)
    assert outcome.status is TransferStatus.FAILED and "tier remote" in outcome.result.error


def test_a_corrupt_payload_sent_to_the_remote_tier_is_refused_there(tiers, remote_backend):
    """Into the remote tier the executor does not hash on the way: the remote backend checks before
    it sends anything to the store, and says so."""
    ex = TransferExecutor(BackendCatalog(W, [*tiers.values(), remote_backend]))
    keys = [1, 2, 3]
    _stock(tiers[Tier.HOST], keys)
    tiers[Tier.HOST]._entries[PayloadKey(DID, 2)][1][5] ^= 0x20  # one flipped bit in host memory
    outcome = ex.execute(_command(keys, Tier.HOST, Tier.REMOTE))
    ex.close()
    assert outcome.status is TransferStatus.INTEGRITY_ERROR and "checksum" in outcome.result.error
    assert remote_backend.keys() == []  # rolled back: the blocks that did arrive are gone again
