"""Which ``nexuskv.kv-events`` records an index may apply: one rule for the index worker and
every index replica, so that they hold the same facts.

A record is taken, in this order of checks, only if

1. it has a key, and the key is a publisher name (UTF-8);
2. it sits on the partition its key hashes to (the Kafka default partitioner, murmur2, which
   aiokafka and the Java client use; a librdkafka producer must set ``partitioner=murmur2_random``):
   a publisher's batches live on one partition, so one partition's checkpoint holds all of that
   publisher's state and nothing of it lives anywhere else (a replayed batch sent to another
   partition would otherwise put a stale copy of its publisher in that partition's checkpoint);
3. when the deployment has a bus secret (``NEXUSKV_BUS_SECRET``), it carries a valid signature of
   its key and value under that publisher's key (:mod:`nexuskv.contracts.kv_signature`), so no
   one without the key can publish as that publisher — a spoofed clear is refused before it is
   decoded;
4. it decodes as a :class:`~nexuskv.contracts.kv_events.KvEventBatch` (version 1, token ids) or a
   :class:`~nexuskv.contracts.keyed_events.KeyedBatch` (version 2, keyed by its publisher; see that
   module for what a consumer then trusts the publisher with) (:mod:`nexuskv.contracts.codec`);
5. the batch's ``publisher`` is the record's key.

Each refusal is a :class:`~nexuskv.errors.ContractError` (an
:class:`~nexuskv.errors.UnauthenticatedError` for 3) whose message is the dead-letter reason.
Sequence and incarnation are the index's own checks (:mod:`nexuskv.publishers`: duplicates,
stale incarnations, bounded jumps).

A change of the topic's partition count moves keys to other partitions: their records are then
refused as misplaced until the workers and replicas restart with the new count (and the
publishers' ordering is broken anyway: resync them).

**Decoding never holds the loop.** A batch may carry 65,536 events (a vLLM step that evicts
thousands of blocks emits one removal per block), and decoding that with :mod:`nexuskv.contracts.codec`
in one go takes ~0.5 s. :meth:`KvIntake.take` decodes a payload above :data:`INLINE_BYTES` in
slices — the msgpack stream is read one event at a time, events are validated in chunks, and a
:class:`Slicer` yields to the event loop every few milliseconds — with the same checks (size,
encoding, top-level map, schema version, the contract) and the same reasons as ``codec.decode``
(the count of further errors in a reason covers the chunk of the first one). The cost of one
record is then bounded by the cost of one event (which the contract bounds: 4,096 blocks, 2**20
tokens), not by the size of the batch. A version 2 payload above :data:`INLINE_BYTES` is decoded
the same way: msgspec reads the envelope with its events left as raw slices, then decodes and
checks them a chunk at a time between pauses (an event of 4,096 pre-keyed blocks is three byte
strings: it costs its length check, not its blocks).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any

import msgpack
import pydantic
from aiokafka.partitioner import murmur2
from pydantic import TypeAdapter

from nexuskv.contracts import codec, keyed_events, kv_signature
from nexuskv.contracts.keyed_events import KeyedBatch
from nexuskv.contracts.kv_events import MAX_EVENTS_PER_BATCH, KvEvent, KvEventBatch
from nexuskv.contracts.topics import KV_EVENTS, Topic
from nexuskv.errors import ContractError, SchemaVersionError, UnauthenticatedError

__all__ = ["KvIntake", "Slicer", "partition_of", "INLINE_BYTES", "SLICE_S"]

_CACHE = 1 << 14
INLINE_BYTES = 32 << 10  # payloads up to this size decode in one go (well under a millisecond or two)
SLICE_S = 0.002  # most seconds of work between two yields to the event loop
_CHUNK = 256  # events validated at a time
_EVENTS = TypeAdapter(list[KvEvent])
_UNPACK_ERRORS = (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
                  msgpack.UnpackException, UnicodeDecodeError, RecursionError)
_TYPE_OF_FIRST_BYTE = (((0x90, 0x9F), "list"), ((0xDC, 0xDD), "list"), ((0xA0, 0xBF), "str"), ((0xD9, 0xDB), "str"),
                       ((0xC4, 0xC6), "bytes"), ((0x00, 0x7F), "int"), ((0xE0, 0xFF), "int"), ((0xCC, 0xD3), "int"),
                       ((0xCA, 0xCB), "float"), ((0xC0, 0xC0), "NoneType"), ((0xC2, 0xC3), "bool"))


class Slicer:
    """Yields to the event loop once ``slice_s`` of work has passed since the last yield."""

    __slots__ = ("slice_s", "_began", "pauses")

    def __init__(self, slice_s: float = SLICE_S) -> None:
        self.slice_s = slice_s
        self._began = time.perf_counter()
        self.pauses = 0

    async def pause(self) -> None:
        if time.perf_counter() - self._began >= self.slice_s:
            await asyncio.sleep(0)
            self.pauses += 1
            self._began = time.perf_counter()

    def restart(self) -> None:
        self._began = time.perf_counter()


def partition_of(key: bytes, partitions: int) -> int:
    """The partition the Kafka default partitioner puts ``key`` on."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


