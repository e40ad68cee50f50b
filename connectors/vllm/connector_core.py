"""The vLLM KV connector's logic, without vLLM: a scheduler side and a worker side.

vLLM builds one connector per role (``KVConnectorRole.SCHEDULER`` in the engine core, ``WORKER``
in each model runner); :mod:`connectors.vllm.connector` is the thin ``KVConnectorBase_V1`` shell
that translates vLLM's objects into the plain values these two classes take, and
:mod:`connectors.vllm.standin` drives them with NexusKV's reference engine playing the
engine. The contracts they keep are vLLM's (``../shared/reference/engines.md`` §3).

**Scheduler side** (:class:`SchedulerSide`). ``num_new_matched_tokens`` answers from the planner:
the request's canonical block keys are looked up in the index; the matches are narrowed to what
this worker can read (its own disk, a shared remote tier) plus the truth about its own GPU
prefix (vLLM's ``num_computed_tokens``); :func:`nexuskv.planner.plan` decides for this worker
alone. Only when the decision moves blocks from a readable source to this worker's GPU — their
reuse is decided and the worker can make it ready — does it answer that many tokens, in whole
blocks and never the prompt's last token; otherwise 0. It answers ``None`` ("ask again") while
the index is lagging beyond the policy's limit, for at most ``decide_wait_s`` per request, and
``load_async`` only with a positive count. vLLM does not tell a connector its queue, so the
planner sees an idle worker: loading must beat recomputing the uncached tokens outright, and
no prefetch is hidden behind a queue. Saving happens when a request finishes: the full
blocks the save tier does not hold yet are handed to the worker with the blocks kept
allocated (``request_finished`` returns True) until the worker reports them written; then the
blocks the tier really holds — checked, not assumed — are announced as tier events through
``take_events`` (vLLM merges them into its KV-event batch; the bridge turns them into
``nexuskv.kv-events``).

**Worker side** (:class:`WorkerSide`). Loads and saves go through the data plane: sources and
destinations are resolved by the :class:`~nexuskv.dataplane.catalog.BackendCatalog` (by tier and
capability), every payload is checksummed and addressed by (descriptor id, canonical key,
group), and a block's payload is its bytes in every registered layer, in layer order. A load
reads each payload into host memory, verifies it, and scatters it into the paged KV; the first
block that is missing, corrupt or of another descriptor ends that request's load, and it and
every later block of the request are reported by ``block_ids_with_load_errors`` — vLLM then
recomputes them (``kv_load_failure_policy="recompute"``). Synchronous loads finish before the
first layer's ``wait_for_layer_load`` returns; asynchronous ones are reported by
``get_finished``. Saves run on a worker thread from ``wait_for_save`` and are reported by
``get_finished`` once written.

Only block-granular attention state is moved: a descriptor with recurrent checkpoints (vLLM's
hybrid models need ``SupportsHMA``) is refused at construction, with the reason.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from nexuskv.contracts.decisions import Action
from nexuskv.contracts.plans import WorkerLoad
from nexuskv.cost import CostModel
from nexuskv.dataplane.backend import host_view
from nexuskv.dataplane.catalog import BackendCatalog
from nexuskv.dataplane.payload import PayloadHeader, PayloadKey
from nexuskv.descriptor import GranularityKind, StateDescriptor, Tier
from nexuskv.entries import EntryLocation
from nexuskv.errors import ConfigError, DataPlaneError, TierUnavailableError
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.lookup import IndexView, LocationMatch, LookupResult
from nexuskv.planner import Plan, PlanQuery, plan
from nexuskv.policy import ExecutionPolicy

__all__ = ["LoadSpec", "SaveSpec", "ConnectorMeta", "TierStored", "Readable", "SchedulerSide", "WorkerSide",
           "catalog_probe", "check_descriptor"]

log = logging.getLogger("nexuskv.vllm")

#: Engine hashes of a prompt's full blocks (vLLM's own block hash, as its KV events carry it).
EngineHasher = Callable[[Sequence[int]], Sequence[int]]
#: Which of these payloads does a tier hold? (True per key, in order.)
Probe = Callable[[Tier, Sequence[PayloadKey]], Sequence[bool]]


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Blocks one request loads this step: canonical keys, where they come from, where they land."""

    request_id: str
    source: EntryLocation | None  # None: the scheduler could not honour the allocation: fail them all
    keys: tuple[int, ...]
    block_ids: tuple[int, ...]
    first_block: int  # the prompt's block index of keys[0]
    load_async: bool = False


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Full blocks of a finished request to write to this worker's ``tier``."""

    request_id: str
    tier: Tier
    keys: tuple[int, ...]
    engine_hashes: tuple[int, ...]
    block_ids: tuple[int, ...]
    first_block: int


