"""``nexuskv.kv-events``: batches of KV lifecycle events from one publisher.

Keyed by publisher, so one publisher's batches stay in order on one partition. Each batch
carries the publisher's identity, its *incarnation* (changes when the engine restarts; its
cache is then new) and a *sequence number* (consecutive per incarnation, from 0), so the index
can ignore duplicates and detect gaps. Encoded as msgpack: this is the high-volume topic.

Events:

* ``stored`` — a run of consecutive blocks (engine hashes, parent hash, their tokens) now
  present in ``tier`` for KV ``group``. With empty ``token_ids`` it is a *tier event*: blocks
  already known by engine hash (stored earlier with tokens) now also exist in another tier, as
  vLLM's OffloadingConnector reports CPU and storage copies.
* ``removed`` — engine hashes no longer present in that publisher's ``tier`` and ``group``.
* ``cleared`` — everything of that publisher (in ``tier`` when given) is gone.
* ``snapshot`` — ``begin``: the publisher's facts are being replaced (uncertain until
  ``end``); the ``stored`` events in between are its complete state.

Removals and clears are scoped to their publisher: they never touch another publisher's facts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, model_validator

from nexuskv.contract import Contract
from nexuskv.descriptor import Tier

__all__ = [
    "SCHEMA_VERSION",
    "MAX_BLOCKS_PER_EVENT",
    "MAX_EVENTS_PER_BATCH",
    "EngineHash",
    "PublisherIdentity",
    "BlockStored",
    "BlockRemoved",
    "AllCleared",
    "Snapshot",
    "KvEvent",
    "KvEventBatch",
]

SCHEMA_VERSION = 1
MAX_BLOCKS_PER_EVENT = 4096
MAX_EVENTS_PER_BATCH = 65536
MAX_TOKENS_PER_EVENT = 1 << 20

#: An engine's block hash, normalised to an unsigned 64-bit int (as llm-d and Dynamo do: signed
#: ints are taken mod 2**64, raw digests by their last 8 bytes big-endian). Engine hashes only
#: resolve parents and removals inside one publisher; canonical keys are 128-bit.
EngineHash = Annotated[int, Field(ge=0, lt=2**64)]
Text = Annotated[str, Field(min_length=1, max_length=1024)]


class PublisherIdentity(Contract):
    """What a publisher serves: the identity its blocks are keyed in."""

    tenant_namespace: Text  # default tenant of the publisher's blocks
    model: Text
    model_revision: Text
    tokenizer_revision: Text
    descriptor_id: Text
    engine_family: Text = "vllm"
    #: The engine worker whose tier this publisher announces (a tier publisher ``<worker>/disk``
    #: serves worker ``<worker>``): its locations are that worker's, so the planner prices a load
    #: from them as the worker's own tier, not another machine's. None: the publisher's own name.
    #: It must be a path prefix of the publisher's name (checked on the batch), so a publisher
    #: (signed under its own name) can only speak for the worker its name is under.
    worker: Text | None = None


class BlockStored(Contract):
    type: Literal["stored"] = "stored"
    engine_hashes: tuple[EngineHash, ...] = Field(min_length=1, max_length=MAX_BLOCKS_PER_EVENT)
    parent: EngineHash | None = None
    token_ids: tuple[Annotated[int, Field(ge=0, lt=2**32)], ...] = Field(default=(), max_length=MAX_TOKENS_PER_EVENT)
    block_size: Annotated[int, Field(ge=1, le=1 << 16)]
    tier: Tier = Tier.GPU
    group: Annotated[int, Field(ge=0, le=1024)] = 0
    tenant_namespace: Text | None = None  # overrides the publisher's default tenant
    lora: Text | None = None
    cache_salt: Text | None = None
    extra_keys: tuple[Any, ...] | None = None  # one entry per block (None for none)

    @model_validator(mode="after")
    def _shape(self) -> BlockStored:
        if self.token_ids and len(self.token_ids) != len(self.engine_hashes) * self.block_size:
            raise ValueError("token_ids: must hold exactly block_size tokens per engine hash, or be empty for a tier event")
        if self.extra_keys is not None and len(self.extra_keys) != len(self.engine_hashes):
            raise ValueError("extra_keys: one entry per engine hash")
        return self

    @property
    def is_tier_event(self) -> bool:
        """True for a token-less event: known blocks now present in another tier."""
        return not self.token_ids


class BlockRemoved(Contract):
    type: Literal["removed"] = "removed"
    engine_hashes: tuple[EngineHash, ...] = Field(min_length=1, max_length=MAX_BLOCKS_PER_EVENT)
    tier: Tier = Tier.GPU
    group: Annotated[int, Field(ge=0, le=1024)] = 0


class AllCleared(Contract):
    type: Literal["cleared"] = "cleared"
    tier: Tier | None = None  # None: every tier of this publisher


class Snapshot(Contract):
    type: Literal["snapshot"] = "snapshot"
    phase: Literal["begin", "end"]


KvEvent = Annotated[Union[BlockStored, BlockRemoved, AllCleared, Snapshot], Field(discriminator="type")]


class KvEventBatch(Contract):
    """One publisher batch (an engine step's events, or a bridge's repaired batch)."""

    schema_version: Literal[1] = SCHEMA_VERSION
    publisher: Annotated[str, Field(min_length=1, max_length=512)]
    incarnation: Annotated[int, Field(ge=0, lt=2**63)]
    seq: Annotated[int, Field(ge=0, lt=2**63)]
    ts: float  # engine timestamp, seconds since the epoch
    identity: PublisherIdentity
    events: tuple[KvEvent, ...] = Field(max_length=MAX_EVENTS_PER_BATCH)

    @model_validator(mode="after")
    def _worker_under_name(self) -> KvEventBatch:
        worker = self.identity.worker
        if worker is not None and not self.publisher.startswith(worker + "/"):
            raise ValueError(f"identity.worker: {worker!r} is not a path prefix of publisher {self.publisher!r}")
        return self

    @property
    def block_operations(self) -> int:
        """Blocks stored or removed by this batch (the unit of the index's throughput)."""
        return sum(len(e.engine_hashes) for e in self.events if isinstance(e, (BlockStored, BlockRemoved)))
