"""The vLLM connector's two sides, driven by the reference runtime playing vLLM's engine.

Unit level (the real engine runs the same code in ``tests/engines/vllm/``). Acceptance: blocks
saved through the data plane are announced by the tier's own publisher and loaded into the
engine's paged KV on the planner's decision, and the prefill with loaded state gives the same
logits as recompute (fp32, 1e-5) — through the worker's disk and across workers through the shared
remote tier; the tier's facts survive the engine's GPU reset and a restart (a new worker side
re-announces them; nothing is written twice); a payload deleted behind the connector's back is not
offered (the tier is checked) and is saved again; a corrupt one is a load error that recomputes
and is announced removed; ``get_num_new_matched_tokens`` answers only what the planner decided
(0 when moving is slower than recomputing, ``None`` while the index lags, ``load_async`` only
with a positive count).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from connectors.vllm.meta import ConnectorMeta
from connectors.vllm.scheduler_side import Readable, Scheduled, SchedulerSide
from connectors.vllm.tier_publisher import TierPublisher, tier_publisher_name
from connectors.vllm.worker_side import WorkerSide, layout_of, tier_held
from nexuskv.contracts.decisions import Action
from nexuskv.dataplane import BackendCatalog, DiskBackend, RemoteBackend
from nexuskv.dataplane.payload import PayloadKey
from nexuskv.descriptor import Tier
from nexuskv.errors import ConfigError, TierUnavailableError
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.lookup import LookupResult
from nexuskv.reference_engine import ReferenceEngine, ReferenceModelSpec, TinyModel

from tests.connectors.reference import POLICY, PROFILE, IndexFeed, cost_model, slow_links
from tests.connectors.vllm_standin import VllmStandIn

TOL = 1e-5
SPECS = {"gqa": ReferenceModelSpec.gqa(), "mla": ReferenceModelSpec.mla()}
MODELS = {name: TinyModel(spec) for name, spec in SPECS.items()}
PROMPT = torch.randint(0, 256, (26,), generator=torch.Generator().manual_seed(5)).tolist()  # 6 full blocks of 4


def _reference_logits(name: str, tokens=PROMPT) -> torch.Tensor:
    return ReferenceEngine(SPECS[name], model=MODELS[name]).prefill(tokens, reuse=False).logits


class _World:
    """Runtimes of one deployment: a shared index, each worker's disk, an optional shared remote tier."""

    def __init__(self, name: str, tmp_path, *, remote: str | None = None, model=None, load_async: bool = False,
                 save_tier: Tier = Tier.DISK, clock=None, disk_bytes: int = 1 << 24) -> None:
        self.name, self.tmp, self.remote = name, tmp_path, remote
        self.disk_bytes = disk_bytes
        self.feed = IndexFeed()
        self.model = model
        self.load_async, self.save_tier, self.clock = load_async, save_tier, clock
        self.engines: list[VllmStandIn] = []
        self.decisions: list = []

    def engine(self, worker: str, index=None, incarnation: int = 0) -> VllmStandIn:
        rt = ReferenceEngine(SPECS[self.name], model=MODELS[self.name], worker=worker, publisher=self.feed,
                              incarnation=incarnation)
        root = self.tmp / worker / "disk"
        backends = [DiskBackend(root, self.disk_bytes)]
        shared: frozenset[Tier] = frozenset()
        if self.remote is not None:
            backends.append(RemoteBackend(self.remote))
            shared = frozenset({Tier.REMOTE})
        catalog = BackendCatalog(rt.publisher_id, backends)
        held = tier_held(catalog, root)
        model = self.model or cost_model(rt.descriptor)
        kw = {} if self.clock is None else {"clock": self.clock}
        sched = SchedulerSide(rt.descriptor, worker=rt.publisher_id, index=index or self.feed.index,
                              model=lambda: model, execution=lambda: POLICY, profile=PROFILE,
                              readable=Readable(rt.publisher_id, own=frozenset({Tier.DISK, Tier.REMOTE}), shared=shared),
                              probe=held, save_tier=self.save_tier, load_async=self.load_async,
                              on_decision=self.decisions.append, **kw)
        keyer = BlockKeyer(IdentityScope.of(rt.descriptor), rt.block_size)
        tier = self.save_tier
        publisher = TierPublisher(rt.descriptor, worker=rt.publisher_id, tier=tier, keyer=keyer, publish=self.feed,
                                  held=lambda keys: held(tier, keys), state_dir=self.tmp / worker)
        publisher.start()
        engine = VllmStandIn(rt, sched, WorkerSide(rt.descriptor, catalog, held=held, publisher=publisher,
                                                       measure=False))
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
    assert first.matched_tokens == 0 and first.saved_blocks == 6  # every full block is on disk
    assert engine.worker.publisher.stats["announced"] == 6  # ... and the index knows, from the tier's publisher
    engine.runtime.reset()  # the GPU cache is gone (a cleared GPU tier); the disk copies stay
    again = engine.serve("r2", PROMPT)
    assert again.computed_tokens == 0
    assert again.matched_tokens == 24 and again.loaded_tokens == 24 and again.failed_blocks == 0
    assert again.result.reused_tokens == 24 and again.result.computed_tokens == 2
    assert (again.result.logits - _reference_logits(name)).abs().max().item() <= TOL
    assert engine.worker.stats["blocks_loaded"] == 6
    assert again.saved_blocks == 0 and engine.worker.stats["blocks_already_held"] == 0  # not even handed over
    assert engine.scheduler.decision_reason("r2") is None  # the request finished and was forgotten


