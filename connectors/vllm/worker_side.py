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

**Loads.** The byte moving is :class:`~nexuskv.dataplane.batch_copy.PagedKV`'s: ``start_load``
hands each load to a worker thread, which reads its payloads into host memory and verifies them
(the first block that is missing, corrupt or of another descriptor ends that request's load, and
it and every later block of the request are reported by ``block_ids_with_load_errors`` — vLLM then
recomputes them (``kv_load_failure_policy="recompute"``) — and, when the tier is this worker's own,
its publisher announces them removed), then lays them out layer-major. Synchronous loads are put
in place by one batched scatter per layer: with ``layerwise`` (what the vLLM shell sets: vLLM calls
``wait_for_layer_load`` before each attention layer) layer by layer, as the forward pass reaches
it — on CUDA the engine's stream then waits only for that layer's copy, so later layers' copies
overlap earlier layers' compute; otherwise all at once before ``start_load`` returns. A load with a
layer vLLM never waited for is reported as load errors (it was not in place when the layer ran).
Asynchronous loads are put in place on their worker thread and reported by ``get_finished``.

**Saves.** ``wait_for_save`` (after the step's forward pass) copies the step's filled blocks out
of the paged KV at once — vLLM may reuse a block as soon as its request ends — in one batched
gather per layer into a host buffer (pinned, on a side stream that the engine's stream waits for
before its next kernels, where CUDA is present), and queues them for the writer thread. The queue
(:class:`~connectors.vllm.save_writer.SaveWriter`) is bounded (``save_queue_bytes`` of copied-out blocks): a save that does not fit is dropped,
counted (``saves_dropped``, ``blocks_dropped``, and ``nexuskv_transfer_outcomes{status=
"save_dropped"}``), logged, and never waited for — the step never blocks on a write. The writer
thread (one, so a request's saves are written in order) makes the payloads, checksums and writes
them through the worker's :class:`~nexuskv.dataplane.tiers.TierManager`, and only what it wrote is
announced: a save queued, or dropped, is never announced. ``close`` drains the queue (bounded in
time) and counts what it could not write as dropped. The tier manager is the capacity authority of
the disk tier: a full tier makes room by utility (this worker's least valuable blocks leave, prefix
parents after the blocks chained from them) and refuses only what is worth less than everything it
would displace; a refusal is counted (``blocks_refused``) and logged once per save, never silent.
What the manager admits or evicts, the tier's
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
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from connectors.descriptors import publisher_identity
from connectors.vllm.meta import ConnectorMeta, CopyTiming, LoadSpec, PrefillTiming, SaveSpec, WorkerReport
from connectors.vllm.save_writer import SaveWriter
from connectors.vllm.scheduler_side import check_descriptor
from connectors.vllm.tier_publisher import TierBlock, TierPublisher
from nexuskv.contracts.observations import ObservationRecord, PrefillObservation, TransferObservation
from nexuskv.dataplane.backend import BufferPool, host_view
from nexuskv.dataplane.batch_copy import PagedKV, PagedLayer, Scatter
from nexuskv.dataplane.catalog import BackendCatalog
from nexuskv.dataplane.payload import PayloadHeader, PayloadKey
from nexuskv.dataplane.tier_facts import BlockIdentity, TierChange
from nexuskv.dataplane.tiers import TierManager
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
class _Outcome:
    request_id: str
    done: int  # blocks loaded
    failed_block_ids: tuple[int, ...] = ()
    failed_keys: tuple[int, ...] = ()
    reason: str | None = None
    source: Tier | None = None
    seconds: float = 0.0


@dataclass(slots=True)
class _Read:
    """A synchronous load whose payloads are read and verified, waiting to be put in place."""

    spec: LoadSpec
    outcome: _Outcome
    scatter: Scatter | None  # None: no block was read


DECODE_SHARE = 8  # prefill tokens per decoding request a timed step may carry (see the module docstring)
DEFAULT_SAVE_QUEUE_BYTES = 256 << 20  # host bytes of saves copied out and not yet written (see WorkerSide)


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
                 tiers: TierManager | None = None, layerwise: bool = False,
                 save_queue_bytes: int = DEFAULT_SAVE_QUEUE_BYTES) -> None:
        check_descriptor(descriptor)
        if save_queue_bytes <= 0:
            raise ConfigError("save_queue_bytes", f"must be > 0, got {save_queue_bytes}")
        self.descriptor = descriptor
        self.catalog = catalog
        self.held = held or tier_held(catalog, None)
        self.publisher = publisher
        self._identity = publisher_identity(descriptor)
        self._own_tiers = tiers is None and publisher is not None  # built here: closed with this side
        if self._own_tiers:
            tiers = TierManager(catalog, facts=PublisherSink(publisher), clock=wall)
            bs = descriptor.block_size
            adopted = tiers.adopt([(PayloadKey(descriptor.descriptor_id, b.key, descriptor.layer_groups[0].kv_group),
                                    BlockIdentity(self._identity, b.tokens, bs, parent=b.parent), 0)
                                   for b in publisher.reannounced], tenant=descriptor.tenant_namespace)
            log.info("%s: the tier manager adopted %d re-announced blocks", publisher.name, adopted)
        self.tiers = tiers
        self.observe = observe
        self.model = model or descriptor.model
        self.profile = profile
        self.measure = measure
        self.clock, self.wall = clock, wall
        self._group = descriptor.layer_groups[0].kv_group
        self._kv: PagedKV | None = None
        self._block_bytes = 0
        self._cuda = torch.cuda.is_available()
        self._buffers = BufferPool(pin=self._cuda, max_bytes=save_queue_bytes)
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="nexuskv-kv")
        self._lock = threading.Lock()
        self._async_loads: dict[str, Future] = {}
        self.layerwise = layerwise
        self._reads: list[Future] = []  # this step's synchronous loads, being read
        self._placing: list[_Read] = []  # ... read, being put in place layer by layer
        self._releasing: list[Scatter] = []  # put in place; their buffers go back once their copies end
        self._load_errors: set[int] = set()
        self._report = WorkerReport()
        self._step_started: float | None = None
        self._step_load_s = 0.0
        self.stats = {"blocks_loaded": 0, "blocks_failed": 0, "blocks_saved": 0, "blocks_already_held": 0,
                      "blocks_unchained": 0, "blocks_refused": 0, "bytes_loaded": 0, "bytes_saved": 0,
                      "prefill_timings": 0, "saves_queued": 0, "saves_dropped": 0, "blocks_dropped": 0,
                      "loads_unwaited": 0, "save_step_s": 0.0}
        # Saves: a bounded queue (in bytes) to one writer thread, FIFO, so a request's blocks are
        # written, hence announced, in order; a save that does not fit is dropped, never waited for.
        self.save_queue_bytes = save_queue_bytes
        self._saver = SaveWriter(descriptor, catalog, held=self.held, tiers=tiers, publisher=publisher,
                                 identity=self._identity, group=self._group, stats=self.stats, lock=self._lock,
                                 copied=self._copied, queue_bytes=save_queue_bytes, clock=clock, wall=wall)

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
            layers.append(PagedLayer(name, t, dim, nbytes, offset))
            offset += nbytes
        expected = sum(g.bytes_per_token for g in self.descriptor.layer_groups) * self.descriptor.block_size
        if offset != expected:
            raise ConfigError("kv_caches", f"{len(layers)} layers hold {offset} bytes per block; descriptor "
                                           f"{self.descriptor.descriptor_id} says {expected}")
        self._kv, self._block_bytes = PagedKV(layers, pool=self._buffers), offset
        self._saver.block_bytes = offset
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
        """Start this step's loads: their payloads are read and verified on worker threads.

        Asynchronous loads are put in place on those threads too, and reported by ``get_finished``.
        Synchronous ones are put in place by :meth:`wait_for_layer_load`, one layer at a time, when
        ``layerwise`` (vLLM calls it before each attention layer); otherwise here, before the
        forward pass, in one batched copy per layer.
        """
        t0 = self.clock()
        for spec in meta.loads:
            if spec.load_async:
                self._async_loads[spec.request_id] = self._pool.submit(self._load_async, spec)
            else:
                self._reads.append(self._pool.submit(self._read, spec))
        if self._reads and not self.layerwise:
            self._take_reads()
            for read in self._placing:
                if read.scatter is not None:
                    read.scatter.put()
            self._placed()
        self._step_load_s += self.clock() - t0

    def _take_reads(self) -> None:
        """Wait for this step's synchronous reads (their layers are needed now)."""
        reads, self._reads = self._reads, []
        self._placing.extend(f.result() for f in reads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Put layer ``layer_name`` of this step's synchronous loads in place (vLLM calls it before
        the layer's attention): on CUDA the engine's stream waits for that layer's copy only."""
        if not self._reads and not self._placing:
            return
        t0 = self.clock()
        if self._reads:
            self._take_reads()
        index = self._kv.layer_index(layer_name) if self._kv is not None else None
        if index is not None:
            for read in self._placing:
                if read.scatter is not None:
                    read.scatter.put(index)
        self._step_load_s += self.clock() - t0

    def _placed(self) -> None:
        """Report this step's synchronous loads; a load with a layer vLLM never waited for was not
        in place when that layer ran: its blocks are load errors (vLLM recomputes them)."""
        if self._reads:  # started but never waited for at all
            self._take_reads()
        placing, self._placing = self._placing, []
        for read in placing:
            outcome, scatter = read.outcome, read.scatter
            if scatter is not None:
                missing = scatter.missing_layers()
                if missing:
                    self.stats["loads_unwaited"] += 1
                    spec = read.spec
                    outcome = replace(outcome, done=0, failed_block_ids=spec.block_ids, failed_keys=(),
                                      reason=f"layer {missing[0]} was not waited for before it ran "
                                             f"({len(missing)} layers)")
                self._releasing.append(scatter)
            self._record(outcome)
        still = []
        for scatter in self._releasing:
            if scatter.ready():
                scatter.release()
            else:
                still.append(scatter)
        self._releasing = still

    def wait_for_save(self, meta: ConnectorMeta) -> None:
        """The step's forward pass is done (enqueued, on CUDA): time it, report its loads, copy its
        filled blocks out in one batched gather per save and queue them for the writer thread."""
        if self._placing or self._reads:
            self._placed()
        if self._step_started is not None:
            self._sync()
            elapsed = self.clock() - self._step_started - self._step_load_s
            self._step_started = None
            work = meta.prefills[0]
            self._timed_prefill(work.request_id, PrefillTiming(work.uncached, work.context, elapsed))
        if meta.saves:
            t0 = self.clock()
            for spec in meta.saves:
                if spec.block_ids:
                    self._enqueue_save(spec)
            self.stats["save_step_s"] += self.clock() - t0  # what the saves cost the step thread
    def _enqueue_save(self, spec: SaveSpec) -> None:
        assert self._kv is not None
        self._saver.enqueue(spec, self._kv.gather)

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

    def _read(self, spec: LoadSpec) -> _Read:
        """Read and verify a load's payloads into host memory, in order; the first missing, corrupt
        or foreign one ends it (it and the blocks after it are load errors)."""
        if spec.source is None:
            return _Read(spec, _Outcome(spec.request_id, 0, spec.block_ids, (),
                                        "the allocation did not match the decision"), None)
        if not spec.keys:
            return _Read(spec, _Outcome(spec.request_id, 0), None)
        t0 = self.clock()
        did = self.descriptor.descriptor_id
        first = PayloadKey(did, spec.keys[0], self._group)
        backend = self.catalog.source_for(spec.source, first)
        tier = spec.source.tier
        if backend is None:
            return _Read(spec, _Outcome(spec.request_id, 0, spec.block_ids, spec.keys,
                                        f"no reachable backend at {spec.source} holds block {spec.first_block}",
                                        tier, self.clock() - t0), None)
        stage = self._kv.staging(len(spec.keys))
        done, failure = len(spec.keys), None
        for i, key in enumerate(spec.keys):
            try:
                backend.read_verified(PayloadKey(did, key, self._group), stage[i])
            except (DataPlaneError, ValueError) as exc:
                done, failure = i, f"block {spec.first_block + i}: {exc}"
                break
        scatter = self._kv.scatter(stage, spec.block_ids[:done]) if done else None
        if failure is None:
            return _Read(spec, _Outcome(spec.request_id, done, source=tier, seconds=self.clock() - t0), scatter)
        return _Read(spec, _Outcome(spec.request_id, done, spec.block_ids[done:], spec.keys[done:], failure, tier,
                                    self.clock() - t0), scatter)

    def _load_async(self, spec: LoadSpec) -> _Outcome:
        """An asynchronous load, whole, on a worker thread: read, verify, put every layer in place."""
        read = self._read(spec)
        if read.scatter is not None:
            read.scatter.put()
            read.scatter.release()  # waits for its copies: the load is reported only once they ended
        return read.outcome

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

    # -- saves (connectors.vllm.save_writer) ---------------------------------------------------

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every save queued so far is written and announced (tests, shutdown)."""
        self._saver.flush(timeout_s)

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
        """True while an asynchronous load has not been reported, or a save is queued or being written."""
        return bool(self._async_loads) or self._saver.pending() > 0

    def pending_saves(self) -> int:
        """Saves copied out and not yet written."""
        return self._saver.pending()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop: the writer drains the queue for up to ``timeout_s``; what it could not write is
        dropped, counted, never announced. The tier manager closes last (its folder is free again)."""
        self._saver.close(timeout_s)
        self._pool.shutdown(wait=True)
        for scatter in self._releasing:
            scatter.release()
        self._releasing = []
        if self._own_tiers and self.tiers is not None:
            self.tiers.close()  # its tier folder's lock goes with it: a restarted worker side takes it


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
