"""The ``affinity`` arm's router: each engine's cache followed from vLLM's own ZMQ KV events.

What llm-d's precise prefix-cache scorer and Dynamo's KV router do, with nothing of NexusKV in the
path: one :class:`~connectors.zmq_events.KvEventSubscriber` per engine (live PUB socket, gaps
and restarts repaired through the engine's replay socket) feeds :class:`EngineCaches`, which keeps
per engine the blocks vLLM said it stored in its GPU pool and has not removed. Blocks are keyed
the way Dynamo's indexer keys them: from the event's token ids, chained from the parent block's
key (a run whose parent the engine never announced, or that was removed, cannot be keyed and is
counted ``unresolved``: a miss, never a wrong hit). A request's tokens are keyed the same way, so
an engine's overlap is the longest run of the prompt's blocks from block 0 that it holds.

Cost, lowest wins (Dynamo's published rule, ``nexuskv.routing_policies.DynamoCost``, at its
defaults: prefill load scale 1, full overlap credit, no decay): ``queued prefill blocks +
max(0, prompt blocks - overlap blocks)``. The queue is the router's own count of requests sent and
not yet answered with a first token (:class:`~streams.app.replay.routing.Loads`), as Dynamo's
router tracks its in-flight prefill. Decode blocks are left out: a replayed request decodes a few
tokens. Ties rotate between the tied engines (Dynamo samples among equal-best workers), so
unrelated requests spread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from connectors.kv_wire import EngineCleared, EngineRemoved, EngineStored, decode_engine_batch
from connectors.zmq_events import KvEventSubscriber, RawBatch
from nexuskv.descriptor import StateDescriptor
from nexuskv.errors import ContractError
from nexuskv.identity import BlockKey, BlockKeyer, IdentityScope
from streams.app.replay.routing import Loads, Routed

__all__ = ["AffinityRouter", "EngineCaches", "affinity_cost"]

log = logging.getLogger(__name__)

#: The engine medium strings of vLLM's GPU pool (None: engines that do not name one).
_GPU_MEDIUMS = (None, "GPU")


@dataclass(slots=True)
class _Cache:
    held: dict[int, BlockKey] = field(default_factory=dict)  # engine hash -> key
    keys: dict[BlockKey, int] = field(default_factory=dict)  # key -> how many held hashes carry it


@dataclass(slots=True)
class EngineCaches:
    """Per engine, the keys of the GPU blocks its events say it holds (pure: no sockets, no clock)."""

    keyer: BlockKeyer
    engines: int
    caches: list[_Cache] = field(init=False)
    stats: dict[str, int] = field(default_factory=lambda: {
        "batches": 0, "stored": 0, "removed": 0, "cleared": 0, "unresolved": 0, "other_tiers": 0,
        "unkeyable": 0, "malformed": 0, "restarts": 0})

    def __post_init__(self) -> None:
        self.caches = [_Cache() for _ in range(self.engines)]

    def apply(self, engine: int, raw: RawBatch) -> None:
        """One engine batch; a payload that does not decode is counted and changes nothing."""
        try:
            batch = decode_engine_batch(raw.payload, "vllm")
        except ContractError as exc:
            self.stats["malformed"] += 1
            log.warning("engine %d batch %d: %s", engine, raw.seq, exc)
            return
        self.stats["batches"] += 1
        cache = self.caches[engine]
        if raw.restart:  # a new engine incarnation starts empty
            self.stats["restarts"] += 1
            self._clear(cache)
        for e in batch.events:
            if isinstance(e, EngineStored):
                self._stored(cache, e)
            elif isinstance(e, EngineRemoved):
                if e.medium not in _GPU_MEDIUMS:
                    continue
                for h in e.block_hashes:
                    key = cache.held.pop(h, None)
                    if key is not None:
                        self.stats["removed"] += 1
                        left = cache.keys[key] - 1
                        if left:
                            cache.keys[key] = left
                        else:
                            del cache.keys[key]
            elif isinstance(e, EngineCleared):
                self.stats["cleared"] += 1
                self._clear(cache)

    def _stored(self, cache: _Cache, e: EngineStored) -> None:
        n = len(e.block_hashes)
        if e.medium not in _GPU_MEDIUMS:
            self.stats["other_tiers"] += n
            return
        if (e.block_size and e.block_size != self.keyer.block_size) or e.lora_id is not None or e.lora_name \
                or e.cache_salt or (e.extra_keys and any(x is not None for x in e.extra_keys)) \
                or len(e.token_ids) != n * self.keyer.block_size:
            self.stats["unkeyable"] += n  # not in the scope requests are keyed in: never a hit
            return
        parent: BlockKey | None = None
        if e.parent_block_hash is not None:
            parent = cache.held.get(e.parent_block_hash)
            if parent is None:
                self.stats["unresolved"] += n
                return
        for h, key in zip(e.block_hashes, self.keyer.keys(e.token_ids, parent=parent), strict=True):
            old = cache.held.get(h)
            if old is not None:  # the hash names another block now
                left = cache.keys[old] - 1
                if left:
                    cache.keys[old] = left
                else:
                    del cache.keys[old]
            cache.held[h] = key
            cache.keys[key] = cache.keys.get(key, 0) + 1
            self.stats["stored"] += 1

    @staticmethod
    def _clear(cache: _Cache) -> None:
        cache.held.clear()
        cache.keys.clear()

    def overlap(self, engine: int, keys: Sequence[BlockKey]) -> int:
        """Blocks of ``keys`` from block 0 that ``engine`` holds, stopping at the first it does not."""
        held = self.caches[engine].keys
        n = 0
        for k in keys:
            if k not in held:
                break
            n += 1
        return n


def affinity_cost(*, prompt_tokens: int, overlap_blocks: int, queued_prefill_tokens: int, block_size: int) -> float:
    """Dynamo's cost at its defaults: queued prefill blocks plus the prompt's blocks not cached there."""
    prompt_blocks = math.ceil(prompt_tokens / block_size)
    return queued_prefill_tokens / block_size + max(0, prompt_blocks - overlap_blocks)


@dataclass(slots=True)
class AffinityRouter:
    """Routes by :func:`affinity_cost` over :class:`EngineCaches` fed by every engine's KV events."""

    descriptor: StateDescriptor
    workers: tuple[str, ...]
    endpoints: tuple[tuple[str, str | None], ...]  # (pub, replay) per engine, in worker order
    topics: tuple[str, ...] = ()  # each engine's topic (a prefix subscription); "" takes all
    caches: EngineCaches = field(init=False)
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _subscribers: list[KvEventSubscriber] = field(default_factory=list)
    _next: int = 0

    def __post_init__(self) -> None:
        if len(self.endpoints) != len(self.workers):
            raise ValueError(f"endpoints: {len(self.endpoints)} for {len(self.workers)} workers")
        if self.topics and len(self.topics) != len(self.workers):
            raise ValueError(f"topics: {len(self.topics)} for {len(self.workers)} workers")
        keyer = BlockKeyer(IdentityScope.of(self.descriptor), self.descriptor.block_size)
        self.caches = EngineCaches(keyer, len(self.workers))

    @property
    def stats(self) -> dict[str, int]:
        return dict(self.caches.stats)

    async def start(self) -> None:
        for i, (pub, replay) in enumerate(self.endpoints):
            sub = KvEventSubscriber(pub, replay_endpoint=replay, topic_prefix=self.topics[i] if self.topics else "")
            self._subscribers.append(sub)
            self._tasks.append(asyncio.create_task(self._follow(i, sub), name=f"affinity-events-{i}"))

    async def _follow(self, engine: int, sub: KvEventSubscriber) -> None:
        async for raw in sub.batches():
            self.caches.apply(engine, raw)

    async def route(self, rid: str, tokens: Sequence[int], loads: Loads, arrival_at: float) -> Routed:
        started = time.perf_counter()
        self._raise_if_follower_died()
        keys = self.caches.keyer.keys(list(tokens))
        bs = self.descriptor.block_size
        costs = [affinity_cost(prompt_tokens=len(tokens), overlap_blocks=self.caches.overlap(i, keys),
                               queued_prefill_tokens=sum(loads.waiting[i].values()), block_size=bs)
                 for i in range(len(self.workers))]
        best = min(costs)
        n = len(self.workers)
        for k in range(n):
            i = (self._next + k) % n
            if costs[i] == best:
                self._next = (i + 1) % n
                return Routed(i, None, time.perf_counter() - started)
        raise AssertionError("unreachable: some engine has the lowest cost")

    def _raise_if_follower_died(self) -> None:
        for t in self._tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise RuntimeError(f"affinity router: {t.get_name()} stopped") from t.exception()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for s in self._subscribers:
            s.close()
        self._tasks.clear()
        self._subscribers.clear()