@dataclass(frozen=True, slots=True)
class ConnectorMeta:
    """What the scheduler side hands the worker side for one step."""

    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()


@dataclass(frozen=True, slots=True)
class TierStored:
    """Blocks (by engine hash) now also held in ``tier``: a token-less BlockStored."""

    engine_hashes: tuple[int, ...]
    tier: Tier


def check_descriptor(descriptor: StateDescriptor) -> None:
    """ConfigError unless the descriptor is one attention group of whole blocks (what this connector moves)."""
    groups = descriptor.layer_groups
    if len(groups) != 1 or groups[0].granularity.kind is not GranularityKind.BLOCK:
        raise ConfigError("descriptor", f"{descriptor.descriptor_id} has {len(groups)} layer groups "
                                        f"({', '.join(g.granularity.kind.value for g in groups)}); the vLLM connector "
                                        "moves one group of whole KV blocks (hybrid models need SupportsHMA)")


@dataclass(frozen=True, slots=True)
class Readable:
    """Locations a worker can read: its own tiers in ``own``, anyone's tiers in ``shared``."""

    worker: str
    own: frozenset[Tier] = frozenset({Tier.DISK})
    shared: frozenset[Tier] = frozenset()

    def __call__(self, location: EntryLocation) -> bool:
        tier = location.tier
        return tier in self.shared or (location.worker == self.worker and tier in self.own)


def catalog_probe(catalog: BackendCatalog) -> Probe:
    """A :data:`Probe` over the catalog's backends of this worker (own or shared) for each tier."""

    def probe(tier: Tier, keys: Sequence[PayloadKey]) -> list[bool]:
        held = [False] * len(keys)
        for backend in catalog.reachable(EntryLocation(worker=catalog.worker, tier=tier)):
            try:
                headers = backend.headers(keys)
            except TierUnavailableError:
                continue
            held = [h or hdr is not None for h, hdr in zip(held, headers)]
        return held
    return probe


@dataclass(slots=True)
class _Planned:
    """The scheduler's decision for one request: load blocks [start, end) from ``source``."""

    keys: tuple[int, ...]
    first_asked: float
    source: EntryLocation | None = None
    start: int = 0
    end: int = 0
    reason: str = ""
    plan: Plan | None = None  # the decision behind a positive answer (its record is built on demand)


