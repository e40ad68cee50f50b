"""Where a request's state can come from: the descriptor's shape and the usable (worker, tier) sources.

A location is usable only if every KV group of the descriptor is present there, *certain* (an
uncertain publisher is a miss), its tier an allowed source, and its prefix legal to restore
(partial prefixes only when the descriptor allows them; recurrent groups only at checkpoints).
Anything else comes back as an :class:`Unusable` with the reason, recorded by the planner as a
rejected alternative and never chosen.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from nexuskv.descriptor import GranularityKind, StateDescriptor, Tier
from nexuskv.lookup import LocationMatch, LookupResult
from nexuskv.policy import ExecutionPolicy

__all__ = ["Shape", "Source", "Unusable", "shape_of", "checkpoint_step", "block_groups", "usable_sources",
           "moved_blocks"]

_GPU = Tier.GPU


class Source(NamedTuple):
    """A usable place holding a prefix of the request's state."""

    worker: str
    tier: Tier
    prefix: int  # usable prefix, blocks
    extents: tuple[tuple[int, int], ...]  # blocks present beyond the prefix (every group), [start, end)


class Unusable(NamedTuple):
    """A place holding ``source.prefix`` blocks that cannot be reused, and why."""

    source: Source
    reason: str


class Shape(NamedTuple):
    """What the planner reads of a descriptor, derived once per descriptor id (content-addressed)."""

    block_size: int
    block_bytes: int  # one block of every token-granular group
    checkpoint_bytes: int  # one checkpoint of every recurrent group
    pages_per_block: int
    groups: tuple[int, ...]
    step: int | None  # blocks between legal reuse boundaries; None: never legal
    partial_ok: bool
    layers: int  # layers that may restore layer by layer (0: not layerwise)
    restore_fixed_s: float
    restore_per_token_s: float

    def nbytes(self, blocks: int) -> int:
        return blocks * self.block_bytes + self.checkpoint_bytes if blocks > 0 else 0


def block_groups(descriptor: StateDescriptor) -> tuple[int, ...]:
    return tuple(g.kv_group for g in descriptor.layer_groups)


_SHAPES: dict[tuple, Shape] = {}


def shape_of(d: StateDescriptor) -> Shape:
    """The descriptor's :class:`Shape` (a bounded memo of a pure function of the descriptor)."""
    # descriptor_id covers what the state *is*; how it may be restored is outside the digest.
    m, r = d.materialization, d.restore_cost
    key = (d.descriptor_id, m.partial_prefix, m.layerwise, r.fixed_s, r.per_token_s)
    shape = _SHAPES.get(key)
    if shape is None:
        tokens = d.block_size
        per_block = sum(g.bytes_per_token * tokens for g in d.layer_groups
                        if g.granularity.kind is GranularityKind.BLOCK)
        checkpoints = sum(g.bytes_per_checkpoint for g in d.layer_groups)
        layers = sum(len(g.layers) for g in d.layer_groups) if m.layerwise else 0
        shape = Shape(tokens, per_block, checkpoints, len(d.layer_groups), block_groups(d), checkpoint_step(d),
                      m.partial_prefix, layers, r.fixed_s, r.per_token_s)
        if len(_SHAPES) > 4096:
            _SHAPES.clear()
        _SHAPES[key] = shape
    return shape


def checkpoint_step(descriptor: StateDescriptor) -> int | None:
    """Blocks between legal reuse boundaries (1 for pure block state; None: never legal)."""
    step = 1
    for g in descriptor.layer_groups:
        if g.granularity.kind is GranularityKind.CHECKPOINT:
            if g.granularity.tokens % descriptor.block_size:
                return None
            step = math.lcm(step, g.granularity.tokens // descriptor.block_size)
    return step


def _intersect(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def usable_sources(descriptor: StateDescriptor, num_blocks: int, shape: Shape, lookup: LookupResult,
                   policy: ExecutionPolicy) -> tuple[list[Source], list[Unusable]]:
    """The usable (worker, tier) locations of a lookup, and every unusable one with its reason."""
    usable: list[Source] = []
    unusable: list[Unusable] = []
    if not lookup.matches:
        return usable, unusable
    groups = shape.groups
    single = groups[0] if len(groups) == 1 else None
    by_place: dict[tuple[str, Tier], dict[int, LocationMatch]] = {}
    for m in lookup.matches:
        loc = m.location
        found = by_place.get((loc.worker, loc.tier))
        if found is None:
            by_place[(loc.worker, loc.tier)] = {loc.group: m}
        else:
            found[loc.group] = m
    step = shape.step
    sources_ok = policy.source_tiers
    for place in sorted(by_place):  # (worker, tier): a Tier is a str, so places sort as strings
        worker, tier = place
        found = by_place[place]
        reason = None
        if single is not None and len(found) == 1 and single in found:
            m = found[single]
            prefix = best = m.prefix_blocks if m.prefix_blocks < num_blocks else num_blocks
            certain = m.certain
        else:
            best = max(min(m.prefix_blocks, num_blocks) for m in found.values())
            prefix = min(min(m.prefix_blocks, num_blocks) for m in found.values())
            certain = all(m.certain for m in found.values())
            foreign = sorted(set(found) - set(groups))
            missing = [g for g in groups if g not in found]
            if foreign:
                reason = (f"incompatible: KV group {foreign[0]} at {worker}/{tier.value} is not a group of "
                          f"descriptor {descriptor.descriptor_id}")
            elif missing:
                reason = f"incompatible: KV group {missing[0]} of the descriptor is missing at {worker}/{tier.value}"
        if reason is None:
            if not certain:
                reason = f"publisher of {worker}/{tier.value} is uncertain (sequence gap or restart): treated as a miss"
            elif tier not in sources_ok:
                reason = f"policy: tier {tier.value} is not an allowed source"
            elif step is None:
                reason = "incompatible: checkpoint interval is not a multiple of the block size"
            else:
                if step > 1:
                    prefix -= prefix % step
                if prefix and prefix < num_blocks and not shape.partial_ok:
                    reason = (f"incompatible: descriptor allows only full reuse; {worker}/{tier.value} holds "
                              f"{prefix} of {num_blocks} blocks")
        if reason is not None:
            if best > 0:
                unusable.append(Unusable(Source(worker, tier, best, ()), reason))
            continue
        if prefix > 0:
            extents: tuple[tuple[int, int], ...] = ()
            for i, m in enumerate(found.values()):
                if not m.extents:
                    mine: tuple[tuple[int, int], ...] = ()
                else:
                    mine = tuple((e.start, min(e.end, num_blocks)) for e in m.extents if e.start < num_blocks)
                extents = mine if i == 0 else _intersect(extents, mine)
            usable.append(Source(worker, tier, prefix, extents))
    return usable, unusable


def moved_blocks(start: int, end: int, local_extents: tuple[tuple[int, int], ...]) -> tuple[tuple[int, ...], bool]:
    """Blocks of ``[start, end)`` the destination lacks: ``(start, end)`` if contiguous, else indices."""
    holes = [(max(s, start), min(e, end)) for s, e in local_extents if s < end and e > start]
    if not holes:
        return (start, end), True
    have = set()
    for s, e in holes:
        have.update(range(s, e))
    return tuple(i for i in range(start, end) if i not in have), False
