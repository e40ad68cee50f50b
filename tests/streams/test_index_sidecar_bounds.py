"""The index sidecar's bounds, on a real Unix socket (no broker; the replica is a stand-in).

* asks are answered on the sidecar's own thread: the loop that applies kv-events (held here for
  half a second, as an ingest slice would) never holds an ask, and a large ask, answered on the
  bulk thread, never holds a small one;
* a frame must be finished within the frame deadline (slowloris), connections are capped (the
  one idle longest gives way), asks are capped at what an engine sends, a client that does not
  read its answers stops being read — each refusal counted on ``nexuskv_index_ask_refusals`` by
  reason and answered with an error frame;
* the engine's client asks for the first ``max_keys`` blocks of a longer prompt;
* the limits come from the settings, and a bad one names its variable.

The broker-backed service test is ``tests/streams/test_index_sidecar.py``.
"""

from __future__ import annotations

import asyncio
import math
import socket
import struct
import tempfile
import threading
import time
from pathlib import Path

import pytest

from connectors.index_client import IndexClient
from nexuskv.config import Settings
from nexuskv.contracts.lookup_wire import (
    OP_LOOKUP,
    VERSION,
    Ask,
    decode_answer,
    encode_ask,
    pack_keys,
    wire_scope,
)
from nexuskv.descriptor import Tier
from nexuskv.entries import EntryLocation
from nexuskv.errors import ConfigError
from nexuskv.lookup import LocationMatch, LookupResult
from streams.bus.metrics import REGISTRY
from streams.index_sidecar import AskLimits, IndexSidecar

from tests.factories import scope

SCOPE = scope("tenant-bounds")
WIRE = wire_scope(SCOPE)


class SlowReplica:
    """Answers one match per lookup; a lookup of more than ``slow_keys`` keys takes ``slow_s``."""

    def __init__(self, slow_keys: int = 1 << 30, slow_s: float = 0.0) -> None:
        self.slow_keys, self.slow_s = slow_keys, slow_s
        self.asked: list[int] = []
        self.threads: set[str] = set()

    def lookup(self, s, keys):
        n = len(keys) // 16
        self.asked.append(n)
        self.threads.add(threading.current_thread().name)
        if n > self.slow_keys:
            time.sleep(self.slow_s)
        loc = EntryLocation(worker="w-a", tier=Tier.GPU, group=0)
        return LookupResult(num_blocks=n, matches=(LocationMatch(loc, "w-a", min(n, 2)),) if n else ())

    async def wait_caught_up(self, timeout_s: float = 60.0) -> None:
        await asyncio.sleep(0)


class Server:
    """An IndexSidecar whose home loop (the replica's, where ingest runs) is a thread of the test."""

    def __init__(self, replica, path: Path, limits: AskLimits, ask_nice: int | None = None) -> None:
        self.replica, self.path = replica, path
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.sidecar = IndexSidecar(replica, path, limits, ask_nice=ask_nice)
        asyncio.run_coroutine_threadsafe(self.sidecar.start(), self.loop).result(5)

    def on_ask_loop(self, fn):
        """``fn()`` run on the sidecar's ask loop; its result."""
        done: asyncio.Future = asyncio.run_coroutine_threadsafe(_call(fn), self.sidecar._loop)
        return done.result(5)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.sidecar.close(), self.loop).result(15)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(100))


async def _call(fn):
    return fn()


@pytest.fixture
def sock_path():
    with tempfile.TemporaryDirectory(prefix="nkv-", dir="/tmp") as d:
        yield Path(d) / "index.sock"


def _serve(sock_path, replica=None, ask_nice=None, **limits) -> Server:
    return Server(replica or SlowReplica(), sock_path, AskLimits(**limits), ask_nice)


def _refused(reason: str) -> float:
    return REGISTRY.get_sample_value("nexuskv_index_ask_refusals_total", {"reason": reason}) or 0.0


def _connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(path))
    s.settimeout(3)
    return s


def _read_answer(s: socket.socket):
    header = s.recv(4, socket.MSG_WAITALL)
    assert len(header) == 4, "the sidecar closed without an answer"
    (n,) = struct.unpack(">I", header)
    return decode_answer(s.recv(n, socket.MSG_WAITALL))


def _ask(request_id: int, n: int) -> bytes:
    return encode_ask(Ask(VERSION, OP_LOOKUP, request_id, WIRE, bytes(16 * n)))