def test_every_decision_acted_upon_is_published_with_its_numbers(world):
    w = world("gqa")
    engine = w.engine("w-a")
    engine.serve("r1", PROMPT)
    engine.runtime.reset()
    engine.serve("r2", PROMPT)
    by_request = {d.request_id: d for d in w.decisions}
    assert by_request["r1"].action is Action.RECOMPUTE
    loaded = by_request["r2"]
    assert loaded.action is Action.TRANSFER and loaded.reused_tokens == 24
    assert loaded.source.worker == engine.runtime.publisher_id and loaded.source.tier is Tier.DISK
    assert loaded.cost_model_version == "connector-test"


def test_the_tiers_facts_survive_a_restart_and_nothing_is_written_twice(world):
    w = world("gqa")
    first = w.engine("w-a")
    first.serve("r1", PROMPT)
    first.worker.close()
    restarted = w.engine("w-a", incarnation=1)  # a new process: fresh GPU pages, new incarnations
    assert restarted.worker.publisher.stats["reannounced"] == 6
    pub = w.feed.index.publisher_status(tier_publisher_name(restarted.runtime.publisher_id, Tier.DISK))
    assert pub.certain  # its snapshot ended the new incarnation's uncertainty
    served = restarted.serve("r2", PROMPT)
    assert served.matched_tokens == 24 and served.loaded_tokens == 24
    assert (served.result.logits - _reference_logits("gqa")).abs().max().item() <= TOL
    assert served.saved_blocks == 0


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
    assert writer.serve("r1", prompt).saved_blocks == 6
    served = reader.serve("r2", prompt)
    assert served.matched_tokens == 24 and served.loaded_tokens == 24
    assert (served.result.logits - _reference_logits("gqa", prompt)).abs().max().item() <= TOL
    assert served.saved_blocks == 0 and reader.worker.stats["blocks_already_held"] == 0


def test_a_payload_deleted_behind_its_back_is_not_offered_and_is_saved_again(world):
    engine = _saved_then_cleared(world)
    _disk, victim = _disk_payload(engine, 3)
    _disk.path(victim).unlink()  # not through the backend: its in-memory index still lists it
    served = engine.serve("r2", PROMPT)
    assert served.matched_tokens == 12 and served.loaded_tokens == 12 and served.failed_blocks == 0
    assert (served.result.logits - _reference_logits("gqa")).abs().max().item() <= TOL
    assert engine.scheduler.stats["source_missing_blocks"] == 3  # blocks 3-5: the prefix ends at the hole
    assert served.saved_blocks == 1 and _disk.path(victim).is_file()  # block 3 is written again
    assert engine.worker.stats["blocks_already_held"] == 2  # blocks 4 and 5 are still there, and announced


