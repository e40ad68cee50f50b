"""The index sidecar's wire format: how an engine asks a per-node replica for its matches.

One request and one answer per frame, on a stream socket (a Unix socket on the node): a 4-byte
big-endian length, then a msgpack array decoded into the structs below by msgspec (their types
are checked as they are decoded: a field of the wrong type is a malformed frame, not a crash).

* :class:`Ask` — ``[version, op, id, scope, keys, timeout_ms]``: ``op`` :data:`OP_LOOKUP` with the
  identity scope and the canonical keys, block 0 first, packed as 16-byte big-endian digests
  (``keys``: the bytes :meth:`nexuskv.index.GlobalIndex.lookup` takes as they are); or
  :data:`OP_SYNC` — answer once the replica has applied everything published so far (at most
  ``timeout_ms``), for tests and operators, never on an engine's hot path.
* :class:`Answer` — ``[version, id, error, num_blocks, lag_events, lag_ms, matches]``: a
  :class:`~nexuskv.lookup.LookupResult` with each match as :class:`WireMatch` (worker, tier,
  group, publisher, prefix, extents, certainty), or ``error`` (non-empty) and no matches.

:func:`result_of` turns an answer into a LookupResult and refuses, with :class:`WireError`, one
that does not fit its question: another request's id, another number of blocks, a prefix or an
extent outside the query, extents out of order, an unknown tier. Pure functions, no I/O.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import msgspec
import numpy as np

from nexuskv.descriptor import Tier
from nexuskv.entries import EntryLocation
from nexuskv.errors import NexusKVError
from nexuskv.identity import IdentityScope
from nexuskv.lookup import Extent, LocationMatch, LookupResult

__all__ = ["VERSION", "OP_LOOKUP", "OP_SYNC", "MAX_FRAME", "MAX_KEYS", "ASK_OVERHEAD", "WireScope", "Ask", "WireMatch",
           "Answer", "WireError", "ask_frame_limit", "pack_keys", "frame", "encode_ask", "decode_ask", "encode_answer",
           "decode_answer", "answer_of", "result_of", "scope_of", "wire_scope"]

VERSION = 1
OP_LOOKUP = 1
OP_SYNC = 2
MAX_KEYS = 1 << 16
#: The largest frame either side accepts (a 65,536-key ask is 1 MiB; an answer is far smaller).
MAX_FRAME = 4 << 20
#: Room in an ask's frame beyond its keys: the array, the ints, the scope's strings (each at most
#: a few hundred bytes once validated), the keys' bin header.
ASK_OVERHEAD = 4096
_LEN = struct.Struct(">I")
_TIERS = {t.value: t for t in Tier}


class WireError(NexusKVError):
    """A frame that is not a valid ask or answer (the reason says what)."""


class WireScope(msgspec.Struct, array_like=True, frozen=True):
    tenant_namespace: str
    model: str
    model_revision: str
    tokenizer_revision: str
    descriptor_id: str
    lora: str | None = None
    cache_salt: str | None = None


class Ask(msgspec.Struct, array_like=True, frozen=True):
    version: int
    op: int
    id: int
    scope: WireScope | None = None
    keys: bytes = b""
    timeout_ms: float = 0.0


class WireMatch(msgspec.Struct, array_like=True, frozen=True):
    worker: str
    tier: str
    group: int
    publisher: str
    prefix_blocks: int
    extents: list[tuple[int, int]] = []
    certain: bool = True


class Answer(msgspec.Struct, array_like=True, frozen=True):
    version: int
    id: int
    error: str = ""
    num_blocks: int = 0
    lag_events: int = 0
    lag_ms: float = 0.0
    matches: list[WireMatch] = []


_ask_decoder = msgspec.msgpack.Decoder(Ask)
_answer_decoder = msgspec.msgpack.Decoder(Answer)
_encoder = msgspec.msgpack.Encoder()


def wire_scope(scope: IdentityScope) -> WireScope:
    return WireScope(scope.tenant_namespace, scope.model, scope.model_revision, scope.tokenizer_revision,
                     scope.descriptor_id, scope.lora, scope.cache_salt)


def scope_of(scope: WireScope) -> IdentityScope:
    """The identity scope an ask names (pydantic checks its fields: IdentityError/ValueError if bad)."""
    return IdentityScope(tenant_namespace=scope.tenant_namespace, model=scope.model,
                         model_revision=scope.model_revision, tokenizer_revision=scope.tokenizer_revision,
                         descriptor_id=scope.descriptor_id, lora=scope.lora, cache_salt=scope.cache_salt)


def pack_keys(keys: Sequence[int] | np.ndarray | bytes) -> bytes:
    """Canonical keys as 16-byte big-endian digests, concatenated (bytes are taken as they are)."""
    if isinstance(keys, (bytes, bytearray, memoryview)):
        raw = bytes(keys)
        if len(raw) % 16:
            raise ValueError(f"packed keys are {len(raw)} bytes, not a multiple of 16")
        return raw
    if isinstance(keys, np.ndarray):
        if keys.ndim != 2 or keys.shape[1] != 2:
            raise ValueError(f"a key array has shape (n, 2), not {keys.shape}")
        return keys.astype(">u8").tobytes()
    return b"".join([k.to_bytes(16, "big") for k in keys])


def ask_frame_limit(max_keys: int) -> int:
    """The largest ask body a server taking at most ``max_keys`` keys needs to read."""
    return min(MAX_FRAME, 16 * max_keys + ASK_OVERHEAD)


def frame(body: bytes) -> bytes:
    return _LEN.pack(len(body)) + body


def frame_length(header: bytes, limit: int = MAX_FRAME) -> int:
    """The body length a 4-byte header announces; WireError beyond ``limit`` (:data:`MAX_FRAME`)."""
    (n,) = _LEN.unpack(header)
    if n > limit:
        raise WireError(f"a frame of {n} bytes is larger than {limit}")
    return n


def encode_ask(ask: Ask) -> bytes:
    return frame(_encoder.encode(ask))


def decode_ask(body: bytes) -> Ask:
    """The ask in a frame's body; WireError when it is not one this version understands."""
    try:
        ask = _ask_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"not an ask: {exc}") from None
    if ask.version != VERSION:
        raise WireError(f"ask version {ask.version}; this sidecar speaks {VERSION}")
    if ask.op == OP_LOOKUP:
        if ask.scope is None:
            raise WireError("a lookup names its scope")
        if len(ask.keys) % 16:
            raise WireError(f"keys are {len(ask.keys)} bytes, not a multiple of 16")
        if len(ask.keys) // 16 > MAX_KEYS:
            raise WireError(f"{len(ask.keys) // 16} keys; at most {MAX_KEYS}")
    elif ask.op != OP_SYNC:
        raise WireError(f"unknown op {ask.op}")
    if not (ask.timeout_ms >= 0 and math.isfinite(ask.timeout_ms)):
        raise WireError(f"timeout_ms {ask.timeout_ms} is not a finite, non-negative number")
    return ask


