"""The reference engine: a tiny paged-KV engine with the lifecycle an engine connector sees.

:class:`ReferenceEngine` stands in for an inference engine in tests and benchmarks. It

* **describes** its state (:meth:`describe`: the variant's State Descriptor) and keys prompts
  canonically (:meth:`block_keys`) in its identity scope;
* **looks up** how much of a prompt it can restore, from its own pages and from a tier
  (:meth:`lookup`), with the reason when that is less than what matched;
* **loads** a prompt's blocks (and recurrent checkpoints) from a tier backend into its pages,
  verifying each payload's checksum and descriptor (:meth:`load`);
* **saves** its pages of a prompt to a tier backend as checksummed payloads (:meth:`save`);
* **prefills** prompts, reusing cached pages where that is legal (:meth:`prefill`), and keeps
  the new full blocks in an LRU prefix cache of fixed pages;
* **emits** ``BlockStored`` (with token ids and its own engine hashes,
  :mod:`nexuskv.reference_engine.engine_hash`), ``BlockRemoved`` on eviction and ``AllCleared`` on
  :meth:`reset` as :class:`~nexuskv.contracts.kv_events.KvEventBatch` records, and one
  :class:`~nexuskv.contracts.observations.PrefillObservation` per prefill, through the injected
  ``publisher`` (:mod:`nexuskv.reference_engine.events`).

Reuse rules (fail closed, fall back to recompute):

* only full blocks are cached; the prompt's last token is always computed (its logits are the
  output), so at most ``len(prompt) - 1`` tokens are reused;
* a hybrid model reuses a prefix only up to a recurrent checkpoint boundary (a multiple of
  ``checkpoint_interval``) whose checkpoint it holds: its attention pages alone cannot rebuild
  the recurrent state. An explicit request to reuse elsewhere is refused, with the reason;
* a payload of another descriptor is refused with the first differing field
  (:func:`nexuskv.dataplane.guard.loadable`); a payload failing its checksum stops the load at
  that block, and the prompt recomputes from there.

Computation is fp32 on CPU; pages are kept in the spec's cache dtype. Token ids are never logged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from nexuskv.contracts.kv_events import PublisherIdentity
from nexuskv.contracts.observations import ObservationRecord, PrefillObservation
from nexuskv.dataplane.backend import TierBackend, host_view
from nexuskv.dataplane.guard import DescriptorRegistry, loadable
from nexuskv.dataplane.payload import PayloadHandle, PayloadHeader, PayloadKey
from nexuskv.descriptor import StateDescriptor, Tier
from nexuskv.errors import DataPlaneError, IdentityError
from nexuskv.identity import BlockKey, BlockKeyer, IdentityScope
from nexuskv.reference_engine.descriptors import ENGINE_FAMILY, descriptor_for
from nexuskv.reference_engine.engine_hash import engine_hashes
from nexuskv.reference_engine.events import EventLog, Publisher, null_publisher
from nexuskv.reference_engine.model import TinyModel
from nexuskv.reference_engine.paging import PagePool
from nexuskv.reference_engine.spec import ReferenceModelSpec

__all__ = ["ReferenceEngine", "ReuseExtent", "PageLoadOutcome", "PageSaveOutcome", "PrefillResult",
           "ATTENTION_GROUP", "CHECKPOINT_GROUP"]


ATTENTION_GROUP = 0  # KV group of attention pages (every variant)
CHECKPOINT_GROUP = 1  # KV group of recurrent checkpoints (hybrid)


@dataclass(frozen=True, slots=True)
class ReuseExtent:
    """How many leading tokens of a prompt can be restored instead of computed."""

    tokens: int  # restorable from the runtime's pages plus the tier asked about
    local_tokens: int  # restorable from the runtime's pages alone
    reason: str | None = None  # why fewer tokens than the cached blocks cover, when so


@dataclass(frozen=True, slots=True)
class PageLoadOutcome:
    """What :meth:`ReferenceEngine.load` restored into the runtime's pages."""

    blocks: int  # attention blocks loaded
    checkpoints: int  # recurrent checkpoints loaded
    bytes: int
    reusable_tokens: int  # tokens of the prompt now restorable from the runtime's pages
    duration_s: float
    reason: str | None = None  # why loading stopped early or was refused


