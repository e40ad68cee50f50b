"""aiokafka producers and consumers that speak NexusKV's topic contracts.

Every record on a NexusKV topic is a versioned contract encoded by :mod:`nexuskv.contracts.codec`;
keys are UTF-8 strings; headers carry the sender's trace context (:mod:`streams.bus.tracing`). A
consumer that cannot decode a record builds a :class:`DeadLetter` for it (:func:`dead_letter_for`)
instead of dropping or crashing.

**Signed kv-events.** :func:`send` signs every :class:`~nexuskv.contracts.kv_events.KvEventBatch`
it sends (header of :mod:`nexuskv.contracts.kv_signature`) with its publisher's key, when this
process has one: from ``NEXUSKV_PUBLISHER_KEYS``, else derived from ``NEXUSKV_BUS_SECRET``
(:class:`BatchSigner`, read from the environment once, at the first send). Every publisher —
the reference engine's bus publisher, the ZMQ bridge, the synchronous plugins' background bus —
sends through here, so none of them signs on its own.

**Signed control records.** The control topics (placement hints, transfer commands, transfer
results) are signed too, by producer (:mod:`nexuskv.contracts.control_signature`): a service
that sends them holds a :class:`ControlSigner` for its producer name (``planner/<service>``,
``executor/<worker>``) and passes it as ``control=``; a consumer holds a :class:`ControlVerifier`
and calls :func:`check_control` on each record before it decodes it, which raises (an
:class:`~nexuskv.errors.UnauthenticatedError`, a :class:`~nexuskv.errors.ReplayedError` for a
replay) with the dead-letter reason, and counts the refusal on ``nexuskv_records_refused``.

Client settings that decide start-up and rebalance latency live in :mod:`streams.bus.tuning`.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError, KafkaTimeoutError
from aiokafka.structs import ConsumerRecord, RecordMetadata

from nexuskv.config import BrokerUrl, Settings
from nexuskv.contract import Contract
from nexuskv.contracts import codec, control_signature, kv_signature
from nexuskv.contracts.control_signature import ControlVerifier, Envelope, Refusal
from nexuskv.contracts.dead_letter import MAX_PAYLOAD, DeadLetter
from nexuskv.contracts.keyed_events import KeyedBatch
from nexuskv.contracts.kv_events import KvEventBatch
from nexuskv.contracts.topics import DEAD_LETTER, PLACEMENT, TIER_OFFERS, TRANSFER_RESULTS, TRANSFERS, Topic
from nexuskv.errors import NexusKVError, ReplayedError, UnauthenticatedError
from streams.bus import tuning
from streams.bus.metrics import METRICS
from streams.bus.tracing import carrier_headers

__all__ = ["make_producer", "make_consumer", "send", "decode_record", "dead_letter_for", "send_dead_letter",
           "BatchSigner", "default_signer", "FROM_ENV", "send_nowait", "record_headers", "DeadLetterQueue",
           "is_transient", "retry_transient", "ControlSigner", "ControlVerifier", "control_verifier",
           "check_control", "CONTROL_TOPICS"]

Headers = Sequence[tuple[str, bytes]]
log = logging.getLogger(__name__)


class _FromEnv:
    def __repr__(self) -> str:
        return "FROM_ENV"


#: ``signer=FROM_ENV``: the process's :func:`default_signer`.
FROM_ENV: Final = _FromEnv()


class BatchSigner:
    """Signing keys of the publishers this process sends for: given per publisher, or derived
    from the bus secret (which can sign for anyone)."""

    def __init__(self, *, bus_secret: bytes = b"", keys: Mapping[str, bytes] | None = None) -> None:
        self._secret = bus_secret
        self._keys = dict(keys or {})
        self._derived: OrderedDict[str, bytes] = OrderedDict()

    @classmethod
    def from_settings(cls, settings: Settings) -> BatchSigner:
        return cls(bus_secret=settings.bus_secret_bytes, keys=settings.publisher_key_map)

    def __bool__(self) -> bool:
        return bool(self._secret or self._keys)

    def key_for(self, publisher: str) -> bytes | None:
        key = self._keys.get(publisher)
        if key is not None or not self._secret:
            return key
        key = self._derived.get(publisher)
        if key is None:
            key = self._derived[publisher] = kv_signature.publisher_key(self._secret, publisher)
            while len(self._derived) > 4096:
                self._derived.popitem(last=False)
        return key

    def header(self, publisher: str, record_key: bytes, value: bytes) -> tuple[str, bytes] | None:
        key = self.key_for(publisher)
        if key is None:
            return None
        return kv_signature.SIGNATURE_HEADER, kv_signature.sign(key, record_key, value)


@functools.cache
def default_signer() -> BatchSigner:
    """This process's signer, from ``NEXUSKV_BUS_SECRET`` and ``NEXUSKV_PUBLISHER_KEYS`` (read once)."""
    return BatchSigner.from_settings(Settings.from_env())


