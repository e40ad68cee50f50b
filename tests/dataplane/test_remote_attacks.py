"""The reliability attacks of issue 13 on whatever serves the remote tier (now: Mooncake Store).

* (5) a DELETE racing a GET never makes a read yield another payload's bytes under a valid header;
  relabelled or torn objects put into the store behind NexusKV's back are misses, never data;
* (6) the store's memory and connections stay bounded: freed and rejected saves keep no memory,
  half-sent requests allocate nothing, idle connections cost no thread and little memory each
  while established and new clients go on; a stopped store is reported within the client's
  timeout;
* (12) non-ASCII, empty and otherwise malformed descriptor ids in a key get a clear error (or are
  ignored by name, with a warning) and never a traceback or a store that stops answering.

Each test starts its own small store (``python -m streams.remote_tier``), so its processes'
memory, threads and connections are measured alone. These tests fail on the home-made TCP server
at commit 30ffd34 (benchmarks/README.md, "Remote tier attacks", says how that was checked).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import threading
import time

import pytest
import torch

from nexuskv.dataplane import PayloadKey, RemoteBackend, verify_payload
from nexuskv.dataplane.payload import HEADER_BYTES
from nexuskv.dataplane.remote_store import LEASE_MS, object_name, parse_store_address
from nexuskv.errors import IntegrityError, ObjectConflictError, TierFullError, TierUnavailableError

from tests.dataplane.remote_stores import (
    DID,
    MIB,
    Store,
    established,
    payload,
    raw_client,
    raw_put,
)

pytestmark = pytest.mark.slow



@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path, 64 * MIB)
    yield s
    s.stop()


# -- (5) -----------------------------------------------------------------------------------------

def test_a_delete_racing_a_read_never_yields_another_payloads_bytes(store):
    """Readers read A in bursts while a writer deletes A and saves B (same size, so freed memory
    is what B would get) and A again. Every read either misses or verifies as A."""
    n = 4 * MIB
    ha, da = payload(1, n)
    others = [payload(100 + i, n) for i in range(4)]
    writer, reader = RemoteBackend(store.address, timeout_s=3), RemoteBackend(store.address, timeout_s=3)
    writer.put(ha, da)
    counts = {"verified": 0, "missed": 0, "foreign": 0, "deleted": 0, "busy": 0}
    lock = threading.Lock()
    stop = threading.Event()

    def read() -> None:
        out = torch.empty(n, dtype=torch.uint8)
        while not stop.is_set():
            burst_end = time.monotonic() + 0.3
            while time.monotonic() < burst_end and not stop.is_set():
                try:
                    header = reader.read_into(ha.key, out)
                except (IntegrityError, TierUnavailableError):
                    header = None
                if header is None:
                    kind = "missed"
                else:
                    try:
                        verify_payload(ha.key, header, out.numpy())
                        kind = "verified"
                    except IntegrityError:
                        kind = "foreign"  # a valid header over another payload's bytes
                with lock:
                    counts[kind] += 1
            stop.wait(LEASE_MS / 1000 * 1.3)  # let the lease lapse: deletes get through

    def write() -> None:
        i = 0
        while not stop.is_set():
            try:
                if writer.delete(ha.key):
                    with lock:
                        counts["deleted"] += 1
                hb, db = others[i % len(others)]
                writer.put(hb, db)
                writer.put(ha, da)
                writer.delete(hb.key)
            except TierUnavailableError:  # A was held by a read for the whole timeout
                with lock:
                    counts["busy"] += 1
            except TierFullError:
                pass
            i += 1

    threads = [threading.Thread(target=read), threading.Thread(target=read), threading.Thread(target=write)]
    for t in threads:
        t.start()
    time.sleep(8)
    stop.set()
    for t in threads:
        t.join(30)
    writer.close()
    reader.close()
    assert counts["foreign"] == 0, counts
    assert counts["verified"] > 20 and counts["deleted"] >= 2, counts  # the race was exercised


def test_a_removal_during_a_read_lease_is_refused_by_the_store(store):
    """The mechanism behind the test above: Mooncake will not free an object a read holds."""
    backend = RemoteBackend(store.address)
    h, d = payload(1, MIB)
    backend.put(h, d)
    raw = raw_client(store.address)
    assert backend.read_into(h.key, torch.empty(MIB, dtype=torch.uint8)) == h
    assert raw.remove(object_name(h.key)) == -706  # OBJECT_HAS_LEASE
    t0 = time.monotonic()
    assert backend.delete(h.key)  # waits for the lease, then removes
    assert time.monotonic() - t0 < LEASE_MS / 1000 + 1.0
    raw.close()
    backend.close()


def test_relabelled_and_torn_objects_are_misses_never_data(store):
    """Objects written behind NexusKV's back under A's name: B's header and bytes (relabelled), A's
    header with B's bytes (torn), a header of the wrong size, garbage. None reads as A."""
    backend = RemoteBackend(store.address)
    ha, da = payload(1, MIB)
    hb, db = payload(2, MIB)
    raw = raw_client(store.address)
    name = object_name(ha.key)
    cases = {
        "relabelled": hb.pack() + db.numpy().tobytes(),
        "torn": ha.pack() + db.numpy().tobytes(),
        "short": ha.pack() + da.numpy().tobytes()[: MIB // 2],
        "garbage": os.urandom(HEADER_BYTES + MIB),
    }
    for case, blob in cases.items():
        raw.remove(name, True)
        assert raw_put(raw, name, blob) == 0, case
        header = backend.header(ha.key)
        assert header is None or header == ha, case
        out = torch.empty(MIB, dtype=torch.uint8)
        try:
            got = backend.read_into(ha.key, out)
        except IntegrityError:
            got = None
        if got is not None:
            with pytest.raises(IntegrityError):
                verify_payload(ha.key, got, out.numpy())
        with pytest.raises(IntegrityError):
            backend.read_verified(ha.key, out)
        try:
            assert backend.get(ha.key) is None, case
        except IntegrityError:
            pass
    raw.close()
    backend.close()


# -- (6) -----------------------------------------------------------------------------------------

def test_freed_and_rejected_saves_keep_no_memory(store):
    """60 saves and deletes of payloads of distinct sizes on a 64 MiB store, then 20 saves too big
    to fit: the store's memory stays within its capacity plus a fixed overhead."""
    backend = RemoteBackend(store.address)
    before = store.rss()
    for i in range(60):
        n = 6 * MIB + i * 4096
        h, d = payload(i, n, seed=1)
        backend.put(h, d)
        assert backend.delete(h.key)
    after_cycles = store.rss()
    big_h, big_d = payload(999, 40 * MIB)
    filler = [payload(500 + i, 8 * MIB, seed=2) for i in range(5)]
    for h, d in filler:
        backend.put(h, d)
    for _ in range(20):
        with pytest.raises(TierFullError):
            backend.put(big_h, big_d)
    after_rejects = store.rss()
    assert backend.used_bytes() == 5 * (8 * MIB + HEADER_BYTES)
    backend.close()
    growth = max(after_cycles, after_rejects) - before
    assert growth <= 64 * MIB + 48 * MIB, (before, after_cycles, after_rejects)


def test_half_sent_requests_allocate_nothing(store):
    """64 connections to every port of the store each send 20 bytes of a header that announces
    16 MiB to 16 GiB more, then wait: the store allocates nothing for them and keeps serving."""
    backend = RemoteBackend(store.address)
    h, d = payload(1, MIB)
    backend.put(h, d)
    before = store.rss()
    heads = [struct.pack(">4sB3xIQ", b"NKVR", 2, 1 << 24, 0)[:20],  # the old server's frame header
             struct.pack("<BBHIQI", 0x21, 1, 0, 1 << 24, 1 << 34, 1 << 30)[:20],  # an RPC header, huge body
             struct.pack("<QQI", 1 << 34, 1 << 34, 0xFFFFFFFF)[:20]]  # a transfer header, huge size
    socks = []
    for port in store.ports():
        for i in range(64):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=2)
                s.sendall(heads[i % len(heads)])
                socks.append(s)
            except OSError:
                break
    time.sleep(2)
    grown = store.rss() - before
    out = torch.empty(MIB, dtype=torch.uint8)
    assert backend.read_into(h.key, out) == h and torch.equal(out, d)
    for s in socks:
        s.close()
    assert len(socks) >= 64
    assert grown <= 16 * MIB, grown
    assert all(p in store.pids() for p in store.pids())  # nothing crashed
    backend.close()


