"""The catalog chooses backends by capability and policy; names never decide."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import nexuskv.dataplane as dataplane
from nexuskv.dataplane import (
    POLICIES,
    BackendCatalog,
    DeviceMemoryBackend,
    DiskBackend,
    DurableFirst,
    FastestFirst,
    HostMemoryBackend,
    MostFree,
    Need,
    PayloadHeader,
    PayloadKey,
)
from nexuskv.descriptor import Tier
from nexuskv.entries import EntryLocation

DID = "sd1-" + "e" * 32


def _fill(backend, key: int, n: int) -> PayloadKey:
    data = torch.zeros(n, dtype=torch.uint8)
    header = PayloadHeader.for_data(PayloadKey(DID, key), data.numpy())
    backend.put(header, data)
    return header.key


@pytest.fixture
def tiers(tmp_path):
    small_host = HostMemoryBackend(10_000, label="zz-small")
    big_host = HostMemoryBackend(50_000, label="aa-big")
    device = DeviceMemoryBackend(20_000)
    disk = DiskBackend(tmp_path, 100_000)
    return small_host, big_host, device, disk


def test_need_filters_on_capabilities(tiers):
    small_host, big_host, device, disk = tiers
    cat = BackendCatalog("w0", tiers)
    assert [b for b, _ in cat.candidates(Need(tier=Tier.HOST))] == [small_host, big_host]
    assert cat.select(Need(durable=True)) is disk
    assert cat.select(Need(real_device=True)) is (device if dataplane.cuda_available() else None)
    assert cat.select(Need(tier=Tier.HOST, free_bytes=20_000)) is big_host
    assert cat.select(Need(tier=Tier.REMOTE)) is None


def test_policies_rank_without_names(tiers):
    small_host, big_host, device, disk = tiers
    cat = BackendCatalog("w0", tiers)
    assert cat.select(Need(), MostFree()) is disk
    assert cat.select(Need(), FastestFirst()) is device
    assert cat.select(Need(), DurableFirst()) is disk
    assert cat.select(Need(tier=Tier.HOST), FastestFirst()) is big_host  # more free, whatever its label
    _fill(big_host, 1, 45_000)
    assert cat.select(Need(tier=Tier.HOST), MostFree()) is small_host
    assert set(POLICIES) == {"most_free", "fastest_first", "durable_first"}


def test_a_held_payload_decides_the_source(tiers):
    small_host, big_host, device, disk = tiers
    cat = BackendCatalog("w0", tiers)
    key = _fill(small_host, 7, 100)
    assert cat.select(Need(tier=Tier.HOST, holds=(key,))) is small_host
    assert cat.source_for(EntryLocation(worker="w0", tier=Tier.HOST), key) is small_host
    assert cat.source_for(EntryLocation(worker="w0", tier=Tier.DISK), key) is None


def test_only_shared_backends_are_reachable_for_other_workers(tiers, remote_backend):
    cat = BackendCatalog("w0", [*tiers, remote_backend])
    assert cat.reachable(EntryLocation(worker="w1", tier=Tier.HOST)) == []
    assert cat.reachable(EntryLocation(worker="w1", tier=Tier.REMOTE)) == [remote_backend]
    assert cat.reachable(EntryLocation(worker="w0", tier=Tier.REMOTE)) == [remote_backend]


def test_destination_prefers_room_and_falls_back_to_the_roomiest_full_one(tiers):
    small_host, big_host, device, disk = tiers
    cat = BackendCatalog("w0", tiers)
    loc = EntryLocation(worker="w0", tier=Tier.HOST)
    assert cat.destination_for(loc, 8_000) is big_host
    assert cat.destination_for(loc, 60_000) is big_host  # none fits: the roomiest, to be rejected with numbers
    assert cat.destination_for(EntryLocation(worker="w0", tier=Tier.OBJECT), 1) is None


def test_public_surface_resolves_and_the_server_side_does_not_load_torch():
    for name in dataplane.__all__:
        assert getattr(dataplane, name) is not None
    code = "import sys, streams.remote_tier; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
