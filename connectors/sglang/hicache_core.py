"""SGLang's HiCache storage tier on NexusKV's data plane, gated by the index and the planner.

:class:`HiCacheCore` is the logic of the HiCache storage backend (:mod:`connectors.sglang.hicache`
is the thin ``HiCacheStorage`` subclass SGLang loads). It keeps SGLang's contract
(``../shared/reference/engines.md`` §4.2): ``get``/``batch_get`` return a page or None,
``set``/``batch_set`` store pages, ``exists`` says whether a page can be read, ``batch_exists``
counts the consecutive readable pages from the first.

**Pages as blocks.** SGLang names a storage page by the hex SHA-256 of its token chain (the
page hash of :mod:`connectors.sglang.hashing`) and gives a storage backend no token ids. The
index keys blocks from token ids, so each page is published as a one-block sequence whose
"tokens" are the page key's eight 32-bit words, in a scope of its own (the deployment's scope
with cache salt ``sglang-hicache-page/1``): the index then keys it (tenant, model, descriptor,
identity secret), scopes it and removes it exactly like any block, and anyone holding the page
key finds it with a plain lookup. The page's canonical key is its payload's address in the data
plane. The descriptor is the rank's shard (tensor-parallel rank, SGLang's host page layout), so
ranks and layouts never read each other's bytes. What this does not give: a page is not joined
with the same tokens' GPU blocks, which are keyed from tokens — the planner and routers see
storage pages in the page scope. Pages of SGLang's other host pools (sliding window, Mamba,
DSA indexer: its ``*_v2`` calls) are named ``<page key>.<pool>`` in the same scope.

**Replicated state.** An MLA model's KV is the same on every TP rank and SGLang writes it from
one rank only (``is_storage_writer``). Every rank keys it alike (one descriptor) and a reader
rank reads what the writer (``owner``) stored: in the shared remote tier, or in the writer's
disk folder on the same host (:class:`FolderSource`).

**Facts.** The backend is a publisher (``worker``, e.g. ``sglang-hicache/10.0.0.5:30000/tp0``) of
``nexuskv.kv-events``: a stored page is a ``stored`` event in the backend's tier, a deleted or
evicted one a ``removed`` event, and a start is ``cleared`` (a new incarnation whose facts start
empty: pages left by an earlier one are found again when SGLang writes them again, for free).

**Gates.** ``exists`` and ``batch_exists`` answer from the index, never from the store alone: a
page is there when a certain fact places it in a tier this backend can read (its own tier, its
owner's, or anyone's shared remote tier). ``batch_exists`` then asks the planner whether loading
what SGLang will load beats recomputing it, and answers 0 when it does not (sglang#26305's file
tier was slower than recomputing). SGLang loads the whole prefetch, so that is what is priced:

* the pages before the call (``prefix``: SGLang's ``extra_info.prefix_keys``, already on its
  device or host) are the context the recomputation would run at — a local GPU prefix in the
  query, so recomputing ``n`` pages costs ``c1*e + c2*e*s`` at their real position ``s``;
* SGLang 0.5.18+'s hybrid controller asks for the whole span in one call; its older (and 0.5.23's
  plain) controller asks in batches of ``STORAGE_BATCH_SIZE`` pages and goes on only while a
  batch is full. A full batch is not the end of the prefetch, so it is priced as the largest
  prefetch SGLang can make from there (half its host pool, :meth:`HiCacheCore.use_host_pool`):
  answered when even that would not pay back, 0; otherwise the batch, and the next call of the
  same thread continues the run (its pages are the next batch's context when SGLang passes no
  prefix keys). The last batch is priced for what it adds. A run that turns out short has then
  loaded full batches that alone would not have paid: ``stats["answered_ahead"]`` counts them.

Without a cost profile for the model the gate is the index alone (said once in the log).

**Promises.** The pages ``batch_exists`` answers are promised: the index's answer (which holder
places each page where) is kept, and SGLang's read of those pages (``batch_get``, its ``_v1`` and
``_v2`` forms, on its I/O thread) loads them from that answer without asking the index again. A
prefetch therefore asks once (once per ``batch_exists`` call of SGLang's batching controller),
and no slow answer to a per-page ask can cut short a prefetch the backend already promised in
full (the index client's budget makes a late answer a miss: 31 and 9 of 136 promised pages loaded
before). A promise is used once, expires after :data:`PROMISE_TTL_S`, and at most
:data:`MAX_PROMISES` are kept (oldest dropped; ``stats["promises_dropped"]``); a read with no
promise asks the index, one ask for all the pages of the call. Either way ``get`` reads only what
the index vouched for, verifies the payload's checksum and address, and misses (None) when the
payload is gone or wrong — never returns stale data; a page of its own found missing or corrupt
is removed from the index. SGLang loads a prefetch's pages up to the first miss and recomputes
from there, so a read stops at its first miss (the pages after it are neither read nor kept
promised).

**Capacity.** A host or disk tier of the backend belongs to its
:class:`~nexuskv.dataplane.tiers.TierManager`: a ``set`` into a full tier makes room by utility
(expected gain per byte: a page read again is worth more than one never read since) and is
refused only when everything it would displace is worth more (``stats["set_refused"]``, never a
silent failure); what leaves is a ``removed`` event, what enters a ``stored`` one, both under
this backend's publisher. The shared remote tier's capacity is the store's: a full store refuses
the write (``set_failed``). SGLang's own LRU of its host pool is untouched.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from connectors.descriptors import publisher_identity
from nexuskv.admission import block_gains
from nexuskv.contracts.decisions import Action
from nexuskv.contracts.keyed_events import Cleared, KeyedBatch, KeyedEvent, KeyedStored, Removed, pack_hashes
from nexuskv.contracts.plans import WorkerLoad
from nexuskv.cost import CostModel
from nexuskv.dataplane.backend import host_view
from nexuskv.dataplane.catalog import BackendCatalog
from nexuskv.dataplane.disk import payload_file, stored_header
from nexuskv.dataplane.payload import HEADER_BYTES, PayloadHeader, PayloadKey, verify_payload
from nexuskv.dataplane.tier_facts import BlockIdentity, TierFacts, event_hash
from nexuskv.dataplane.tiers import SaveBlock, TierManager
from nexuskv.descriptor import StateDescriptor, Tier
from nexuskv.entries import EntryLocation
from nexuskv.errors import DataPlaneError, IntegrityError
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.lookup import IndexView, LocationMatch, LookupResult
from nexuskv.planner import PlanQuery, plan
from nexuskv.policy import ExecutionPolicy

__all__ = ["PAGE_SCOPE_SALT", "PAGE_WORDS", "STORAGE_BATCH_SIZE", "PROMISE_TTL_S", "MAX_PROMISES", "page_scope",
           "page_words", "page_event_hash", "FolderSource", "HiCacheCore", "folder_of"]

log = logging.getLogger("nexuskv.sglang")

PAGE_SCOPE_SALT = "sglang-hicache-page/1"
PAGE_WORDS = 8  # a 32-byte page key as eight little-endian uint32 words
#: Pages per ``batch_exists`` call of SGLang's batching controller (``hicache_storage.STORAGE_BATCH_SIZE``,
#: 128 in 0.5.10-0.5.23; read from SGLang when it is installed).
STORAGE_BATCH_SIZE = 128
#: How long a page ``batch_exists`` answered stays promised: SGLang reads a prefetch within its
#: prefetch timeout (``prefetch_timeout_base`` 1 s plus per token), far less than this.
PROMISE_TTL_S = 30.0
#: Promised pages kept at most (a prefetch holds at most half SGLang's host pool).
MAX_PROMISES = 1 << 16
_MASK64 = (1 << 64) - 1


def page_scope(descriptor: StateDescriptor) -> IdentityScope:
    """The scope storage pages of ``descriptor``'s state are keyed in (apart from token-keyed blocks)."""
    return IdentityScope.of(descriptor, cache_salt=PAGE_SCOPE_SALT)


