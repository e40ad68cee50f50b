"""The facts of a tier that outlives the engine, published by the tier's writer under its own identity.

An engine's KV events (the bridge's publisher ``vllm/<pod>/dp<rank>``) describe its GPU cache:
a restart empties it, so the bridge starts the engine's new incarnation with a clear, and a
prefix-cache reset clears the GPU tier. Blocks this connector wrote to the worker's disk, or to a
remote tier, survive both. So they are not the engine's facts: :class:`TierPublisher` publishes
them to ``nexuskv.kv-events`` as a publisher of their own, named after the worker and the tier
(:func:`tier_publisher_name`: ``vllm/10.0.0.5:8000/dp0/disk``), whose incarnation is the *tier's*
lifetime as this worker knows it, not the engine process's.

* **Announce.** A block is announced once the tier holds it (checked, not assumed): a
  ``stored`` event with the block's tokens and its parent, so the index keys it exactly as it
  keys the engine's blocks, without the engine's own events (and whatever hash algorithm the
  engine uses). Event hashes are the low 64 bits of the canonical key: this publisher's own
  names for its blocks, resolved only within it.
* **Remember.** Each announced block is appended to the tier's manifest
  (``<data dir>/tiers/<worker>/<tier>.manifest.jsonl``: canonical key, parent key, tokens).
* **Re-announce at start.** A starting worker (a restarted engine, or a fresh one with the same
  worker name) begins a new incarnation of the tier's publisher with a ``snapshot``: ``begin``,
  every block of the manifest the tier still holds (its payload checked, its key recomputed from
  its parent and tokens under the current scope and secret, so a block of another tenant, model
  or secret is never re-announced as this one's) whose parent is also held, then ``end``. The
  index drops what it believed of the tier and takes the snapshot as its whole state: certain
  again as soon as ``end`` is applied, whatever was lost or deleted meanwhile. The manifest is
  rewritten to what was re-announced.
* **Forget.** A block found missing or corrupt on load is a ``removed`` event.

A publisher's batches are numbered from 0 in each incarnation and sent one at a time, each
waiting for the broker's acknowledgement; incarnations only grow (the last one is kept in
``<tier>.publisher.json``). One process per worker name may publish a tier at a time.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from connectors.descriptors import publisher_identity
from nexuskv.contracts.keyed_events import KeyedBatch, KeyedEvent, KeyedStored, Removed, SnapshotMark, pack_hashes
from nexuskv.contracts.kv_events import MAX_EVENTS_PER_BATCH
from nexuskv.dataplane.payload import PayloadKey
from nexuskv.descriptor import StateDescriptor, Tier
from nexuskv.errors import IdentityError
from nexuskv.identity import BlockKeyer

__all__ = ["TierBlock", "TierPublisher", "tier_publisher_name", "event_hash"]

log = logging.getLogger("nexuskv.vllm")

_MASK64 = (1 << 64) - 1
_BATCH_EVENTS = min(1024, MAX_EVENTS_PER_BATCH)


def tier_publisher_name(worker: str, tier: Tier) -> str:
    """The publisher of ``worker``'s blocks in ``tier`` (its locations in the index are named so)."""
    return f"{worker}/{tier.value}"


def event_hash(key: int) -> int:
    """The tier publisher's name for a block in its events: the canonical key's low 64 bits."""
    return key & _MASK64


@dataclass(frozen=True, slots=True)
class TierBlock:
    """One block the tier holds: its canonical key, its parent's (None for block 0), its tokens."""

    key: int
    parent: int | None
    tokens: tuple[int, ...]


#: Which of these payloads does the tier hold (True per key, in order)?
Held = Callable[[Sequence[PayloadKey]], Sequence[bool]]