#: The topics whose records are signed by producer (:mod:`nexuskv.contracts.control_signature`).
CONTROL_TOPICS: Final = frozenset({PLACEMENT.name, TRANSFERS.name, TRANSFER_RESULTS.name, TIER_OFFERS.name})
_REPLAY_CODES = frozenset({"replayed", "stale", "outside_window", "window_full"})


class ControlSigner:
    """Signs this process's control records as ``producer``: its key (from ``NEXUSKV_PUBLISHER_KEYS``,
    else derived from the bus secret), a random incarnation per signer, and a sequence from 0.

    Falsy without a key: records then go out unsigned (a deployment without a bus secret)."""

    def __init__(self, producer: str, *, key: bytes | None, clock: Callable[[], float] = time.time,
                 incarnation: int | None = None) -> None:
        self.producer = producer
        self._key = key
        self.clock = clock
        self.incarnation = incarnation if incarnation is not None else int.from_bytes(os.urandom(8), "big")
        self._seq = itertools.count()

    @classmethod
    def from_settings(cls, settings: Settings, producer: str, **kw: Any) -> ControlSigner:
        key = settings.publisher_key_map.get(producer)
        if key is None and settings.bus_secret_bytes:
            key = control_signature.producer_key(settings.bus_secret_bytes, producer)
        return cls(producer, key=key, **kw)

    @classmethod
    def from_env(cls, producer: str, **kw: Any) -> ControlSigner:
        return cls.from_settings(Settings.from_env(), producer, **kw)

    def __bool__(self) -> bool:
        return self._key is not None

    def header(self, topic: Topic, record_key: bytes, value: bytes) -> tuple[str, bytes] | None:
        if self._key is None:
            return None
        env = Envelope(self.producer, self.incarnation, next(self._seq), self.clock())
        return control_signature.SIGNATURE_HEADER, control_signature.sign(self._key, topic.name, env, record_key,
                                                                          value)


def control_verifier(settings: Settings) -> ControlVerifier:
    """A consumer's verifier of control records under the deployment's bus secret, or the producer keys
    this host was given (``NEXUSKV_PUBLISHER_KEYS``: then only those producers' records are taken);
    neither: every record is taken, as before signing."""
    return ControlVerifier(settings.bus_secret_bytes, keys=settings.publisher_key_map,
                           window=control_signature.ReplayWindow(max_age_s=settings.control_max_age_s))


def check_control(verifier: ControlVerifier, topic: Topic, record: ConsumerRecord, *, now: float,
                  service: str, admit: bool = True) -> Envelope | None:
    """The record's signed envelope (None where the deployment signs nothing); raises
    UnauthenticatedError, or ReplayedError for a replay, whose message is the dead-letter reason,
    after counting the refusal on ``nexuskv_records_refused``. ``admit=False``: the signature only,
    for a record this consumer will not act on (see :meth:`ControlVerifier.check`)."""
    key = bytes(record.key) if record.key is not None else b""
    value = bytes(record.value) if record.value is not None else b""
    got = verifier.check(topic.name, key, value, record.headers, now=now, admit=admit)
    if isinstance(got, Refusal):
        METRICS.records_refused.labels(service, topic.name, got.code).inc()
        error = ReplayedError if got.code in _REPLAY_CODES else UnauthenticatedError
        raise error(f"{got.code}: {got.reason}")
    return got


