"""``nexuskv.tier-state``: each managed tier's usage and displacement price, from its tier manager.

Keyed by ``<worker>/<tier>``; each record is the tier's whole state at ``published_at`` (so the
topic is compacted: the latest record per key is all a reader needs). Planners read
``price_s_per_gib`` of each worker's GPU tier as the ``C_pollution`` price of prefetching there
(seconds of expected gain lost per GiB displaced, :func:`nexuskv.admission.displacement_price`
for a copy of ``price_bytes``); operators read the rest. Bytes are payload bytes. ``pinned_bytes``
(stored bytes under a pin) and ``in_flight_bytes`` (bytes of copies landing now, part of
``reserved_bytes``) are counted apart.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from nexuskv.contract import Contract
from nexuskv.descriptor import Tier

__all__ = ["SCHEMA_VERSION", "TierStateRecord"]

SCHEMA_VERSION = 1
Text = Annotated[str, Field(min_length=1, max_length=1024)]
Bytes = Annotated[int, Field(ge=0)]


class TierStateRecord(Contract):
    schema_version: Annotated[int, Field(ge=1, le=1)] = SCHEMA_VERSION
    worker: Text
    tier: Tier
    backend: Text
    policy: Text  # the eviction policy in force ("utility" or "lru")
    capacity_bytes: Bytes
    used_bytes: Bytes
    reserved_bytes: Bytes
    pinned_bytes: Bytes
    in_flight_bytes: Bytes
    blocks: Bytes
    unannounced_blocks: Bytes
    price_s_per_gib: Annotated[float, Field(ge=0)]  # may be +inf: pinned state leaves no room
    price_bytes: Bytes
    counters: dict[Annotated[str, Field(max_length=64)], Bytes] = Field(default_factory=dict)
    published_at: Annotated[float, Field(ge=0)]

    @property
    def key(self) -> str:
        return f"{self.worker}/{self.tier.value}"