def test_idle_connections_cost_no_thread_and_little_memory_each(store):
    """600 idle connections to the store's master: no thread each, at most 16 KiB each, an
    established client goes on and a new one joins while they are held. (Mooncake does not time
    idle connections out: they are bounded by the machine's open-file limit only; see
    benchmarks/README.md, "Remote tier attacks".)"""
    backend = RemoteBackend(store.address)
    h, d = payload(1, MIB)
    backend.put(h, d)
    threads_before, rss_before = store.threads(), store.rss()
    master_port = parse_store_address(store.address).port
    socks = [socket.create_connection(("127.0.0.1", master_port), timeout=2) for _ in range(600)]
    try:
        time.sleep(1)
        held = established(store.pids(), master_port)
        threads_flooded, rss_flooded = store.threads(), store.rss()
        out = torch.empty(MIB, dtype=torch.uint8)
        assert backend.read_into(h.key, out) == h and torch.equal(out, d)  # the established client goes on
        h2, d2 = payload(2, MIB)
        backend.put(h2, d2)
        late = RemoteBackend(store.address, timeout_s=5)  # a new client joins during the flood
        assert late.get(h2.key)[0] == h2
        late.close()
    finally:
        for s in socks:
            s.close()
    backend.close()
    assert held >= 600  # the store holds them (nothing refuses them)
    assert threads_flooded <= threads_before + 8, (threads_before, threads_flooded)
    assert rss_flooded - rss_before <= 600 * 16 * 1024, (rss_before, rss_flooded)


