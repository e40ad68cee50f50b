"""The subscriber's sequence bookkeeping and replay repair, against a lossy replay server.

The server is a stand-in for an engine ROUTER that drops what exceeds its send queue (SGLang keeps
ZMQ's default high-water mark): it answers a request with at most ``burst`` batches, and sends the
end marker only when nothing was cut. The same repair runs against SGLang's own ROUTER in
``tests/connectors/sglang_real/test_events_bridge.py``.
"""

from __future__ import annotations

import asyncio
import threading

import zmq

from connectors.zmq_events import END_SEQ, KvEventSubscriber, SequenceTracker, payload_digest
from streams.bus.process import free_port


def test_a_renumbered_batch_is_a_restart_a_resent_one_a_duplicate():
    t = SequenceTracker()
    for seq in range(3):
        t.delivered("a", seq, payload_digest(b"p%d" % seq))
    assert t.classify("a", 1, payload_digest(b"p1")).kind == "duplicate"
    assert t.classify("a", 1, payload_digest(b"other")).kind == "restart"
    assert t.classify("a", 1).kind == "restart"  # no payload to compare: fail closed
    assert t.classify("a", 3).kind == "next" and t.classify("a", 9).replay_from == 3


class LossyReplay:
    """A ROUTER holding batches ``first..last``; each reply burst is cut after ``burst`` batches."""

    def __init__(self, first: int, last: int, burst: int) -> None:
        self.batches = {s: b"payload-%d" % s for s in range(first, last + 1)}
        self.burst = burst
        self.requests: list[int] = []
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self._router.bind(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(50):
                continue
            ident, _, start = self._router.recv_multipart()
            start = int.from_bytes(start, "big")
            self.requests.append(start)
            todo = [s for s in sorted(self.batches) if s >= start]
            for s in todo[: self.burst]:
                self._router.send_multipart([ident, b"", b"kv@t@m", s.to_bytes(8, "big"), self.batches[s]])
            if len(todo) <= self.burst:  # the end marker is lost with the rest of a cut burst
                self._router.send_multipart([ident, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._router.close(linger=0)
        self._ctx.term()


def test_replay_asks_again_until_the_range_is_complete():
    server = LossyReplay(0, 999, burst=150)

    async def run():
        sub = KvEventSubscriber(f"tcp://127.0.0.1:{free_port()}", replay_endpoint=server.endpoint,
                                reply_idle_s=0.2, probe_interval_s=None)
        try:
            return await sub.fetch("kv@t@m", 0, 1000), sub.stats
        finally:
            sub.close()

    try:
        got, stats = asyncio.run(run())
    finally:
        server.close()
    assert sorted(got.batches) == list(range(1000)) and not got.gone
    assert got.batches[500] == b"payload-500"
    assert stats["replay_rounds"] == 7 and server.requests[:3] == [0, 150, 300]


def test_what_the_engine_no_longer_buffers_is_reported_gone():
    server = LossyReplay(40, 99, burst=1000)  # seqs below 40 fell out of the engine's buffer

    async def run():
        sub = KvEventSubscriber(f"tcp://127.0.0.1:{free_port()}", replay_endpoint=server.endpoint,
                                reply_idle_s=0.2, probe_interval_s=None)
        try:
            return await sub.fetch("kv@t@m", 10, 100)
        finally:
            sub.close()

    try:
        got = asyncio.run(run())
    finally:
        server.close()
    assert got.gone == set(range(10, 40)) and sorted(got.batches) == list(range(40, 100))
    assert server.requests == [10]  # the engine said so; nothing to ask again
