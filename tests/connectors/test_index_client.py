"""The engine's index client against the node's sidecar server (a real Unix socket, no broker).

The sidecar here serves a stand-in replica (a canned answer, or a lookup that holds the loop);
the broker test in ``tests/streams/test_index_sidecar.py`` runs the real replica. Every failure
— no answer within the budget, a sidecar that is gone, an answer that does not fit the question
— is a miss with infinite lag, counted, and costs at most the budget; a restarted sidecar is
asked again without losing the request."""

from __future__ import annotations

import asyncio
import math
import socket
import struct
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import pytest

from connectors.index_client import IndexClient
from nexuskv.contracts.lookup_wire import VERSION, Answer, WireMatch, decode_ask, frame, pack_keys
from nexuskv.descriptor import Tier
from nexuskv.entries import EntryLocation
from nexuskv.errors import BrokerError, ConfigError
from nexuskv.lookup import Extent, LocationMatch, LookupResult
from streams.index_sidecar import IndexSidecar

from tests.factories import scope

SCOPE = scope("tenant-ask")
KEYS = [(i * 0x9E3779B97F4A7C15_1234567890ABCDEF) % (1 << 128) for i in range(1, 65)]


def _result(n: int) -> LookupResult:
    return LookupResult(num_blocks=n, lag_events=3, lag_ms=1.5, matches=(
        LocationMatch(EntryLocation(worker="w-a/disk", tier=Tier.DISK, group=0), "w-a/disk", 40,
                      (Extent(42, 50), Extent(52, 60))),
        LocationMatch(EntryLocation(worker="w-b", tier=Tier.GPU, group=1), "w-b", 10, (), False),
        LocationMatch(EntryLocation(worker="shared", tier=Tier.REMOTE, group=0), "pub-r", 0, (Extent(3, 7),)),
    ))


