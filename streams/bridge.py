"""The engine → Kafka bridge: vLLM/SGLang KV events in, ``nexuskv.kv-events`` batches out.

For each engine batch received in order (:mod:`connectors.zmq_events`), the bridge

1. names the publisher from the ZMQ topic (``kv@<pod>@<model>`` → ``<engine>/<pod>/dp<rank>``;
   a free-form topic → the configured name) and the batch's data-parallel rank;
2. decodes the payload (:mod:`connectors.kv_wire`), maps each engine medium to a tier, and
   translates the events into a :class:`~nexuskv.contracts.kv_events.KvEventBatch` carrying the
   publisher's identity, its *incarnation* and the engine's own sequence number;
3. keys it at the edge (:class:`~nexuskv.edge_keys.EdgeKeyer`, one per publisher: the bridge knows
   the identity scope and the identity secret, ``NEXUSKV_IDENTITY_SECRET``) and publishes it as a
   version 2 :class:`~nexuskv.contracts.keyed_events.KeyedBatch` — canonical keys packed, no token
   ids unless ``NEXUSKV_KV_EVENTS_TOKENS=on`` — keyed by publisher, so one publisher's batches stay
   ordered on one partition. The keyer's map from engine hash to key is saved beside the state
   file when the bridge stops cleanly and read back when it starts; a stored run whose parent the
   map does not hold (the bridge crashed, or the map forgot it) is not published and is counted
   (``unresolved_blocks``): a miss for the index, never a wrong hit.

Clears concern the engine's own memory only. vLLM's ``AllBlocksCleared`` (a prefix-cache reset)
empties its GPU cache and nothing else (vLLM's own CPU offload tier keeps its blocks), so it
becomes ``cleared`` of the GPU tier, and whatever else the publisher announced stays. SGLang's
empties its radix caches, device and host, which are everything its engine publisher announces
(its storage tier's pages are the HiCache backend's, a publisher of their own), so it stays a
clear of the publisher (:data:`ENGINE_CLEARS`).

Restarts: a lower sequence number means the engine restarted. The bridge gives it a new
incarnation (a nanosecond timestamp, so incarnations grow) and starts the new incarnation with
``cleared`` of every tier: a restarted engine's state is known — nothing of what its process
published survives it — and the index, which treats a new incarnation as uncertain, is certain
again at once. Blocks in tiers that outlive the engine process are not the engine's to announce:
their writer publishes them under an identity that outlives it (the vLLM connector's tier
publisher, ``<worker>/disk``), so neither a restart nor a reset touches them.

Failures lose nothing silently: a payload that cannot be decoded or keyed (an unknown medium,
token ids that do not fill the blocks) goes to ``nexuskv.dead-letter`` with its reason and is
*not* forwarded, so the index sees the sequence gap and treats the publisher as uncertain until
it resyncs — fail closed rather than guess.

**Pipelined sends.** Waiting for the broker's acknowledgement of every batch before the next
one is sent gave about 47 batches/s: a busy engine emits 50-100 a second, and a 10k-batch gap
took minutes to repair. The bridge keeps up to ``window`` records in flight instead (queued in the
producer, acknowledged later), on the idempotent producer (``enable_idempotence``: a retried
request is never written twice). Order per partition is aiokafka's: it keeps at most one
produce request in flight per partition, so one publisher's batches, which share a partition,
reach the log in the order the bridge sent them. When the window is full the bridge waits for
its oldest record's acknowledgement before it takes the next engine batch (``window_stats["window_full"]``
and ``nexuskv_bridge_window_full``): backpressure, so a stalled broker slows the bridge and fills
the engine's replay buffer instead of the bridge's memory. The state file records only
acknowledged progress: a bridge that dies with records in flight resumes before them (the
index drops what it already applied), never after a batch that was lost. ``window=1`` is the
former one-at-a-time send (the benchmark's baseline). Gap repair (:mod:`connectors.zmq_events`)
is unchanged: it hands the bridge the repaired batches in order, and the window carries them.

Run: ``python -m streams.bridge --engine vllm --endpoint tcp://10.0.0.5:5557
--replay-endpoint tcp://10.0.0.5:5558 --model meta-llama/Llama-3.1-8B`` (``NEXUSKV_BROKER``
names the bus; unset, an embedded broker is started).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from aiokafka import AIOKafkaProducer

from connectors.descriptors import publisher_identity, resolve_descriptor
from connectors.kv_wire import Engine, EngineBatch, EngineCleared, EngineRemoved, EngineStored, decode_engine_batch
from connectors.zmq_events import KvEventSubscriber, RawBatch
from nexuskv.config import BrokerUrl, Settings
from nexuskv.contracts.keyed_events import KeyedBatch
from nexuskv.contracts.kv_events import AllCleared, BlockRemoved, BlockStored, KvEventBatch, PublisherIdentity
from nexuskv.contracts.topics import DEAD_LETTER, KV_EVENTS
from nexuskv.descriptor import Tier
from nexuskv.edge_keys import EdgeKeyer
from nexuskv.errors import ConfigError, ContractError, NexusKVError
from streams.bus.process import stop_on_signals

__all__ = [
    "DEFAULT_MEDIUMS",
    "DEFAULT_WINDOW",
    "ENGINE_CLEARS",
    "BridgeConfig",
    "EventBridge",
    "publisher_name",
    "tier_of",
    "translate",
]

log = logging.getLogger(__name__)

#: Engine medium strings (vLLM GPU/CPU/STORAGE/FS/OBJ, SGLang GPU/CPU_PINNED/DISK/EXTERNAL) -> tiers.
DEFAULT_MEDIUMS: dict[str, Tier] = {
    "GPU": Tier.GPU,
    "CPU": Tier.HOST,
    "CPU_PINNED": Tier.HOST,
    "STORAGE": Tier.DISK,
    "FS": Tier.DISK,
    "DISK": Tier.DISK,
    "OBJ": Tier.OBJECT,
    "OBJECT": Tier.OBJECT,
    "EXTERNAL": Tier.REMOTE,
    "REMOTE": Tier.REMOTE,
}


#: Records the bridge keeps in flight by default: ~2.5 s of a busy engine's batches at 100/s, and
#: enough to cover a loopback or in-zone round trip at thousands of batches a second.
DEFAULT_WINDOW = 256

#: At most one state file write per this many seconds while forwarding (and one at every stop): a
#: bridge that crashes resumes up to this much earlier, and the index drops what it already applied.
STATE_INTERVAL_S = 0.1

#: The tiers an engine's ``AllBlocksCleared`` empties (None: all of the publisher's).
ENGINE_CLEARS: dict[str, tuple[Tier | None, ...]] = {"vllm": (Tier.GPU,), "sglang": (None,)}


def tier_of(medium: str | None, mediums: Mapping[str, Tier] = DEFAULT_MEDIUMS) -> Tier:
    """The tier of an engine medium; None (older engines) is the GPU pool."""
    if medium is None:
        return Tier.GPU
    tier = mediums.get(medium.upper())
    if tier is None:
        raise ContractError(f"unknown medium {medium!r}; map it with --medium {medium}=TIER")
    return tier


def publisher_name(engine: Engine, topic: str, dp_rank: int | None, fallback: str) -> str:
    """``<engine>/<pod>/dp<rank>`` from a ``kv@<pod>@<model>`` topic, else from ``fallback``."""
    pod = fallback
    if topic.startswith("kv@"):
        parts = topic.split("@", 2)
        if len(parts) == 3 and parts[1]:
            pod = parts[1]
    return f"{engine}/{pod}/dp{dp_rank or 0}"


def translate(batch: EngineBatch, *, publisher: str, incarnation: int, seq: int, identity: PublisherIdentity,
              default_block_size: int, mediums: Mapping[str, Tier] = DEFAULT_MEDIUMS,
              cleared_first: bool = False, clears: tuple[Tier | None, ...] = ENGINE_CLEARS["vllm"]) -> KvEventBatch:
    """One decoded engine batch as a NexusKV batch; ContractError when an event cannot be keyed.

    ``cleared_first`` starts it with a clear of every tier (a new incarnation); the engine's own
    clears become clears of ``clears``.
    """
    events: list[BlockStored | BlockRemoved | AllCleared] = [AllCleared()] if cleared_first else []
    for i, e in enumerate(batch.events):
        where = f"events[{i}]"
        if isinstance(e, EngineStored):
            block_size = e.block_size or default_block_size
            if e.token_ids and len(e.token_ids) != len(e.block_hashes) * block_size:
                raise ContractError(f"{where}: {len(e.token_ids)} token ids do not fill {len(e.block_hashes)} "
                                    f"blocks of {block_size}; the blocks cannot be keyed")
            lora = e.lora_name if e.lora_name is not None else (None if e.lora_id is None else f"lora-id:{e.lora_id}")
            events.append(BlockStored(
                engine_hashes=e.block_hashes, parent=e.parent_block_hash, token_ids=e.token_ids,
                block_size=block_size, tier=tier_of(e.medium, mediums), group=e.group_idx or 0,
                lora=lora, cache_salt=e.cache_salt, extra_keys=e.extra_keys,
            ))
        elif isinstance(e, EngineRemoved):
            events.append(BlockRemoved(engine_hashes=e.block_hashes, tier=tier_of(e.medium, mediums),
                                       group=e.group_idx or 0))
        elif isinstance(e, EngineCleared):
            events.extend(AllCleared(tier=t) for t in clears)
    return KvEventBatch(publisher=publisher, incarnation=incarnation, seq=seq, ts=batch.ts, identity=identity,
                        events=tuple(events))


@dataclass(frozen=True, slots=True)
class BridgeConfig:
    engine: Engine
    identity: PublisherIdentity
    name: str = "engine"  # publisher name when the topic is free-form
    default_block_size: int = 16
    mediums: Mapping[str, Tier] = field(default_factory=lambda: dict(DEFAULT_MEDIUMS))
    state_file: Path | None = None  # where incarnations and resume points survive a bridge restart
    identity_secret: bytes = b""  # keys the blocks' scopes (NEXUSKV_IDENTITY_SECRET): the same as the index's
    include_tokens: bool = False  # token ids on the bus too (NEXUSKV_KV_EVENTS_TOKENS=on)
    window: int = DEFAULT_WINDOW  # records in flight (sent, not yet acknowledged); 1: wait for each acknowledgement

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
            raise ConfigError("window", f"records in flight must be a positive int, not {self.window!r}")


@dataclass(slots=True)
class _Publisher:
    incarnation: int
    next_seq: int = 0


@dataclass(frozen=True, slots=True)
class _InFlight:
    """A record sent and not yet acknowledged: the engine batch it carries and the broker's future."""

    topic: str
    incarnation: int
    seq: int
    future: Any
    forwarded: bool  # False: the batch's dead letter
    block_ops: int = 0


