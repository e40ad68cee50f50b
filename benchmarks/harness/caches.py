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

**Utility tiers** (:class:`UtilityTier`, NexusKV's runs): a tier manager's host, disk and store
tiers (whitepaper §7.5, :mod:`nexuskv.admission`). The GPU cache stays the engine's LRU (the engine
keeps authority over its memory). A block leaves its tier cheapest first by utility per byte, and
enters a full tier (an offload from above, a write to the store) only when it is worth more than
the cheapest block there — else it is dropped, or not written; a block whose reuse from a tier
would cost more than recomputing it (EG <= 0 there, by the believed cost model: a prompt's mean
per block) never enters it. ``P(reuse)`` is a decayed use count per worker (a prefill, a copy
source and a reuse in place each count once per block). To keep the order in a heap, a block is
ranked by its log utility in the rarely-used limit, ``ln EG + ln score + t_last * ln 2 / half-life``,
which does not change as time passes (every score decays alike). ``admit_all`` (the "no tier
admission" ablation) evicts by utility but takes every offload and write.
"""

from __future__ import annotations

import hashlib
import heapq
import math
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

__all__ = ["LruTier", "UtilityTier", "Uses", "Publisher"]

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

    def touch(self, keys: Sequence[int], now: float | None = None) -> None:
        """Mark ``keys`` (those held) most recently used, block 0 last."""
        blocks = self.blocks
        for k in reversed(keys):
            if k in blocks:
                blocks.move_to_end(k)

    # -- the cascade's hooks (LRU: the oldest leaves, everything is taken) --------------------------

    def pop_victim(self) -> tuple[int, int]:
        return self.blocks.popitem(last=False)

    def accepts(self, key: int) -> bool:
        return self.capacity > 0

    def insert(self, key: int, held: int) -> None:
        self.blocks[key] = held
        self.blocks.move_to_end(key)


_LN2 = math.log(2.0)


class Uses:
    """One worker's use history of its blocks (shared by its utility tiers) and their EG per tier."""

    __slots__ = ("half_life_s", "score", "since", "gains", "tiers")

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self.score: dict[int, float] = {}
        self.since: dict[int, float] = {}
        self.gains: dict[int, dict[Tier, float]] = {}
        self.tiers: list[UtilityTier] = []

    def use(self, keys: Sequence[int], now: float, gains: dict[Tier, float] | None = None) -> None:
        """Count one use of each key at ``now`` (``gains``: the EG a new block is valued at)."""
        score, since, h = self.score, self.since, self.half_life_s
        for k in keys:
            prev = score.get(k)
            score[k] = 1.0 if prev is None else prev * 2.0 ** (-(now - since[k]) / h) + 1.0
            since[k] = now
            if gains is not None and k not in self.gains:
                self.gains[k] = gains
        for t in self.tiers:
            t.reranked(keys)

    def rank(self, key: int, tier: Tier) -> float:
        """Log utility in the rarely-used limit (time-invariant); -inf when the tier cannot pay."""
        g = self.gains.get(key, {}).get(tier, 0.0)
        if g <= 0.0:
            return -math.inf
        return math.log(g) + math.log(self.score.get(key, 1.0)) + self.since.get(key, 0.0) * _LN2 / self.half_life_s

    def forget(self, key: int) -> None:
        if not any(key in t.blocks for t in self.tiers):
            self.score.pop(key, None)
            self.since.pop(key, None)
            self.gains.pop(key, None)


class UtilityTier(LruTier):
    """A tier manager's tier: cheapest by utility leaves first; a full tier admits only what is worth
    more than its cheapest block (see the module docstring)."""

    __slots__ = ("uses", "admit_all", "_heap", "_rank", "_seq")

    def __init__(self, tier: Tier, capacity: int, uses: Uses, *, admit_all: bool = False) -> None:
        super().__init__(tier, capacity)
        self.uses = uses
        self.admit_all = admit_all
        self._heap: list[tuple[float, int, int]] = []
        self._rank: dict[int, float] = {}
        self._seq = 0
        uses.tiers.append(self)

    def _push(self, key: int) -> None:
        r = self.uses.rank(key, self.tier)
        self._rank[key] = r
        self._seq += 1
        heapq.heappush(self._heap, (r, self._seq, key))

    def reranked(self, keys: Sequence[int]) -> None:
        blocks = self.blocks
        for k in keys:
            if k in blocks:
                self._push(k)

    def touch(self, keys: Sequence[int], now: float | None = None) -> None:
        if now is not None:
            self.uses.use(keys, now)

    def _cheapest(self) -> tuple[float, int] | None:
        heap, rank, blocks = self._heap, self._rank, self.blocks
        while heap:
            r, _seq, k = heap[0]
            if k in blocks and rank.get(k) == r:
                return r, k
            heapq.heappop(heap)
        return None

    def pop_victim(self) -> tuple[int, int]:
        found = self._cheapest()
        if found is None:
            return self.blocks.popitem(last=False)
        heapq.heappop(self._heap)
        k = found[1]
        self._rank.pop(k, None)
        return k, self.blocks.pop(k)

    def accepts(self, key: int) -> bool:
        if self.capacity <= 0:
            return False
        r = self.uses.rank(key, self.tier)
        if r == -math.inf:
            return False  # reuse from here would not pay
        if self.admit_all or len(self.blocks) < self.capacity:
            return True
        cheapest = self._cheapest()
        return cheapest is None or r > cheapest[0]

    def insert(self, key: int, held: int) -> None:
        self.blocks[key] = held
        self._push(key)


class Publisher:
    """One engine (or the store) publishing lifecycle events for its tiers."""

    def __init__(self, name: str, tiers: Sequence[LruTier], identity: PublisherIdentity, block_tokens: int,
                 uses: Uses | None = None, value: Callable[[int], dict[Tier, float]] | None = None) -> None:
        if not tiers:
            raise ValueError("a publisher has at least one tier")
        self.name = name
        self.tiers = {t.tier: t for t in tiers}
        self.order = [t.tier for t in tiers]  # fastest first: evictions cascade down this list
        self.identity = identity
        self.block_tokens = block_tokens
        self.uses = uses  # with utility tiers: the worker's use history
        self.value = value  # blocks of a prompt -> their EG per tier (the prompt's mean)
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
        if self.uses is not None:
            self.uses.use(keys, ts, self.value(len(keys)) if self.value is not None else None)
        first = next((i for i, k in enumerate(keys) if k not in blocks), None)
        if first is not None and isinstance(top, UtilityTier) and not top.accepts(keys[first]):
            first = None  # a write the store does not admit: the prompt's blocks are worth less than its cheapest
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
                    top.insert(k, h)
        if not isinstance(top, UtilityTier):
            top.touch(keys)  # the engine's own LRU order (a utility tier counted the use above)
        events.extend(self._cascade())
        if self.uses is not None:
            for k in keys:
                self.uses.forget(k)  # only what no tier of this publisher holds
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
                k, h = lru.pop_victim()
                gone.append(self.ehash(k))
                if below is not None and below.accepts(k):
                    if k not in below.blocks:
                        entered.append(self.ehash(k))
                    below.insert(k, h)
                elif self.uses is not None:
                    self.uses.forget(k)
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