def _digest(key: str) -> bytes:
    if len(key) == 64:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    return hashlib.sha256(key.encode("utf-8")).digest()  # a key that is not a bare page hash


def page_words(key: str) -> list[int]:
    """The page key as the eight "tokens" of its one-block sequence in the page scope."""
    raw = _digest(key)
    return [int.from_bytes(raw[i:i + 4], "little") for i in range(0, 32, 4)]


def page_event_hash(key: str) -> int:
    """The page's engine hash in its events: the first 8 bytes, as SGLang's KV events name it."""
    return int.from_bytes(_digest(key)[:8], "big")


class FolderSource:
    """Read-only access to another process's disk tier folder on this host (the writer rank's).

    It keeps no index of its own: every read takes the file as it is now (``stored_header``) and
    verifies checksum and address, so a file the owner is replacing or has deleted is a miss.
    """

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    def header(self, key: PayloadKey) -> PayloadHeader | None:
        return stored_header(self.root, key)

    def read_verified(self, key: PayloadKey, out: torch.Tensor) -> PayloadHeader:
        view = host_view(out)
        try:
            with open(payload_file(self.root, key), "rb", buffering=0) as fh:
                header = PayloadHeader.unpack(fh.read(HEADER_BYTES))
                if header.nbytes != view.nbytes:
                    raise IntegrityError(f"{key}: the file holds {header.nbytes} bytes, expected {view.nbytes}")
                got = 0
                while got < view.nbytes:
                    n = fh.readinto(view[got:])
                    if not n:
                        raise IntegrityError(f"{key}: the file is truncated at {got} bytes")
                    got += n
        except FileNotFoundError:
            raise IntegrityError(f"{key} is no longer in {self.root}") from None
        except OSError as exc:
            raise IntegrityError(f"{key}: cannot read it from {self.root}: {exc}") from None
        verify_payload(key, header, view)
        return header