class SchedulerSide:
    """The scheduler-side half; one per engine. Not thread-safe (vLLM's scheduler is one thread)."""

    def __init__(self, descriptor: StateDescriptor, *, worker: str, index: IndexView,
                 model: Callable[[], CostModel], execution: Callable[[], ExecutionPolicy], readable: Readable,
                 engine_hashes: EngineHasher, probe: Probe, save_tier: Tier | None = Tier.DISK,
                 profile: str | None = None, load_async: bool = False, decide_wait_s: float = 0.05,
                 secret: bytes = b"", clock: Callable[[], float] = time.time) -> None:
        check_descriptor(descriptor)
        self.descriptor = descriptor
        self.scope = IdentityScope.of(descriptor)
        self.block_size = descriptor.block_size
        self.worker = worker
        self.index = index
        self.model = model
        self.execution = execution
        self.readable = readable
        self.engine_hashes = engine_hashes
        self.probe = probe
        self.save_tier = save_tier
        self.profile = profile
        self.load_async = load_async
        self.decide_wait_s = decide_wait_s
        self.clock = clock
        self._keyer = BlockKeyer(self.scope, self.block_size, secret)
        self._group = descriptor.layer_groups[0].kv_group
        self._requests: dict[str, _Planned] = {}
        self._loads: list[LoadSpec] = []
        self._saves: list[SaveSpec] = []
        self._saving: dict[str, SaveSpec] = {}
        self._events: list[TierStored] = []
        self.stats = {"asked": 0, "deferred": 0, "matched_tokens": 0, "saves_announced": 0, "saves_missing": 0,
                      "loads_finished": 0}

    # -- get_num_new_matched_tokens -------------------------------------------------------------

    def num_new_matched_tokens(self, request_id: str, token_ids: Sequence[int],
                               num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` this connector will load, and whether asynchronously."""
        self.stats["asked"] += 1
        now = self.clock()
        bs = self.block_size
        st = self._requests.get(request_id)
        if st is None:
            st = self._requests[request_id] = _Planned(tuple(self._keyer.keys(token_ids)), now)
        elif len(st.keys) != len(token_ids) // bs:  # a resumed request asks with its output tokens too
            st.keys = tuple(self._keyer.keys(token_ids))
        st.source, st.start, st.end, st.plan = None, 0, 0, None
        local = num_computed_tokens // bs
        limit = (len(token_ids) - 1) // bs  # the last token is always computed: its logits are the output
        if local >= limit or not st.keys:
            st.reason = "nothing beyond the local prefix to load"
            return 0, False
        execution = self.execution()
        found = self.index.lookup(self.scope, st.keys)
        if found.lag_ms > execution.budgets.max_index_lag_ms and now - st.first_asked < self.decide_wait_s:
            self.stats["deferred"] += 1
            return None, False  # facts too old to move state on: ask again once the index caught up
        query = PlanQuery(request_id=request_id, scope=self.scope, descriptor=self.descriptor, keys=st.keys,
                          prompt_tokens=len(token_ids), arrival_at=now,
                          candidates=(WorkerLoad(worker=self.worker, profile=self.profile),))
        p = plan(query, self._readable_view(found, local), self.model(), execution, now=now)
        chosen = p.chosen
        src = chosen.source
        if chosen.action not in (Action.TRANSFER, Action.PREFETCH) or src is None or not chosen.contiguous:
            st.reason = f"planner: {chosen.action.value}"
            return 0, False
        start, end = chosen.moved  # type: ignore[misc]
        end = min(end, limit)
        if start != local or end <= start:
            st.reason = f"planner moves blocks [{start}, {end}) but the engine holds {local}"
            return 0, False
        st.source = EntryLocation(worker=src.worker, tier=src.tier, group=self._group)
        st.start, st.end, st.plan = start, end, p
        tokens = (end - start) * bs
        self.stats["matched_tokens"] += tokens
        return tokens, self.load_async

    def _readable_view(self, found: LookupResult, local_blocks: int) -> LookupResult:
        """The lookup narrowed to locations this worker can read, with its own GPU prefix as vLLM knows it."""
        mine = EntryLocation(worker=self.worker, tier=Tier.GPU, group=self._group)
        matches: list[LocationMatch] = [m for m in found.matches
                                        if m.location.tier is not Tier.GPU and self.readable(m.location)]
        if local_blocks:
            matches.append(LocationMatch(mine, self.worker, local_blocks))
        matches.sort(key=lambda m: (m.location.worker, m.location.tier.value, m.location.group))
        return LookupResult(num_blocks=found.num_blocks, matches=tuple(matches), lag_events=found.lag_events,
                            lag_ms=found.lag_ms)

    def decision_reason(self, request_id: str) -> str | None:
        """Why the last answer for this request was what it was (formula and numbers; no tokens)."""
        st = self._requests.get(request_id)
        if st is None:
            return None
        return st.plan.decision.reason if st.plan is not None else st.reason

    # -- allocation, metadata -------------------------------------------------------------------

    def update_state_after_alloc(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` (the request's blocks from block 0) for ``num_external_tokens``."""
        if num_external_tokens <= 0:
            return  # nothing to load (or the second call of an async load)
        st = self._requests.get(request_id)
        bs = self.block_size
        count = num_external_tokens // bs
        if st is None or st.source is None or count != st.end - st.start or num_external_tokens % bs:
            # Never leave allocated blocks unfilled and unreported: fail them, vLLM recomputes.
            start = st.start if st is not None else 0
            ids = tuple(block_ids[start:start + -(-num_external_tokens // bs)])
            self._loads.append(LoadSpec(request_id, None, (), ids, start))
            return
        ids = tuple(block_ids[st.start:st.end])
        if len(ids) != count:
            self._loads.append(LoadSpec(request_id, None, (), ids, st.start))
            return
        self._loads.append(LoadSpec(request_id, st.source, st.keys[st.start:st.end], ids, st.start,
                                    self.load_async))

    def build_meta(self) -> ConnectorMeta:
        """This step's loads and saves (the per-step state is reset)."""
        meta = ConnectorMeta(tuple(self._loads), tuple(self._saves))
        self._loads, self._saves = [], []
        return meta

    # -- finishing, saving, events --------------------------------------------------------------

    def request_finished(self, request_id: str, token_ids: Sequence[int],
                         block_ids: Sequence[int]) -> tuple[bool, dict | None]:
        """Queue the finished request's unsaved full blocks; True keeps its blocks until they are written."""
        st = self._requests.pop(request_id, None)
        tier = self.save_tier
        if tier is None:
            return False, None
        n = min(len(token_ids) // self.block_size, len(block_ids))
        keys = st.keys if st is not None and len(st.keys) >= n else tuple(self._keyer.keys(token_ids))
        keys = keys[:n]
        first = self._saved_prefix(keys, tier)
        if first >= n:
            return False, None
        hashes = tuple(int(h) for h in self.engine_hashes(token_ids)[first:n])
        spec = SaveSpec(request_id, tier, keys[first:], hashes, tuple(block_ids[first:n]), first)
        self._saves.append(spec)
        self._saving[request_id] = spec
        return True, None

    def _saved_prefix(self, keys: Sequence[int], tier: Tier) -> int:
        """Blocks from 0 the index says the save tier already holds for this worker (or shared)."""
        if not keys:
            return 0
        found = self.index.lookup(self.scope, keys)
        best = 0
        for m in found.matches:
            loc = m.location
            if loc.tier is tier and m.certain and (loc.worker == self.worker or tier in self.readable.shared):
                best = max(best, m.prefix_blocks)
        return best

    def update_connector_output(self, finished_sending: Iterable[str] = (), finished_recving: Iterable[str] = ()) -> None:
        """The worker finished these saves and loads; saved blocks the tier now holds become events."""
        did = self.descriptor.descriptor_id
        for request_id in finished_sending:
            spec = self._saving.pop(request_id, None)
            if spec is None:
                continue
            held = self.probe(spec.tier, [PayloadKey(did, k, self._group) for k in spec.keys])
            hashes = tuple(h for h, ok in zip(spec.engine_hashes, held) if ok)
            self.stats["saves_announced"] += len(hashes)
            self.stats["saves_missing"] += len(spec.keys) - len(hashes)
            if hashes:
                self._events.append(TierStored(hashes, spec.tier))
        self.stats["loads_finished"] += sum(1 for _ in finished_recving)

    def take_events(self) -> list[TierStored]:
        """Events of this connector since the last call (vLLM publishes them with its own)."""
        out, self._events = self._events, []
        return out


# -- worker side ------------------------------------------------------------------------------------

_LAYER_INDEX = re.compile(r"(\d+)")


def _layer_order(name: str) -> tuple:
    """Natural order of layer names (``model.layers.10.self_attn.attn`` after ``...layers.9...``)."""
    return tuple(int(p) if p.isdigit() else p for p in _LAYER_INDEX.split(name))


@dataclass(slots=True)
class _Layer:
    name: str
    tensor: torch.Tensor
    block_dim: int
    nbytes: int  # bytes of one block of this layer
    offset: int  # where this layer's bytes start in a block payload


@dataclass(slots=True)
class _Outcome:
    request_id: str
    done: int  # blocks loaded or written
    failed_block_ids: tuple[int, ...] = ()
    reason: str | None = None


class WorkerSide:
    """The worker-side half; one per model runner. Thread-safe for vLLM's calling pattern."""

    def __init__(self, descriptor: StateDescriptor, catalog: BackendCatalog, *, threads: int = 2) -> None:
        check_descriptor(descriptor)
        self.descriptor = descriptor
        self.catalog = catalog
        self._group = descriptor.layer_groups[0].kv_group
        self._layers: list[_Layer] = []
        self._block_bytes = 0
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="nexuskv-kv")
        self._lock = threading.Lock()
        self._sync_loads: list[Future] = []
        self._async_loads: dict[str, Future] = {}
        self._saves: dict[str, Future] = {}
        self._finished_seen: set[str] = set()
        self._load_errors: set[int] = set()
        self.stats = {"blocks_loaded": 0, "blocks_failed": 0, "blocks_saved": 0, "bytes_loaded": 0, "bytes_saved": 0}

    # -- registration --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor],
                           block_dims: Mapping[str, int] | None = None) -> None:
        """The engine's paged KV per layer; a block's payload is its bytes in every layer, in layer order.

        ``block_dims`` gives each layer's block dimension (default 0). The bytes of one block must
        equal the descriptor's bytes per block, or the registration fails naming both numbers.
        """
        layers, offset = [], 0
        for name in sorted(kv_caches, key=_layer_order):
            t = kv_caches[name]
            dim = (block_dims or {}).get(name, 0)
            one = t.select(dim, 0)
            nbytes = one.numel() * one.element_size()
            layers.append(_Layer(name, t, dim, nbytes, offset))
            offset += nbytes
        expected = sum(g.bytes_per_token for g in self.descriptor.layer_groups) * self.descriptor.block_size
        if offset != expected:
            raise ConfigError("kv_caches", f"{len(layers)} layers hold {offset} bytes per block; descriptor "
                                           f"{self.descriptor.descriptor_id} says {expected}")
        self._layers, self._block_bytes = layers, offset

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    def _gather(self, block_id: int) -> torch.Tensor:
        """One block's payload bytes (every layer, in order) in host memory."""
        out = torch.empty(self._block_bytes, dtype=torch.uint8)
        for layer in self._layers:
            src = layer.tensor.select(layer.block_dim, block_id).contiguous()
            out[layer.offset:layer.offset + layer.nbytes].copy_(src.view(-1).view(torch.uint8).cpu())
        return out

    def _scatter(self, block_id: int, data: torch.Tensor) -> None:
        for layer in self._layers:
            dst = layer.tensor.select(layer.block_dim, block_id)
            part = data[layer.offset:layer.offset + layer.nbytes].view(dst.dtype).view(dst.shape)
            dst.copy_(part)

    # -- loads ---------------------------------------------------------------------------------

    def start_load(self, meta: ConnectorMeta) -> None:
        """Begin this step's loads (on worker threads)."""
        for spec in meta.loads:
            future = self._pool.submit(self._load, spec)
            if spec.load_async:
                self._async_loads[spec.request_id] = future
            else:
                self._sync_loads.append(future)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until this step's synchronous loads are in the paged KV (they finish together)."""
        pending, self._sync_loads = self._sync_loads, []
        for future in pending:
            self._record(future.result())

    def _load(self, spec: LoadSpec) -> _Outcome:
        if spec.source is None:
            return _Outcome(spec.request_id, 0, spec.block_ids, "the allocation did not match the decision")
        if not spec.keys:
            return _Outcome(spec.request_id, 0)
        did = self.descriptor.descriptor_id
        first = PayloadKey(did, spec.keys[0], self._group)
        backend = self.catalog.source_for(spec.source, first)
        if backend is None:
            return _Outcome(spec.request_id, 0, spec.block_ids, f"no reachable backend at {spec.source} holds "
                                                                f"block {spec.first_block}")
        buf = torch.empty(self._block_bytes, dtype=torch.uint8)
        for i, (key, block_id) in enumerate(zip(spec.keys, spec.block_ids)):
            pk = PayloadKey(did, key, self._group)
            try:
                backend.read_verified(pk, buf)
            except (DataPlaneError, ValueError) as exc:
                return _Outcome(spec.request_id, i, spec.block_ids[i:], f"block {spec.first_block + i}: {exc}")
            self._scatter(block_id, buf)
        return _Outcome(spec.request_id, len(spec.keys))

    def _record(self, outcome: _Outcome) -> None:
        with self._lock:
            self.stats["blocks_loaded"] += outcome.done
            self.stats["bytes_loaded"] += outcome.done * self._block_bytes
            if outcome.failed_block_ids:
                self.stats["blocks_failed"] += len(outcome.failed_block_ids)
                self._load_errors.update(outcome.failed_block_ids)
                log.warning("request %s: load stopped, %d blocks recompute: %s", outcome.request_id,
                            len(outcome.failed_block_ids), outcome.reason)

    def block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    # -- saves ---------------------------------------------------------------------------------

    def wait_for_save(self, meta: ConnectorMeta) -> None:
        """Start writing this step's saves; their blocks stay allocated until get_finished reports them."""
        for spec in meta.saves:
            self._saves[spec.request_id] = self._pool.submit(self._save, spec)

    def _save(self, spec: SaveSpec) -> _Outcome:
        did = self.descriptor.descriptor_id
        where = EntryLocation(worker=self.catalog.worker, tier=spec.tier, group=self._group)
        backend = self.catalog.destination_for(where, len(spec.keys) * self._block_bytes)
        if backend is None:
            return _Outcome(spec.request_id, 0, reason=f"no backend for {where}")
        written = 0
        for i, (key, block_id) in enumerate(zip(spec.keys, spec.block_ids)):
            pk = PayloadKey(did, key, self._group)
            try:
                if backend.contains(pk):
                    continue
                data = self._gather(block_id)
                backend.put(PayloadHeader.for_data(pk, host_view(data)), data)
            except DataPlaneError as exc:
                return _Outcome(spec.request_id, written, reason=f"saving stopped at block {spec.first_block + i}: "
                                                                 f"{exc}")
            written += 1
        return _Outcome(spec.request_id, written)

    # -- completion ----------------------------------------------------------------------------

    def get_finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str], set[str]]:
        """(requests whose saves are written, requests whose async loads are in the paged KV)."""
        self._finished_seen.update(finished_req_ids)
        sending: set[str] = set()
        for request_id, future in list(self._saves.items()):
            if future.done() and request_id in self._finished_seen:
                outcome = future.result()
                with self._lock:
                    self.stats["blocks_saved"] += outcome.done
                    self.stats["bytes_saved"] += outcome.done * self._block_bytes
                if outcome.reason:
                    log.warning("request %s: %s", request_id, outcome.reason)
                del self._saves[request_id]
                self._finished_seen.discard(request_id)
                sending.add(request_id)
        recving: set[str] = set()
        for request_id, future in list(self._async_loads.items()):
            if future.done():
                self._record(future.result())
                del self._async_loads[request_id]
                recving.add(request_id)
        return sending, recving

    def busy(self) -> bool:
        """True while a save or an asynchronous load has not been reported yet."""
        return bool(self._saves or self._async_loads)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
