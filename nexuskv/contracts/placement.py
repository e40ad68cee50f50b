"""``nexuskv.placement``: routing and placement hints for routers, tiers and executors.

Keyed by tenant namespace and prefix root (the request's first block key), so hints about one
shared prefix stay in order. A router consumes ``route`` hints; tier managers consume ``pin``,
``unpin``, ``prefetch``, ``demote`` and ``evict``; an executor may consume ``cancel`` (a transfer
whose deadline passed: the request recomputes, finishing the copy is wasted work). A hint covers
blocks ``[first_block, first_block + blocks)`` of the request's key chain at ``worker``/``tier``.
Hints are advice: the engine keeps final authority over its memory.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field

from nexuskv.contracts.base import Contract
from nexuskv.descriptor import Tier

__all__ = ["SCHEMA_VERSION", "HintKind", "PlacementHint"]

SCHEMA_VERSION = 1
Text = Annotated[str, Field(min_length=1, max_length=1024)]


class HintKind(StrEnum):
    ROUTE = "route"
    PREFETCH = "prefetch"
    PIN = "pin"
    UNPIN = "unpin"
    DEMOTE = "demote"
    EVICT = "evict"
    CANCEL = "cancel"


class PlacementHint(Contract):
    schema_version: Annotated[int, Field(ge=1, le=1)] = SCHEMA_VERSION
    hint_id: Text
    request_id: Text | None = None
    tenant_namespace: Text
    prefix_root: Annotated[int, Field(ge=0, lt=2**128)] | None = None
    kind: HintKind
    worker: Text
    tier: Tier | None = None
    group: Annotated[int, Field(ge=0)] = 0
    first_block: Annotated[int, Field(ge=0)] = 0
    blocks: Annotated[int, Field(ge=0)] = 0
    transfer_id: Text | None = None  # the transfer a pin, prefetch, cancel or demote belongs to
    to_tier: Tier | None = None  # demote: where the blocks should go
    expires_at: float | None = None
    issued_at: Annotated[float, Field(ge=0)]
    reason: Annotated[str, Field(min_length=1, max_length=4096)]
