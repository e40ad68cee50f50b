"""SGLang's own KV-event code through ``streams.bridge --engine sglang`` to Apache Kafka.

SGLang 0.5.23's radix caches (``RadixCache`` and the default ``UnifiedRadixCache`` with its Rust
tree core) record their events with SGLang's ``KVCacheEventRecorder``; SGLang's
``ZmqEventPublisher`` sends them, as the scheduler's ``publish_kv_events`` does, and answers
replays from its ROUTER. Each test checks, batch by batch, what reaches ``nexuskv.kv-events``
against SGLang's own event objects: hashes, parents, tokens, media, LoRA, salt (fix 4: EAGLE's
bigram pages included); and that gaps (fix 6), a lost last batch (fix 7), a late join, a bridge
restart and an engine restart all end with every batch SGLang still buffers, in order.
"""

from __future__ import annotations

import asyncio
import random
import time
from array import array
from types import SimpleNamespace

import pytest

from nexuskv.contracts.keyed_events import Cleared, KeyedStored
from nexuskv.contracts.kv_events import AllCleared
from nexuskv.edge_keys import EdgeKeyer
from nexuskv.index import GlobalIndex
from streams.bus.topics import ensure_topics

from tests.connectors.sglang_real.events import Line, expected

pytestmark = pytest.mark.broker
PAGE = 4


