"""The connector's worker side: loads into vLLM's paged KV, saves out of it, and what they cost.

The logic of the ``KVConnectorRole.WORKER`` instance, one per model runner (in vLLM's worker
process); :mod:`connectors.vllm.shell` calls it, the scheduler side (:mod:`connectors.vllm.scheduler_side`)
decides what it does each step through :class:`~connectors.vllm.meta.ConnectorMeta`.

**Data plane.** Sources and destinations are resolved by the
:class:`~nexuskv.dataplane.catalog.BackendCatalog` (by tier and capability); every payload is
checksummed and addressed by (descriptor id, canonical key, group), and a block's payload is its
bytes in every registered layer, in layer order. The registered tensors must have the layout the
descriptor names (:func:`layout_of`): a cache laid out otherwise is refused at registration, so
payloads of one layout are never read into another.

**Loads.** Each payload is read into host memory, verified and scattered into the paged KV; the
first block that is missing, corrupt or of another descriptor ends that request's load, and it and
every later block of the request are reported by ``block_ids_with_load_errors`` — vLLM then
recomputes them (``kv_load_failure_policy="recompute"``) — and, when the tier is this worker's own,
its publisher announces them removed. Synchronous loads finish inside ``start_load`` (vLLM calls
it before the forward pass of a step with synchronous loads); asynchronous ones are reported by
``get_finished``.

**Saves.** ``wait_for_save`` (after the step's forward pass) copies the step's filled blocks out
of the paged KV into host memory at once — vLLM may reuse a block as soon as its request ends —
and a worker thread saves them through the worker's
:class:`~nexuskv.dataplane.tiers.TierManager`, the capacity authority of its disk tier: a full
tier makes room by utility (this worker's least valuable blocks leave, prefix parents after the
blocks chained from them) and refuses only what is worth less than everything it would
displace; a refusal is counted (``blocks_refused``) and logged once per save, never silent. What
the manager admits or evicts, the tier's
:class:`~connectors.vllm.tier_publisher.TierPublisher` announces (manifest and all; its snapshot
at start is what the manager adopts). A block the tier already holds is neither written nor
announced again; one the manager believed held but the tier lost is forgotten, then written.

**Measurements.** At registration: the device's GEMM rate, and a read probe of the save tier
(the cold-start cost model's anchors). Each step: its duration from ``bind`` to ``wait_for_save``
(less synchronous load time; on CUDA the step is synchronised first, only when it carries a
prefill to time), recorded as a prefill timing when the step computed one prefill and at most one
decoding request per ``DECODE_SHARE`` (8) of its tokens — a decode token rides in the same matrix
products as the prefill's rows, so a few of them are within the timing's noise, and a busy engine
almost never runs a step with no decode at all; every load and save as a copy timing. They go to the scheduler side in the next
:class:`~connectors.vllm.meta.WorkerReport` and, through ``observe``, to ``nexuskv.observations``
(prefill and transfer observations) for the calibration agent.

Only block-granular attention state is moved (see
:func:`~connectors.vllm.scheduler_side.check_descriptor`).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from connectors.descriptors import publisher_identity
from connectors.vllm.meta import ConnectorMeta, CopyTiming, LoadSpec, PrefillTiming, SaveSpec, WorkerReport
from connectors.vllm.scheduler_side import check_descriptor
from connectors.vllm.tier_publisher import TierBlock, TierPublisher
from nexuskv.contracts.observations import ObservationRecord, PrefillObservation, TransferObservation
from nexuskv.dataplane.backend import host_view
from nexuskv.dataplane.catalog import BackendCatalog
from nexuskv.dataplane.payload import PayloadHeader, PayloadKey
from nexuskv.dataplane.tier_facts import BlockIdentity, TierChange
from nexuskv.dataplane.tiers import SaveBlock, TierManager
from nexuskv.descriptor import StateDescriptor, Tier
from nexuskv.entries import EntryLocation
from nexuskv.errors import ConfigError, DataPlaneError, TierUnavailableError

__all__ = ["WorkerSide", "layout_of", "block_dims", "catalog_probe", "tier_held"]

log = logging.getLogger("nexuskv.vllm")

_LAYER_INDEX = re.compile(r"(\d+)")
#: Which of these payloads does a tier hold, really (True per key)? The disk backend's in-memory
#: index cannot see a file deleted behind its back; this must.
Held = Callable[[Tier, Sequence[PayloadKey]], Sequence[bool]]


def _layer_order(name: str) -> tuple:
    """Natural order of layer names (``model.layers.10.self_attn.attn`` after ``...layers.9...``)."""
    return tuple(int(p) if p.isdigit() else p for p in _LAYER_INDEX.split(name))


def block_dims(kv_caches: Mapping[str, torch.Tensor], num_blocks: int | None) -> dict[str, int]:
    """Where each layer's block dimension is: 1 for FlashAttention's ``(2, num_blocks, ...)``, else 0."""
    dims = {}
    for name, t in kv_caches.items():
        shape = tuple(t.shape)
        leading_blocks = num_blocks is not None and shape[0] == num_blocks
        dims[name] = 1 if not leading_blocks and len(shape) >= 2 and shape[0] == 2 else 0
    return dims


def layout_of(shape: Sequence[int], block_dim: int, *, kv_heads: int, block_size: int, head_size: int) -> str | None:
    """The descriptor layout name (:data:`nexuskv.hf_config.LAYOUTS`) of one layer's paged KV, or None.

    ``(2, blocks, tokens, heads, dim)`` is ``paged_nhd``, ``(2, blocks, heads, tokens, dim)``
    ``paged_hnd``, ``(blocks, heads, tokens, 2*dim)`` ``paged_hn_kvd`` (vLLM's CPU attention).
    """
    shape = tuple(shape)
    if block_dim == 1 and len(shape) == 5 and shape[0] == 2:
        tail = shape[2:]
        if tail == (block_size, kv_heads, head_size):
            return "paged_nhd"
        if tail == (kv_heads, block_size, head_size):
            return "paged_hnd"
    if block_dim == 0 and len(shape) == 4 and shape[1:] == (kv_heads, block_size, 2 * head_size):
        return "paged_hn_kvd"
    return None


def catalog_probe(catalog: BackendCatalog) -> Held:
    """A probe over the catalog's backends of this worker (own or shared) for each tier, by header."""

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
class _Layer:
    name: str
    tensor: torch.Tensor
    block_dim: int
    nbytes: int  # bytes of one block of this layer
    offset: int  # where this layer's bytes start in a block payload


@dataclass(slots=True)
class _Outcome:
    request_id: str
    done: int  # blocks loaded
    failed_block_ids: tuple[int, ...] = ()
    failed_keys: tuple[int, ...] = ()
    reason: str | None = None
    source: Tier | None = None
    seconds: float = 0.0


DECODE_SHARE = 8  # prefill tokens per decoding request a timed step may carry (see the module docstring)


class PublisherSink:
    """A tier manager's changes, announced by the tier's :class:`TierPublisher` (one tier: no moves).

    Changes are applied in order under the manager's lock and announced in that order by
    :meth:`flush` (one flush at a time), so a removal never overtakes the store it undoes.
    """

    def __init__(self, publisher: TierPublisher) -> None:
        self.publisher = publisher
        self._pending: list[TierChange] = []
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self.unchained = 0

    def apply(self, changes: Sequence[TierChange]) -> None:
        with self._lock:
            self._pending.extend(c for c in changes if c.tier is self.publisher.tier)

    def flush(self) -> int:
        with self._flush_lock:
            with self._lock:
                pending, self._pending = self._pending, []
            i = 0
            while i < len(pending):
                kind = pending[i].kind
                j = i + 1
                while j < len(pending) and pending[j].kind == kind:
                    j += 1
                run = pending[i:j]
                if kind == "removed":
                    self.publisher.forget([c.key.key for c in run])
                elif kind in ("stored", "moved"):
                    blocks = [TierBlock(c.key.key, c.identity.parent, c.identity.tokens) for c in run]
                    for start in range(len(blocks)):  # one announce per chained run
                        if start == 0 or blocks[start].parent != blocks[start - 1].key:
                            end = next((e for e in range(start + 1, len(blocks))
                                        if blocks[e].parent != blocks[e - 1].key), len(blocks))
                            if not self.publisher.announce(blocks[start:end]):
                                self.unchained += end - start
                i = j
            return len(pending)


class WorkerSide:
    """The worker-side half; one per model runner. Thread-safe for vLLM's calling pattern."""

    def __init__(self, descriptor: StateDescriptor, catalog: BackendCatalog, *, held: Held | None = None,
                 publisher: TierPublisher | None = None, observe: Callable[[ObservationRecord], None] | None = None,
                 model: str | None = None, profile: str = "", threads: int = 2, measure: bool = True,
                 clock: Callable[[], float] = time.perf_counter, wall: Callable[[], float] = time.time,
                 tiers: TierManager | None = None) -> None:
        check_descriptor(descriptor)
        self.descriptor = descriptor
        self.catalog = catalog
        self.held = held or tier_held(catalog, None)
        self.publisher = publisher
        self._identity = publisher_identity(descriptor)
        if tiers is None and publisher is not None:
            tiers = TierManager(catalog, facts=PublisherSink(publisher), clock=wall)
            bs = descriptor.block_size
            adopted = tiers.adopt([(PayloadKey(descriptor.descriptor_id, b.key, descriptor.layer_groups[0].kv_group),
                                    BlockIdentity(self._identity, b.tokens, bs, parent=b.parent), 0)
                                   for b in publisher.reannounced], tenant=descriptor.tenant_namespace)
            log.info("%s: the tier manager adopted %d re-announced blocks", publisher.name, adopted)
        self.tiers = tiers
        self._ticked = 0.0
        self.observe = observe
        self.model = model or descriptor.model
        self.profile = profile
        self.measure = measure
        self.clock, self.wall = clock, wall
        self._group = descriptor.layer_groups[0].kv_group
        self._layers: list[_Layer] = []
        self._block_bytes = 0
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="nexuskv-kv")
        self._lock = threading.Lock()
        self._async_loads: dict[str, Future] = {}
        self._writes: list[Future] = []
        self._load_errors: set[int] = set()
        self._report = WorkerReport()
        self._step_started: float | None = None
        self._step_load_s = 0.0
        self._cuda = torch.cuda.is_available()
        self.stats = {"blocks_loaded": 0, "blocks_failed": 0, "blocks_saved": 0, "blocks_already_held": 0,
                      "blocks_unchained": 0, "blocks_refused": 0, "bytes_loaded": 0, "bytes_saved": 0,
                      "prefill_timings": 0}

    # -- registration --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor],
                           block_dims: Mapping[str, int] | None = None) -> None:
        """The engine's paged KV per layer; a block's payload is its bytes in every layer, in layer order.

        ``block_dims`` gives each layer's block dimension (default 0). The bytes of one block must
        equal the descriptor's bytes per block, and the layout the descriptor's (when the tensor
        shape names one), or the registration fails naming both.
        """
        layers, offset = [], 0
        group = self.descriptor.layer_groups[0]
        key = group.tensors[0]
        heads, head_size = (key.shape[0], key.shape[1]) if len(key.shape) == 2 else (0, 0)
        for name in sorted(kv_caches, key=_layer_order):
            t = kv_caches[name]
            dim = (block_dims or {}).get(name, 0)
            layout = layout_of(t.shape, dim, kv_heads=heads, block_size=self.descriptor.block_size,
                               head_size=head_size)
            if layout is not None and layout != self.descriptor.layout.layout:
                raise ConfigError("kv_caches", f"layer {name} is laid out {layout} {tuple(t.shape)}; descriptor "
                                               f"{self.descriptor.descriptor_id} says {self.descriptor.layout.layout}")
            one = t.select(dim, 0)
            nbytes = one.numel() * one.element_size()
            layers.append(_Layer(name, t, dim, nbytes, offset))
            offset += nbytes
        expected = sum(g.bytes_per_token for g in self.descriptor.layer_groups) * self.descriptor.block_size
        if offset != expected:
            raise ConfigError("kv_caches", f"{len(layers)} layers hold {offset} bytes per block; descriptor "
                                           f"{self.descriptor.descriptor_id} says {expected}")
        self._layers, self._block_bytes = layers, offset
        if self.measure:
            self._measure_at_start(layers[0].tensor)

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    def _measure_at_start(self, like: torch.Tensor) -> None:
        """The GEMM rate of the cache's device and a read probe of the save tier, for the cold start."""
        d = like.device
        dtype = like.dtype if like.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
        n, k = 512, 512
        a = torch.randn(n, k, device=d).to(dtype)
        b = torch.randn(k, 3 * k, device=d).to(dtype)
        times = []
        for _ in range(5):
            self._sync()
            t0 = self.clock()
            torch.matmul(a, b)
            self._sync()
            times.append(self.clock() - t0)
        best = sorted(times)[len(times) // 2]
        if best > 0:
            rate = 2.0 * n * k * 3 * k / best
            label = f"{dtype} GEMM {n}x{k}x{3 * k} on {d.type}, median of 5, measured at engine start"
            with self._lock:
                self._report = self._report.merged(WorkerReport(gemm_flops_per_s=rate, gemm_label=label))
        if self.publisher is not None:
            self._probe_tier(self.publisher.tier)

    def _probe_tier(self, tier: Tier) -> None:
        """Write then read back 1 and 8 scratch payloads of one block: the link's first two points."""
        where = EntryLocation(worker=self.catalog.worker, tier=tier, group=self._group)
        backend = self.catalog.destination_for(where, 8 * self._block_bytes)
        if backend is None:
            return
        data = torch.zeros(self._block_bytes, dtype=torch.uint8)
        keys = [PayloadKey("nexuskv-probe", (1 << 127) | i, self._group) for i in range(8)]
        buf = torch.empty(self._block_bytes, dtype=torch.uint8)
        try:
            for pk in keys:
                backend.put(PayloadHeader.for_data(pk, host_view(data)), data)
            for count in (1, 8):
                t0 = self.clock()
                for pk in keys[:count]:
                    backend.read_verified(pk, buf)
                self._copied(CopyTiming(tier, Tier.GPU, count, self.clock() - t0))
        except DataPlaneError as exc:
            log.warning("read probe of the %s tier failed: %s", tier.value, exc)
        finally:
            for pk in keys:
                try:
                    backend.delete(pk)
                except DataPlaneError:
                    pass

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()

    # -- one block's bytes ---------------------------------------------------------------------

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

    # -- the step ------------------------------------------------------------------------------

    def bind(self, meta: ConnectorMeta) -> None:
        """A step begins (vLLM bound its metadata before the forward pass)."""
        if len(meta.prefills) == 1 and meta.decodes * DECODE_SHARE <= meta.prefills[0].uncached:
            self._sync()
            self._step_started = self.clock()
        else:
            self._step_started = None
        self._step_load_s = 0.0

    def start_load(self, meta: ConnectorMeta) -> None:
        """Run this step's synchronous loads (before the forward pass), start its asynchronous ones."""
        t0 = self.clock()
        sync: list[Future] = []
        for spec in meta.loads:
            future = self._pool.submit(self._load, spec)
            if spec.load_async:
                self._async_loads[spec.request_id] = future
            else:
                sync.append(future)
        for future in sync:
            self._record(future.result())
        self._step_load_s += self.clock() - t0

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: synchronous loads are in place when ``start_load`` returns."""

    def wait_for_save(self, meta: ConnectorMeta) -> None:
        """The step's forward pass is done: time it, copy its filled blocks out, write them on a thread."""
        if self._step_started is not None:
            self._sync()
            elapsed = self.clock() - self._step_started - self._step_load_s
            self._step_started = None
            work = meta.prefills[0]
            self._timed_prefill(work.request_id, PrefillTiming(work.uncached, work.context, elapsed))
        for spec in meta.saves:
            copies = [self._gather(b) for b in spec.block_ids]
            self._writes.append(self._pool.submit(self._save, spec, copies))
        self._writes = [f for f in self._writes if not f.done()]

    def _timed_prefill(self, request_id: str, timing: PrefillTiming) -> None:
        self.stats["prefill_timings"] += 1
        with self._lock:
            self._report = self._report.merged(WorkerReport(prefills=(timing,)))
        if self.observe is not None and self.profile:
            self.observe(ObservationRecord(observed_at=self.wall(), request_id=request_id, observation=PrefillObservation(
                model=self.model, profile=self.profile, worker=self.catalog.worker, uncached_tokens=timing.uncached,
                context_tokens=timing.context, duration_s=timing.duration_s)))

    def _copied(self, timing: CopyTiming, *, request_id: str | None = None, backend: str = "nexuskv-vllm") -> None:
        with self._lock:
            self._report = self._report.merged(WorkerReport(copies=(timing,)))
        if self.observe is not None and timing.pages:
            self.observe(ObservationRecord(observed_at=self.wall(), request_id=request_id, observation=TransferObservation(
                source_tier=timing.source, destination_tier=timing.destination, backend=backend,
                worker=self.catalog.worker, bytes=timing.pages * self._block_bytes, pages=timing.pages,
                duration_s=timing.duration_s, ok=timing.ok)))

    # -- loads ---------------------------------------------------------------------------------

    def _load(self, spec: LoadSpec) -> _Outcome:
        if spec.source is None:
            return _Outcome(spec.request_id, 0, spec.block_ids, (), "the allocation did not match the decision")
        if not spec.keys:
            return _Outcome(spec.request_id, 0)
        t0 = self.clock()
        did = self.descriptor.descriptor_id
        first = PayloadKey(did, spec.keys[0], self._group)
        backend = self.catalog.source_for(spec.source, first)
        tier = spec.source.tier
        if backend is None:
            return _Outcome(spec.request_id, 0, spec.block_ids, spec.keys, f"no reachable backend at {spec.source} "
                            f"holds block {spec.first_block}", tier, self.clock() - t0)
        buf = torch.empty(self._block_bytes, dtype=torch.uint8)
        for i, (key, block_id) in enumerate(zip(spec.keys, spec.block_ids)):
            try:
                backend.read_verified(PayloadKey(did, key, self._group), buf)
            except (DataPlaneError, ValueError) as exc:
                return _Outcome(spec.request_id, i, spec.block_ids[i:], spec.keys[i:],
                                f"block {spec.first_block + i}: {exc}", tier, self.clock() - t0)
            self._scatter(block_id, buf)
        return _Outcome(spec.request_id, len(spec.keys), source=tier, seconds=self.clock() - t0)

    def _record(self, outcome: _Outcome) -> None:
        with self._lock:
            self.stats["blocks_loaded"] += outcome.done
            self.stats["bytes_loaded"] += outcome.done * self._block_bytes
            if outcome.failed_block_ids:
                self.stats["blocks_failed"] += len(outcome.failed_block_ids)
                self._load_errors.update(outcome.failed_block_ids)
                self._report = self._report.merged(WorkerReport(loads_failed=(outcome.request_id,)))
            else:
                self._report = self._report.merged(WorkerReport(loads_done=(outcome.request_id,)))
        if outcome.failed_block_ids:
            log.warning("request %s: load stopped, %d blocks recompute: %s", outcome.request_id,
                        len(outcome.failed_block_ids), outcome.reason)
            publisher = self.publisher
            if publisher is not None and outcome.source is publisher.tier and outcome.failed_keys:
                try:  # the first is missing or corrupt; the rest unknown
                    if self.tiers is not None:
                        lost = [PayloadKey(self.descriptor.descriptor_id, outcome.failed_keys[0], self._group)]
                        if not self.tiers.lost(lost, publisher.tier):
                            publisher.forget(outcome.failed_keys[:1])
                    else:
                        publisher.forget(outcome.failed_keys[:1])
                except Exception as exc:  # noqa: BLE001 - a lost removal leaves a miss, never a wrong load
                    log.warning("could not announce the removal: %s", exc)
        if outcome.source is not None and (outcome.done or outcome.failed_block_ids):
            self._copied(CopyTiming(outcome.source, Tier.GPU, outcome.done, outcome.seconds,
                                    ok=not outcome.failed_block_ids), request_id=outcome.request_id)

    def block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    # -- saves ---------------------------------------------------------------------------------

    def _save(self, spec: SaveSpec, copies: Sequence[torch.Tensor]) -> int:
        """Write the blocks the tier lacks, announce the run; returns blocks written."""
        t0 = self.clock()
        did = self.descriptor.descriptor_id
        where = EntryLocation(worker=self.catalog.worker, tier=spec.tier, group=self._group)
        backend = self.catalog.destination_for(where, len(spec.keys) * self._block_bytes)
        if backend is None:
            log.warning("request %s: no backend for %s", spec.request_id, where)
            return 0
        pks = [PayloadKey(did, k, self._group) for k in spec.keys]
        try:
            held = list(self.held(spec.tier, pks))
        except TierUnavailableError as exc:
            log.warning("request %s: cannot check the %s tier: %s", spec.request_id, spec.tier.value, exc)
            return 0
        bs = self.descriptor.block_size
        tiers = self.tiers
        if tiers is not None and any(b.capabilities.tier is spec.tier for b in tiers.backends()):
            return self._save_managed(spec, copies, pks, held, tiers, t0)
        publisher = self.publisher
        run: list[TierBlock] = []
        written = 0
        parent = spec.parent
        for i, (pk, data) in enumerate(zip(pks, copies)):
            block = TierBlock(pk.key, parent, tuple(spec.token_ids[i * bs:(i + 1) * bs]))
            parent = pk.key
            if held[i] and (publisher is None or publisher.announced(pk.key)):
                self.stats["blocks_already_held"] += 1
                if run:
                    self._announce(run, spec)
                    run = []
                continue
            if not held[i]:
                try:
                    if backend.contains(pk):  # its index still lists a payload that is gone: forget it first
                        backend.delete(pk)
                    backend.put(PayloadHeader.for_data(pk, host_view(data)), data)
                except DataPlaneError as exc:
                    log.warning("request %s: saving stopped at block %d: %s", spec.request_id, spec.first_block + i,
                                exc)
                    break
                written += 1
            run.append(block)
        if run:
            self._announce(run, spec)
        with self._lock:
            self.stats["blocks_saved"] += written
            self.stats["bytes_saved"] += written * self._block_bytes
        if written:
            self._copied(CopyTiming(Tier.GPU, spec.tier, written, self.clock() - t0), request_id=spec.request_id)
        return written

    def _save_managed(self, spec: SaveSpec, copies: Sequence[torch.Tensor], pks: list[PayloadKey],
                      held: list[bool], tiers: TierManager, t0: float) -> int:
        """Save through the tier manager: admitted by utility, announced by the tier's publisher."""
        bs = self.descriptor.block_size
        now = self.wall()
        if now - self._ticked >= 1.0:  # pins and leases lapse, garbage goes (at most once a second)
            self._ticked = now
            tiers.tick()
        lost = [pk for pk, ok in zip(pks, held) if not ok and tiers.holds(pk, spec.tier)]
        if lost:  # deleted behind the manager's back: forget them, then write them again
            tiers.lost(lost, spec.tier)
        blocks, parent = [], spec.parent
        for i, (pk, data) in enumerate(zip(pks, copies)):
            tokens = tuple(spec.token_ids[i * bs:(i + 1) * bs])
            blocks.append(SaveBlock(pk, data, BlockIdentity(self._identity, tokens, bs, parent=parent),
                                    position=spec.first_block + i))
            parent = pk.key
        out = tiers.save(blocks, spec.tier, tenant=self.descriptor.tenant_namespace)
        if out.refused or out.failed:
            log.warning("request %s: %d of %d blocks not saved to %s (%d refused, %d failed): %s", spec.request_id,
                        out.refused + out.failed, len(blocks), spec.tier.value, out.refused, out.failed,
                        "; ".join(out.reasons[:2]))
        with self._lock:
            self.stats["blocks_saved"] += out.saved
            self.stats["blocks_already_held"] += out.already
            self.stats["blocks_refused"] += out.refused
            self.stats["bytes_saved"] += out.nbytes
        if out.saved:
            self._copied(CopyTiming(Tier.GPU, spec.tier, out.saved, self.clock() - t0), request_id=spec.request_id)
        return out.saved

    def _announce(self, run: list[TierBlock], spec: SaveSpec) -> None:
        if self.publisher is None:
            return
        try:
            if not self.publisher.announce(run):
                self.stats["blocks_unchained"] += len(run)
        except Exception as exc:  # noqa: BLE001 - the publisher resyncs; the blocks stay on the tier
            log.warning("request %s: announcing %d saved blocks failed: %s", spec.request_id, len(run), exc)

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait for every write started so far (tests, shutdown)."""
        pending, self._writes = self._writes, []
        for future in pending:
            future.result(timeout_s)

    # -- completion ----------------------------------------------------------------------------

    def get_finished(self, finished_req_ids: Iterable[str] = ()) -> tuple[set[str], set[str]]:
        """(requests whose saves are done: none are delayed, so always empty; requests whose async loads are in place)."""
        recving: set[str] = set()
        for request_id, future in list(self._async_loads.items()):
            if future.done():
                self._record(future.result())
                del self._async_loads[request_id]
                recving.add(request_id)
        return set(), recving

    def take_report(self) -> WorkerReport | None:
        """Measurements since the last call (None when there are none)."""
        with self._lock:
            report, self._report = self._report, WorkerReport()
        return report or None

    def busy(self) -> bool:
        """True while an asynchronous load has not been reported, or a write is running."""
        return bool(self._async_loads) or any(not f.done() for f in self._writes)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def tier_held(catalog: BackendCatalog, disk_root: Path | None) -> Held:
    """What each tier really holds: the disk tier by its files (a file deleted behind the backend's
    back is gone, whatever its in-memory index says), other tiers by their backends' headers."""
    from nexuskv.dataplane.disk import stored_header

    by_headers = catalog_probe(catalog)

    def held(tier: Tier, keys: Sequence[PayloadKey]) -> list[bool]:
        if tier is Tier.DISK and disk_root is not None:
            return [stored_header(disk_root, k) is not None for k in keys]
        return list(by_headers(tier, keys))
    return held