def test_asks_are_answered_while_the_ingest_loop_is_held(sock_path):
    replica = SlowReplica()
    server = _serve(sock_path, replica)
    try:
        client = IndexClient(sock_path, budget_s=0.2, backoff_s=0.0)
        assert client.lookup(SCOPE, bytes(16 * 8)).matches
        server.loop.call_soon_threadsafe(_spin, 0.6)  # ingest that holds its loop (and wants the GIL) for 600 ms
        time.sleep(0.05)
        took = []
        for _ in range(20):
            t0 = time.perf_counter()
            assert client.lookup(SCOPE, bytes(16 * 8)).matches
            took.append(time.perf_counter() - t0)
        assert max(took) < 0.1 and sum(took) < 0.5, took  # none waited for the held loop
        assert client.stats["timeouts"] == 0 and replica.threads == {"index-asks"}
    finally:
        server.stop()


def test_a_large_ask_is_answered_on_the_bulk_thread_and_holds_no_small_one(sock_path):
    replica = SlowReplica(slow_keys=64, slow_s=0.5)
    server = _serve(sock_path, replica, bulk_keys=64, bulk_queue=1)
    try:
        big = _connect(sock_path)
        big.sendall(_ask(1, 1000))  # 500 ms on the bulk thread
        time.sleep(0.05)
        client = IndexClient(sock_path, budget_s=0.2, backoff_s=0.0)
        t0 = time.perf_counter()
        assert client.lookup(SCOPE, bytes(16 * 16)).matches
        assert time.perf_counter() - t0 < 0.1
        other = _connect(sock_path)  # a second large ask while one is answered: refused, at once
        other.sendall(_ask(9, 1000))
        answer = _read_answer(other)
        assert answer.id == 9 and answer.error.startswith("bulk_busy")
        first = _read_answer(big)
        assert first.id == 1 and not first.error and first.num_blocks == 1000
        big.sendall(_ask(2, 1000))  # its connection is read again after the answer
        assert _read_answer(big).id == 2
        assert server.sidecar.refusals == {"bulk_busy": 1}
        assert any(t.startswith("index-bulk-asks") for t in replica.threads)
        big.close()
        other.close()
    finally:
        server.stop()


def test_a_frame_not_finished_in_time_closes_its_connection_and_others_are_answered(sock_path, caplog):
    server = _serve(sock_path, frame_deadline_s=0.3)
    before = _refused("frame_deadline")
    try:
        slow = [_connect(sock_path) for _ in range(5)]
        for s in slow:
            s.sendall(_ask(3, 100)[:50])  # a frame begun, never finished
        client = IndexClient(sock_path, budget_s=0.2, backoff_s=0.0)
        assert client.lookup(SCOPE, bytes(16 * 4)).matches
        t0 = time.perf_counter()
        for s in slow:
            answer = _read_answer(s)
            assert answer.id == 0 and answer.error.startswith("frame_deadline: a frame not finished within 300 ms")
            assert s.recv(10) == b""
            s.close()
        assert 0.2 < time.perf_counter() - t0 < 2.0
        assert _refused("frame_deadline") - before == 5 and server.sidecar.refusals == {"frame_deadline": 5}
        logged = [r for r in caplog.records if "refused (frame_deadline)" in r.getMessage()]
        assert len(logged) == 1  # every refusal counted, one line per reason per 10 s: no log flood
        # A connection that finishes each frame in time is never closed, however long it lives.
        for i in range(3):
            time.sleep(0.2)
            assert client.lookup(SCOPE, bytes(16 * 4)).matches
        assert client.stats["connects"] == 1
    finally:
        server.stop()


def test_connections_are_capped_and_a_silent_idle_one_gives_way_never_an_engines(sock_path):
    server = _serve(sock_path, max_connections=3, idle_evict_s=0.3)
    before = _refused("connections")
    try:
        held = [_connect(sock_path) for _ in range(3)]
        time.sleep(0.05)
        extra = _connect(sock_path)
        answer = _read_answer(extra)
        assert answer.id == 0 and answer.error.startswith("connections: the sidecar holds its 3 connections")
        assert extra.recv(10) == b""
        assert _refused("connections") - before == 1
        held[1].sendall(_ask(5, 2))  # two of them stay busy: the oldest idle one is held[0]
        held[2].sendall(_ask(6, 2))
        assert _read_answer(held[1]).id == 5 and _read_answer(held[2]).id == 6
        time.sleep(0.35)
        held[1].sendall(_ask(7, 2))
        held[2].sendall(_ask(8, 2))
        assert _read_answer(held[1]).id == 7 and _read_answer(held[2]).id == 8
        client = IndexClient(sock_path, budget_s=0.5, backoff_s=0.0)
        assert client.lookup(SCOPE, bytes(16 * 2)).matches  # takes held[0]'s place
        assert held[0].recv(10) == b""  # it never asked: it gave way
        assert server.sidecar.refusals == {"connections": 1, "evicted": 1}
        assert server.on_ask_loop(lambda: len(server.sidecar._open)) == 3
        # Every connection held has asked (engines'): idle 0.4 s, none gives way to a silent newcomer.
        time.sleep(0.4)
        late = _connect(sock_path)
        assert _read_answer(late).error.startswith("connections")
        assert client.lookup(SCOPE, bytes(16 * 2)).matches and client.stats["connects"] == 1
        assert server.sidecar.refusals == {"connections": 2, "evicted": 1}
        for s in held[1:] + [extra, late]:
            s.close()
    finally:
        server.stop()


