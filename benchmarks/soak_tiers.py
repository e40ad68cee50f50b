"""Soak: ``nexuskv up`` on Apache Kafka, with a request and event load that overfills every tier many times.

What runs, all real:

* **Apache Kafka** (single node, KRaft; the one the tests provision), or ``NEXUSKV_BROKER``.
* **``nexuskv up``** as a subprocess (``python -m streams.app.cli up``): index worker, index lookup
  API, the remote tier's Mooncake Store, the tier manager of worker ``soak-w0`` with its transfer executor, calibration,
  planner, decision sink — each its own process, tiers sized small by the settings.
* **Engine workers, in this process** (``--engines``, ``soak-e0``...): what a vLLM connector or the
  SGLang backend runs in an engine's process — a :class:`~nexuskv.dataplane.tiers.TierManager`
  over the worker's own device stand-in, host and disk tiers, a :class:`~streams.tier_manager.TierBus`
  on the bus (its tier facts to ``nexuskv.kv-events``, its tier state, hints for it) and a transfer
  executor serving the planner's commands for it. Each engine sends one plan request after another
  to ``up``'s planner: a *recurring* prompt (one shared system prefix, a short unique tail) with
  probability ``--recurring``, otherwise a *one-off* prompt; when the decision moves blocks, the
  engine's executor copies them (host or disk to GPU, through its manager); then the engine saves
  the prompt's blocks to its host tier through :meth:`~nexuskv.dataplane.tiers.TierManager.save`
  (as a connector offloads after a prefill), tokens and parent included, so the index can key them.
* **Worker ``soak-w0``'s load**: prompts whose blocks this process writes to the shared remote tier
  and offers on ``nexuskv.tier-offers`` (the event load): ``up``'s remote-tier manager admits them
  by utility, evicts to keep headroom as the store overfills, and announces them under its own
  publisher; plan requests for ``soak-w0`` make ``up``'s planner order copies remote -> GPU, which
  ``up``'s tier manager admits, demotes and collects.

Checked at the end (the result says which held): every save answered (saved, already held, or
refused by utility with a reason) and none failed, remote-tier puts included; every managed
tier's used + reserved bytes within its capacity at every sample; an index rebuilt from
``nexuskv.kv-events`` equal to what every tier manager's tiers really hold, and to what the
remote-tier manager holds (its audit); every service's RSS bounded (the last third of the run
within ``rss_growth`` of the first third); every process alive, no traceback in any service log;
the recurring prefix found by the planner in most of its requests (``hit rate``: matched whole in
a tier, whether or not the cost model chose to load it, which is ``recurring_reuse_rate``), while
the evicted blocks are one-off ones.

``python -m benchmarks.soak_tiers --minutes 10`` writes ``benchmarks/results/soak_tiers.json``
(``benchmarks/README.md``); ``tests/benchmarks/test_soak.py`` runs a one-minute version in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import psutil
import torch

from nexuskv.admission import ReuseModel
from nexuskv.config import BrokerUrl, parse_broker_url
from nexuskv.contracts import codec
from nexuskv.contracts.decisions import Action, Decision
from nexuskv.contracts.kv_events import PublisherIdentity
from nexuskv.contracts.plans import PlanRequest, WorkerLoad
from nexuskv.contracts.tier_state import TierStateRecord
from nexuskv.contracts.topics import DECISIONS, PLAN_REQUESTS, TIER_STATE, TRANSFER_RESULTS
from nexuskv.contracts.transfers import TransferResult, TransferStatus
from nexuskv.cost import extent_bytes
from nexuskv.dataplane.catalog import BackendCatalog
from nexuskv.dataplane.disk import DiskBackend
from nexuskv.dataplane.executor import TransferExecutor
from nexuskv.dataplane.memory import DeviceMemoryBackend, HostMemoryBackend
from nexuskv.dataplane.payload import PayloadKey
from nexuskv.dataplane.remote import RemoteBackend
from nexuskv.dataplane.remote_offers import save_and_offer
from nexuskv.dataplane.tier_facts import BlockIdentity, TierFacts
from nexuskv.dataplane.tiers import SaveBlock, TierManager
from nexuskv.descriptor import StateDescriptor, Tier
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.models import known_model
from nexuskv.profiles import shipped_cost_model
from streams.bus.clients import ControlSigner, make_consumer, make_producer, send
from streams.bus.topic_keys import route
from streams.replica import IndexReplica
from streams.tier_manager import TierBus, cost_model_gains
from streams.transfer_executor import TransferService

from benchmarks._result import Run, write_result

__all__ = ["SoakConfig", "SoakResult", "run_soak", "main"]

PROFILE = "h200x1-rdma4x200"
TENANT = "soak"
W0 = "soak-w0"
REMOTE_OWNER = "remote-tier"  # the remote-tier manager's publisher (NEXUSKV_REMOTE_TIER_OWNER's default)


@dataclass(frozen=True, slots=True)
class SoakConfig:
    duration_s: float = 600.0
    engines: int = 2
    recurring: float = 0.3  # share of an engine's requests that carry the shared system prefix
    system_blocks: int = 8  # the recurring prefix, in blocks
    tail_blocks: int = 8  # the unique part of a recurring prompt; a one-off prompt has system + tail blocks
    followup: float = 0.5  # share of one-off prompts that get one follow-up turn a few requests later
    followup_blocks: int = 4  # new blocks of a follow-up turn
    layers: int = 2  # Llama-3.1-8B's KV per layer (64 KiB per 16-token block per layer)
    gpu_blocks: int = 32  # per worker
    host_blocks: int = 64
    disk_blocks: int = 128
    remote_blocks: int = 512  # the shared remote tier (its own server in ``up``)
    engine_rate_per_s: float = 4.0  # plan requests per engine per second (at most: one at a time)
    w0_rate_per_s: float = 1.0  # plan requests for soak-w0 per second
    # The tier managers' P(reuse) memory. It should be the time within which state is reused: minutes
    # for real conversations (the default NEXUSKV_TIER_REUSE_HALF_LIFE is 600 s), about 2 s here,
    # where a follow-up comes 2-8 requests (0.5-2 s) after its first turn. With 30 s, a first turn
    # that got its follow-up (two uses) outranks every new prompt (one use) for a minute and most
    # saves are refused.
    half_life_s: float = 2.0
    sample_s: float = 5.0
    rss_growth: float = 0.25  # allowed growth of the last third's max RSS over the first third's, plus 48 MiB
    out: Path | None = None
    seed: int = 7


@dataclass(slots=True)
class SoakResult:
    duration_s: float = 0.0
    requests: Counter = field(default_factory=Counter)  # by kind (recurring, one-off, w0)
    actions: Counter = field(default_factory=Counter)
    transfers: Counter = field(default_factory=Counter)
    saves: Counter = field(default_factory=Counter)  # blocks saved, already held, refused, failed
    refusal_reasons: Counter = field(default_factory=Counter)
    remote_saves: Counter = field(default_factory=Counter)  # blocks soak-w0 wrote to the remote tier, failed puts
    recurring_hits: int = 0
    recurring_requests: int = 0
    recurring_reused: int = 0  # recurring requests whose decision reused the whole prefix
    recurring_misses: Counter = field(default_factory=Counter)  # why a recurring request did not find it
    overfill: dict[str, float] = field(default_factory=dict)  # blocks written / capacity, per tier
    capacity_violations: list[str] = field(default_factory=list)
    index_equal: dict[str, bool] = field(default_factory=dict)
    index_detail: dict[str, dict] = field(default_factory=dict)
    rss_mib: dict[str, dict[str, float]] = field(default_factory=dict)
    rss_bounded: dict[str, bool] = field(default_factory=dict)
    alive: dict[str, bool] = field(default_factory=dict)
    tracebacks: dict[str, int] = field(default_factory=dict)
    evicted_recurring: int = 0
    evicted_one_off: int = 0
    counters: dict[str, dict[str, int]] = field(default_factory=dict)
    w0_states: dict[str, dict] = field(default_factory=dict)

    @property
    def recurring_hit_rate(self) -> float:
        return self.recurring_hits / self.recurring_requests if self.recurring_requests else 0.0

    def failures(self) -> list[str]:
        """What did not hold (empty: the soak passed)."""
        out = []
        if self.saves["failed"]:
            out.append(f"{self.saves['failed']} block saves failed")
        attempted = self.saves["saved"] + self.saves["refused"]
        if attempted and self.saves["refused"] > 0.2 * attempted:
            out.append(f"{self.saves['refused']} of {attempted} new blocks refused: saves are not succeeding")
        if not self.saves["saved"]:
            out.append("nothing was saved")
        if self.remote_saves["failed"]:
            out.append(f"{self.remote_saves['failed']} remote-tier puts failed (its owner keeps headroom)")
        out += self.capacity_violations
        out += [f"index != tiers for {k}" for k, ok in self.index_equal.items() if not ok]
        out += [f"RSS of {k} grew beyond bound: {self.rss_mib[k]}" for k, ok in self.rss_bounded.items() if not ok]
        out += [f"{k} died" for k, ok in self.alive.items() if not ok]
        out += [f"{k} logged {n} tracebacks" for k, n in self.tracebacks.items() if n]
        if self.recurring_requests and self.recurring_hit_rate < 0.8:
            out.append(f"recurring prefix found in {self.recurring_hit_rate:.2f} of its requests < 0.8: "
                       f"{dict(self.recurring_misses.most_common(3))}")
        if self.evicted_recurring > self.evicted_one_off:
            out.append("more recurring than one-off blocks were evicted")
        return out

    def as_dict(self) -> dict:
        d = {f.name: (dict(getattr(self, f.name)) if isinstance(getattr(self, f.name), Counter)
                      else getattr(self, f.name)) for f in fields(self)}
        d["recurring_hit_rate"] = self.recurring_hit_rate
        d["recurring_reuse_rate"] = self.recurring_reused / self.recurring_requests if self.recurring_requests else 0.0
        d["failures"] = self.failures()
        return d


def _descriptor(layers: int) -> StateDescriptor:
    return known_model("meta-llama/Llama-3.1-8B", tenant_namespace=TENANT, num_layers=layers)


class _Prompts:
    """Token ids of the recurring prompts (one shared system prefix), one-off prompts, and follow-ups.

    A one-off prompt gets one follow-up turn with probability ``followup``, a few requests later: its
    whole first turn plus a new tail (the first turn's blocks are then found in a tier and moved to
    the GPU, which is what makes the GPU tiers churn). Nothing else ever comes back.
    """

    def __init__(self, config: SoakConfig, block_size: int, rng: random.Random) -> None:
        self.config = config
        self.block_size = block_size
        self.rng = rng
        self.system = [rng.randrange(1, 50_000) for _ in range(config.system_blocks * block_size)]
        self.pending: list[tuple[int, list[int]]] = []  # (due at request n, first turn)
        self.n = 0

    def _fresh(self, blocks: int) -> list[int]:
        return [self.rng.randrange(1, 50_000) for _ in range(blocks * self.block_size)]

    def next(self, recurring: bool) -> tuple[str, list[int]]:
        self.n += 1
        tail = self._fresh(self.config.tail_blocks)
        if recurring:
            return "recurring", self.system + tail
        if self.pending and self.pending[0][0] <= self.n:
            _due, first = self.pending.pop(0)
            return "follow-up", first + tail[: self.config.followup_blocks * self.block_size]
        prompt = self._fresh(self.config.system_blocks) + tail
        if self.rng.random() < self.config.followup:
            self.pending.append((self.n + self.rng.randrange(2, 8), prompt))
        return "one-off", prompt


class _Outcomes:
    """Decisions and transfer results, by request id, as they arrive (one consumer for the run)."""

    def __init__(self) -> None:
        self.decisions: dict[str, Decision] = {}
        self.results: dict[str, list[TransferResult]] = {}
        self.waiters: dict[str, asyncio.Event] = {}
        self.ready = asyncio.Event()

    async def follow(self, url: BrokerUrl, stop: asyncio.Event) -> None:
        consumer = make_consumer(url, DECISIONS, TRANSFER_RESULTS, client_id=f"soak-{uuid.uuid4().hex[:6]}",
                                 auto_offset_reset="latest")
        await consumer.start()
        await _at_end(consumer)
        self.ready.set()
        try:
            while not stop.is_set():
                for tp, records in (await consumer.getmany(timeout_ms=100)).items():
                    for rec in records:
                        topic = DECISIONS if tp.topic == DECISIONS.name else TRANSFER_RESULTS
                        try:
                            value = codec.decode(topic, rec.value)
                        except Exception:  # noqa: BLE001 - not ours to judge here
                            continue
                        if isinstance(value, Decision):
                            prior = self.decisions.get(value.request_id)
                            if prior is None or value.revision >= prior.revision:
                                self.decisions[value.request_id] = value
                            rid = value.request_id
                        elif isinstance(value, TransferResult):
                            self.results.setdefault(value.request_id, []).append(value)
                            rid = value.request_id
                        else:
                            continue
                        ev = self.waiters.get(rid)
                        if ev is not None:
                            ev.set()
        finally:
            await consumer.stop()

    async def wait(self, rid: str, check, timeout_s: float):
        ev = self.waiters.setdefault(rid, asyncio.Event())
        deadline = time.monotonic() + timeout_s
        try:
            while (found := check()) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                ev.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(ev.wait(), left)
            return found
        finally:
            self.waiters.pop(rid, None)

    def forget(self, rid: str) -> None:
        self.decisions.pop(rid, None)
        self.results.pop(rid, None)


class _Engine:
    """One engine worker of this process: its tiers under a tier manager, on the bus."""

    def __init__(self, name: str, url: BrokerUrl, root: Path, config: SoakConfig, descriptor: StateDescriptor,
                 block_bytes: int) -> None:
        self.name = name
        self.descriptor = descriptor
        self.block_bytes = block_bytes
        backends = [DeviceMemoryBackend(config.gpu_blocks * block_bytes, label=f"{name}-gpu"),
                    HostMemoryBackend(config.host_blocks * block_bytes, label=f"{name}-host", pin=False),
                    DiskBackend(root / "tiers" / name / "disk", config.disk_blocks * block_bytes,
                                label=f"{name}-disk")]
        self.catalog = BackendCatalog(name, backends)
        holder: list[TierBus] = []
        model = shipped_cost_model()
        gains = cost_model_gains(lambda: model, {descriptor.descriptor_id: descriptor}.get, profile=PROFILE,
                                 tiers=(Tier.GPU, Tier.HOST, Tier.DISK))
        self.manager = TierManager(self.catalog, facts=TierFacts(name, lambda b: holder[0].publish_batch(b)),
                                   reuse=ReuseModel(config.half_life_s), gains=gains)
        self.executor = TransferExecutor(self.catalog, tiers=self.manager)
        self.bus = TierBus(url, self.manager, worker=name, executor=self.executor, state_interval_s=1.0)
        holder.append(self.bus)
        self.transfers = TransferService(url, self.executor, worker=name)
        self.written = Counter()  # blocks written per tier name (saves and copies)


def _blocks(tokens: list[int], keys: list[int], d: StateDescriptor, identity: PublisherIdentity,
            fill: int) -> list[SaveBlock]:
    bs = d.block_size
    nbytes = extent_bytes(d, 1)
    out = []
    for i, key in enumerate(keys):
        data = torch.full((nbytes,), (key + fill) % 251, dtype=torch.uint8)
        ident = BlockIdentity(identity, tuple(tokens[i * bs:(i + 1) * bs]), bs, parent=keys[i - 1] if i else None)
        out.append(SaveBlock(PayloadKey(d.descriptor_id, key, 0), data, ident, position=i))
    return out


async def _engine_loop(engine: _Engine, config: SoakConfig, outcomes: _Outcomes, producer, result: SoakResult,
                       stop: asyncio.Event, rng: random.Random, system_keys: set[int]) -> None:
    d = engine.descriptor
    scope = IdentityScope.of(d)
    keyer = BlockKeyer(scope, d.block_size)
    identity = PublisherIdentity(tenant_namespace=TENANT, model=d.model, model_revision=d.model_revision,
                                 tokenizer_revision=d.tokenizer_revision, descriptor_id=d.descriptor_id,
                                 engine_family="soak")
    prompts = _Prompts(config, d.block_size, rng)
    system_keys.update(keyer.keys(prompts.system))
    n = 0
    while not stop.is_set():
        n += 1
        t0 = time.monotonic()
        kind, tokens = prompts.next(rng.random() < config.recurring)
        recurring = kind == "recurring"
        keys = keyer.keys(tokens)
        rid = f"{engine.name}-{n}"
        request = PlanRequest(request_id=rid, scope=scope, block_size=d.block_size, prompt_tokens=len(tokens),
                              keys=tuple(keys), arrival_at=time.time(), descriptor=d,
                              candidates=(WorkerLoad(worker=engine.name, profile=PROFILE,
                                                     queued_prefill_tokens=rng.choice((0, 0, 20_000))),))
        await send(producer, PLAN_REQUESTS, rid, request)
        decision = await outcomes.wait(rid, lambda rid=rid: outcomes.decisions.get(rid), 60.0)
        result.requests[kind] += 1
        if decision is None:
            result.actions["no-decision"] += 1
            continue
        result.actions[decision.action.value] += 1
        if decision.action in (Action.TRANSFER, Action.PREFETCH):
            got = await outcomes.wait(rid, lambda rid=rid: (outcomes.results.get(rid) or None), 30.0)
            for r in got or []:
                result.transfers[r.status.value] += 1
                if r.status is TransferStatus.COMPLETED:
                    engine.written["gpu"] += r.blocks_moved
        elif decision.action in (Action.FULL_REUSE, Action.PARTIAL_REUSE):
            engine.manager.touch([PayloadKey(d.descriptor_id, k, 0) for k in keys[:decision.reused_blocks]])
        if recurring:
            result.recurring_requests += 1
            # Found: the planner matched the whole shared prefix in a tier (the decision or an option it
            # weighed reuses it). Whether loading it pays is the cost model's call, which on a loaded
            # machine can rightly say recompute (a host copy measured slower than a short prefill).
            found = max([decision.reused_blocks, *(a.reused_blocks for a in decision.alternatives)])
            result.recurring_hits += found >= config.system_blocks
            result.recurring_reused += decision.reused_blocks >= config.system_blocks
            if found < config.system_blocks:
                result.recurring_misses[f"{decision.action.value}: {decision.reason[:100]}"] += 1
        # The prefill is done: the engine offloads the prompt's blocks, as a connector does.
        out = await asyncio.to_thread(engine.manager.save, _blocks(tokens, keys, d, identity, n), Tier.HOST,
                                      tenant=TENANT)
        result.saves["saved"] += out.saved
        result.saves["already"] += out.already
        result.saves["refused"] += out.refused
        result.saves["failed"] += out.failed
        engine.written["host"] += out.saved
        for why in out.reasons:
            result.refusal_reasons[why.split(": ", 1)[-1][:80]] += 1
        outcomes.forget(rid)
        await asyncio.sleep(max(0.0, 1.0 / config.engine_rate_per_s - (time.monotonic() - t0)))


class _RemoteLoad:
    """Worker soak-w0's load: prompts saved to the shared remote tier and offered to its owner (the
    remote-tier manager ``up`` runs, which admits, evicts and announces them), then planned for soak-w0."""

    def __init__(self, remote: RemoteBackend, config: SoakConfig, d: StateDescriptor, rng: random.Random) -> None:
        self.remote = remote
        self.config = config
        self.d = d
        self.rng = rng
        self.scope = IdentityScope.of(d)
        self.keyer = BlockKeyer(self.scope, d.block_size)
        self.identity = PublisherIdentity(tenant_namespace=TENANT, model=d.model, model_revision=d.model_revision,
                                          tokenizer_revision=d.tokenizer_revision, descriptor_id=d.descriptor_id,
                                          engine_family="soak")
        self.writer = "soak-remote-writer"
        self.signer = ControlSigner.from_env(f"writer/{self.writer}")  # offers are signed control records

    async def run(self, outcomes: _Outcomes, producer, result: SoakResult, stop: asyncio.Event) -> None:
        prompts = _Prompts(self.config, self.d.block_size, self.rng)
        n = 0
        while not stop.is_set():
            n += 1
            t0 = time.monotonic()
            _kind, tokens = prompts.next(self.rng.random() < self.config.recurring)
            keys = self.keyer.keys(tokens)
            # The whole prompt is offered (what the store holds already is not written again): the
            # owner may have evicted any part of it, and counts what it still holds as a use.
            save = await asyncio.to_thread(save_and_offer, self.remote, _blocks(tokens, keys, self.d, self.identity, 0),
                                           writer=self.writer, tenant=TENANT, identity=self.identity,
                                           block_size=self.d.block_size, offer_id=f"{self.writer}-{n}",
                                           now=time.time())
            result.remote_saves["written"] += save.written
            result.remote_saves["failed"] += save.failed
            for why in save.reasons:
                result.refusal_reasons[f"remote: {why.split(': ', 1)[-1][:80]}"] += 1
            for offer in save.offers:
                await send(producer, *route(offer), offer, control=self.signer)
            await asyncio.sleep(0.2)  # the index applies the facts
            rid = f"{W0}-{n}"
            request = PlanRequest(request_id=rid, scope=self.scope, block_size=self.d.block_size,
                                  prompt_tokens=len(tokens), keys=tuple(keys), arrival_at=time.time(),
                                  descriptor=self.d, candidates=(WorkerLoad(worker=W0, profile=PROFILE,
                                                                            queued_prefill_tokens=20_000),))
            await send(producer, PLAN_REQUESTS, rid, request)
            decision = await outcomes.wait(rid, lambda rid=rid: outcomes.decisions.get(rid), 60.0)
            result.requests["w0"] += 1
            if decision is not None:
                result.actions[f"w0:{decision.action.value}"] += 1
                if decision.action in (Action.TRANSFER, Action.PREFETCH):
                    got = await outcomes.wait(rid, lambda rid=rid: (outcomes.results.get(rid) or None), 30.0)
                    for r in got or []:
                        result.transfers[f"w0:{r.status.value}"] += 1
            outcomes.forget(rid)
            await asyncio.sleep(max(0.0, 1.0 / self.config.w0_rate_per_s - (time.monotonic() - t0)))


class _States:
    """The latest nexuskv.tier-state record per worker and tier; capacity checked on every record."""

    def __init__(self, result: SoakResult) -> None:
        self.latest: dict[str, TierStateRecord] = {}
        self.result = result
        self.ready = asyncio.Event()

    async def follow(self, url: BrokerUrl, stop: asyncio.Event) -> None:
        consumer = make_consumer(url, TIER_STATE, client_id=f"soak-states-{uuid.uuid4().hex[:6]}",
                                 auto_offset_reset="latest")
        await consumer.start()
        await _at_end(consumer)
        self.ready.set()
        try:
            while not stop.is_set():
                for records in (await consumer.getmany(timeout_ms=200)).values():
                    for rec in records:
                        try:
                            r = codec.decode(TIER_STATE, rec.value)
                        except Exception:  # noqa: BLE001
                            continue
                        self.latest[r.key] = r  # type: ignore[attr-defined]
                        if r.used_bytes + r.reserved_bytes > r.capacity_bytes:  # type: ignore[attr-defined]
                            self.result.capacity_violations.append(
                                f"{r.key}: {r.used_bytes} used + {r.reserved_bytes} reserved > {r.capacity_bytes}")
        finally:
            await consumer.stop()


async def _at_end(consumer, timeout_s: float = 60.0) -> None:
    """Wait until a group-less consumer holds its partitions, positioned at their ends."""
    deadline = time.monotonic() + timeout_s
    while not consumer.assignment():
        if time.monotonic() > deadline:
            raise RuntimeError("a soak consumer got no partitions")
        await asyncio.sleep(0.05)
    tps = list(consumer.assignment())
    await consumer.seek_to_end(*tps)
    for tp in tps:
        await consumer.position(tp)


def _rss_mib(proc: psutil.Process) -> float:
    try:
        return proc.memory_info().rss / (1 << 20)
    except psutil.Error:
        return float("nan")


def _classify_drops(manager: TierManager, seen: int, system_keys: set[int], result: SoakResult) -> int:
    """Count the manager's drops since ``seen`` (its running total) as recurring or one-off blocks."""
    total = manager.counters["blocks_dropped"]
    fresh = list(manager.drops)[-(total - seen):] if total > seen else []
    for _t, key, _tier, _why in fresh:
        if key.key in system_keys:
            result.evicted_recurring += 1
        else:
            result.evicted_one_off += 1
    return total


