"""The facts of a tier manager's tiers, as ``nexuskv.kv-events`` batches under its own publisher.

A :class:`~nexuskv.dataplane.tiers.TierManager` is the only writer of its tiers, so it is their
publisher: every block it admits, moves or drops is an event of its publisher (the worker's name),
whose incarnation is the manager's lifetime. What the index needs to key a block is what an
engine's ``stored`` event carries — the publisher identity, the block's tokens and its parent —
so a save hands it over as a :class:`BlockIdentity`; the manager announces the block once, then
reports its other tiers with token-less tier events and its removals by engine hash. A block's
engine hash in these events is its canonical key's low 64 bits: this publisher's own name for
it, meaningful only inside this publisher (as the index treats every engine hash). A block's
parent must be held by the same publisher when it is announced (the index resolves it there), so
the manager drops a prefix parent only after the blocks that chain from it.

Batches are numbered from 0 in each incarnation and handed to ``publish`` in order, one
operation's events per batch and identity; the first batch of an incarnation is a full
``cleared`` (what an earlier incarnation announced is gone with it).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from nexuskv.contracts.kv_events import (
    MAX_BLOCKS_PER_EVENT,
    AllCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    PublisherIdentity,
)
from nexuskv.descriptor import Tier

if TYPE_CHECKING:
    from nexuskv.dataplane.payload import PayloadKey

__all__ = ["BlockIdentity", "TierChange", "FactSink", "TierFacts", "event_hash"]

_MASK64 = (1 << 64) - 1


def event_hash(key: int) -> int:
    """A block's engine hash in a tier manager's events: its canonical key's low 64 bits."""
    return key & _MASK64


@dataclass(frozen=True, slots=True)
class BlockIdentity:
    """What the index needs to key one block: who serves it, its tokens, and the block before it."""

    identity: PublisherIdentity
    tokens: tuple[int, ...]
    block_size: int
    parent: int | None = None  # canonical key of the previous block of the chain (None: block 0)
    tenant_namespace: str | None = None  # overrides of the publisher identity, as in BlockStored
    lora: str | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if len(self.tokens) != self.block_size:
            raise ValueError(f"tokens: {len(self.tokens)} for a block of {self.block_size}")


@dataclass(frozen=True, slots=True)
class TierChange:
    """One change of a tier manager's tiers that the index must learn (in the order it was made).

    ``stored``: ``key`` is announced, with its tokens, as held in ``tier``; ``moved``: an announced
    block is now also held in ``tier`` (a tier event); ``removed``: it left ``tier``.
    """

    kind: Literal["stored", "moved", "removed"]
    tier: Tier
    key: PayloadKey
    identity: BlockIdentity


class FactSink(Protocol):
    """Where a tier manager's changes go: :class:`TierFacts` (its own publisher), or an adapter's
    publisher of its tier (the vLLM connector's, which also keeps a manifest).

    ``apply`` is called under the manager's lock, in the order of the changes; ``flush`` outside
    it, to publish what ``apply`` queued.
    """

    def apply(self, changes: Sequence[TierChange]) -> None: ...

    def flush(self) -> int: ...


