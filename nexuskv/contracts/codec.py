"""Encode and decode topic payloads. Every failure is a ContractError with a reason.

Decoding checks, in order: size, encoding (truncated or garbage bytes), shape (a map at the top),
schema version (a :class:`SchemaVersionError` names the version), then the contract itself.
The reason string is what goes to the dead-letter topic.

``nexuskv.kv-events`` has two payload versions: 1, the pydantic :class:`KvEventBatch` (token ids),
and 2, the msgspec :class:`~nexuskv.contracts.keyed_events.KeyedBatch` (pre-keyed, binary).
:func:`encode` writes whichever it is given; :func:`decode` reads both (the same checks, in the
same order; a v2 payload is recognised by its first bytes and decoded by msgspec in one call).
"""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pydantic

from nexuskv.contract import Contract, contract_error
from nexuskv.contracts.keyed_events import (
    KEYED_SCHEMA_VERSION,
    KeyedBatch,
    decode_keyed,
    encode_keyed,
    is_keyed_payload,
)
from nexuskv.contracts.kv_events import KvEventBatch
from nexuskv.contracts.topics import Topic
from nexuskv.errors import ContractError, SchemaVersionError

__all__ = ["MAX_PAYLOAD_BYTES", "encode", "decode", "decode_raw"]

MAX_PAYLOAD_BYTES = 8 * 1024 * 1024


def _carries_keyed(topic: Topic) -> bool:
    """Whether ``topic`` is a kv-events topic (under any name) that reads version 2."""
    return topic.contract is KvEventBatch and KEYED_SCHEMA_VERSION in topic.versions


def encode(topic: Topic, value: Contract | KeyedBatch) -> bytes:
    """Serialise ``value`` for ``topic`` (its contract type is checked)."""
    if isinstance(value, KeyedBatch) and _carries_keyed(topic):
        return encode_keyed(value)
    if not isinstance(value, topic.contract):
        raise ContractError(f"{topic.name} carries {topic.contract.__name__}, not {type(value).__name__}")
    if topic.encoding == "json":
        return value.model_dump_json().encode("utf-8")
    return msgpack.packb(value.model_dump(mode="json"), use_bin_type=True)


def decode_raw(topic: Topic, raw: bytes) -> dict[str, Any]:
    """Bytes to the top-level map, checking size, encoding and schema version."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise ContractError(f"payload is {type(raw).__name__}, not bytes")
    if len(raw) > MAX_PAYLOAD_BYTES:
        raise ContractError(f"payload of {len(raw)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        if topic.encoding == "json":
            data = json.loads(bytes(raw))
        else:
            data = msgpack.unpackb(bytes(raw), raw=False, strict_map_key=True, use_list=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            UnicodeDecodeError, RecursionError) as exc:
        raise ContractError(f"undecodable {topic.encoding}: {type(exc).__name__}: {exc}"[:400]) from None
    if not isinstance(data, dict):
        raise ContractError(f"top level must be a map, got {type(data).__name__}")
    if "schema_version" not in data:
        raise SchemaVersionError("schema_version is missing", path="schema_version")
    version = data["schema_version"]
    if isinstance(version, bool) or version not in topic.versions:
        readable = ", ".join(str(v) for v in topic.versions)
        raise SchemaVersionError(f"schema_version {version!r} is not supported (this build reads {readable})",
                                 path="schema_version")
    return data


def decode(topic: Topic, raw: bytes) -> Contract | KeyedBatch:
    """Bytes to a validated contract value of ``topic`` (for kv-events, either version)."""
    keyed = _carries_keyed(topic)
    if keyed and isinstance(raw, (bytes, bytearray, memoryview)) and len(raw) <= MAX_PAYLOAD_BYTES \
            and is_keyed_payload(raw):
        return decode_keyed(raw)
    data = decode_raw(topic, raw)
    if keyed and data["schema_version"] == KEYED_SCHEMA_VERSION:
        return decode_keyed(bytes(raw))  # a v2 map whose fields another encoder ordered differently
    try:
        return topic.contract.model_validate(data)
    except pydantic.ValidationError as exc:
        raise contract_error(exc) from None
    except RecursionError:
        raise ContractError("payload nested too deeply") from None
