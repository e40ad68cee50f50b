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
  replay and delivered first, in order.
* ``first`` — a topic seen for the first time (or after a bridge restart): history from the
  resume point is fetched through replay.
* ``restart`` — a lower number than the last one whose payload is not the one delivered under
  that number: the engine restarted (new incarnation, empty cache); its history is fetched from 0.
* ``duplicate`` — a number already delivered with the same payload (a batch that arrived live
  after replay had supplied it): dropped.

**Repair** (:meth:`KvEventSubscriber.fetch`) retries until the range is complete or the engine
has said the rest is gone. The engine's ROUTER sends a whole reply burst at once and drops
what exceeds its send high-water mark (SGLang leaves ZMQ's default of 1,000 messages), the end
marker included; so a round ends at the end marker or when replies stop for
``reply_idle_s``, and the next round asks again from the first number still missing. The
engine says numbers are gone when its first reply to a request starts later than asked: its
buffer no longer holds them (replies never overtake each other, and the first one of a burst is
never the one dropped). What is gone, or still missing after ``repair_deadline_s``, stays
missing: downstream sees the jump in ``seq`` and treats the publisher as uncertain until it
resyncs (``stats["unrepaired"]``).

**Probe.** Engines publish only when they have events, so a lost *last* batch would go unseen
until the engine publishes again. After ``probe_interval_s`` without a live message, the
subscriber asks the replay socket for every known topic's last delivered batch onward: that
batch coming back unchanged proves the same engine incarnation, and anything after it was lost
live and is delivered now; a different batch under that number, or none at all with the end
marker, is a restart (its history is fetched from 0). An engine that does not answer at all
teaches nothing (``stats["probe_silent"]``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

import zmq
import zmq.asyncio

__all__ = ["END_SEQ", "RawBatch", "SequenceTracker", "Verdict", "KvEventSubscriber", "bind_or_connect",
           "payload_digest"]

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_END = -1
_RECENT = 4096  # delivered (seq, digest) pairs remembered per topic, to tell duplicates from restarts


def payload_digest(payload: bytes) -> bytes:
    """A short digest of a batch payload (two batches under one number are the same batch iff equal)."""
    return hashlib.blake2b(payload, digest_size=16).digest()


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
    recent: dict[str, OrderedDict[int, bytes]] = field(default_factory=dict)  # topic -> seq -> payload digest

    def classify(self, topic: str, seq: int, digest: bytes | None = None) -> Verdict:
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
        if digest is not None and self.recent.get(topic, {}).get(seq) == digest:
            return Verdict("duplicate")
        return Verdict("restart", replay_from=0 if seq > 0 else None)

    def delivered(self, topic: str, seq: int, digest: bytes | None = None) -> None:
        self.last[topic] = seq
        if digest is not None:
            recent = self.recent.setdefault(topic, OrderedDict())
            recent[seq] = digest
            recent.move_to_end(seq)
            while len(recent) > _RECENT:
                recent.popitem(last=False)

    def digest_of(self, topic: str, seq: int) -> bytes | None:
        return self.recent.get(topic, {}).get(seq)

    def reset(self, topic: str) -> None:
        self.last.pop(topic, None)
        self.resume.pop(topic, None)
        self.recent.pop(topic, None)


def bind_or_connect(socket: zmq.Socket, endpoint: str, *, bind: bool = False) -> None:
    """Connect (the engine binds ``tcp://*:5557``), or bind for a centralised subscriber.

    vLLM's publisher binds when its endpoint has a wildcard or is ``ipc://``/``inproc://``, and
    connects otherwise — so a subscriber that binds lets many engines connect to it.
    """
    if bind:
        socket.bind(endpoint)
    else:
        socket.connect(endpoint)


@dataclass(slots=True)
class _Fetched:
    """What one :meth:`KvEventSubscriber.fetch` got: batches by number, what the engine said is gone."""

    batches: dict[int, bytes] = field(default_factory=dict)
    gone: set[int] = field(default_factory=set)
    answered: bool = False  # the engine replied at all
    ended_empty: bool = False  # an end marker came with no batch at or after the start


class KvEventSubscriber:
    """SUB for live batches plus a DEALER for replay; yields batches in order per topic."""

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic_prefix: str = "",
                 bind: bool = False, replay_timeout_s: float = 2.0, reply_idle_s: float = 0.5,
                 repair_deadline_s: float = 60.0, probe_interval_s: float | None = 2.0,
                 resume: dict[str, int] | None = None, context: zmq.asyncio.Context | None = None,
                 rcvhwm: int = 100_000) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_s = replay_timeout_s  # wait for the first reply of a round
        self.reply_idle_s = reply_idle_s  # a burst is over when replies stop this long
        self.repair_deadline_s = repair_deadline_s
        self.probe_interval_s = probe_interval_s if replay_endpoint is not None else None
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, rcvhwm)  # live messages ZMQ queues before it drops (0: no limit)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic_prefix.encode("utf-8"))
        bind_or_connect(self._sub, endpoint, bind=bind)
        self.tracker = SequenceTracker(resume=dict(resume or {}))
        self.stats = {"live": 0, "replayed": 0, "gaps": 0, "unrepaired": 0, "restarts": 0, "malformed_frames": 0,
                      "duplicates": 0, "replay_rounds": 0, "probes": 0, "probe_found": 0, "probe_silent": 0}

    def close(self) -> None:
        self._sub.close(linger=0)

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
        """Wait for the next live message (probing while idle); return it preceded by what replay filled in."""
        while True:
            if self.probe_interval_s is not None and self.tracker.last:
                if not await self._sub.poll(int(self.probe_interval_s * 1000)):
                    found = await self.probe()
                    if found:
                        return found
                    continue
            frames = await self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.stats["malformed_frames"] += 1
                log.warning("dropping a malformed ZMQ message of %d frames", len(frames))
                continue
            topic = frames[0].decode("utf-8", errors="replace")
            seq = int.from_bytes(frames[1], "big")
            digest = payload_digest(frames[2])
            verdict = self.tracker.classify(topic, seq, digest)
            if verdict.kind == "duplicate":
                self.stats["duplicates"] += 1
                continue
            out: list[RawBatch] = []
            restart = verdict.kind == "restart"
            if restart:
                self.stats["restarts"] += 1
                self.tracker.reset(topic)
            if verdict.kind == "gap":
                self.stats["gaps"] += 1
            if verdict.replay_from is not None:
                got = await self.fetch(topic, verdict.replay_from, seq)
                out.extend(self._deliver(topic, verdict.replay_from, seq, got, restart=restart))
            out.append(RawBatch(topic, seq, frames[2], restart=restart and not out))
            self.tracker.delivered(topic, seq, digest)
            self.stats["live"] += 1
            self.stats["replayed"] += len(out) - 1
            return out

    def _deliver(self, topic: str, start: int, before: int | None, got: _Fetched, *,
                 restart: bool) -> list[RawBatch]:
        """The fetched batches of ``[start, before)`` in order, recorded as delivered; holes are counted."""
        out: list[RawBatch] = []
        numbers = sorted(s for s in got.batches if s >= start and (before is None or s < before))
        for i, rseq in enumerate(numbers):
            payload = got.batches[rseq]
            out.append(RawBatch(topic, rseq, payload, replayed=True, restart=restart and i == 0))
            self.tracker.delivered(topic, rseq, payload_digest(payload))
        end = before if before is not None else (numbers[-1] + 1 if numbers else start)
        missing = (end - start) - len(numbers)
        if missing:
            self.stats["unrepaired"] += missing
            gone = len([s for s in got.gone if start <= s < end])
            log.warning("topic %r: %d batches in [%d, %d) lost (%d no longer buffered by the engine); its facts "
                        "are uncertain until it resyncs", topic, missing, start, end, gone)
        return out

    async def probe(self) -> list[RawBatch]:
        """Ask the replay socket what every known topic published after its last delivered batch.

        Returns the batches that were lost live (in order), or a restarted engine's history;
        empty when nothing was missed.
        """
        out: list[RawBatch] = []
        for topic, last in list(self.tracker.last.items()):
            self.stats["probes"] += 1
            got = await self.fetch(topic, last, None)
            if not got.answered:
                self.stats["probe_silent"] += 1
                continue
            mine = self.tracker.digest_of(topic, last)
            echoed = got.batches.get(last)
            if echoed is not None and payload_digest(echoed) == mine:
                found = self._deliver(topic, last + 1, None, got, restart=False)
                if found:
                    self.stats["probe_found"] += len(found)
                    self.stats["replayed"] += len(found)
                    log.warning("topic %r: %d batches after seq %d were lost live; found by the replay probe",
                                topic, len(found), last)
                out.extend(found)
                continue
            if echoed is None and not got.ended_empty and any(s > last for s in got.batches):
                # The engine no longer buffers our last batch but has later ones: the same
                # incarnation with more than its buffer published since (a gap that stays open).
                out.extend(self._deliver(topic, last + 1, None, got, restart=False))
                continue
            # Not the batch we delivered under that number, or no such number any more: a restart.
            self.stats["restarts"] += 1
            log.warning("topic %r: the engine no longer holds our seq %d: it restarted", topic, last)
            self.tracker.reset(topic)
            history = await self.fetch(topic, 0, None)
            out.extend(self._deliver(topic, 0, None, history, restart=True))
        return out

    async def fetch(self, topic: str, start: int, before: int | None) -> _Fetched:
        """Batches ``start <= seq < before`` (``before`` None: everything the engine buffers from ``start``).

        Rounds of replay requests until every number is there or said to be gone, or
        ``repair_deadline_s`` has passed.
        """
        got = _Fetched()
        if self.replay_endpoint is None:
            return got
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.repair_deadline_s
        ask = start
        while True:
            self.stats["replay_rounds"] += 1
            replies, ended = await self._round(topic, ask, before)
            if replies or ended:
                got.answered = True
            if replies:
                first = replies[0][0]
                if first > ask:  # the engine's buffer starts later: what lies before is gone
                    got.gone.update(s for s in range(ask, first) if s not in got.batches)
                for rseq, payload in replies:
                    got.batches[rseq] = payload
            elif ended:
                if before is None:
                    got.ended_empty = ask == start and not got.batches
                    return got
                got.gone.update(s for s in range(ask, before) if s not in got.batches)  # nothing buffered from ask
            top = before if before is not None else (max(got.batches) + 1 if got.batches else ask)
            hole = next((s for s in range(start, top) if s not in got.batches and s not in got.gone), None)
            if hole is None and (before is not None or ended):
                return got
            if loop.time() >= deadline:
                log.warning("topic %r: replay of [%d, %s) incomplete after %.0fs", topic, start,
                            before if before is not None else "end", self.repair_deadline_s)
                return got
            if not replies and not ended:  # the engine did not answer: try again, a little later
                await asyncio.sleep(min(0.5, max(0.0, deadline - loop.time())))
            ask = hole if hole is not None else top

    async def _round(self, topic: str, start: int, before: int | None) -> tuple[list[tuple[int, bytes]], bool]:
        """One replay request from ``start``: the replies of ``topic`` in arrival order, and whether it ended.

        Each round has a DEALER of its own (a new identity), so no late reply of an earlier round
        can pass for the first reply of this one.
        """
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVHWM, 0)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            replies: list[tuple[int, bytes]] = []
            wait_ms = int(self.replay_timeout_s * 1000)
            while True:
                if not await dealer.poll(wait_ms):
                    return replies, False
                parsed = _parse_reply(await dealer.recv_multipart())
                wait_ms = int(self.reply_idle_s * 1000)
                if parsed is None:
                    continue
                rtopic, rseq, payload = parsed
                if rseq == _END:
                    return replies, True
                if (rtopic is None or rtopic == topic) and rseq >= start and (before is None or rseq < before):
                    replies.append((rseq, payload))
        finally:
            dealer.close(linger=0)


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
