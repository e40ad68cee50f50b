"""Factories for planner inputs: queries from real identity keys, lookups, and a small IndexView.

:class:`KeyIndex` is an in-test :class:`~nexuskv.lookup.IndexView`: a dict from (worker, tier,
group) to the set of canonical block keys held there, plus the publishers whose facts are
uncertain. It answers ``lookup`` the way the index contract says (prefix from block 0, partial
extents beyond the first gap, certainty), so planner tests can feed it the keys of real prompts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from nexuskv.contracts.plans import WorkerLoad
from nexuskv.descriptor import StateDescriptor, Tier
from nexuskv.entries import EntryLocation
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.lookup import Extent, LocationMatch, LookupResult
from nexuskv.planner import PlanQuery

NOW = 1_700_000_000.0


def keys_for(descriptor: StateDescriptor, tokens: int, *, seed: int = 0, tenant: str | None = None) -> tuple[int, ...]:
    """Canonical keys of a prompt of ``tokens`` token ids (deterministic per seed)."""
    d = descriptor if tenant is None else descriptor.with_tenant(tenant)
    ids = [(seed * 7919 + i * 31) % 50_000 for i in range(tokens)]
    return tuple(BlockKeyer(IdentityScope.of(d), d.block_size).keys(ids))


def query(descriptor: StateDescriptor, tokens: int, workers: Sequence[WorkerLoad | str], *, request_id: str = "r1",
          seed: int = 0, arrival_at: float = NOW, slo_ttft_s: float | None = None,
          deadline_at: float | None = None) -> PlanQuery:
    loads = tuple(w if isinstance(w, WorkerLoad) else WorkerLoad(worker=w) for w in workers)
    return PlanQuery(request_id=request_id, scope=IdentityScope.of(descriptor), descriptor=descriptor,
                     keys=keys_for(descriptor, tokens, seed=seed), prompt_tokens=tokens, arrival_at=arrival_at,
                     candidates=loads, slo_ttft_s=slo_ttft_s, deadline_at=deadline_at)


def match(worker: str, tier: Tier | str, prefix: int, *, group: int = 0, certain: bool = True,
          extents: Iterable[tuple[int, int]] = ()) -> LocationMatch:
    return LocationMatch(location=EntryLocation(worker=worker, tier=Tier(tier), group=group),
                         publisher=f"pub/{worker}", prefix_blocks=prefix,
                         extents=tuple(Extent(s, e) for s, e in extents), certain=certain)


def lookup(num_blocks: int, *matches: LocationMatch, lag_ms: float = 0.0, lag_events: int = 0) -> LookupResult:
    ordered = tuple(sorted(matches, key=lambda m: (m.location.worker, m.location.tier.value, m.location.group)))
    return LookupResult(num_blocks=num_blocks, matches=ordered, lag_events=lag_events, lag_ms=lag_ms)


class KeyIndex:
    """An IndexView over explicit key sets: ``held[(worker, tier, group)] = {keys}``."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, Tier, int], set[int]] = {}
        self.scopes: dict[tuple[str, Tier, int], IdentityScope] = {}
        self.uncertain: set[str] = set()

    def store(self, scope: IdentityScope, worker: str, tier: Tier | str, keys: Iterable[int], group: int = 0) -> None:
        place = (worker, Tier(tier), group)
        self.held.setdefault(place, set()).update(keys)
        self.scopes[place] = scope

    def lookup(self, scope: IdentityScope, keys: Sequence[int]) -> LookupResult:
        matches = []
        for (worker, tier, group), held in sorted(self.held.items(), key=lambda kv: (kv[0][0], kv[0][1].value,
                                                                                     kv[0][2])):
            if self.scopes[(worker, tier, group)] != scope:
                continue
            present = [k in held for k in keys]
            prefix = next((i for i, p in enumerate(present) if not p), len(present))
            extents, start = [], None
            for i in range(prefix, len(present)):
                if present[i] and start is None:
                    start = i
                elif not present[i] and start is not None:
                    extents.append(Extent(start, i))
                    start = None
            if start is not None:
                extents.append(Extent(start, len(present)))
            if prefix or extents:
                matches.append(LocationMatch(location=EntryLocation(worker=worker, tier=tier, group=group),
                                             publisher=f"pub/{worker}", prefix_blocks=prefix, extents=tuple(extents),
                                             certain=worker not in self.uncertain))
        return LookupResult(num_blocks=len(keys), matches=tuple(matches))
