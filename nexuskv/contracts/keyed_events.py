"""``nexuskv.kv-events`` version 2: pre-keyed lifecycle events, binary, decoded without Python loops.

Version 1 (:mod:`nexuskv.contracts.kv_events`) carries token ids and every consumer re-derives
each block's canonical key from them (a keyed BLAKE2b per block, ~1 µs, in every index copy).
Version 2 is keyed **once, at the edge**: the publisher (the event bridge, a tier publisher, a
tier manager, the reference runtime) knows the identity scope and the deployment's identity
secret, computes the canonical keys (:mod:`nexuskv.identity`) and publishes them packed:

* ``keys``: ``n`` canonical keys, 16 bytes each, big-endian (:meth:`BlockKeyer.digests` joined);
* ``engine_hashes``: the publisher's own ``n`` block hashes, 8 bytes each, little-endian u64
  (they name the blocks in later removals and tier events of the same publisher);
* ``token_ids``: absent by default. Token ids are prompt content; they stay off the bus unless a
  deployment opts in (``NEXUSKV_KV_EVENTS_TOKENS=on``, :class:`~nexuskv.config.Settings`), for a
  consumer that needs them; then ``n * block_size`` ids, 4 bytes each, little-endian u32.

The payload is msgpack, encoded and decoded by msgspec structs (tagged, the batch by
``schema_version`` = 2, each event by ``type``): a stored run of 512 blocks is three ``bin``
fields, validated by length in one ``__post_init__``, so decoding costs per event, not per block
(``benchmarks/bench_kv_decode.py``). Version 1 stays decodable: :func:`nexuskv.contracts.codec.decode`
reads both (a v2 payload starts with the map key ``schema_version`` and the int 2, which is how
msgspec writes this struct; any other payload takes the v1 path, which names its version).

**Trust.** A consumer cannot check a pre-keyed block against its content: it has no tokens. A
key is therefore exactly as trustworthy as its publisher. When the deployment has a bus secret,
every kv-events record is signed with its publisher's key (:mod:`nexuskv.contracts.kv_signature`,
over the raw bytes, whatever version they hold), so a signed publisher *vouches* for its keys:
it can place (or withhold) facts about its own blocks — as it could with v1 by sending tokens it
does not hold — but cannot remove or overwrite another publisher's facts (removals and clears are
scoped to the publisher), cannot publish as another publisher, and cannot compute another
tenant's keys without the identity secret. What a v2 publisher additionally needs is the identity
secret itself: give it only to processes you would trust to key blocks (the bridge and connectors
on the engine's host; not the engine's users). A wrong key is at worst a false hit for a prefix
whose reuse then fails the data plane's checksum and address checks and falls back to recompute.

JSON: the structs also encode as JSON (msgspec), where ``bytes`` are base64 (the JSON Schema says
``contentEncoding: base64``); :func:`to_jsonable` renders a batch for people and tools with keys as
lowercase hex strings (32 digits), as every NexusKV JSON form renders 128-bit keys.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta

from nexuskv.contracts.kv_events import MAX_BLOCKS_PER_EVENT, MAX_EVENTS_PER_BATCH, PublisherIdentity
from nexuskv.descriptor import Tier
from nexuskv.errors import ContractError

__all__ = [
    "HASH_BYTES",
    "KEYED_SCHEMA_VERSION",
    "KEY_BYTES",
    "TOKEN_BYTES",
    "Cleared",
    "KeyedBatch",
    "KeyedEvent",
    "KeyedStored",
    "Removed",
    "SnapshotMark",
    "TierStored",
    "decode_keyed",
    "encode_keyed",
    "is_keyed_payload",
    "keyed_schema",
    "pack_hashes",
    "to_jsonable",
    "unpack_hashes",
]

KEYED_SCHEMA_VERSION = 2
KEY_BYTES = 16
HASH_BYTES = 8
TOKEN_BYTES = 4
MAX_TOKENS_PER_EVENT = 1 << 20

Group = Annotated[int, Meta(ge=0, le=1024)]
Text = Annotated[str, Meta(min_length=1, max_length=1024)]
Keys = Annotated[bytes, Meta(min_length=KEY_BYTES, max_length=MAX_BLOCKS_PER_EVENT * KEY_BYTES)]
Hashes = Annotated[bytes, Meta(min_length=HASH_BYTES, max_length=MAX_BLOCKS_PER_EVENT * HASH_BYTES)]


def _hash_count(hashes: bytes, field: str) -> int:
    if len(hashes) % HASH_BYTES:
        raise ValueError(f"{field}: {len(hashes)} bytes is not a whole number of 8-byte engine hashes")
    return len(hashes) // HASH_BYTES


class KeyedStored(msgspec.Struct, tag_field="type", tag="stored", frozen=True, forbid_unknown_fields=True):
    """A run of blocks now present in ``tier`` for KV ``group``, with their canonical keys.

    ``keys[16*i:16*i+16]`` is the canonical key of the block named ``engine_hashes[8*i:8*i+8]``,
    computed by the publisher in the scope of the batch identity with this event's overrides.
    """

    @property
    def type(self) -> str:
        """The event's tag (``stored``), as version 1's events name theirs."""
        return "stored"

    engine_hashes: Hashes
    keys: Keys
    block_size: Annotated[int, Meta(ge=1, le=1 << 16)]
    tier: Tier = Tier.GPU
    group: Group = 0
    tenant_namespace: Text | None = None
    lora: Text | None = None
    cache_salt: Text | None = None
    token_ids: Annotated[bytes, Meta(max_length=MAX_TOKENS_PER_EVENT * TOKEN_BYTES)] | None = None

    def __post_init__(self) -> None:
        n = _hash_count(self.engine_hashes, "engine_hashes")
        if len(self.keys) != n * KEY_BYTES:
            raise ValueError(f"keys: {len(self.keys)} bytes for {n} engine hashes (16 bytes per key)")
        if self.token_ids is not None and len(self.token_ids) != n * self.block_size * TOKEN_BYTES:
            raise ValueError(f"token_ids: {len(self.token_ids)} bytes, not {n} blocks of {self.block_size} "
                             "4-byte token ids")

    def __len__(self) -> int:
        return len(self.engine_hashes) // HASH_BYTES


class TierStored(msgspec.Struct, tag_field="type", tag="tier", frozen=True, forbid_unknown_fields=True):
    """Blocks this publisher announced (by engine hash) are now also present in ``tier``."""

    @property
    def type(self) -> str:
        """The event's tag (``tier``), as version 1's events name theirs."""
        return "tier"

    engine_hashes: Hashes
    tier: Tier
    group: Group = 0

    def __post_init__(self) -> None:
        _hash_count(self.engine_hashes, "engine_hashes")

    def __len__(self) -> int:
        return len(self.engine_hashes) // HASH_BYTES


class Removed(msgspec.Struct, tag_field="type", tag="removed", frozen=True, forbid_unknown_fields=True):
    """Engine hashes no longer present in this publisher's ``tier`` and ``group``."""

    @property
    def type(self) -> str:
        """The event's tag (``removed``), as version 1's events name theirs."""
        return "removed"

    engine_hashes: Hashes
    tier: Tier = Tier.GPU
    group: Group = 0

    def __post_init__(self) -> None:
        _hash_count(self.engine_hashes, "engine_hashes")

    def __len__(self) -> int:
        return len(self.engine_hashes) // HASH_BYTES


