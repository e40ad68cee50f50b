"""Interned sets of locations: one uint32 per indexed block instead of one entry per membership.

Every indexed block points at an interned *location set* (a bitmask over location ids, where a
location is one publisher's tier and KV group). Blocks held in the same places share one set, so
the per-block cost of a membership is a bit, and a lookup walks runs of equal set ids instead of
individual (block, location) pairs. Set 0 is the empty set. Sets are reference counted by the
number of blocks that point at them and recycled when no block does.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["LocationSets"]


class LocationSets:
    """The interned sets, their reference counts and the total membership count."""

    __slots__ = ("masks", "locs", "refs", "_by_mask", "_free", "memberships")

    def __init__(self) -> None:
        self.masks: list[int] = [0]
        self.locs: list[tuple[int, ...]] = [()]
        self.refs: list[int] = [0]
        self._by_mask: dict[int, int] = {0: 0}
        self._free: list[int] = []
        self.memberships = 0  # sum over blocks of the size of their set

    def __len__(self) -> int:
        return len(self._by_mask)

    def intern(self, mask: int) -> int:
        sid = self._by_mask.get(mask)
        if sid is not None:
            return sid
        locs = tuple(_bits(mask))
        if self._free:
            sid = self._free.pop()
            self.masks[sid], self.locs[sid], self.refs[sid] = mask, locs, 0
        else:
            sid = len(self.masks)
            self.masks.append(mask)
            self.locs.append(locs)
            self.refs.append(0)
        self._by_mask[mask] = sid
        return sid

    def ref(self, sid: int, count: int) -> None:
        """``count`` more (or, negative, fewer) blocks point at ``sid``."""
        if sid == 0:  # the empty set: absent blocks, nothing to count
            return
        self.refs[sid] += count
        self.memberships += count * len(self.locs[sid])
        if self.refs[sid] == 0:
            del self._by_mask[self.masks[sid]]
            self._free.append(sid)

    def transform(self, ids: np.ndarray, change: Callable[[int], int]) -> np.ndarray:
        """New set ids for blocks whose sets are ``ids`` (one entry per distinct block) after
        ``change(mask) -> mask``; reference counts follow."""
        uniq, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
        new = np.empty(len(uniq), np.uint32)
        for j, (sid, count) in enumerate(zip(uniq.tolist(), counts.tolist())):
            target = self.intern(change(self.masks[sid]))
            new[j] = target
            if target != sid:
                self.ref(target, count)
                self.ref(sid, -count)
        return new[inverse]

    def size_of(self, sid: int) -> int:
        return len(self.locs[sid])

    def nbytes(self) -> int:
        """Rough Python-object cost of the set table (a few hundred bytes per distinct set)."""
        return len(self.masks) * 200


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out