_unsigned_warned: set[str] = set()
_BACKOFF_S = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0)
T = TypeVar("T")


def is_transient(exc: BaseException) -> bool:
    """A Kafka error that a broker outage, election or rebalance causes, and that passes."""
    return isinstance(exc, KafkaError) and (bool(getattr(exc, "retriable", False)) or isinstance(exc, KafkaTimeoutError))


async def retry_transient(op: Callable[[], Awaitable[T]], *, what: str) -> T:
    """``await op()`` until it succeeds, waiting out transient broker errors (backoff up to 5 s);
    any other error propagates. While it waits, the service's readiness says why (``/readyz``),
    so a broker outage is survived and reported, not fatal."""
    from streams.bus.health import HEALTH

    attempt = 0
    while True:
        try:
            result = await op()
        except Exception as exc:
            if not is_transient(exc):
                raise
            HEALTH.set_ready("broker", False, f"{what}: {type(exc).__name__}")
            if attempt == 0 or attempt % 10 == 0:
                log.warning("%s failed (%s: %s); retrying while the broker is away", what, type(exc).__name__, exc)
            await asyncio.sleep(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)])
            attempt += 1
            continue
        if attempt:
            HEALTH.set_ready("broker", True)
            log.info("%s succeeded after %d retries", what, attempt)
        return result


def make_producer(url: BrokerUrl, *, client_id: str, **overrides: Any) -> AIOKafkaProducer:
    """A producer (not started). Idempotence stays off: the embedded broker rejects it."""
    settings = dict(tuning.PRODUCER)
    settings.update(overrides)
    return AIOKafkaProducer(bootstrap_servers=url.bootstrap_servers, client_id=client_id, **settings)


def make_consumer(url: BrokerUrl, *topics: Topic, client_id: str, group_id: str | None = None,
                  **overrides: Any) -> AIOKafkaConsumer:
    """A consumer (not started) of ``topics``; in a group when ``group_id`` is given."""
    settings = dict(tuning.CONSUMER)
    settings.update(overrides)
    return AIOKafkaConsumer(*(t.name for t in topics), bootstrap_servers=url.bootstrap_servers,
                            client_id=client_id, group_id=group_id, **settings)


def record_headers(key: bytes, payload: bytes, value: Contract, headers: Headers | None,
                   signer: BatchSigner | _FromEnv | None = FROM_ENV, *, topic: Topic | None = None,
                   control: ControlSigner | None = None) -> list[tuple[str, bytes]]:
    """The headers of a record: the trace context, a kv-events batch's signature, and a control
    record's (``topic`` one of :data:`CONTROL_TOPICS`, signed by ``control``)."""
    out = [(k, v) for k, v in carrier_headers(headers)
           if k not in (kv_signature.SIGNATURE_HEADER, control_signature.SIGNATURE_HEADER)]
    if control and topic is not None and topic.name in CONTROL_TOPICS:
        signed = control.header(topic, key, payload)
        if signed is not None:
            out.append(signed)
    if isinstance(value, (KvEventBatch, KeyedBatch)) and signer is not None:
        chosen = default_signer() if isinstance(signer, _FromEnv) else signer
        header = chosen.header(value.publisher, key, payload) if chosen else None
        if header is not None:
            out.append(header)
        elif chosen and value.publisher not in _unsigned_warned and len(_unsigned_warned) < 64:
            _unsigned_warned.add(value.publisher)
            log.warning("no signing key for publisher %s: its batches go out unsigned", value.publisher)
    return out


async def send(producer: AIOKafkaProducer, topic: Topic, key: str, value: Contract,
               headers: Headers | None = None, *, signer: BatchSigner | _FromEnv | None = FROM_ENV,
               control: ControlSigner | None = None) -> RecordMetadata:
    """Encode and send, carrying the current trace context (and, for a kv-events batch, its
    publisher's signature; for a control record, ``control``'s); returns once the broker acknowledged."""
    return await (await send_nowait(producer, topic, key, value, headers, signer=signer, control=control))


