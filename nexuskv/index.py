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
in some tier: an entry whose block the publisher no longer holds anywhere is gone, whichever
way the block left (removal, clear, another hash taking its place, forgetting).

**Pre-keyed blocks.** Version 2 batches (:class:`~nexuskv.contracts.keyed_events.KeyedBatch`) and
:class:`KeyedBlocks` events carry canonical keys computed at the edge (16 bytes each) instead of
token ids: the index stores them as given, with no parent to resolve and no token to touch (the
publisher vouches for them; :mod:`nexuskv.contracts.keyed_events`). Their tier events and
removals name blocks by engine hash, as version 1's do, through the same per-publisher map.
:meth:`GlobalIndex.apply` takes either version; :meth:`GlobalIndex.apply_events` takes
:class:`KeyedBlocks` beside both versions' events.

**Scope isolation.** Every block is stored under its scope and found only by a lookup in that
same scope: a caller of one tenant that presents another tenant's keys gets misses, and the
same work as for keys that exist nowhere (the core mixes each key with its scope's salt before
it picks a bucket, so a foreign key probes an unrelated bucket; :mod:`nexuskv.index_core`).

**Scoping of removals.** A removal touches one publisher's one (tier, group); a clear one
publisher's facts (one tier's, when the clear names a tier). Another publisher's or another
tier's memberships of the same block are left alone (the property tests check it).

**Sequence and incarnation** are :mod:`nexuskv.publishers`' business: a duplicate or stale batch
is ignored; a gap, a late first sight or a new incarnation makes the publisher *uncertain* (every
match it contributes is ``certain=False``, a miss for the planner) until it resyncs with a full
``AllCleared`` or a clean ``Snapshot``. **Checkpoints** (one per stream partition) are in the
format of :mod:`nexuskv.index_checkpoint`.

**Memory.** The storage is :mod:`nexuskv.index_core`'s native core (128-bit mixed key, scope,
location-set id and slot generation per table slot, a 16-byte entry per engine hash, a 4-byte
member-list entry per membership; tables kept between 60% and 90% full). It is required: an index
built where ``nexuskv._native`` is missing raises :class:`~nexuskv.index_core.NativeUnavailable`,
naming the build command. ``max_memberships`` bounds the (block, location) memberships; past it the
index *forgets* blocks with the ``sweep`` policy: it walks the block table from a rotating cursor
(slot order is a seeded hash order, so this is a uniform sample of blocks, whatever their age) and
drops whole blocks until it is 1/16 below the bound. Forgotten memberships and blocks are counted;
a forgotten fact is a miss, never a wrong hit. Note that when forgetting happens, which blocks are
forgotten depends on the order in which publishers' batches arrived.

**Bounded side tables.** A scope lives while it holds a block (vLLM's cache salt is per request:
every salt is a scope); past ``max_scopes`` live scopes the least recently used 1/16 of them are
forgotten with their blocks (counted as forgotten); a lookup counts as a use. Keyers are cached
for up to 256 (scope, block size) pairs (the cache is emptied when full).

