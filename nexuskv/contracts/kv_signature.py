"""The signed header of a ``nexuskv.kv-events`` record: who may publish a publisher's batches.

A kv-events record is keyed by its publisher (``KvEventBatch.publisher``). When a deployment
sets a bus secret, every such record carries a Kafka record header :data:`SIGNATURE_HEADER`
whose value is one version byte (:data:`SIGNATURE_VERSION`) and an HMAC-SHA256 tag, keyed with
*that publisher's* key, over the record key and the record value exactly as sent::

    tag = HMAC-SHA256(publisher_key, b"nexuskv.kv-events/1" 0x00 len(key):u32be key value)

A publisher's key is derived from the bus secret and its name (:func:`publisher_key`), so the
verifiers (the index worker and every index replica) hold one secret and can check every
publisher, while an engine host can be given only its own publisher's key (``nexuskv
publisher-key NAME``): it can then sign its own batches and no one else's.

The header is independent of the payload's encoding (msgpack today): the tag covers the bytes,
whatever they hold. What the tag does *not* cover is the partition; the verifier checks that
separately (a publisher's records belong on the partition its key hashes to), and replays of a
genuine record are harmless (the index drops a batch whose sequence number it has seen).

Pure functions (hmac, hashlib): no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

__all__ = ["SIGNATURE_HEADER", "SIGNATURE_VERSION", "publisher_key", "sign", "verify", "signature_of"]

SIGNATURE_HEADER = "nexuskv-sig"
SIGNATURE_VERSION = 1
_DOMAIN = b"nexuskv.kv-events/1\x00"
_KEY_DOMAIN = b"nexuskv publisher key/1\x00"
_TAG_BYTES = 32


def publisher_key(bus_secret: bytes, publisher: str) -> bytes:
    """The 32-byte signing key of ``publisher`` under the deployment's ``bus_secret``."""
    if not bus_secret:
        raise ValueError("the bus secret is empty")
    return hmac.new(bus_secret, _KEY_DOMAIN + publisher.encode("utf-8"), hashlib.sha256).digest()


def _tag(key: bytes, record_key: bytes, value: bytes) -> bytes:
    mac = hmac.new(key, _DOMAIN, hashlib.sha256)
    mac.update(struct.pack(">I", len(record_key)))
    mac.update(record_key)
    mac.update(value)
    return mac.digest()


def sign(key: bytes, record_key: bytes, value: bytes) -> bytes:
    """The header value for a record sent with ``record_key`` and ``value`` under ``key``."""
    return bytes((SIGNATURE_VERSION,)) + _tag(key, record_key, value)


def verify(key: bytes, record_key: bytes, value: bytes, header: bytes | None) -> str | None:
    """None when ``header`` is a valid signature of the record under ``key``; else why not."""
    if header is None:
        return f"no {SIGNATURE_HEADER} header"
    if len(header) != 1 + _TAG_BYTES:
        return f"{SIGNATURE_HEADER} header of {len(header)} bytes, not {1 + _TAG_BYTES}"
    if header[0] != SIGNATURE_VERSION:
        return f"{SIGNATURE_HEADER} version {header[0]} is not {SIGNATURE_VERSION}"
    if not hmac.compare_digest(header[1:], _tag(key, record_key, value)):
        return "signature does not match the publisher's key"
    return None


def signature_of(headers: object) -> bytes | None:
    """The signature header's value among a record's headers (a sequence of (name, bytes)), if one."""
    found = None
    for item in headers or ():
        name, value = item
        if name == SIGNATURE_HEADER:
            if found is not None:
                return b""  # two signatures: refuse rather than pick one
            found = bytes(value) if value is not None else b""
    return found