class Cleared(msgspec.Struct, tag_field="type", tag="cleared", frozen=True, forbid_unknown_fields=True):
    """Everything of this publisher (in ``tier`` when given) is gone."""

    @property
    def type(self) -> str:
        """The event's tag (``cleared``), as version 1's events name theirs."""
        return "cleared"

    tier: Tier | None = None


class SnapshotMark(msgspec.Struct, tag_field="type", tag="snapshot", frozen=True, forbid_unknown_fields=True):
    """``begin``: the publisher's facts are being replaced (uncertain until ``end``)."""

    @property
    def type(self) -> str:
        """The event's tag (``snapshot``), as version 1's events name theirs."""
        return "snapshot"

    phase: Literal["begin", "end"]


KeyedEvent = Union[KeyedStored, TierStored, Removed, Cleared, SnapshotMark]


class KeyedBatch(msgspec.Struct, tag_field="schema_version", tag=KEYED_SCHEMA_VERSION, frozen=True,
                 forbid_unknown_fields=True):
    """One publisher batch of pre-keyed events (same envelope as version 1's ``KvEventBatch``)."""

    publisher: Annotated[str, Meta(min_length=1, max_length=512)]
    incarnation: Annotated[int, Meta(ge=0, le=2**63 - 1)]
    seq: Annotated[int, Meta(ge=0, le=2**63 - 1)]
    ts: float
    identity: PublisherIdentity
    events: Annotated[tuple[KeyedEvent, ...], Meta(max_length=MAX_EVENTS_PER_BATCH)]

    def __post_init__(self) -> None:
        _worker_under_name(self.publisher, self.identity)

    @property
    def schema_version(self) -> int:
        return KEYED_SCHEMA_VERSION

    @property
    def block_operations(self) -> int:
        """Blocks stored or removed by this batch (the unit of the index's throughput)."""
        blocks = (len(e.engine_hashes) for e in self.events if not isinstance(e, (Cleared, SnapshotMark)))
        return sum(blocks) // HASH_BYTES