@dataclass(frozen=True, slots=True)
class PageSaveOutcome:
    """What saving the engine's pages to a backend did (a tier manager's save of blocks answers with
    its own ``SaveOutcome``)."""

    handles: tuple[PayloadHandle, ...]
    blocks: int
    checkpoints: int
    bytes: int
    already_there: int  # payloads the destination held already (not copied again)
    reason: str | None = None  # why saving stopped early


@dataclass(frozen=True, slots=True)
class PrefillResult:
    logits: torch.Tensor  # [vocab] fp32 next-token logits after the prompt
    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    stored_blocks: int
    duration_s: float
    reason: str | None = None  # why reuse was limited or refused


class ReferenceEngine:
    """A tiny transformer engine with paged state. Not thread-safe: one caller at a time."""

    def __init__(self, spec: ReferenceModelSpec, *, worker: str = "reference-0", tenant_namespace: str = "default",
                 num_pages: int = 512, num_checkpoints: int = 128, profile: str = "reference-cpu",
                 incarnation: int = 0, identity_secret: bytes = b"", publisher: Publisher = null_publisher,
                 clock: Callable[[], float] = time.time, registry: DescriptorRegistry | None = None,
                 model: TinyModel | None = None) -> None:
        self.spec = spec
        self.worker = worker
        self.profile = profile
        self.clock = clock
        self.publisher = publisher
        self.model = model if model is not None else TinyModel(spec)
        if self.model.spec != spec:
            raise ValueError("model: built from another spec")
        self.descriptor = descriptor_for(spec, tenant_namespace=tenant_namespace)
        self.registry = registry if registry is not None else DescriptorRegistry()
        self.registry.register(self.descriptor)
        self.scope = IdentityScope.of(self.descriptor)
        self.block_size = spec.block_size
        self._keyer = BlockKeyer(self.scope, spec.block_size, identity_secret)
        self._attn_layers = spec.attention_layers
        self._rec_layers = spec.recurrent_layers
        self.pages = PagePool(num_pages, (len(self._attn_layers), spec.block_size, spec.attention_width),
                              self.model.cache_dtype)
        self.checkpoints = (PagePool(num_checkpoints, (len(self._rec_layers), spec.checkpoint_width),
                                     self.model.cache_dtype) if self._rec_layers else None)
        self._hash_of: dict[int, int] = {}  # block key -> engine hash, while any page holds it
        self._events = EventLog(publisher_id=f"{ENGINE_FAMILY}/{worker}", incarnation=incarnation,
                                identity=self.identity, block_size=spec.block_size, publisher=publisher, clock=clock,
                                secret=identity_secret)

    # -- describe -------------------------------------------------------------------------------

    def describe(self) -> StateDescriptor:
        return self.descriptor

    @property
    def identity(self) -> PublisherIdentity:
        d = self.descriptor
        return PublisherIdentity(tenant_namespace=d.tenant_namespace, model=d.model, model_revision=d.model_revision,
                                 tokenizer_revision=d.tokenizer_revision, descriptor_id=d.descriptor_id,
                                 engine_family=d.engine_family)

    @property
    def publisher_id(self) -> str:
        return self._events.publisher_id

    @property
    def interval(self) -> int | None:
        """Checkpoint interval in tokens (hybrid), else None."""
        return self.spec.checkpoint_interval if self._rec_layers else None

    def block_keys(self, tokens: Sequence[int]) -> list[BlockKey]:
        """Canonical keys of the prompt's full blocks, in this runtime's identity scope."""
        return self._keyer.keys(self._check(tokens))

    def payload_key(self, key: int, group: int = ATTENTION_GROUP) -> PayloadKey:
        return PayloadKey(self.descriptor.descriptor_id, int(key), group)

    def cached_blocks(self) -> int:
        return len(self.pages)

    def _check(self, tokens: Sequence[int]) -> list[int]:
        ids = [int(t) for t in tokens]
        if not ids:
            raise IdentityError("tokens: a prompt needs at least one token")
        if min(ids) < 0 or max(ids) >= self.spec.vocab_size:
            raise IdentityError(f"tokens: ids must be in [0, {self.spec.vocab_size})")
        return ids

    # -- look up ------------------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], source: TierBackend | None = None) -> ReuseExtent:
        """Tokens of ``tokens`` restorable from the pages, and from the pages plus ``source``."""
        ids = self._check(tokens)
        keys = self._keyer.keys(ids)
        local, reason_local = self._restorable(keys, len(ids), self._held(ATTENTION_GROUP),
                                               self._held(CHECKPOINT_GROUP))
        if source is None:
            return ReuseExtent(local, local, reason_local)
        total, reason = self._restorable(keys, len(ids), self._held(ATTENTION_GROUP, source),
                                         self._held(CHECKPOINT_GROUP, source))
        return ReuseExtent(total, local, reason)

    def _held(self, group: int, source: TierBackend | None = None,
              allowed: set[PayloadKey] | None = None) -> Callable[[int], bool]:
        """Is a key's state of ``group`` held by the pages (or by ``source``, among ``allowed``)?"""
        pool = self.pages if group == ATTENTION_GROUP else self.checkpoints

        def held(key: int) -> bool:
            if pool is not None and key in pool:
                return True
            if source is None or pool is None:
                return False
            pk = self.payload_key(key, group)
            return (allowed is None or pk in allowed) and source.contains(pk)
        return held

    def _restorable(self, keys: Sequence[int], n: int, block: Callable[[int], bool],
                    checkpoint: Callable[[int], bool]) -> tuple[int, str | None]:
        """The longest legal reuse (tokens) given which blocks and checkpoints are available."""
        bs = self.block_size
        hit = 0
        while hit < len(keys) and block(keys[hit]):
            hit += 1
        attn = min(hit * bs, n - 1)
        if not self._rec_layers or attn == 0:
            return attn, None
        interval = self.spec.checkpoint_interval
        b = attn // interval * interval
        while b > 0 and not checkpoint(keys[b // bs - 1]):
            b -= interval
        if b == attn:
            return b, None
        return b, (f"recurrent layers {list(self._rec_layers)} restore only at a checkpoint boundary (every "
                   f"{interval} tokens) whose checkpoint is held: reusing {b} of {attn} cached tokens")

    def refusal(self, tokens: Sequence[int], reuse_tokens: int) -> str | None:
        """Why restoring exactly ``reuse_tokens`` tokens of ``tokens`` from the pages is illegal (None: legal)."""
        ids = self._check(tokens)
        n, bs = len(ids), self.block_size
        if reuse_tokens < 0 or reuse_tokens > n - 1:
            return f"cannot reuse {reuse_tokens} tokens of a {n}-token prompt (at most {n - 1}: the last is computed)"
        if reuse_tokens == 0:
            return None
        if self._rec_layers and reuse_tokens % self.spec.checkpoint_interval:
            return (f"recurrent layers {list(self._rec_layers)} can be restored only at checkpoint boundaries "
                    f"(every {self.spec.checkpoint_interval} tokens); {reuse_tokens} is not one")
        keys = self._keyer.keys(ids)
        need = -(-reuse_tokens // bs)
        missing = next((i for i in range(need) if keys[i] not in self.pages), None)
        if missing is not None:
            return f"block {missing} is not cached: {reuse_tokens} tokens cannot be restored"
        if self._rec_layers and keys[reuse_tokens // bs - 1] not in self.checkpoints:
            return f"no recurrent checkpoint is held at token {reuse_tokens}"
        return None

    # -- prefill ------------------------------------------------------------------------------

    def prefill(self, tokens: Sequence[int], *, reuse: bool = True, reuse_tokens: int | None = None,
                request_id: str | None = None, queued_s: float | None = None) -> PrefillResult:
        """Compute the prompt's next-token logits, restoring cached state where legal.

        ``reuse=False`` recomputes everything; ``reuse_tokens`` asks to restore exactly that many
        tokens (refused, with the reason, when illegal: the prompt then recomputes in full).
        ``request_id`` labels the prefill observation, so outcomes join their decisions, and
        ``queued_s`` records how long the request waited for this engine (the scheduler knows it).
        Stores the prompt's new full blocks (and checkpoints) in the pages and publishes their
        events and a prefill observation.
        """
        ids = self._check(tokens)
        t0 = time.perf_counter()
        n, bs = len(ids), self.block_size
        keys = self._keyer.keys(ids)
        hashes = engine_hashes(ids, bs)
        reason: str | None = None
        if not reuse:
            p = 0
        elif reuse_tokens is not None:
            reason = self.refusal(ids, reuse_tokens)
            p = 0 if reason else reuse_tokens
        else:
            p, reason = self._restorable(keys, n, self._held(ATTENTION_GROUP), self._held(CHECKPOINT_GROUP))
        self.pages.unpin_all()
        rows, ckpt = self._gather(keys, p)
        interval = self.interval
        boundaries = range(interval, n + 1, interval) if interval else ()
        out = self.model(torch.tensor(ids[p:], dtype=torch.long), p, rows, ckpt, boundaries)
        stored = self._store(ids, keys, hashes, p, out.rows, out.checkpoints)
        self._touch(keys)
        self.pages.unpin_all()
        if self.checkpoints is not None:
            self.checkpoints.unpin_all()
        self._events.flush()
        duration = time.perf_counter() - t0
        self.publisher(ObservationRecord(observed_at=self.clock(), request_id=request_id, observation=PrefillObservation(
            model=self.descriptor.model, profile=self.profile, worker=self.worker, uncached_tokens=n - p,
            context_tokens=n, duration_s=duration, queued_s=queued_s)))
        return PrefillResult(logits=out.logits, prompt_tokens=n, reused_tokens=p, computed_tokens=n - p,
                             stored_blocks=stored, duration_s=duration, reason=reason)

    def _gather(self, keys: Sequence[int], p: int) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """Cached rows of positions [0, p) per attention layer, and the checkpoints after p tokens."""
        if p == 0:
            return {}, {}
        bs = self.block_size
        pages = [self.pages.lookup(k) for k in keys[: -(-p // bs)]]
        self.pages.pin(pages)
        sel = self.pages.pages[pages]  # [blocks, layers, bs, width]
        flat = sel.permute(1, 0, 2, 3).reshape(len(self._attn_layers), -1, sel.shape[-1])[:, :p]
        rows = {layer: flat[j] for j, layer in enumerate(self._attn_layers)}
        ckpt: dict[int, torch.Tensor] = {}
        if self._rec_layers:
            page = self.checkpoints.lookup(keys[p // bs - 1])
            state = self.checkpoints.view(page).clone()
            ckpt = {layer: state[j] for j, layer in enumerate(self._rec_layers)}
        return rows, ckpt

    def _store(self, ids: list[int], keys: Sequence[int], hashes: Sequence[int], p: int,
               rows: dict[int, torch.Tensor], checkpoints: dict[int, dict[int, torch.Tensor]]) -> int:
        """Keep the new full blocks and checkpoints; returns how many blocks were stored."""
        bs = self.block_size
        first, last = -(-p // bs), len(ids) // bs
        new_run: list[int] = []
        stored = 0
        for i in range(first, last):
            if keys[i] in self.pages:
                self._flush_run(new_run, ids, hashes, ATTENTION_GROUP)
                continue
            got = self._allocate(self.pages, keys[i], hashes[i], ATTENTION_GROUP)
            if got is None:  # every page is in use by this prompt: keep what fits
                break
            page = self.pages.view(got)
            for j, layer in enumerate(self._attn_layers):
                page[j].copy_(rows[layer][i * bs - p:(i + 1) * bs - p])
            new_run.append(i)
            stored += 1
        self._flush_run(new_run, ids, hashes, ATTENTION_GROUP)
        for boundary, layers in sorted(checkpoints.items()):
            i = boundary // bs - 1
            if keys[i] in self.checkpoints or keys[i] not in self.pages:
                continue
            got = self._allocate(self.checkpoints, keys[i], hashes[i], CHECKPOINT_GROUP)
            if got is None:
                break
            page = self.checkpoints.view(got)
            for j, layer in enumerate(self._rec_layers):
                page[j].copy_(layers[layer])
            self._announce_checkpoint(ids, hashes, i)
        return stored

    def _allocate(self, pool: PagePool, key: int, engine_hash: int, group: int) -> int | None:
        got = pool.allocate(key)
        if got is None:
            return None
        page, evicted = got
        for victim in evicted:
            self._events.removed([self._hash_of[victim]], group=group)
            self._forget(victim)
        self._hash_of[key] = engine_hash
        return page

    def _forget(self, key: int) -> None:
        if key not in self.pages and (self.checkpoints is None or key not in self.checkpoints):
            self._hash_of.pop(key, None)

    def _flush_run(self, run: list[int], ids: list[int], hashes: Sequence[int], group: int) -> None:
        """Announce a run of consecutive new blocks as one BlockStored (GPU tier)."""
        if not run:
            return
        a, b, bs = run[0], run[-1] + 1, self.block_size
        self._events.stored(hashes[a:b], hashes[a - 1] if a else None, ids[a * bs:b * bs], group=group)
        run.clear()

    def _announce_checkpoint(self, ids: list[int], hashes: Sequence[int], i: int) -> None:
        bs = self.block_size
        self._events.stored(hashes[i:i + 1], hashes[i - 1] if i else None, ids[i * bs:(i + 1) * bs],
                            group=CHECKPOINT_GROUP)

    def _touch(self, keys: Sequence[int]) -> None:
        """Mark a prompt's blocks used, deepest first, so its tail is evicted before its root."""
        self.pages.touch(reversed(keys))
        if self.checkpoints is not None:
            self.checkpoints.touch(reversed(keys))

    # -- load -----------------------------------------------------------------------------------

    def load(self, tokens: Sequence[int], source: TierBackend, *,
             payloads: Sequence[PayloadKey] | None = None) -> PageLoadOutcome:
        """Restore the prompt's blocks (and checkpoint) held by ``source`` into the pages.

        Loads the longest legal prefix the pages and ``source`` hold together (for a hybrid, up
        to the last checkpoint boundary it can restore). ``payloads`` restricts loading to the
        named payloads (what a planner or index handed over): each must be of a compatible
        descriptor and part of this prompt's state, or the whole load is refused with the reason.
        Every payload is verified against its checksum as it lands in its page; the first that
        fails (or vanished) ends the load there.
        """
        ids = self._check(tokens)
        t0 = time.perf_counter()
        keys = self._keyer.keys(ids)
        allowed: set[PayloadKey] | None = None
        if payloads is not None:
            refusal = self._refuse_foreign(keys, payloads)
            if refusal is not None:
                return PageLoadOutcome(0, 0, 0, self.lookup(ids).local_tokens, time.perf_counter() - t0, refusal)
            allowed = set(payloads)

        target, reason = self._restorable(keys, len(ids), self._held(ATTENTION_GROUP, source, allowed),
                                          self._held(CHECKPOINT_GROUP, source, allowed))
        hashes = engine_hashes(ids, self.block_size)
        blocks = checkpoints = nbytes = 0
        bs = self.block_size
        run: list[int] = []
        self.pages.unpin_all()
        self.pages.pin(p for p in (self.pages.lookup(k) for k in keys[: -(-target // bs)]) if p is not None)
        stop: str | None = None
        for i in range(-(-target // bs)):
            if keys[i] in self.pages:
                self._flush_run(run, ids, hashes, ATTENTION_GROUP)
                continue
            got = self._read_page(self.pages, source, keys[i], hashes[i], ATTENTION_GROUP)
            if isinstance(got, str):
                stop = f"block {i}: {got}"
                break
            run.append(i)
            blocks += 1
            nbytes += got
        self._flush_run(run, ids, hashes, ATTENTION_GROUP)
        if stop is None and self._rec_layers and target:
            i = target // bs - 1
            if keys[i] not in self.checkpoints:
                got = self._read_page(self.checkpoints, source, keys[i], hashes[i], CHECKPOINT_GROUP)
                if isinstance(got, str):
                    stop = f"checkpoint at token {target}: {got}"
                else:
                    checkpoints, nbytes = 1, nbytes + got
                    self._announce_checkpoint(ids, hashes, i)
        self._touch(keys[: -(-target // bs)])
        self.pages.unpin_all()
        if self.checkpoints is not None:
            self.checkpoints.unpin_all()
        self._events.flush()
        now_reusable = self.lookup(ids).local_tokens
        if stop is not None:
            reason = f"{stop}; the prompt recomputes from there"
        return PageLoadOutcome(blocks, checkpoints, nbytes, now_reusable, time.perf_counter() - t0, reason)

    def _refuse_foreign(self, keys: Sequence[int], payloads: Sequence[PayloadKey]) -> str | None:
        for did in sorted({pk.descriptor_id for pk in payloads}):
            verdict = loadable(did, self.descriptor, self.registry)
            if not verdict:
                return f"refused payloads of descriptor {did}: {verdict.reason}"
        mine = {self.payload_key(k, ATTENTION_GROUP) for k in keys}
        if self._rec_layers:
            mine |= {self.payload_key(k, CHECKPOINT_GROUP) for k in keys}
        strays = [pk for pk in payloads if pk not in mine]
        if strays:
            return f"refused: payload {strays[0]} is not part of this prompt's state"
        return None

    def _read_page(self, pool: PagePool, source: TierBackend, key: int, engine_hash: int, group: int) -> int | str:
        """Read one payload straight into a new page and verify it there; bytes read, or why not."""
        pk = self.payload_key(key, group)
        got = self._allocate(pool, key, engine_hash, group)
        if got is None:
            return "no free page"
        dest = pool.bytes_of(got)
        try:
            header = source.read_verified(pk, dest)
        except (DataPlaneError, ValueError) as exc:
            pool.release(key)
            self._forget(key)
            return str(exc)
        return header.nbytes

    # -- save -----------------------------------------------------------------------------------

    def save(self, tokens: Sequence[int], destination: TierBackend, *, announce: bool = True) -> PageSaveOutcome:
        """Write the prompt's cached prefix (pages, and checkpoints within it) to ``destination``.

        Each page becomes one checksummed payload addressed by (descriptor id, block key, group).
        Stops at the first block not cached, or when the destination is full or unreachable.
        ``announce`` publishes tier events (token-less ``BlockStored`` in the destination's tier)
        for what was written, as vLLM's offloading connector does for its CPU copies.
        """
        ids = self._check(tokens)
        keys = self._keyer.keys(ids)
        hashes = engine_hashes(ids, self.block_size)
        handles: list[PayloadHandle] = []
        written: dict[int, list[int]] = {ATTENTION_GROUP: [], CHECKPOINT_GROUP: []}
        blocks = checkpoints = nbytes = already = 0
        reason = None
        jobs: list[tuple[PagePool, int, int]] = []
        for i, key in enumerate(keys):
            if key not in self.pages:
                break
            jobs.append((self.pages, i, ATTENTION_GROUP))
            if self.checkpoints is not None and key in self.checkpoints:
                jobs.append((self.checkpoints, i, CHECKPOINT_GROUP))
        for pool, i, group in jobs:
            pk = self.payload_key(keys[i], group)
            try:
                if destination.contains(pk):
                    already += 1
                    continue
                data = pool.bytes_of(pool.lookup(keys[i]))
                header = PayloadHeader.for_data(pk, host_view(data))
                handles.append(destination.put(header, data))
            except DataPlaneError as exc:
                reason = f"saving stopped at block {i} (group {group}): {exc}"
                break
            written[group].append(i)
            nbytes += header.nbytes
            if group == ATTENTION_GROUP:
                blocks += 1
            else:
                checkpoints += 1
        if announce:
            tier = destination.capabilities.tier
            for group, idx in written.items():
                if idx:
                    self._events.stored([hashes[i] for i in idx], None, (), tier=tier, group=group)
            self._events.flush()
        return PageSaveOutcome(tuple(handles), blocks, checkpoints, nbytes, already, reason)

    # -- engine-connector seams ----------------------------------------------------------------
    # What an engine shows a KV connector (vLLM's KVConnectorBase_V1): its paged KV tensors, the
    # prefix its own cache restores, blocks allocated for the connector to fill, and the events
    # of blocks the connector filled or copied elsewhere. Attention pages only: recurrent
    # checkpoints are not block-granular state a connector of that shape can move.

    def kv_caches(self) -> dict[str, torch.Tensor]:
        """Per attention layer, its rows of every page: ``[num_pages, block_size, width]`` views.

        A block id is a page index; the bytes of one block over every layer, in layer order, are
        exactly the page's payload (what :meth:`save` writes and :meth:`load` reads).
        """
        return {f"layers.{layer}.attn": self.pages.pages[:, j] for j, layer in enumerate(self._attn_layers)}

    def computed_tokens(self, tokens: Sequence[int]) -> int:
        """Leading tokens the pages restore, in whole blocks, never the last one (vLLM's own rule)."""
        return self.lookup(tokens).local_tokens // self.block_size * self.block_size

    def block_ids(self, tokens: Sequence[int], count: int) -> list[int] | None:
        """Pages of the prompt's first ``count`` blocks (None when one of them is not cached)."""
        keys = self._keyer.keys(self._check(tokens))[:count]
        pages = [self.pages.lookup(k) for k in keys]
        return None if len(pages) < count or any(p is None for p in pages) else pages  # type: ignore[return-value]

    def allocate_blocks(self, tokens: Sequence[int], start: int, end: int) -> list[int] | None:
        """Pages for blocks ``[start, end)`` that a connector will fill; None when they do not fit.

        The pages are pinned until the next prefill, and not announced until
        :meth:`adopt_blocks` says they were filled (or :meth:`release_blocks` gives them back).
        """
        ids = self._check(tokens)
        keys = self._keyer.keys(ids)
        hashes = engine_hashes(ids, self.block_size)
        if not 0 <= start <= end <= len(keys):
            raise ValueError(f"blocks [{start}, {end}) are not full blocks of a {len(ids)}-token prompt")
        pages: list[int] = []
        for i in range(start, end):
            if keys[i] in self.pages:
                raise ValueError(f"block {i} is cached already: a connector fills only missing blocks")
            got = self._allocate(self.pages, keys[i], hashes[i], ATTENTION_GROUP)
            if got is None:
                self.release_blocks(ids, start, i)
                return None
            pages.append(got)
        self._events.flush()  # evictions made room
        return pages

    def adopt_blocks(self, tokens: Sequence[int], start: int, end: int) -> None:
        """Blocks ``[start, end)`` were filled by a connector: cache and announce them (GPU tier)."""
        ids = self._check(tokens)
        self._flush_run(list(range(start, end)), ids, engine_hashes(ids, self.block_size), ATTENTION_GROUP)
        self._events.flush()

    def release_blocks(self, tokens: Sequence[int], start: int, end: int) -> None:
        """Give back the pages of blocks ``[start, end)`` (a load that failed); nothing is announced."""
        for key in self._keyer.keys(self._check(tokens))[start:end]:
            self.pages.release(key)
            self._forget(key)

    def announce_copies(self, hashes: Sequence[int], tier: Tier) -> None:
        """Publish that blocks (by engine hash) now also exist in ``tier`` (a connector's saves)."""
        if hashes:
            self._events.stored(list(hashes), None, (), tier=tier)
            self._events.flush()

    # -- reset ----------------------------------------------------------------------------------

    def reset(self) -> None:
        """Drop every cached page and checkpoint (one ``AllCleared`` for the device tier)."""
        self.pages.clear()
        if self.checkpoints is not None:
            self.checkpoints.clear()
        self._hash_of.clear()
        self._events.discard()
        self._events.cleared(Tier.GPU)
        self._events.flush()