class TierFacts:
    """Builds and orders one publisher's batches; thread-safe.

    Events are queued in the order the manager made its changes (``queue``, under the manager's
    lock) and handed to ``publish`` in that order by whoever calls :meth:`flush` (outside it).
    """

    def __init__(self, publisher: str, publish: Callable[[KvEventBatch], None] | None, *,
                 identity: PublisherIdentity | None = None, incarnation: int | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.publisher = publisher
        self.publish = publish
        self.identity = identity
        self.incarnation = incarnation if incarnation is not None else time.time_ns()
        self.clock = clock
        self.seq = 0
        self.batches = 0
        self._outbox: deque[KvEventBatch] = deque()
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._started = False

    def start(self, identity: PublisherIdentity) -> None:
        """Begin the incarnation: one full clear (the publisher's earlier facts are void)."""
        if self._started:
            return
        self._started = True
        self.identity = self.identity or identity
        self.queue([AllCleared()], identity)

    def queue(self, events: Iterable[KvEvent], identity: PublisherIdentity) -> None:
        events = tuple(events)
        if not events or self.publish is None:
            return
        with self._lock:
            self._outbox.append(KvEventBatch(publisher=self.publisher, incarnation=self.incarnation, seq=self.seq,
                                             ts=self.clock(), identity=identity, events=events))
            self.seq += 1

    def apply(self, changes: Sequence[TierChange]) -> None:
        """Queue ``changes`` as events, one batch per run of one publisher identity, in order."""
        if not changes or self.publish is None:
            return
        self.start(changes[0].identity.identity)
        events: list[KvEvent] = []
        ident = changes[0].identity.identity
        i = 0
        while i < len(changes):
            c = changes[i]
            if c.identity.identity != ident:
                self.queue(events, ident)
                events, ident = [], c.identity.identity
            j = i + 1
            while (j < len(changes) and changes[j].kind == c.kind and changes[j].tier is c.tier
                   and changes[j].key.group == c.key.group and changes[j].identity.identity == ident):
                j += 1
            run = changes[i:j]
            group = c.key.group
            if c.kind == "stored":
                events += stored_events([(x.key.key, x.identity) for x in run], c.tier, group)
            elif c.kind == "moved":
                events += moved_events([x.key.key for x in run], c.tier, group, c.identity.block_size)
            else:
                events += removed_events([x.key.key for x in run], c.tier, group)
            i = j
        self.queue(events, ident)

    def flush(self) -> int:
        """Hand queued batches to ``publish``, in order; returns how many."""
        if self.publish is None:
            return 0
        sent = 0
        with self._flush_lock:
            while True:
                with self._lock:
                    if not self._outbox:
                        return sent
                    batch = self._outbox.popleft()
                self.publish(batch)
                self.batches += 1
                sent += 1

    def pending(self) -> int:
        with self._lock:
            return len(self._outbox)


def stored_events(announce: list[tuple[int, BlockIdentity]], tier: Tier, group: int) -> list[BlockStored]:
    """``stored`` events for blocks announced with their tokens: one per run that chains, in order."""
    out: list[BlockStored] = []
    run: list[tuple[int, BlockIdentity]] = []

    def close() -> None:
        if not run:
            return
        first = run[0][1]
        out.append(BlockStored(
            engine_hashes=tuple(event_hash(k) for k, _ in run),
            parent=None if first.parent is None else event_hash(first.parent),
            token_ids=tuple(t for _, b in run for t in b.tokens), block_size=first.block_size, tier=tier,
            group=group, tenant_namespace=first.tenant_namespace, lora=first.lora, cache_salt=first.cache_salt))
        run.clear()

    for key, ident in announce:
        if run:
            prev_key, prev = run[-1]
            same = (ident.parent == prev_key and ident.block_size == prev.block_size
                    and (ident.tenant_namespace, ident.lora, ident.cache_salt)
                    == (prev.tenant_namespace, prev.lora, prev.cache_salt)
                    and len(run) < MAX_BLOCKS_PER_EVENT)
            if not same:
                close()
        run.append((key, ident))
    close()
    return out


def moved_events(keys: list[int], tier: Tier, group: int, block_size: int) -> list[BlockStored]:
    """Token-less ``stored`` events: blocks this publisher announced are now also in ``tier``."""
    return [BlockStored(engine_hashes=tuple(event_hash(k) for k in keys[i:i + MAX_BLOCKS_PER_EVENT]),
                        block_size=block_size, tier=tier, group=group)
            for i in range(0, len(keys), MAX_BLOCKS_PER_EVENT)]


def removed_events(keys: list[int], tier: Tier, group: int) -> list[BlockRemoved]:
    return [BlockRemoved(engine_hashes=tuple(event_hash(k) for k in keys[i:i + MAX_BLOCKS_PER_EVENT]), tier=tier,
                         group=group)
            for i in range(0, len(keys), MAX_BLOCKS_PER_EVENT)]
