"""The index checkpoint format: publishers' complete state as bytes, and back.

One checkpoint holds, per publisher, its sequence and certainty state, its locations, and its
blocks (128-bit keys with their identity scope, the engine hash it published each under, and
which of its locations hold each). :meth:`nexuskv.index.GlobalIndex.checkpoint` builds an
:class:`IndexCheckpoint` from its tables and :func:`encode`s it; ``restore`` :func:`decode`s one
and replays it into its tables. msgpack with little-endian arrays as ``bin``; versioned, and a
version this code does not know is refused (compatibility fails closed).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import numpy as np

from nexuskv.descriptor import Tier
from nexuskv.identity import IdentityScope

__all__ = ["CHECKPOINT_VERSION", "IndexCheckpoint", "PublisherCheckpoint", "encode", "decode"]

CHECKPOINT_VERSION = 1


@dataclass(frozen=True, slots=True)
class PublisherCheckpoint:
    """One publisher's state. Arrays are aligned by row: row ``i`` is one block of the publisher."""

    name: str
    incarnation: int
    next_seq: int
    certain: bool
    reason: str | None
    in_snapshot: bool
    snapshot_clean: bool
    locations: tuple[tuple[Tier, int], ...]  # (tier, group), in location order
    held: tuple[np.ndarray, ...]  # per location: the rows it holds (uint32)
    engine_hashes: np.ndarray  # uint64, per row
    key_lo: np.ndarray  # uint64, per row: the canonical key's low and high halves
    key_hi: np.ndarray
    scope: np.ndarray  # uint32, per row: index into IndexCheckpoint.scopes
    worker: str | None = None  # the engine worker its locations belong to (PublisherIdentity.worker)


@dataclass(frozen=True, slots=True)
class IndexCheckpoint:
    scopes: tuple[IdentityScope, ...]
    publishers: tuple[PublisherCheckpoint, ...]


def encode(cp: IndexCheckpoint) -> bytes:
    pubs = [{
        "name": p.name, "incarnation": p.incarnation, "next_seq": p.next_seq, "certain": p.certain,
        "reason": p.reason, "in_snapshot": p.in_snapshot, "clean": p.snapshot_clean,
        "locs": [[t.value, g] for (t, g) in p.locations],
        "held": [np.asarray(h, "<u4").tobytes() for h in p.held],
        "ehash": np.asarray(p.engine_hashes, "<u8").tobytes(),
        "lo": np.asarray(p.key_lo, "<u8").tobytes(),
        "hi": np.asarray(p.key_hi, "<u8").tobytes(),
        "scope": np.asarray(p.scope, "<u4").tobytes(),
        "worker": p.worker,
    } for p in cp.publishers]
    return msgpack.packb({"version": CHECKPOINT_VERSION, "scopes": [s.model_dump(mode="json") for s in cp.scopes],
                          "publishers": pubs}, use_bin_type=True)


def decode(data: bytes) -> IndexCheckpoint:
    """Parse a checkpoint; raises ValueError on a version this code does not know."""
    doc = msgpack.unpackb(data, raw=False)
    if doc.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"index checkpoint version {doc.get('version')!r} is not {CHECKPOINT_VERSION}")
    scopes = tuple(IdentityScope.model_validate(s) for s in doc["scopes"])
    pubs = tuple(PublisherCheckpoint(
        name=item["name"], incarnation=item["incarnation"], next_seq=item["next_seq"], certain=item["certain"],
        reason=item["reason"], in_snapshot=item["in_snapshot"], snapshot_clean=item["clean"],
        locations=tuple((Tier(t), int(g)) for t, g in item["locs"]),
        held=tuple(np.frombuffer(h, "<u4").astype(np.intp) for h in item["held"]),
        engine_hashes=np.frombuffer(item["ehash"], "<u8").astype(np.uint64),
        key_lo=np.frombuffer(item["lo"], "<u8").astype(np.uint64),
        key_hi=np.frombuffer(item["hi"], "<u8").astype(np.uint64),
        scope=np.frombuffer(item["scope"], "<u4").astype(np.intp),
        worker=item.get("worker"),  # absent in checkpoints written before the field
    ) for item in doc["publishers"])
    return IndexCheckpoint(scopes, pubs)
