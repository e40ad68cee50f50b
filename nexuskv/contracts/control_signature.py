"""The signed header of a control record: who sent a placement hint, a transfer command or a result.

The control topics (``nexuskv.placement``, ``nexuskv.transfers``, ``nexuskv.transfer-results``)
tell tier managers and executors what to pin, reserve, demote, evict and copy, and tell the
planner what landed. When a deployment sets a bus secret, every record on them carries a Kafka
record header :data:`SIGNATURE_HEADER` that names its producer and the record's place in that
producer's stream, and authenticates all of it with the producer's key::

    header = version:u8  incarnation:u64be  seq:u64be  sent_at_ms:u64be  len(producer):u16be  producer  tag
    tag    = HMAC-SHA256(producer_key, b"nexuskv.control/1 " topic 0x00
                         len(producer):u16be producer incarnation seq sent_at_ms len(key):u32be key value)

* **Topic domain.** The topic's name is in what is signed, so a record signed for one control
  topic (a transfer command) is refused on another (as a placement hint), and a kv-events
  signature (:mod:`nexuskv.contracts.kv_signature`, another domain) is never a control signature.
* **Producer.** A producer's key is derived from the bus secret and its name
  (:func:`producer_key`, a key domain of its own: no kv-events publisher key is a control key), so
  the verifiers hold one secret while a host can be given only its own producer's key. The name
  says the producer's role (``planner/<service>``, ``executor/<worker>``, ``writer/<worker>``), and
  each topic is entitled to some roles only (:data:`ENTITLED`): hints and commands come from
  planners, results from executors, remote-tier offers from writers. A record signed by a producer the topic does not entitle is refused, whatever
  its signature.
* **Replays** (:class:`ReplayWindow`). ``(incarnation, seq)`` numbers a producer's records (a
  random incarnation per process start, seq from 0), and ``sent_at`` dates them; both are signed.
  A consumer accepts a record once: the window remembers, per ``(producer, incarnation)``, the
  highest seq taken and which of the :data:`WINDOW` seqs below it were taken (a bitmap, as IPsec
  and DTLS do). A record is refused as *replayed* when its seq was taken, as *stale* when it was
  sent more than ``max_age_s`` ago (or more than ``skew_s`` ahead of the consumer's clock), and
  as *outside the window* when its seq is :data:`WINDOW` or more below the highest taken. The
  age bound is what keeps the window bounded and sound: a stream whose newest record is older
  than ``max_age_s`` can be forgotten, because every record of it is refused as stale anyway. At
  most ``max_streams`` streams are remembered; when all of them are fresh a new stream is refused
  (the window is full) rather than forgetting one that could then be replayed.

A consumer reads a producer's records from several partitions in an interleaving Kafka does not
fix; the window's width is what one producer may send to other partitions while a consumer lags
on one of them (:data:`WINDOW` records), beyond which a late record is refused and counted.

The window lives in the consumer's memory: it does not survive a restart. A copy of a record
sent less than ``max_age_s`` before a consumer restarted is taken once more by the new process
(as the record itself may be, re-read from an uncommitted offset). What such a replay can do is
what its genuine record did once: a hint is idempotent or bounded (a prefetch's room by share and
time), a command re-run copies nothing already there.

A copy of a record that the Kafka client resends by itself (a produce request retried after a
lost acknowledgement) carries the same header and is refused as replayed: the consumer took it
once, which is what it wants. A service that sends a record again (the planner after a broker
outage) signs it again, with a new seq: its consumers then see it twice, as they did before
signing, and drop the repeat by its own id.

Pure functions and a clock-free state machine (hmac, hashlib, struct): no I/O; the caller passes
the time.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

__all__ = ["SIGNATURE_HEADER", "SIGNATURE_VERSION", "ENTITLED", "WINDOW", "Envelope", "producer_key", "role_of",
           "sign", "parse", "verify", "signature_of", "entitled", "ReplayWindow", "Refusal",
           "ControlVerifier"]

SIGNATURE_HEADER = "nexuskv-ctl-sig"
SIGNATURE_VERSION = 1
_DOMAIN = b"nexuskv.control/1 "
_KEY_DOMAIN = b"nexuskv control producer key/1\x00"
_TAG_BYTES = 32
_FIXED = struct.Struct(">BQQQH")
MAX_PRODUCER = 256  # bytes of a producer name
WINDOW: Final = 4096  # seqs of one producer stream remembered below its highest

#: The roles (a producer name's part before its first ``/``) each control topic accepts records from.
ENTITLED: Final[Mapping[str, frozenset[str]]] = {
    "nexuskv.placement": frozenset({"planner"}),
    "nexuskv.transfers": frozenset({"planner"}),
    "nexuskv.transfer-results": frozenset({"executor"}),
    # Offers to the remote tier's owner: its refusals delete objects, so only writers may offer.
    "nexuskv.tier-offers": frozenset({"writer"}),
}


@dataclass(frozen=True, slots=True)
class Envelope:
    """What a control header says: who sent the record, which of its records, when (seconds)."""

    producer: str
    incarnation: int
    seq: int
    sent_at: float
    tag: bytes = b""


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a control record is not taken: a short ``code`` (a metric label) and the reason."""

    code: str  # unsigned, malformed, no_key, forged, not_entitled, replayed, stale, outside_window, window_full
    reason: str


