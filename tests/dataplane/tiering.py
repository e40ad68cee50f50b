"""Small factories for tier-manager tests: chains of blocks with their identity, tiers, an index."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nexuskv.contracts.kv_events import KvEventBatch, PublisherIdentity
from nexuskv.dataplane.catalog import BackendCatalog
from nexuskv.dataplane.payload import PayloadKey
from nexuskv.dataplane.tier_facts import BlockIdentity, TierFacts
from nexuskv.dataplane.tiers import SaveBlock, TierManager
from nexuskv.descriptor import Tier
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.index import GlobalIndex

IDENTITY = PublisherIdentity(tenant_namespace="acme", model="tiny", model_revision="r1", tokenizer_revision="t1",
                             descriptor_id="tiny-desc")
SCOPE = IdentityScope(tenant_namespace="acme", model="tiny", model_revision="r1", tokenizer_revision="t1",
                      descriptor_id="tiny-desc")
BLOCK_TOKENS = 4
BLOCK_BYTES = 4096


def chain_tokens(seed: int, blocks: int, *, shared: int = 0, shared_seed: int = 0) -> list[int]:
    """Tokens of a chain: ``shared`` leading blocks from ``shared_seed``, the rest from ``seed``."""
    head = [(shared_seed * 7919 + i) % 50_000 + 1 for i in range(shared * BLOCK_TOKENS)]
    tail = [(seed * 104_729 + i) % 50_000 + 1 for i in range((blocks - shared) * BLOCK_TOKENS)]
    return head + tail


def save_blocks(tokens: list[int], *, start: int = 0, fill: int | None = None) -> list[SaveBlock]:
    """SaveBlocks for blocks ``[start, end)`` of ``tokens``, each with its identity and bytes."""
    keys = BlockKeyer(SCOPE, BLOCK_TOKENS, b"").keys(tokens)
    out = []
    for i in range(start, len(keys)):
        data = torch.full((BLOCK_BYTES,), (keys[i] if fill is None else fill) % 251, dtype=torch.uint8)
        ident = BlockIdentity(IDENTITY, tuple(tokens[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS]), BLOCK_TOKENS,
                              parent=keys[i - 1] if i else None)
        out.append(SaveBlock(PayloadKey("tiny-desc", keys[i]), data, ident, position=i))
    return out


@dataclass
class Clock:
    now: float = 1_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Harness:
    """A manager over ``backends``, whose events feed a real GlobalIndex."""

    backends: list
    clock: Clock = field(default_factory=Clock)
    index: GlobalIndex = field(default_factory=GlobalIndex)
    batches: list[KvEventBatch] = field(default_factory=list)

    def __post_init__(self) -> None:
        def publish(batch: KvEventBatch) -> None:
            self.batches.append(batch)
            self.index.apply(batch)

        self.catalog = BackendCatalog("w0", self.backends)
        self.facts = TierFacts("w0", publish, clock=self.clock)

    def manager(self, **kw) -> TierManager:
        return TierManager(self.catalog, facts=self.facts, clock=self.clock, **kw)

    def index_contents(self) -> dict[tuple[Tier, int], set[PayloadKey]]:
        out: dict[tuple[Tier, int], set[PayloadKey]] = {}
        for (pub, tier, group), members in self.index.facts().items():
            if pub != "w0":
                continue
            out[(tier, group)] = {PayloadKey(scope.descriptor_id, key, group) for scope, key in members}
        return {k: v for k, v in out.items() if v}

    def tier_contents(self) -> dict[tuple[Tier, int], set[PayloadKey]]:
        out: dict[tuple[Tier, int], set[PayloadKey]] = {}
        for b in self.backends:
            for k in b.keys():
                out.setdefault((b.capabilities.tier, k.group), set()).add(k)
        return out