async def send_nowait(producer: AIOKafkaProducer, topic: Topic, key: str, value: Contract,
                      headers: Headers | None = None, *, signer: BatchSigner | _FromEnv | None = FROM_ENV,
                      control: ControlSigner | None = None) -> Any:
    """As :func:`send`, returning once the record is queued: await the returned future for the
    broker's acknowledgement (so that many records share a round trip)."""
    raw_key = key.encode("utf-8")
    payload = codec.encode(topic, value)
    return await producer.send(topic.name, payload, key=raw_key,
                               headers=record_headers(raw_key, payload, value, headers, signer, topic=topic,
                                                      control=control) or None)


def decode_record(topic: Topic, record: ConsumerRecord) -> Contract:
    """The record's value as ``topic``'s contract; raises ContractError with the reason."""
    return codec.decode(topic, record.value)


def dead_letter_for(topic_name: str, record: ConsumerRecord | None, error: BaseException, *, service: str,
                    now: float, payload: bytes | None = None, key: bytes | None = None) -> DeadLetter:
    """A dead-letter record for a rejected input, keeping up to MAX_PAYLOAD bytes of it."""
    raw = payload if payload is not None else (record.value if record is not None else b"") or b""
    raw_key = key if key is not None else (record.key if record is not None else None)
    reason = str(error) or type(error).__name__
    return DeadLetter(
        source_topic=topic_name,
        partition=record.partition if record is not None else -1,
        offset=record.offset if record is not None else -1,
        key=bytes(raw_key) if raw_key is not None else None,
        payload=bytes(raw[:MAX_PAYLOAD]),
        payload_size=len(raw),
        reason=reason[:4096],
        error_type=type(error).__name__ if isinstance(error, NexusKVError) else f"unexpected:{type(error).__name__}",
        service=service,
        rejected_at=now,
    )


async def send_dead_letter(producer: AIOKafkaProducer, letter: DeadLetter, topic: Topic = DEAD_LETTER) -> RecordMetadata:
    return await send(producer, topic, letter.source_topic, letter)


class DeadLetterQueue:
    """Dead letters sent in batches: :meth:`put` queues one (a round trip is shared by every
    letter queued meanwhile), :meth:`flush` returns once the broker acknowledged all of them.

    A service calls :meth:`flush` before it records progress past the rejected records (a
    checkpoint, an offset commit), so a letter is never lost behind that progress. At most
    ``max_pending`` letters wait unacknowledged; :meth:`put` flushes beyond that."""

    def __init__(self, producer: AIOKafkaProducer, topic: Topic = DEAD_LETTER, *, max_pending: int = 2000) -> None:
        self.producer = producer
        self.topic = topic
        self.max_pending = max_pending
        self._pending: list[tuple[DeadLetter, Any]] = []
        self.sent = 0

    async def _queue(self, letter: DeadLetter) -> Any:
        return await retry_transient(lambda: send_nowait(self.producer, self.topic, letter.source_topic, letter),
                                     what="queueing a dead letter")

    async def put(self, letter: DeadLetter) -> None:
        self._pending.append((letter, await self._queue(letter)))
        if len(self._pending) >= self.max_pending:
            await self.flush()

    def __len__(self) -> int:
        return len(self._pending)

    async def flush(self) -> int:
        """Wait until every queued letter is acknowledged; letters whose send failed for a transient
        reason (a broker outage) are sent again until they are."""
        pending, self._pending = self._pending, []
        done = 0
        while pending:
            results = await asyncio.gather(*(fut for _letter, fut in pending), return_exceptions=True)
            failed = []
            for (letter, _fut), result in zip(pending, results):
                if isinstance(result, BaseException):
                    if not is_transient(result):
                        raise result  # the caller records no progress past the letters not sent
                    failed.append(letter)
                else:
                    done += 1
            if failed:
                log.warning("%d dead letters not acknowledged; sending them again", len(failed))
                await asyncio.sleep(0.5)
            pending = [(letter, await self._queue(letter)) for letter in failed]
        self.sent += done
        return done