class KvIntake:
    """The checks of the module docstring for one topic of ``partitions`` partitions."""

    def __init__(self, topic: Topic, *, partitions: int, bus_secret: bytes = b"") -> None:
        if partitions < 1:
            raise ValueError("partitions must be positive")
        self.topic = topic
        self.partitions = partitions
        self.authenticated = bool(bus_secret)
        self._secret = bus_secret
        self._parts: OrderedDict[bytes, int] = OrderedDict()
        self._keys: OrderedDict[bytes, bytes] = OrderedDict()

    def partition_of(self, key: bytes) -> int:
        part = self._parts.get(key)
        if part is None:
            part = self._parts[key] = partition_of(key, self.partitions)
            if len(self._parts) > _CACHE:
                self._parts.popitem(last=False)
        return part

    def owns(self, publisher: str, partition: int) -> bool:
        """Whether ``publisher``'s batches belong on ``partition``."""
        return self.partition_of(publisher.encode("utf-8")) == partition

    def _key_of(self, key: bytes) -> bytes:
        k = self._keys.get(key)
        if k is None:
            k = self._keys[key] = kv_signature.publisher_key(self._secret, key.decode("utf-8"))
            if len(self._keys) > _CACHE:
                self._keys.popitem(last=False)
        return k

    def batch(self, record: Any) -> KvEventBatch | KeyedBatch:
        """The record's batch, or ContractError saying why it may not be applied (decoded in one go)."""
        key, value = self._check(record)
        return self._same_publisher(key, codec.decode(self.topic, value))

    async def take(self, record: Any, slicer: Slicer) -> KvEventBatch | KeyedBatch:
        """As :meth:`batch`, decoding a large payload in slices (``slicer`` yields the loop)."""
        key, value = self._check(record)
        if len(value) <= INLINE_BYTES:
            batch = codec.decode(self.topic, value)
        elif keyed_events.is_keyed_payload(value):
            batch = await _decode_keyed_sliced(value, slicer)
        else:
            batch = await _decode_sliced(value, slicer)
        return self._same_publisher(key, batch)

    def _same_publisher(self, key: bytes, batch: Any) -> KvEventBatch | KeyedBatch:
        if not isinstance(batch, (KvEventBatch, KeyedBatch)):
            raise ContractError(f"{self.topic.name} carries kv-event batches, not {type(batch).__name__}")
        if batch.publisher.encode("utf-8") != key:
            raise ContractError(f"batch of publisher {batch.publisher[:80]!r} under record key {key[:80]!r}: a "
                                "kv-events record must be keyed by its batch's publisher", path="publisher")
        return batch

    def _check(self, record: Any) -> tuple[bytes, bytes]:
        """Key, partition and signature; returns (key, value)."""
        key = record.key
        if not key:
            raise ContractError("record has no key: kv-events records are keyed by their publisher", path="key")
        key = bytes(key)
        try:
            key.decode("utf-8")
        except UnicodeDecodeError:
            raise ContractError("record key is not UTF-8: kv-events records are keyed by their publisher",
                                path="key") from None
        expected = self.partition_of(key)
        if record.partition != expected:
            raise ContractError(f"record of publisher key {key[:80]!r} is on partition {record.partition}; its key "
                                f"belongs on partition {expected} of {self.partitions}", path="partition")
        value = record.value if record.value is not None else b""
        if self.authenticated:
            why = kv_signature.verify(self._key_of(key), key, bytes(value),
                                      kv_signature.signature_of(record.headers))
            if why is not None:
                raise UnauthenticatedError(f"unauthenticated batch for publisher key {key[:80]!r}: {why}")
        return key, bytes(value)


def _type_name(first: int) -> str:
    if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):
        return "dict"
    for (lo, hi), name in _TYPE_OF_FIRST_BYTE:
        if lo <= first <= hi:
            return name
    return "ext"


def _undecodable(exc: BaseException) -> ContractError:
    return ContractError(f"undecodable msgpack: {type(exc).__name__}: {exc}"[:400])