def producer_key(bus_secret: bytes, producer: str) -> bytes:
    """The 32-byte control signing key of ``producer`` under the deployment's ``bus_secret``."""
    if not bus_secret:
        raise ValueError("the bus secret is empty")
    return hmac.new(bus_secret, _KEY_DOMAIN + producer.encode("utf-8"), hashlib.sha256).digest()


def role_of(producer: str) -> str:
    """The role a producer name claims: its part before the first ``/`` (``planner/p1`` -> ``planner``)."""
    return producer.partition("/")[0]


def entitled(topic: str, producer: str) -> bool:
    """Whether ``producer`` may send records on control topic ``topic``."""
    return role_of(producer) in ENTITLED.get(topic, frozenset())


def _ms(sent_at: float) -> int:
    return max(0, int(round(sent_at * 1000)))


def _tag(key: bytes, topic: str, env: Envelope, record_key: bytes, value: bytes) -> bytes:
    name = env.producer.encode("utf-8")
    mac = hmac.new(key, _DOMAIN + topic.encode("utf-8") + b"\x00", hashlib.sha256)
    mac.update(struct.pack(">H", len(name)))
    mac.update(name)
    mac.update(struct.pack(">QQQ", env.incarnation, env.seq, _ms(env.sent_at)))
    mac.update(struct.pack(">I", len(record_key)))
    mac.update(record_key)
    mac.update(value)
    return mac.digest()


def sign(key: bytes, topic: str, env: Envelope, record_key: bytes, value: bytes) -> bytes:
    """The header value of a record on ``topic`` sent by ``env.producer`` with ``record_key`` and ``value``."""
    name = env.producer.encode("utf-8")
    if not name or len(name) > MAX_PRODUCER:
        raise ValueError(f"a producer name has 1 to {MAX_PRODUCER} bytes, not {len(name)}")
    head = _FIXED.pack(SIGNATURE_VERSION, env.incarnation, env.seq, _ms(env.sent_at), len(name))
    return head + name + _tag(key, topic, env, record_key, value)


def parse(header: bytes | None) -> Envelope | Refusal:
    """The envelope a header carries (its tag unchecked), or why it is not one."""
    if header is None:
        return Refusal("unsigned", f"no {SIGNATURE_HEADER} header")
    if len(header) < _FIXED.size + 1 + _TAG_BYTES:
        return Refusal("malformed", f"{SIGNATURE_HEADER} header of {len(header)} bytes is too short")
    version, incarnation, seq, sent_ms, size = _FIXED.unpack_from(header)
    if version != SIGNATURE_VERSION:
        return Refusal("malformed", f"{SIGNATURE_HEADER} version {version} is not {SIGNATURE_VERSION}")
    if size == 0 or size > MAX_PRODUCER or len(header) != _FIXED.size + size + _TAG_BYTES:
        return Refusal("malformed", f"{SIGNATURE_HEADER} header of {len(header)} bytes does not hold a "
                                    f"producer name of {size} bytes and a tag")
    try:
        producer = header[_FIXED.size:_FIXED.size + size].decode("utf-8")
    except UnicodeDecodeError:
        return Refusal("malformed", f"{SIGNATURE_HEADER} producer name is not UTF-8")
    return Envelope(producer, incarnation, seq, sent_ms / 1000.0, bytes(header[-_TAG_BYTES:]))


def verify(key: bytes, topic: str, env: Envelope, record_key: bytes, value: bytes) -> Refusal | None:
    """None when ``env``'s tag signs the record on ``topic`` under ``key``; else why not."""
    if not hmac.compare_digest(env.tag, _tag(key, topic, env, record_key, value)):
        return Refusal("forged", f"signature does not match producer {env.producer[:80]!r}'s key for {topic}")
    return None


def signature_of(headers: Sequence[tuple[str, bytes | None]] | None) -> bytes | None:
    """The control signature header's value among a record's headers, if one (two: b"", refused)."""
    found = None
    for name, value in headers or ():
        if name == SIGNATURE_HEADER:
            if found is not None:
                return b""
            found = bytes(value) if value is not None else b""
    return found


@dataclass(slots=True)
class _Stream:
    highest: int
    seen: int  # bit i: seq ``highest - i`` was taken
    newest_sent: float


