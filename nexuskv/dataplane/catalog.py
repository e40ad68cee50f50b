"""The backend catalog: which tier backend serves a need, chosen by capability and policy.

Code asks for what it needs — a tier, free room, durability, real device memory, payloads it
must already hold — as a :class:`Need`; the catalog keeps the backends whose
:class:`~nexuskv.dataplane.capabilities.Capabilities` satisfy it and lets a
:class:`SelectionPolicy` rank them. Nothing selects a backend by its name or class: a second
disk, a remote tier on another host or a real GPU instead of the stand-in change the answer
only through their capabilities.

Policies are small classes with one pure method, ``rank(candidate) -> sort key`` (lower is
better), over a :class:`BackendCandidate` snapshot taken once per selection.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from nexuskv.dataplane.backend import TierBackend
from nexuskv.dataplane.capabilities import Capabilities
from nexuskv.dataplane.payload import PayloadKey
from nexuskv.descriptor import Tier
from nexuskv.entries import EntryLocation
from nexuskv.errors import TierUnavailableError

__all__ = ["Need", "BackendCandidate", "SelectionPolicy", "MostFree", "FastestFirst", "DurableFirst", "POLICIES",
           "BackendCatalog", "TIER_ORDER"]

#: Expected access cost on one node, cheapest first (the order FastestFirst uses). A remote
#: memory tier usually beats a local SSD for reads of a few MiB; calibrated link costs from
#: observations are the planner's business, not the catalog's.
TIER_ORDER: tuple[Tier, ...] = (Tier.GPU, Tier.HOST, Tier.REMOTE, Tier.DISK, Tier.OBJECT)


@dataclass(frozen=True, slots=True, kw_only=True)
class Need:
    """What a caller needs from a backend; None means "either way"."""

    tier: Tier | None = None
    free_bytes: int = 0
    durable: bool | None = None
    out_of_process: bool | None = None
    real_device: bool | None = None
    pinned: bool | None = None
    holds: tuple[PayloadKey, ...] = ()  # payloads it must already hold

    def accepts(self, caps: Capabilities) -> bool:
        """The capability part of the need (free room and held payloads are checked live)."""
        return ((self.tier is None or caps.tier is self.tier)
                and (self.durable is None or caps.durable is self.durable)
                and (self.out_of_process is None or caps.out_of_process is self.out_of_process)
                and (self.real_device is None or caps.real_device is self.real_device)
                and (self.pinned is None or caps.pinned is self.pinned))


@dataclass(frozen=True, slots=True)
class BackendCandidate:
    """A backend that satisfies a need, as its policy sees it (a snapshot)."""

    position: int  # registration order: the last tie-breaker, for determinism
    capabilities: Capabilities
    free_bytes: int
    capacity_bytes: int


class SelectionPolicy(Protocol):
    name: ClassVar[str]

    def rank(self, candidate: BackendCandidate) -> tuple: ...


class MostFree:
    """The backend with the most free bytes (spreads payloads over equal tiers)."""

    name: ClassVar[str] = "most_free"

    def rank(self, candidate: BackendCandidate) -> tuple:
        return (-candidate.free_bytes, candidate.position)


class FastestFirst:
    """The backend of the cheapest tier (:data:`TIER_ORDER`), real devices before stand-ins."""

    name: ClassVar[str] = "fastest_first"

    def rank(self, candidate: BackendCandidate) -> tuple:
        caps = candidate.capabilities
        return (TIER_ORDER.index(caps.tier), caps.stand_in, not caps.pinned, -candidate.free_bytes,
                candidate.position)


class DurableFirst:
    """Backends whose payloads survive the process first, then the fastest."""

    name: ClassVar[str] = "durable_first"

    def rank(self, candidate: BackendCandidate) -> tuple:
        return (not candidate.capabilities.durable, *FastestFirst().rank(candidate))


POLICIES: dict[str, type] = {p.name: p for p in (MostFree, FastestFirst, DurableFirst)}


class BackendCatalog:
    """The backends one worker can use: its own tiers, plus shared ones (the remote tier)."""

    def __init__(self, worker: str, backends: Iterable[TierBackend] = ()) -> None:
        self.worker = worker
        self._backends: list[TierBackend] = []
        for b in backends:
            self.add(b)

    def add(self, backend: TierBackend) -> None:
        if any(b is backend for b in self._backends):
            raise ValueError(f"backend {backend.label} is already in the catalog")
        self._backends.append(backend)

    @property
    def backends(self) -> tuple[TierBackend, ...]:
        return tuple(self._backends)

    def candidates(self, need: Need) -> list[tuple[TierBackend, BackendCandidate]]:
        """Backends meeting ``need``, with their snapshots; unreachable ones are skipped."""
        out = []
        for position, backend in enumerate(self._backends):
            if not need.accepts(backend.capabilities):
                continue
            try:
                free = backend.free_bytes()
                if free < need.free_bytes:
                    continue
                if need.holds and not all(backend.contains(k) for k in need.holds):
                    continue
            except TierUnavailableError:
                continue
            out.append((backend, BackendCandidate(position, backend.capabilities, free, backend.capacity_bytes)))
        return out

    def select(self, need: Need, policy: SelectionPolicy | None = None) -> TierBackend | None:
        """The best backend for ``need`` under ``policy`` (MostFree by default); None if none fits."""
        found = self.candidates(need)
        if not found:
            return None
        chosen = policy or MostFree()
        return min(found, key=lambda pair: chosen.rank(pair[1]))[0]

    def reachable(self, location: EntryLocation) -> Sequence[TierBackend]:
        """Backends of ``location``'s tier this worker can reach (its own, or shared ones)."""
        return [b for b in self._backends
                if b.capabilities.tier is location.tier and (location.worker == self.worker or b.capabilities.shared)]

    def source_for(self, location: EntryLocation, first: PayloadKey) -> TierBackend | None:
        """The reachable backend at ``location`` that holds ``first`` (a transfer's first block)."""
        for backend in self.reachable(location):
            try:
                if backend.contains(first):
                    return backend
            except TierUnavailableError:
                continue
        return None

    def destination_for(self, location: EntryLocation, nbytes: int,
                        policy: SelectionPolicy | None = None) -> TierBackend | None:
        """The reachable backend at ``location`` with room for ``nbytes``, by ``policy``.

        None when no backend of that tier is reachable at all; a reachable but full one is still
        returned (largest free first), so the transfer is rejected for capacity, with the numbers.
        """
        reachable = self.reachable(location)
        if not reachable:
            return None
        need = Need(tier=location.tier, free_bytes=nbytes)
        ids = {id(b) for b in reachable}
        fitting = [(b, c) for b, c in self.candidates(need) if id(b) in ids]
        if fitting:
            chosen = policy or MostFree()
            return min(fitting, key=lambda pair: chosen.rank(pair[1]))[0]
        return max(reachable, key=_free_or_zero)


def _free_or_zero(backend: TierBackend) -> int:
    try:
        return backend.free_bytes()
    except TierUnavailableError:
        return -1