def test_a_flood_of_reconnects_costs_one_refusal_per_accept_pause(sock_path):
    server = _serve(sock_path, max_connections=2)
    try:
        client = IndexClient(sock_path, budget_s=0.5, backoff_s=0.0)
        assert client.lookup(SCOPE, bytes(16 * 2)).matches
        held = _connect(sock_path)
        stop = time.monotonic() + 1.0
        tries = [0]

        def flood() -> None:
            while time.monotonic() < stop:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(0.2)
                try:
                    s.connect(str(sock_path))
                    tries[0] += 1
                except OSError:
                    pass
                finally:
                    s.close()

        threads = [threading.Thread(target=flood) for _ in range(4)]
        for t in threads:
            t.start()
        answered = 0
        while time.monotonic() < stop:
            answered += bool(client.lookup(SCOPE, bytes(16 * 2)).matches)
        for t in threads:
            t.join()
        refused = server.sidecar.refusals.get("connections", 0)
        assert tries[0] > 100 and 1 <= refused <= 1.0 / 0.05 * 1.5 + 2, (tries, refused)
        assert answered > 10 and client.stats["answered"] == answered + 1 and client.stats["timeouts"] == 0
        held.close()
    finally:
        server.stop()


def test_asks_are_capped_at_what_an_engine_sends_and_the_client_trims_longer_prompts(sock_path):
    replica = SlowReplica()
    server = _serve(sock_path, replica, max_keys=32)
    try:
        s = _connect(sock_path)
        s.sendall(_ask(4, 33))
        answer = _read_answer(s)
        assert answer.id == 4 and answer.error == "too_many_keys: 33 keys; this sidecar answers at most 32"
        s.sendall(_ask(5, 32))  # the connection stays usable
        assert _read_answer(s).num_blocks == 32
        # A frame announcing more bytes than a 32-key ask needs is refused before it is read.
        s.sendall(struct.pack(">I", 16 * 32 + 4096 + 1))
        answer = _read_answer(s)
        assert answer.id == 0 and answer.error.startswith("frame_size")
        assert s.recv(10) == b""
        s.close()
        client = IndexClient(sock_path, budget_s=0.5, backoff_s=0.0, max_keys=32)
        got = client.lookup(SCOPE, bytes(16 * 100))
        assert got.num_blocks == 100 and got.matches[0].prefix_blocks == 2 and replica.asked[-1] == 32
        assert client.stats["trimmed"] == 1 and client.stats["answered"] == 1
        assert server.sidecar.refusals == {"too_many_keys": 1, "frame_size": 1}
    finally:
        server.stop()


def test_a_client_that_does_not_read_its_answers_stops_being_read(sock_path):
    server = _serve(sock_path, max_keys=64)
    try:
        s = _connect(sock_path)
        s.setblocking(False)
        ask = _ask(1, 64)  # ~1 KiB asks, each answered with a small frame the client never reads
        sent = 0
        pending = b""  # what a partial send left: sent next, so the stream stays whole frames
        t_end = time.monotonic() + 3.0
        while time.monotonic() < t_end:
            pending = pending or ask * 64
            try:
                n = s.send(pending)
            except BlockingIOError:  # the sidecar stopped reading: the kernel's buffers are full
                time.sleep(0.2)
                try:
                    n = s.send(pending)
                except BlockingIOError:
                    break
            sent, pending = sent + n, pending[n:]
        assert time.monotonic() < t_end, "the sidecar kept reading a client that never reads"

        def buffered():
            (conn,) = server.sidecar._open
            return len(conn.buffer), conn.transport.get_write_buffer_size(), conn.write_paused

        inbuf, outbuf, paused = server.on_ask_loop(buffered)
        assert paused and inbuf <= server.sidecar.limits.frame_limit + (256 << 10) and outbuf < 1 << 20
        # Reading its answers again: it is read again, and every ask it sent is answered.
        s.setblocking(True)
        s.settimeout(5)
        asks = sent // len(ask)
        for i in range(asks):
            assert _read_answer(s).num_blocks == 64
        s.close()
    finally:
        server.stop()


