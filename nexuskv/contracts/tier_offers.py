"""``nexuskv.tier-offers``: a writer offers blocks it saved to the shared remote tier to its owner.

The remote tier (Mooncake Store) is shared by every worker, so no worker's tier manager owns its
capacity: one remote-tier manager does (:mod:`streams.remote_tier_manager`). A worker that saves to
the store writes its bytes first (the remote backend acknowledges only what it can read back) and
then *offers* them here; the owner checks each object's header against the offer, admits it by
utility within the tenant's quota (announcing it on ``nexuskv.kv-events`` under the owner's own
publisher) or refuses it (deleting the object), and evicts what is worth less to keep headroom.
A writer never announces remote-tier blocks itself.

Keyed by writer, so one writer's offers stay in order (a chain's parent before its children).
An offer carries canonical keys, not tokens: the owner announces the keys themselves
(:mod:`nexuskv.contracts.keyed_events`), and token ids stay off the bus.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from nexuskv.contract import Contract, Key128
from nexuskv.contracts.kv_events import PublisherIdentity

__all__ = ["SCHEMA_VERSION", "MAX_OFFERED_BLOCKS", "OfferedBlock", "TierOffer"]

SCHEMA_VERSION = 1
MAX_OFFERED_BLOCKS = 4096
Text = Annotated[str, Field(min_length=1, max_length=1024)]


class OfferedBlock(Contract):
    """One object the writer put in the store: its payload address, size and checksum, and its chain."""

    key: Key128  # canonical block key (the payload key's ``key``)
    parent: Key128 | None = None  # canonical key of the block before it (None: the chain's first block)
    nbytes: Annotated[int, Field(ge=1, le=1 << 40)]  # payload bytes, without the store's 128-byte header
    checksum: Key128  # the payload header's XXH3-128 checksum (the owner checks the stored header against it)
    position: Annotated[int, Field(ge=0, le=1 << 24)]  # block index in its chain


class TierOffer(Contract):
    """Blocks one writer saved to the remote tier, offered in chain order (parents first)."""

    schema_version: Annotated[int, Field(ge=1, le=1)] = SCHEMA_VERSION
    offer_id: Text
    writer: Text  # the worker that wrote the objects
    tenant_namespace: Text
    identity: PublisherIdentity  # the scope the blocks are keyed in (model, revisions, descriptor)
    descriptor_id: Text
    group: Annotated[int, Field(ge=0, le=1024)] = 0
    block_size: Annotated[int, Field(ge=1, le=1 << 16)]
    lora: Text | None = None
    cache_salt: Text | None = None
    blocks: tuple[OfferedBlock, ...] = Field(min_length=1, max_length=MAX_OFFERED_BLOCKS)
    offered_at: Annotated[float, Field(ge=0)]

    @model_validator(mode="after")
    def _consistent(self) -> TierOffer:
        if self.identity.descriptor_id != self.descriptor_id:
            raise ValueError(f"identity: descriptor {self.identity.descriptor_id} is not the offer's "
                             f"{self.descriptor_id}")
        keys = [b.key for b in self.blocks]
        if len(set(keys)) != len(keys):
            raise ValueError("blocks: a key is offered twice")
        return self

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)
