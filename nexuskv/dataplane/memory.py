"""Memory tiers: host DRAM, and device memory (CUDA, or a host-memory stand-in without it).

* :class:`HostMemoryBackend` — payloads in host memory, pinned (page-locked) when CUDA is present
  so device copies can DMA from them; without CUDA pinning is impossible and the capabilities
  say so.
* :class:`DeviceMemoryBackend` — payloads in CUDA device memory, uploaded from pinned staging
  buffers on dedicated streams (:mod:`nexuskv.dataplane.cuda`). Without CUDA it is a stand-in
  that keeps payloads in host memory: same capacity, handles and checksums, capabilities with
  ``stand_in=True`` and ``device="cpu"``, so nobody mistakes its figures for device figures.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from nexuskv.dataplane.backend import BufferPool, Reservation, TierBackend
from nexuskv.dataplane.capabilities import Capabilities
from nexuskv.dataplane.cuda import CudaCopier, cuda_available
from nexuskv.dataplane.payload import PayloadHandle, PayloadHeader, PayloadKey
from nexuskv.descriptor import Tier

__all__ = ["HostMemoryBackend", "DeviceMemoryBackend"]

STAND_IN_NOTE = "host-memory stand-in for device memory: CUDA is not available"


class _MemoryBackend(TierBackend):
    """Payloads kept as tensors in a dict; received buffers become the stored payloads."""

    def __init__(self, *, label: str, capacity_bytes: int, capabilities: Capabilities, pin: bool) -> None:
        super().__init__(label=label, capacity_bytes=capacity_bytes, capabilities=capabilities)
        self._entries: dict[PayloadKey, tuple[PayloadHeader, torch.Tensor]] = {}
        self._pending: set[PayloadKey] = set()  # admitted, being stored
        self._lent: dict[PayloadKey, int] = {}  # borrowed payloads: their buffers are not recycled
        # Idle buffers are bounded by the capacity: memory the tier may hold anyway.
        self._pool = BufferPool(pin=pin, max_bytes=capacity_bytes)

    def header(self, key: PayloadKey) -> PayloadHeader | None:
        entry = self._entries.get(key)
        return entry[0] if entry is not None else None

    def keys(self) -> list[PayloadKey]:
        with self._lock:
            return list(self._entries)

    def read_into(self, key: PayloadKey, out: torch.Tensor) -> PayloadHeader | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        header, stored = entry
        _check_size(key, header, out)
        self._copy_out(stored, out)
        return header

    def _copy_out(self, stored: torch.Tensor, out: torch.Tensor) -> None:
        if out.device.type == "cpu":
            # numpy's copy runs on the calling thread without the GIL; torch's would fan out to its
            # intra-op threads and oversubscribe the cores the executor's copy lanes already use.
            np.copyto(out.numpy(), stored.numpy())
        else:
            out.copy_(stored)

    def receive_buffer(self, nbytes: int) -> torch.Tensor:
        return self._pool.take(nbytes)

    def release(self, buf: torch.Tensor) -> None:
        if buf.device.type == "cpu":
            self._pool.give(buf)

    def commit(self, header: PayloadHeader, buf: torch.Tensor,
               reservation: Reservation | None = None) -> PayloadHandle:
        if buf.numel() != header.nbytes:
            self.release(buf)
            raise ValueError(f"{self.label}: buffer of {buf.numel()} bytes for a {header.nbytes}-byte payload")
        with self._lock:
            held = header.key in self._entries or header.key in self._pending
            if not held:
                try:
                    self._admit(header.key, header.nbytes, reservation)
                except BaseException:
                    self.release(buf)
                    raise
                self._pending.add(header.key)
        if held:  # the first copy wins; an equal address means equal state
            self.release(buf)
            return self._handle(self._entries.get(header.key, (header,))[0])
        try:
            stored = self._store(buf)
        except BaseException:
            with self._lock:
                self._used -= header.nbytes
                self._pending.discard(header.key)
            raise
        with self._lock:
            self._entries[header.key] = (header, stored)
            self._pending.discard(header.key)
        return self._handle(header)

    def _store(self, buf: torch.Tensor) -> torch.Tensor:
        """The tensor to keep for a received buffer (the buffer itself for host memory)."""
        return buf

    def delete(self, key: PayloadKey) -> bool:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self._used -= entry[0].nbytes
            lent = key in self._lent
        if not lent:  # a lent buffer is left to the garbage collector, never reused under a reader
            self.release(entry[1])
        return True

    @contextlib.contextmanager
    def borrow(self, key: PayloadKey) -> Iterator[tuple[PayloadHeader, torch.Tensor] | None]:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[1].device.type != "cpu":
                entry = None
            else:
                self._lent[key] = self._lent.get(key, 0) + 1
        if entry is None:
            yield None
            return
        try:
            yield entry
        finally:
            with self._lock:
                left = self._lent[key] - 1
                if left:
                    self._lent[key] = left
                else:
                    del self._lent[key]

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._used = 0
        self._pool.clear()


class HostMemoryBackend(_MemoryBackend):
    """Host DRAM, pinned when CUDA is present (``pin=None``), pageable otherwise."""

    def __init__(self, capacity_bytes: int, *, label: str = "host-memory", pin: bool | None = None) -> None:
        pinned = cuda_available() if pin is None else pin
        note = "" if pinned else "pageable host memory: pinning needs CUDA, which is not available"
        caps = Capabilities(tier=Tier.HOST, device="cpu", transport="memory", pinned=pinned, note=note)
        super().__init__(label=label, capacity_bytes=capacity_bytes, capabilities=caps, pin=pinned)


class DeviceMemoryBackend(_MemoryBackend):
    """CUDA device memory when present; otherwise a host-memory stand-in that says so."""

    def __init__(self, capacity_bytes: int, *, label: str = "device-memory", device: str | None = None) -> None:
        use_cuda = cuda_available() if device is None else device.startswith("cuda")
        if use_cuda:
            dev = torch.device(device or "cuda:0")
            self._copier: CudaCopier | None = CudaCopier(dev)
            name = f"cuda:{dev.index if dev.index is not None else torch.cuda.current_device()}"
            caps = Capabilities(tier=Tier.GPU, device=name, transport="cuda", async_copy=True)
        else:
            self._copier = None
            caps = Capabilities(tier=Tier.GPU, device="cpu", transport="memory", stand_in=True, note=STAND_IN_NOTE)
        # Staging buffers are pinned with CUDA, so uploads are true asynchronous DMA.
        super().__init__(label=label, capacity_bytes=capacity_bytes, capabilities=caps, pin=use_cuda)

    def _store(self, buf: torch.Tensor) -> torch.Tensor:
        if self._copier is None:
            return buf
        dev = self._copier.empty(buf.numel())
        try:
            self._copier.upload(buf, dev)
        finally:
            self.release(buf)  # the staging buffer is free once the upload's event completed
        return dev

    def _copy_out(self, stored: torch.Tensor, out: torch.Tensor) -> None:
        if self._copier is not None and out.device.type == "cpu":
            self._copier.download(stored, out)
        else:
            out.copy_(stored)


def _check_size(key: PayloadKey, header: PayloadHeader, out: torch.Tensor) -> None:
    if out.numel() != header.nbytes or out.dtype != torch.uint8:
        raise ValueError(f"read_into {key}: needs a uint8 buffer of {header.nbytes} bytes, "
                         f"got {out.dtype} of {out.numel()}")
