"""Receive vLLM/SGLang KV events over ZMQ, in order, repairing gaps through the replay socket.

Transport (``../shared/reference/engines.md`` §1.3-1.4, §4.1): the engine's PUB socket sends one
3-frame message per batch ``[topic, seq (8 bytes, big-endian), msgpack payload]``; ``seq``
counts from 0 per engine process. A ROUTER socket (``replay_endpoint``) answers
``[b"", start_seq]`` with every buffered batch from ``start_seq`` on, then an end marker
(``seq = -1``). Replies carry the topic from vLLM 0.26 / SGLang 0.5.22 on
(``[b"", topic, seq, payload]``) and not before (``[b"", seq, payload]``); both are accepted.

The replay client is a DEALER: the server streams many replies to one request, and a REQ
socket can read only the first (vLLM's own example subscriber has that bug).

Per topic, :class:`SequenceTracker` classifies each live sequence number:

* ``next`` — the expected one; delivered.
* ``gap`` — numbers were lost (PUB drops at its high-water mark); they are fetched through
  replay and delivered first, in order. What replay cannot supply stays missing: downstream
  sees the jump in ``seq`` and treats the publisher as uncertain.
* ``first`` — a topic seen for the first time (or after a bridge restart): history from the
  resume point is fetched through replay.
* ``restart`` — a lower number than the last one: the engine restarted (new incarnation, empty
  cache); its history is fetched from 0.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

import zmq
import zmq.asyncio

__all__ = ["END_SEQ", "RawBatch", "SequenceTracker", "Verdict", "KvEventSubscriber", "bind_or_connect"]

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_END = -1


@dataclass(frozen=True, slots=True)
class RawBatch:
    """One engine batch as received: its topic, sequence number and payload."""

    topic: str
    seq: int
    payload: bytes
    replayed: bool = False
    restart: bool = False  # first batch of a new engine incarnation


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: Literal["next", "gap", "first", "restart", "duplicate"]
    replay_from: int | None = None  # first sequence number to fetch through replay


@dataclass(slots=True)
class SequenceTracker:
    """Sequence bookkeeping of every topic (pure; no sockets)."""

    last: dict[str, int] = field(default_factory=dict)
    resume: dict[str, int] = field(default_factory=dict)  # topic -> next seq expected after a bridge restart

    def classify(self, topic: str, seq: int) -> Verdict:
        last = self.last.get(topic)
        if last is None:
            start = self.resume.get(topic, 0)
            if seq < start:  # the engine restarted while the bridge was down
                return Verdict("restart", replay_from=0 if seq > 0 else None)
            return Verdict("first", replay_from=start if seq > start else None)
        if seq == last + 1:
            return Verdict("next")
        if seq > last + 1:
            return Verdict("gap", replay_from=last + 1)
        if seq <= last:
            return Verdict("restart", replay_from=0 if seq > 0 else None)
        return Verdict("duplicate")  # pragma: no cover - unreachable, kept for exhaustiveness

    def delivered(self, topic: str, seq: int) -> None:
        self.last[topic] = seq

    def reset(self, topic: str) -> None:
        self.last.pop(topic, None)
        self.resume.pop(topic, None)


def bind_or_connect(socket: zmq.Socket, endpoint: str, *, bind: bool = False) -> None:
    """Connect (the engine binds ``tcp://*:5557``), or bind for a centralised subscriber.

    vLLM's publisher binds when its endpoint has a wildcard or is ``ipc://``/``inproc://``, and
    connects otherwise — so a subscriber that binds lets many engines connect to it.
    """
    if bind:
        socket.bind(endpoint)
    else:
        socket.connect(endpoint)


class KvEventSubscriber:
    """SUB for live batches plus a DEALER for replay; yields batches in order per topic."""

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic_prefix: str = "",
                 bind: bool = False, replay_timeout_s: float = 2.0, resume: dict[str, int] | None = None,
                 context: zmq.asyncio.Context | None = None) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_s = replay_timeout_s
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic_prefix.encode("utf-8"))
        bind_or_connect(self._sub, endpoint, bind=bind)
        self._dealer: zmq.asyncio.Socket | None = None
        self.tracker = SequenceTracker(resume=dict(resume or {}))
        self.stats = {"live": 0, "replayed": 0, "gaps": 0, "unrepaired": 0, "restarts": 0, "malformed_frames": 0}

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)

    async def __aenter__(self) -> KvEventSubscriber:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    async def batches(self) -> AsyncIterator[RawBatch]:
        """Every batch, in order per topic, repaired where replay can; runs until cancelled."""
        while True:
            for batch in await self.receive():
                yield batch

    async def receive(self) -> list[RawBatch]:
        """Wait for the next live message; return it preceded by whatever replay filled in."""
        while True:
            frames = await self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.stats["malformed_frames"] += 1
                log.warning("dropping a malformed ZMQ message of %d frames", len(frames))
                continue
            topic = frames[0].decode("utf-8", errors="replace")
            seq = int.from_bytes(frames[1], "big")
            verdict = self.tracker.classify(topic, seq)
            out: list[RawBatch] = []
            restart = verdict.kind == "restart"
            if restart:
                self.stats["restarts"] += 1
                self.tracker.reset(topic)
            if verdict.kind == "gap":
                self.stats["gaps"] += 1
            if verdict.replay_from is not None:
                repaired = await self._replay(topic, verdict.replay_from, seq)
                for i, (rseq, payload) in enumerate(repaired):
                    out.append(RawBatch(topic, rseq, payload, replayed=True, restart=restart and i == 0))
                    self.tracker.delivered(topic, rseq)
                got = {s for s, _ in repaired}
                missing = [s for s in range(verdict.replay_from, seq) if s not in got]
                if missing:
                    self.stats["unrepaired"] += len(missing)
                    log.warning("topic %r: %d batches lost before seq %d could not be replayed", topic,
                                len(missing), seq)
            out.append(RawBatch(topic, seq, frames[2], restart=restart and not out))
            self.tracker.delivered(topic, seq)
            self.stats["live"] += 1
            self.stats["replayed"] += len(out) - 1
            return out

    async def _replay(self, topic: str, start: int, before: int) -> list[tuple[int, bytes]]:
        """Batches ``start <= seq < before`` of ``topic`` from the replay socket, in order."""
        if self.replay_endpoint is None:
            return []
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.RCVHWM, 0)
            self._dealer.connect(self.replay_endpoint)
        dealer = self._dealer
        # Drain stale replies of an earlier, timed-out request.
        while await dealer.poll(0):
            await dealer.recv_multipart()
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        found: dict[int, bytes] = {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.replay_timeout_s
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0 or not await dealer.poll(int(remaining * 1000)):
                log.warning("replay from %s timed out after %.1fs", self.replay_endpoint, self.replay_timeout_s)
                break
            frames = await dealer.recv_multipart()
            parsed = _parse_reply(frames)
            if parsed is None:
                continue
            rtopic, rseq, payload = parsed
            if rseq == _END:
                break
            if (rtopic is None or rtopic == topic) and start <= rseq < before:
                found[rseq] = payload
        return sorted(found.items())


def _parse_reply(frames: list[bytes]) -> tuple[str | None, int, bytes] | None:
    """A replay reply in either shape, as (topic or None, seq, payload); None if malformed."""
    if frames and frames[0] == b"":
        frames = frames[1:]
    if len(frames) == 2 and len(frames[0]) == 8:  # [seq, payload] (vLLM <= 0.25, SGLang <= 0.5.20)
        return None, int.from_bytes(frames[0], "big", signed=True), frames[1]
    if len(frames) == 3 and len(frames[1]) == 8:  # [topic, seq, payload] (vLLM >= 0.26, SGLang >= 0.5.22)
        topic = frames[0].decode("utf-8", errors="replace") or None
        return topic, int.from_bytes(frames[1], "big", signed=True), frames[2]
    return None
