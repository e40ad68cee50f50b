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
4. it decodes as a :class:`~nexuskv.contracts.kv_events.KvEventBatch` (:mod:`nexuskv.contracts.codec`);
5. the batch's ``publisher`` is the record's key.

Each refusal is a :class:`~nexuskv.errors.ContractError` (an
:class:`~nexuskv.errors.UnauthenticatedError` for 3) whose message is the dead-letter reason.
Sequence and incarnation are the index's own checks (:mod:`nexuskv.publishers`: duplicates,
stale incarnations, bounded jumps).

A change of the topic's partition count moves keys to other partitions: their records are then
refused as misplaced until the workers and replicas restart with the new count (and the
publishers' ordering is broken anyway: resync them).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from aiokafka.partitioner import murmur2

from nexuskv.contracts import codec, kv_signature
from nexuskv.contracts.kv_events import KvEventBatch
from nexuskv.contracts.topics import Topic
from nexuskv.errors import ContractError, UnauthenticatedError

__all__ = ["KvIntake", "partition_of"]

_CACHE = 1 << 14


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

    def batch(self, record: Any) -> KvEventBatch:
        """The record's batch, or ContractError saying why it may not be applied."""
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
        batch = codec.decode(self.topic, value)
        assert isinstance(batch, KvEventBatch)
        if batch.publisher.encode("utf-8") != key:
            raise ContractError(f"batch of publisher {batch.publisher[:80]!r} under record key {key[:80]!r}: a "
                                "kv-events record must be keyed by its batch's publisher", path="publisher")
        return batch
