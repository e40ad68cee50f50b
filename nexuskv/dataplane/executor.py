"""The transfer executor: carries out TransferCommands between tier backends, honestly.

For one command it resolves the source and destination backends through the
:class:`~nexuskv.dataplane.catalog.BackendCatalog` (by capability, never by name), checks
everything it can before moving a byte (deadline, cancellation, every block present at the
source, room at the destination), then copies block by block on ``lanes`` threads — each block
read straight into the buffer it will be stored in, verified against its checksum there, then
committed (:mod:`nexuskv.dataplane.backend`) — or, into a disk or remote tier from a tier
that lends host views, verified in place and written from there (the remote backend verifies
what it sends against the same checksum, so the executor does not hash it twice). The
outcome is one
:class:`~nexuskv.contracts.transfers.TransferResult`:

* ``completed`` only when every block is at the destination, verified, before the deadline;
* ``deadline_exceeded`` when the deadline passed before or during the copy (checked before each
  block and at the end: a transfer that finishes late is not reported as done);
* ``cancelled`` when :meth:`TransferExecutor.cancel` was called for it;
* ``integrity_error`` when a block's bytes or header do not match its checksum or address;
* ``rejected_capacity`` when the destination cannot hold the blocks: the room is reserved before
  the first byte moves, so a transfer that does not fit is rejected whole, with the numbers (the
  shared remote tier can only be checked, not reserved: a PUT it refuses midway rolls back);
* ``not_found`` when a block is not at the source; ``failed`` for anything else, with the reason.

A transfer that does not complete leaves the destination as it found it: blocks it had already
committed are deleted again (blocks that were there before it are left alone). Blocks already at
the destination are not copied again, and do not count in ``blocks_moved``/``bytes_moved``.

Each transfer that moved or tried to move bytes also yields a
:class:`~nexuskv.contracts.observations.TransferObservation` (bytes, blocks, link, wall time on
a monotonic clock) for calibration. The copy engine is torch: ``Tensor.copy_`` between host
buffers on CPU worker threads, or non-blocking copies on dedicated CUDA streams from pinned
staging buffers, completed by events (:mod:`nexuskv.dataplane.cuda`), when a backend is a real
device. ``result.device`` says which: ``"cuda:N"`` or ``"cpu"`` (the host path, including the
device tier's host-memory stand-in).

Deadlines, result timestamps and the observation's ``observed_at`` use the injected ``clock``
(seconds since the epoch); durations use ``time.perf_counter``.

With a :class:`~nexuskv.dataplane.tiers.TierManager` (``tiers``), the destination's room comes
from it instead of a bare reservation: a copy into a managed tier is admitted by utility (evicting
or demoting cheaper state; ``rejected_capacity`` with the manager's reason when what is there is
worth more, pinned or in use), a queued prefetch holds its room from the moment it is submitted,
the blocks a transfer reads are never evicted while it reads them, and what landed is handed to
the manager (which announces it when it knows the blocks' identity). A cancel for a transfer that
has not arrived yet is remembered (the last 4,096), so a command that arrives after its cancel
is answered ``cancelled`` at once.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from nexuskv.contracts.observations import ObservationRecord, TransferObservation
from nexuskv.contracts.transfers import TransferCommand, TransferResult, TransferStatus
from nexuskv.dataplane.backend import Reservation, TierBackend, host_view
from nexuskv.dataplane.catalog import BackendCatalog, SelectionPolicy
from nexuskv.dataplane.payload import PayloadHeader, PayloadKey, verify_payload
from nexuskv.dataplane.tiers import TierManager
from nexuskv.errors import IntegrityError, TierFullError, TierUnavailableError

__all__ = ["TransferExecutor", "TransferOutcome"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TransferOutcome:
    """What happened to one command: the result to publish, and the timing observation if any."""

    result: TransferResult
    observation: ObservationRecord | None = None

    @property
    def status(self) -> TransferStatus:
        return self.result.status


@dataclass(slots=True)
class _Job:
    command: TransferCommand
    cancelled: threading.Event = field(default_factory=threading.Event)
    reason: str = ""
    future: Future = field(default_factory=Future)


class _Abort(Exception):
    def __init__(self, status: TransferStatus, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(slots=True)
class _Progress:
    """Shared by the lanes of one transfer."""

    reservation: Reservation | None = None
    committed: list[PayloadKey] = field(default_factory=list)
    bytes: int = 0
    failure: _Abort | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, abort: _Abort) -> None:
        with self.lock:
            if self.failure is None:
                self.failure = abort


class TransferExecutor:
    """Executes transfer commands for one worker's catalog; thread-safe.

    ``lanes`` threads copy the blocks of one transfer concurrently (the second lane overlaps one
    block's checksum, which holds the GIL, with another block's copy, which does not); ``jobs``
    threads run queued transfers, earliest deadline first.
    """

    def __init__(self, catalog: BackendCatalog, *, clock: Callable[[], float] = time.time, lanes: int = 2,
                 jobs: int = 2, policy: SelectionPolicy | None = None, tiers: TierManager | None = None) -> None:
        if lanes < 1 or jobs < 1:
            raise ValueError("lanes and jobs: at least 1 each")
        if tiers is not None and tiers.catalog is not catalog:
            raise ValueError("tiers: the tier manager must own this executor's catalog")
        self.catalog = catalog
        self.clock = clock
        self.lanes = lanes
        self.policy = policy
        self.tiers = tiers
        # cancels that came before their command: transfer id -> (reason, tenant the cancel named or None)
        self._cancelled: OrderedDict[str, tuple[str, str | None]] = OrderedDict()
        self._lane_pool = ThreadPoolExecutor(max_workers=lanes - 1, thread_name_prefix="nkv-lane") if lanes > 1 else None
        self._queue: list[tuple[float, int, _Job]] = []
        self._order = itertools.count()
        self._jobs: dict[str, _Job] = {}
        self._cv = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._run_jobs, name=f"nkv-transfer-{i}", daemon=True)
                         for i in range(jobs)]
        for t in self._threads:
            t.start()

    # -- queueing ---------------------------------------------------------------------------

    def submit(self, command: TransferCommand) -> Future:
        """Queue ``command`` (earliest deadline first); the future yields its TransferOutcome."""
        job = _Job(command)
        with self._cv:
            if self._closed:
                raise RuntimeError("the transfer executor is closed")
            early = self._cancelled.pop(command.transfer_id, None)
            if early is not None and early[1] not in (None, command.tenant_namespace):
                log.warning("transfer %s: an earlier cancel named tenant %s, not its %s: ignored",
                            command.transfer_id, early[1], command.tenant_namespace)
                early = None
            if early is not None:
                job.reason = early[0]
                job.cancelled.set()
            self._jobs[command.transfer_id] = job
            heapq.heappush(self._queue, (command.deadline_at, next(self._order), job))
            self._cv.notify()
        if early is None:
            self._hold_room(command)
        return job.future

    def _hold_room(self, command: TransferCommand) -> None:
        """A queued copy into a managed tier holds its room until it runs (or its deadline)."""
        tiers = self.tiers
        if tiers is None or command.destination.worker != self.catalog.worker or command.bytes <= 0:
            return
        why = tiers.reserve(command.transfer_id, command.destination.tier, command.bytes,
                            tenant=command.tenant_namespace, expires_at=command.deadline_at, share=False)
        if why is not None:
            log.info("transfer %s: no room held while it waits (%s)", command.transfer_id, why)

    def cancel(self, transfer_id: str, reason: str = "cancelled by request", *, tenant: str | None = None) -> bool:
        """Cancel a queued or running transfer — with ``tenant``, only one of that tenant; False when
        none with that id is pending (then a command with that id that arrives later is cancelled on
        arrival, if it is that tenant's)."""
        with self._cv:
            job = self._jobs.get(transfer_id)
            if job is not None and tenant is not None and job.command.tenant_namespace != tenant:
                return False  # another tenant's copy: a cancel acts in the scope it names
            if job is None:
                self._cancelled[transfer_id] = (reason, tenant)
                while len(self._cancelled) > 4096:
                    self._cancelled.popitem(last=False)
        if self.tiers is not None:
            self.tiers.release(transfer_id, tenant=tenant)  # room held for it while queued (not a running copy's)
        if job is None:
            return False
        job.reason = reason
        job.cancelled.set()
        return True

    def pending(self) -> int:
        with self._cv:
            return len(self._jobs)

    def close(self, reason: str = "the transfer executor is stopping") -> None:
        """Cancel everything pending (each still gets its ``cancelled`` outcome) and stop."""
        with self._cv:
            self._closed = True
            jobs = list(self._jobs.values())
            self._cv.notify_all()
        for job in jobs:
            job.reason = reason
            job.cancelled.set()
        for t in self._threads:
            t.join(30)
        if self._lane_pool is not None:
            self._lane_pool.shutdown(wait=True)

    def _run_jobs(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                _, _, job = heapq.heappop(self._queue)
            try:
                outcome = self._execute(job)
            except BaseException as exc:  # never lose a future; the outcome says what broke
                log.exception("transfer %s crashed", job.command.transfer_id)
                outcome = TransferOutcome(self._result(job.command, TransferStatus.FAILED, self.clock(),
                                                       error=f"executor error: {type(exc).__name__}: {exc}"))
            with self._cv:
                self._jobs.pop(job.command.transfer_id, None)
            if self.tiers is not None:
                self.tiers.release(job.command.transfer_id)  # room it held while queued, if it never used it
            job.future.set_result(outcome)

    # -- execution --------------------------------------------------------------------------

    def execute(self, command: TransferCommand) -> TransferOutcome:
        """Run ``command`` now, in the calling thread (plus lanes); cancellable while it runs."""
        job = _Job(command)
        with self._cv:
            self._jobs[command.transfer_id] = job
        try:
            return self._execute(job)
        finally:
            with self._cv:
                if self._jobs.get(command.transfer_id) is job:
                    del self._jobs[command.transfer_id]

    def _execute(self, job: _Job) -> TransferOutcome:
        cmd = job.command
        started = self.clock()
        if job.cancelled.is_set():
            return TransferOutcome(self._result(cmd, TransferStatus.CANCELLED, started,
                                                error=f"{job.reason} before the transfer started"))
        if started >= cmd.deadline_at:
            return TransferOutcome(self._result(cmd, TransferStatus.DEADLINE_EXCEEDED, started,
                                                error=f"deadline passed {started - cmd.deadline_at:.3f}s before "
                                                      f"the transfer started"))
        src_keys = [PayloadKey(cmd.descriptor_id, k, cmd.source.group) for k in cmd.keys]
        try:
            src, dst, todo, reservation = self._plan(cmd, src_keys)
        except _Abort as abort:
            return TransferOutcome(self._result(cmd, abort.status, started, error=abort.reason))

        device = _device_of(src, dst)
        progress = _Progress(reservation=reservation)
        reading = self.tiers.reading(src, src_keys) if self.tiers is not None else contextlib.nullcontext()
        t0 = time.perf_counter()
        with reservation, reading:
            self._copy(job, src, dst, todo, progress)
        duration = time.perf_counter() - t0
        failure = progress.failure
        finished = self.clock()
        if failure is None and finished > cmd.deadline_at:
            failure = _Abort(TransferStatus.DEADLINE_EXCEEDED,
                             f"copy finished {finished - cmd.deadline_at:.3f}s after the deadline")
        if failure is not None:
            self._rollback(cmd, dst, progress.committed)
            result = self._result(cmd, failure.status, started, error=failure.reason, device=device)
        else:
            if self.tiers is not None:
                sizes = {k: h.nbytes for k, h in todo}
                self.tiers.landed(cmd.transfer_id, cmd.tenant_namespace, dst, progress.committed,
                                  [sizes[k] for k in progress.committed], lease_until=cmd.deadline_at + self.tiers.lease_s)
            result = self._result(cmd, TransferStatus.COMPLETED, started, blocks=len(progress.committed),
                                  nbytes=progress.bytes, device=device)
        observation = None
        if todo:
            observation = ObservationRecord(observed_at=self.clock(), observation=TransferObservation(
                source_tier=src.capabilities.tier, destination_tier=dst.capabilities.tier,
                backend=f"{src.capabilities.transport}->{dst.capabilities.transport}",
                worker=self.catalog.worker, bytes=progress.bytes, pages=len(progress.committed),
                duration_s=duration, ok=failure is None))
        return TransferOutcome(result, observation)

    def _plan(self, cmd: TransferCommand, keys: Sequence[PayloadKey]
              ) -> tuple[TierBackend, TierBackend, list[tuple[PayloadKey, PayloadHeader]], Reservation]:
        """Source, destination, the blocks to copy and the room reserved for them; _Abort when
        the transfer cannot start (nothing has moved then)."""
        src = self.catalog.source_for(cmd.source, keys[0])
        if src is None:
            if not self.catalog.reachable(cmd.source):
                raise _Abort(TransferStatus.FAILED, f"no backend of tier {cmd.source.tier.value} is reachable at "
                                                    f"{cmd.source} from worker {self.catalog.worker}")
            raise _Abort(TransferStatus.NOT_FOUND, f"block 0 ({keys[0]}) is not held at {cmd.source}")
        try:
            headers = src.headers(keys)
            missing = next((i for i, h in enumerate(headers) if h is None), None)
            if missing is not None:
                raise _Abort(TransferStatus.NOT_FOUND, f"block {missing} ({keys[missing]}) is not held at {cmd.source}")
            total = sum(h.nbytes for h in headers)
            dst = self.catalog.destination_for(cmd.destination, total, self.policy)
            if dst is None:
                raise _Abort(TransferStatus.FAILED, f"no backend of tier {cmd.destination.tier.value} is reachable "
                                                    f"at {cmd.destination} from worker {self.catalog.worker}")
            if dst is src:
                raise _Abort(TransferStatus.FAILED, f"source and destination resolve to the same backend {src.label}")
            there = dst.headers(keys)
            todo = [(k, h) for k, h, t in zip(keys, headers, there) if t is None]
            needed = sum(h.nbytes for _, h in todo)
            if self.tiers is not None and self.tiers.managed(dst):
                reservation, why = self.tiers.admit_copy(cmd.transfer_id, cmd.tenant_namespace, dst,
                                                         [(k, h.nbytes) for k, h in todo], expires_at=cmd.deadline_at)
                if reservation is None:
                    raise _Abort(TransferStatus.REJECTED_CAPACITY,
                                 f"destination {dst.label} ({cmd.destination}) refused {needed} bytes for "
                                 f"{len(todo)} blocks: {why}")
                return src, dst, todo, reservation
            reservation = dst.reserve(needed)
            free = dst.free_bytes() if reservation is None else 0
        except TierUnavailableError as exc:
            raise _Abort(TransferStatus.FAILED, str(exc)) from None
        if reservation is None:
            raise _Abort(TransferStatus.REJECTED_CAPACITY,
                         f"destination {dst.label} ({cmd.destination}) has {free} of {dst.capacity_bytes} bytes "
                         f"free; the transfer needs {needed} for {len(todo)} blocks")
        return src, dst, todo, reservation

    def _copy(self, job: _Job, src: TierBackend, dst: TierBackend,
              todo: list[tuple[PayloadKey, PayloadHeader]], progress: _Progress) -> None:
        lanes = min(self.lanes, len(todo))
        if lanes <= 1 or self._lane_pool is None:
            self._lane(job, src, dst, todo, progress)
            return
        shares = [todo[i::lanes] for i in range(lanes)]
        futures = [self._lane_pool.submit(self._lane, job, src, dst, share, progress) for share in shares[1:]]
        self._lane(job, src, dst, shares[0], progress)
        for f in futures:
            f.result()

    def _lane(self, job: _Job, src: TierBackend, dst: TierBackend,
              items: list[tuple[PayloadKey, PayloadHeader]], progress: _Progress) -> None:
        deadline = job.command.deadline_at
        for key, expected in items:
            if progress.failure is not None:
                return
            if job.cancelled.is_set():
                progress.fail(_Abort(TransferStatus.CANCELLED,
                                     f"{job.reason} after {len(progress.committed)} blocks"))
                return
            now = self.clock()
            if now >= deadline:
                progress.fail(_Abort(TransferStatus.DEADLINE_EXCEEDED,
                                     f"deadline passed after {len(progress.committed)} of "
                                     f"{len(job.command.keys)} blocks"))
                return
            try:
                self._copy_one(src, dst, key, expected, progress)
            except _Abort as abort:
                progress.fail(abort)
                return
            except Exception as exc:  # a backend bug must not leave the transfer unreported
                log.exception("copying %s failed", key)
                progress.fail(_Abort(TransferStatus.FAILED, f"copying {key} failed: {type(exc).__name__}: {exc}"))
                return

    def _copy_one(self, src: TierBackend, dst: TierBackend, key: PayloadKey, expected: PayloadHeader,
                  progress: _Progress) -> None:
        if dst.writes_from_views and self._copy_from_view(src, dst, key, progress.reservation):
            with progress.lock:
                progress.committed.append(key)
                progress.bytes += expected.nbytes
            return
        buf = dst.receive_buffer(expected.nbytes)
        owned = True  # until commit takes the buffer
        try:
            with _as_outcome():
                header = src.read_into(key, buf)
                if header is None:
                    raise _Abort(TransferStatus.NOT_FOUND, f"{key} vanished from {src.label} during the transfer")
                verify_payload(key, header, host_view(buf))
                owned = False
                dst.commit(header, buf, progress.reservation)
        finally:
            if owned:
                dst.release(buf)
        with progress.lock:
            progress.committed.append(key)
            progress.bytes += expected.nbytes

    @staticmethod
    def _copy_from_view(src: TierBackend, dst: TierBackend, key: PayloadKey, reservation: Reservation | None) -> bool:
        """Verify the payload where the source keeps it and write it from there; False if it cannot lend it."""
        with _as_outcome(), src.borrow(key) as lent:
            if lent is None:
                return False
            header, data = lent
            if not dst.verifies_on_commit:
                verify_payload(key, header, host_view(data))
            elif header.key != key:
                raise IntegrityError(f"payload header names {header.key}, not {key}")
            dst.commit_view(header, data, reservation)
        return True

    def _rollback(self, cmd: TransferCommand, dst: TierBackend, committed: list[PayloadKey]) -> None:
        if self.tiers is not None and self.tiers.managed(dst):
            self.tiers.abandon_copy(cmd.transfer_id, dst, committed)
            return
        for key in committed:
            try:
                dst.delete(key)
            except TierUnavailableError as exc:
                log.warning("rollback of %s on %s failed: %s", key, dst.label, exc)

    def _result(self, cmd: TransferCommand, status: TransferStatus, started: float, *, error: str | None = None,
                blocks: int = 0, nbytes: int = 0, device: str = "cpu") -> TransferResult:
        finished = max(self.clock(), started)
        return TransferResult(transfer_id=cmd.transfer_id, request_id=cmd.request_id, status=status,
                              source=cmd.source, destination=cmd.destination, blocks_moved=blocks,
                              bytes_moved=nbytes, started_at=started, finished_at=finished, device=device,
                              error=error)


@contextlib.contextmanager
def _as_outcome() -> Iterator[None]:
    """Data-plane errors of one block as the transfer status they mean."""
    try:
        yield
    except IntegrityError as exc:
        raise _Abort(TransferStatus.INTEGRITY_ERROR, str(exc)) from None
    except TierFullError as exc:
        raise _Abort(TransferStatus.REJECTED_CAPACITY, str(exc)) from None
    except TierUnavailableError as exc:
        raise _Abort(TransferStatus.FAILED, str(exc)) from None


def _device_of(src: TierBackend, dst: TierBackend) -> str:
    """What executed the copy: the CUDA device when either side is real device memory, else the CPU."""
    for b in (dst, src):
        if b.capabilities.real_device:
            return b.capabilities.device
    return "cpu"
