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
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch

from nexuskv.dataplane.capabilities import Capabilities
from nexuskv.dataplane.payload import PayloadHandle, PayloadHeader, PayloadKey, verify_payload
from nexuskv.errors import TierFullError

__all__ = ["TierBackend", "BufferPool", "host_view"]


class TierBackend(ABC):
    """One tier's store of payloads: capacity in bytes, payload handles, checksummed reads."""

    def __init__(self, *, label: str, capacity_bytes: int, capabilities: Capabilities) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes: must be >= 0, got {capacity_bytes}")
        self.label = label
        self.capacity_bytes = int(capacity_bytes)
        self.capabilities = capabilities
        self._lock = threading.Lock()
        self._used = 0

    # -- accounting -------------------------------------------------------------------------

    def used_bytes(self) -> int:
        """Payload bytes stored now."""
        with self._lock:
            return self._used

    def free_bytes(self) -> int:
        """Payload bytes that still fit."""
        with self._lock:
            return self.capacity_bytes - self._used

    def _admit(self, key: PayloadKey, nbytes: int) -> None:
        """Reserve ``nbytes`` (call with the lock held); TierFullError when they do not fit."""
        if self._used + nbytes > self.capacity_bytes:
            raise TierFullError(f"{self.label}: {nbytes} bytes for {key} do not fit "
                                f"({self.capacity_bytes - self._used} of {self.capacity_bytes} free)")
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
    def commit(self, header: PayloadHeader, buf: torch.Tensor) -> PayloadHandle:
        """Store ``buf`` (from :meth:`receive_buffer`) under ``header``; this tier owns it now.

        Raises TierFullError (nothing stored, ``buf`` released) when it does not fit. A payload
        already held under the same key is kept and ``buf`` released: the first copy wins.
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

    def put(self, header: PayloadHeader, data: torch.Tensor) -> PayloadHandle:
        """Copy ``data`` (a uint8 tensor of ``header.nbytes``) in and commit it."""
        buf = self.receive_buffer(header.nbytes)
        try:
            buf.copy_(data.reshape(-1))
        except BaseException:
            self.release(buf)
            raise
        return self.commit(header, buf)

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


def host_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy."""
    if t.device.type != "cpu":
        raise ValueError(f"host_view: tensor is on {t.device}, not in host memory")
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


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
