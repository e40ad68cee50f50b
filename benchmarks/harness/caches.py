"""The ground truth of where state lives: per-worker LRU tiers, the shared store, and their events.

A worker's tiers form a hierarchy: blocks a prefill computed (or copied in) enter its GPU cache;
GPU evictions are offloaded to host DRAM, host evictions to local disk, disk evictions dropped
(a tier that is absent drops instead). The shared remote store receives every computed block
(write-through, as LMCache and Mooncake's store are deployed) and evicts LRU. Within a request
the blocks are touched deepest first, so block 0 ends most recently used and a request's tail
goes before its head (vLLM frees a request's blocks in reverse order).

Each change is published as the ``nexuskv.kv-events`` batch the engine would emit: a
``stored`` run with token ids for blocks entering the GPU (or the store), token-less tier events
for offloads, ``removed`` for evictions — one batch per publisher per completion, in order, so a
real :class:`~nexuskv.index.GlobalIndex` fed with them holds exactly these facts.

A cache maps the key the *index* sees to the key of the state actually held. They are equal
unless the index's identity was degraded (the "semantic validation" ablation keys blocks by
tokens alone): then a lookup can match state computed for another tenant or adapter, and the
mismatch is how the harness counts unsafe reuse.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from nexuskv.contracts.kv_events import (
    MAX_BLOCKS_PER_EVENT,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    PublisherIdentity,
)
from nexuskv.descriptor import Tier

__all__ = ["LruTier", "Publisher"]

_MASK64 = (1 << 64) - 1


class LruTier:
    """One tier of one place: ``index key -> held key``, least recently used first."""

    __slots__ = ("tier", "capacity", "blocks")

    def __init__(self, tier: Tier, capacity: int) -> None:
        self.tier = tier
        self.capacity = capacity
        self.blocks: OrderedDict[int, int] = OrderedDict()

    def prefix(self, keys: Sequence[int]) -> int:
        """Blocks of ``keys`` held here consecutively from block 0."""
        blocks = self.blocks
        n = 0
        for k in keys:
            if k not in blocks:
                break
            n += 1
        return n

    def holds(self, keys: Sequence[int]) -> bool:
        blocks = self.blocks
        return all(k in blocks for k in keys)

    def mismatched(self, keys: Sequence[int], held: Sequence[int]) -> int:
        """How many of ``keys`` hold state other than ``held`` (unsafe if reused)."""
        blocks = self.blocks
        return sum(1 for k, h in zip(keys, held) if blocks.get(k, h) != h)

    def touch(self, keys: Sequence[int]) -> None:
        """Mark ``keys`` (those held) most recently used, block 0 last."""
        blocks = self.blocks
        for k in reversed(keys):
            if k in blocks:
                blocks.move_to_end(k)


class Publisher:
    """One engine (or the store) publishing lifecycle events for its tiers."""

    def __init__(self, name: str, tiers: Sequence[LruTier], identity: PublisherIdentity, block_tokens: int) -> None:
        if not tiers:
            raise ValueError("a publisher has at least one tier")
        self.name = name
        self.tiers = {t.tier: t for t in tiers}
        self.order = [t.tier for t in tiers]  # fastest first: evictions cascade down this list
        self.identity = identity
        self.block_tokens = block_tokens
        self.seq = 0
        self._salt = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big")

    def ehash(self, key: int) -> int:
        """This publisher's engine hash of a block (meaningful only inside this publisher)."""
        return ((key & _MASK64) ^ self._salt) or 1

    def store(self, keys: Sequence[int], held: Sequence[int], tokens: Callable[[], np.ndarray], *,
              tenant: str | None, lora: str | None, ts: float) -> KvEventBatch | None:
        """A prompt's blocks enter the top tier (and are touched); returns the batch to publish.

        ``keys`` are the index's keys of the prompt's full blocks, ``held`` the true ones;
        ``tokens`` gives the prompt's token ids when a stored run needs them.
        """
        top = self.tiers[self.order[0]]
        blocks = top.blocks
        first = next((i for i, k in enumerate(keys) if k not in blocks), None)
        events: list[KvEvent] = []
        if first is not None:
            ids = tokens()
            bt = self.block_tokens
            for start in range(first, len(keys), MAX_BLOCKS_PER_EVENT):
                run = keys[start:start + MAX_BLOCKS_PER_EVENT]
                events.append(BlockStored(
                    engine_hashes=tuple(self.ehash(k) for k in run),
                    parent=self.ehash(keys[start - 1]) if start else None,
                    token_ids=tuple(ids[start * bt:(start + len(run)) * bt].tolist()), block_size=bt,
                    tier=top.tier, tenant_namespace=tenant, lora=lora))
            for k, h in zip(keys[first:], held[first:]):
                if k not in blocks:  # what the engine holds already, it keeps
                    blocks[k] = h
        top.touch(keys)
        events.extend(self._cascade())
        if not events:
            return None
        return self._batch(events, ts)

    def _cascade(self) -> list[KvEvent]:
        moved_in: list[tuple[Tier, list[int]]] = []
        removed: list[tuple[Tier, list[int]]] = []
        for i, tier in enumerate(self.order):
            lru = self.tiers[tier]
            below = self.tiers[self.order[i + 1]] if i + 1 < len(self.order) else None
            gone: list[int] = []
            entered: list[int] = []
            while len(lru.blocks) > lru.capacity:
                k, h = lru.blocks.popitem(last=False)
                gone.append(self.ehash(k))
                if below is not None and below.capacity > 0:
                    if k not in below.blocks:
                        entered.append(self.ehash(k))
                    below.blocks[k] = h
                    below.blocks.move_to_end(k)
            if entered:
                moved_in.append((below.tier, entered))  # type: ignore[union-attr]
            if gone:
                removed.append((tier, gone))
        events: list[KvEvent] = []
        bt = self.block_tokens
        for tier, hashes in moved_in:  # offloads first: the publisher still holds the blocks
            for i in range(0, len(hashes), MAX_BLOCKS_PER_EVENT):
                events.append(BlockStored(engine_hashes=tuple(hashes[i:i + MAX_BLOCKS_PER_EVENT]), block_size=bt,
                                          tier=tier))
        for tier, hashes in removed:
            for i in range(0, len(hashes), MAX_BLOCKS_PER_EVENT):
                events.append(BlockRemoved(engine_hashes=tuple(hashes[i:i + MAX_BLOCKS_PER_EVENT]), tier=tier))
        return events

    def _batch(self, events: list[KvEvent], ts: float) -> KvEventBatch:
        batch = KvEventBatch(publisher=self.name, incarnation=1, seq=self.seq, ts=ts, identity=self.identity,
                             events=tuple(events))
        self.seq += 1
        return batch