class TierPublisher:
    """One worker's facts about one tier; thread-safe (the worker's write threads announce)."""

    def __init__(self, descriptor: StateDescriptor, *, worker: str, tier: Tier, keyer: BlockKeyer,
                 publish: Callable[[KeyedBatch], None], held: Held, state_dir: Path,
                 clock: Callable[[], float] = time.time, clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.descriptor = descriptor
        self.worker = worker
        self.tier = tier
        self.name = tier_publisher_name(worker, tier)
        self.keyer = keyer
        self.publish = publish
        self.held = held
        self.clock = clock
        self._clock_ns = clock_ns
        self._identity = publisher_identity(descriptor, worker=worker)  # its locations are the worker's
        self._group = descriptor.layer_groups[0].kv_group
        self._block_size = descriptor.block_size
        self._manifest = state_dir / f"{tier.value}.manifest.jsonl"
        self._state = state_dir / f"{tier.value}.publisher.json"
        self._lock = threading.Lock()
        self._incarnation = 0
        self._seq = 0
        self._announced: set[int] = set()
        self.reannounced: tuple[TierBlock, ...] = ()
        self._broken = False  # a batch may not have arrived: the next call resyncs with a new snapshot
        self.stats = {"reannounced": 0, "dropped_at_start": 0, "announced": 0, "removed": 0, "resyncs": 0}

    # -- start -------------------------------------------------------------------------------------

    def start(self) -> int:
        """A new incarnation, re-announcing what the tier still holds (a snapshot); returns that many blocks."""
        with self._lock:
            return self._start()

    def _start(self) -> int:
        self._manifest.parent.mkdir(parents=True, exist_ok=True)
        previous = self._last_incarnation()
        self._incarnation = max(self._clock_ns(), previous + 1)
        self._state.write_text(json.dumps({"publisher": self.name, "incarnation": self._incarnation}))
        blocks = self._recoverable(self._read_manifest())
        tmp = self._manifest.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            for b in blocks:
                fh.write(_line(b))
        os.replace(tmp, self._manifest)
        self._seq, self._broken = 0, False
        events: list[KeyedEvent] = [SnapshotMark(phase="begin")]
        events += [self._stored([b]) for b in blocks]
        events.append(SnapshotMark(phase="end"))
        for i in range(0, len(events), _BATCH_EVENTS):
            self._emit(events[i:i + _BATCH_EVENTS])
        self._announced = {b.key for b in blocks}
        self.reannounced = tuple(blocks)  # the tier's tier manager adopts them (nothing is announced twice)
        self.stats["reannounced"] = len(blocks)
        log.info("%s: incarnation %d re-announced %d blocks the tier still holds (%d manifest entries dropped)",
                 self.name, self._incarnation, len(blocks), self.stats["dropped_at_start"])
        return len(blocks)

    def _last_incarnation(self) -> int:
        try:
            return int(json.loads(self._state.read_text()).get("incarnation", 0))
        except (OSError, ValueError, TypeError):
            return 0

    def _read_manifest(self) -> dict[int, TierBlock]:
        out: dict[int, TierBlock] = {}
        try:
            fh = open(self._manifest, encoding="utf-8")
        except FileNotFoundError:
            return out
        with fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                    block = TierBlock(int(rec["k"], 16), None if rec["p"] is None else int(rec["p"], 16),
                                      tuple(int(t) for t in rec["t"]))
                except (ValueError, KeyError, TypeError):
                    self.stats["dropped_at_start"] += 1  # a torn last line after a crash
                    continue
                out[block.key] = block
        return out

    def _recoverable(self, records: dict[int, TierBlock]) -> list[TierBlock]:
        """Blocks that are held, keyed as this scope keys them, and chained to held parents; parents first."""
        keyed: dict[int, TierBlock] = {}
        for b in records.values():
            try:
                ok = len(b.tokens) == self._block_size and self.keyer.keys(b.tokens, parent=b.parent)[0] == b.key
            except IdentityError:
                ok = False
            if ok:
                keyed[b.key] = b
        did = self.descriptor.descriptor_id
        keys = list(keyed)
        present = self.held([PayloadKey(did, k, self._group) for k in keys]) if keys else []
        held = {k for k, ok in zip(keys, present) if ok}
        children: dict[int | None, list[int]] = {}
        for k in held:
            children.setdefault(keyed[k].parent, []).append(k)
        ordered: list[TierBlock] = []
        frontier = sorted(children.get(None, ()))
        while frontier:
            nxt: list[int] = []
            for k in frontier:
                ordered.append(keyed[k])
                nxt.extend(sorted(children.get(k, ())))
            frontier = nxt
        self.stats["dropped_at_start"] += len(records) - len(ordered)
        return ordered

    # -- serving -----------------------------------------------------------------------------------

    def announced(self, key: int) -> bool:
        with self._lock:
            return key in self._announced

    def announce(self, blocks: Sequence[TierBlock]) -> int:
        """Announce a run of consecutive blocks the tier now holds; the run must hang from an announced block.

        Returns how many were announced (0 when the run's parent is not one of this tier's blocks:
        the index could not key it).
        """
        if not blocks:
            return 0
        with self._lock:
            self._resync_if_broken()
            parent = blocks[0].parent
            if parent is not None and parent not in self._announced:
                return 0
            self._emit([self._stored(blocks)])
            self._announced.update(b.key for b in blocks)
            with open(self._manifest, "a", encoding="utf-8") as fh:
                for b in blocks:
                    fh.write(_line(b))
        self.stats["announced"] += len(blocks)
        return len(blocks)

    def forget(self, keys: Iterable[int]) -> None:
        """Blocks found missing or corrupt: ``removed`` events (the manifest drops them at the next start)."""
        with self._lock:
            self._resync_if_broken()
            gone = [k for k in keys if k in self._announced]
            if not gone:
                return
            self._emit([Removed(engine_hashes=pack_hashes(event_hash(k) for k in gone), tier=self.tier,
                                group=self._group)])
            self._announced.difference_update(gone)
        self.stats["removed"] += len(gone)

    # -- events ------------------------------------------------------------------------------------

    def _stored(self, blocks: Sequence[TierBlock]) -> KeyedStored:
        """The blocks with their canonical keys (this publisher computed them: no consumer sees the tokens)."""
        return KeyedStored(engine_hashes=pack_hashes(event_hash(b.key) for b in blocks),
                           keys=b"".join([b.key.to_bytes(16, "big") for b in blocks]), block_size=self._block_size,
                           tier=self.tier, group=self._group)

    def _emit(self, events: list[KeyedEvent]) -> None:
        """Publish one batch (the lock is held: batches leave in sequence order).

        A batch that may not have arrived leaves a gap the index treats as uncertainty; the next
        call starts a new incarnation with a snapshot instead of going on (``resyncs``).
        """
        batch = KeyedBatch(publisher=self.name, incarnation=self._incarnation, seq=self._seq, ts=self.clock(),
                           identity=self._identity, events=tuple(events))
        self._seq += 1
        try:
            self.publish(batch)
        except Exception:
            self._broken = True
            raise

    def _resync_if_broken(self) -> None:
        if self._broken:
            self.stats["resyncs"] += 1
            log.warning("%s: a batch may be lost; resyncing with a new snapshot", self.name)
            self._start()


def _line(b: TierBlock) -> str:
    return json.dumps({"k": f"{b.key:032x}", "p": None if b.parent is None else f"{b.parent:032x}",
                       "t": list(b.tokens)}, separators=(",", ":")) + "\n"
