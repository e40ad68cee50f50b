"""The global index: which canonical blocks live at which (publisher, tier, KV group).

:class:`GlobalIndex` applies ``nexuskv.kv-events`` batches and answers lookups. It is pure: no
I/O, no clock; the stream worker and the replicas (``streams/``) feed it.

**Identity.** A stored block's canonical key is computed from the event's ``token_ids`` with
:class:`~nexuskv.identity.BlockKeyer` in the scope of the batch's publisher identity plus the
event's tenant, LoRA and cache-salt overrides; the parent key comes from the publisher's own
engine-hash map (llm-d's scheme, ``engines.md`` §2.3). Engine hashes are per publisher: two
publishers' equal engine hashes mean nothing. Token-less *tier events* (a known block now also in
host memory or on disk) and removals resolve through that map; hashes the map does not know are
counted (``unresolved_blocks``, ``unknown_removals``) and otherwise ignored, so they can never
create or delete another block. A publisher's map entry lives while the publisher holds the block
in some tier.

**Scope isolation.** Every block is stored with its scope id and found only by a lookup in that
same scope: a caller of one tenant that presents another tenant's keys gets misses.

**Scoping of removals.** A removal touches one publisher's one (tier, group); a clear one
publisher's facts (one tier's, when the clear names a tier). Another publisher's or another
tier's memberships of the same block are left alone (the property tests check it).

**Sequence and incarnation** are :mod:`nexuskv.publishers`' business: a duplicate or stale batch
is ignored; a gap, a late first sight or a new incarnation makes the publisher *uncertain* (every
match it contributes is ``certain=False``, a miss for the planner) until it resyncs with a full
``AllCleared`` or a clean ``Snapshot``. **Checkpoints** (one per stream partition) are in the
format of :mod:`nexuskv.index_checkpoint`.

**Memory.** Blocks live in a :class:`~nexuskv.keytable.KeyTable` (128-bit key, scope id, an
interned location-set id and a reference count: 24 bytes a slot) and the engine-hash map in a
second one (mixed hash, publisher id, block slot: 16 bytes a slot), both kept between ~53% and
80% full. ``max_memberships`` bounds the (block, location) memberships; past it the index
*forgets* blocks with the ``sweep`` policy: it walks the block table from a rotating cursor (slot
order is hash order, so this is a uniform sample of blocks, whatever their age) and drops whole
blocks, with their memberships and engine-map entries, until it is 1/16 below the bound. Forgotten
memberships and blocks are counted; a forgotten fact is a miss, never a wrong hit. Note that when
forgetting happens, which blocks are forgotten depends on the order in which publishers' batches
arrived.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from nexuskv.contracts.kv_events import AllCleared, BlockRemoved, BlockStored, KvEventBatch, PublisherIdentity, Snapshot
from nexuskv.descriptor import Tier
from nexuskv.entries import EntryLocation
from nexuskv.errors import IdentityError
from nexuskv.identity import BlockKeyer, IdentityScope, digest_array, key_array
from nexuskv.index_checkpoint import CHECKPOINT_VERSION, IndexCheckpoint, PublisherCheckpoint
from nexuskv.index_checkpoint import decode as decode_checkpoint
from nexuskv.index_checkpoint import encode as encode_checkpoint
from nexuskv.keytable import KeyTable
from nexuskv.locsets import LocationSets
from nexuskv.lookup import Extent, LocationMatch, LookupResult
from nexuskv.publishers import Publishers, PublisherState, PublisherStatus

__all__ = ["GlobalIndex", "ApplyOutcome", "PublisherStatus", "IndexStats", "FORGET_POLICY", "CHECKPOINT_VERSION"]

FORGET_POLICY = "sweep"
_MIX_PUB = 0x9E3779B97F4A7C15
_MIX_MUL = 0xBF58476D1CE4E5B9
_MIX_INV = pow(_MIX_MUL, -1, 1 << 64)
_U64 = np.uint64
_MATCH_CACHE_MAX = 1 << 16


@dataclass(frozen=True, slots=True)
class ApplyOutcome:
    """What :meth:`GlobalIndex.apply` did with one batch."""

    status: Literal["applied", "duplicate", "stale"]
    block_ops: int  # blocks stored or removed by the batch (0 unless applied)
    uncertain: bool  # the publisher is uncertain after this batch


@dataclass(frozen=True, slots=True)
class IndexStats:
    """Counters since the index was built, and its current size."""

    batches_applied: int
    duplicate_batches: int
    stale_batches: int
    gaps: int
    resyncs: int
    blocks_stored: int
    blocks_removed: int
    unresolved_blocks: int  # stored blocks whose parent, or tier events whose hash, was unknown
    unknown_removals: int  # removed hashes the publisher's map did not know
    forgotten_memberships: int
    forgotten_blocks: int
    forget_policy: str
    memberships: int
    blocks: int
    publishers: int
    uncertain_publishers: int
    max_memberships: int
    nbytes: int


@dataclass(slots=True)
class _Counters:
    batches_applied: int = 0
    duplicate_batches: int = 0
    stale_batches: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    unresolved_blocks: int = 0
    unknown_removals: int = 0
    forgotten_memberships: int = 0
    forgotten_blocks: int = 0


@dataclass(frozen=True, slots=True)
class _Location:
    pid: int
    tier: Tier
    group: int
    entry: EntryLocation
    order: tuple[str, str, int]


class GlobalIndex:
    """Canonical blocks by location, per identity scope; see the module docstring."""

    def __init__(self, *, max_memberships: int = 16_000_000, secret: bytes = b"") -> None:
        if max_memberships < 1:
            raise ValueError("max_memberships must be positive")
        self.max_memberships = max_memberships
        self._secret = secret
        self._blocks = KeyTable(wide=True, values=("set", "refs"), on_move=self._blocks_moved)
        self._engine = KeyTable(wide=False, values=("ref",))
        self._sets = LocationSets()
        self._scope_ids: dict[IdentityScope, int] = {}
        self._scopes: list[IdentityScope] = []
        self._keyers: dict[tuple[int, int], BlockKeyer] = {}
        self._event_scopes: dict[tuple[PublisherIdentity, str | None, str | None, str | None], int] = {}
        self._publishers = Publishers()
        self._pubs = self._publishers.by_name
        self._pub_list = self._publishers.by_id
        self._locations: list[_Location] = []
        self._count = _Counters()
        self._match_cache: dict[tuple[int, int, bool], LocationMatch] = {}
        self._cursor = 0

    # -- applying batches -----------------------------------------------------------------------------

    def apply(self, batch: KvEventBatch) -> ApplyOutcome:
        """Apply one publisher batch (idempotent: a batch already applied is ignored)."""
        pub, admission = self._publishers.admit(batch.publisher, batch.incarnation, batch.seq)
        if admission == "stale":
            self._count.stale_batches += 1
            return ApplyOutcome("stale", 0, not pub.certain)
        if admission == "duplicate":
            self._count.duplicate_batches += 1
            return ApplyOutcome("duplicate", 0, not pub.certain)
        ops = 0
        for event in batch.events:
            if isinstance(event, BlockStored):
                ops += self._stored(pub, batch.identity, event)
            elif isinstance(event, BlockRemoved):
                ops += self._removed(pub, event)
            elif isinstance(event, AllCleared):
                self._clear(pub, None if event.tier is None else event.tier)
                if event.tier is None:
                    self._publishers.certain(pub)
            elif isinstance(event, Snapshot):
                if self._publishers.snapshot(pub, event.phase):
                    self._clear(pub, None)
        self._count.batches_applied += 1
        if self._sets.memberships > self.max_memberships:
            self._forget(self._sets.memberships - (self.max_memberships - self.max_memberships // 16))
        return ApplyOutcome("applied", ops, not pub.certain)

    def _stored(self, pub: PublisherState, identity: PublisherIdentity, event: BlockStored) -> int:
        n = len(event.engine_hashes)
        loc = self._location(pub, event.tier, event.group)
        if event.is_tier_event:
            eslots = self._engine.find(self._engine_k1(pub, event.engine_hashes), None, pub.tag)
            known = eslots[eslots >= 0]
            self._count.unresolved_blocks += n - len(known)
            if len(known):
                self._add_location(self._engine.values["ref"][known].astype(np.intp), loc)
            self._count.blocks_stored += len(known)
            return n
        scope_id = self._event_scope(identity, event)
        keyer = self._keyer(scope_id, event.block_size)
        parent = None
        if event.parent is not None:
            parent = self._engine_block_key(pub, event.parent)
            if parent is None:
                self._count.unresolved_blocks += n
                return n
        try:
            keys = digest_array(keyer.digests(event.token_ids, parent=parent, extra_keys=event.extra_keys))
        except IdentityError:
            self._count.unresolved_blocks += n
            return n
        blocks = self._find_or_insert_blocks(keys[:, 1], keys[:, 0], scope_id + 1)
        self._map_engine(pub, event.engine_hashes, blocks)
        self._add_location(blocks, loc)
        self._count.blocks_stored += n
        return n

    def _removed(self, pub: PublisherState, event: BlockRemoved) -> int:
        n = len(event.engine_hashes)
        loc = pub.locs.get((event.tier, event.group))
        eslots = self._engine.find(self._engine_k1(pub, event.engine_hashes), None, pub.tag)
        known = np.unique(eslots[eslots >= 0])
        self._count.unknown_removals += n - int((eslots >= 0).sum())
        if loc is None or len(known) == 0:
            return n
        blocks = self._engine.values["ref"][known].astype(np.intp)
        self._change_sets(blocks, lambda m, bit=1 << loc: m & ~bit)
        still = self._holds(self._blocks.values["set"][blocks], pub.mask)
        self._drop_engine(known[~still])
        self._count.blocks_removed += len(known)
        return n

    def _clear(self, pub: PublisherState, tier: Tier | None) -> None:
        mask = 0
        for (t, _group), loc in pub.locs.items():
            if tier is None or t == tier:
                mask |= 1 << loc
        if mask:
            sets = self._sets
            remap = np.arange(len(sets.masks), dtype=np.uint32)
            for sid, m in enumerate(list(sets.masks)):
                if sid and sets.refs[sid] > 0 and m & mask:
                    target = sets.intern(m & ~mask)
                    remap[sid] = target
            setcol = self._blocks.values["set"]
            for sid in np.flatnonzero(remap != np.arange(len(remap))).tolist():
                count = sets.refs[sid]
                sets.ref(int(remap[sid]), count)
                sets.ref(sid, -count)
            setcol[:] = remap[setcol]
        eslots = np.flatnonzero(self._engine.tag == pub.tag)
        if tier is not None and len(eslots):
            blocks = self._engine.values["ref"][eslots].astype(np.intp)
            eslots = eslots[~self._holds(self._blocks.values["set"][blocks], pub.mask)]
        self._drop_engine(eslots)

    # -- blocks, engine map, location sets ------------------------------------------------------------

    def _find_or_insert_blocks(self, lo: np.ndarray, hi: np.ndarray, tag: int) -> np.ndarray:
        table = self._blocks
        slots = table.find(lo, hi, tag)
        missing = np.flatnonzero(slots < 0)
        if len(missing):
            _u, first = np.unique(lo[missing], return_index=True)
            new_keys = missing[np.sort(first)]
            rehashes = table.rehashes
            new = table.insert(lo[new_keys], hi[new_keys], tag)
            table.values["set"][new] = 0
            table.values["refs"][new] = 0
            if table.rehashes != rehashes or len(new_keys) != len(missing):
                slots = table.find(lo, hi, tag)
            else:
                slots[new_keys] = new
        return slots

    def _engine_k1(self, pub: PublisherState, hashes: Sequence[int]) -> np.ndarray:
        # A bijection of the engine hash for a fixed publisher, spread over the high bits that pick
        # the bucket; the hash is recovered from it (checkpoints), so it is not stored.
        e = np.array(hashes, dtype=np.uint64) if not isinstance(hashes, np.ndarray) else hashes
        return (e ^ _U64(_MIX_PUB * pub.tag % (1 << 64))) * _U64(_MIX_MUL)

    def _engine_hashes(self, pub: PublisherState, k1: np.ndarray) -> np.ndarray:
        return (k1 * _U64(_MIX_INV)) ^ _U64(_MIX_PUB * pub.tag % (1 << 64))

    def _engine_block_key(self, pub: PublisherState, engine_hash: int) -> int | None:
        eslot = self._engine.find(self._engine_k1(pub, (engine_hash,)), None, pub.tag)[0]
        if eslot < 0:
            return None
        b = int(self._engine.values["ref"][eslot])
        return (int(self._blocks.k2[b]) << 64) | int(self._blocks.k1[b])

    def _map_engine(self, pub: PublisherState, hashes: Sequence[int], blocks: np.ndarray) -> None:
        k1 = self._engine_k1(pub, hashes)
        _u, first = np.unique(k1, return_index=True)
        if len(first) != len(k1):  # the same engine hash twice in one event: the last one wins
            last = len(k1) - 1 - np.unique(k1[::-1], return_index=True)[1]
            k1, blocks = k1[last], blocks[last]
        eslots = self._engine.find(k1, None, pub.tag)
        refcol = self._blocks.values["refs"]
        old = eslots >= 0
        if old.any():
            have = eslots[old]
            prev = self._engine.values["ref"][have].astype(np.intp)
            moved = prev != blocks[old]
            if moved.any():  # an engine hash now names another block: forget the old one here
                self._change_sets(prev[moved], lambda m, mask=pub.mask: m & ~mask)
                self._engine.values["ref"][have[moved]] = blocks[old][moved]
                np.add.at(refcol, blocks[old][moved], 1)
                self._unref_blocks(prev[moved])
        new = ~old
        if new.any():
            slots = self._engine.insert(k1[new], None, pub.tag)
            self._engine.values["ref"][slots] = blocks[new]
            np.add.at(refcol, blocks[new], 1)

    def _drop_engine(self, eslots: np.ndarray) -> None:
        if len(eslots) == 0:
            return
        blocks = self._engine.values["ref"][eslots].astype(np.intp)
        self._engine.delete(eslots)
        self._unref_blocks(blocks)

    def _unref_blocks(self, blocks: np.ndarray) -> None:
        refcol = self._blocks.values["refs"]
        np.subtract.at(refcol, blocks, 1)
        gone = np.unique(blocks[refcol[blocks] == 0])
        if len(gone):
            self._change_sets(gone, lambda m: 0)
            self._blocks.delete(gone)

    def _blocks_moved(self, remap: np.ndarray) -> None:
        eslots = self._engine.slots()
        refs = self._engine.values["ref"]
        refs[eslots] = remap[refs[eslots].astype(np.intp)]

    def _add_location(self, blocks: np.ndarray, loc: int) -> None:
        self._change_sets(blocks, lambda m, bit=1 << loc: m | bit)

    def _change_sets(self, blocks: np.ndarray, change: Any) -> None:
        blocks = np.unique(blocks)
        setcol = self._blocks.values["set"]
        setcol[blocks] = self._sets.transform(setcol[blocks], change)

    def _holds(self, set_ids: np.ndarray, mask: int) -> np.ndarray:
        """Per entry: does the set share a bit with ``mask``?"""
        uniq, inverse = np.unique(set_ids, return_inverse=True)
        masks = self._sets.masks
        return np.array([masks[s] & mask != 0 for s in uniq.tolist()], np.bool_)[inverse]

    def _location(self, pub: PublisherState, tier: Tier, group: int) -> int:
        loc = pub.locs.get((tier, group))
        if loc is None:
            loc = len(self._locations)
            entry = EntryLocation(worker=pub.name, tier=tier, group=group)
            self._locations.append(_Location(pub.pid, tier, group, entry, (pub.name, tier.value, group)))
            pub.locs[(tier, group)] = loc
            pub.mask |= 1 << loc
        return loc

    def _forget(self, excess: int) -> None:
        table = self._blocks
        setcol = table.values["set"]
        sizes = np.array([len(x) for x in self._sets.locs], np.int64)
        live = table.slots()
        start = self._cursor % table.capacity
        order = np.concatenate((live[live >= start], live[live < start]))
        held = sizes[setcol[order]]
        upto = int(np.searchsorted(np.cumsum(held), excess)) + 1
        gone = np.sort(order[:upto])
        if len(gone) == 0:
            return
        self._cursor = int(order[min(upto, len(order)) - 1]) + 1
        self._count.forgotten_memberships += int(held[:upto].sum())
        self._count.forgotten_blocks += len(gone)
        eslots = self._engine.slots()
        refs = self._engine.values["ref"][eslots].astype(np.intp)
        self._engine.delete(eslots[np.isin(refs, gone)])
        self._change_sets(gone, lambda m: 0)
        table.values["refs"][gone] = 0
        table.delete(gone)

    # -- scopes ----------------------------------------------------------------------------------------

    def _scope_id(self, scope: IdentityScope, *, create: bool) -> int | None:
        sid = self._scope_ids.get(scope)
        if sid is None and create:
            sid = len(self._scopes)
            self._scopes.append(scope)
            self._scope_ids[scope] = sid
        return sid

    def _event_scope(self, identity: PublisherIdentity, event: BlockStored) -> int:
        key = (identity, event.tenant_namespace, event.lora, event.cache_salt)
        sid = self._event_scopes.get(key)
        if sid is None:
            scope = IdentityScope(
                tenant_namespace=event.tenant_namespace or identity.tenant_namespace,
                model=identity.model, model_revision=identity.model_revision,
                tokenizer_revision=identity.tokenizer_revision, descriptor_id=identity.descriptor_id,
                lora=event.lora, cache_salt=event.cache_salt,
            )
            sid = self._scope_id(scope, create=True)
            if len(self._event_scopes) > 4096:
                self._event_scopes.clear()
            self._event_scopes[key] = sid
        return sid

    def _keyer(self, scope_id: int, block_size: int) -> BlockKeyer:
        keyer = self._keyers.get((scope_id, block_size))
        if keyer is None:
            keyer = BlockKeyer(self._scopes[scope_id], block_size, self._secret)
            self._keyers[(scope_id, block_size)] = keyer
        return keyer

    # -- lookups ---------------------------------------------------------------------------------------

    def lookup(self, scope: IdentityScope, keys: Sequence[int] | np.ndarray) -> LookupResult:
        """Matches for canonical ``keys`` (block 0 first; ints, or an ``(n, 2)`` uint64 array from
        :func:`~nexuskv.identity.key_array` / :func:`~nexuskv.identity.digest_array`) in ``scope``."""
        arr = key_array(keys)
        sid = self._scope_ids.get(scope)
        if sid is None or len(arr) == 0:
            return LookupResult(num_blocks=len(arr), matches=())
        slots = self._blocks.find(np.ascontiguousarray(arr[:, 1]), np.ascontiguousarray(arr[:, 0]), sid + 1)
        ids = np.take(self._blocks.values["set"], slots)
        ids[slots < 0] = 0
        return LookupResult(num_blocks=len(arr), matches=self._matches(ids))

    def lookup_tokens(self, scope: IdentityScope, token_ids: Sequence[int] | np.ndarray,
                      block_size: int) -> LookupResult:
        """As :meth:`lookup`, keying the full blocks of ``token_ids`` first."""
        sid = self._scope_ids.get(scope)
        if sid is None:
            return LookupResult(num_blocks=len(token_ids) // block_size, matches=())
        return self.lookup(scope, digest_array(self._keyer(sid, block_size).digests(token_ids)))

    def _matches(self, ids: np.ndarray) -> tuple[LocationMatch, ...]:
        n = len(ids)
        change = np.flatnonzero(ids[1:] != ids[:-1]) + 1
        if len(change) == 0 and ids[0] == 0:
            return ()
        starts = [0, *change.tolist()]
        ends = [*starts[1:], n]
        run_ids = ids[starts].tolist()
        locs_of = self._sets.locs
        runs: dict[int, list[list[int]]] = {}
        for s, e, sid in zip(starts, ends, run_ids):
            if sid:
                for loc in locs_of[sid]:
                    got = runs.get(loc)
                    if got is None:
                        runs[loc] = [[s, e]]
                    elif got[-1][1] == s:
                        got[-1][1] = e
                    else:
                        got.append([s, e])
        out = []
        for loc, got in runs.items():
            prefix = got[0][1] if got[0][0] == 0 else 0
            rest = got[1:] if prefix else got
            out.append(self._match(loc, prefix, tuple(Extent(s, e) for s, e in rest)))
        if len(out) > 1:
            out.sort(key=lambda m: (m.location.worker, m.location.tier.value, m.location.group))
        return tuple(out)

    def _match(self, loc: int, prefix: int, extents: tuple[Extent, ...]) -> LocationMatch:
        where = self._locations[loc]
        pub = self._pub_list[where.pid]
        if extents:
            return LocationMatch(where.entry, pub.name, prefix, extents, pub.certain)
        key = (loc, prefix, pub.certain)
        hit = self._match_cache.get(key)
        if hit is None:
            if len(self._match_cache) >= _MATCH_CACHE_MAX:
                self._match_cache.clear()
            hit = self._match_cache[key] = LocationMatch(where.entry, pub.name, prefix, (), pub.certain)
        return hit

    # -- inspection ------------------------------------------------------------------------------------

    def publisher_status(self, publisher: str) -> PublisherStatus | None:
        pub = self._pubs.get(publisher)
        if pub is None:
            return None
        return pub.status()

    def publishers(self) -> tuple[str, ...]:
        return tuple(self._pubs)

    @property
    def memberships(self) -> int:
        return self._sets.memberships

    @property
    def nbytes(self) -> int:
        """Bytes held: both tables' arrays plus an estimate of the Python-side tables."""
        python_side = self._sets.nbytes() + 600 * len(self._pub_list) + 400 * len(self._locations)
        return self._blocks.nbytes + self._engine.nbytes + python_side + 2000 * len(self._scopes)

    def stats(self) -> IndexStats:
        c = self._count
        return IndexStats(
            batches_applied=c.batches_applied, duplicate_batches=c.duplicate_batches, stale_batches=c.stale_batches,
            gaps=self._publishers.gaps, resyncs=self._publishers.resyncs, blocks_stored=c.blocks_stored,
            blocks_removed=c.blocks_removed,
            unresolved_blocks=c.unresolved_blocks, unknown_removals=c.unknown_removals,
            forgotten_memberships=c.forgotten_memberships, forgotten_blocks=c.forgotten_blocks,
            forget_policy=FORGET_POLICY, memberships=self._sets.memberships, blocks=self._blocks.live,
            publishers=len(self._pubs), uncertain_publishers=sum(not p.certain for p in self._pub_list),
            max_memberships=self.max_memberships, nbytes=self.nbytes,
        )

    def facts(self) -> dict[tuple[str, Tier, int], set[tuple[IdentityScope, int]]]:
        """Every membership as ``{(publisher, tier, group): {(scope, key), ...}}`` (for tests and
        audits; it builds Python objects for every membership)."""
        out: dict[tuple[str, Tier, int], set[tuple[IdentityScope, int]]] = {}
        table = self._blocks
        slots = table.slots()
        setcol = table.values["set"][slots]
        keep = setcol != 0
        slots, setcol = slots[keep], setcol[keep]
        keys = [(int(h) << 64) | int(lo) for h, lo in zip(table.k2[slots].tolist(), table.k1[slots].tolist())]
        scopes = (table.tag[slots] - 1).tolist()
        for key, scope, sid in zip(keys, scopes, setcol.tolist()):
            for loc in self._sets.locs[sid]:
                where = self._locations[loc]
                out.setdefault((self._pub_list[where.pid].name, where.tier, where.group), set()).add(
                    (self._scopes[scope], key))
        return out

    # -- checkpoints -----------------------------------------------------------------------------------

    def checkpoint(self, publishers: Sequence[str]) -> bytes:
        """The complete state of ``publishers`` (facts, engine maps, sequence and certainty) as bytes.

        :meth:`restore` of these bytes into any index reproduces exactly these publishers' facts
        and answers; the stream worker writes one per partition (``streams/index_worker.py``).
        The format is :mod:`nexuskv.index_checkpoint`.
        """
        scopes: dict[int, int] = {}
        out = []
        setcol = self._blocks.values["set"]
        for name in publishers:
            pub = self._pubs.get(name)
            if pub is None:
                continue
            eslots = np.flatnonzero(self._engine.tag == pub.tag)
            blocks = self._engine.values["ref"][eslots].astype(np.intp)
            local = np.array([scopes.setdefault(int(t) - 1, len(scopes)) for t in self._blocks.tag[blocks].tolist()],
                             np.uint32)
            sets = setcol[blocks]
            out.append(PublisherCheckpoint(
                name=name, incarnation=pub.incarnation, next_seq=pub.next_seq, certain=pub.certain,
                reason=pub.reason, in_snapshot=pub.in_snapshot, snapshot_clean=pub.snapshot_clean,
                locations=tuple(pub.locs),
                held=tuple(np.flatnonzero(self._holds(sets, 1 << loc)).astype(np.uint32) for loc in pub.locs.values()),
                engine_hashes=self._engine_hashes(pub, self._engine.k1[eslots]),
                key_lo=self._blocks.k1[blocks], key_hi=self._blocks.k2[blocks], scope=local))
        scope_list = [self._scopes[sid] for sid, _ in sorted(scopes.items(), key=lambda kv: kv[1])]
        return encode_checkpoint(IndexCheckpoint(tuple(scope_list), tuple(out)))

    def restore(self, data: bytes) -> tuple[str, ...]:
        """Load a :meth:`checkpoint`, replacing whatever this index held for its publishers."""
        cp = decode_checkpoint(data)
        scope_ids = [self._scope_id(s, create=True) for s in cp.scopes]
        names = []
        for item in cp.publishers:
            name = item.name
            pub = self._pubs.get(name)
            if pub is None:
                pub = self._publishers.add(name)
            else:
                self._clear(pub, None)
            pub.incarnation, pub.next_seq = item.incarnation, item.next_seq
            pub.certain, pub.reason = item.certain, item.reason
            pub.in_snapshot, pub.snapshot_clean = item.in_snapshot, item.snapshot_clean
            lo, hi, local = item.key_lo, item.key_hi, item.scope
            for j in np.unique(local).tolist():
                rows = np.flatnonzero(local == j)
                self._find_or_insert_blocks(lo[rows], hi[rows], scope_ids[j] + 1)
            # Found again after every insert: an insert may have rehashed the table (slots move).
            blocks = self._blocks.find(lo, hi, np.array([scope_ids[j] + 1 for j in local.tolist()], np.uint32))
            self._map_engine(pub, item.engine_hashes, blocks)
            for (tier, group), rows in zip(item.locations, item.held):
                loc = self._location(pub, tier, group)
                if len(rows):
                    self._add_location(blocks[rows], loc)
            names.append(name)
        return tuple(names)
