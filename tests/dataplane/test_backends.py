"""Every tier backend: capacity, handles, checksummed reads, and what its capabilities say.

The remote tier is a real Mooncake Store (``remote_backend`` fixture: ``python -m
streams.remote_tier`` starts its master and memory segment); its capacity test starts a second,
small one.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from nexuskv.dataplane import (
    DeviceMemoryBackend,
    DiskBackend,
    HostMemoryBackend,
    PayloadHeader,
    PayloadKey,
    RemoteBackend,
    cuda_available,
)
from nexuskv.dataplane.payload import HEADER_BYTES
from nexuskv.descriptor import Tier
from nexuskv.errors import IntegrityError, TierFullError, TierUnavailableError
from streams.bus.process import ManagedProcess
from streams.remote_tier import local_address

DID = "sd1-" + "d" * 32
KINDS = ["host", "device", "disk", "remote"]


def _payload(key: int, n: int = 4096, group: int = 0) -> tuple[PayloadHeader, torch.Tensor]:
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(key))
    return PayloadHeader.for_data(PayloadKey(DID, key, group), data.numpy()), data


@pytest.fixture(params=KINDS)
def backend(request, tmp_path):
    kind = request.param
    if kind == "host":
        b = HostMemoryBackend(1 << 20)
    elif kind == "device":
        b = DeviceMemoryBackend(1 << 20)
    elif kind == "disk":
        b = DiskBackend(tmp_path / "disk", 1 << 20)
    else:
        b = request.getfixturevalue("remote_backend")
    yield b
    if kind != "remote":
        b.close()


def test_put_get_handles_and_accounting(backend):
    h1, d1 = _payload(1)
    h2, d2 = _payload(2, n=1000, group=1)
    free0 = backend.free_bytes()
    handle = backend.put(h1, d1)
    assert (handle.key, handle.nbytes, handle.checksum, handle.tier) == (h1.key, 4096, h1.checksum,
                                                                          backend.capabilities.tier)
    backend.put(h2, d2)
    per = _overhead(backend)
    assert backend.used_bytes() == 5096 + 2 * per and backend.free_bytes() == free0 - 5096 - 2 * per
    assert sorted(backend.keys()) == sorted([h1.key, h2.key])
    assert backend.header(h1.key) == h1 and backend.contains(h2.key)
    got_header, got = backend.get(h2.key)
    assert got_header == h2 and torch.equal(got, d2)
    out = torch.empty(4096, dtype=torch.uint8)
    assert backend.read_into(h1.key, out) == h1 and torch.equal(out, d1)
    assert backend.delete(h1.key) and not backend.delete(h1.key)
    assert backend.used_bytes() == 1000 + per


def _overhead(backend) -> int:
    """Bytes a tier uses per payload beyond the payload: the store of the remote tier keeps the
    128-byte header with the bytes and counts what it allocated."""
    return HEADER_BYTES if backend.capabilities.tier is Tier.REMOTE else 0


def test_missing_payloads_are_none(backend):
    missing = PayloadKey(DID, 999)
    assert backend.header(missing) is None
    assert backend.get(missing) is None
    assert backend.read_into(missing, torch.empty(10, dtype=torch.uint8)) is None


def test_the_first_copy_wins(backend):
    h, d = _payload(5)
    backend.put(h, d)
    backend.put(h, d)
    assert backend.used_bytes() == h.nbytes + _overhead(backend) and backend.keys() == [h.key]


def test_capabilities_say_what_the_tier_is(backend):
    caps = backend.capabilities
    expected = {"host": Tier.HOST, "device": Tier.GPU, "disk": Tier.DISK, "remote": Tier.REMOTE}
    assert caps.tier in expected.values()
    if caps.tier is Tier.GPU:
        assert caps.stand_in is (not cuda_available())
        assert caps.real_device is cuda_available()
        if not cuda_available():
            assert caps.device == "cpu" and "stand-in" in caps.note
    if caps.tier is Tier.HOST:
        assert caps.pinned is cuda_available()
        if not cuda_available():
            assert "pinning needs CUDA" in caps.note
    assert caps.durable is (caps.tier is Tier.DISK)
    assert caps.out_of_process is caps.shared is (caps.tier is Tier.REMOTE)


@pytest.mark.parametrize("kind", ["host", "device", "disk"])
def test_a_full_tier_rejects_and_stores_nothing(kind, tmp_path):
    b = {"host": lambda: HostMemoryBackend(10_000), "device": lambda: DeviceMemoryBackend(10_000),
         "disk": lambda: DiskBackend(tmp_path, 10_000)}[kind]()
    rejected = _overfill(b, "do not fit")
    if kind == "disk":
        assert not b.path(rejected).exists()


def _overfill(b, message: str, n: int = 6000) -> PayloadKey:
    """Put ``n`` bytes into a tier with room for fewer than 2n, then n more: rejected, nothing of it stored."""
    h1, d1 = _payload(1, n=n)
    h2, d2 = _payload(2, n=n)
    b.put(h1, d1)
    with pytest.raises(TierFullError, match=message):
        b.put(h2, d2)
    assert b.keys() == [h1.key] and b.used_bytes() == n + _overhead(b)
    return h2.key


def test_a_full_remote_tier_store_rejects_and_stores_nothing(tmp_path):
    """A 16 MiB store (Mooncake's smallest; its own Mooncake master and segment): a save that does not fit is refused
    whole, the store evicts nothing to make room, and the next save still works."""
    address = local_address()
    env = dict(os.environ, NEXUSKV_REMOTE_TIER_BYTES=str(16 << 20), NEXUSKV_DATA_DIR=str(tmp_path))
    proc = ManagedProcess([sys.executable, "-m", "streams.remote_tier", "--listen", address], name="small-remote",
                          log_path=tmp_path / "remote.log", env=env)
    proc.start()
    try:
        b = _connect(address, proc)
        assert b.capacity_bytes == 16 << 20
        _overfill(b, "remote tier full", n=9_000_000)
        h3, d3 = _payload(3, n=100)
        b.put(h3, d3)  # the client is still usable after a rejected save
        assert b.get(h3.key)[1].equal(d3)
        assert b.header(PayloadKey(DID, 1)) is not None  # nothing was evicted to make room
        b.close()
    finally:
        proc.stop()


def _connect(address: str, proc: ManagedProcess) -> RemoteBackend:
    deadline = time.monotonic() + 60
    while True:
        try:
            return RemoteBackend(address, timeout_s=5)
        except TierUnavailableError:
            assert proc.alive() and time.monotonic() < deadline, proc.log_tail()
            time.sleep(0.2)


def test_the_remote_tier_refuses_bytes_that_do_not_match_their_header(remote_backend):
    h, d = _payload(7)
    corrupt = d.clone()
    corrupt[100] ^= 0xFF
    with pytest.raises(IntegrityError, match="checksum"):
        remote_backend.put(h, corrupt)
    assert remote_backend.keys() == [] and remote_backend.used_bytes() == 0


def test_an_unreachable_remote_tier_says_so():
    with pytest.raises(TierUnavailableError, match="cannot be reached"):
        RemoteBackend(local_address(), timeout_s=1)
    with pytest.raises(TierUnavailableError, match="mooncake://host:port"):
        RemoteBackend("tcp://127.0.0.1:1")


@pytest.mark.parametrize("kind", ["host", "device"])
def test_memory_corruption_is_caught_on_read(kind):
    b = HostMemoryBackend(1 << 20) if kind == "host" else DeviceMemoryBackend(1 << 20)
    h, d = _payload(9)
    b.put(h, d)
    b._entries[h.key][1][17] ^= 0x04  # one flipped bit in the stored payload
    with pytest.raises(IntegrityError, match="checksum"):
        b.get(h.key)


def test_disk_payloads_survive_a_restart_and_corruption_is_caught(tmp_path):
    first = DiskBackend(tmp_path, 1 << 20)
    h1, d1 = _payload(1)
    h2, d2 = _payload(2)
    first.put(h1, d1)
    first.put(h2, d2)
    (tmp_path / DID / "g0" / "leftover.nkv.123.tmp").write_bytes(b"torn")
    again = DiskBackend(tmp_path, 1 << 20)
    assert sorted(again.keys()) == sorted([h1.key, h2.key]) and again.used_bytes() == 8192
    assert not (tmp_path / DID / "g0" / "leftover.nkv.123.tmp").exists()
    assert again.get(h1.key)[1].equal(d1)
    raw = bytearray(again.path(h2.key).read_bytes())
    raw[-1] ^= 0x80  # one flipped bit in the last data byte on disk
    again.path(h2.key).write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="checksum"):
        again.get(h2.key)


def test_a_disk_file_renamed_to_another_payload_is_refused(tmp_path):
    b = DiskBackend(tmp_path, 1 << 20)
    h1, d1 = _payload(1)
    b.put(h1, d1)
    other = PayloadKey(DID, 2)
    b.path(other).write_bytes(b.path(h1.key).read_bytes())  # payload 1's file under payload 2's name
    assert DiskBackend(tmp_path, 1 << 20).keys() == [h1.key]  # a restart ignores it
    b._index[other] = PayloadHeader(other, h1.nbytes, h1.checksum)  # as if indexed: reading still refuses
    with pytest.raises(IntegrityError, match="names"):
        b.get(other)


@pytest.mark.parametrize("kind", ["host", "device", "disk"])
def test_reservations_set_room_aside_for_their_commits_only(kind, tmp_path):
    b = {"host": lambda: HostMemoryBackend(10_000), "device": lambda: DeviceMemoryBackend(10_000),
         "disk": lambda: DiskBackend(tmp_path, 10_000)}[kind]()
    r = b.reserve(8_000)
    assert r is not None and b.free_bytes() == 2_000 and b.reserve(3_000) is None
    h1, d1 = _payload(1, n=5000)
    h2, d2 = _payload(2, n=5000)
    with pytest.raises(TierFullError):
        b.put(h1, d1)  # without the reservation, only 2,000 bytes are free
    b.put(h1, d1, r)
    assert r.remaining == 3_000 and b.used_bytes() == 5_000 and b.free_bytes() == 2_000
    r.release()
    assert b.free_bytes() == 5_000
    b.put(h2, d2)
    assert b.free_bytes() == 0
