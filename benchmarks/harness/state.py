"""The simulated cluster's state during one run, and the true cost of any path a request can take.

:class:`ClusterState` owns the ground truth — which blocks each worker's tiers and the store hold
(:mod:`.caches`), prefill slots, decode load and busy links (:mod:`.timeline`), the true costs and
noise (:mod:`.truth`) — and a real :class:`~nexuskv.index.GlobalIndex` fed by the kv-events
batches the caches publish, each applied ``event_delay_s`` after it was published (what a lookup
sees is therefore what an index replica would see, not the truth).

:meth:`ClusterState.evaluate` prices a :class:`~.paths.Choice` with the true costs and, with
``commit``, carries it out: it reserves the worker and the links, and schedules the completions
(the prefill's blocks enter the worker's GPU and the store; the copy's result reaches the policy).
Nothing here reads a clock: time is the simulated time passed in.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from nexuskv.admission import block_gains
from nexuskv.contracts.kv_events import KvEventBatch, PublisherIdentity
from nexuskv.contracts.plans import WorkerLoad
from nexuskv.cost import extent_bytes, extent_pages
from nexuskv.descriptor import StateDescriptor, Tier
from nexuskv.identity import IdentityScope
from nexuskv.index import GlobalIndex
from nexuskv.lookup import LookupResult
from nexuskv.profiles import shipped_cost_model

from benchmarks.harness.caches import LruTier, Publisher, Uses, UtilityTier
from benchmarks.harness.cluster import STORE, ClusterSpec
from benchmarks.harness.paths import Choice, ExecMode, Outcome, Place
from benchmarks.harness.timeline import DecodeLoad, Engine, Job, Links
from benchmarks.harness.truth import Noise, TrueCosts

__all__ = ["TIER_SETS", "IDENTITIES", "EVICTIONS", "Admission", "ClusterState"]

#: Which tiers a run's data plane has: none (caching off), the engines' GPU caches only, or all.
TIER_SETS = ("none", "gpu", "all")
#: How the index keys state: by the full identity (tenant, adapter, model, ...) or by tokens alone.
IDENTITIES = ("full", "tokens")
#: How the host, disk and store tiers evict and admit: LRU (everything admitted) or by utility per
#: byte (caches.UtilityTier, what NexusKV's tier manager does). The GPU cache is the engine's LRU.
EVICTIONS = ("lru", "utility")
SHARED_TENANT = "harness"
_EPS = 1e-12


@dataclass(slots=True)
class Admission:
    """One request at admission, as the simulator sees it (the policies read what they may)."""

    position: int  # index of the request in the stream
    now: float
    request_id: str
    workload: str
    tenant: str
    lora: str | None
    prompt_tokens: int
    output_tokens: int
    keys: Sequence[int]  # the index's keys of the full blocks
    held: Sequence[int]  # the true keys (equal to ``keys`` unless the identity is degraded)
    tokens: Callable[[], np.ndarray]
    scope: IdentityScope  # the index's scope for this request
    descriptor: StateDescriptor
    noise: Noise
    loads: tuple[WorkerLoad, ...]
    decode_blocks: dict[str, int]
    prefixes: dict[Place, int]  # true prefix held at each place (index keys)
    safe_prefixes: dict[Place, int]  # the part of it that is this request's own state
    recompute_s: dict[str, float]  # per worker: true TTFT of recomputing from scratch there
    baseline_worker: str
    t_base_s: float
    oracle: tuple[Choice, Outcome] | None = None  # the best path on this state (oracle.best_path)
    _lookup: LookupResult | None = None
    _state: ClusterState | None = None

    @property
    def blocks(self) -> int:
        return len(self.keys)

    def lookup(self) -> LookupResult:
        """The index's answer for this request (with the replica's lag), once per admission."""
        if self._lookup is None:
            self._lookup = self._state.lookup(self.scope, self.keys, self.now)  # type: ignore[union-attr]
        return self._lookup


def _prompt_value(spec: ClusterSpec) -> Callable[[int], dict[Tier, float]]:
    """Per prompt length in blocks, the EG per tier of one of its blocks (the prompt's mean), by the
    believed (shipped) cost model: what a tier manager values a block at when it is saved."""
    model = shipped_cost_model()
    compute = model.compute_for(spec.model, spec.profile)
    links = {t: model.link(spec.profile, t, Tier.GPU) for t in (Tier.HOST, Tier.DISK, Tier.REMOTE)}
    links = {t: lk for t, lk in links.items() if lk is not None}
    per_block = [block_gains(compute, links, block_tokens=spec.block_tokens, position=0, nbytes=spec.block_bytes)]
    cumulative = [dict(per_block[0])]
    cache: dict[int, dict[Tier, float]] = {}

    def value(blocks: int) -> dict[Tier, float]:
        blocks = max(1, blocks)
        hit = cache.get(blocks)
        if hit is not None:
            return hit
        while len(cumulative) < blocks:
            g = block_gains(compute, links, block_tokens=spec.block_tokens, position=len(cumulative),
                            nbytes=spec.block_bytes)
            cumulative.append({t: cumulative[-1][t] + g[t] for t in g})
        out = cache[blocks] = {t: v / blocks for t, v in cumulative[blocks - 1].items()}
        return out
    return value


class ClusterState:
    """Ground truth, index and event schedule of one simulated run."""

    def __init__(self, spec: ClusterSpec, truth: TrueCosts, *, tiers: str, identity: str, layerwise: bool,
                 eviction: str = "lru", tier_admission: bool = True, half_life_s: float = 120.0) -> None:
        if eviction not in EVICTIONS:
            raise ValueError(f"eviction: {eviction!r} is not one of {EVICTIONS}")
        if tiers not in TIER_SETS:
            raise ValueError(f"tiers: {tiers!r} is not one of {TIER_SETS}")
        if identity not in IDENTITIES:
            raise ValueError(f"identity: {identity!r} is not one of {IDENTITIES}")
        self.spec = spec
        self.truth = truth
        self.tiers = tiers
        self.identity = identity
        self.layerwise = layerwise
        self.descriptor = spec.descriptor(SHARED_TENANT, layerwise=layerwise)
        d = self.descriptor
        self.block_tokens = d.block_size
        self.block_bytes = extent_bytes(d, 1)
        self.groups = len(d.layer_groups)
        self.layers = sum(len(g.layers) for g in d.layer_groups) if d.materialization.layerwise else 0
        self.workers = spec.worker_names
        ident = PublisherIdentity(tenant_namespace=SHARED_TENANT, model=d.model, model_revision=d.model_revision,
                                  tokenizer_revision=d.tokenizer_revision, descriptor_id=d.descriptor_id)
        cap, bt = spec.capacity, self.block_tokens
        self.publishers: dict[str, Publisher] = {}
        self.places: dict[Place, LruTier] = {}
        self.eviction = eviction
        utility = eviction == "utility"
        value = _prompt_value(spec) if utility else None

        def tier(t: Tier, capacity: int, uses: Uses | None) -> LruTier:
            if uses is None:
                return LruTier(t, capacity)
            return UtilityTier(t, capacity, uses, admit_all=not tier_admission)

        if tiers != "none":
            for w in self.workers:
                uses = Uses(half_life_s) if utility else None
                levels = [LruTier(Tier.GPU, cap.gpu_tokens // bt)]  # the engine's own cache
                if tiers == "all":
                    levels += [tier(Tier.HOST, cap.host_tokens // bt, uses), tier(Tier.DISK, cap.disk_tokens // bt, uses)]
                levels = [t for t in levels if t.capacity > 0]
                self.publishers[w] = Publisher(w, levels, ident, bt, uses=uses, value=value)
                for t in levels:
                    self.places[Place(w, t.tier)] = t
            if tiers == "all" and cap.remote_tokens > 0:
                uses = Uses(half_life_s) if utility else None
                store = tier(Tier.REMOTE, cap.remote_tokens // bt, uses)
                self.publishers[STORE] = Publisher(STORE, [store], ident, bt, uses=uses, value=value)
                self.places[Place(STORE, Tier.REMOTE)] = store
        self.index = GlobalIndex()
        self._pending: deque[tuple[float, float, KvEventBatch]] = deque()  # (due, published, batch)
        self.engines = {w: Engine(self.at) for w in self.workers}
        self.decode = {w: DecodeLoad() for w in self.workers}
        self.links = Links()
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.batches = 0

    # -- scopes ---------------------------------------------------------------------------------------

    def true_scope(self, tenant: str, lora: str | None) -> IdentityScope:
        """The identity a request's state really has."""
        return IdentityScope.of(self.spec.descriptor(tenant, layerwise=self.layerwise), lora=lora)

    def scope(self, tenant: str, lora: str | None) -> IdentityScope:
        """The index's scope of a request: its own identity, or the shared one when keyed by tokens."""
        if self.identity == "tokens":
            return IdentityScope.of(self.descriptor)
        return self.true_scope(tenant, lora)

    def request_descriptor(self, tenant: str) -> StateDescriptor:
        """The descriptor the planner is given for a request (the shared one when keyed by tokens)."""
        if self.identity == "tokens":
            return self.descriptor
        return self.spec.descriptor(tenant, layerwise=self.layerwise)

    # -- time -----------------------------------------------------------------------------------------

    def at(self, when: float, action: Callable[[], None]) -> None:
        """Run ``action`` when simulated time reaches ``when``."""
        self._seq += 1
        heapq.heappush(self._events, (when, self._seq, action))

    def advance(self, now: float) -> None:
        """Apply every completion and index delivery due by ``now``, in time order."""
        events, pending = self._events, self._pending
        while True:
            next_event = events[0][0] if events else math.inf
            next_batch = pending[0][0] if pending else math.inf
            if min(next_event, next_batch) > now or not (events or pending):
                break
            if next_batch <= next_event:
                self.index.apply(pending.popleft()[2])
            else:
                heapq.heappop(events)[2]()

    def publish(self, batch: KvEventBatch | None, at: float) -> None:
        if batch is not None:
            self._pending.append((at + self.spec.event_delay_s, at, batch))
            self.batches += 1

    def lookup(self, scope: IdentityScope, keys: Sequence[int], now: float) -> LookupResult:
        found = self.index.lookup(scope, keys)
        if not self._pending:
            return found
        lag_ms = (now - self._pending[0][1]) * 1000.0
        return LookupResult(found.num_blocks, found.matches, lag_events=len(self._pending), lag_ms=max(0.0, lag_ms))

    # -- what a request finds -------------------------------------------------------------------------

    def loads(self, now: float) -> tuple[WorkerLoad, ...]:
        """What each worker reports: the prefills queued (count, tokens, tokens x context), decode
        blocks, active requests."""
        out = []
        for w in self.workers:
            eng, dl = self.engines[w], self.decode[w]
            jobs, tokens, products = eng.queued_work(now)
            out.append(WorkerLoad(worker=w, queued_prefill_tokens=tokens, queued_prefill_requests=jobs,
                                  queued_prefill_token_products=products, decode_blocks=dl.blocks(now),
                                  active_requests=eng.jobs(now) + dl.requests(now), profile=self.spec.profile))
        return tuple(out)

    def prefixes(self, keys: Sequence[int], held: Sequence[int]) -> tuple[dict[Place, int], dict[Place, int]]:
        """Per place, the prefix held (by index key) and the part of it that is the request's own state."""
        raw: dict[Place, int] = {}
        safe: dict[Place, int] = {}
        degraded = self.identity == "tokens"
        for place, lru in self.places.items():
            if not degraded:
                p = lru.prefix(keys)
                if p:
                    raw[place] = safe[place] = p
                continue
            blocks = lru.blocks
            p, own = 0, None
            for k, h in zip(keys, held):
                v = blocks.get(k)
                if v is None:
                    break
                if own is None and v != h:
                    own = p
                p += 1
            if p:
                raw[place] = p
                if (own if own is not None else p) > 0:
                    safe[place] = own if own is not None else p
        return raw, safe

    def recompute(self, now: float, prompt_tokens: int, noise: Noise, decode_blocks: dict[str, int],
                  position: int) -> dict[str, float]:
        """Per worker, the true TTFT of recomputing the whole prompt there, arriving now."""
        out = {}
        compute = self.truth.compute_s(prompt_tokens, prompt_tokens, noise.compute)
        for w in self.workers:
            dur = compute + self.truth.decode_s(decode_blocks[w], self.block_bytes, prompt_tokens)
            out[w] = self.engines[w].start_of(now, now, dur, position) + dur - now
        return out

    # -- carrying out a choice ------------------------------------------------------------------------

    def route(self, source: Place, worker: str) -> tuple[str, tuple[str, ...]]:
        """The link kind of a copy from ``source`` into ``worker``'s GPU, and the resources it holds."""
        if source.worker == STORE:
            return "store", (f"nic:{worker}",)
        if source.worker == worker:
            if source.tier is Tier.HOST:
                return "host", (f"pcie:{worker}",)
            if source.tier is Tier.DISK:
                return "disk", (f"nvme:{worker}",)
            raise ValueError(f"a copy from {source} to its own GPU is not a copy")
        if source.tier is Tier.DISK:
            return "peer-disk", (f"nvme:{source.worker}", f"nic:{source.worker}", f"nic:{worker}")
        return "net", (f"nic:{source.worker}", f"nic:{worker}")

    def _job(self, adm: Admission, worker: str, reuse: int, local: int, copied: bool, link: str | None,
             copy_s: float) -> tuple[float, float, int]:
        """(job seconds, compute seconds, uncached tokens) of the prefill after reusing ``reuse`` blocks."""
        n = adm.prompt_tokens
        e = n - reuse * self.block_tokens
        e = e if e > 0 else 1
        compute = self.truth.compute_s(e, n, adm.noise.compute)
        job = compute + self.truth.decode_s(adm.decode_blocks[worker], self.block_bytes, e)
        if local > 0:
            job += self.truth.in_place_s
        if copied:
            r = self.descriptor.restore_cost
            job += self.truth.hardware.sync_s + r.fixed_s + r.per_token_s * (reuse - local) * self.block_tokens
            job += copy_s * self.truth.interference(link)  # type: ignore[arg-type]
        return job, compute, e

    def evaluate(self, adm: Admission, choice: Choice, mode: ExecMode, *, commit: bool = False,
                 done: Callable[[Outcome], None] | None = None) -> Outcome:
        """The true cost of ``choice`` for ``adm`` on the state now; with ``commit``, carry it out.

        A request that must wait for its copy is parked and takes its slot when the copy is done
        (or given up); requests admitted meanwhile may run before it, so its final outcome can only
        be later than the one returned here. ``done`` receives the final outcome once it is placed.
        """
        w, t = choice.worker, adm.now
        local = adm.prefixes.get(Place(w, Tier.GPU), 0) if mode.local_reuse else 0
        eng, pos = self.engines[w], adm.position
        mv = choice.move
        link = copy_status = fallback = None
        resources: tuple[str, ...] = ()
        copy_s = 0.0
        copy_start = copy_end = None
        moved = nbytes = 0
        head_s = 0.0  # a synchronous copy's share of the job
        ready = t
        reuse = local
        consumed = False
        if mv is not None and mv.end > mv.start and mv.blocks > 0:
            link, resources = self.route(mv.source, w)
            moved = mv.blocks
            nbytes = extent_bytes(self.descriptor, moved)
            pages = extent_pages(self.descriptor, moved)
            copy_s = self.truth.transfer_s(link, pages, nbytes, adm.noise.links[link])
            lru = self.places.get(mv.source)
            present = lru is not None and lru.holds(adm.keys[mv.start:mv.end])
            connects = mv.start <= local and mv.end > local
            if present and connects:
                job, compute, e = self._job(adm, w, mv.end, local, True, link, copy_s)
                overlap = job * (self.layers - 1) / self.layers if (mode.layerwise and self.layers > 1) else 0.0
            else:
                job, compute, e = self._job(adm, w, local, local, False, link, copy_s)
                overlap = 0.0
            free = self.links.free_at(resources)
            if mode.async_copy:
                copy_start = max(t, free)
                if not present:
                    copy_end = copy_start + self.truth.latency_s(link)
                    copy_status, fallback = "not_found", f"{mv.source} does not hold the blocks the index reported"
                    ready = copy_end
                else:
                    copy_end = copy_start + copy_s
                    late = (mode.fallback and choice.deadline_at is not None
                            and copy_end > choice.deadline_at + _EPS)
                    if late:
                        copy_end = max(t, choice.deadline_at)  # type: ignore[arg-type]
                        copy_status, fallback = "abandoned", "the copy was not done by its deadline"
                        job, compute, e = self._job(adm, w, local, local, False, link, copy_s)
                        ready = copy_end
                    else:
                        copy_status = "completed"
                        consumed = connects
                        ready = max(t, copy_end - overlap) if connects else t
                        if not connects:
                            fallback = "the copied blocks do not extend the worker's own prefix"
                start = eng.start_of(t, ready, job, pos)
            else:
                # The engine loads synchronously when it schedules the request: the copy is part of the job.
                head = self.truth.latency_s(link) if not present else max(0.0, copy_s - overlap)
                ready = max(t, free)
                start = eng.start_of(t, ready, job + head, pos)
                copy_start = start
                copy_end = start + (copy_s if present else self.truth.latency_s(link))
                copy_status = "completed" if present else "not_found"
                consumed = present and connects
                if not present:
                    fallback = f"{mv.source} does not hold the blocks the index reported"
                elif not connects:
                    fallback = "the copied blocks do not extend the worker's own prefix"
                head_s = head
            if consumed:
                reuse = mv.end
        else:
            job, compute, e = self._job(adm, w, local, local, False, None, 0.0)
            start = eng.start_of(t, t, job, pos)
        start_nt = eng.start_of(t, t, job, pos)
        end = start + job + head_s
        queue = max(0.0, start_nt - t)
        visible = max(0.0, (start - t) - queue) + head_s
        unsafe = 0
        if self.identity == "tokens" and reuse > 0:
            if local:
                unsafe += self.places[Place(w, Tier.GPU)].mismatched(adm.keys[:local], adm.held[:local])
            if consumed and mv is not None:
                lo = max(mv.start, local)
                unsafe += self.places[mv.source].mismatched(adm.keys[lo:mv.end], adm.held[lo:mv.end])
        outcome = Outcome(
            worker=w, reused_blocks=reuse, unsafe_blocks=unsafe, moved_blocks=moved, moved_bytes=nbytes, link=link,
            queue_s=queue, visible_transfer_s=visible, transfer_s=copy_s, prefill_s=job,
            ttft_s=end - t, start=start, end=end, ready=ready, copy_start=copy_start, copy_end=copy_end,
            copy_status=copy_status,
            fallback=fallback, uncached_tokens=e, compute_s=compute)
        if commit:
            self._commit(adm, choice, outcome, resources, done)
        return outcome

    def _commit(self, adm: Admission, choice: Choice, o: Outcome, resources: tuple[str, ...],
                done: Callable[[Outcome], None] | None) -> None:
        w = choice.worker
        self.engines[w].submit(Job(adm.position, o.ready, o.end - o.start, o.uncached_tokens,
                                   lambda start: self._started(adm, w, o, start, done), adm.prompt_tokens), adm.now)
        if resources and o.copy_end is not None:
            self.links.hold(resources, o.copy_end)
        # What the request uses is most recently used from now on (pinned, in effect, until consumed).
        gpu = self.places.get(Place(w, Tier.GPU))
        if gpu is not None and o.reused_blocks:
            gpu.touch(adm.keys[:min(o.reused_blocks, adm.prefixes.get(Place(w, Tier.GPU), 0))], adm.now)
        mv = choice.move
        if mv is not None and o.copy_status == "completed":
            src = self.places.get(mv.source)
            if src is not None:
                src.touch(adm.keys[mv.start:mv.end], adm.now)

    def _started(self, adm: Admission, w: str, o: Outcome, start: float,
                 done: Callable[[Outcome], None] | None) -> None:
        """The request's prefill started on ``w``: its outcome is final."""
        if start != o.start:
            duration = o.end - o.start
            head = duration - o.prefill_s
            o = dataclasses.replace(o, start=start, end=start + duration, ttft_s=start + duration - adm.now,
                                    visible_transfer_s=start - adm.now - o.queue_s + head)
        out_blocks = -(-(adm.prompt_tokens + adm.output_tokens) // self.block_tokens)
        self.decode[w].add(o.end, o.end + adm.output_tokens * self.spec.tpot_s, out_blocks)
        if self.tiers != "none":
            end = o.end
            self.at(end, lambda: self._prefilled(adm, w, end))
        if done is not None:
            done(o)

    def _prefilled(self, adm: Admission, worker: str, at: float) -> None:
        """The prefill is done: its blocks are in the worker's GPU cache, and written through to the store."""
        tenant = None if self.identity == "tokens" else adm.tenant
        lora = None if self.identity == "tokens" else adm.lora
        self.publish(self.publishers[worker].store(adm.keys, adm.held, adm.tokens, tenant=tenant, lora=lora, ts=at),
                     at)
        store = self.publishers.get(STORE)
        if store is not None:
            self.publish(store.store(adm.keys, adm.held, adm.tokens, tenant=tenant, lora=lora, ts=at), at)