class EventBridge:
    """Moves batches from one engine subscriber to the kv-events topic (and rejects to dead-letter)."""

    def __init__(self, config: BridgeConfig, *, clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.config = config
        self._clock_ns = clock_ns
        self._publishers: dict[str, _Publisher] = {}
        self._keyers: dict[str, EdgeKeyer] = {}
        self.stats = {"forwarded": 0, "dead_lettered": 0, "restarts": 0, "block_ops": 0, "unresolved_blocks": 0}
        # The send window: waits for an acknowledgement because it was full, the most records in flight.
        self.window_stats = {"window_full": 0, "in_flight_max": 0}
        self._in_flight: deque[_InFlight] = deque()
        # Batches received and not yet sent (a repair delivers thousands at once): a stop leaves them
        # here for the next run; a new bridge process resumes before them (the state file).
        self._backlog: deque[RawBatch] = deque()
        self._load_state()
        # What the broker acknowledged, per topic: the resume points the state file keeps.
        self._acked: dict[str, _Publisher] = {t: _Publisher(p.incarnation, p.next_seq)
                                              for t, p in self._publishers.items()}
        self._acked_dirty = False
        self._saved_at = float("-inf")

    def resume_points(self) -> dict[str, int]:
        """Next engine sequence number per topic, for :class:`KvEventSubscriber` after a restart."""
        return {topic: p.next_seq for topic, p in self._publishers.items()}

    def acknowledged_points(self) -> dict[str, int]:
        """Next engine sequence number per topic after the last batch the broker acknowledged."""
        return {topic: p.next_seq for topic, p in self._acked.items()}

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def handle(self, raw: RawBatch) -> KeyedBatch:
        """Translate and key one received batch (raises ContractError with the reason when it cannot)."""
        state = self._publishers.get(raw.topic)
        new_incarnation = state is None or raw.restart or raw.seq < state.next_seq
        if new_incarnation:
            if state is not None:
                self.stats["restarts"] += 1
            incarnation = max(self._clock_ns(), (state.incarnation + 1) if state else 0)
            state = self._publishers[raw.topic] = _Publisher(incarnation=incarnation)
        state.next_seq = raw.seq + 1
        batch = decode_engine_batch(raw.payload, self.config.engine)
        publisher = publisher_name(self.config.engine, raw.topic, batch.data_parallel_rank, self.config.name)
        restarted = new_incarnation and (raw.seq == 0 or raw.restart)
        plain = translate(batch, publisher=publisher, incarnation=state.incarnation, seq=raw.seq,
                          identity=self.config.identity, default_block_size=self.config.default_block_size,
                          mediums=self.config.mediums, cleared_first=restarted,
                          clears=ENGINE_CLEARS[self.config.engine])
        keyer = self._keyers.get(publisher)
        if keyer is None:
            keyer = self._keyers[publisher] = EdgeKeyer(self.config.identity_secret,
                                                        include_tokens=self.config.include_tokens)
        before = keyer.stats.unresolved_blocks
        out = keyer.key_batch(plain)
        self.stats["unresolved_blocks"] += keyer.stats.unresolved_blocks - before
        return out

    async def run(self, subscriber: KvEventSubscriber, producer: AIOKafkaProducer, *,
                  stop: asyncio.Event | None = None) -> None:
        """Forward until ``stop`` is set (or cancelled); returns once every record sent is acknowledged.

        A stop takes effect between two batches, also in the middle of a repair's thousands; the
        batches not sent yet wait for the next :meth:`run` (a bridge process started again
        resumes before them, from the state file).

        A record the broker finally refuses (the producer gave up retrying) raises here, after the
        state file was written up to the last acknowledged batch before it.
        """
        stop = stop or asyncio.Event()
        receive: asyncio.Future | None = None
        acked: asyncio.Future | None = None  # waits for the oldest record's acknowledgement
        stopped = asyncio.ensure_future(stop.wait())
        try:
            while self._backlog and not stop.is_set():  # what an earlier run received and did not send
                await self.forward(self._backlog[0], producer)
                self._backlog.popleft()
            while not stop.is_set():
                if receive is None:
                    receive = asyncio.ensure_future(subscriber.receive())
                if acked is None and self._in_flight:  # while the engine is quiet, acknowledgements
                    acked = asyncio.ensure_future(asyncio.wait([self._in_flight[0].future]))  # move the state
                waits = {receive, stopped} | ({acked} if acked is not None else set())
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED,  # a state write
                                             timeout=STATE_INTERVAL_S if self._acked_dirty else None)  # due
                if acked in done:
                    acked = None
                if receive in done:
                    self._backlog.extend(receive.result())
                    receive = None
                    while self._backlog and not stop.is_set():  # a stop does not wait for a long repair
                        await self.forward(self._backlog[0], producer)
                        self._backlog.popleft()
                elif stopped in done:
                    break
                self._settle()
                self._save_state(min_interval_s=STATE_INTERVAL_S)
            await self.drain()
        finally:
            for task in (receive, stopped, acked):
                if task is not None and not task.done():
                    task.cancel()
            self._save_state()
        self._save_keys()

    async def forward(self, raw: RawBatch, producer: AIOKafkaProducer) -> None:
        """Translate, key and send one batch (or its dead letter), waiting first while the window is full."""
        from streams.bus.clients import dead_letter_for, send_nowait
        from streams.bus.metrics import METRICS

        self._settle()
        if len(self._in_flight) >= self.config.window:
            if self.config.window > 1:
                self.window_stats["window_full"] += 1
                METRICS.bridge_window_full.labels(service="kv-bridge").inc()
            while len(self._in_flight) >= self.config.window:
                await self._acknowledge_oldest()
        try:
            out = self.handle(raw)
        except NexusKVError as exc:
            letter = dead_letter_for(f"zmq:{raw.topic}", None, exc, service="kv-bridge",
                                     now=time.time(), payload=raw.payload, key=raw.topic.encode())
            future = await send_nowait(producer, DEAD_LETTER, letter.source_topic, letter)
            self._track(raw, future, forwarded=False)
            log.warning("dead-lettered batch seq %d of %r: %s", raw.seq, raw.topic, exc)
        else:
            future = await send_nowait(producer, KV_EVENTS, out.publisher, out)
            self._track(raw, future, forwarded=True, block_ops=out.block_operations)
        if self.config.window == 1:
            await self.drain()

    def _track(self, raw: RawBatch, future: Any, *, forwarded: bool, block_ops: int = 0) -> None:
        state = self._publishers[raw.topic]
        self._in_flight.append(_InFlight(raw.topic, state.incarnation, raw.seq, future, forwarded, block_ops))
        self.window_stats["in_flight_max"] = max(self.window_stats["in_flight_max"], len(self._in_flight))

    async def drain(self) -> None:
        """Wait until every record sent is acknowledged."""
        while self._in_flight:
            await self._acknowledge_oldest()

    async def _acknowledge_oldest(self) -> None:
        entry = self._in_flight[0]
        try:
            await asyncio.shield(entry.future)
        except asyncio.CancelledError:
            if not entry.future.done():
                raise
        self._settle()

    def _settle(self) -> None:
        """Account for the acknowledged records at the head of the window (in send order); raise the
        broker's error of the first one that failed."""
        while self._in_flight and self._in_flight[0].future.done():
            entry = self._in_flight[0]
            exc = entry.future.exception() if not entry.future.cancelled() else asyncio.CancelledError()
            if exc is not None:
                raise exc
            self._in_flight.popleft()
            self._acked[entry.topic] = _Publisher(entry.incarnation, entry.seq + 1)
            self._acked_dirty = True
            if entry.forwarded:
                self.stats["forwarded"] += 1
                self.stats["block_ops"] += entry.block_ops
            else:
                self.stats["dead_lettered"] += 1

    def _load_state(self) -> None:
        path = self.config.state_file
        if path is None or not path.is_file():
            return
        data = json.loads(path.read_text())
        for topic, entry in data.get("publishers", {}).items():
            self._publishers[topic] = _Publisher(incarnation=int(entry["incarnation"]), next_seq=int(entry["next_seq"]))
        keys = path.with_suffix(".keys")
        if keys.is_file():
            try:
                saved = msgspec.msgpack.decode(keys.read_bytes(), type=dict[str, bytes])
                for publisher, blob in saved.items():
                    keyer = self._keyers[publisher] = EdgeKeyer(self.config.identity_secret,
                                                                include_tokens=self.config.include_tokens)
                    keyer.restore(blob)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
                self._keyers.clear()
                log.warning("%s: key map unreadable (%s): runs hanging from earlier blocks go unpublished", keys, exc)
            keys.unlink()  # a map is good for the one restart after it was saved: later batches change it

    def _save_keys(self) -> None:
        """Save the publishers' key maps at a clean stop, so a restarted bridge still keys runs that hang
        from blocks stored before it stopped (after a crash they are unresolved: misses, counted)."""
        path = self.config.state_file
        if path is None or not self._keyers:
            return
        tmp = path.with_suffix(".keys.tmp")
        tmp.write_bytes(msgspec.msgpack.encode({p: k.export() for p, k in self._keyers.items()}))
        os.replace(tmp, path.with_suffix(".keys"))

    def _save_state(self, *, min_interval_s: float = 0.0) -> None:
        """Write the acknowledged resume points (when they moved since the last write, and at most
        every ``min_interval_s``: a file write per batch would cost more than the batch)."""
        path = self.config.state_file
        if path is None or not self._acked_dirty:
            return
        now = time.monotonic()
        if min_interval_s and now - self._saved_at < min_interval_s:
            return
        self._saved_at = now
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"publishers": {t: {"incarnation": p.incarnation, "next_seq": p.next_seq}
                                                  for t, p in self._acked.items()}}))
        os.replace(tmp, path)
        self._acked_dirty = False


