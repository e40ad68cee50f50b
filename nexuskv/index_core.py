"""The storage core under :class:`~nexuskv.index.GlobalIndex`: blocks by scoped 128-bit key,
their location sets, every publisher's engine-hash map, and the lookup inner loop.

Two backends with one interface and the same semantics (the property tests run both against
:class:`~nexuskv.reference_index.ReferenceIndex`):

* ``native`` — ``nexuskv._native``, Rust (``nexuskv/native/``), built by ``pip install -e .``
  through setuptools-rust. What services run.
* ``python`` — :class:`PyCore` below: dicts and sets, several hundred bytes a membership and
  ~5x slower lookups. For a source tree without the built extension, and as the executable
  statement of what the native core does.
* ``auto`` (``GlobalIndex``'s default) — native when ``nexuskv._native`` imports, else python
  with a :class:`RuntimeWarning` naming the build command; ``IndexStats.backend`` says which
  one runs. The tests name their backend, so a missing build fails them.

**Semantics the core owns** (the publisher rules above it — sequence, incarnation, certainty —
are :mod:`nexuskv.index`'s):

* A block is (scope id, canonical key). A lookup in scope A probes A's keys only: the native
  table stores every key mixed with its scope's salt and checks the scope on a full-key match,
  so a key that exists only in another scope costs what a key that exists nowhere costs.
* A block exists while some location holds it (its location set is not empty).
* An engine-map entry ``(publisher, hash) -> block`` is valid while the publisher holds that
  block somewhere; invalid entries behave as absent. A stored hash that named another block
  moves to the new block, and the old block leaves every location of that publisher.
* A clear of locations visits what they hold (per-location member lists), never the index.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["BACKENDS", "NativeUnavailable", "make_core", "native_available", "resolve_backend", "PyCore"]

BACKENDS = ("native", "python")
_BUILD_HINT = ("build it with `python -m pip install -e .` (needs cargo and rustc: https://rustup.rs), or in place "
               "in a source tree with `python -c 'import setuptools; setuptools.setup()' build_rust --inplace "
               "--release` (needs setuptools-rust); or pass backend='python' for the pure-Python core")


class NativeUnavailable(ImportError):
    """The native index core (``nexuskv._native``) is not built for this interpreter."""


def native_available() -> bool:
    try:
        import nexuskv._native  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str) -> str:
    """``"auto"`` -> ``"native"`` when built, else ``"python"`` (with a warning)."""
    if backend != "auto":
        return backend
    if native_available():
        return "native"
    warnings.warn(f"nexuskv._native is not built; the index runs on the pure-Python core: {_BUILD_HINT}",
                  RuntimeWarning, stacklevel=3)
    return "python"


def make_core(backend: str, seed: bytes) -> Any:
    """A new, empty core of ``backend`` (``"native"`` or ``"python"``)."""
    if backend == "native":
        try:
            from nexuskv._native import Core
        except ImportError as exc:
            raise NativeUnavailable(f"nexuskv._native is not importable ({exc}): {_BUILD_HINT}") from None
        return Core(seed)
    if backend == "python":
        return PyCore(seed)
    raise ValueError(f"index backend must be one of {BACKENDS}, got {backend!r}")


# -- the pure-Python core ----------------------------------------------------------------------------

_EMPTY: frozenset[int] = frozenset()


class _Block:
    __slots__ = ("sid", "key", "locs", "alive")

    def __init__(self, sid: int, key: int) -> None:
        self.sid = sid
        self.key = key
        self.locs = _EMPTY
        self.alive = True


def _key_ints(keys: Any) -> list[int]:
    if isinstance(keys, (bytes, bytearray, memoryview)):
        raw = bytes(keys)
        if len(raw) % 16:
            raise ValueError(f"keys: {len(raw)} bytes is not a whole number of 16-byte keys")
        return [int.from_bytes(raw[i:i + 16], "big") for i in range(0, len(raw), 16)]
    arr = np.asarray(keys)
    if arr.dtype != np.uint64 or arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError("keys: expected bytes (16 per key) or an (n, 2) uint64 array")
    return [(h << 64) | lo for h, lo in arr.tolist()]


def _hash_ints(hashes: Any) -> list[int]:
    if isinstance(hashes, (bytes, bytearray, memoryview)):
        raw = bytes(hashes)
        if len(raw) % 8:
            raise ValueError("engine hashes: bytes must hold 8 per hash")
        return np.frombuffer(raw, "<u8").tolist()
    if isinstance(hashes, np.ndarray):
        return hashes.astype(np.uint64).tolist()
    out = list(hashes)
    for h in out:
        if not isinstance(h, int) or not 0 <= h < 1 << 64:
            raise OverflowError("engine hashes: each must be an int in [0, 2**64)")
    return out


def _u32(values: Sequence[int]) -> bytes:
    return np.asarray(values, "<u4").tobytes()


class PyCore:
    """The core in plain Python: a dict of (scope id, key) -> block, per-publisher dicts of
    engine hash -> block, per-location sets of blocks. Same interface as ``nexuskv._native.Core``."""

    def __init__(self, seed: bytes) -> None:
        if len(seed) != 32:
            raise ValueError("seed: 32 bytes")
        self._blocks: dict[tuple[int, int], _Block] = {}
        self._engine: list[dict[int, _Block]] = []
        self._pub_locs: list[list[int]] = []
        self._loc_pub: list[int] = []
        self._members: list[set[_Block]] = []
        self._scopes: list[list[int]] = []  # [blocks, live, serial]
        self._serials = 0
        self._free_scopes: list[int] = []
        self._dirty: list[int] = []
        self._sets: dict[frozenset[int], frozenset[int]] = {}
        self.memberships = 0

    # registries
    def add_publisher(self) -> int:
        self._engine.append({})
        self._pub_locs.append([])
        return len(self._engine) - 1

    def add_location(self, publisher: int) -> int:
        self._pub(publisher)
        self._loc_pub.append(publisher)
        self._members.append(set())
        self._pub_locs[publisher].append(len(self._loc_pub) - 1)
        return len(self._loc_pub) - 1

    def add_scope(self, salt: bytes) -> tuple[int, int]:
        if len(salt) != 16:
            raise ValueError("salt: 16 bytes")
        self._serials += 1
        if self._free_scopes:
            sid = self._free_scopes.pop()
            self._scopes[sid] = [0, 1, self._serials]
        else:
            sid = len(self._scopes)
            self._scopes.append([0, 1, self._serials])
        self._dirty.append(sid)
        return sid, self._serials

    def presize(self, blocks: int) -> None:
        """Dicts size themselves; nothing to do."""

    def take_empty_scopes(self) -> list[int]:
        out = sorted({s for s in self._dirty if self._scopes[s][1] and self._scopes[s][0] == 0})
        self._dirty.clear()
        return out

    def release_scope(self, sid: int) -> bool:
        self._scope(sid)
        if self._scopes[sid][0]:
            return False
        self._scopes[sid][1] = 0
        self._free_scopes.append(sid)
        return True

    def scope_blocks(self, sid: int) -> int:
        self._scope(sid)
        return self._scopes[sid][0]

    def _pub(self, p: int) -> None:
        if not 0 <= p < len(self._engine):
            raise ValueError(f"unknown publisher id {p}")

    def _loc(self, p: int, loc: int) -> None:
        self._pub(p)
        if not (0 <= loc < len(self._loc_pub) and self._loc_pub[loc] == p):
            raise ValueError(f"location {loc} is not publisher {p}'s")

    def _scope(self, sid: int) -> None:
        if not (0 <= sid < len(self._scopes) and self._scopes[sid][1]):
            raise ValueError(f"unknown scope id {sid}")

    # blocks and sets
    def _intern(self, locs: frozenset[int]) -> frozenset[int]:
        return self._sets.setdefault(locs, locs)

    def _holds(self, block: _Block, p: int) -> bool:
        loc_pub = self._loc_pub
        return any(loc_pub[loc] == p for loc in block.locs)

    def _valid(self, block: _Block | None, p: int) -> bool:
        return block is not None and block.alive and self._holds(block, p)

    def _set_locs(self, block: _Block, locs: frozenset[int]) -> None:
        old = block.locs
        if locs == old:
            return
        for loc in locs - old:
            self._members[loc].add(block)
        for loc in old - locs:
            self._members[loc].discard(block)
        self.memberships += len(locs) - len(old)
        block.locs = self._intern(locs) if locs else _EMPTY
        if not locs:
            del self._blocks[(block.sid, block.key)]
            block.alive = False
            sc = self._scopes[block.sid]
            sc[0] -= 1
            if sc[0] == 0:
                self._dirty.append(block.sid)

    def _block(self, sid: int, key: int) -> _Block:
        b = self._blocks.get((sid, key))
        if b is None:
            b = self._blocks[(sid, key)] = _Block(sid, key)
            self._scopes[sid][0] += 1
        return b

    def _drop_pub(self, block: _Block, p: int) -> None:
        loc_pub = self._loc_pub
        self._set_locs(block, frozenset(loc for loc in block.locs if loc_pub[loc] != p))

    def _link(self, p: int, h: int, block: _Block) -> None:
        eng = self._engine[p]
        old = eng.get(h)
        if self._valid(old, p) and old is not block:
            self._drop_pub(old, p)
        eng[h] = block

    # events
    def store(self, publisher: int, loc: int, sid: int, keys: Any, hashes: Any) -> int:
        self._loc(publisher, loc)
        self._scope(sid)
        ks, hs = _key_ints(keys), _hash_ints(hashes)
        if len(ks) != len(hs):
            raise ValueError(f"{len(ks)} keys for {len(hs)} engine hashes")
        for k, h in zip(ks, hs):
            b = self._block(sid, k)
            self._link(publisher, h, b)
            self._set_locs(b, b.locs | {loc})
        return len(ks)

    def store_tier(self, publisher: int, loc: int, hashes: Any) -> int:
        self._loc(publisher, loc)
        eng = self._engine[publisher]
        known = 0
        for h in _hash_ints(hashes):
            b = eng.get(h)
            if self._valid(b, publisher):
                known += 1
                self._set_locs(b, b.locs | {loc})
            elif b is not None:
                del eng[h]
        return known

    def remove(self, publisher: int, loc: int | None, hashes: Any) -> int:
        if loc is None:
            self._pub(publisher)
        else:
            self._loc(publisher, loc)
        eng = self._engine[publisher]
        known = 0
        for h in _hash_ints(hashes):
            b = eng.get(h)
            if self._valid(b, publisher):
                known += 1
                if loc is not None:
                    self._set_locs(b, b.locs - {loc})
                    if not self._valid(b, publisher):
                        del eng[h]
            elif b is not None:
                del eng[h]
        return known

    def clear(self, publisher: int, locs: Sequence[int], all: bool) -> None:  # noqa: A002 - the native name
        for loc in locs:
            self._loc(publisher, loc)
        for loc in locs:
            for b in list(self._members[loc]):
                self._set_locs(b, b.locs - {loc})
            self._members[loc] = set()
        if all:
            self._engine[publisher] = {}

    def parent_key(self, publisher: int, engine_hash: int) -> bytes | None:
        self._pub(publisher)
        b = self._engine[publisher].get(engine_hash)
        return b.key.to_bytes(16, "big") if self._valid(b, publisher) else None

    def lookup(self, sid: int, keys: Any, serial: int | None = None) -> list[tuple[int, int, tuple[tuple[int, int], ...]]] | None:
        if serial is not None and not (0 <= sid < len(self._scopes) and self._scopes[sid][1]
                                       and self._scopes[sid][2] == serial):
            return None
        self._scope(sid)
        get = self._blocks.get
        present = []
        for k in _key_ints(keys):
            b = get((sid, k))
            present.append(b.locs if b is not None else _EMPTY)
        runs: dict[int, list[list[int]]] = {}
        n, i = len(present), 0
        while i < n:
            s = present[i]
            j = i + 1
            while j < n and present[j] is s:
                j += 1
            for loc in s:
                got = runs.get(loc)
                if got is None:
                    runs[loc] = [[i, j]]
                elif got[-1][1] == i:
                    got[-1][1] = j
                else:
                    got.append([i, j])
            i = j
        out = []
        for loc in sorted(runs):
            got = runs[loc]
            prefix = got[0][1] if got[0][0] == 0 else 0
            rest = got[1:] if prefix else got
            out.append((loc, prefix, tuple((s, e) for s, e in rest)))
        return out

    def _drop_blocks(self, blocks: list[_Block]) -> tuple[int, int]:
        m = 0
        for b in blocks:
            m += len(b.locs)
            self._set_locs(b, _EMPTY)
        return m, len(blocks)

    def forget(self, excess: int) -> tuple[int, int]:
        """Forget whole blocks, oldest stored first, until ``excess`` memberships are gone."""
        gone, total = [], 0
        for b in self._blocks.values():
            if total >= excess:
                break
            gone.append(b)
            total += len(b.locs)
        return self._drop_blocks(gone)

    def forget_scopes(self, sids: Sequence[int]) -> tuple[int, int]:
        want = set(sids)
        return self._drop_blocks([b for b in self._blocks.values() if b.sid in want])

    # inspection and checkpoints
    def facts(self) -> list[tuple[int, bytes, bytes]]:
        out = []
        for loc, members in enumerate(self._members):
            if members:
                blocks = sorted(members, key=lambda b: (b.sid, b.key))
                out.append((loc, _u32([b.sid for b in blocks]), b"".join(b.key.to_bytes(16, "big") for b in blocks)))
        return out

    def export(self, publisher: int) -> tuple[bytes, bytes, bytes, list[tuple[int, bytes]]]:
        self._pub(publisher)
        rows = [(h, b) for h, b in self._engine[publisher].items() if self._valid(b, publisher)]
        held = [(loc, _u32([r for r, (_h, b) in enumerate(rows) if loc in b.locs])) for loc in self._pub_locs[publisher]]
        return (np.array([h for h, _b in rows], "<u8").tobytes(), b"".join(b.key.to_bytes(16, "big") for _h, b in rows),
                _u32([b.sid for _h, b in rows]), held)

    def restore(self, publisher: int, hashes: Any, keys: Any, scopes: bytes,
                held: Sequence[tuple[int, bytes]]) -> None:
        self._pub(publisher)
        hs, ks = _hash_ints(hashes), _key_ints(keys)
        sids = np.frombuffer(scopes, "<u4").tolist()
        if not len(hs) == len(ks) == len(sids):
            raise ValueError("restore: hashes, keys and scopes differ in length")
        for s in sids:
            self._scope(s)
        rows = []
        for loc, raw in held:
            self._loc(publisher, loc)
            r = np.frombuffer(raw, "<u4").tolist()
            if any(x >= len(hs) for x in r):
                raise ValueError("restore: a held row is out of range")
            rows.append((loc, r))
        locs_of: list[set[int]] = [set() for _ in hs]
        for loc, r in rows:
            for x in r:
                locs_of[x].add(loc)
        eng = self._engine[publisher]
        for h, k, sid, locs in zip(hs, ks, sids, locs_of):
            if not locs:
                continue  # an entry whose block the publisher held nowhere: not part of its state
            b = self._block(sid, k)
            self._link(publisher, h, b)
            self._set_locs(b, b.locs | locs)
            eng[h] = b

    @property
    def blocks(self) -> int:
        return len(self._blocks)

    @property
    def live_scopes(self) -> int:
        return len(self._scopes) - len(self._free_scopes)

    @property
    def location_sets(self) -> int:
        return len(self._sets)

    @property
    def nbytes(self) -> int:
        """A rough estimate: ~300 bytes a block, ~100 an engine entry, ~70 a membership."""
        entries = sum(len(e) for e in self._engine)
        return 300 * len(self._blocks) + 100 * entries + 70 * self.memberships + 200 * len(self._sets)
