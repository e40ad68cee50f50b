"""The tier backend interface every tier implements, and the buffer pool they share.

A transfer moves one payload in three steps, so that each byte is copied once and checked once::

    buf = destination.receive_buffer(nbytes)   # host memory the payload will arrive in
    header = source.read_into(key, buf)        # the copy (None: the source lacks it)
    verify_payload(key, header, buf)           # integrity, on the bytes that arrived
    destination.commit(header, buf)            # stored; the destination owns ``buf`` now

For host-memory tiers ``buf`` *is* the stored payload (no second copy); the CUDA device tier
returns a pinned staging buffer and uploads it on a dedicated stream in ``commit``; the disk
and remote tiers write or send it. A tier never stores a payload it has not been handed whole,
and a full tier raises :class:`~nexuskv.errors.TierFullError` having stored nothing.

When the source keeps payloads in host memory (:meth:`TierBackend.borrow`) and the destination
writes or sends bytes rather than keeping a buffer (``writes_from_views``: disk, remote), the
payload is verified in place at the source and written from there (:meth:`TierBackend.commit_view`):
no staging copy. The remote backend verifies the bytes before it sends them to its store.
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from nexuskv.dataplane.capabilities import Capabilities
from nexuskv.dataplane.payload import PayloadHandle, PayloadHeader, PayloadKey, verify_payload
from nexuskv.errors import DataPlaneError, IntegrityError, TierFullError

__all__ = ["TierBackend", "StagedBackend", "Reservation", "BufferPool", "host_view"]


class TierBackend(ABC):
    """One tier's store of payloads: capacity in bytes, payload handles, checksummed reads."""

    #: True when commit_view writes straight from a borrowed host view (disk, remote): a transfer
    #: into this tier then needs no staging buffer when its source can lend views.
    writes_from_views = False
    #: True when commit itself verifies the bytes against the header's checksum before storing
    #: (the remote backend does, before sending): the executor then does not hash them a second time.
    verifies_on_commit = False
    #: The folder this backend keeps its payloads in (the disk tier), None for memory and remote
    #: tiers: the tier manager that manages it locks it (:mod:`nexuskv.dataplane.folder_lock`).
    folder: Path | None = None

    def __init__(self, *, label: str, capacity_bytes: int, capabilities: Capabilities) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes: must be >= 0, got {capacity_bytes}")
        self.label = label
        self.capacity_bytes = int(capacity_bytes)
        self.capabilities = capabilities
        self._lock = threading.Lock()
        self._used = 0
        self._reserved = 0

    # -- accounting -------------------------------------------------------------------------

    def used_bytes(self) -> int:
        """Payload bytes stored now."""
        with self._lock:
            return self._used

    def free_bytes(self) -> int:
        """Payload bytes that still fit (neither stored nor reserved)."""
        with self._lock:
            return self.capacity_bytes - self._used - self._reserved

    def reserve(self, nbytes: int) -> Reservation | None:
        """Set ``nbytes`` aside for commits that pass the reservation; None when they do not fit.

        A transfer reserves all it needs before it copies a byte, so concurrent transfers into a
        small tier are admitted or rejected whole instead of all failing halfway.
        """
        with self._lock:
            if self._used + self._reserved + nbytes > self.capacity_bytes:
                return None
            self._reserved += nbytes
        return Reservation(self, nbytes)

    def _admit(self, key: PayloadKey, nbytes: int, reservation: Reservation | None = None) -> None:
        """Account ``nbytes`` (call with the lock held), from ``reservation`` when it covers them."""
        if reservation is not None and reservation.backend is self and reservation.remaining >= nbytes:
            reservation.remaining -= nbytes
            self._reserved -= nbytes
        elif self._used + self._reserved + nbytes > self.capacity_bytes:
            raise TierFullError(f"{self.label}: {nbytes} bytes for {key} do not fit "
                                f"({self.capacity_bytes - self._used - self._reserved} of {self.capacity_bytes} free)")
        self._used += nbytes

    def _handle(self, header: PayloadHeader) -> PayloadHandle:
        return PayloadHandle(tier=self.capabilities.tier, backend=self.label, key=header.key,
                             nbytes=header.nbytes, checksum=header.checksum)

    # -- the interface ----------------------------------------------------------------------

    @abstractmethod
    def header(self, key: PayloadKey) -> PayloadHeader | None:
        """The stored payload's header, or None when this tier does not hold ``key``."""

    @abstractmethod
    def keys(self) -> list[PayloadKey]:
        """Every payload held, in no particular order."""

    @abstractmethod
    def read_into(self, key: PayloadKey, out: torch.Tensor) -> PayloadHeader | None:
        """Copy the payload's bytes into ``out`` (uint8, ``nbytes`` long); None when not held.

        Returns the header *as stored*, which the caller verifies against the bytes in ``out``.
        """

    @abstractmethod
    def receive_buffer(self, nbytes: int) -> torch.Tensor:
        """A host uint8 buffer of ``nbytes`` that a payload headed for this tier arrives in."""

    @abstractmethod
    def commit(self, header: PayloadHeader, buf: torch.Tensor,
               reservation: Reservation | None = None) -> PayloadHandle:
        """Store ``buf`` (from :meth:`receive_buffer`) under ``header``; this tier owns it now.

        Raises TierFullError (nothing stored, ``buf`` released) when it does not fit. A payload
        already held under the same key is kept and ``buf`` released: the first copy wins. The
        bytes come out of ``reservation`` when it is this tier's and covers them.
        """

    @abstractmethod
    def release(self, buf: torch.Tensor) -> None:
        """Give back a buffer from :meth:`receive_buffer` that will not be committed."""

    @abstractmethod
    def delete(self, key: PayloadKey) -> bool:
        """Drop a payload; False when it was not held."""

    def clear(self) -> None:
        """Drop every payload."""
        for key in self.keys():
            self.delete(key)

    def close(self) -> None:
        """Release connections and memory; the backend is unusable afterwards."""

    # -- conveniences built on the interface ------------------------------------------------

    def contains(self, key: PayloadKey) -> bool:
        return self.header(key) is not None

    def headers(self, keys: Sequence[PayloadKey]) -> list[PayloadHeader | None]:
        """:meth:`header` of each key, in order (one round trip on the remote tier)."""
        return [self.header(k) for k in keys]

    @contextlib.contextmanager
    def borrow(self, key: PayloadKey) -> Iterator[tuple[PayloadHeader, torch.Tensor] | None]:
        """A zero-copy host view of a stored payload for the block's duration, or None.

        None when the tier cannot lend one (bytes not in this process's host memory) or does
        not hold ``key``. A borrowed payload deleted meanwhile keeps its bytes until returned.
        """
        yield None

    def commit_view(self, header: PayloadHeader, data: torch.Tensor,
                    reservation: Reservation | None = None) -> PayloadHandle:
        """Store a copy of host tensor ``data`` (the caller keeps it): :meth:`put`, unless cheaper."""
        return self.put(header, data, reservation)

    def commit_views(self, entries: Sequence[tuple[PayloadHeader, torch.Tensor, Reservation | None]]
                     ) -> list[PayloadHandle | DataPlaneError]:
        """:meth:`commit_view` of each ``(header, data, reservation)``; per entry its handle, or the
        error it raised (a tier that can write many at once for less overrides it: disk)."""
        out: list[PayloadHandle | DataPlaneError] = []
        for header, data, reservation in entries:
            try:
                out.append(self.commit_view(header, data, reservation))
            except DataPlaneError as exc:
                out.append(exc)
        return out

    def put(self, header: PayloadHeader, data: torch.Tensor, reservation: Reservation | None = None) -> PayloadHandle:
        """Copy ``data`` (a uint8 tensor of ``header.nbytes``) in and commit it."""
        buf = self.receive_buffer(header.nbytes)
        try:
            buf.copy_(data.reshape(-1))
        except BaseException:
            self.release(buf)
            raise
        return self.commit(header, buf, reservation)

    def read_verified(self, key: PayloadKey, out: torch.Tensor) -> PayloadHeader:
        """Copy the payload into host tensor ``out`` and verify it there.

        IntegrityError when the tier does not hold it (any more) or its bytes or address do not
        match: for a reader that was told the payload is there and must not use anything else.
        """
        header = self.read_into(key, out)
        if header is None:
            raise IntegrityError(f"{key} is no longer held by {self.label}")
        verify_payload(key, header, host_view(out))
        return header

    def get(self, key: PayloadKey) -> tuple[PayloadHeader, torch.Tensor] | None:
        """A verified host copy of the payload, or None when not held. IntegrityError if corrupt."""
        header = self.header(key)
        if header is None:
            return None
        out = torch.empty(header.nbytes, dtype=torch.uint8)
        stored = self.read_into(key, out)
        if stored is None:
            return None
        verify_payload(key, stored, host_view(out))
        return stored, out

    def __iter__(self) -> Iterator[PayloadKey]:
        return iter(self.keys())

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.label} {self.capabilities.tier.value} {self.used_bytes()}/{self.capacity_bytes} B>"