def _identity(args: argparse.Namespace) -> PublisherIdentity:
    return publisher_identity(resolve_descriptor(model=args.model, descriptor_path=args.descriptor,
                                                 tenant=args.tenant, block_size=args.block_size,
                                                 engine_family=args.engine))


def _mediums(pairs: list[str]) -> dict[str, Tier]:
    out = dict(DEFAULT_MEDIUMS)
    for pair in pairs:
        name, _, tier = pair.partition("=")
        try:
            out[name.upper()] = Tier(tier.lower())
        except ValueError:
            raise SystemExit(f"--medium {pair!r}: expected NAME=TIER with TIER one of {[t.value for t in Tier]}")
    return out


async def _serve(args: argparse.Namespace, url: BrokerUrl, settings: Settings) -> None:
    from streams.bus.clients import make_producer

    state = Path(args.state_file) if args.state_file else None
    config = BridgeConfig(engine=args.engine, identity=_identity(args), name=args.name,
                          default_block_size=args.block_size, mediums=_mediums(args.medium), state_file=state,
                          identity_secret=settings.identity_secret_bytes, include_tokens=settings.kv_event_tokens,
                          window=args.window)
    bridge = EventBridge(config)
    subscriber = KvEventSubscriber(args.endpoint, replay_endpoint=args.replay_endpoint, topic_prefix=args.topic,
                                   bind=args.bind, resume=bridge.resume_points())
    # The idempotent producer wherever the broker grants a producer id (Apache Kafka); a broker that
    # refuses one (the embedded Tansu broker, also when it is the configured NEXUSKV_BROKER of a
    # replay) gets the plain producer, said once: a retried request may then be written twice.
    producer = make_producer(url, client_id=f"kv-bridge-{args.name}", enable_idempotence=True)
    stop = stop_on_signals()
    try:
        await producer.start()
    except Exception as exc:  # noqa: BLE001 - aiokafka raises the broker's error class for InitProducerId
        log.warning("the broker refused an idempotent producer (%s: %s); the producer is not idempotent "
                    "(a retried request may be written twice)", type(exc).__name__, exc)
        with contextlib.suppress(Exception):
            await producer.stop()
        producer = make_producer(url, client_id=f"kv-bridge-{args.name}", enable_idempotence=False)
        await producer.start()
    log.info("bridge ready: %s events from %s to %s, resuming at %s, %d records in flight", args.engine,
             args.endpoint, url, bridge.resume_points() or "the engine's next batch", config.window)
    try:
        await bridge.run(subscriber, producer, stop=stop)
    finally:
        subscriber.close()
        await producer.stop()
        log.info("bridge stopped: %s, window %s", bridge.stats, bridge.window_stats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m streams.bridge", description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["vllm", "sglang"], default="vllm")
    ap.add_argument("--endpoint", required=True, help="the engine's PUB endpoint, e.g. tcp://10.0.0.5:5557")
    ap.add_argument("--replay-endpoint", default=None, help="the engine's ROUTER replay endpoint")
    ap.add_argument("--bind", action="store_true", help="bind the SUB socket (engines connect to it)")
    ap.add_argument("--topic", default="", help="ZMQ topic prefix to subscribe to")
    ap.add_argument("--name", default="engine", help="publisher name when the topic is not kv@pod@model")
    ap.add_argument("--model", default="meta-llama/Llama-3.1-8B", help="a known model (nexuskv.models)")
    ap.add_argument("--descriptor", default=None,
                    help="a StateDescriptor JSON file (instead of --model), e.g. from `nexuskv descriptor`")
    ap.add_argument("--tenant", default="default")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--medium", action="append", default=[], help="extra medium mapping NAME=TIER")
    ap.add_argument("--state-file", default=None)
    ap.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                    help="records in flight (sent, not yet acknowledged); 1 waits for each acknowledgement")
    args = ap.parse_args(argv)
    settings = Settings.from_env()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from streams.bus.broker import open_bus

    with open_bus(settings.broker, start_timeout_s=settings.broker_start_timeout_s) as url:
        asyncio.run(_serve(args, url, settings))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
