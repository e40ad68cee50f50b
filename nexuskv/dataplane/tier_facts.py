"""The facts of a tier manager's tiers, as ``nexuskv.kv-events`` batches under its own publisher.

A :class:`~nexuskv.dataplane.tiers.TierManager` is the only writer of its tiers, so it is their
publisher: every block it admits, moves or drops is an event of its publisher (the worker's name),
whose incarnation is the manager's lifetime. What the index needs to key a block is what an
engine's ``stored`` event carries — the publisher identity, the block's tokens and its parent —
so a save hands it over as a :class:`BlockIdentity`; the manager announces the block once, then
reports its other tiers with tier events and its removals by engine hash. The manager holds each
block's canonical key already (its payload key), so it publishes the keys themselves, in
version 2 batches (:mod:`nexuskv.contracts.keyed_events`): no consumer recomputes them, and the
tokens stay off the bus unless ``include_tokens`` (``NEXUSKV_KV_EVENTS_TOKENS=on``). A block's
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

from nexuskv.contracts.keyed_events import Cleared, KeyedBatch, KeyedEvent, KeyedStored, Removed, TierStored
from nexuskv.contracts.kv_events import MAX_BLOCKS_PER_EVENT, PublisherIdentity
from nexuskv.descriptor import Tier
from nexuskv.edge_keys import pack_tokens
from nexuskv.identity import KEY_BYTES

if TYPE_CHECKING:
    from nexuskv.dataplane.payload import PayloadKey

__all__ = ["BlockIdentity", "TierChange", "FactSink", "TierFacts", "event_hash"]

_MASK64 = (1 << 64) - 1


def event_hash(key: int) -> int:
    """A block's engine hash in a tier manager's events: its canonical key's low 64 bits."""
    return key & _MASK64


@dataclass(frozen=True, slots=True)
class BlockIdentity:
    """What the index needs to key one block: who serves it, its tokens, and the block before it.

    ``tokens`` may be empty where they never reached this process (the remote-tier manager learns
    blocks from offers, which carry keys only): the events carry the canonical keys, and such a
    block's ``stored`` event has no token ids even with ``include_tokens``."""

    identity: PublisherIdentity
    tokens: tuple[int, ...]
    block_size: int
    parent: int | None = None  # canonical key of the previous block of the chain (None: block 0)
    tenant_namespace: str | None = None  # overrides of the publisher identity, as in BlockStored
    lora: str | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.tokens and len(self.tokens) != self.block_size:
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

    def __init__(self, publisher: str, publish: Callable[[KeyedBatch], None] | None, *,
                 identity: PublisherIdentity | None = None, incarnation: int | None = None,
                 clock: Callable[[], float] = time.time, include_tokens: bool = False) -> None:
        self.publisher = publisher
        self.include_tokens = include_tokens
        self.publish = publish
        self.identity = identity
        self.incarnation = incarnation if incarnation is not None else time.time_ns()
        self.clock = clock
        self.seq = 0
        self.batches = 0
        self._outbox: deque[KeyedBatch] = deque()
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._started = False

    def start(self, identity: PublisherIdentity) -> None:
        """Begin the incarnation: one full clear (the publisher's earlier facts are void)."""
        if self._started:
            return
        self._started = True
        self.identity = self.identity or identity
        self.queue([Cleared()], identity)

    def queue(self, events: Iterable[KeyedEvent], identity: PublisherIdentity) -> None:
        events = tuple(events)
        if not events or self.publish is None:
            return
        with self._lock:
            self._outbox.append(KeyedBatch(publisher=self.publisher, incarnation=self.incarnation, seq=self.seq,
                                           ts=self.clock(), identity=identity, events=events))
            self.seq += 1

    def apply(self, changes: Sequence[TierChange]) -> None:
        """Queue ``changes`` as events, one batch per run of one publisher identity, in order."""
        if not changes or self.publish is None:
            return
        self.start(changes[0].identity.identity)
        events: list[KeyedEvent] = []
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
                events += stored_events([(x.key.key, x.identity) for x in run], c.tier, group,
                                        include_tokens=self.include_tokens)
            elif c.kind == "moved":
                events += moved_events([x.key.key for x in run], c.tier, group)
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


def _hashes(keys: Iterable[int]) -> bytes:
    return b"".join([(k & _MASK64).to_bytes(8, "little") for k in keys])


def stored_events(announce: list[tuple[int, BlockIdentity]], tier: Tier, group: int, *,
                  include_tokens: bool = False) -> list[KeyedStored]:
    """``stored`` events for announced blocks, with their keys: one per run of one scope, in order."""
    out: list[KeyedStored] = []
    run: list[tuple[int, BlockIdentity]] = []

    def close() -> None:
        if not run:
            return
        first = run[0][1]
        out.append(KeyedStored(
            engine_hashes=_hashes(k for k, _ in run), keys=b"".join([k.to_bytes(KEY_BYTES, "big") for k, _ in run]),
            block_size=first.block_size, tier=tier, group=group, tenant_namespace=first.tenant_namespace,
            lora=first.lora, cache_salt=first.cache_salt,
            token_ids=pack_tokens(t for _, b in run for t in b.tokens) if include_tokens and first.tokens else None))
        run.clear()

    for key, ident in announce:
        if run:
            prev = run[-1][1]
            same = (ident.block_size == prev.block_size and bool(ident.tokens) == bool(prev.tokens)
                    and (ident.tenant_namespace, ident.lora, ident.cache_salt)
                    == (prev.tenant_namespace, prev.lora, prev.cache_salt)
                    and len(run) < MAX_BLOCKS_PER_EVENT)
            if not same:
                close()
        run.append((key, ident))
    close()
    return out


def moved_events(keys: list[int], tier: Tier, group: int) -> list[TierStored]:
    """Tier events: blocks this publisher announced are now also in ``tier``."""
    return [TierStored(engine_hashes=_hashes(keys[i:i + MAX_BLOCKS_PER_EVENT]), tier=tier, group=group)
            for i in range(0, len(keys), MAX_BLOCKS_PER_EVENT)]


def removed_events(keys: list[int], tier: Tier, group: int) -> list[Removed]:
    return [Removed(engine_hashes=_hashes(keys[i:i + MAX_BLOCKS_PER_EVENT]), tier=tier, group=group)
            for i in range(0, len(keys), MAX_BLOCKS_PER_EVENT)]