def _service_processes(up: subprocess.Popen) -> dict[str, psutil.Process]:
    """``nexuskv up`` and every process under it, by the module it runs (or its title: Faust renames
    its workers' processes)."""
    out = {"nexuskv-up": psutil.Process(up.pid)}
    for child in psutil.Process(up.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmd = child.cmdline()
            if "-m" in cmd:
                name = cmd[cmd.index("-m") + 1]
            elif cmd and cmd[0].startswith("[Faust"):
                name = next((f"faust {w}" for w in cmd if w.startswith("nexuskv-")), "faust worker")
            else:
                name = Path(cmd[0]).name if cmd else child.name()  # mooncake_master, mooncake_client
            out[name if name not in out else f"{name} ({child.pid})"] = child
    return out


def _facts_by_publisher(replica: IndexReplica) -> dict[str, dict[tuple[Tier, int], set[int]]]:
    out: dict[str, dict[tuple[Tier, int], set[int]]] = {}
    for (pub, tier, group), members in replica.index.facts().items():
        if members:
            out.setdefault(pub, {})[(tier, group)] = {k for _scope, k in members}
    return out


def _held(manager: TierManager) -> dict[tuple[Tier, int], set[int]]:
    out: dict[tuple[Tier, int], set[int]] = {}
    for b in manager.backends():
        for k in b.keys():
            out.setdefault((b.capabilities.tier, k.group), set()).add(k.key)
    return out


async def run_soak(config: SoakConfig, url: BrokerUrl, work: Path) -> SoakResult:
    """Run ``nexuskv up`` on ``url`` with the load above for ``config.duration_s``; check and report."""
    result = SoakResult()
    d = _descriptor(config.layers)
    block_bytes = extent_bytes(d, 1)
    data_dir = work / "up"
    env = dict(os.environ, NEXUSKV_BROKER=str(url), NEXUSKV_DATA_DIR=str(data_dir), NEXUSKV_WORKER=W0,
               NEXUSKV_TIER_DEVICE_BYTES=str(config.gpu_blocks * block_bytes),
               NEXUSKV_TIER_HOST_BYTES=str(config.host_blocks * block_bytes),
               NEXUSKV_TIER_DISK_BYTES=str(config.disk_blocks * block_bytes),
               NEXUSKV_REMOTE_TIER_BYTES=str(max(32 << 20, 2 * config.remote_blocks * (block_bytes + 4096))),
               NEXUSKV_TIER_REUSE_HALF_LIFE=str(config.half_life_s), NEXUSKV_TIER_STATE_INTERVAL="1.0",
               NEXUSKV_INDEX_API_PORT=str(_free_port()), NEXUSKV_LOG_LEVEL="INFO",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    from streams.remote_tier import local_address

    remote_addr = local_address()
    env["NEXUSKV_REMOTE_TIER"] = remote_addr
    up_log = (work / "up.out").open("w")
    up = subprocess.Popen([sys.executable, "-m", "streams.app.cli", "up"], env=env, stdout=up_log,
                          stderr=subprocess.STDOUT, start_new_session=True)
    engines: list[_Engine] = []
    stop = asyncio.Event()
    tasks: list[asyncio.Task] = []
    producer = make_producer(url, client_id="soak-load")
    try:
        remote = await asyncio.to_thread(RemoteBackend.connect, remote_addr, wait_s=60.0, label="soak-remote")
        await _wait_for_services(data_dir, up, 90.0)
        await producer.start()
        outcomes, states = _Outcomes(), _States(result)
        tasks += [asyncio.create_task(outcomes.follow(url, stop)), asyncio.create_task(states.follow(url, stop))]
        await asyncio.wait_for(asyncio.gather(outcomes.ready.wait(), states.ready.wait()), 60.0)
        for i in range(config.engines):
            e = _Engine(f"soak-e{i}", url, work, config, d, block_bytes)
            engines.append(e)
            tasks += [asyncio.create_task(e.bus.run(stop)), asyncio.create_task(e.transfers.run(stop))]
        await asyncio.wait_for(asyncio.gather(*(e.bus.ready.wait() for e in engines),
                                              *(e.transfers.ready.wait() for e in engines)), 90.0)
        await asyncio.sleep(2.0)  # the planner's index replica and groups settle
        procs = _service_processes(up)
        rss: dict[str, list[tuple[float, float]]] = {name: [] for name in procs}
        rss["soak (engines)"] = []
        me = psutil.Process()
        system_keys: set[int] = set()
        done = asyncio.Event()  # the load stops first; the services after the last facts went out
        load = [asyncio.create_task(_engine_loop(e, config, outcomes, producer, result, done, random.Random(
            config.seed + i), system_keys)) for i, e in enumerate(engines)]
        load.append(asyncio.create_task(_RemoteLoad(remote, config, d, random.Random(config.seed + 99)).run(
            outcomes, producer, result, done)))
        seen_drops = {e.name: 0 for e in engines}
        t0 = time.monotonic()
        while time.monotonic() - t0 < config.duration_s:
            await asyncio.sleep(config.sample_s)
            t = time.monotonic() - t0
            for name, p in procs.items():
                rss[name].append((t, _rss_mib(p)))
            rss["soak (engines)"].append((t, _rss_mib(me)))
            for e in engines:
                for u in e.manager.usage():
                    if u.used_bytes + u.reserved_bytes > u.capacity_bytes:
                        result.capacity_violations.append(f"{e.name}/{u.tier.value}: {u.used_bytes} + "
                                                          f"{u.reserved_bytes} > {u.capacity_bytes}")
                seen_drops[e.name] = _classify_drops(e.manager, seen_drops[e.name], system_keys, result)
            for task in load + tasks:
                if task.done() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            if config.out is not None:
                print(f"[{t:6.0f}s] requests {dict(result.requests)} saves {dict(result.saves)} "
                      f"hit {result.recurring_hit_rate:.2f} actions {dict(result.actions)} "
                      f"transfers {dict(result.transfers)}", flush=True)
        done.set()
        await asyncio.gather(*load, return_exceptions=True)
        result.duration_s = time.monotonic() - t0
        # Quiesce: collect what no one can find, flush every publisher, let the buses send it.
        await asyncio.sleep(2.0)
        for e in engines:
            await asyncio.to_thread(e.manager.tick)
            seen_drops[e.name] = _classify_drops(e.manager, seen_drops[e.name], system_keys, result)
            e.manager.flush()
        await asyncio.sleep(3.0)
        for name, p in procs.items():
            result.alive[name] = p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        for name, series in rss.items():
            values = [v for _t, v in series if not math.isnan(v)]
            if len(values) < 3:
                continue
            third = max(1, len(values) // 3)
            first, last = max(values[:third]), max(values[-third:])
            result.rss_mib[name] = {"first_third_max": round(first, 1), "last_third_max": round(last, 1),
                                    "max": round(max(values), 1)}
            result.rss_bounded[name] = last <= first * (1 + config.rss_growth) + 48
        for e in engines:
            result.counters[e.name] = dict(e.manager.counters)
            for tier, n in e.written.items():
                cap = {"gpu": config.gpu_blocks, "host": config.host_blocks}[tier]
                result.overfill[f"{e.name}/{tier}"] = round(n / cap, 1)
            demoted = e.manager.counters["demoted"]  # each demotion lands one block one tier down
            result.overfill[f"{e.name}/demotions per host+disk block"] = round(
                demoted / (config.host_blocks + config.disk_blocks), 1)
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await producer.stop()
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                up.wait(60)
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(10)
        up_log.close()
    # The index, rebuilt from the log, against what every tier manager's tiers hold.
    replica = IndexReplica(url, client_id=f"soak-audit-{uuid.uuid4().hex[:6]}")
    await replica.start(timeout_s=60.0)
    try:
        await replica.wait_caught_up(timeout_s=120.0)
        facts = _facts_by_publisher(replica)
    finally:
        await replica.stop()
    for e in engines:
        held, mine = _held(e.manager), {k: {x.key for x in v} for k, v in e.manager.contents().items()}
        indexed = facts.get(e.name, {})
        result.index_equal[e.name] = held == mine == indexed
        result.index_detail[e.name] = {f"{t.value}/g{g}": {"held": len(held.get((t, g), ())),
                                                           "announced": len(mine.get((t, g), ())),
                                                           "indexed": len(indexed.get((t, g), ()))}
                                       for (t, g) in sorted(set(held) | set(indexed), key=lambda x: x[0].value)}

    audit_path = data_dir / "tiers" / W0 / "audit.json"
    if audit_path.exists():
        audit = json.loads(audit_path.read_text())
        indexed = {f"{t.value}/g{g}": sorted(f"{d.descriptor_id}/{k:032x}" for k in keys)
                   for (t, g), keys in facts.get(W0, {}).items()}
        agree = all(v == [0, 0] for v in audit["ledger_vs_tiers"].values())
        n_announced = sum(len(v) for v in audit["contents"].values())
        n_indexed = sum(len(v) for v in indexed.values())
        result.index_equal[W0] = agree and indexed == audit["contents"]
        result.index_detail[W0] = {"announced": n_announced, "indexed": n_indexed, "held": audit["held_blocks"],
                                   "ledger_vs_tiers": audit["ledger_vs_tiers"]}
        result.counters[W0] = audit["counters"]
        result.w0_states = {u["tier"]: {k: u[k] for k in ("capacity_bytes", "used_bytes", "reserved_bytes",
                                                            "pinned_bytes", "blocks", "price_s_per_gib")}
                            for u in audit["usage"]}
        landed = audit["counters"].get("landed", 0)
        result.overfill[f"{W0}/gpu"] = round(landed / config.gpu_blocks, 1)
    else:
        result.index_equal[W0] = False
        result.index_detail[W0] = {"error": f"{audit_path} was not written"}
    owner_audit = data_dir / "tiers" / REMOTE_OWNER / "audit.json"
    if owner_audit.exists():
        audit = json.loads(owner_audit.read_text())
        indexed = {f"{t.value}/g{g}": sorted(f"{d.descriptor_id}/{k:032x}" for k in keys)
                   for (t, g), keys in facts.get(REMOTE_OWNER, {}).items()}
        result.index_equal[REMOTE_OWNER] = audit["ledger_vs_store"] == [0, 0] and indexed == audit["contents"]
        result.index_detail[REMOTE_OWNER] = {"announced": sum(len(v) for v in audit["contents"].values()),
                                             "indexed": sum(len(v) for v in indexed.values()),
                                             "ledger_vs_store": audit["ledger_vs_store"]}
        result.counters[REMOTE_OWNER] = {**audit["counters"], **{f"store_{k}": v
                                                                 for k, v in audit["store_counters"].items()}}
    else:
        result.index_equal[REMOTE_OWNER] = False
        result.index_detail[REMOTE_OWNER] = {"error": f"{owner_audit} was not written"}
    for log in (data_dir / "logs").glob("*.log"):
        text = log.read_text(errors="replace")
        result.tracebacks[log.stem] = text.count("Traceback (most recent call last)")
    result.alive["nexuskv-up (until stopped)"] = up.returncode in (0, -signal.SIGINT, 130) or result.alive.get(
        "nexuskv-up", False)
    return result


def _free_port() -> int:
    from streams.bus.process import free_port

    return free_port()


async def _wait_for_services(data_dir: Path, up: subprocess.Popen, timeout_s: float) -> None:
    """Until every service logged that it serves (the tier manager's tiers, the planner's policy)."""
    deadline = time.monotonic() + timeout_s
    marks = {"tier-manager.log": "tier disk:", "planner.log": "serving with policy",
             "remote-tier-manager.log": f"owner {REMOTE_OWNER}"}
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise RuntimeError(f"nexuskv up exited with {up.returncode}")
        logs = data_dir / "logs"
        if all((logs / f).exists() and m in (logs / f).read_text(errors="replace") for f, m in marks.items()):
            return
        await asyncio.sleep(0.5)
    raise RuntimeError("nexuskv up's services did not start in time")


def _plain(value):
    """JSON-ready: mapping keys as strings, all the way down."""
    if isinstance(value, dict):
        return {(k if isinstance(k, str) else "/".join(map(str, k)) if isinstance(k, tuple) else str(k)): _plain(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "soak_tiers.json")
    ap.add_argument("--work", type=Path, default=None, help="folder for the run (default: a temporary one)")
    args = ap.parse_args(argv)
    config = SoakConfig(duration_s=args.minutes * 60, engines=args.engines, out=args.out)
    work = args.work or Path(tempfile.mkdtemp(prefix="nexuskv-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    override = os.environ.get("NEXUSKV_BROKER")

    async def go(url: BrokerUrl) -> SoakResult:
        # Ctrl-C or SIGTERM cancels the run, whose cleanup stops nexuskv up and the engines.
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)  # type: ignore[union-attr]
        return await run_soak(config, url, work)

    if override:
        result = asyncio.run(go(parse_broker_url(override)))
    else:
        from streams.bus.broker import ApacheKafkaBroker

        (work / "kafka").mkdir(parents=True, exist_ok=True)
        with ApacheKafkaBroker(work_dir=work / "kafka") as broker:
            from streams.bus.topics import ensure_topics

            asyncio.run(ensure_topics(broker.url, partitions=4))
            result = asyncio.run(go(broker.url))
    doc = result.as_dict()
    doc.update({"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
                "work": str(work)})
    doc = _plain(doc)
    command = f"python -m benchmarks.soak_tiers --minutes {args.minutes:g}"
    if args.engines != 2:
        command += f" --engines {args.engines}"
    # The figure is the number of checks that failed; its baseline is the goal, every check held.
    write_result(args.out.stem, "soak checks failed, nexuskv up under tier overfill", "checks",
                 [Run(float(len(doc["failures"])), 0.0)], "every check held (the goal)", command,
                 details=doc, results_dir=args.out.parent)
    print(json.dumps({k: doc[k] for k in ("failures", "recurring_hit_rate", "saves", "transfers", "overfill",
                                          "index_equal", "rss_mib")}, indent=1, default=str))
    return 0 if not doc["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