def test_a_tier_that_cannot_be_asked_holds_nothing_and_the_engine_recomputes(world):
    # A remote store killed mid-replay made the probe raise on vLLM's scheduler thread, which killed
    # the engine core (EngineDeadError for every request after it). It is a miss now, counted.
    engine = _saved_then_cleared(world)

    def gone(tier, keys):
        raise TierUnavailableError(f"the {tier.value} tier cannot be reached")
    engine.scheduler.probe = gone
    served = engine.serve("r2", PROMPT)
    assert served.matched_tokens == 0 and served.loaded_tokens == 0 and served.result.reused_tokens == 0
    assert (served.result.logits - _reference_logits("gqa")).abs().max().item() <= TOL
    assert engine.scheduler.stats["tier_probes_failed"] >= 1


def test_a_corrupt_payload_is_a_load_error_recomputes_and_is_announced_removed(world):
    w = world("gqa")
    engine = w.engine("w-a")
    engine.serve("r1", PROMPT)
    engine.runtime.reset()
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
    assert engine.worker.publisher.stats["removed"] == 1
    revisions = [(d.revision, d.action) for d in w.decisions if d.request_id == "r2"]
    assert revisions == [(0, Action.TRANSFER), (1, Action.RECOMPUTE)]  # the fallback supersedes the plan


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
    assert worker.block_ids_with_load_errors() == {10, 11, 12, 13, 14}
    assert worker.block_ids_with_load_errors() == set()  # reported once


def test_each_filled_block_is_saved_in_the_step_that_fills_it(world):
    """vLLM's steps: a prefill chunk, then decode steps; each hands over only the blocks it completed."""
    engine = world("gqa").engine("w-a")
    sched = engine.scheduler
    tokens = list(PROMPT[:14])  # 3 full blocks of 4, and 2 tokens
    sched.track("r1", tokens, 14)
    assert sched.num_new_matched_tokens("r1", tokens, 0) == (0, False)
    ids = list(range(20, 28))
    first = sched.build_meta([Scheduled("r1", 0, 10, ids)])  # a first chunk of 10 tokens: blocks 0 and 1
    assert [s.first_block for s in first.saves] == [0] and len(first.saves[0].keys) == 2
    assert first.saves[0].block_ids == (20, 21) and first.saves[0].parent is None
    assert first.prefills[0].uncached == 10 and first.prefills[0].context == 10 and first.decodes == 0
    second = sched.build_meta([Scheduled("r1", 10, 4, ids)])  # the rest of the prompt: block 2
    assert second.saves[0].first_block == 2 and second.saves[0].parent == first.saves[0].keys[-1]
    tokens.extend([1, 2])  # two tokens decoded: block 3 fills in the step that computes its last token
    third = sched.build_meta([Scheduled("r1", 14, 1, ids)])
    assert third.saves == () and third.prefills == () and third.decodes == 1
    fourth = sched.build_meta([Scheduled("r1", 15, 1, ids)])
    assert fourth.saves[0].first_block == 3 and fourth.saves[0].token_ids == tuple(tokens[12:16])
    assert sched.request_finished("r1") == (False, None)  # nothing waits: the blocks are free at once


def test_hybrid_state_is_refused_with_the_reason(tmp_path):
    rt = ReferenceEngine(ReferenceModelSpec.hybrid())
    with pytest.raises(ConfigError, match="hybrid models need SupportsHMA"):
        WorkerSide(rt.descriptor, BackendCatalog(rt.publisher_id, [DiskBackend(tmp_path, 1 << 20)]))


def test_registered_kv_caches_must_match_the_descriptor(tmp_path):
    rt = ReferenceEngine(SPECS["gqa"], model=MODELS["gqa"])
    worker = WorkerSide(rt.descriptor, BackendCatalog(rt.publisher_id, [DiskBackend(tmp_path, 1 << 20)]),
                        measure=False)
    caches = rt.kv_caches()
    caches.pop(next(iter(caches)))
    with pytest.raises(ConfigError, match="bytes per block"):
        worker.register_kv_caches(caches)
    worker.close()


