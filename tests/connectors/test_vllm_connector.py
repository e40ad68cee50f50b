"""The vLLM connector's core, driven by the reference engine playing vLLM's engine.

Acceptance: blocks saved through the data plane are loaded into the engine's paged KV on the
planner's decision, and the prefill with loaded state gives the same logits as recompute (fp32,
1e-5) — through the worker's disk and across workers through the shared remote tier; a corrupt
or vanished payload is a load error that recomputes; ``get_num_new_matched_tokens`` answers only
what the planner decided (0 when moving is slower than recomputing, ``None`` while the index
lags, ``load_async`` only with a positive count); and the connector's vLLM block hashes equal
engines.md §2.2.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from connectors.vllm.connector_core import ConnectorMeta, Readable, SchedulerSide, WorkerSide, catalog_probe
from connectors.vllm.standin import VllmStandIn
from nexuskv.dataplane import BackendCatalog, DiskBackend, RemoteBackend
from nexuskv.dataplane.payload import PayloadKey
from nexuskv.descriptor import Tier
from nexuskv.errors import ConfigError
from nexuskv.lookup import LookupResult
from nexuskv.reference_engine import ReferenceModelSpec, ReferenceEngine, TinyModel, engine_hashes
from tests.connectors.reference import POLICY, PROFILE, IndexFeed, cost_model, slow_links

TOL = 1e-5
SPECS = {"gqa": ReferenceModelSpec.gqa(), "mla": ReferenceModelSpec.mla()}
MODELS = {name: TinyModel(spec) for name, spec in SPECS.items()}
PROMPT = torch.randint(0, 256, (26,), generator=torch.Generator().manual_seed(5)).tolist()  # 6 full blocks of 4


def _reference_logits(name: str, tokens=PROMPT) -> torch.Tensor:
    return ReferenceEngine(SPECS[name], model=MODELS[name]).prefill(tokens, reuse=False).logits


class _World:
    """Runtimes of one deployment: a shared index, each worker's disk, an optional shared remote tier."""

    def __init__(self, name: str, tmp_path, *, remote: str | None = None, model=None, load_async: bool = False,
                 save_tier: Tier = Tier.DISK, clock=None) -> None:
        self.name, self.tmp, self.remote = name, tmp_path, remote
        self.feed = IndexFeed()
        self.model = model
        self.load_async, self.save_tier, self.clock = load_async, save_tier, clock
        self.engines: list[VllmStandIn] = []

    def engine(self, worker: str, index=None) -> VllmStandIn:
        rt = ReferenceEngine(SPECS[self.name], model=MODELS[self.name], worker=worker, publisher=self.feed)
        backends = [DiskBackend(self.tmp / worker, 1 << 24)]
        shared: frozenset[Tier] = frozenset()
        if self.remote is not None:
            backends.append(RemoteBackend(self.remote))
            shared = frozenset({Tier.REMOTE})
        catalog = BackendCatalog(rt.publisher_id, backends)
        model = self.model or cost_model(rt.descriptor)
        kw = {} if self.clock is None else {"clock": self.clock}
        sched = SchedulerSide(rt.descriptor, worker=rt.publisher_id, index=index or self.feed.index,
                              model=lambda: model, execution=lambda: POLICY, profile=PROFILE,
                              readable=Readable(rt.publisher_id, own=frozenset({Tier.DISK}), shared=shared),
                              engine_hashes=lambda toks: engine_hashes(toks, rt.block_size),
                              probe=catalog_probe(catalog), save_tier=self.save_tier, load_async=self.load_async,
                              **kw)
        engine = VllmStandIn(rt, sched, WorkerSide(rt.descriptor, catalog))
        self.engines.append(engine)
        return engine

    def close(self) -> None:
        for e in self.engines:
            e.worker.close()


@pytest.fixture
def world(tmp_path):
    made: list[_World] = []

    def make(name: str, **kw) -> _World:
        w = _World(name, tmp_path, **kw)
        made.append(w)
        return w
    yield make
    for w in made:
        w.close()


