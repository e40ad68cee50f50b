"""Payloads: the bytes of one block (or one recurrent checkpoint) of state, and what binds them.

A payload is addressed by :class:`PayloadKey` — (descriptor id, canonical block key, KV group) —
and travels with a :class:`PayloadHeader` that repeats that address, the byte count and a
checksum. The checksum is XXH3-128 over the header's address fields *and* the data, so a payload
cannot be relabelled as another descriptor's, another block's or another group's without the
check failing, and one flipped byte anywhere is caught.

Why XXH3-128 (``benchmarks/bench_checksum.py``): on the 2-core development machine it hashes
about 10 GB/s from memory and 35 GB/s from cache, as fast as a memory copy (BLAKE2b manages
0.7 GB/s, CRC32 3.6 GB/s), releases the GIL so two copy lanes hash in parallel, and 128 bits make
an accidental match negligible. Verifying still costs: copies with verification run at 0.55-0.8
of a plain copy (``benchmarks/README.md``, ``copy_*``). It guards against corruption, not against an adversary who can write to a
tier: tiers are inside the deployment's trust boundary, and canonical keys (BLAKE2b, keyed per
tenant scope) already keep tenants apart.

The header has a fixed binary form (:data:`HEADER_BYTES`), used in front of the data in disk
files and on the remote tier's wire::

    magic "NKVP" | version u16 | flags u16 | group u32 | nbytes u64 | key 16 B | checksum 16 B |
    descriptor id, 64 B ASCII, NUL-padded | 12 B reserved (zero)      (big-endian, 128 bytes)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import xxhash

from nexuskv.descriptor import Tier
from nexuskv.errors import IntegrityError
from nexuskv.identity import KEY_BYTES

__all__ = [
    "CHECKSUM_ALGORITHM",
    "HEADER_BYTES",
    "PayloadKey",
    "PayloadHeader",
    "PayloadHandle",
    "payload_checksum",
    "verify_payload",
]

CHECKSUM_ALGORITHM = "xxh3-128"
HEADER_BYTES = 128
_MAGIC = b"NKVP"
_VERSION = 1
_DESCRIPTOR_FIELD = 64
_STRUCT = struct.Struct(f">4sHHIQ{KEY_BYTES}s16s{_DESCRIPTOR_FIELD}s12x")
assert _STRUCT.size == HEADER_BYTES
_ADDRESS = struct.Struct(f">4sHIQ{KEY_BYTES}s{_DESCRIPTOR_FIELD}s")  # what the checksum binds


@dataclass(frozen=True, slots=True, order=True)
class PayloadKey:
    """Where a payload belongs: one descriptor's state, one canonical block, one KV group."""

    descriptor_id: str
    key: int  # the canonical 128-bit block key (nexuskv.identity.BlockKey)
    group: int = 0
    # Keys are hashed several times per copied payload (indexes, reservations, rollbacks).
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        return self._hash

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.descriptor_id, self.key, self.group)))
        raw = self.descriptor_id.encode("ascii", "strict") if self.descriptor_id.isascii() else b""
        if not raw or len(raw) > _DESCRIPTOR_FIELD or b"\x00" in raw:
            raise ValueError(f"descriptor_id: 1 to {_DESCRIPTOR_FIELD} ASCII characters, got {self.descriptor_id!r}")
        if not 0 <= self.key < 1 << (8 * KEY_BYTES):
            raise ValueError("key: must be an unsigned 128-bit block key")
        if not 0 <= self.group < 1 << 32:
            raise ValueError("group: must be an unsigned 32-bit KV group id")

    def __str__(self) -> str:
        return f"{self.descriptor_id}/g{self.group}/{self.key:032x}"

    def address_bytes(self, nbytes: int) -> bytes:
        """The fields the checksum binds: magic, version, group, size, key, descriptor id."""
        return _ADDRESS.pack(_MAGIC, _VERSION, self.group, nbytes, self.key.to_bytes(KEY_BYTES, "big"),
                             self.descriptor_id.encode("ascii"))


@dataclass(frozen=True, slots=True)
class PayloadHeader:
    """A payload's address, size in bytes and checksum (XXH3-128 of address and data)."""

    key: PayloadKey
    nbytes: int
    checksum: int

    @classmethod
    def for_data(cls, key: PayloadKey, data: Any) -> PayloadHeader:
        """The header of ``data`` (any C-contiguous buffer: bytes, numpy array, memoryview)."""
        view = memoryview(data).cast("B")
        return cls(key=key, nbytes=view.nbytes, checksum=payload_checksum(key, view))

    def pack(self) -> bytes:
        k = self.key
        return _STRUCT.pack(_MAGIC, _VERSION, 0, k.group, self.nbytes, k.key.to_bytes(KEY_BYTES, "big"),
                            self.checksum.to_bytes(16, "big"), k.descriptor_id.encode("ascii"))

    @classmethod
    def unpack(cls, raw: bytes | bytearray | memoryview) -> PayloadHeader:
        """Parse a packed header; IntegrityError when it is not one (wrong magic, version or text)."""
        if len(raw) != HEADER_BYTES:
            raise IntegrityError(f"payload header is {len(raw)} bytes, not {HEADER_BYTES}")
        magic, version, _flags, group, nbytes, key, checksum, descriptor = _STRUCT.unpack(raw)
        if magic != _MAGIC:
            raise IntegrityError(f"payload header has magic {magic!r}, not {_MAGIC!r}")
        if version != _VERSION:
            raise IntegrityError(f"payload header version {version} is not {_VERSION}")
        try:
            descriptor_id = descriptor.rstrip(b"\x00").decode("ascii")
            pk = PayloadKey(descriptor_id, int.from_bytes(key, "big"), group)
        except (UnicodeDecodeError, ValueError) as exc:
            raise IntegrityError(f"payload header address is malformed: {exc}") from None
        return cls(key=pk, nbytes=nbytes, checksum=int.from_bytes(checksum, "big"))


@dataclass(frozen=True, slots=True)
class PayloadHandle:
    """A stored payload: which tier and backend instance hold it, its address, size and checksum.

    ``backend`` is the instance's label, for logs and observations; code never selects by it.
    """

    tier: Tier
    backend: str
    key: PayloadKey
    nbytes: int
    checksum: int


def payload_checksum(key: PayloadKey, data: Any) -> int:
    """XXH3-128 over ``key``'s address fields (with the data's size) and the data's bytes."""
    view = memoryview(data).cast("B")
    h = xxhash.xxh3_128(key.address_bytes(view.nbytes))
    h.update(view)
    return h.intdigest()


def verify_payload(expected: PayloadKey, header: PayloadHeader, data: Any) -> None:
    """Raise IntegrityError unless ``header`` names ``expected`` and ``data`` matches its checksum."""
    if header.key != expected:
        raise IntegrityError(f"payload header names {header.key}, not {expected}")
    view = memoryview(data).cast("B")
    if view.nbytes != header.nbytes:
        raise IntegrityError(f"payload {expected} has {view.nbytes} bytes, its header says {header.nbytes}")
    actual = payload_checksum(expected, view)
    if actual != header.checksum:
        raise IntegrityError(f"payload {expected} fails its {CHECKSUM_ALGORITHM} checksum "
                             f"(expected {header.checksum:032x}, got {actual:032x})")