class StagedBackend(TierBackend):
    """A tier that writes or sends bytes from host memory rather than keeping buffers (disk, remote).

    Payloads headed here arrive in pooled host buffers (pinned with CUDA) that are given back
    once written; :meth:`commit` is :meth:`commit_view` of the buffer; reads into device memory
    land in a pooled host buffer first (:meth:`_host_target`).
    """

    writes_from_views = True

    def __init__(self, *, label: str, capacity_bytes: int, capabilities: Capabilities, pin: bool) -> None:
        super().__init__(label=label, capacity_bytes=capacity_bytes, capabilities=capabilities)
        self._pool = BufferPool(pin=pin, max_bytes=64 << 20)

    @abstractmethod
    def commit_view(self, header: PayloadHeader, data: torch.Tensor,
                    reservation: Reservation | None = None) -> PayloadHandle:
        """Write or send host tensor ``data`` under ``header`` (the caller keeps ``data``)."""

    def commit(self, header: PayloadHeader, buf: torch.Tensor,
               reservation: Reservation | None = None) -> PayloadHandle:
        try:
            return self.commit_view(header, buf, reservation)
        finally:
            self.release(buf)

    def receive_buffer(self, nbytes: int) -> torch.Tensor:
        return self._pool.take(nbytes)

    def release(self, buf: torch.Tensor) -> None:
        self._pool.give(buf)

    @contextlib.contextmanager
    def _host_target(self, out: torch.Tensor) -> Iterator[torch.Tensor]:
        """``out`` itself when in host memory; else a pooled host buffer copied into ``out`` on success."""
        if out.device.type == "cpu":
            yield out
            return
        staged = self._pool.take(out.numel())
        try:
            yield staged
            out.copy_(staged)
        finally:
            self._pool.give(staged)

    def close(self) -> None:
        self._pool.clear()


