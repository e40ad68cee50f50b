"""The worker side's saves, after ``wait_for_save`` copied them out: a bounded queue to one writer
thread, which writes them and announces only what it wrote.

:class:`~connectors.vllm.worker_side.WorkerSide` gathers a step's filled blocks out of the paged KV
(one batched gather per layer) and hands them to :meth:`SaveWriter.enqueue`. The queue is bounded
in bytes of copied-out blocks: a save that does not fit is dropped, counted and logged, and never
waited for, so the engine's step never blocks on a write. The writer thread (one, so a request's
saves are written, hence announced, in order) makes the payloads and writes them:

* through the worker's :class:`~nexuskv.dataplane.tiers.TierManager` where it manages the tier
  (admitted by utility; what it admits or evicts, the tier's publisher announces), checking on the
  tier only the blocks the manager believes held (a file deleted behind its back is forgotten,
  then written again);
* otherwise straight to the tier's backend, announcing each chained run it wrote or found held.

A save queued, or dropped, is never announced. :meth:`close` drains the queue (bounded in time)
and counts what it could not write as dropped.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from connectors.vllm.meta import CopyTiming, SaveSpec
from connectors.vllm.tier_publisher import TierBlock, TierPublisher
from nexuskv.dataplane.backend import host_view
from nexuskv.dataplane.batch_copy import Gathered
from nexuskv.dataplane.catalog import BackendCatalog
from nexuskv.dataplane.payload import PayloadHeader, PayloadKey
from nexuskv.dataplane.tier_facts import BlockIdentity
from nexuskv.dataplane.tiers import SaveBlock, TierManager
from nexuskv.descriptor import StateDescriptor, Tier
from nexuskv.entries import EntryLocation
from nexuskv.errors import DataPlaneError, TierUnavailableError
from streams.bus.metrics import METRICS

__all__ = ["SaveWriter"]

log = logging.getLogger("nexuskv.vllm")

#: Which of these payloads does a tier hold, really (True per key)?
Held = Callable[[Tier, Sequence[PayloadKey]], Sequence[bool]]


class SaveWriter:
    """The bounded save queue and its writer thread, for one worker side.

    ``stats`` and ``lock`` are the worker side's (one set of counters for the connector);
    ``copied`` records a copy timing (the worker side's report and observations);
    :attr:`block_bytes` is set once the worker side knows the KV layout.
    """

    def __init__(self, descriptor: StateDescriptor, catalog: BackendCatalog, *, held: Held,
                 tiers: TierManager | None, publisher: TierPublisher | None, identity: Any, group: int,
                 stats: dict[str, Any], lock: threading.Lock, copied: Callable[..., None], queue_bytes: int,
                 clock: Callable[[], float] = time.perf_counter, wall: Callable[[], float] = time.time) -> None:
        self.descriptor = descriptor
        self.catalog = catalog
        self.held = held
        self.tiers = tiers
        self.publisher = publisher
        self._identity = identity
        self._group = group
        self.stats = stats
        self._lock = lock
        self._copied = copied
        self.queue_bytes = queue_bytes
        self.clock, self.wall = clock, wall
        self.block_bytes = 0
        self._ticked = 0.0
        self._saves: collections.deque[tuple[SaveSpec, Gathered]] = collections.deque()
        self._queued_bytes = 0
        self._writing = 0  # saves taken by the writer and not finished
        self._cv = threading.Condition(threading.Lock())
        self._closing = False
        self._thread = threading.Thread(target=self._write_loop, name="nexuskv-kv-writer", daemon=True)
        self._thread.start()

    # -- the step thread's side ----------------------------------------------------------------

    def enqueue(self, spec: SaveSpec, gather: Callable[[Sequence[int]], Gathered]) -> None:
        """Copy ``spec``'s blocks out with ``gather`` and queue them, or drop the save (counted)
        when the queue is full: never wait for the writer."""
        nbytes = len(spec.block_ids) * self.block_bytes
        with self._cv:
            fits = not self._closing and self._queued_bytes + nbytes <= self.queue_bytes
            if fits:
                self._queued_bytes += nbytes
        if not fits:  # a later miss, counted
            self.dropped(spec, "the save queue is full" if not self._closing else "the worker side is closing")
            return
        try:
            gathered = gather(spec.block_ids)
        except Exception as exc:  # noqa: BLE001 - a save that cannot be copied is a later miss, not a dead engine
            with self._cv:
                self._queued_bytes -= nbytes
            self.dropped(spec, f"copying it out failed: {type(exc).__name__}: {exc}")
            return
        with self._cv:
            self._saves.append((spec, gathered))
            self.stats["saves_queued"] += 1
            self._cv.notify()

    def dropped(self, spec: SaveSpec, why: str) -> None:
        with self._lock:
            first = self.stats["saves_dropped"] == 0
            self.stats["saves_dropped"] += 1
            self.stats["blocks_dropped"] += len(spec.block_ids)
        METRICS.transfers.labels(status="save_dropped", link=f"gpu->{spec.tier.value}").inc()
        (log.warning if first else log.debug)("request %s: %d blocks not saved to %s: %s (%d saves dropped so far)",
                                              spec.request_id, len(spec.block_ids), spec.tier.value, why,
                                              self.stats["saves_dropped"])

    def pending(self) -> int:
        """Saves copied out and not yet written."""
        with self._cv:
            return len(self._saves) + self._writing

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every save queued so far is written and announced (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._saves or self._writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(self._saves) + self._writing} saves not written in {timeout_s} s")
                self._cv.wait(left)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop: the writer drains the queue for up to ``timeout_s``; what it could not write is
        dropped, counted, never announced."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout_s)
        with self._cv:
            left, self._saves = list(self._saves), collections.deque()
        for spec, gathered in left:
            gathered.release()
            self.dropped(spec, "the worker side closed before it was written")

    # -- the writer thread -----------------------------------------------------------------------

    def _write_loop(self) -> None:
        """Saves in the order they were queued; a save is announced only once written."""
        while True:
            with self._cv:
                while not self._saves and not self._closing:
                    self._cv.wait()
                if not self._saves:
                    return
                spec, gathered = self._saves.popleft()
                self._writing += 1
            try:
                payloads = gathered.payloads()
                gathered.release()
                self.write(spec, list(payloads.unbind(0)))
            except Exception as exc:  # noqa: BLE001 - a failed save is a later miss; the writer goes on
                log.warning("request %s: saving %d blocks failed: %s", spec.request_id, len(spec.block_ids), exc)
            finally:
                gathered.release()
                with self._cv:
                    self._writing -= 1
                    self._queued_bytes -= gathered.nbytes
                    self._cv.notify_all()

    def write(self, spec: SaveSpec, copies: Sequence[torch.Tensor]) -> int:
        """Write the blocks the tier lacks, announce the run; returns blocks written."""
        t0 = self.clock()
        did = self.descriptor.descriptor_id
        where = EntryLocation(worker=self.catalog.worker, tier=spec.tier, group=self._group)
        backend = self.catalog.destination_for(where, len(spec.keys) * self.block_bytes)
        if backend is None:
            log.warning("request %s: no backend for %s", spec.request_id, where)
            return 0
        pks = [PayloadKey(did, k, self._group) for k in spec.keys]
        tiers = self.tiers
        managed = tiers is not None and any(b.capabilities.tier is spec.tier for b in tiers.backends())
        # Managed, only what the manager believes held needs checking (a file deleted behind its
        # back); a block it does not hold is written anyway: no probe (a failed open) per new block.
        probed = [pk for pk in pks if tiers.holds(pk, spec.tier)] if managed else pks
        try:
            held = list(self.held(spec.tier, probed)) if probed else []
        except TierUnavailableError as exc:
            log.warning("request %s: cannot check the %s tier: %s", spec.request_id, spec.tier.value, exc)
            return 0
        if managed:
            lost = [pk for pk, ok in zip(probed, held) if not ok]
            return self._write_managed(spec, copies, pks, lost, tiers, t0)
        bs = self.descriptor.block_size
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
            self.stats["bytes_saved"] += written * self.block_bytes
        if written:
            self._copied(CopyTiming(Tier.GPU, spec.tier, written, self.clock() - t0), request_id=spec.request_id)
        return written

    def _write_managed(self, spec: SaveSpec, copies: Sequence[torch.Tensor], pks: list[PayloadKey],
                       lost: list[PayloadKey], tiers: TierManager, t0: float) -> int:
        """Save through the tier manager: admitted by utility, announced by the tier's publisher.
        ``lost``: blocks the manager holds that the tier no longer does."""
        bs = self.descriptor.block_size
        now = self.wall()
        if now - self._ticked >= 1.0:  # pins and leases lapse, garbage goes (at most once a second)
            self._ticked = now
            tiers.tick()
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