class HiCacheCore:
    """One SGLang storage backend instance (one TP rank); thread-safe (SGLang calls from I/O threads)."""

    def __init__(self, descriptor: StateDescriptor, *, worker: str, catalog: BackendCatalog, tier: Tier,
                 index: IndexView, publish: Callable[[KeyedBatch], None], model: Callable[[], CostModel],
                 execution: Callable[[], ExecutionPolicy], profile: str | None = None, secret: bytes = b"",
                 clock: Callable[[], float] = time.time, incarnation: int | None = None,
                 layout: tuple[torch.dtype, tuple[int, ...]] | None = None, owner: str | None = None,
                 owner_source: FolderSource | None = None) -> None:
        self.descriptor = descriptor
        self.worker = worker
        self.owner = owner if owner is not None else worker
        self.owner_source = owner_source
        self.catalog = catalog
        self.tier = tier
        self.index = index
        self.publish = publish
        self.model = model
        self.execution = execution
        self.profile = profile
        self.clock = clock
        self.scope = page_scope(descriptor)
        self._keyer = BlockKeyer(self.scope, PAGE_WORDS, secret)
        self._identity = publisher_identity(descriptor)
        self._incarnation = incarnation if incarnation is not None else time.time_ns()
        self._lock = threading.RLock()
        # One publisher, one sequence: the tier manager's changes and this backend's own events.
        self._facts = TierFacts(worker, lambda batch: self.publish(batch), identity=self._identity,
                                incarnation=self._incarnation, clock=clock)
        where = EntryLocation(worker=worker, tier=tier)
        managed = any(not b.capabilities.shared for b in catalog.reachable(where))
        self.tiers: TierManager | None = TierManager(catalog, facts=self._facts, clock=clock,
                                                     gains=self._page_gains) if managed else None
        self._remote_own: set[int] = set()  # pages this backend wrote to the shared remote tier
        # (dtype, shape) of a page, for ``get`` without a target: from the host pool, else the first set
        self._layout = layout
        self._max_prefetch_pages: int | None = None
        self._runs: dict[int, list[int]] = {}  # thread -> canonical keys of its batched query so far
        # canonical -> (holder, when): pages batch_exists answered, read from that answer (once)
        self._promised: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self._warned = False
        self._shared = any(b.capabilities.shared for b in catalog.reachable(EntryLocation(worker=worker, tier=tier)))
        self.stats = {"set": 0, "set_failed": 0, "set_refused": 0, "hits": 0, "misses": 0, "stale_or_missing": 0,
                      "evicted": 0, "gated_by_planner": 0, "answered_ahead": 0, "promised": 0, "read_on_promise": 0,
                      "asked_at_read": 0, "promises_dropped": 0, "promises_expired": 0}
        self._facts.start(self._identity)  # a new incarnation starts with no facts (and resyncs the publisher)
        self._facts.flush()

    # -- naming -------------------------------------------------------------------------------------

    def use_layout(self, dtype: torch.dtype, shape: Sequence[int]) -> None:
        """The dtype and shape of a page (SGLang's host pool), for ``get`` without a target."""
        self._layout = (dtype, tuple(shape))

    def use_host_pool(self, max_prefetch_pages: int) -> None:
        """The most pages one SGLang prefetch can load (half its host pool): the bound a full batch is priced at."""
        self._max_prefetch_pages = max(1, int(max_prefetch_pages))

    def canonical(self, key: str) -> int:
        return self._keyer.keys(page_words(key))[0]

    def _payload_key(self, canonical: int) -> PayloadKey:
        return PayloadKey(self.descriptor.descriptor_id, canonical, 0)

    def _emit(self, events: list[KeyedEvent]) -> None:
        if not events:
            return
        self._facts.queue(events, self._identity)
        self._facts.flush()

    def _page_gains(self, key: PayloadKey, position: int, nbytes: int) -> Mapping[Tier, float]:
        """EG of reusing one page from each of this backend's managed tiers (its own position unknown:
        SGLang names pages by hash), by the current cost model."""
        d = self.descriptor
        model = self.model()
        profile = self.profile or self.execution().planner.default_hardware_profile
        tiers = [b.capabilities.tier for b in (self.tiers.backends() if self.tiers is not None else ())]
        # A page is one copy: a link fitted at this page size prices it, else the size-free prior.
        links = {t: (None if t is Tier.GPU else model.link(profile, t, Tier.GPU, nbytes if nbytes > 0 else None))
                 for t in tiers}
        usable = {t: lk for t, lk in links.items() if t is Tier.GPU or lk is not None}
        return block_gains(model.compute_for(d.model, profile), usable, block_tokens=d.block_size, position=position,
                           nbytes=nbytes)

    def _identity_of(self, key: str) -> BlockIdentity:
        return BlockIdentity(self._identity, tuple(page_words(key)), PAGE_WORDS, cache_salt=PAGE_SCOPE_SALT)

    def _readable(self, location: EntryLocation) -> bool:
        return location.tier is self.tier and (location.worker in (self.worker, self.owner) or self._shared)

    def _holders(self, canonicals: Sequence[int]) -> list[str | None]:
        """Per page: a worker whose certain fact places it in a readable tier (None: not there)."""
        if not canonicals:
            return []
        found = self.index.lookup(self.scope, canonicals)
        out: list[str | None] = [None] * len(canonicals)
        for m in found.matches:
            if not m.certain or not self._readable(m.location):
                continue
            runs = ([(0, m.prefix_blocks)] if m.prefix_blocks else []) + [(e.start, e.end) for e in m.extents]
            for start, end in runs:
                for i in range(start, min(end, len(out))):
                    if out[i] is None or m.location.worker == self.worker:
                        out[i] = m.location.worker
        return out

    def _source(self, holder: str, pk: PayloadKey):
        """The backend that serves ``pk`` as ``holder`` placed it, or None."""
        if holder == self.worker or self._shared:
            return self.catalog.source_for(EntryLocation(worker=holder, tier=self.tier), pk)
        if holder == self.owner and self.owner_source is not None:
            return self.owner_source if self.owner_source.header(pk) is not None else None
        return None

    # -- exists -----------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self._holders([self.canonical(key)])[0] is not None

    def readable_run(self, keys: Sequence[str]) -> tuple[list[int], list[str | None], int]:
        """Canonical keys, holders, and how many pages from the first the index places here."""
        canonicals = [self.canonical(k) for k in keys]
        holders = self._holders(canonicals)
        count = next((i for i, h in enumerate(holders) if h is None), len(holders))
        return canonicals, holders, count

    def batch_exists(self, keys: Sequence[str], *, prefix: Sequence[str] | None = None,
                     batched: bool = False) -> int:
        """Consecutive pages from the first that the index places here and the planner would load.

        ``prefix``: the page keys before ``keys`` (SGLang's ``prefix_keys``), None when SGLang
        does not pass them. ``batched``: the caller asks in batches of ``STORAGE_BATCH_SIZE``.
        """
        canonicals, holders, count = self.readable_run(keys)
        thread = threading.get_ident()
        run = self._runs.pop(thread, None)
        if prefix is not None:
            context = [self.canonical(k) for k in prefix]
        else:
            context = run if (batched and run is not None) else []
        if count == 0:
            return 0
        more = batched and count == len(keys) == STORAGE_BATCH_SIZE
        answer = self.gate(canonicals[:count], holders[:count], context=context, more=more)
        if more and answer:
            self.stats["answered_ahead"] += 1
            self._runs[thread] = context + canonicals
        self.promise(canonicals[:answer], holders[:answer])
        return answer

    # -- promises ---------------------------------------------------------------------------------

    def promise(self, canonicals: Sequence[int], holders: Sequence[str | None]) -> None:
        """Keep the index's answer for pages ``batch_exists`` answered: their read will not ask again."""
        now = self.clock()
        with self._lock:
            for canonical, holder in zip(canonicals, holders):
                if holder is None:
                    continue
                self._promised[canonical] = (holder, now)
                self._promised.move_to_end(canonical)
                self.stats["promised"] += 1
            while len(self._promised) > MAX_PROMISES:
                self._promised.popitem(last=False)
                self.stats["promises_dropped"] += 1

    def forget_promises(self, canonicals: Sequence[int]) -> None:
        """Drop promises that will not be read (SGLang stopped its prefetch before them)."""
        with self._lock:
            for canonical in canonicals:
                self._promised.pop(canonical, None)

    def locate(self, keys: Sequence[str]) -> list[tuple[int, str | None]]:
        """(canonical key, holder or None) per page: from its promise, else from one ask for all the rest."""
        canonicals = [self.canonical(k) for k in keys]
        holders: list[str | None] = [None] * len(keys)
        now = self.clock()
        with self._lock:
            for i, canonical in enumerate(canonicals):
                entry = self._promised.pop(canonical, None)
                if entry is None:
                    continue
                if now - entry[1] > PROMISE_TTL_S:
                    self.stats["promises_expired"] += 1
                    continue
                holders[i] = entry[0]
                self.stats["read_on_promise"] += 1
        rest = [i for i, h in enumerate(holders) if h is None]
        if rest:
            self.stats["asked_at_read"] += len(rest)
            for i, holder in zip(rest, self._holders([canonicals[i] for i in rest])):
                holders[i] = holder
        return list(zip(canonicals, holders))

    def gate(self, canonicals: list[int], holders: list[str | None], *, context: Sequence[int] = (),
             more: bool = False) -> int:
        """How many of ``canonicals`` (readable, in order) loading pays for; 0 when recomputing wins.

        ``context``: the canonical keys of the pages before them (on SGLang's device or host).
        ``more``: a full batch of a batched query, priced as the largest prefetch SGLang can make.
        """
        d = self.descriptor
        execution = self.execution()
        profile = self.profile or execution.planner.default_hardware_profile
        model = self.model()
        n = len(canonicals)
        if model.compute_for(d.model, profile) is None:
            if not self._warned:
                self._warned = True
                log.warning("no cost profile for %s on %s: batch_exists is gated by the index alone", d.model, profile)
            return n
        p = len(context)
        loaded = n
        if more and self._max_prefetch_pages is not None:
            loaded = max(n, self._max_prefetch_pages - p)
        keys = list(context) + list(canonicals)
        if loaded > n:  # the pages a longer prefetch would bring: priced, never published or read
            tail = canonicals[-1]
            keys += [(tail + 1 + i) & _MASK64 for i in range(loaded - n)]
        where = holders[0] if holders[0] is not None else self.worker
        groups = [g.kv_group for g in d.layer_groups]
        matches = [LocationMatch(EntryLocation(worker=where, tier=self.tier, group=g), where, p + loaded)
                   for g in groups]
        if p and self.tier is not Tier.GPU:
            matches += [LocationMatch(EntryLocation(worker=self.worker, tier=Tier.GPU, group=g), self.worker, p)
                        for g in groups]
        matches.sort(key=lambda m: (m.location.worker, m.location.tier, m.location.group))
        now = self.clock()
        total = p + loaded
        # The pages priced are a prefix of the prompt, whose last token lies beyond them (the engine
        # computes it itself; the planner never reuses it): one token more keeps every page reusable.
        query = PlanQuery(request_id=f"hicache-{self.worker}-{now:.6f}", scope=self.scope, descriptor=d,
                          keys=tuple(keys), prompt_tokens=total * d.block_size + 1, arrival_at=now, at_admission=False,
                          candidates=(WorkerLoad(worker=self.worker, profile=profile),))
        chosen = plan(query, LookupResult(num_blocks=total, matches=tuple(matches)), model, execution,
                      now=now).chosen
        if chosen.action in (Action.TRANSFER, Action.PREFETCH) and chosen.contiguous and chosen.moved:
            return max(0, min(chosen.moved[1] - p, n))
        if self.tier is Tier.GPU and chosen.action in (Action.FULL_REUSE, Action.PARTIAL_REUSE):
            return max(0, min(chosen.reused_blocks - p, n))  # a device tier: reused in place
        self.stats["gated_by_planner"] += 1
        return 0

    # -- get --------------------------------------------------------------------------------------

    def get(self, key: str, target: torch.Tensor | None = None) -> torch.Tensor | None:
        """The page (read into ``target`` when given), or None: not vouched for by the index, gone, or wrong.

        A miss may leave ``target`` partly written (SGLang drops the page on None).
        """
        canonical, holder = self.locate([key])[0]
        return self.read(key, canonical, holder, target)

    def get_many(self, keys: Sequence[str], targets: Sequence[torch.Tensor | None] | None = None,
                 ) -> list[torch.Tensor | None]:
        """Pages in order (as :meth:`get`), up to the first miss; None for it and every page after it."""
        targets = list(targets) if targets is not None else [None] * len(keys)
        located = self.locate(keys)
        out: list[torch.Tensor | None] = []
        for i, (key, (canonical, holder)) in enumerate(zip(keys, located)):
            page = self.read(key, canonical, holder, targets[i])
            if page is None:
                return out + [None] * (len(keys) - i)
            out.append(page)
        return out

    def read(self, key: str, canonical: int, holder: str | None,
             target: torch.Tensor | None = None) -> torch.Tensor | None:
        """Read the page ``holder`` placed (None: a miss), verified; see :meth:`get`."""
        if holder is None:
            self.stats["misses"] += 1
            return None
        pk = self._payload_key(canonical)
        backend = self._source(holder, pk)
        header = backend.header(pk) if backend is not None else None
        if backend is None or header is None:
            return self._stale(key, canonical, holder, "the payload is gone")
        if target is not None:
            if not target.is_contiguous():
                raise ValueError("the target page must be one contiguous tensor")
            buf = target.view(-1).view(torch.uint8)
            if buf.numel() != header.nbytes:
                raise ValueError(f"target holds {buf.numel()} bytes, the page {header.nbytes}")
        else:
            buf = torch.empty(header.nbytes, dtype=torch.uint8)
        try:
            backend.read_verified(pk, buf)
        except (DataPlaneError, ValueError) as exc:
            return self._stale(key, canonical, holder, str(exc))
        if self.tiers is not None:
            self.tiers.touch([pk])  # a hit: worth more in the tier than a page never read again
        self.stats["hits"] += 1
        if target is not None:
            return target
        if self._layout is not None:
            dtype, shape = self._layout
            return buf.view(dtype).view(shape)
        return buf

    def _stale(self, key: str, canonical: int, holder: str, why: str) -> None:
        self.stats["stale_or_missing"] += 1
        self.stats["misses"] += 1
        log.info("page miss where the index placed it (%s/%s): %s", holder, self.tier.value, why)
        if holder == self.worker:
            self._forget(key, canonical)
        return None

    # -- set --------------------------------------------------------------------------------------

    def set(self, key: str, value: torch.Tensor) -> bool:
        """Store one page (a tensor of its bytes in host or device memory); False when it cannot."""
        return self.set_many([(key, value)])[0]

    def set_many(self, pages: Sequence[tuple[str, torch.Tensor]]) -> list[bool]:
        """Store pages; one ``stored`` batch announces those that were stored."""
        datas = []
        for _key, value in pages:
            datas.append(value.detach().contiguous().view(-1).view(torch.uint8).cpu())
            if self._layout is None:
                self._layout = (value.dtype, tuple(value.shape))
        if self.tiers is not None:
            blocks = [SaveBlock(self._payload_key(self.canonical(key)), data, self._identity_of(key), position=0)
                      for (key, _value), data in zip(pages, datas)]
            out = self.tiers.save(blocks, self.tier, tenant=self.descriptor.tenant_namespace)
            held = set(out.held)
            self.stats["set"] += out.saved + out.already
            self.stats["set_refused"] += out.refused
            self.stats["set_failed"] += out.failed
            self.stats["evicted"] = self.tiers.counters["dropped"]
            if out.refused or out.failed:
                log.info("%d of %d pages not stored on %s: %s", out.refused + out.failed, len(blocks),
                         self.tier.value, "; ".join(out.reasons[:2]))
            return [b.key in held for b in blocks]
        results: list[bool] = []
        stored: list[KeyedEvent] = []
        for (key, _value), data in zip(pages, datas):
            canonical = self.canonical(key)
            ok = self._store_shared(canonical, data)
            results.append(ok)
            if ok:
                # Keyed here, where the page scope and the secret are known: no consumer sees its words.
                stored.append(KeyedStored(engine_hashes=pack_hashes((event_hash(canonical),)),
                                          keys=canonical.to_bytes(16, "big"), block_size=PAGE_WORDS, tier=self.tier,
                                          cache_salt=PAGE_SCOPE_SALT))
        self._emit(stored)
        return results

    def _store_shared(self, canonical: int, data: torch.Tensor) -> bool:
        """Write one page to the shared remote tier (its capacity is the store's)."""
        pk = self._payload_key(canonical)
        header = PayloadHeader.for_data(pk, host_view(data))
        backend = self.catalog.destination_for(EntryLocation(worker=self.worker, tier=self.tier), header.nbytes)
        if backend is None:
            self.stats["set_failed"] += 1
            return False
        try:
            backend.put(header, data)
        except DataPlaneError as exc:  # a full store refuses (TierFullError), with nothing stored
            log.warning("page write failed: %s", exc)
            self.stats["set_failed"] += 1
            return False
        with self._lock:
            self._remote_own.add(canonical)
        self.stats["set"] += 1
        return True

    # -- delete, clear ----------------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        """Remove one of this backend's pages (payload and fact); False when it holds no such page."""
        canonical = self.canonical(key)
        pk = self._payload_key(canonical)
        if self.tiers is not None:
            return self.tiers.lost([pk], self.tier) > 0
        with self._lock:
            if canonical not in self._remote_own:
                return False
        self._forget(key, canonical)
        return True

    def _forget(self, key: str, canonical: int) -> None:
        """Delete one of this backend's pages, payload and fact (one found missing or corrupt)."""
        if self.tiers is not None:
            self.tiers.lost([self._payload_key(canonical)], self.tier)
            return
        with self._lock:
            self._remote_own.discard(canonical)
        self._delete_payload(canonical)
        self._emit([Removed(engine_hashes=pack_hashes((event_hash(canonical),)), tier=self.tier)])

    def _delete_payload(self, canonical: int) -> None:
        pk = self._payload_key(canonical)
        for backend in self.catalog.reachable(EntryLocation(worker=self.worker, tier=self.tier)):
            try:
                backend.delete(pk)
            except DataPlaneError:
                continue

    def clear(self) -> None:
        """Drop every page this backend stored, and its facts."""
        if self.tiers is not None:
            self.tiers.lost(self.tiers.keys(self.tier), self.tier)
        else:
            with self._lock:
                own, self._remote_own = list(self._remote_own), set()
            for canonical in own:
                self._delete_payload(canonical)
        self._emit([Cleared(tier=self.tier)])

    def close(self) -> None:
        """Close the tier manager: what it queued is sent, and its tier folder is free again."""
        if self.tiers is not None:
            self.tiers.close()

    def pages(self) -> int:
        if self.tiers is not None:
            return len(self.tiers.keys(self.tier))
        with self._lock:
            return len(self._remote_own)


def folder_of(data_dir: Path | str, worker: str) -> Path:
    """The disk tier folder of ``worker`` under ``NEXUSKV_DATA_DIR`` (the same in every process)."""
    return Path(data_dir) / "tiers" / worker / "disk"