class Engine:
    """An SGLang radix cache on CPU with its event recorder, driven like a serving engine."""

    def __init__(self, kind: str, *, eagle: bool = False, seed: int = 0) -> None:
        import torch
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.events import KvEventLoraNames
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.radix_cache import RadixCache
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        size = 1 << 14
        device = MHATokenToKVPool(size=size, page_size=PAGE, dtype=torch.float16, head_num=1, head_dim=4, layer_num=1,
                                  device="cpu", enable_memory_saver=False)
        self.allocator = PagedTokenToKVPoolAllocator(size=size, page_size=PAGE, dtype=torch.float16, device="cpu",
                                                     kvcache=device, need_sort=False)
        self.lora_names = KvEventLoraNames()
        self.adapter = "ab" * 16  # a LoRA id: SGLang puts it at the end of a request's extra_key
        self.lora_names.register(SimpleNamespace(extra_key=f"tenant-x{self.adapter}", lora_id=self.adapter),
                                 "adapter-a")
        params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.allocator,
                                 page_size=PAGE, enable_kv_cache_events=True, is_eagle=eagle,
                                 kv_event_lora_names=self.lora_names,
                                 tree_components=(ComponentType.FULL,) if kind == "unified" else None)
        self.cache = UnifiedRadixCache(params) if kind == "unified" else RadixCache(params)
        self.eagle = eagle
        self.rng = random.Random(seed)
        self.prefixes: list[list[int]] = []

    def step(self, requests: int = 3) -> list:
        """One engine step: a few requests cached (sharing prefixes), sometimes an eviction; its events."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        for _ in range(self.rng.randint(1, requests)):
            if self.prefixes and self.rng.random() < 0.6:
                base = self.rng.choice(self.prefixes)[: PAGE * self.rng.randint(1, 8)]
            else:
                base = []
            tokens = base + [self.rng.randrange(1, 150_000) for _ in range(PAGE * self.rng.randint(1, 12))]
            self.prefixes.append(tokens)
            which = self.rng.random()
            extra_key = f"tenant-x{self.adapter}" if which < 0.15 else None
            salt = "salt-b" if 0.15 <= which < 0.3 else None
            n = len(tokens) - (1 if self.eagle else 0)
            n -= n % PAGE
            if n <= 0:
                continue
            value = self.allocator.alloc(n)
            if value is None:
                self.cache.evict(EvictParams(num_tokens=4 * n))
                value = self.allocator.alloc(n)
            raw = tokens[: n + (1 if self.eagle else 0)]
            self.cache.insert(InsertParams(key=RadixKey(array("q", raw), extra_key=extra_key, is_bigram=self.eagle,
                                                        cache_salt=salt), value=value))
        if self.rng.random() < 0.25:
            self.cache.evict(EvictParams(num_tokens=PAGE * self.rng.randint(1, 16)))
        return self.cache.take_events()


def publish(publisher, events) -> None:
    from sglang.srt.disaggregation.kv_events import KVEventBatch

    publisher.publish(KVEventBatch(ts=time.time(), events=events))


def _check(received, sent) -> int:
    """Every batch SGLang sent arrived once, in order, with exactly its events, keyed at the bridge
    (no token ids on the bus); returns the block hashes checked."""
    assert [b.seq for b in received] == list(range(len(sent)))
    assert len({b.incarnation for b in received}) == 1
    keyer = EdgeKeyer()  # the bridge's keying, over the events SGLang sent (the line's bridge has no secret)
    hashes = 0
    for batch, events in zip(received, sent):
        got = list(batch.events)
        want = [expected(e) for e in events]
        if batch.seq == 0:
            assert isinstance(got[0], Cleared)  # a new engine incarnation starts empty
            want = [AllCleared(), *want]
        assert got == keyer.key_events(batch.identity, want)
        assert all(e.token_ids is None for e in got if isinstance(e, KeyedStored))
        hashes += sum(len(getattr(e, "engine_hashes", ())) for e in want)
    return hashes


@pytest.mark.parametrize("kind, eagle", [("radix", False), ("unified", False), ("unified", True)],
                         ids=["RadixCache", "UnifiedRadixCache", "UnifiedRadixCache-EAGLE"])
async def test_every_event_arrives_exactly(kafka_url, tmp_path, kind, eagle):
    line = Line(kafka_url, tmp_path, page=PAGE)
    engine = Engine(kind, eagle=eagle, seed=1 if eagle else 0)
    publisher = line.publisher()
    sent = []
    try:
        await line.start_bridge()
        await asyncio.sleep(0.3)
        for _ in range(150):
            events = engine.step()
            if events:
                publish(publisher, events)
                sent.append(events)
        await line.wait_forwarded(len(sent))
        assert line.bridge.stats["dead_lettered"] == 0
        received = await line.read(len(sent))
        hashes = _check(received, sent)
        assert hashes > 1000
        if eagle:  # the bigrams' next tokens are extra keys, folded into the keys _check compared
            assert any(expected(e).extra_keys for events in sent for e in events if type(e).__name__ == "BlockStored")
        assert any(getattr(e, "lora", None) == "adapter-a" for b in received for e in b.events)
        assert any(getattr(e, "cache_salt", None) == "salt-b" for b in received for e in b.events)
        index = GlobalIndex()
        assert all(index.apply(b).status == "applied" for b in received)
        assert index.publisher_status(line.publisher_name).certain
    finally:
        publisher.shutdown()
        await line.close()


async def test_a_dropped_burst_is_repaired_from_sglangs_replay_buffer(kafka_url, tmp_path):
    """Fix 6: 1,500 batches published while the bridge is not reading, over small socket buffers
    (SGLang's sockets and the bridge's: a congested link); ZMQ drops most of them, and the bridge
    fetches every one SGLang still buffers through its ROUTER."""
    line = Line(kafka_url, tmp_path, page=PAGE, rcvhwm=20, rcvbuf=4096)
    engine = Engine("unified", seed=3)
    publisher = line.publisher(hwm=20, sndbuf=4096)
    sent = []
    try:
        await line.start_bridge()
        await asyncio.sleep(0.3)
        events = engine.step()
        publish(publisher, events)
        sent.append(events)
        await line.wait_forwarded(1)
        line._stop.set()  # the bridge stops reading; the engine goes on
        await asyncio.wait_for(line._task, 30)
        line._task = None
        while len(sent) < 1500:
            events = engine.step()
            if events:
                publish(publisher, events)
                sent.append(events)
        await asyncio.sleep(1.0)
        line._stop = asyncio.Event()
        line._task = asyncio.create_task(line.bridge.run(line.subscriber, line._producer, stop=line._stop))
        await line.wait_forwarded(len(sent), timeout=120)
        stats = line.subscriber.stats
        assert stats["unrepaired"] == 0 and stats["replayed"] >= 500, stats  # most of the burst was dropped
        received = await line.read(len(sent), timeout=120)
        _check(received, sent)
    finally:
        publisher.shutdown()
        await line.close()


async def test_a_lost_last_batch_is_found_without_new_traffic(kafka_url, tmp_path):
    """Fix 7: the bridge's connection drops while the engine publishes its last batches, and the
    engine publishes nothing after them; the bridge's replay probe finds them within seconds."""
    line = Line(kafka_url, tmp_path, page=PAGE, probe_interval_s=0.5)
    engine = Engine("unified", seed=4)
    publisher = line.publisher()
    sent = []

    def run(steps: int) -> None:
        target = len(sent) + steps
        while len(sent) < target:
            events = engine.step()
            if events:
                publish(publisher, events)
                sent.append(events)

    try:
        await line.start_bridge()
        await asyncio.sleep(0.3)
        run(50)
        await line.wait_forwarded(50)
        endpoint = f"tcp://127.0.0.1:{line.port}"
        line.subscriber._sub.disconnect(endpoint)  # a network blip: PUB has no subscriber, it drops
        await asyncio.sleep(0.3)
        run(3)
        await asyncio.sleep(0.5)
        line.subscriber._sub.connect(endpoint)
        started = time.monotonic()
        await line.wait_forwarded(len(sent), timeout=30)
        assert time.monotonic() - started < 10
        assert line.subscriber.stats["probe_found"] == 3, line.subscriber.stats
        _check(await line.read(len(sent)), sent)
    finally:
        publisher.shutdown()
        await line.close()


