"""``nexuskv.placement``: routing and placement hints for routers, tier managers and executors.

Keyed by tenant namespace and prefix root (the request's first block key), so hints about one
shared prefix stay in order. A hint covers blocks ``[first_block, first_block + blocks)`` of the
request's key chain at ``worker``/``tier``; ``keys`` names them (canonical keys, in chain order)
wherever a consumer acts on blocks, and ``bytes`` is what they weigh there. Every kind has a
consumer:

======== ==================================== =========================================================
kind     consumer                             what it does there
======== ==================================== =========================================================
route    the router (``streams/router``)   the worker the planner chose and its predicted TTFT
pin      the tier manager of ``worker``       keeps ``keys`` in ``tier`` until ``expires_at`` (a
                                              reused prefix until consumed, a transfer's source until
                                              its deadline), within the tier's pinned-bytes quota
unpin    the tier manager of ``worker``       ends the pins of ``transfer_id`` (the copy stopped)
prefetch the tier manager of ``worker``       reserves ``bytes`` in ``tier`` for ``transfer_id`` until
                                              the copy lands in them or ``expires_at`` passes
demote   the tier manager of ``worker``       moves ``keys`` from ``tier`` to ``to_tier`` (a copy that
                                              landed after its request recomputed)
evict    the tier manager of ``worker``       drops ``keys`` from ``tier``
cancel   the transfer executor of ``worker``  stops the copy ``transfer_id`` between two blocks; its
                                              result (``cancelled``) says when the bytes stopped
======== ==================================== =========================================================

Hints are advice: the engine keeps final authority over its memory, and a tier manager refuses
a pin beyond its quota (the block may then leave under pressure; the request falls back to
recompute if it is gone when needed).

Version 2 added ``keys`` and ``bytes``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field

from nexuskv.contract import Contract, Key128
from nexuskv.descriptor import Tier

__all__ = ["SCHEMA_VERSION", "HintKind", "PlacementHint"]

SCHEMA_VERSION = 2
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
    schema_version: Annotated[int, Field(ge=1, le=2)] = SCHEMA_VERSION
    hint_id: Text
    request_id: Text | None = None
    tenant_namespace: Text
    prefix_root: Key128 | None = None
    kind: HintKind
    worker: Text
    tier: Tier | None = None
    group: Annotated[int, Field(ge=0)] = 0
    first_block: Annotated[int, Field(ge=0)] = 0
    blocks: Annotated[int, Field(ge=0)] = 0
    keys: tuple[Key128, ...] = Field(default=(), max_length=1 << 20)
    bytes: Annotated[int, Field(ge=0)] = 0
    transfer_id: Text | None = None  # the transfer a pin, unpin, prefetch, cancel or demote belongs to
    descriptor_id: Text | None = None  # whose payloads ``keys`` address (pin, prefetch, demote, evict)
    to_tier: Tier | None = None  # demote: where the blocks should go
    expires_at: float | None = None
    issued_at: Annotated[float, Field(ge=0)]
    reason: Annotated[str, Field(min_length=1, max_length=4096)]