def test_a_cache_in_another_layout_is_refused(tmp_path):
    from nexuskv.hf_config import descriptor_from_hf_config

    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128,
           "dtype": "bfloat16"}
    d = descriptor_from_hf_config(cfg, model="tiny", block_size=32, layout="paged_nhd")
    worker = WorkerSide(d, BackendCatalog("w", [DiskBackend(tmp_path, 1 << 20)]), measure=False)
    cpu_cache = {f"model.layers.{i}.attn": torch.zeros(8, 2, 32, 64, dtype=torch.bfloat16) for i in range(2)}
    with pytest.raises(ConfigError, match="laid out paged_hn_kvd"):
        worker.register_kv_caches(cpu_cache)
    worker.close()
    assert layout_of((2, 8, 32, 2, 32), 1, kv_heads=2, block_size=32, head_size=32) == "paged_nhd"
    assert layout_of((2, 8, 2, 32, 32), 1, kv_heads=2, block_size=32, head_size=32) == "paged_hnd"
    assert layout_of((8, 2, 32, 64), 0, kv_heads=2, block_size=32, head_size=32) == "paged_hn_kvd"


def test_a_resumed_request_asks_with_its_output_tokens(world):
    engine = _saved_then_cleared(world)
    sched = engine.scheduler
    assert sched.num_new_matched_tokens("r2", PROMPT[:13], 0) == (12, False)
    assert sched.num_new_matched_tokens("r2", PROMPT, 0) == (24, False)  # keyed again, not a stale prefix


def test_a_full_disk_tier_keeps_saving_and_the_index_follows_what_it_evicts(world):
    w = world("gqa", disk_bytes=10 * 768 * 4)  # room for 10 blocks; every prompt brings 6 new ones
    engine = w.engine("w-a")
    disk = engine.worker.catalog.backends[0]
    did = engine.runtime.descriptor.descriptor_id
    name = tier_publisher_name(engine.runtime.publisher_id, Tier.DISK)
    for i in range(8):
        prompt = torch.randint(0, 256, (26,), generator=torch.Generator().manual_seed(100 + i)).tolist()
        served = engine.serve(f"r{i}", prompt)
        assert served.saved_blocks == 6, i  # a full tier makes room: the saves go on
        engine.runtime.reset()
        assert disk.used_bytes() <= disk.capacity_bytes
        held = {k.key for k in disk.keys()}
        indexed = {key for (pub, tier, _g), members in w.feed.index.facts().items() if pub == name
                   for _scope, key in members}
        assert held == indexed, i  # what the manager evicted, the tier's publisher withdrew
    assert engine.worker.tiers.counters["dropped"] >= 8 * 6 - 10
    assert engine.worker.stats["blocks_refused"] == 0
    assert all(k.descriptor_id == did for k in disk.keys())


def test_a_block_aligned_prompt_records_the_blocks_vllm_loads_not_the_whole_match(world):
    """vLLM computes a prompt's last token itself: a fully matched prompt of 6 blocks of 4 tokens loads 5
    blocks (20 tokens), and the decision record says 20, not 24 (as 640 -> 608 with blocks of 32)."""
    aligned = PROMPT[:24]
    w = world("gqa")
    engine = w.engine("w-a")
    engine.serve("r1", aligned)
    engine.runtime.reset()
    again = engine.serve("r2", aligned)
    assert again.matched_tokens == 20 and again.loaded_tokens == 20
    loaded = next(d for d in w.decisions if d.request_id == "r2")
    assert loaded.action is Action.TRANSFER
    assert (loaded.reused_tokens, loaded.reused_blocks) == (again.loaded_tokens, 5)
    assert loaded.prompt_tokens == 24
    assert (again.result.logits - _reference_logits("gqa", aligned)).abs().max().item() <= TOL
