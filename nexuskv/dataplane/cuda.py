"""Copies between pinned host memory and CUDA device memory, on dedicated streams, ended by events.

Used only when ``torch.cuda.is_available()``; nothing here runs on a machine without CUDA, and
this build's tests ran without one (the device tier is then a host-memory stand-in,
:mod:`nexuskv.dataplane.memory`). Each thread gets its own non-default stream, so copies of
concurrent transfers overlap each other and never queue behind the engine's compute on the
default stream. A copy is enqueued with ``non_blocking=True`` from or to a *pinned* buffer (a
pageable one would make the copy synchronous), an event is recorded after it, and the copy is
complete — and may be reported so — only once that event has completed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

__all__ = ["CudaCopier", "cuda_available"]


def cuda_available() -> bool:
    """True when torch sees a CUDA device (the only switch between the CUDA and host paths)."""
    return torch.cuda.is_available()


class CudaCopier:
    """Host <-> device copies on per-thread streams of one device, completed by events."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CudaCopier needs a CUDA device, got {device}")
        self.device = device
        self._local = threading.local()

    def stream(self) -> torch.cuda.Stream:
        """This thread's dedicated copy stream (created on first use)."""
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = torch.cuda.Stream(device=self.device)
            self._local.stream = stream
        return stream

    def empty(self, nbytes: int) -> torch.Tensor:
        """Device memory allocated on this thread's copy stream (so the allocator ties it there)."""
        with torch.cuda.stream(self.stream()):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def upload(self, host: torch.Tensor, dev: torch.Tensor, *, poll: Callable[[], bool] | None = None) -> None:
        """Copy pinned ``host`` into ``dev``; returns when the copy's event has completed."""
        self._copy(dev, host, poll)

    def download(self, dev: torch.Tensor, host: torch.Tensor, *, poll: Callable[[], bool] | None = None) -> None:
        """Copy ``dev`` into pinned ``host``; returns when the copy's event has completed."""
        self._copy(host, dev, poll)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, poll: Callable[[], bool] | None) -> None:
        stream = self.stream()
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        # Poll rather than block, so a caller can notice cancellation while the DMA runs; the
        # copy itself cannot be recalled, so we still wait for it before the buffers are reused.
        while not done.query():
            if poll is not None and poll():
                break
            time.sleep(20e-6)
        done.synchronize()