def _saved_then_cleared(world, name: str = "gqa", **kw) -> VllmStandIn:
    """An engine that served PROMPT once (its blocks saved to its disk), then lost its GPU cache."""
    engine = world(name, **kw).engine("w-a")
    engine.serve("r1", PROMPT)
    engine.runtime.reset()
    return engine


def _disk_payload(engine: VllmStandIn, block: int) -> tuple[DiskBackend, PayloadKey]:
    return engine.worker.catalog.backends[0], PayloadKey(engine.runtime.descriptor.descriptor_id,
                                                         engine.runtime.block_keys(PROMPT)[block])


@pytest.mark.parametrize("name", SPECS)
def test_saved_blocks_load_from_disk_and_prefill_equals_recompute(world, name):
    w = world(name)
    engine = w.engine("w-a")
    first = engine.serve("r1", PROMPT)
    assert first.matched_tokens == 0 and first.saved_requests == 1
    assert engine.scheduler.stats["saves_announced"] == 6  # every full block is on disk, and the index knows
    engine.runtime.reset()  # the GPU cache is gone; the disk copies stay
    again = engine.serve("r2", PROMPT)
    assert again.computed_tokens == 0
    assert again.matched_tokens == 24 and again.loaded_tokens == 24 and again.failed_blocks == 0
    assert again.result.reused_tokens == 24 and again.result.computed_tokens == 2
    assert (again.result.logits - _reference_logits(name)).abs().max().item() <= TOL
    assert engine.worker.stats["blocks_loaded"] == 6
    reason = engine.scheduler.decision_reason("r2")
    assert reason is None  # the request finished and was forgotten
    assert again.saved_requests == 0  # the disk already held every block: nothing written twice


def test_loads_start_after_the_engines_own_prefix(world):
    w = world("gqa")
    engine = w.engine("w-a")
    engine.serve("r1", PROMPT)
    engine.runtime.reset()
    engine.runtime.prefill(PROMPT[:9])  # the engine's own pages hold blocks 0-1 again
    served = engine.serve("r2", PROMPT)
    assert served.computed_tokens == 8
    assert served.matched_tokens == 16 and served.result.reused_tokens == 24
    assert (served.result.logits - _reference_logits("gqa")).abs().max().item() <= TOL


def test_another_worker_loads_through_the_shared_remote_tier(world, remote_tier_address):
    w = world("gqa", remote=remote_tier_address, save_tier=Tier.REMOTE)
    writer, reader = w.engine("w-a"), w.engine("w-b")
    prompt = [(t + 7) % 256 for t in PROMPT]  # not shared with other tests on the session's remote tier
    writer.serve("r1", prompt)
    served = reader.serve("r2", prompt)
    assert served.matched_tokens == 24 and served.loaded_tokens == 24
    assert (served.result.logits - _reference_logits("gqa", prompt)).abs().max().item() <= TOL


def test_a_corrupt_payload_is_a_load_error_and_recomputes_from_there(world):
    engine = _saved_then_cleared(world)
    disk, victim = _disk_payload(engine, 3)
    path = disk.path(victim)
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    served = engine.serve("r2", PROMPT)
    assert served.matched_tokens == 24
    assert served.loaded_tokens == 12 and served.failed_blocks == 3  # blocks 3, 4 and 5 recompute
    assert served.result.reused_tokens == 12
    assert (served.result.logits - _reference_logits("gqa")).abs().max().item() <= TOL
    assert engine.worker.stats["blocks_failed"] == 3


def test_a_vanished_payload_is_a_load_error(world):
    engine = _saved_then_cleared(world)
    disk, victim = _disk_payload(engine, 0)
    assert disk.delete(victim)
    served = engine.serve("r2", PROMPT)  # the index still says the disk holds it
    assert served.matched_tokens == 24 and served.loaded_tokens == 0 and served.failed_blocks == 6
    assert (served.result.logits - _reference_logits("gqa")).abs().max().item() <= TOL


def test_no_tokens_when_moving_is_slower_than_recomputing(world):
    engine = _saved_then_cleared(world)
    slow = slow_links(engine.runtime.descriptor)
    engine.scheduler.model = lambda: slow
    served = engine.serve("r2", PROMPT)
    assert served.matched_tokens == 0 and served.result.reused_tokens == 0
    assert engine.scheduler.stats["matched_tokens"] == 0


