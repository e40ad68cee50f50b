"""What an index lookup returns: per location, the matched prefix, partial extents, certainty.

This is the contract between the index (which knows what is where) and the planner (which
decides whether it is worth using). A lookup for a query of ``num_blocks`` canonical keys
answers, for every (worker, tier, KV group) holding at least one of them:

* ``prefix_blocks`` — consecutive blocks present from block 0 (the reusable prefix);
* ``extents`` — the runs of present blocks *beyond* the first gap (partial hits), ascending,
  non-overlapping, each ``[start, end)`` in block indices;
* ``certain`` — False when the publisher's facts are in doubt (sequence gap or restart not yet
  resynced). Uncertain matches are reported, never reused: the planner treats them as misses.

Logical match (the index says so), physical availability, completed materialization and useful
reuse are four distinct states; a LookupResult is only the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from nexuskv.entries import EntryLocation
from nexuskv.identity import IdentityScope

__all__ = ["Extent", "LocationMatch", "LookupResult", "IndexView"]


@dataclass(frozen=True, slots=True)
class Extent:
    """Blocks ``[start, end)`` of the query, all present at one location."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"extent [{self.start}, {self.end}) is empty or negative")

    @property
    def blocks(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class LocationMatch:
    location: EntryLocation
    publisher: str
    prefix_blocks: int
    extents: tuple[Extent, ...] = ()
    certain: bool = True

    @property
    def present_blocks(self) -> int:
        """Every block of the query present here (prefix plus partial extents)."""
        return self.prefix_blocks + sum(e.blocks for e in self.extents)


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The index's answer for one query; ``matches`` sorted by (worker, tier, group)."""

    num_blocks: int
    matches: tuple[LocationMatch, ...]
    lag_events: int = 0  # events published but not yet applied by the answering replica
    lag_ms: float = 0.0  # age of the newest unapplied event, milliseconds

    def for_worker(self, worker: str) -> tuple[LocationMatch, ...]:
        return tuple(m for m in self.matches if m.location.worker == worker)

    def best_certain_prefix(self) -> LocationMatch | None:
        """The certain match with the longest prefix (None when nothing certain matched)."""
        best = None
        for m in self.matches:
            if m.certain and m.prefix_blocks > 0 and (best is None or m.prefix_blocks > best.prefix_blocks):
                best = m
        return best


class IndexView(Protocol):
    """What the planner and routers need from an index (the pure index, or a live replica)."""

    def lookup(self, scope: IdentityScope, keys: Sequence[int]) -> LookupResult:
        """Matches for the canonical ``keys`` (block 0 first) inside ``scope``."""
        ...