async def test_late_join_bridge_restart_and_engine_restart(kafka_url, tmp_path):
    """``python -m streams.bridge --engine sglang`` started after the engine, restarted (its state
    file) while the engine publishes, and an engine restarted on the same endpoints: nothing SGLang
    buffers is missed, and the restarted engine is a new incarnation that starts empty."""
    line = Line(kafka_url, tmp_path, page=PAGE)
    engine = Engine("radix", seed=5)
    publisher = line.publisher()
    bridge = line.bridge_process()
    sent = []

    def run(steps: int) -> None:
        target = len(sent) + steps
        while len(sent) < target:
            events = engine.step()
            if events:
                publish(publisher, events)
                sent.append(events)

    try:
        await ensure_topics(kafka_url, partitions=8)
        run(40)  # before any bridge listens: all dropped live, buffered for replay
        bridge.start()
        await asyncio.sleep(3.0)  # the bridge process starts and connects
        run(1)  # the first batch the bridge sees: it fetches the 40 before it through replay
        await line.read(41, timeout=60)
        bridge.stop()  # the bridge goes down; its state file keeps where it was
        run(30)
        bridge.start()
        await asyncio.sleep(3.0)
        run(1)
        _check(await line.read(72, timeout=60), list(sent))

        publisher.shutdown()  # the engine restarts: a new publisher, seq from 0, an empty cache
        engine = Engine("radix", seed=6)
        publisher = line.publisher()
        await asyncio.sleep(0.5)
        sent = []
        run(20)
        batches = await line.read(92, timeout=60)
        second = batches[72:]
        assert len({b.incarnation for b in second}) == 1 and second[0].incarnation > batches[0].incarnation
        _check(second, sent)
    finally:
        bridge.stop()
        publisher.shutdown()
        await line.close()


@pytest.mark.parametrize("version", ["0.5.10.post1", "0.5.15", "0.5.18", "0.5.20", "0.5.22"])
async def test_older_sglang_publishers(kafka_url, tmp_path, old_publisher, version):
    """The publisher code and event structs of SGLang 0.5.10-0.5.22, from their wheels: their
    encodings (positional arrays, 0.5.18's salted variant, maps), their replay replies (without the
    topic frame before 0.5.22), a gap repaired through their ROUTER."""
    kv = old_publisher(version)
    line = Line(kafka_url, tmp_path, page=PAGE, rcvhwm=10)
    publisher = line.publisher(kv, hwm=10)
    stored_fields = set(kv.BlockStored.__struct_fields__)
    rng = random.Random(7)
    sent = []

    def stored(i: int):
        hashes = [rng.randrange(-(1 << 63), 1 << 63) for _ in range(rng.randint(1, 4))]
        fields = dict(block_hashes=hashes, parent_block_hash=rng.choice([None, rng.randrange(-(1 << 63), 1 << 63)]),
                      token_ids=[rng.randrange(0, 1 << 31) for _ in range(PAGE * len(hashes))], block_size=PAGE,
                      lora_id=None, medium=rng.choice(["GPU", "CPU_PINNED"]))
        salt = "salt-c" if i % 3 == 0 else None
        if "cache_salt" in stored_fields:
            fields["cache_salt"] = salt
        if "lora_name" in stored_fields and i % 4 == 0:
            fields["lora_name"] = "adapter-z"
        if salt is not None and hasattr(kv, "BlockStoredWithMetadata"):
            return kv.BlockStoredWithMetadata(**fields, metadata=kv.BlockStoredMetadata(cache_salt=salt))
        return kv.BlockStored(**fields)

    def batch(i: int):
        events = [stored(i)]
        if i % 5 == 1:
            events.append(kv.BlockRemoved(block_hashes=list(events[0].block_hashes[:1]), medium="GPU"))
        if i % 97 == 50:
            events.append(kv.AllBlocksCleared())
        return events

    try:
        await line.start_bridge()
        await asyncio.sleep(0.3)
        events = batch(0)
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=events))
        sent.append(events)
        await line.wait_forwarded(1)
        line._stop.set()
        await asyncio.wait_for(line._task, 30)
        line._task = None
        for i in range(1, 300):
            events = batch(i)
            publisher.publish(kv.KVEventBatch(ts=time.time(), events=events))
            sent.append(events)
        await asyncio.sleep(0.5)
        line._stop = asyncio.Event()
        line._task = asyncio.create_task(line.bridge.run(line.subscriber, line._producer, stop=line._stop))
        events = batch(300)
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=events))  # live again: the gap shows
        sent.append(events)
        await line.wait_forwarded(301, timeout=60)
        assert line.bridge.stats["dead_lettered"] == 0 and line.subscriber.stats["unrepaired"] == 0
        assert line.subscriber.stats["replayed"] > 0
        _check(await line.read(301), sent)
    finally:
        publisher.shutdown()
        await line.close()