def answer_of(request_id: int, result: LookupResult) -> Answer:
    return Answer(VERSION, request_id, "", result.num_blocks, result.lag_events, result.lag_ms,
                  [WireMatch(m.location.worker, m.location.tier.value, m.location.group, m.publisher,
                             m.prefix_blocks, [(e.start, e.end) for e in m.extents], m.certain)
                   for m in result.matches])


def encode_answer(answer: Answer) -> bytes:
    return frame(_encoder.encode(answer))


def decode_answer(body: bytes) -> Answer:
    try:
        answer = _answer_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"not an answer: {exc}") from None
    if answer.version != VERSION:
        raise WireError(f"answer version {answer.version}; this client speaks {VERSION}")
    return answer


class LocationCache:
    """EntryLocations by (worker, tier, group), built (and validated) once: at most ``limit`` kept."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._cache: dict[tuple[str, str, int], EntryLocation] = {}

    def get(self, worker: str, tier: str, group: int) -> EntryLocation:
        key = (worker, tier, group)
        loc = self._cache.get(key)
        if loc is None:
            t = _TIERS.get(tier)
            if t is None:
                raise WireError(f"unknown tier {tier!r}")
            try:
                loc = EntryLocation(worker=worker, tier=t, group=group)
            except ValueError as exc:
                raise WireError(f"bad location {worker!r}/{tier}/{group}: {str(exc).splitlines()[0]}") from None
            if len(self._cache) >= self.limit:
                self._cache.clear()
            self._cache[key] = loc
        return loc


def result_of(answer: Answer, request_id: int, num_blocks: int, locations: LocationCache) -> LookupResult:
    """The LookupResult an answer gives for a lookup of ``num_blocks`` keys; WireError if it cannot be one."""
    if answer.id != request_id:
        raise WireError(f"answer to request {answer.id}, expected {request_id}")
    if answer.error:
        raise WireError(f"the sidecar refused the lookup: {answer.error[:300]}")
    if answer.num_blocks != num_blocks:
        raise WireError(f"answer for {answer.num_blocks} blocks, asked {num_blocks}")
    if answer.lag_events < 0 or not answer.lag_ms >= 0:  # NaN fails too; +inf is a valid "unknown"
        raise WireError(f"lag {answer.lag_events} events / {answer.lag_ms} ms")
    matches = []
    for m in answer.matches:
        if not 0 <= m.prefix_blocks <= num_blocks:
            raise WireError(f"prefix of {m.prefix_blocks} blocks in a query of {num_blocks}")
        extents = ()
        if m.extents:
            last = m.prefix_blocks
            out = []
            for start, end in m.extents:
                if not last < start < end <= num_blocks:  # beyond the first gap, ascending, disjoint
                    raise WireError(f"extent [{start}, {end}) out of order or outside [0, {num_blocks})")
                out.append(Extent(start, end))
                last = end
            extents = tuple(out)
        if m.prefix_blocks == 0 and not extents:
            raise WireError("a match with no block")
        matches.append(LocationMatch(locations.get(m.worker, m.tier, m.group), m.publisher, m.prefix_blocks,
                                     extents, m.certain))
    return LookupResult(num_blocks=num_blocks, matches=tuple(matches), lag_events=answer.lag_events,
                        lag_ms=answer.lag_ms)