def test_asks_in_many_threads_on_their_own_connections_are_all_answered(sock_path):
    server = _serve(sock_path)
    try:
        out: list[LookupResult] = []

        def engine() -> None:
            client = IndexClient(sock_path, budget_s=1.0, backoff_s=0.0)
            out.extend(client.lookup(SCOPE, bytes(16 * 8)) for _ in range(50))
            client.close()

        threads = [threading.Thread(target=engine) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(out) == 400 and all(r.matches and math.isfinite(r.lag_ms) for r in out)
        assert server.sidecar.lookups == 400
    finally:
        server.stop()


def test_the_limits_come_from_the_settings_and_a_bad_one_names_its_variable():
    limits = AskLimits.from_settings(Settings.from_env({"NEXUSKV_INDEX_MAX_ASK_KEYS": "4096",
                                                        "NEXUSKV_INDEX_MAX_CONNECTIONS": "16",
                                                        "NEXUSKV_INDEX_FRAME_DEADLINE_MS": "250"}))
    assert (limits.max_keys, limits.max_connections, limits.frame_deadline_s) == (4096, 16, 0.25)
    assert limits.frame_limit == 16 * 4096 + 4096
    assert AskLimits.from_settings(Settings.from_env({})) == AskLimits()
    for var, bad in (("NEXUSKV_INDEX_MAX_ASK_KEYS", "0"), ("NEXUSKV_INDEX_MAX_ASK_KEYS", "70000"),
                     ("NEXUSKV_INDEX_MAX_CONNECTIONS", "0"), ("NEXUSKV_INDEX_FRAME_DEADLINE_MS", "-1")):
        with pytest.raises(ConfigError) as err:
            Settings.from_env({var: bad})
        assert err.value.field == var
    with pytest.raises(ValueError, match="bulk_queue"):
        AskLimits(bulk_queue=0)
    with pytest.raises(ValueError, match="max_keys"):
        IndexClient("/tmp/x.sock", max_keys=0)
    assert pack_keys(bytes(32)) == bytes(32)


def test_a_cancelled_server_task_still_closes_the_sidecar_cleanly(sock_path):
    async def main() -> None:
        sidecar = IndexSidecar(SlowReplica(), sock_path)
        await sidecar.start()
        task = asyncio.create_task(sidecar.serve_forever())  # as a supervisor's stop cancels it
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await sidecar.close()
        assert sidecar._thread is not None
        sidecar._thread.join(5)
        assert not sidecar._thread.is_alive() and not sock_path.exists()
        assert not sidecar._ended.cancelled() and sidecar._ended.exception() is None

    asyncio.run(main())


def test_the_ask_thread_runs_at_its_nice_value_and_only_it(sock_path):
    import os

    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    wanted = min(19, own + 3)  # raising a nice value needs no privilege
    server = _serve(sock_path, ask_nice=wanted)
    try:
        ask_thread = server.sidecar._thread
        assert server.sidecar.ask_priority == wanted
        assert os.getpriority(os.PRIO_PROCESS, ask_thread.native_id) == wanted
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # the caller's is untouched
        client = IndexClient(sock_path, budget_s=0.5, backoff_s=0.0)
        assert client.lookup(SCOPE, bytes(16 * 8)).matches
    finally:
        server.stop()


def test_a_refused_nice_value_is_logged_and_the_sidecar_serves_anyway(sock_path, monkeypatch, caplog):
    import os

    def refuse(*_args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)
    server = _serve(sock_path, ask_nice=-10)
    try:
        assert server.sidecar.ask_priority == os.getpriority(os.PRIO_PROCESS, server.sidecar._thread.native_id)
        assert server.sidecar.ask_priority != -10 or os.getpriority(os.PRIO_PROCESS, 0) == -10
        assert "the index sidecar's ask thread keeps its priority (nice -10 refused" in caplog.text
        client = IndexClient(sock_path, budget_s=0.5, backoff_s=0.0)
        assert client.lookup(SCOPE, bytes(16 * 8)).matches
    finally:
        server.stop()
