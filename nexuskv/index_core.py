"""The storage core under :class:`~nexuskv.index.GlobalIndex`: blocks by scoped 128-bit key,
their location sets, every publisher's engine-hash map, and the lookup inner loop.

It is native code: ``nexuskv._native.Core``, Rust (``nexuskv/native/``), built by
``pip install -e .`` through setuptools-rust. There is no other backend: an index without it
raises :class:`NativeUnavailable` when it is built, naming the build command, so every service
fails at start instead of running on something slower. The same semantics are written once
more, as plainly as possible, as the test oracle (``tests/oracles/reference_index.py``), which
the property tests compare :class:`~nexuskv.index.GlobalIndex` with after every step.

**Semantics the core owns** (the publisher rules above it — sequence, incarnation, certainty —
are :mod:`nexuskv.index`'s):

* A block is (scope id, canonical key). A lookup in scope A probes A's keys only: the table
  stores every key mixed with its scope's salt and checks the scope on a full-key match, so a
  key that exists only in another scope costs what a key that exists nowhere costs. A scope id
  freed and reused gets a new serial; a lookup that names the old serial answers ``None``.
* A block exists while some location holds it (its location set is not empty).
* An engine-map entry ``(publisher, hash) -> block`` is valid while the publisher holds that
  block somewhere; invalid entries behave as absent. A stored hash that named another block
  moves to the new block, and the old block leaves every location of that publisher.
* A clear of locations visits what they hold (per-location member lists), never the index.
* A lookup answers, per location holding any of the keys, its runs of consecutive keys held
  there: ``(loc, prefix_blocks, ((start, end), ...))``, by location id.

**Threads.** The core is behind a readers-writer lock: lookups (and checkpoint exports) run in
parallel, each write excludes them, and every call with real work releases the GIL while it
waits for the lock and while it works, so a lookup in one thread never holds up Python code in
another, and no thread waits for the lock holding the GIL.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BUILD_HINT", "NativeUnavailable", "make_core"]

BUILD_HINT = ("build it with `python -m pip install -e .` (needs cargo and rustc: https://rustup.rs), or in place "
              "in a source tree with `python -c 'import setuptools; setuptools.setup()' build_rust --inplace "
              "--release` (needs setuptools-rust)")


class NativeUnavailable(ImportError):
    """The native index core (``nexuskv._native``) is not built for this interpreter."""


def make_core(seed: bytes) -> Any:
    """A new, empty ``nexuskv._native.Core`` whose hash functions ``seed`` (32 bytes) chooses."""
    try:
        from nexuskv._native import Core
    except ImportError as exc:
        raise NativeUnavailable(f"the index needs its native core, nexuskv._native, which is not importable "
                                f"({exc}): {BUILD_HINT}") from None
    return Core(seed)
