"""KeyTable: a compact, vectorised hash table of fixed-width integer keys (numpy columns).

The global index keeps millions of entries; a Python dict of 128-bit ints costs ~100 bytes per
entry and one interpreter round trip per key. A KeyTable stores its keys and values in numpy
arrays and answers a whole query (hundreds of keys) with a handful of array operations.

Layout: ``nb`` buckets of :data:`WAYS` slots. A key is ``(k1, k2, tag)``: ``k1`` is a uniformly
distributed 64-bit word that also picks the bucket, ``k2`` an optional second 64-bit word (the
rest of a 128-bit key) and ``tag`` a non-zero uint32 (a scope or publisher id; 0 marks an empty
slot). A key lives in the first bucket of its probe sequence (its home bucket, then the next
ones) that had room when it was inserted; a bucket that ever turned a key away is flagged
*overflowed*, and only then does a search continue past it. So deleting is just clearing the
tag (no tombstones); the flags are reset by the next rehash, which happens when the table grows
(load above ``max_load``) or when a quarter of the buckets are flagged.

Values are extra uint32 columns moved with their keys. Slot numbers change on a rehash: the
owner passes ``on_move(remap)`` (old slot -> new slot, -1 for empty) to fix references it keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["KeyTable", "WAYS"]

WAYS = 8  # slots per bucket: one 64-byte cache line of k1 words
_AR = np.arange(WAYS, dtype=np.intp)
_SHIFT32 = np.uint64(32)
_SHIFT56 = np.uint64(56)
# Multiplying 1 << (8 * i) by this puts i in the top byte: the index of the one set byte.
_BYTE_INDEX = np.uint64(0x0001020304050607)


class KeyTable:
    """Open addressing over 8-slot buckets; every operation takes and returns numpy arrays."""

    __slots__ = ("wide", "max_load", "nb", "k1", "k2", "tag", "values", "overflow", "live", "on_move",
                 "_value_names", "rehashes")

    def __init__(self, *, wide: bool, values: Sequence[str] = (), capacity: int = 0, max_load: float = 0.8,
                 on_move: Callable[[np.ndarray], None] | None = None) -> None:
        if not 0.3 <= max_load <= 0.95:
            raise ValueError(f"max_load must be in [0.3, 0.95], got {max_load}")
        self.wide = wide
        self.max_load = max_load
        self._value_names = tuple(values)
        self.on_move = on_move
        self.live = 0
        self.rehashes = 0
        self._allocate(self._buckets_for(capacity))

    # -- sizing --------------------------------------------------------------------------------------

    def _buckets_for(self, keys: int) -> int:
        # Sized for a load of ~2/3 of max_load right after a rehash, so growth is 1.5x at a time.
        return max(8, int(keys / (self.max_load * 2 / 3) / WAYS) + 1)

    def _allocate(self, nb: int) -> None:
        if nb >= 1 << 31:
            raise MemoryError("KeyTable: more than 2**31 buckets")
        self.nb = nb
        n = nb * WAYS
        self.k1 = np.zeros(n, np.uint64)
        self.k2 = np.zeros(n, np.uint64) if self.wide else None
        self.tag = np.zeros(n, np.uint32)
        self.values = {name: np.zeros(n, np.uint32) for name in self._value_names}
        self.overflow = np.zeros(nb, np.bool_)

    @property
    def capacity(self) -> int:
        return self.nb * WAYS

    @property
    def nbytes(self) -> int:
        total = self.k1.nbytes + self.tag.nbytes + self.overflow.nbytes + sum(v.nbytes for v in self.values.values())
        return total + (self.k2.nbytes if self.k2 is not None else 0)

    def _bucket(self, k1: np.ndarray) -> np.ndarray:
        # Multiply-shift onto [0, nb): the high 32 bits of k1 times nb, shifted back down.
        return (((k1 >> _SHIFT32) * np.uint64(self.nb)) >> _SHIFT32).astype(np.intp)

    # -- queries -------------------------------------------------------------------------------------

    def find(self, k1: np.ndarray, k2: np.ndarray | None, tag: np.ndarray | int) -> np.ndarray:
        """Slot of every key (intp), -1 where absent."""
        n = len(k1)
        out = np.full(n, -1, np.intp)
        if n == 0 or self.live == 0:
            return out
        scalar_tag = np.isscalar(tag) or getattr(tag, "ndim", 1) == 0
        tags = None if scalar_tag else np.asarray(tag, np.uint32)
        b = self._bucket(k1)
        idx = np.arange(n)
        rows1 = self.k1.reshape(self.nb, WAYS)
        while True:
            q1 = k1[idx]
            # One 64-byte row per key; a row's 8 equality bytes read as one uint64 say where k1 matched.
            eq = np.take(rows1, b, axis=0).ravel() == np.repeat(q1, WAYS)
            word = eq.view(np.uint64)
            hit = word != 0
            if hit.any():
                hi_idx = np.flatnonzero(hit)
                w = word[hi_idx]
                single = (w & (w - np.uint64(1))) == 0
                slot = b[hi_idx] * WAYS + ((w * _BYTE_INDEX) >> _SHIFT56).astype(np.intp)
                if not single.all():  # the same k1 twice in one bucket: keys differ in k2 or tag
                    for j in np.flatnonzero(~single):
                        slot[j] = self._scan_bucket(int(b[hi_idx[j]]), k1[idx[hi_idx[j]]],
                                                    None if k2 is None else k2[idx[hi_idx[j]]],
                                                    tag if scalar_tag else tags[idx[hi_idx[j]]])
                ok = slot >= 0
                okv = np.take(self.tag, np.where(ok, slot, 0)) == (tag if scalar_tag else tags[idx[hi_idx]])
                if self.wide:
                    okv &= np.take(self.k2, np.where(ok, slot, 0)) == k2[idx[hi_idx]]
                ok &= okv
                out[idx[hi_idx[ok]]] = slot[ok]
                hit[hi_idx[~ok]] = False
            cont = ~hit & np.take(self.overflow, b)
            if not cont.any():
                return out
            idx = idx[cont]
            b = (b[cont] + 1) % self.nb

    def _scan_bucket(self, bucket: int, k1: np.uint64, k2: np.uint64 | None, tag: int) -> int:
        base = bucket * WAYS
        for s in range(base, base + WAYS):
            if self.k1[s] == k1 and self.tag[s] == tag and (k2 is None or self.k2[s] == k2):
                return s
        return -1

    # -- updates -------------------------------------------------------------------------------------

    def insert(self, k1: np.ndarray, k2: np.ndarray | None, tag: np.ndarray | int) -> np.ndarray:
        """Insert keys known to be absent and distinct; returns their slots (may rehash first)."""
        n = len(k1)
        if n == 0:
            return np.empty(0, np.intp)
        tags = np.broadcast_to(np.asarray(tag, np.uint32), (n,))
        if self.live + n > self.max_load * self.capacity or self.overflow.sum() * 4 > self.nb:
            self._rehash(self.live + n)
        slots = self._place(k1, k2, tags)
        self.live += n
        return slots

    def delete(self, slots: np.ndarray) -> None:
        """Empty the given slots (distinct, occupied)."""
        if len(slots):
            self.tag[slots] = 0
            self.live -= len(slots)

    def slots(self) -> np.ndarray:
        """Every occupied slot, ascending."""
        return np.flatnonzero(self.tag)

    def _place(self, k1: np.ndarray, k2: np.ndarray | None, tags: np.ndarray) -> np.ndarray:
        n = len(k1)
        out = np.empty(n, np.intp)
        b = self._bucket(k1)
        pending = np.arange(n)
        nb = self.nb
        while pending.size:
            bp = b[pending]
            win = (bp * WAYS)[:, None] + _AR
            free = self.tag[win] == 0
            room = free.any(1)
            if not room.all():
                full = pending[~room]
                self.overflow[b[full]] = True
                b[full] = (b[full] + 1) % nb
            ok = pending[room]
            cand = bp[room] * WAYS + free[room].argmax(1)
            # Two keys may pick the same free slot: the first wins, the rest retry next round.
            uniq, first = np.unique(cand, return_index=True)
            win_keys = ok[first]
            self.k1[uniq] = k1[win_keys]
            if self.wide:
                self.k2[uniq] = k2[win_keys]
            self.tag[uniq] = tags[win_keys]
            out[win_keys] = uniq
            lost = np.ones(len(ok), np.bool_)
            lost[first] = False
            pending = np.concatenate((pending[~room], ok[lost]))
        return out

    def _rehash(self, keys: int) -> None:
        old = self.slots()
        k1, tag = self.k1[old], self.tag[old]
        k2 = self.k2[old] if self.wide else None
        vals = {name: arr[old] for name, arr in self.values.items()}
        self._allocate(self._buckets_for(max(keys, len(old))))
        new = self._bulk_place(k1, k2, tag)
        for name, v in vals.items():
            self.values[name][new] = v
        self.rehashes += 1
        if self.on_move is not None:
            remap = np.full(len(self.tag) if len(old) == 0 else int(old[-1]) + 1, -1, np.intp)
            remap[old] = new
            self.on_move(remap)

    def _bulk_place(self, k1: np.ndarray, k2: np.ndarray | None, tag: np.ndarray) -> np.ndarray:
        """Place keys into an empty table: rank keys within their bucket, spill the rest onward."""
        n = len(k1)
        out = np.empty(n, np.intp)
        b = self._bucket(k1)
        pending = np.arange(n)
        fill = np.zeros(self.nb, np.intp)
        while pending.size:
            bp = b[pending]
            order = np.argsort(bp, kind="stable")
            sb = bp[order]
            starts = np.r_[0, np.flatnonzero(sb[1:] != sb[:-1]) + 1]
            rank = np.arange(len(sb)) - np.repeat(starts, np.diff(np.r_[starts, len(sb)]))
            pos = fill[sb] + rank
            fits = pos < WAYS
            placed = pending[order[fits]]
            slot = sb[fits] * WAYS + pos[fits]
            self.k1[slot] = k1[placed]
            if self.wide:
                self.k2[slot] = k2[placed]
            self.tag[slot] = tag[placed]
            out[placed] = slot
            np.maximum.at(fill, sb[fits], pos[fits] + 1)
            spill = pending[order[~fits]]
            if spill.size:
                self.overflow[b[spill]] = True
                b[spill] = (b[spill] + 1) % self.nb
            pending = spill
        return out