class ReplayWindow:
    """Which ``(producer, incarnation, seq)`` were taken, within ``max_age_s`` (module docstring)."""

    def __init__(self, *, max_age_s: float = 300.0, skew_s: float = 30.0, window: int = WINDOW,
                 max_streams: int = 4096) -> None:
        if max_age_s <= 0 or skew_s < 0 or window < 1 or max_streams < 1:
            raise ValueError("max_age_s and window and max_streams must be positive, skew_s not negative")
        self.max_age_s = max_age_s
        self.skew_s = skew_s
        self.window = window
        self.max_streams = max_streams
        self._streams: OrderedDict[tuple[str, int], _Stream] = OrderedDict()  # least recently taken first

    def __len__(self) -> int:
        return len(self._streams)

    def admit(self, env: Envelope, *, now: float) -> Refusal | None:
        """Take the record ``env`` numbers (None), or say why not; a refused record changes nothing."""
        age = now - env.sent_at
        if age > self.max_age_s:
            return Refusal("stale", f"sent {age:.1f} s ago by {env.producer[:80]!r}, more than the "
                                    f"{self.max_age_s:.0f} s a control record is taken for")
        if -age > self.skew_s:
            return Refusal("stale", f"sent {-age:.1f} s in the future by {env.producer[:80]!r} (clock skew "
                                    f"beyond {self.skew_s:.0f} s)")
        ident = (env.producer, env.incarnation)
        stream = self._streams.get(ident)
        if stream is None:
            if len(self._streams) >= self.max_streams and not self._forget_stale(now):
                return Refusal("window_full", f"{len(self._streams)} producer streams sent records in the last "
                                              f"{self.max_age_s:.0f} s; a new one is refused")
            self._streams[ident] = _Stream(env.seq, 1, env.sent_at)
            return None
        if env.seq > stream.highest:
            shift = env.seq - stream.highest
            stream.seen = ((stream.seen << shift) | 1) & ((1 << self.window) - 1) if shift < self.window else 1
            stream.highest = env.seq
        else:
            behind = stream.highest - env.seq
            if behind >= self.window:
                return Refusal("outside_window", f"seq {env.seq} of {env.producer[:80]!r} is {behind} behind the "
                                                 f"newest taken, beyond the replay window of {self.window}")
            bit = 1 << behind
            if stream.seen & bit:
                return Refusal("replayed", f"record {env.incarnation:016x}/{env.seq} of {env.producer[:80]!r} "
                                           "was taken already")
            stream.seen |= bit
        stream.newest_sent = max(stream.newest_sent, env.sent_at)
        self._streams.move_to_end(ident)
        return None

    def _forget_stale(self, now: float) -> bool:
        """Forget streams whose every record is stale now; whether any was."""
        gone = [k for k, s in self._streams.items() if now - s.newest_sent > self.max_age_s]
        for k in gone:
            del self._streams[k]
        return bool(gone)


class ControlVerifier:
    """The checks a consumer of control topics makes, in order: a header that parses, a producer
    the topic entitles, a signature under that producer's key, a record not taken before.

    A producer's key comes from ``keys`` (given per producer: a host that holds no bus secret),
    else is derived from ``bus_secret``. With neither nothing is checked (:meth:`check` answers
    None for every record, as before signing existed); with ``keys`` only, a record of a producer
    not among them is refused (``no_key``): a host that was given keys fails closed. A refused
    record leaves the replay window as it was: only a record that passed every other check is
    remembered.
    """

    def __init__(self, bus_secret: bytes = b"", *, keys: Mapping[str, bytes] | None = None,
                 window: ReplayWindow | None = None) -> None:
        self.authenticated = bool(bus_secret or keys)
        self._secret = bus_secret
        self._given = dict(keys or {})
        self.window = window if window is not None else ReplayWindow()
        self._keys: OrderedDict[str, bytes] = OrderedDict()

    def _key_of(self, producer: str) -> bytes | None:
        key = self._given.get(producer)
        if key is not None or not self._secret:
            return key
        key = self._keys.get(producer)
        if key is None:
            key = self._keys[producer] = producer_key(self._secret, producer)
            while len(self._keys) > 4096:
                self._keys.popitem(last=False)
        return key

    def check(self, topic: str, record_key: bytes, value: bytes,
              headers: Sequence[tuple[str, bytes | None]] | None, *, now: float,
              admit: bool = True) -> Envelope | Refusal | None:
        """The record's envelope when it may be acted on, a Refusal when not; None: not authenticated here.

        ``admit=False`` checks the header, the entitlement and the signature only, and leaves the
        replay window alone: for a record the caller will not act on whatever it says (a command
        keyed to another worker), so that it is not refused as stale, nor remembered."""
        if not self.authenticated:
            return None
        env = parse(signature_of(headers))
        if isinstance(env, Refusal):
            return Refusal(env.code, f"{topic}: {env.reason}")
        if not entitled(topic, env.producer):
            roles = ", ".join(sorted(ENTITLED.get(topic, ()))) or "none"
            return Refusal("not_entitled", f"{topic}: producer {env.producer[:80]!r} (role {role_of(env.producer)[:40]!r}) "
                                           f"may not send here (entitled: {roles})")
        key = self._key_of(env.producer)
        if key is None:
            return Refusal("no_key", f"{topic}: this host holds no key to check producer {env.producer[:80]!r} "
                                     "(NEXUSKV_BUS_SECRET, or its key in NEXUSKV_PUBLISHER_KEYS)")
        why = verify(key, topic, env, record_key, value)
        if why is not None:
            return why
        if not admit:
            return env
        why = self.window.admit(env, now=now)
        if why is not None:
            return Refusal(why.code, f"{topic}: {why.reason}")
        return env