class FakeReplica:
    """Answers every lookup with :func:`_result`; ``hold_s`` blocks the loop first (a stuck apply)."""

    def __init__(self) -> None:
        self.hold_s = 0.0
        self.asked: list[tuple] = []

    def lookup(self, s, keys):
        self.asked.append((s, bytes(keys)))
        if self.hold_s:
            time.sleep(self.hold_s)
        return _result(len(keys) // 16)

    async def wait_caught_up(self, timeout_s: float = 60.0) -> None:
        await asyncio.sleep(0)


class Server:
    """An IndexSidecar on a loop thread of its own."""

    def __init__(self, replica, path: Path) -> None:
        self.replica, self.path = replica, path
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.sidecar = IndexSidecar(replica, path)
        asyncio.run_coroutine_threadsafe(self.sidecar.start(), self.loop).result(5)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.sidecar.close(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def sock_path():
    with tempfile.TemporaryDirectory(prefix="nkv-", dir="/tmp") as d:
        yield Path(d) / "index.sock"


@pytest.fixture
def server(sock_path):
    s = Server(FakeReplica(), sock_path)
    yield s
    s.stop()


def test_the_answer_is_the_replicas_lookup_field_for_field(server):
    client = IndexClient(server.path, budget_s=1.0)
    got = client.lookup(SCOPE, KEYS)
    assert got == _result(len(KEYS))
    (asked_scope, asked_keys), = server.replica.asked
    assert asked_scope == SCOPE and asked_keys == pack_keys(KEYS)
    assert int.from_bytes(asked_keys[:16], "big") == KEYS[0]
    assert client.stats["answered"] == 1 and client.stats["connects"] == 1
    assert client.lookup(SCOPE, KEYS) == got and client.stats["connects"] == 1  # the connection is kept
    client.wait_caught_up(5)
    client.close()


def test_no_answer_within_the_budget_is_a_miss_then_misses_at_once_until_the_backoff_ends(server):
    server.replica.hold_s = 0.3
    client = IndexClient(server.path, budget_s=0.05, backoff_s=0.5)
    began = time.perf_counter()
    got = client.lookup(SCOPE, KEYS)
    took = time.perf_counter() - began
    assert got.matches == () and math.isinf(got.lag_ms) and got.num_blocks == len(KEYS)
    assert client.stats["timeouts"] == 1
    assert took < 0.05 + 0.03, took  # the budget, not the sidecar's 0.3 s
    began = time.perf_counter()
    assert client.lookup(SCOPE, KEYS).matches == ()
    assert time.perf_counter() - began < 0.005 and client.stats["skipped"] == 1
    server.replica.hold_s = 0.0
    time.sleep(0.55)  # the held lookup ended (its late answer went to a closed connection); the backoff too
    assert client.lookup(SCOPE, KEYS) == _result(len(KEYS))
    assert client.stats["answered"] == 1 and client.stats["connects"] == 2


def test_a_missing_sidecar_is_a_fast_miss(sock_path):
    client = IndexClient(sock_path, budget_s=0.5, backoff_s=0.0)
    began = time.perf_counter()
    got = client.lookup(SCOPE, KEYS)
    assert got.matches == () and math.isinf(got.lag_ms)
    assert time.perf_counter() - began < 0.05
    assert client.stats["unavailable"] == 1
    with pytest.raises(BrokerError, match="did not sync"):
        client.wait_caught_up(1)


def test_a_restarted_sidecar_is_asked_again_on_a_new_connection_without_losing_the_request(sock_path):
    first = Server(FakeReplica(), sock_path)
    client = IndexClient(sock_path, budget_s=1.0, backoff_s=0.0)
    assert client.lookup(SCOPE, KEYS).matches
    first.stop()
    assert not sock_path.exists()
    assert client.lookup(SCOPE, KEYS).matches == ()  # down: a miss
    assert client.stats["unavailable"] == 1
    second = Server(FakeReplica(), sock_path)
    try:
        assert client.lookup(SCOPE, KEYS) == _result(len(KEYS))
        third_connects = client.stats["connects"]
        # Restarted between two asks on a connection that worked: the client reconnects within the
        # same ask, which succeeds (nothing counted as unavailable).
        second.stop()
        second = Server(FakeReplica(), sock_path)
        assert client.lookup(SCOPE, KEYS) == _result(len(KEYS))
        assert client.stats["unavailable"] == 1 and client.stats["connects"] == third_connects + 1
    finally:
        second.stop()


class RawServer:
    """A socket server that answers each ask with ``reply(ask) -> bytes`` (whatever bytes it likes)."""

    def __init__(self, path: Path, reply) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen()
        self.reply = reply
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    while True:
                        header = conn.recv(4, socket.MSG_WAITALL)
                        if len(header) < 4:
                            break
                        (n,) = struct.unpack(">I", header)
                        ask = decode_ask(conn.recv(n, socket.MSG_WAITALL))
                        conn.sendall(self.reply(ask))
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def _answer(ask, **kw) -> bytes:
    fields = dict(version=VERSION, id=ask.id, num_blocks=len(ask.keys) // 16, lag_events=0, lag_ms=0.0,
                  matches=[WireMatch("w", "disk", 0, "w", 4)])
    fields.update(kw)
    return frame(msgspec.msgpack.encode(Answer(**fields)))


MALFORMED = {
    "not msgpack": lambda ask: frame(b"\xc1\xc1\xc1"),
    "a string for the block count": lambda ask: frame(msgspec.msgpack.encode(
        [VERSION, ask.id, "", "many", 0, 0.0, []])),
    "another request's id": lambda ask: _answer(ask, id=ask.id + 1),
    "another version": lambda ask: _answer(ask, version=VERSION + 1),
    "fewer blocks than asked": lambda ask: _answer(ask, num_blocks=3),
    "a prefix beyond the query": lambda ask: _answer(ask, matches=[WireMatch("w", "disk", 0, "w", 65)]),
    "an extent inside the prefix": lambda ask: _answer(ask, matches=[WireMatch("w", "disk", 0, "w", 4, [(2, 6)])]),
    "extents out of order": lambda ask: _answer(ask, matches=[WireMatch("w", "disk", 0, "w", 4, [(20, 30),
                                                                                                  (8, 10)])]),
    "an unknown tier": lambda ask: _answer(ask, matches=[WireMatch("w", "tape", 0, "w", 4)]),
    "a negative group": lambda ask: _answer(ask, matches=[WireMatch("w", "disk", -1, "w", 4)]),
    "an empty match": lambda ask: _answer(ask, matches=[WireMatch("w", "disk", 0, "w", 0)]),
    "a NaN lag": lambda ask: _answer(ask, lag_ms=math.nan),
    "a frame too large": lambda ask: struct.pack(">I", 1 << 30),
    "a truncated answer": lambda ask: _answer(ask)[:9],
}


@pytest.mark.parametrize("what", MALFORMED)
def test_a_malformed_answer_is_a_counted_miss(sock_path, what):
    raw = RawServer(sock_path, MALFORMED[what])
    try:
        client = IndexClient(sock_path, budget_s=0.2, backoff_s=0.0)
        got = client.lookup(SCOPE, KEYS)
        assert got.matches == () and math.isinf(got.lag_ms)
        failed = client.stats["malformed"] + client.stats["unavailable"] + client.stats["timeouts"]
        assert failed == 1 and client.stats["answered"] == 0
        if what != "a truncated answer":
            assert client.stats["malformed"] == 1
        assert client._sock is None  # dropped: what follows on that stream cannot be trusted
    finally:
        raw.close()


def test_an_error_answer_is_a_refused_miss_and_a_refused_connection_backs_off(sock_path):
    raw = RawServer(sock_path, lambda ask: _answer(ask, error="too_many_keys: no", matches=[]))
    try:
        client = IndexClient(sock_path, budget_s=0.5, backoff_s=5.0)
        got = client.lookup(SCOPE, KEYS)
        assert got.matches == () and math.isinf(got.lag_ms) and client.stats["refused"] == 1
        assert client._sock is not None and client.stats["malformed"] == 0  # the ask was refused, not the stream
        assert client.lookup(SCOPE, KEYS).matches == () and client.stats["refused"] == 2  # asked again: no backoff
    finally:
        raw.close()
    sock_path.unlink()
    raw = RawServer(sock_path, lambda ask: _answer(ask, id=0, error="connections: full", matches=[]))
    try:
        client = IndexClient(sock_path, budget_s=0.5, backoff_s=5.0)
        assert client.lookup(SCOPE, KEYS).matches == () and client.stats["refused"] == 1
        assert client._sock is None  # a refused connection is dropped, and the client backs off
        assert client.lookup(SCOPE, KEYS).matches == () and client.stats["skipped"] == 1
    finally:
        raw.close()


def test_a_well_formed_answer_from_the_same_raw_server_is_taken(sock_path):
    raw = RawServer(sock_path, _answer)
    try:
        got = IndexClient(sock_path, budget_s=0.5).lookup(SCOPE, KEYS)
        assert got.matches[0].prefix_blocks == 4 and got.matches[0].location.tier is Tier.DISK
    finally:
        raw.close()


def _refusal_then_closed(s: socket.socket) -> str:
    """The error frame (id 0) a sidecar sends before it closes a connection, then the close."""
    from nexuskv.contracts.lookup_wire import decode_answer

    s.settimeout(2)
    (n,) = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))
    answer = decode_answer(s.recv(n, socket.MSG_WAITALL))
    assert answer.id == 0 and answer.matches == []
    assert s.recv(10) == b""  # closed
    return answer.error


