"""ReferenceIndex: the global index's semantics, written as plainly as possible.

A dict of sets per (publisher, tier, group) and a dict per publisher from engine hash to block.
It is the oracle of the property tests (``tests/nexuskv/test_index_properties.py`` and the
others that compare :class:`~nexuskv.index.GlobalIndex` with it) and the "plain dict-of-sets
index" baseline of the index benchmarks (``benchmarks/bench_index.py``; the peer benchmark's
dict baseline answers with :func:`location_runs` too). It follows the rules written in
:mod:`nexuskv.index` (sequence numbers, incarnations, resyncs, scoped removals and clears, the
engine-hash map whose entries live while their publisher holds their block somewhere) but shares
none of its code except the key computation, and has no memory bound. The native core
(``nexuskv/native/``) is the other statement of these rules; there is no third. Test code only:
a membership costs several hundred bytes here.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence

from nexuskv.contracts.kv_events import AllCleared, BlockRemoved, BlockStored, KvEventBatch, Snapshot
from nexuskv.descriptor import Tier
from nexuskv.entries import EntryLocation
from nexuskv.errors import IdentityError
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.lookup import Extent, LocationMatch, LookupResult

__all__ = ["ReferenceIndex", "location_runs", "prefix_and_extents"]

Block = tuple[IdentityScope, int]
Where = tuple[str, Tier, int]


def location_runs(present: Sequence[Collection[Hashable]]) -> dict[Hashable, list[list[int]]]:
    """Per location, the runs ``[start, end)`` of consecutive query blocks it holds, in order;
    ``present[i]`` is the set of locations holding query block ``i``.

    Consecutive blocks held by the same locations are one stretch, taken at once (a prompt's
    blocks mostly are): a run grows by the whole stretch."""
    runs: dict[Hashable, list[list[int]]] = {}
    n, i = len(present), 0
    while i < n:
        here, j = present[i], i + 1
        while j < n and (present[j] is here or present[j] == here):  # identity first: interned sets
            j += 1
        for loc in here:
            got = runs.get(loc)
            if got is None:
                runs[loc] = [[i, j]]
            elif got[-1][1] == i:
                got[-1][1] = j
            else:
                got.append([i, j])
        i = j
    return runs


def prefix_and_extents(runs: list[list[int]]) -> tuple[int, tuple[tuple[int, int], ...]]:
    """A location's runs as a match: the prefix (blocks from 0 on, 0 when block 0 is not held)
    and the runs after it."""
    prefix = runs[0][1] if runs[0][0] == 0 else 0
    return prefix, tuple((s, e) for s, e in (runs[1:] if prefix else runs))


class _Pub:
    def __init__(self, incarnation: int, next_seq: int) -> None:
        self.incarnation = incarnation
        self.next_seq = next_seq
        self.certain = True
        self.in_snapshot = False
        self.clean = False
        self.engine: dict[int, Block] = {}
        self.hashes: dict[Block, set[int]] = {}  # the engine map, reversed

    def link(self, h: int, block: Block) -> None:
        old = self.engine.get(h)
        if old is not None:
            self.hashes[old].discard(h)
        self.engine[h] = block
        self.hashes.setdefault(block, set()).add(h)

    def unlink(self, block: Block) -> None:
        """Every hash naming ``block`` leaves the map (the publisher holds it nowhere now)."""
        for h in self.hashes.pop(block, ()):
            del self.engine[h]


class ReferenceIndex:
    """Brute force: every membership is a tuple in a set."""

    def __init__(self, *, secret: bytes = b"") -> None:
        self.secret = secret
        self.facts: dict[Where, set[Block]] = {}
        self.pubs: dict[str, _Pub] = {}

    def apply(self, batch: KvEventBatch) -> str:
        pub = self.pubs.get(batch.publisher)
        if pub is None:
            pub = self.pubs[batch.publisher] = _Pub(batch.incarnation, batch.seq)
            if batch.seq != 0:
                self._doubt(pub)
        elif batch.incarnation < pub.incarnation:
            return "stale"
        elif batch.incarnation > pub.incarnation:
            pub.incarnation = batch.incarnation
            self._doubt(pub)
        elif batch.seq < pub.next_seq:
            return "duplicate"
        elif batch.seq > pub.next_seq:
            self._doubt(pub)
        pub.next_seq = batch.seq + 1
        name = batch.publisher
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(name, pub, batch, ev)
            elif isinstance(ev, BlockRemoved):
                for h in ev.engine_hashes:
                    block = pub.engine.get(h)
                    if block is not None:
                        self.facts.get((name, ev.tier, ev.group), set()).discard(block)
                        if not self._held(name, block):
                            pub.unlink(block)
            elif isinstance(ev, AllCleared):
                self._clear(name, pub, ev.tier)
                if ev.tier is None:
                    pub.certain, pub.in_snapshot = True, False
            elif isinstance(ev, Snapshot):
                if ev.phase == "begin":
                    self._clear(name, pub, None)
                    pub.certain, pub.in_snapshot, pub.clean = False, True, True
                elif pub.in_snapshot and pub.clean:
                    pub.certain, pub.in_snapshot = True, False
                else:
                    pub.in_snapshot = False
        return "applied"

    @staticmethod
    def _doubt(pub: _Pub) -> None:
        pub.certain = False
        pub.clean = False

    def _stored(self, name: str, pub: _Pub, batch: KvEventBatch, ev: BlockStored) -> None:
        where = (name, ev.tier, ev.group)
        if ev.is_tier_event:
            for h in ev.engine_hashes:
                if h in pub.engine:
                    self.facts.setdefault(where, set()).add(pub.engine[h])
            return
        ident = batch.identity
        scope = IdentityScope(
            tenant_namespace=ev.tenant_namespace or ident.tenant_namespace, model=ident.model,
            model_revision=ident.model_revision, tokenizer_revision=ident.tokenizer_revision,
            descriptor_id=ident.descriptor_id, lora=ev.lora, cache_salt=ev.cache_salt,
        )
        parent = None
        if ev.parent is not None:
            if ev.parent not in pub.engine:
                return
            parent = pub.engine[ev.parent][1]
        try:
            keys = BlockKeyer(scope, ev.block_size, self.secret).keys(ev.token_ids, parent=parent,
                                                                        extra_keys=ev.extra_keys)
        except IdentityError:
            return
        for h, key in zip(ev.engine_hashes, keys):
            old = pub.engine.get(h)
            pub.link(h, (scope, key))
            self.facts.setdefault(where, set()).add((scope, key))
            if old is not None and old != (scope, key):
                for (p, _t, _g), blocks in self.facts.items():
                    if p == name:
                        blocks.discard(old)
                pub.unlink(old)

    def _held(self, name: str, block: Block) -> bool:
        return any(p == name and block in blocks for (p, _t, _g), blocks in self.facts.items())

    def _clear(self, name: str, pub: _Pub, tier: Tier | None) -> None:
        gone: set[Block] = set()
        for (p, t, _g), blocks in self.facts.items():
            if p == name and (tier is None or t == tier):
                gone |= blocks
                blocks.clear()
        for block in gone:
            if not self._held(name, block):
                pub.unlink(block)

    def lookup(self, scope: IdentityScope, keys: Sequence[int]) -> LookupResult:
        keys = [int(k) for k in keys]
        present = [frozenset(where for where, blocks in self.facts.items() if (scope, k) in blocks) for k in keys]
        runs = location_runs(present)
        matches = []
        for where in sorted(runs, key=lambda w: (w[0], w[1].value, w[2])):
            name, tier, group = where
            prefix, rest = prefix_and_extents(runs[where])
            matches.append(LocationMatch(EntryLocation(worker=name, tier=tier, group=group), name, prefix,
                                         tuple(Extent(s, e) for s, e in rest), self.pubs[name].certain))
        return LookupResult(num_blocks=len(keys), matches=tuple(matches))

    def nonempty_facts(self) -> dict[Where, set[Block]]:
        return {where: set(blocks) for where, blocks in self.facts.items() if blocks}