def _worker_under_name(publisher: str, identity: PublisherIdentity) -> None:
    """As version 1: a publisher speaks only for the worker its name is under."""
    worker = identity.worker
    if worker is not None and not publisher.startswith(worker + "/"):
        raise ValueError(f"identity.worker: {worker!r} is not a path prefix of publisher {publisher!r}")


def pack_hashes(hashes: Any) -> bytes:
    """Engine hashes (ints in [0, 2**64)) as ``8 * n`` little-endian bytes."""
    try:
        return b"".join([int(h).to_bytes(HASH_BYTES, "little") for h in hashes])
    except OverflowError:
        raise ContractError("engine_hashes: each must be an int in [0, 2**64)") from None


def unpack_hashes(raw: bytes) -> list[int]:
    return [int.from_bytes(raw[i:i + HASH_BYTES], "little") for i in range(0, len(raw), HASH_BYTES)]


# -- identity: the v1 contract (pydantic), carried inside the msgspec struct ---------------------------
# Its fields are validated by pydantic, as everywhere else; one publisher sends the same identity in
# every batch, so decoded identities are cached by their fields (a dict lookup per batch).

_IDENTITIES: OrderedDict[tuple, PublisherIdentity] = OrderedDict()
_IDENTITY_CACHE = 1024


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, PublisherIdentity):
        return obj.model_dump(mode="json", exclude_defaults=False)
    raise TypeError(f"kv-events v2: cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is PublisherIdentity:
        if not isinstance(obj, dict):
            raise ValueError(f"identity: expected a map, got {type(obj).__name__}")
        key = tuple(obj.items())  # in the order sent: a publisher sends the same order every time
        try:
            hit = _IDENTITIES.get(key)
        except TypeError:  # an unhashable value: not an identity, pydantic says why below
            key, hit = None, None
        if hit is not None:
            return hit
        try:
            ident = PublisherIdentity.model_validate(obj)
        except ContractError as exc:
            raise ValueError(f"identity: {exc}") from None
        if key is not None:
            _IDENTITIES[key] = ident
            if len(_IDENTITIES) > _IDENTITY_CACHE:
                _IDENTITIES.popitem(last=False)
        return ident
    raise TypeError(f"kv-events v2: cannot decode {kind!r}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODER = msgspec.msgpack.Decoder(KeyedBatch, dec_hook=_dec_hook)
_EVENT_DECODER = msgspec.msgpack.Decoder(KeyedEvent)
_PREFIX = b"\xaeschema_version\x02"


class _Envelope(msgspec.Struct, tag_field="schema_version", tag=KEYED_SCHEMA_VERSION, frozen=True,
                forbid_unknown_fields=True):
    """A v2 batch with its events left raw (for decoding them a chunk at a time)."""

    publisher: Annotated[str, Meta(min_length=1, max_length=512)]
    incarnation: Annotated[int, Meta(ge=0, le=2**63 - 1)]
    seq: Annotated[int, Meta(ge=0, le=2**63 - 1)]
    ts: float
    identity: PublisherIdentity
    events: Annotated[list[msgspec.Raw], Meta(max_length=MAX_EVENTS_PER_BATCH)]

    def __post_init__(self) -> None:
        _worker_under_name(self.publisher, self.identity)


_ENVELOPE_DECODER = msgspec.msgpack.Decoder(_Envelope, dec_hook=_dec_hook)


def is_keyed_payload(raw: bytes | memoryview) -> bool:
    """Whether ``raw`` is laid out as msgspec writes a :class:`KeyedBatch` (its first key and value)."""
    if len(raw) < 17:
        return False
    first = raw[0]
    if 0x80 <= first <= 0x8F:
        return raw[1:17] == _PREFIX
    if first == 0xDE:
        return raw[3:19] == _PREFIX
    return False


def encode_keyed(batch: KeyedBatch) -> bytes:
    return _ENCODER.encode(batch)


def _contract_error(exc: msgspec.ValidationError | msgspec.DecodeError) -> ContractError:
    text = str(exc)
    path = "<root>"
    if " - at `$." in text:
        text, _, where = text.rpartition(" - at `$.")
        path = where.rstrip("`")
    if isinstance(exc, msgspec.ValidationError):
        err = ContractError(f"KeyedBatch.{path}: {text}"[:400])
    else:
        err = ContractError(f"undecodable msgpack: {text}"[:400])
    err.path = path
    return err


def decode_keyed(raw: bytes | memoryview) -> KeyedBatch:
    """A v2 payload to a :class:`KeyedBatch`; ContractError (with the field's path) when malformed."""
    try:
        return _DECODER.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _contract_error(exc) from None
    except RecursionError:
        raise ContractError("payload nested too deeply") from None


def decode_envelope(raw: bytes | memoryview) -> _Envelope:
    """The batch's fields, its events still raw (each a slice of ``raw``)."""
    try:
        return _ENVELOPE_DECODER.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _contract_error(exc) from None


def decode_events(raws: list[msgspec.Raw], offset: int) -> list[KeyedEvent]:
    """Events of a chunk of :func:`decode_envelope`'s raw events (``offset``: the chunk's first index)."""
    out = []
    decode = _EVENT_DECODER.decode
    for i, r in enumerate(raws):
        try:
            out.append(decode(r))
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            err = _contract_error(exc)
            path = f"events[{offset + i}]" + ("" if err.path == "<root>" else f".{err.path}")
            msg = str(err).split(": ", 1)[1] if ": " in str(err) else str(err)
            out_err = ContractError(f"KeyedBatch.{path}: {msg}"[:400])
            out_err.path = path
            raise out_err from None
    return out


def keyed_schema() -> dict:
    """The JSON Schema of :class:`KeyedBatch` (the identity's part is the v1 contract's own)."""
    ident = PublisherIdentity.model_json_schema(mode="serialization")

    def hook(kind: type) -> dict:
        if kind is PublisherIdentity:
            return ident
        raise TypeError(f"kv-events v2: no JSON Schema for {kind!r}")

    doc = msgspec.json.schema(KeyedBatch, schema_hook=hook)
    doc["$comment"] = ("nexuskv.kv-events schema_version 2 (msgpack; bytes are msgpack bin, base64 in JSON): "
                       "keys 16 bytes each big-endian, engine_hashes 8 bytes each little-endian, token_ids "
                       "(absent unless the deployment opts in) 4 bytes each little-endian")
    return doc


def to_jsonable(batch: KeyedBatch) -> dict:
    """A batch as plain JSON data for people and tools: keys as 32-digit lowercase hex strings,
    engine hashes as 16-digit hex strings (JSON numbers lose precision past 2**53)."""
    events = []
    for e in batch.events:
        d: dict[str, Any] = {"type": type(e).__struct_config__.tag}
        for name in e.__struct_fields__:
            v = getattr(e, name)
            if name == "keys":
                v = [v[i:i + KEY_BYTES].hex() for i in range(0, len(v), KEY_BYTES)]
            elif name == "engine_hashes":
                v = [f"{h:016x}" for h in unpack_hashes(v)]
            elif name == "token_ids" and v is not None:
                v = [int.from_bytes(v[i:i + TOKEN_BYTES], "little") for i in range(0, len(v), TOKEN_BYTES)]
            elif isinstance(v, Tier):
                v = v.value
            d[name] = v
        events.append(d)
    return {"schema_version": KEYED_SCHEMA_VERSION, "publisher": batch.publisher, "incarnation": batch.incarnation,
            "seq": batch.seq, "ts": batch.ts, "identity": batch.identity.model_dump(mode="json"), "events": events}