def test_the_sidecar_closes_a_connection_that_sends_garbage_and_refuses_a_bad_scope(server):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(server.path))
        s.sendall(frame(b"garbage"))
        assert _refusal_then_closed(s).startswith("malformed: not an ask")
    assert server.sidecar.malformed == 1
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(server.path))
        s.sendall(struct.pack(">I", 1 << 31))
        assert _refusal_then_closed(s).startswith("frame_size: a frame of 2147483648 bytes")
    assert server.sidecar.refusals == {"malformed": 1, "frame_size": 1}
    from nexuskv.contracts.lookup_wire import Ask, WireScope, decode_answer, encode_ask

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(server.path))
        s.sendall(encode_ask(Ask(VERSION, 1, 7, WireScope("", "m", "r", "t", "d"), pack_keys(KEYS[:2]))))
        s.settimeout(2)
        (n,) = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))
        answer = decode_answer(s.recv(n, socket.MSG_WAITALL))
    assert answer.id == 7 and answer.error.startswith("bad_scope") and answer.matches == []
    assert server.sidecar.errors == 1 and server.replica.asked == []
    client = IndexClient(server.path, budget_s=1.0)  # other connections are served as before
    assert client.lookup(SCOPE, KEYS) == _result(len(KEYS))


def test_asks_from_many_threads_each_get_their_own_answer(server):
    client = IndexClient(server.path, budget_s=2.0)
    out: list[LookupResult] = []

    def ask() -> None:
        for _ in range(20):
            out.append(client.lookup(SCOPE, KEYS))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 80 and all(r == _result(len(KEYS)) for r in out)
    assert client.stats["answered"] == 80 and client.stats["connects"] == 1


def test_a_socket_path_too_long_for_unix_sockets_names_the_setting(tmp_path):
    with pytest.raises(ConfigError) as err:
        IndexSidecar(FakeReplica(), Path("/tmp") / ("x" * 120) / "index.sock")
    assert err.value.field == "NEXUSKV_INDEX_SOCKET"


def test_a_second_sidecar_on_a_live_socket_refuses_to_start(server):
    other = IndexSidecar(FakeReplica(), server.path)
    with pytest.raises(ConfigError, match="already listens"):
        asyncio.run(other.start())