def test_async_loads_are_reported_by_get_finished(world):
    engine = _saved_then_cleared(world, "mla", load_async=True)
    served = engine.serve("r2", PROMPT)
    assert served.load_async and served.matched_tokens == 24 and served.loaded_tokens == 24
    assert (served.result.logits - _reference_logits("mla")).abs().max().item() <= TOL
    assert engine.scheduler.stats["loads_finished"] == 1


class _Lagging:
    """An index view whose answers are ``lag_ms`` old."""

    def __init__(self, index, lag_ms: float) -> None:
        self.index, self.lag_ms = index, lag_ms

    def lookup(self, scope, keys) -> LookupResult:
        return dataclasses.replace(self.index.lookup(scope, keys), lag_events=3, lag_ms=self.lag_ms)


def test_undecided_while_the_index_lags_then_no_movement_on_old_facts(world):
    now = [1000.0]
    w = world("gqa", clock=lambda: now[0])
    engine = w.engine("w-a")
    engine.serve("r1", PROMPT)
    engine.runtime.reset()
    sched = engine.scheduler
    sched.index = _Lagging(w.feed.index, lag_ms=5000.0)
    assert sched.num_new_matched_tokens("r2", PROMPT, 0) == (None, False)
    assert sched.num_new_matched_tokens("r2", PROMPT, 0) == (None, False)  # side-effect free, repeatable
    assert sched.build_meta() == ConnectorMeta()
    now[0] += 1.0  # past decide_wait_s: decide with what there is; the planner moves nothing on old facts
    assert sched.num_new_matched_tokens("r2", PROMPT, 0) == (0, False)
    sched.index = w.feed.index
    assert sched.num_new_matched_tokens("r2", PROMPT, 0) == (24, False)
    assert sched.num_new_matched_tokens("r2", PROMPT, 0) == (24, False)
    assert sched.decision_reason("r2").startswith("transfer on nexuskv-reference/w-a from nexuskv-reference/w-a/disk")
    assert sched.build_meta() == ConnectorMeta()  # asking queues nothing; only an allocation does


def test_an_allocation_that_does_not_match_the_decision_fails_its_blocks(world):
    engine = _saved_then_cleared(world)
    sched, worker = engine.scheduler, engine.worker
    assert sched.num_new_matched_tokens("r2", PROMPT, 0)[0] == 24
    sched.update_state_after_alloc("r2", [10, 11, 12, 13, 14], 20)  # not what was decided
    meta = sched.build_meta()
    assert meta.loads[0].source is None
    worker.start_load(meta)
    worker.wait_for_layer_load("layers.0.attn")
    assert worker.block_ids_with_load_errors() == {10, 11, 12, 13, 14}
    assert worker.block_ids_with_load_errors() == set()  # reported once


def test_hybrid_state_is_refused_with_the_reason(tmp_path):
    rt = ReferenceEngine(ReferenceModelSpec.hybrid())
    with pytest.raises(ConfigError, match="hybrid models need SupportsHMA"):
        WorkerSide(rt.descriptor, BackendCatalog(rt.publisher_id, [DiskBackend(tmp_path, 1 << 20)]))


def test_registered_kv_caches_must_match_the_descriptor(tmp_path):
    rt = ReferenceEngine(SPECS["gqa"], model=MODELS["gqa"])
    worker = WorkerSide(rt.descriptor, BackendCatalog(rt.publisher_id, [DiskBackend(tmp_path, 1 << 20)]))
    caches = rt.kv_caches()
    caches.pop(next(iter(caches)))
    with pytest.raises(ConfigError, match="bytes per block"):
        worker.register_kv_caches(caches)
    worker.close()


def test_a_resumed_request_asks_with_its_output_tokens(world):
    engine = _saved_then_cleared(world)
    sched = engine.scheduler
    assert sched.num_new_matched_tokens("r2", PROMPT[:13], 0) == (12, False)
    assert sched.num_new_matched_tokens("r2", PROMPT, 0) == (24, False)  # keyed again, not a stale prefix