def _chunk_error(exc: pydantic.ValidationError, offset: int) -> ContractError:
    errors = exc.errors()
    first = errors[0]
    loc = list(first.get("loc", ()))
    if loc and isinstance(loc[0], int):
        loc[0] += offset
    path = ".".join(str(p) for p in ["events", *loc])
    msg = str(first.get("msg", "invalid"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    suffix = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    err = ContractError(f"KvEventBatch.{path}: {msg}{suffix}")
    err.path = path
    return err


def _validated(chunk: list[Any], offset: int) -> list[Any]:
    try:
        return _EVENTS.validate_python(chunk)
    except pydantic.ValidationError as exc:
        raise _chunk_error(exc, offset) from None
    except RecursionError:
        raise ContractError("payload nested too deeply") from None


async def _decode_sliced(raw: bytes, slicer: Slicer) -> KvEventBatch:
    """``codec.decode(KV_EVENTS, raw)``, in slices (see the module docstring)."""
    if len(raw) > codec.MAX_PAYLOAD_BYTES:
        raise ContractError(f"payload of {len(raw)} bytes exceeds {codec.MAX_PAYLOAD_BYTES}")
    # No valid map of the contract has more than a dozen keys: a hostile huge map is refused at its header.
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, use_list=True, max_map_len=64,
                                max_buffer_size=len(raw) + 1)
    unpacker.feed(raw)
    envelope: dict[str, Any] = {}
    events: Any = ()
    event_error: ContractError | None = None
    try:
        try:
            fields = unpacker.read_map_header()
        except ValueError:
            raise ContractError(f"top level must be a map, got {_type_name(raw[0])}") from None
        for _ in range(fields):
            name = unpacker.unpack()
            if name != "events":
                envelope[name] = unpacker.unpack()
                continue
            try:
                count = unpacker.read_array_header()
            except ValueError:
                events = unpacker.unpack()  # not a list: the contract says why below
                continue
            if count > MAX_EVENTS_PER_BATCH:
                raise ContractError(f"KvEventBatch.events: Tuple should have at most {MAX_EVENTS_PER_BATCH} items "
                                    f"after validation, not {count}")
            # Unpacked and validated a chunk at a time: the raw maps of a chunk are freed as soon as
            # it is validated, so the collector never has a whole batch of them to scan.
            # The first event error is kept until the envelope is checked: as in codec.decode, the
            # schema version and the batch's own fields are reported first.
            events = []
            chunk: list[Any] = []
            for i in range(count):
                chunk.append(unpacker.unpack())
                if len(chunk) == _CHUNK or i == count - 1:
                    if event_error is None:
                        try:
                            events.extend(_validated(chunk, len(events)))
                        except ContractError as exc:
                            event_error = exc
                    chunk = []
                    await slicer.pause()
        if unpacker.tell() != len(raw):
            raise msgpack.ExtraData(envelope, raw[unpacker.tell():])
    except ContractError:
        raise
    except _UNPACK_ERRORS as exc:
        raise _undecodable(exc) from None
    if "schema_version" not in envelope:
        raise SchemaVersionError("schema_version is missing", path="schema_version")
    version = envelope["schema_version"]
    if version == keyed_events.KEYED_SCHEMA_VERSION and not isinstance(version, bool):
        # A version 2 map another encoder ordered differently (msgspec's own starts with its version and
        # takes _decode_keyed_sliced): msgspec decodes it in one call, ~1 ms per MB.
        return codec.decode(KV_EVENTS, raw)
    if version != 1 or isinstance(version, bool):
        raise SchemaVersionError(f"schema_version {version!r} is not supported (this build reads 1, 2)",
                                 path="schema_version")
    head = KvEventBatch.model_validate({**envelope, "events": ()})
    if not isinstance(events, list):
        KvEventBatch.model_validate({**envelope, "events": events})  # raises the contract's reason
    if event_error is not None:
        raise event_error
    return head.model_copy(update={"events": tuple(events)})


async def _decode_keyed_sliced(raw: bytes, slicer: Slicer) -> KeyedBatch:
    """``codec.decode(KV_EVENTS, raw)`` of a version 2 payload, a chunk of events at a time."""
    if len(raw) > codec.MAX_PAYLOAD_BYTES:
        raise ContractError(f"payload of {len(raw)} bytes exceeds {codec.MAX_PAYLOAD_BYTES}")
    envelope = keyed_events.decode_envelope(raw)  # the envelope's errors first, as codec.decode reports them
    await slicer.pause()
    events: list[Any] = []
    raws = envelope.events
    for start in range(0, len(raws), _CHUNK):
        events.extend(keyed_events.decode_events(raws[start:start + _CHUNK], start))
        await slicer.pause()
    return KeyedBatch(publisher=envelope.publisher, incarnation=envelope.incarnation, seq=envelope.seq,
                      ts=envelope.ts, identity=envelope.identity, events=tuple(events))