def test_a_stopped_store_is_reported_within_the_clients_timeout(store):
    backend = RemoteBackend(store.address, timeout_s=2)
    master = min(store.pids())  # the master starts first
    os.kill(master, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(TierUnavailableError):
            backend.free_bytes()
        with pytest.raises(TierUnavailableError):
            RemoteBackend(store.address, timeout_s=2)
        assert time.monotonic() - t0 < 8
    finally:
        os.kill(master, signal.SIGCONT)
    assert backend.free_bytes() > 0
    backend.close()


# -- (12) ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("descriptor", ["", "d\u00e9j\u00e0-vu", "sd1-\u4e2d\u6587", "a" * 65, "nul\x00byte"])
def test_a_malformed_descriptor_id_is_a_clear_error_before_any_io(descriptor):
    with pytest.raises(ValueError, match="descriptor_id: 1 to 64 ASCII characters"):
        PayloadKey(descriptor, 1)


def test_objects_with_malformed_descriptor_ids_in_the_store_are_ignored_by_name(store, caplog):
    """Objects named like payloads but with an empty, non-ASCII, NUL-carrying, over-long or
    line-breaking descriptor id, written by another client: the store keeps answering, the tier
    lists only real payloads (a warning says how many it ignored), and saves and reads go on."""
    backend = RemoteBackend(store.address)
    h, d = payload(1, 4096)
    backend.put(h, d)
    raw = raw_client(store.address)
    hex_key = f"{7:032x}"
    hostile = [f"nexuskv/p/0/{hex_key}/", "nexuskv/p/0/" + hex_key + "/d\u00e9j\u00e0",
               "nexuskv/p/0/" + hex_key + "/nul\x00byte", "nexuskv/p/0/" + hex_key + "/" + "a" * 5000,
               "nexuskv/p/1/" + hex_key + "/x\n" + object_name(PayloadKey(DID, 8)),
               "nexuskv/p/99999999999/" + hex_key + "/x", "nexuskv/p/0/zz/x"]
    for name in hostile:
        assert raw_put(raw, name, b"hostile") == 0, name
    with caplog.at_level(logging.WARNING, logger="nexuskv.dataplane.remote"):
        assert backend.keys() == [h.key]
    assert "not named like NexusKV payloads" in caplog.text
    h2, d2 = payload(2, 4096)
    backend.put(h2, d2)
    assert sorted(backend.keys()) == sorted([h.key, h2.key])
    assert backend.get(h.key)[0] == h and backend.get(PayloadKey(DID, 8)) is None
    backend.clear()
    assert backend.keys() == []
    raw.close()
    backend.close()


# -- helpers ---------------------------------------------------------------------------------------

# -- issue 23: saves acknowledged only when readable, deadlines that hold, deletes not starved ----

def test_a_squatted_name_fails_the_save_and_a_same_payload_copy_is_acknowledged(store):
    """A plain Mooncake client writes under payload A's name first (garbage; another payload's
    header and bytes; A's header over other bytes): NexusKV's save of A fails with the reason and
    nothing reads as A. A copy of A's own bytes saved by another worker is acknowledged."""
    raw = raw_client(store.address)
    backend = RemoteBackend(store.address)
    cases = {}
    for i, kind in enumerate(("garbage", "relabelled", "torn")):
        ha, da = payload(10 + i, MIB)
        hb, db = payload(20 + i, MIB)
        blob = {"garbage": bytes(HEADER_BYTES + MIB),
                "relabelled": hb.pack() + db.numpy().tobytes(),
                "torn": ha.pack() + db.numpy().tobytes()}[kind]
        assert raw_put(raw, object_name(ha.key), blob) == 0
        with pytest.raises(ObjectConflictError, match="already holds an object under its name") as err:
            backend.put(ha, da)
        cases[kind] = str(err.value)
        try:
            header = backend.read_verified(ha.key, torch.empty(MIB, dtype=torch.uint8))
        except IntegrityError:
            header = None
        assert header is None  # never read as A (a read checks header and bytes)
    assert backend.counters()["conflicts"] == 3
    assert "header names" in cases["relabelled"] and "checksum" in cases["torn"], cases
    other = RemoteBackend(store.address)
    h, d = payload(30, MIB)
    other.put(h, d)
    backend.put(h, d)  # the same payload, already stored by another worker: acknowledged, and readable
    out = torch.empty(MIB, dtype=torch.uint8)
    assert backend.read_into(h.key, out) == h and torch.equal(out, d)
    assert backend.counters()["conflicts"] == 3
    raw.close()
    other.close()
    backend.close()


def test_every_call_returns_within_its_deadline_while_the_transport_is_stalled(store):
    """The process holding the store's bytes is stopped (SIGSTOP): Mooncake's client would block
    for its own tens of seconds; every call of the backend returns within its deadline (+1 s),
    and the backend works again once the store does."""
    backend = RemoteBackend(store.address, timeout_s=2)
    h, d = payload(1, MIB)
    backend.put(h, d)
    master = min(store.pids())
    segment = [p for p in store.pids() if p != master]
    assert segment
    for pid in segment:
        os.kill(pid, signal.SIGSTOP)
    took = {}
    try:
        h2, d2 = payload(2, MIB)
        calls = {"put": lambda: backend.put(h2, d2),
                 "read": lambda: backend.read_into(h.key, torch.empty(MIB, dtype=torch.uint8)),
                 "headers": lambda: backend.headers([h.key, h2.key]),
                 "delete": lambda: backend.delete(h.key)}
        for name, fn in calls.items():
            t0 = time.monotonic()
            try:
                fn()
            except TierUnavailableError:
                pass
            took[name] = time.monotonic() - t0
    finally:
        for pid in segment:
            os.kill(pid, signal.SIGCONT)
    assert all(t <= 2 + 1 for t in took.values()), took
    assert backend.counters()["overruns"] >= 1, (took, backend.counters())
    deadline = time.monotonic() + 60
    while True:  # the store answers again: so does the backend
        try:
            h3, d3 = payload(3, MIB)
            backend.put(h3, d3)
            break
        except TierUnavailableError:
            assert time.monotonic() < deadline
            time.sleep(0.5)
    out = torch.empty(MIB, dtype=torch.uint8)
    assert backend.read_into(h3.key, out) == h3 and torch.equal(out, d3)
    backend.close()


def test_deletes_are_not_starved_by_nonstop_readers(store):
    """Two readers read each payload without pause (every read renews Mooncake's lease); nine
    deletes each return within their bounded wait (+1 s), all succeed, and they are counted."""
    backend = RemoteBackend(store.address, delete_wait_s=1.0)
    readers = [RemoteBackend(store.address) for _ in range(2)]
    payloads = [payload(100 + i, MIB) for i in range(9)]
    for h, d in payloads:
        backend.put(h, d)
    stop = threading.Event()

    def read(client) -> None:
        out = torch.empty(MIB, dtype=torch.uint8)
        while not stop.is_set():
            for h, _ in payloads:
                try:
                    client.read_into(h.key, out)
                except (IntegrityError, TierUnavailableError):
                    pass

    threads = [threading.Thread(target=read, args=(r,)) for r in readers]
    for t in threads:
        t.start()
    time.sleep(0.3)
    took = []
    try:
        for h, _ in payloads:
            t0 = time.monotonic()
            assert backend.delete(h.key)
            took.append(time.monotonic() - t0)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert max(took) <= 1.0 + 1.0, took
    assert all(backend.header(h.key) is None for h, _ in payloads)
    counts = backend.counters()
    assert counts["delete_retries"] + counts["forced_deletes"] > 0, counts  # the readers really held leases
    for r in readers:
        r.close()
    backend.close()


def test_a_killed_store_costs_one_deadline_then_calls_fail_at_once(store):
    """Both store processes killed (SIGKILL): Mooncake's client answers the first call with an RPC
    failure, then blocks every later call for its own timeouts, so each waited out its deadline (a
    vLLM engine's scheduler thread waited 10 s on every remote probe after such a kill). Now the
    first failure opens the backend's breaker: later calls fail at once while the master's port
    refuses, counted."""
    backend = RemoteBackend(store.address, timeout_s=2)
    other = RemoteBackend(store.address, timeout_s=2)  # another backend of the process (a worker beside a scheduler)
    h, d = payload(1, MIB)
    backend.put(h, d)
    for pid in store.pids():
        os.kill(pid, signal.SIGKILL)
    calls = {"headers": lambda: backend.headers([h.key] * 35),
             "read": lambda: backend.read_into(h.key, torch.empty(MIB, dtype=torch.uint8)),
             "put": lambda: backend.put(*payload(2, MIB))}
    took = []
    for _ in range(3):
        for name, fn in calls.items():
            t0 = time.monotonic()
            with pytest.raises(TierUnavailableError):
                fn()
            took.append((name, round(time.monotonic() - t0, 3)))
    assert took[0][1] <= 2 + 1, took
    assert all(t < 0.6 for _, t in took[1:]), took  # at most the 0.5 s check that the port still refuses
    counters = backend.counters()
    assert counters["store_down"] == 1 and counters["short_circuited"] >= 6, counters
    t0 = time.monotonic()
    with pytest.raises(TierUnavailableError, match="not tried: the service is down"):
        other.headers([h.key], deadline_s=0.5)  # the store's breaker is one per process: no deadline waited
    assert time.monotonic() - t0 < 0.6
    backend.close()
    other.close()
