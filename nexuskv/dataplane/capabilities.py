"""What a tier backend can do, as data: the catalog selects on these, never on a backend's name."""

from __future__ import annotations

from dataclasses import dataclass

from nexuskv.descriptor import Tier

__all__ = ["Capabilities"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Capabilities:
    """A backend's advertised properties.

    * ``device`` — where the payload bytes live: ``"cuda:0"``, or ``"cpu"``.
    * ``stand_in`` — True for a host-memory stand-in of device memory (no CUDA here): it keeps
      the device tier's contract (capacity, handles, checksums) but its bytes are in host DRAM,
      and every transfer result it takes part in says ``device="cpu"``.
    * ``pinned`` — page-locked host memory (CUDA can DMA from it without another copy); only
      possible when CUDA is present.
    * ``durable`` — payloads survive the process (files).
    * ``out_of_process`` — payloads are held by another process (the remote tier's store).
    * ``shared`` — every worker can reach it, not only the worker that owns it.
    * ``async_copy`` — copies run on dedicated CUDA streams and complete by CUDA events.
    * ``transport`` — how bytes reach it: ``memory``, ``cuda``, ``file`` or ``tcp``.
    * ``note`` — a caveat in words (what is a stand-in, what is not pinned and why).
    """

    tier: Tier
    device: str
    transport: str
    stand_in: bool = False
    pinned: bool = False
    durable: bool = False
    out_of_process: bool = False
    shared: bool = False
    async_copy: bool = False
    note: str = ""

    @property
    def real_device(self) -> bool:
        """True when payloads live in accelerator memory (not a stand-in)."""
        return self.device.startswith("cuda")
