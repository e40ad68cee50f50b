"""``nexuskv.dead-letter``: inputs a service rejected, with the reason. Nothing is dropped silently.

Keyed by source topic. The original key and payload travel as bytes (base64 in JSON), at most
``MAX_PAYLOAD`` bytes of the payload; ``payload_size`` says how large it was.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field

from nexuskv.contract import Contract

__all__ = ["SCHEMA_VERSION", "MAX_PAYLOAD", "DeadLetter"]

SCHEMA_VERSION = 1
MAX_PAYLOAD = 256 * 1024


class DeadLetter(Contract):
    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    schema_version: Annotated[int, Field(ge=1, le=1)] = SCHEMA_VERSION
    source_topic: Annotated[str, Field(min_length=1, max_length=256)]
    partition: Annotated[int, Field(ge=-1)] = -1
    offset: Annotated[int, Field(ge=-1)] = -1
    key: bytes | None = None
    payload: bytes = b""
    payload_size: Annotated[int, Field(ge=0)] = 0
    reason: Annotated[str, Field(min_length=1, max_length=4096)]
    error_type: Annotated[str, Field(min_length=1, max_length=256)]
    service: Annotated[str, Field(min_length=1, max_length=256)]
    rejected_at: Annotated[float, Field(ge=0)]
