"""SGLang's KV events into ``streams.bridge`` and out of Apache Kafka, for the event tests.

:class:`Line` runs the real path: an SGLang ``ZmqEventPublisher`` (0.5.23's, or an older release's
own ``kv_events.py``) on loopback TCP, NexusKV's :class:`~connectors.zmq_events.KvEventSubscriber`
and :class:`~streams.bridge.EventBridge` forwarding to the test session's Kafka, and a reader of
``nexuskv.kv-events`` keeping this publisher's batches. :func:`expected` says what each SGLang
event must become, from the event's own fields — independently of the bridge's code.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from connectors.descriptors import publisher_identity, resolve_descriptor
from connectors.zmq_events import KvEventSubscriber
from nexuskv.contracts.keyed_events import KeyedBatch
from nexuskv.contracts.kv_events import AllCleared, BlockRemoved, BlockStored
from nexuskv.contracts.topics import KV_EVENTS
from nexuskv.descriptor import Tier
from nexuskv.errors import ContractError
from streams.bridge import BridgeConfig, EventBridge
from streams.bus.clients import decode_record, make_consumer, make_producer
from streams.bus.process import free_port
from streams.bus.topics import ensure_topics

_MASK = (1 << 64) - 1
_TIERS = {None: Tier.GPU, "GPU": Tier.GPU, "CPU_PINNED": Tier.HOST, "DISK": Tier.DISK, "EXTERNAL": Tier.REMOTE}


def expected(event: Any) -> Any:
    """The NexusKV event an SGLang event (any version's struct) must arrive as."""
    kind = type(event).__name__
    if kind in ("BlockStored", "BlockStoredWithMetadata"):
        tokens = list(event.token_ids)
        extra = None
        if tokens and isinstance(tokens[0], (tuple, list)):  # EAGLE bigrams
            bs = event.block_size
            extra = tuple(("sglang-eagle-next", tokens[(i + 1) * bs - 1][1]) for i in range(len(event.block_hashes)))
            tokens = [p[0] for p in tokens]
        salt = getattr(event, "cache_salt", None)
        metadata = getattr(event, "metadata", None)
        if salt is None and metadata is not None:
            salt = metadata.cache_salt
        lora = getattr(event, "lora_name", None)
        if lora is None and event.lora_id is not None:
            lora = f"lora-id:{event.lora_id}"
        return BlockStored(engine_hashes=tuple(h & _MASK for h in event.block_hashes),
                           parent=None if event.parent_block_hash is None else event.parent_block_hash & _MASK,
                           token_ids=tuple(tokens), block_size=event.block_size,
                           tier=_TIERS[getattr(event, "medium", None)], lora=lora, cache_salt=salt, extra_keys=extra)
    if kind == "BlockRemoved":
        return BlockRemoved(engine_hashes=tuple(h & _MASK for h in event.block_hashes),
                            tier=_TIERS[getattr(event, "medium", None)])
    assert kind == "AllBlocksCleared", kind
    return AllCleared()


@dataclass
class Line:
    """Publisher -> bridge -> Kafka for one SGLang engine (one topic)."""

    kafka_url: Any
    tmp: Path
    page: int = 4
    pod: str = field(default_factory=lambda: f"pod-{uuid.uuid4().hex[:8]}")
    probe_interval_s: float | None = 2.0
    rcvhwm: int = 100_000
    rcvbuf: int | None = None  # the subscriber's kernel receive buffer (a slow consumer's small window)
    window: int = 256  # the bridge's records in flight (1: one acknowledgement at a time)
    idempotent: bool = True  # the bridge's producer, as ``python -m streams.bridge`` makes it on Kafka

    def __post_init__(self) -> None:
        self.topic = f"kv@{self.pod}@meta-llama/Llama-3.1-8B"
        self.port, self.replay_port = free_port(), free_port()
        self.identity = publisher_identity(resolve_descriptor(model="meta-llama/Llama-3.1-8B", tenant="sglang-test",
                                                              block_size=self.page, engine_family="sglang"))
        self.publisher_name = f"sglang/{self.pod}/dp0"
        self.state_file = self.tmp / f"bridge-{self.pod}.json"
        self.bridge: EventBridge | None = None
        self.subscriber: KvEventSubscriber | None = None
        self._task: asyncio.Task | None = None
        self._stop: asyncio.Event | None = None
        self._producer = None
        self.received: list[KeyedBatch] = []
        self._consumer = None
        self._handled = 0  # batches handled by earlier bridges of this line

    # -- the engine side ---------------------------------------------------------------------------

    def publisher(self, kv_events: Any = None, *, sndbuf: int | None = None, **options: Any) -> Any:
        """SGLang's ZmqEventPublisher (of ``kv_events``, 0.5.23's by default) bound on loopback.

        ``sndbuf``: the kernel send buffer of its sockets (a congested link), set as the default of
        the ZMQ context SGLang creates them in, for their creation only.
        """
        import inspect

        import zmq

        if sndbuf is not None:
            zmq.Context.instance().setsockopt(zmq.SNDBUF, sndbuf)
            try:
                return self.publisher(kv_events, **options)
            finally:
                zmq.Context.instance().setsockopt(zmq.SNDBUF, -1)  # the OS default again

        if kv_events is None:
            from sglang.srt.disaggregation import kv_events
        params = inspect.signature(kv_events.ZmqEventPublisher.__init__).parameters
        if "bind" in params:
            endpoint, replay = f"tcp://127.0.0.1:{self.port}", f"tcp://127.0.0.1:{self.replay_port}"
            options.setdefault("bind", True)
        else:  # older releases bind a wildcard endpoint
            endpoint, replay = f"tcp://*:{self.port}", f"tcp://*:{self.replay_port}"
        deadline = time.monotonic() + 10
        while True:  # a restarted engine binds the ports its predecessor's ZMQ I/O thread is still releasing
            try:
                return kv_events.ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay, topic=self.topic,
                                                   **options)
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    # -- the NexusKV side --------------------------------------------------------------------------

    async def start_bridge(self) -> None:
        await ensure_topics(self.kafka_url, partitions=8)
        if self.bridge is not None:  # a restarted bridge: count what the earlier one handled
            self._handled += self.bridge.stats["forwarded"] + self.bridge.stats["dead_lettered"]
        self.bridge = EventBridge(BridgeConfig(engine="sglang", identity=self.identity, name=self.pod,
                                               default_block_size=self.page, state_file=self.state_file,
                                               window=self.window))
        context = None
        if self.rcvbuf is not None:
            import zmq
            import zmq.asyncio

            context = self._context = zmq.asyncio.Context()
            context.setsockopt(zmq.RCVBUF, self.rcvbuf)
        self.subscriber = KvEventSubscriber(f"tcp://127.0.0.1:{self.port}", context=context,
                                            replay_endpoint=f"tcp://127.0.0.1:{self.replay_port}",
                                            topic_prefix=self.topic, resume=self.bridge.resume_points(),
                                            probe_interval_s=self.probe_interval_s, rcvhwm=self.rcvhwm)
        if self._producer is None:
            self._producer = make_producer(self.kafka_url, client_id=f"bridge-{self.pod}",
                                           enable_idempotence=self.idempotent)
            await self._producer.start()
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self.bridge.run(self.subscriber, self._producer, stop=self._stop))

    async def stop_bridge(self) -> None:
        if self._task is not None:
            self._stop.set()
            await asyncio.wait_for(self._task, 30)
            self._task = None
        if self.subscriber is not None:
            self.subscriber.close()

    async def close(self) -> None:
        await self.stop_bridge()
        if self._producer is not None:
            await self._producer.stop()
        if self._consumer is not None:
            await self._consumer.stop()

    def bridge_process(self) -> Any:
        """``python -m streams.bridge --engine sglang`` for this engine, as a deployment runs it (not started)."""
        import os
        import sys

        from streams.bus.process import ManagedProcess

        argv = [sys.executable, "-m", "streams.bridge", "--engine", "sglang",
                "--endpoint", f"tcp://127.0.0.1:{self.port}", "--replay-endpoint", f"tcp://127.0.0.1:{self.replay_port}",
                "--topic", self.topic, "--name", self.pod, "--model", "meta-llama/Llama-3.1-8B",
                "--tenant", "sglang-test", "--block-size", str(self.page), "--state-file", str(self.state_file)]
        env = dict(os.environ, NEXUSKV_BROKER=str(self.kafka_url),
                   PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[3]),
                                               os.environ.get("PYTHONPATH", "")]))
        return ManagedProcess(argv, name=f"bridge-{self.pod}", log_path=self.tmp / f"bridge-{self.pod}.log", env=env)

    async def wait_forwarded(self, count: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self._handled + self.bridge.stats["forwarded"] + self.bridge.stats["dead_lettered"] < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"the bridge forwarded {self.bridge.stats} of {count}; "
                                     f"subscriber {self.subscriber.stats}")
            await asyncio.sleep(0.05)

    async def read(self, count: int, timeout: float = 60.0) -> list[KeyedBatch]:
        """This publisher's batches on ``nexuskv.kv-events``, at least ``count`` of them, in topic order."""
        if self._consumer is None:
            self._consumer = make_consumer(self.kafka_url, KV_EVENTS, client_id=f"reader-{self.pod}",
                                           group_id=f"g-{uuid.uuid4().hex}")
            await self._consumer.start()
        deadline = time.monotonic() + timeout
        while len(self.received) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"read {len(self.received)} of {count} batches from Kafka")
            records = await self._consumer.getmany(timeout_ms=500)
            for recs in records.values():
                for record in recs:
                    try:
                        batch = decode_record(KV_EVENTS, record)
                    except ContractError:
                        continue  # other tests put malformed records on the shared topic on purpose
                    if batch.publisher == self.publisher_name:
                        self.received.append(batch)
        return self.received