class Reservation:
    """Bytes set aside in one backend; :meth:`release` returns what commits did not use."""

    __slots__ = ("backend", "nbytes", "remaining")

    def __init__(self, backend: TierBackend, nbytes: int) -> None:
        self.backend = backend
        self.nbytes = nbytes
        self.remaining = nbytes

    def release(self) -> None:
        backend = self.backend
        with backend._lock:
            backend._reserved -= self.remaining
            self.remaining = 0

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def host_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy."""
    if t.device.type != "cpu":
        raise ValueError(f"host_view: tensor is on {t.device}, not in host memory")
    if t.dtype is not torch.uint8 or not t.is_contiguous():
        t = t.contiguous().view(torch.uint8)
    return memoryview(t.numpy()).cast("B")


class BufferPool:
    """Host uint8 buffers kept by size for reuse, so steady-state transfers touch warm memory.

    Fresh memory costs a page fault per 4 KiB on first write (and pinning costs a syscall per
    allocation), which a copy of a few MiB would otherwise pay every time. At most
    ``max_bytes`` are kept idle; ``pin`` allocates page-locked memory (only with CUDA).
    """

    def __init__(self, *, pin: bool, max_bytes: int) -> None:
        self.pin = pin
        self.max_bytes = max_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._idle = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            stack = self._free.get(nbytes)
            if stack:
                self._idle -= nbytes
                return stack.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buf: torch.Tensor) -> None:
        n = buf.numel()
        with self._lock:
            if self._idle + n <= self.max_bytes:
                self._free.setdefault(n, []).append(buf)
                self._idle += n

    def idle_bytes(self) -> int:
        with self._lock:
            return self._idle

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._idle = 0
