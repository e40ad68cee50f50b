"""Lifecycle events and observations of the reference engine, handed to an injected publisher.

The runtime never talks to Kafka: it calls ``publisher(record)`` with a
:class:`~nexuskv.contracts.kv_events.KvEventBatch` (one per operation that changed its state) or
an :class:`~nexuskv.contracts.observations.ObservationRecord` (one per prefill). The bus adapter
``streams.bus.runtime_publisher.BusPublisher`` sends them to ``nexuskv.kv-events`` and
``nexuskv.observations``; :func:`null_publisher` drops them (the default, as vLLM's
``NullEventPublisher``).

Batches carry the publisher id, its incarnation (a restarted runtime takes a new one) and a
sequence number consecutive from 0 per incarnation. They are keyed at the edge: the runtime knows
its scope and identity secret, so an :class:`~nexuskv.edge_keys.EdgeKeyer` turns each operation's
events into a version 2 :class:`~nexuskv.contracts.keyed_events.KeyedBatch` (canonical keys packed,
token ids only with ``include_tokens``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Union

from nexuskv.contracts.keyed_events import KeyedBatch
from nexuskv.contracts.kv_events import (
    MAX_BLOCKS_PER_EVENT,
    AllCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    PublisherIdentity,
)
from nexuskv.contracts.observations import ObservationRecord
from nexuskv.descriptor import Tier
from nexuskv.edge_keys import EdgeKeyer

__all__ = ["Record", "Publisher", "null_publisher", "EventLog"]

Record = Union[KeyedBatch, KvEventBatch, ObservationRecord]
Publisher = Callable[[Record], None]


def null_publisher(record: Record) -> None:
    """Publishes nothing."""


class EventLog:
    """Collects one operation's events; :meth:`flush` publishes them as one numbered batch."""

    def __init__(self, *, publisher_id: str, incarnation: int, identity: PublisherIdentity, block_size: int,
                 publisher: Publisher, clock: Callable[[], float], secret: bytes = b"",
                 include_tokens: bool = False) -> None:
        self.publisher_id = publisher_id
        self.keyer = EdgeKeyer(secret, include_tokens=include_tokens)
        self.incarnation = incarnation
        self.identity = identity
        self.block_size = block_size
        self.publisher = publisher
        self.clock = clock
        self.seq = 0
        self._events: list[KvEvent] = []

    def stored(self, hashes: Sequence[int], parent: int | None, tokens: Sequence[int], *, tier: Tier = Tier.GPU,
               group: int = 0) -> None:
        """Blocks now present; ``tokens`` has ``block_size`` ids per hash (empty for a tier event)."""
        bs = self.block_size
        for start in range(0, len(hashes), MAX_BLOCKS_PER_EVENT):
            chunk = tuple(hashes[start:start + MAX_BLOCKS_PER_EVENT])
            chunk_parent = parent if start == 0 else hashes[start - 1]
            chunk_tokens = tuple(tokens[start * bs:(start + len(chunk)) * bs]) if tokens else ()
            self._events.append(BlockStored(engine_hashes=chunk, parent=chunk_parent, token_ids=chunk_tokens,
                                            block_size=bs, tier=tier, group=group))

    def removed(self, hashes: Sequence[int], *, tier: Tier = Tier.GPU, group: int = 0) -> None:
        for start in range(0, len(hashes), MAX_BLOCKS_PER_EVENT):
            self._events.append(BlockRemoved(engine_hashes=tuple(hashes[start:start + MAX_BLOCKS_PER_EVENT]),
                                             tier=tier, group=group))

    def cleared(self, tier: Tier | None = Tier.GPU) -> None:
        self._events.append(AllCleared(tier=tier))

    def flush(self) -> KeyedBatch | None:
        """Publish the collected events as the next batch, keyed (nothing when there are none)."""
        if not self._events:
            return None
        batch = KeyedBatch(publisher=self.publisher_id, incarnation=self.incarnation, seq=self.seq,
                           ts=self.clock(), identity=self.identity,
                           events=tuple(self.keyer.key_events(self.identity, self._events)))
        self._events = []
        self.seq += 1
        self.publisher(batch)
        return batch

    def discard(self) -> None:
        self._events = []