**Threads.** One thread writes: :meth:`~GlobalIndex.apply`, :meth:`~GlobalIndex.apply_events`,
the ``*_steps`` generators, :meth:`~GlobalIndex.mark_uncertain`, :meth:`~GlobalIndex.checkpoint`
and :meth:`~GlobalIndex.restore` are called from one thread at a time (the event loop that
applies events), never concurrently with each other. These may be called from any other threads
at the same time as those writes (the node's index sidecar answers engine asks from a thread):

* :meth:`~GlobalIndex.lookup` and :meth:`~GlobalIndex.lookup_tokens`. The native lookup holds
  the core's read lock with the GIL released, so it sees the core between two of the writer's
  core calls: a state the index went through (the state after some of a batch's events, as
  :meth:`~GlobalIndex.apply_steps` describes). On the Python side it only reads, or does single
  dict and deque operations (atomic under the GIL): the scope's id and serial (a scope freed and
  its id reused by another scope meanwhile answers nothing, never the other scope's blocks),
  the locations and publishers (lists that only grow), the match cache (a dict emptied when
  full, replaced when a publisher's locations move to its worker), the keyer cache, and the
  deque of scope uses the writer applies to its LRU order later. Certainty is read after the
  core answered; a publisher that may have become certain meanwhile (a resync, a restore: the
  writer keeps a counter odd while one is under way) makes the lookup try again, and after
  four tries it answers with every match uncertain. So a match is reported certain only when
  its publisher was certain at the state the facts come from; a match may be reported
  uncertain that was certain an instant before (a miss is always safe).
* :meth:`~GlobalIndex.publisher_status`, :meth:`~GlobalIndex.publishers`,
  :attr:`~GlobalIndex.memberships`, :attr:`~GlobalIndex.nbytes` and :meth:`~GlobalIndex.stats`:
  each value is read whole, but together they are not one snapshot (counters may be mid-batch).

Not safe concurrently with writes: :meth:`~GlobalIndex.facts` (a scope it names may be freed
meanwhile), and any second writer.

**Cost.** Every operation costs what it touches: a store, removal or tier event its blocks; a
clear the memberships it removes (per-location member lists), never the whole index; a lookup
its keys. Growing a table (1.5x at a time) is the exception: amortised, but the one apply that
triggers it pays for the rebuild — ~80 ms of CPU at 1M blocks here, in proportion beyond —
unless ``expected_blocks`` sized the block table up front.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict, deque
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from nexuskv.contracts.keyed_events import Cleared, KeyedBatch, KeyedStored, Removed, SnapshotMark, TierStored
from nexuskv.contracts.kv_events import (
    MAX_BLOCKS_PER_EVENT,
    AllCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    PublisherIdentity,
    Snapshot,
)
from nexuskv.descriptor import Tier
from nexuskv.entries import EntryLocation
from nexuskv.errors import IdentityError
from nexuskv.identity import KEY_BYTES, BlockKeyer, IdentityScope
from nexuskv.index_checkpoint import CHECKPOINT_VERSION, IndexCheckpoint, PublisherCheckpoint
from nexuskv.index_checkpoint import decode as decode_checkpoint
from nexuskv.index_checkpoint import encode as encode_checkpoint
from nexuskv.index_core import make_core
from nexuskv.lookup import Extent, LocationMatch, LookupResult
from nexuskv.publishers import Publishers, PublisherState, PublisherStatus

__all__ = ["GlobalIndex", "ApplyOutcome", "PublisherStatus", "IndexStats", "KeyedBlocks", "FORGET_POLICY",
           "CHECKPOINT_VERSION"]

FORGET_POLICY = "sweep"
_MATCH_CACHE_MAX = 1 << 16
_KEYER_CACHE_MAX = 256
_EVENT_SCOPE_CACHE_MAX = 256
_TOUCHES_MAX = 1 << 14  # scope uses not yet applied to the LRU order (lookups in other threads while the writer idles)
_TOUCHES_DRAIN = 1 << 10  # the writer applies them to the LRU order past this many
_LOOKUP_TRIES = 4  # a lookup that overlapped a publisher becoming certain this many times answers uncertain
MAX_SCOPES = 65_535  # the core stores scope ids in 16 bits


_EVENT_TYPES = frozenset((BlockStored, BlockRemoved, AllCleared, Snapshot, KeyedStored, TierStored, Removed, Cleared,
                          SnapshotMark))


@dataclass(frozen=True, slots=True)
class KeyedBlocks:
    """Stored blocks whose canonical keys were computed at the edge: no token ids, no parent.

    ``keys``: ``n`` 16-byte big-endian digests (:meth:`BlockKeyer.digests` joined), or an
    ``(n, 2)`` uint64 array [high, low]. ``engine_hashes``: ``n`` ints, ``n * 8`` little-endian
    bytes, or a uint64 array. The scope is the batch identity's with the overrides given here,
    as for :class:`~nexuskv.contracts.kv_events.BlockStored`.
    """

    engine_hashes: Sequence[int] | bytes | np.ndarray
    keys: bytes | np.ndarray
    tier: Tier = Tier.GPU
    group: int = 0
    tenant_namespace: str | None = None
    lora: str | None = None
    cache_salt: str | None = None

    def __len__(self) -> int:
        keys = self.keys
        return len(keys) // KEY_BYTES if isinstance(keys, (bytes, bytearray, memoryview)) else len(keys)

    def check(self) -> None:
        n = len(self)
        hashes = self.engine_hashes
        m = len(hashes) // 8 if isinstance(hashes, (bytes, bytearray, memoryview)) else len(hashes)
        if isinstance(self.keys, (bytes, bytearray, memoryview)) and len(self.keys) % KEY_BYTES:
            raise ValueError(f"KeyedBlocks.keys: {len(self.keys)} bytes is not a whole number of 16-byte keys")
        if not 1 <= n <= MAX_BLOCKS_PER_EVENT or n != m:
            raise ValueError(f"KeyedBlocks: {n} keys for {m} engine hashes (1 to {MAX_BLOCKS_PER_EVENT} each)")
        if not 0 <= self.group <= 1024:
            raise ValueError(f"KeyedBlocks.group: {self.group} is not in [0, 1024]")


@dataclass(frozen=True, slots=True)
class ApplyOutcome:
    """What :meth:`GlobalIndex.apply` did with one batch."""

    status: Literal["applied", "duplicate", "stale", "refused"]
    block_ops: int  # blocks stored or removed by the batch (0 unless applied)
    uncertain: bool  # the publisher is uncertain after this batch


@dataclass(frozen=True, slots=True)
class IndexStats:
    """Counters since the index was built, and its current size."""

    batches_applied: int
    duplicate_batches: int
    stale_batches: int
    refused_batches: int  # beyond the bounded sequence or incarnation jump (nexuskv.publishers)
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
    scopes: int = 0  # live identity scopes (each holds at least one block)
    forgotten_scopes: int = 0  # scopes forgotten past max_scopes
    backend: str = "native"
    core_nbytes: int = 0  # the storage core's share of nbytes (native: exactly its allocated capacity)


@dataclass(slots=True)
class _Counters:
    batches_applied: int = 0
    duplicate_batches: int = 0
    stale_batches: int = 0
    refused_batches: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    unresolved_blocks: int = 0
    unknown_removals: int = 0
    forgotten_memberships: int = 0
    forgotten_blocks: int = 0
    forgotten_scopes: int = 0


@dataclass(frozen=True, slots=True)
class _Location:
    pid: int
    tier: Tier
    group: int
    entry: EntryLocation
    order: tuple[str, str, int]


def _derive(secret: bytes, seed: bytes | None) -> tuple[bytes, bytes]:
    """(core seed, scope-salt key): from ``seed`` when given, else from the identity secret."""
    base = seed if seed is not None else hashlib.blake2b(secret, digest_size=32, person=b"nexuskv-ixseed").digest()
    core_seed = hashlib.blake2b(base, digest_size=32, person=b"nexuskv-ixcore").digest()
    salt_key = hashlib.blake2b(base, digest_size=32, person=b"nexuskv-ixsalt").digest()
    return core_seed, salt_key


class GlobalIndex:
    """Canonical blocks by location, per identity scope; see the module docstring.

    ``seed``: randomness for the tables' hash functions and the scopes' salts (services pass
    ``os.urandom(32)``; default: derived from ``secret``). ``max_scopes``: live identity scopes kept before the least recently used
    are forgotten. ``expected_blocks``: size the block table for that many blocks up front (about
    40 bytes each, allocated lazily by the OS), so no apply below it pays for growing the table.
    """

    def __init__(self, *, max_memberships: int = 16_000_000, secret: bytes = b"", seed: bytes | None = None,
                 max_scopes: int = MAX_SCOPES, expected_blocks: int = 0) -> None:
        if max_memberships < 1:
            raise ValueError("max_memberships must be positive")
        if not 1 <= max_scopes <= MAX_SCOPES:
            raise ValueError(f"max_scopes must be in [1, {MAX_SCOPES}]")
        self.max_memberships = max_memberships
        self.max_scopes = max_scopes
        self._secret = secret
        core_seed, self._salt_key = _derive(secret, seed)
        self._core = make_core(core_seed)
        if expected_blocks > 0:
            self._core.presize(expected_blocks)
        self._scope_ids: dict[IdentityScope, tuple[int, int]] = {}  # scope -> (core scope id, its serial)
        self._scopes: dict[int, IdentityScope] = {}
        self._scope_lru: OrderedDict[int, None] = OrderedDict()  # the writer's alone
        self._touched: deque[int] = deque(maxlen=_TOUCHES_MAX)  # scope uses, in order, for _scope_lru
        self._keyers: dict[tuple[IdentityScope, int], BlockKeyer] = {}
        self._event_scopes: dict[tuple[PublisherIdentity, str | None, str | None, str | None], IdentityScope] = {}
        self._publishers = Publishers()
        self._pubs = self._publishers.by_name
        self._pub_list = self._publishers.by_id
        self._locations: list[_Location] = []
        self._core_publishers = 0
        self._count = _Counters()
        self._match_cache: dict[tuple[int, int, bool], LocationMatch] = {}
        # Odd while a publisher may become certain (a resync, a restore): a lookup that overlaps
        # it tries again, so it never reports facts from before the resync as certain.
        self._epoch = 0

    # -- applying batches -----------------------------------------------------------------------------

    def apply(self, batch: KvEventBatch | KeyedBatch) -> ApplyOutcome:
        """Apply one publisher batch (idempotent: a batch already applied is ignored)."""
        return self.apply_events(batch.publisher, batch.incarnation, batch.seq, batch.identity, batch.events)

    def apply_events(self, publisher: str, incarnation: int, seq: int, identity: PublisherIdentity,
                     events: Iterable[Any]) -> ApplyOutcome:
        """As :meth:`apply`, for a batch given by its parts; ``events`` may also hold
        :class:`KeyedBlocks` (checked before anything is applied)."""
        steps = self.apply_event_steps(publisher, incarnation, seq, identity, events)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def apply_steps(self, batch: KvEventBatch | KeyedBatch) -> Generator[int, None, ApplyOutcome]:
        """:meth:`apply`, one event at a time: yields after each event (the block operations so
        far) and returns the outcome. Between steps the index holds the batch's first events'
        effect, a state the publisher itself went through, so lookups in between are answered
        correctly for that moment; a caller (the replicas, the index worker) uses the pauses to let
        other work run, so that no batch holds its event loop for long. Drive it to the end before
        applying or checkpointing anything else."""
        return self.apply_event_steps(batch.publisher, batch.incarnation, batch.seq, batch.identity, batch.events)

    def apply_event_steps(self, publisher: str, incarnation: int, seq: int, identity: PublisherIdentity,
                          events: Iterable[Any]) -> Generator[int, None, ApplyOutcome]:
        """:meth:`apply_events`, one event at a time (as :meth:`apply_steps`)."""
        events = tuple(events)
        for event in events:
            if isinstance(event, KeyedBlocks):
                event.check()
            elif type(event) not in _EVENT_TYPES:
                raise TypeError(f"not a kv event: {type(event).__name__}")
        pub, admission = self._publishers.admit(publisher, incarnation, seq)
        self._sync_publishers()
        if pub is None or admission == "refused":
            self._count.refused_batches += 1
            return ApplyOutcome("refused", 0, pub is None or not pub.certain)
        if admission == "stale":
            self._count.stale_batches += 1
            return ApplyOutcome("stale", 0, not pub.certain)
        if admission == "duplicate":
            self._count.duplicate_batches += 1
            return ApplyOutcome("duplicate", 0, not pub.certain)
        worker = identity.worker
        if worker is not None and worker != pub.worker and publisher.startswith(worker + "/"):
            self._locate_at(pub, worker)
        ops = 0
        for event in events:
            kind = type(event)
            if kind is KeyedStored or kind is KeyedBlocks:
                ops += self._stored_keys(pub, identity, event)
            elif kind is Removed or kind is BlockRemoved:
                ops += self._removed(pub, event)
            elif kind is TierStored:
                ops += self._stored_tier(pub, event)
            elif kind is BlockStored:
                ops += self._stored(pub, identity, event)
            elif kind is AllCleared or kind is Cleared:
                self._clear(pub, event.tier)
                if event.tier is None:
                    self._epoch += 1
                    self._publishers.certain(pub)
                    self._epoch += 1
            elif kind is Snapshot or kind is SnapshotMark:
                if event.phase == "end":  # may resync
                    self._epoch += 1
                    self._publishers.snapshot(pub, "end")
                    self._epoch += 1
                elif self._publishers.snapshot(pub, event.phase):
                    self._clear(pub, None)
            yield ops
        self._count.batches_applied += 1
        self._bound()
        return ApplyOutcome("applied", ops, not pub.certain)

    def mark_uncertain(self, publishers: Sequence[str], reason: str) -> int:
        """Make ``publishers`` uncertain (their facts stay, every match is ``certain=False``) until
        each resyncs; for a caller that knows their record history is incomplete (an event log cut
        by retention). Returns how many were known."""
        n = 0
        for name in publishers:
            pub = self._pubs.get(name)
            if pub is not None:
                self._publishers.uncertain(pub, reason)
                n += 1
        return n

    def _sync_publishers(self) -> None:
        """Give the core every publisher :class:`~nexuskv.publishers.Publishers` added (same dense ids)."""
        while self._core_publishers < len(self._pub_list):
            assert self._core.add_publisher() == self._pub_list[self._core_publishers].pid
            self._core_publishers += 1

    def _stored(self, pub: PublisherState, identity: PublisherIdentity, event: BlockStored) -> int:
        if event.is_tier_event:
            return self._stored_tier(pub, event)
        n = len(event.engine_hashes)
        loc = self._location(pub, event.tier, event.group)
        scope = self._event_scope(identity, event.tenant_namespace, event.lora, event.cache_salt)
        parent = None
        if event.parent is not None:
            raw = self._core.parent_key(pub.pid, event.parent)
            if raw is None:
                self._count.unresolved_blocks += n
                return n
            parent = int.from_bytes(raw, "big")
        try:
            keys = b"".join(self._keyer(scope, event.block_size).digests(event.token_ids, parent=parent,
                                                                          extra_keys=event.extra_keys))
        except IdentityError:
            self._count.unresolved_blocks += n
            return n
        self._core.store(pub.pid, loc, self._scope_id(scope, create=True), keys, event.engine_hashes)
        self._count.blocks_stored += n
        return n

    def _stored_tier(self, pub: PublisherState, event: BlockStored | TierStored) -> int:
        """Blocks the publisher announced, now also in ``event.tier`` (resolved by engine hash)."""
        hashes = event.engine_hashes
        n = len(hashes) // 8 if isinstance(hashes, bytes) else len(hashes)
        loc = self._location(pub, event.tier, event.group)
        known = self._core.store_tier(pub.pid, loc, hashes)
        self._count.unresolved_blocks += n - known
        self._count.blocks_stored += known
        return n

    def _stored_keys(self, pub: PublisherState, identity: PublisherIdentity, event: KeyedBlocks | KeyedStored) -> int:
        loc = self._location(pub, Tier(event.tier), event.group)
        scope = self._event_scope(identity, event.tenant_namespace, event.lora, event.cache_salt)
        n = self._core.store(pub.pid, loc, self._scope_id(scope, create=True), event.keys, event.engine_hashes)
        self._count.blocks_stored += n
        return n

    def _removed(self, pub: PublisherState, event: BlockRemoved | Removed) -> int:
        hashes = event.engine_hashes
        n = len(hashes) // 8 if isinstance(hashes, bytes) else len(hashes)
        loc = pub.locs.get((event.tier, event.group))
        known = self._core.remove(pub.pid, loc, event.engine_hashes)
        self._count.unknown_removals += n - known
        if loc is not None:
            self._count.blocks_removed += known
        return n

    def _clear(self, pub: PublisherState, tier: Tier | None) -> None:
        locs = [loc for (t, _g), loc in pub.locs.items() if tier is None or t == tier]
        self._core.clear(pub.pid, locs, tier is None)

    def _location(self, pub: PublisherState, tier: Tier, group: int) -> int:
        loc = pub.locs.get((tier, group))
        if loc is None:
            loc = self._core.add_location(pub.pid)
            assert loc == len(self._locations)
            entry = EntryLocation(worker=pub.worker or pub.name, tier=tier, group=group)
            self._locations.append(_Location(pub.pid, tier, group, entry, (pub.name, tier.value, group)))
            pub.locs[(tier, group)] = loc
        return loc

    def _locate_at(self, pub: PublisherState, worker: str) -> None:
        """The publisher's locations are ``worker``'s (its identity says so; see ``PublisherIdentity.worker``)."""
        pub.worker = worker
        for i in pub.locs.values():
            old = self._locations[i]
            entry = EntryLocation(worker=worker, tier=old.entry.tier, group=old.entry.group)
            self._locations[i] = dataclasses.replace(old, entry=entry)
        # The cached matches name the old worker. A new cache, after the new entries: a lookup
        # that still fills the old one reads entries that may be old too, and is not cached here.
        self._match_cache = {}

    # -- bounds ----------------------------------------------------------------------------------------

    def _forget_scopes(self) -> None:
        """Forget the least recently used 1/16 of the scopes (and their blocks)."""
        self._drain_touches()
        drop = max(1, self.max_scopes // 16) + max(0, len(self._scopes) - self.max_scopes)
        victims = [sid for sid, _ in zip(self._scope_lru, range(drop))]
        m, b = self._core.forget_scopes(victims)
        self._count.forgotten_memberships += m
        self._count.forgotten_blocks += b
        self._count.forgotten_scopes += len(victims)
        self._release_empty_scopes()

    def _release_empty_scopes(self) -> None:
        core = self._core
        empty = core.take_empty_scopes()
        if empty:
            self._drain_touches()  # before an id is freed: its uses must not count for a later owner
        for sid in empty:
            if core.release_scope(sid):
                scope = self._scopes.pop(sid, None)
                self._scope_lru.pop(sid, None)
                if scope is not None:
                    del self._scope_ids[scope]

    def _bound(self) -> None:
        core = self._core
        if len(self._scopes) > self.max_scopes:
            self._forget_scopes()
        if core.memberships > self.max_memberships:
            m, b = core.forget(core.memberships - (self.max_memberships - self.max_memberships // 16))
            self._count.forgotten_memberships += m
            self._count.forgotten_blocks += b
        self._release_empty_scopes()

    # -- scopes ----------------------------------------------------------------------------------------

    def _scope_id(self, scope: IdentityScope, *, create: bool) -> int | None:
        got = self._scope_ids.get(scope)
        if got is None:
            if not create:
                return None
            if len(self._scopes) >= self.max_scopes:
                self._release_empty_scopes()
                if len(self._scopes) >= self.max_scopes:
                    self._forget_scopes()
            salt = hashlib.blake2b(scope.canonical_bytes(), digest_size=16, key=self._salt_key,
                                   person=b"nexuskv-salt1").digest()
            sid, serial = self._core.add_scope(salt)
            self._drain_touches()  # the new scope is the most recent: after every earlier use
            self._scope_ids[scope] = (sid, serial)
            self._scopes[sid] = scope
            self._scope_lru[sid] = None
            return sid
        touched = self._touched
        touched.append(got[0])
        if len(touched) >= _TOUCHES_DRAIN:
            self._drain_touches()
        return got[0]

    def _drain_touches(self) -> None:
        """Apply the scope uses recorded since the last drain to the LRU order (the writer only:
        lookups, in any thread, only append to the deque)."""
        touched, lru = self._touched, self._scope_lru
        while touched:
            sid = touched.popleft()
            if sid in lru:
                lru.move_to_end(sid)

    def _event_scope(self, identity: PublisherIdentity, tenant: str | None, lora: str | None,
                     salt: str | None) -> IdentityScope:
        key = (identity, tenant, lora, salt)
        scope = self._event_scopes.get(key)
        if scope is None:
            scope = IdentityScope(
                tenant_namespace=tenant or identity.tenant_namespace,
                model=identity.model, model_revision=identity.model_revision,
                tokenizer_revision=identity.tokenizer_revision, descriptor_id=identity.descriptor_id,
                lora=lora, cache_salt=salt,
            )
            if len(self._event_scopes) >= _EVENT_SCOPE_CACHE_MAX:
                self._event_scopes.clear()
            self._event_scopes[key] = scope
        return scope

    def _keyer(self, scope: IdentityScope, block_size: int) -> BlockKeyer:
        # A plain dict emptied when full: its single operations are safe from lookup_tokens in
        # other threads, where an LRU's reorderings and evictions were not.
        key = (scope, block_size)
        keyer = self._keyers.get(key)
        if keyer is None:
            keyer = BlockKeyer(scope, block_size, self._secret)
            if len(self._keyers) >= _KEYER_CACHE_MAX:
                self._keyers.clear()
            self._keyers[key] = keyer
        return keyer

    # -- lookups ---------------------------------------------------------------------------------------

    def lookup(self, scope: IdentityScope, keys: Sequence[int] | np.ndarray | bytes) -> LookupResult:
        """Matches for canonical ``keys`` (block 0 first) in ``scope``: 128-bit ints, an ``(n, 2)``
        uint64 array [high, low] (:func:`~nexuskv.identity.key_array`,
        :func:`~nexuskv.identity.digest_array`) or ``n`` 16-byte big-endian digests as bytes."""
        raw, n = _key_input(keys)
        got = self._scope_ids.get(scope)
        if got is None or n == 0:
            return LookupResult(num_blocks=n, matches=())
        sid, serial = got
        self._touched.append(sid)  # not _scope_lru itself: another thread may be writing
        core = self._core
        for _ in range(_LOOKUP_TRIES):
            epoch = self._epoch
            found = core.lookup(sid, raw, serial)
            if found is None:  # the scope was released meanwhile: it held no block then
                return LookupResult(num_blocks=n, matches=())
            matches = self._matches(found, trusted=True)
            if not epoch & 1 and epoch == self._epoch:
                return LookupResult(num_blocks=n, matches=matches)
        return LookupResult(num_blocks=n, matches=self._matches(found, trusted=False))

    def lookup_tokens(self, scope: IdentityScope, token_ids: Sequence[int] | np.ndarray,
                      block_size: int) -> LookupResult:
        """As :meth:`lookup`, keying the full blocks of ``token_ids`` first."""
        if scope not in self._scope_ids:
            return LookupResult(num_blocks=len(token_ids) // block_size, matches=())
        return self.lookup(scope, b"".join(self._keyer(scope, block_size).digests(token_ids)))

    def _matches(self, found: list[tuple[int, int, tuple[tuple[int, int], ...]]], *,
                 trusted: bool) -> tuple[LocationMatch, ...]:
        """The core's answer as matches; ``trusted=False``: every one uncertain."""
        if not found:
            return ()
        locations, pubs, cache = self._locations, self._pub_list, self._match_cache
        out = []
        for loc, prefix, rest in found:
            where = locations[loc]
            pub = pubs[where.pid]
            certain = trusted and pub.certain  # read once: the writer may change it meanwhile
            if rest:
                out.append(LocationMatch(where.entry, pub.name, prefix, tuple(Extent(s, e) for s, e in rest),
                                         certain))
                continue
            key = (loc, prefix, certain)
            hit = cache.get(key)
            if hit is None:
                if len(cache) >= _MATCH_CACHE_MAX:
                    cache.clear()
                hit = cache[key] = LocationMatch(where.entry, pub.name, prefix, (), certain)
            out.append(hit)
        if len(out) > 1:
            out.sort(key=lambda m: (m.location.worker, m.location.tier.value, m.location.group))
        return tuple(out)

    # -- inspection ------------------------------------------------------------------------------------

    def publisher_status(self, publisher: str) -> PublisherStatus | None:
        pub = self._pubs.get(publisher)
        return None if pub is None else pub.status()

    def publishers(self) -> tuple[str, ...]:
        return tuple(self._pubs)

    @property
    def memberships(self) -> int:
        return self._core.memberships

    @property
    def nbytes(self) -> int:
        """Bytes held: the core's tables plus an estimate of the Python-side tables."""
        python_side = 600 * len(self._pub_list) + 400 * len(self._locations) + 1500 * len(self._scopes)
        return self._core.nbytes + python_side + 1200 * len(self._keyers)

    def stats(self) -> IndexStats:
        c = self._count
        return IndexStats(
            batches_applied=c.batches_applied, duplicate_batches=c.duplicate_batches, stale_batches=c.stale_batches,
            refused_batches=c.refused_batches,
            gaps=self._publishers.gaps, resyncs=self._publishers.resyncs, blocks_stored=c.blocks_stored,
            blocks_removed=c.blocks_removed,
            unresolved_blocks=c.unresolved_blocks, unknown_removals=c.unknown_removals,
            forgotten_memberships=c.forgotten_memberships, forgotten_blocks=c.forgotten_blocks,
            forget_policy=FORGET_POLICY, memberships=self._core.memberships, blocks=self._core.blocks,
            publishers=len(self._pubs), uncertain_publishers=sum(not p.certain for p in self._pub_list),
            max_memberships=self.max_memberships, nbytes=self.nbytes, scopes=len(self._scopes),
            forgotten_scopes=c.forgotten_scopes, backend="native", core_nbytes=self._core.nbytes,
        )

    def facts(self) -> dict[tuple[str, Tier, int], set[tuple[IdentityScope, int]]]:
        """Every membership as ``{(publisher, tier, group): {(scope, key), ...}}`` (for tests and
        audits; it builds Python objects for every membership)."""
        out: dict[tuple[str, Tier, int], set[tuple[IdentityScope, int]]] = {}
        for loc, sids, keys in self._core.facts():
            where = self._locations[loc]
            scopes = [self._scopes[s] for s in np.frombuffer(sids, "<u4").tolist()]
            ints = [int.from_bytes(keys[i:i + KEY_BYTES], "big") for i in range(0, len(keys), KEY_BYTES)]
            out[(self._pub_list[where.pid].name, where.tier, where.group)] = set(zip(scopes, ints))
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
        for name in publishers:
            pub = self._pubs.get(name)
            if pub is None:
                continue
            hashes, keys, sids, held = self._core.export(pub.pid)
            local = np.array([scopes.setdefault(s, len(scopes)) for s in np.frombuffer(sids, "<u4").tolist()],
                             np.uint32)
            words = np.frombuffer(keys, ">u8").reshape(-1, 2).astype(np.uint64)
            held_of = {loc: np.frombuffer(rows, "<u4").astype(np.uint32) for loc, rows in held}
            out.append(PublisherCheckpoint(
                name=name, incarnation=pub.incarnation, next_seq=pub.next_seq, certain=pub.certain,
                reason=pub.reason, in_snapshot=pub.in_snapshot, snapshot_clean=pub.snapshot_clean,
                locations=tuple(pub.locs), held=tuple(held_of[loc] for loc in pub.locs.values()),
                engine_hashes=np.frombuffer(hashes, "<u8").astype(np.uint64),
                key_lo=words[:, 1].copy(), key_hi=words[:, 0].copy(), scope=local, worker=pub.worker))
        scope_list = [self._scopes[sid] for sid, _ in sorted(scopes.items(), key=lambda kv: kv[1])]
        return encode_checkpoint(IndexCheckpoint(tuple(scope_list), tuple(out)))

    def restore(self, data: bytes) -> tuple[str, ...]:
        """Load a :meth:`checkpoint`: each of its publishers replaces what this index held for it,
        unless the index already holds that publisher at the same or a later point of its history
        (incarnation, then next sequence number): then the checkpoint's copy is older and skipped.
        So the newest state of a publisher wins whatever the order checkpoints are restored in.
        Returns the publishers restored."""
        cp = decode_checkpoint(data)
        self._epoch += 1  # publishers may become certain: concurrent lookups try again
        try:
            return self._restore(cp)
        finally:
            self._epoch += 1

    def _restore(self, cp: IndexCheckpoint) -> tuple[str, ...]:
        names = []
        for item in cp.publishers:
            pub = self._pubs.get(item.name)
            if pub is None:
                pub = self._publishers.add(item.name)
                self._sync_publishers()
            elif (pub.incarnation, pub.next_seq) >= (item.incarnation, item.next_seq):
                continue
            else:
                self._clear(pub, None)
            pub.incarnation, pub.next_seq = item.incarnation, item.next_seq
            pub.certain, pub.reason = item.certain, item.reason
            pub.in_snapshot, pub.snapshot_clean = item.in_snapshot, item.snapshot_clean
            if item.worker is not None and item.worker != pub.worker and item.name.startswith(item.worker + "/"):
                self._locate_at(pub, item.worker)
            keys = np.stack((item.key_hi, item.key_lo), axis=1).astype(">u8").tobytes()
            sids = np.array([self._scope_id(cp.scopes[j], create=True) for j in item.scope.tolist()], "<u4").tobytes()
            held = [(self._location(pub, tier, group), np.asarray(rows, "<u4").tobytes())
                    for (tier, group), rows in zip(item.locations, item.held)]
            self._core.restore(pub.pid, np.asarray(item.engine_hashes, "<u8").tobytes(), keys, sids, held)
            names.append(item.name)
        self._bound()
        return tuple(names)


def _key_input(keys: Sequence[int] | np.ndarray | bytes) -> tuple[Any, int]:
    """Keys as the core takes them (bytes of 16-byte digests, or an (n, 2) uint64 array), and n."""
    if isinstance(keys, np.ndarray):
        if keys.ndim != 2 or keys.shape[1] != 2 or keys.dtype != np.uint64:
            raise IdentityError(f"key array: expected shape (n, 2) of uint64, got {keys.shape} of {keys.dtype}")
        return (keys if keys.flags.c_contiguous else np.ascontiguousarray(keys)), len(keys)
    if isinstance(keys, (bytes, bytearray)):
        if len(keys) % KEY_BYTES:
            raise IdentityError(f"keys: {len(keys)} bytes is not a whole number of 16-byte keys")
        return bytes(keys), len(keys) // KEY_BYTES
    try:
        raw = b"".join([int(k).to_bytes(KEY_BYTES, "big") for k in keys])
    except (OverflowError, TypeError, ValueError) as exc:
        raise IdentityError(f"keys: each must be an int in [0, 2**128) ({exc})") from None
    return raw, len(raw) // KEY_BYTES
