"""Keying at the edge: one publisher's version 1 events (token ids) as version 2 events (keys).

The index used to derive every stored block's canonical key from its token ids, in every index
copy. An :class:`EdgeKeyer` does it once, in the publisher's process, which knows the identity
scope and the identity secret: each ``stored`` run's keys are computed (:class:`BlockKeyer`) and
published packed (:mod:`nexuskv.contracts.keyed_events`); token ids are dropped unless the
deployment opted in (``include_tokens``).

A run's *parent* is named by the publisher's engine hash, so the keyer keeps the publisher's map
from engine hash to key, with exactly the index's lifetime rule (:mod:`nexuskv.index`): an
entry lives while the publisher holds its block in some (tier, group) — a removal from the last
one, a clear of its tier, a full clear, a snapshot's begin, or another block taking the hash
ends it. So a run the index would have keyed from tokens is keyed here to the same keys, and a
run it could not key (its parent unknown to the publisher's map) is not published: it is counted
(``unresolved_blocks``), as the index counted it, and is a miss, never a wrong hit. The map is
bounded (``max_blocks``); past it the oldest 1/16 of blocks are forgotten (``forgotten_blocks``):
a run hanging from a forgotten block is then unresolved, a miss again.

Tier events, removals and clears pass through as their version 2 forms: the index resolves
engine hashes itself. Consecutive removals from one (tier, group) are merged into one event (up
to 4,096 hashes; vLLM emits one event per evicted block): the same removals in the same order, at
one event's decode and apply cost instead of one per block. Pure: no I/O, no clock.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from nexuskv.contracts.keyed_events import (
    Cleared,
    KeyedBatch,
    KeyedEvent,
    KeyedStored,
    Removed,
    SnapshotMark,
    TierStored,
    pack_hashes,
    unpack_hashes,
)
from nexuskv.contracts.kv_events import (
    MAX_BLOCKS_PER_EVENT,
    AllCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    PublisherIdentity,
    Snapshot,
)
from nexuskv.descriptor import Tier
from nexuskv.errors import ContractError, IdentityError
from nexuskv.identity import BlockKeyer, IdentityScope

__all__ = ["EdgeKeyer", "EdgeStats", "pack_tokens", "scope_of"]

DEFAULT_MAX_BLOCKS = 1 << 18
_KEYERS = 64


def scope_of(identity: PublisherIdentity, tenant: str | None, lora: str | None, salt: str | None) -> IdentityScope:
    """The identity scope of a publisher's block with an event's overrides (as the index forms it)."""
    return IdentityScope(tenant_namespace=tenant or identity.tenant_namespace, model=identity.model,
                         model_revision=identity.model_revision, tokenizer_revision=identity.tokenizer_revision,
                         descriptor_id=identity.descriptor_id, lora=lora, cache_salt=salt)


def pack_tokens(token_ids: Iterable[int]) -> bytes:
    """Token ids as 4-byte little-endian words (the version 2 ``token_ids`` field)."""
    try:
        packed = array("I", token_ids)
    except OverflowError:
        raise ContractError("token_ids: each id must be in [0, 2**32)") from None
    if sys.byteorder != "little":  # pragma: no cover - x86 and arm64 are little-endian
        packed.byteswap()
    return packed.tobytes()


@dataclass(slots=True)
class EdgeStats:
    keyed_blocks: int = 0
    unresolved_blocks: int = 0  # stored blocks whose parent the publisher's map did not hold (not published)
    forgotten_blocks: int = 0  # blocks dropped from the map past max_blocks


class EdgeKeyer:
    """Keys one publisher's events (see the module docstring). Not thread-safe: one per publisher."""

    def __init__(self, secret: bytes = b"", *, include_tokens: bool = False,
                 max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 16:
            raise ValueError("max_blocks must be at least 16")
        self.secret = secret
        self.include_tokens = include_tokens
        self.max_blocks = max_blocks
        self.stats = EdgeStats()
        self._engine: dict[int, bytes] = {}  # engine hash -> key
        self._held: dict[bytes, int] = {}  # key -> bit set of the (tier, group) locations holding it
        self._names: dict[bytes, list[int]] = {}  # key -> the engine hashes naming it
        self._bits: dict[tuple[Tier, int], int] = {}
        self._keyers: OrderedDict[tuple[IdentityScope, int], BlockKeyer] = OrderedDict()
        self._scopes: dict[tuple[PublisherIdentity, str | None, str | None, str | None], IdentityScope] = {}

    def __len__(self) -> int:
        return len(self._held)

    def key_batch(self, batch: KvEventBatch) -> KeyedBatch:
        """``batch`` with its events keyed (a run that cannot be keyed is left out and counted)."""
        return KeyedBatch(publisher=batch.publisher, incarnation=batch.incarnation, seq=batch.seq, ts=batch.ts,
                          identity=batch.identity, events=tuple(self.key_events(batch.identity, batch.events)))

    def key_events(self, identity: PublisherIdentity, events: Iterable[object]) -> list[KeyedEvent]:
        out: list[KeyedEvent] = []
        run: list[int] = []  # engine hashes of the removal run being merged
        where: tuple[Tier, int] | None = None

        def close() -> None:
            if run:
                out.append(Removed(engine_hashes=pack_hashes(run), tier=where[0], group=where[1]))
                run.clear()

        for e in events:
            if isinstance(e, BlockRemoved):
                self._removed(e.engine_hashes, self._bit(e.tier, e.group))
                if where != (e.tier, e.group) or len(run) + len(e.engine_hashes) > MAX_BLOCKS_PER_EVENT:
                    close()
                    where = (e.tier, e.group)
                run.extend(e.engine_hashes)
                continue
            close()
            if isinstance(e, BlockStored):
                if e.is_tier_event:
                    self._tier(e.engine_hashes, self._bit(e.tier, e.group))
                    out.append(TierStored(engine_hashes=pack_hashes(e.engine_hashes), tier=e.tier, group=e.group))
                else:
                    keyed = self._stored(identity, e)
                    if keyed is not None:
                        out.append(keyed)
            elif isinstance(e, AllCleared):
                self._cleared(e.tier)
                out.append(Cleared(tier=e.tier))
            elif isinstance(e, Snapshot):
                if e.phase == "begin":
                    self._cleared(None)
                out.append(SnapshotMark(phase=e.phase))
            else:
                raise TypeError(f"not a kv event: {type(e).__name__}")
        close()
        return out

    def export(self) -> bytes:
        """The map as bytes (for a publisher that restarts without its engine: :meth:`restore`)."""
        keys = list(self._held)
        index = {k: i for i, k in enumerate(keys)}
        hashes = [h for h in self._engine]
        doc = {"v": 1, "bits": [[t.value, g, bit] for (t, g), bit in self._bits.items()],
               "keys": b"".join(keys), "held": b"".join(self._held[k].to_bytes(8, "little") for k in keys),
               "hashes": pack_hashes(hashes),
               "owner": b"".join(index[self._engine[h]].to_bytes(4, "little") for h in hashes)}
        return msgspec.msgpack.encode(doc)

    def restore(self, data: bytes) -> None:
        """Replace the map with an :meth:`export` (ValueError when it is not one)."""
        try:
            doc = msgspec.msgpack.decode(data)
            assert doc["v"] == 1
            bits = {(Tier(t), int(g)): int(b) for t, g, b in doc["bits"]}
            raw = doc["keys"]
            keys = [raw[i:i + 16] for i in range(0, len(raw), 16)]
            held = [int.from_bytes(doc["held"][8 * i:8 * i + 8], "little") for i in range(len(keys))]
            hashes = unpack_hashes(doc["hashes"])
            owner = [int.from_bytes(doc["owner"][4 * i:4 * i + 4], "little") for i in range(len(hashes))]
            engine = {h: keys[o] for h, o in zip(hashes, owner, strict=True)}
        except (msgspec.DecodeError, KeyError, TypeError, ValueError, AssertionError, IndexError) as exc:
            raise ValueError(f"not an edge keyer map: {type(exc).__name__}: {exc}") from None
        self._bits = bits
        self._held = dict(zip(keys, held, strict=True))
        self._engine = engine
        self._names = {}
        for h, k in engine.items():
            self._names.setdefault(k, []).append(h)

    def parent_key(self, engine_hash: int) -> bytes | None:
        """The key the publisher's map holds for ``engine_hash`` (None: unknown)."""
        return self._engine.get(engine_hash)

    # -- the map ---------------------------------------------------------------------------------------

    def _bit(self, tier: Tier, group: int) -> int:
        bit = self._bits.get((tier, group))
        if bit is None:
            bit = self._bits[(tier, group)] = 1 << len(self._bits)
        return bit

    def _stored(self, identity: PublisherIdentity, e: BlockStored) -> KeyedStored | None:
        n = len(e.engine_hashes)
        parent = None
        if e.parent is not None:
            raw = self._engine.get(e.parent)
            if raw is None:
                self.stats.unresolved_blocks += n
                return None
            parent = int.from_bytes(raw, "big")
        scope = self._scope(identity, e.tenant_namespace, e.lora, e.cache_salt)
        try:
            digests = self._keyer(scope, e.block_size).digests(e.token_ids, parent=parent, extra_keys=e.extra_keys)
        except IdentityError:
            self.stats.unresolved_blocks += n
            return None
        bit = self._bit(e.tier, e.group)
        engine, held, names = self._engine, self._held, self._names
        for h, k in zip(e.engine_hashes, digests):
            old = engine.get(h)
            if old is not None and old != k:
                self._unlink(old)  # another block takes the hash: the old one leaves the publisher
            if engine.get(h) != k:
                engine[h] = k
                names.setdefault(k, []).append(h)
            held[k] = held.get(k, 0) | bit
        self.stats.keyed_blocks += n
        if len(held) > self.max_blocks:
            self._forget()
        return KeyedStored(engine_hashes=pack_hashes(e.engine_hashes), keys=b"".join(digests),
                           block_size=e.block_size, tier=e.tier, group=e.group, tenant_namespace=e.tenant_namespace,
                           lora=e.lora, cache_salt=e.cache_salt,
                           token_ids=pack_tokens(e.token_ids) if self.include_tokens else None)

    def _tier(self, hashes: Iterable[int], bit: int) -> None:
        engine, held = self._engine, self._held
        for h in hashes:
            k = engine.get(h)
            if k is not None:
                held[k] |= bit

    def _removed(self, hashes: Iterable[int], bit: int) -> None:
        engine, held = self._engine, self._held
        for h in hashes:
            k = engine.get(h)
            if k is None:
                continue
            left = held[k] & ~bit
            if left:
                held[k] = left
            else:
                self._unlink(k)

    def _cleared(self, tier: Tier | None) -> None:
        if tier is None:
            self._engine.clear()
            self._held.clear()
            self._names.clear()
            return
        mask = 0
        for (t, _g), bit in self._bits.items():
            if t == tier:
                mask |= bit
        if not mask:
            return
        gone = []
        for k, bits in self._held.items():
            if bits & mask:
                if bits & ~mask:
                    self._held[k] = bits & ~mask
                else:
                    gone.append(k)
        for k in gone:
            self._unlink(k)

    def _unlink(self, key: bytes) -> None:
        self._held.pop(key, None)
        for h in self._names.pop(key, ()):
            if self._engine.get(h) == key:
                del self._engine[h]

    def _forget(self) -> None:
        drop = len(self._held) - (self.max_blocks - self.max_blocks // 16)
        victims = [k for k, _ in zip(self._held, range(drop))]
        for k in victims:
            self._unlink(k)
        self.stats.forgotten_blocks += len(victims)

    def _scope(self, identity: PublisherIdentity, tenant: str | None, lora: str | None,
               salt: str | None) -> IdentityScope:
        key = (identity, tenant, lora, salt)
        scope = self._scopes.get(key)
        if scope is None:
            if len(self._scopes) >= 256:
                self._scopes.clear()
            scope = self._scopes[key] = scope_of(identity, tenant, lora, salt)
        return scope

    def _keyer(self, scope: IdentityScope, block_size: int) -> BlockKeyer:
        key = (scope, block_size)
        keyer = self._keyers.get(key)
        if keyer is None:
            keyer = self._keyers[key] = BlockKeyer(scope, block_size, self.secret)
            if len(self._keyers) > _KEYERS:
                self._keyers.popitem(last=False)
        return keyer
