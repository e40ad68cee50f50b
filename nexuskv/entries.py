"""QueryKey, CacheEntry and EntryLocation: the State Contract's lookup-side types.

* :class:`EntryLocation` — where one copy lives: (worker, tier, KV group).
* :class:`CacheEntry` — one block of state in one location, with the facts that make it valid
  (publisher, incarnation, sequence number, certainty, TTL, pin).
* :class:`QueryKey` — what a request asks for: its identity scope and the canonical keys of its
  full blocks, in order from block 0.

These are contract values (validated, versioned, exportable). The index does not store one
CacheEntry per block — it keeps compact structures and builds these only for answers.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from nexuskv.contract import Contract, Key128
from nexuskv.descriptor import Tier
from nexuskv.identity import BlockKey, IdentityScope

__all__ = ["EntryLocation", "CacheEntry", "QueryKey", "WorkerId"]

WorkerId = Annotated[str, Field(min_length=1, max_length=256)]
U128 = Key128  # hex in JSON (nexuskv.contract)


class EntryLocation(Contract):
    """One place a block can be: a worker's tier, for one KV group."""

    worker: WorkerId
    tier: Tier
    group: Annotated[int, Field(ge=0)] = 0

    def __str__(self) -> str:
        return f"{self.worker}/{self.tier.value}/g{self.group}"


class CacheEntry(Contract):
    """One block of state at one location, and the facts that make it valid."""

    key: U128
    scope: IdentityScope
    location: EntryLocation
    publisher: str = Field(min_length=1)
    incarnation: Annotated[int, Field(ge=0)]
    seq: Annotated[int, Field(ge=0)]
    certain: bool = True
    stored_at: Annotated[float, Field(ge=0)] = 0.0  # seconds since the epoch
    expires_at: float | None = None
    pinned: bool = False


class QueryKey(Contract):
    """A request's identity scope and canonical keys of its full blocks, from block 0."""

    scope: IdentityScope
    block_size: Annotated[int, Field(ge=1)]
    keys: tuple[U128, ...] = Field(max_length=1 << 20)
    num_tokens: Annotated[int, Field(ge=0)]

    @model_validator(mode="after")
    def _blocks(self) -> QueryKey:
        if len(self.keys) != self.num_tokens // self.block_size:
            raise ValueError("keys: one key per full block of num_tokens is required")
        return self

    @property
    def block_keys(self) -> tuple[BlockKey, ...]:
        return tuple(BlockKey(k) for k in self.keys)
