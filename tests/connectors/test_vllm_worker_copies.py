"""The vLLM worker side's copies off the step thread: a bounded save queue, one writer, layer-wise loads.

Acceptance: ``wait_for_save`` returns while the writer is stuck on a write, and nothing of that
save is announced until its bytes are on the tier (intent is not completion); a save that does not
fit in the queue is dropped — counted in the worker's stats and in ``nexuskv_transfer_outcomes``,
never announced, never waited for — and the next one fits again once the writer caught up;
``close`` drains what it can and counts the rest as dropped; a synchronous load with ``layerwise``
puts each layer in place only when ``wait_for_layer_load`` names it, and a load whose layers were
never waited for is reported as load errors (vLLM recomputes them) instead of being used.
"""

from __future__ import annotations

import threading

import pytest
import torch

from connectors.vllm.scheduler_side import Readable, Scheduled, SchedulerSide
from connectors.vllm.tier_publisher import TierPublisher
from connectors.vllm.worker_side import WorkerSide, tier_held
from nexuskv.dataplane import BackendCatalog, DiskBackend
from nexuskv.descriptor import Tier
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.reference_engine import ReferenceEngine, ReferenceModelSpec, TinyModel
from streams.bus.metrics import METRICS

from tests.connectors.reference import POLICY, PROFILE, IndexFeed, cost_model

SPEC = ReferenceModelSpec.gqa()
MODEL = TinyModel(SPEC)
PROMPT = torch.randint(0, 256, (26,), generator=torch.Generator().manual_seed(5)).tolist()  # 6 full blocks of 4
OTHER = torch.randint(0, 256, (26,), generator=torch.Generator().manual_seed(6)).tolist()


class GatedDisk(DiskBackend):
    """A disk tier whose writes wait until the test opens the gate."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.gate = threading.Event()
        self.gate.set()
        self.writing = threading.Event()

    def commit_views(self, entries):  # every write (put and commit_view commit through it)
        self.writing.set()
        if not self.gate.wait(30):
            raise TimeoutError("the test never opened the gate")
        return super().commit_views(entries)


class Rig:
    """One reference engine, its scheduler side, and a worker side over a gated disk tier."""

    def __init__(self, tmp_path, *, layerwise: bool = False, save_queue_bytes: int = 1 << 24) -> None:
        self.feed = IndexFeed()
        self.rt = rt = ReferenceEngine(SPEC, model=MODEL, worker="w-a", publisher=self.feed)
        root = tmp_path / "disk"
        self.disk = GatedDisk(root, 1 << 24)
        catalog = BackendCatalog(rt.publisher_id, [self.disk])
        held = tier_held(catalog, root)
        model = cost_model(rt.descriptor)
        self.sched = SchedulerSide(rt.descriptor, worker=rt.publisher_id, index=self.feed.index, model=lambda: model,
                                   execution=lambda: POLICY, profile=PROFILE, probe=held, save_tier=Tier.DISK,
                                   readable=Readable(rt.publisher_id, own=frozenset({Tier.DISK}), shared=frozenset()))
        keyer = BlockKeyer(IdentityScope.of(rt.descriptor), rt.block_size)
        self.publisher = TierPublisher(rt.descriptor, worker=rt.publisher_id, tier=Tier.DISK, keyer=keyer,
                                       publish=self.feed, held=lambda keys: held(Tier.DISK, keys), state_dir=tmp_path)
        self.publisher.start()
        self.worker = WorkerSide(rt.descriptor, catalog, held=held, publisher=self.publisher, measure=False,
                                 layerwise=layerwise, save_queue_bytes=save_queue_bytes)
        self.worker.register_kv_caches(rt.kv_caches())

    def computed(self, request_id: str, tokens: list[int]):
        """The engine prefilled ``tokens``; the step's metadata saves its full blocks."""
        self.rt.prefill(tokens, reuse=False, request_id=request_id)
        self.sched.track(request_id, tokens, len(tokens))
        assert self.sched.num_new_matched_tokens(request_id, tokens, 0) == (0, False)
        full = self.rt.block_ids(tokens, len(tokens) // self.rt.block_size)
        return self.sched.build_meta([Scheduled(request_id, 0, len(tokens), full)])

    def announced(self, tokens: list[int]) -> list[bool]:
        return [self.publisher.announced(k) for k in self.rt.block_keys(tokens)[:len(tokens) // 4]]

    def close(self) -> None:
        self.disk.gate.set()
        self.worker.close()


@pytest.fixture
def rig(tmp_path):
    made: list[Rig] = []

    def make(**kw) -> Rig:
        made.append(Rig(tmp_path / str(len(made)), **kw))
        return made[-1]
    yield make
    for r in made:
        r.close()


def test_a_save_is_written_off_the_step_thread_and_announced_only_once_written(rig):
    r = rig()
    meta = r.computed("r1", PROMPT)
    assert len(meta.saves) == 1 and len(meta.saves[0].block_ids) == 6
    r.disk.gate.clear()
    r.worker.wait_for_save(meta)  # returns with the writer stuck on the first write
    assert r.disk.writing.wait(10)
    assert r.worker.busy() and r.worker.pending_saves() == 1
    assert r.announced(PROMPT) == [False] * 6 and r.publisher.stats["announced"] == 0  # intent is not completion
    assert not r.disk.keys()
    r.disk.gate.set()
    r.worker.flush()
    assert r.announced(PROMPT) == [True] * 6 and len(r.disk.keys()) == 6
    assert r.worker.stats["blocks_saved"] == 6 and r.worker.stats["saves_dropped"] == 0
    assert not r.worker.busy()


def test_a_full_queue_drops_the_save_counted_never_announced_never_waited_for(rig):
    dropped = METRICS.transfers.labels(status="save_dropped", link="gpu->disk")
    before = dropped._value.get()
    r = rig(save_queue_bytes=6 * 3072)  # room for one prompt's 6 blocks of 3072 bytes
    assert r.worker.block_bytes == 3072
    first, second = r.computed("r1", PROMPT), r.computed("r2", OTHER)
    r.disk.gate.clear()
    r.worker.wait_for_save(first)
    assert r.disk.writing.wait(10)
    r.worker.wait_for_save(second)  # does not fit while the first is being written: dropped, not waited for
    assert r.worker.stats["saves_dropped"] == 1 and r.worker.stats["blocks_dropped"] == 6
    assert dropped._value.get() == before + 1
    r.disk.gate.set()
    r.worker.flush()
    assert r.announced(PROMPT) == [True] * 6
    assert r.announced(OTHER) == [False] * 6 and len(r.disk.keys()) == 6  # the dropped save left no trace
    third = r.computed("r3", OTHER)
    r.worker.wait_for_save(third)  # the writer caught up: it fits again
    r.worker.flush()
    assert r.announced(OTHER) == [True] * 6 and r.worker.stats["saves_dropped"] == 1


def test_close_drains_the_queue_and_counts_what_it_could_not_write(rig, tmp_path):
    r = rig()
    r.worker.wait_for_save(r.computed("r1", PROMPT))
    r.worker.close()  # drained: written and announced
    assert r.announced(PROMPT) == [True] * 6 and r.worker.stats["saves_dropped"] == 0

    stuck = rig()
    stuck.disk.gate.clear()
    stuck.worker.wait_for_save(stuck.computed("r1", PROMPT))
    assert stuck.disk.writing.wait(10)
    stuck.worker.wait_for_save(stuck.computed("r2", OTHER))
    closer = threading.Thread(target=stuck.worker.close, kwargs={"timeout_s": 0.5})
    closer.start()
    closer.join(5)
    assert stuck.worker.stats["saves_dropped"] == 1  # r2 never reached the writer
    stuck.disk.gate.set()
    closer.join(10)
    assert stuck.announced(OTHER) == [False] * 6
    stuck.worker.wait_for_save(stuck.computed("r3", OTHER))  # a closed worker side queues nothing
    assert stuck.worker.stats["saves_dropped"] == 2


def _load_meta(r: Rig):
    """PROMPT saved and flushed, the engine's pages cleared and zeroed, a load of its 6 blocks decided."""
    r.worker.wait_for_save(r.computed("r1", PROMPT))
    r.worker.flush()
    saved = {name: t.clone() for name, t in r.rt.kv_caches().items()}
    old = r.rt.block_ids(PROMPT, 6)
    r.rt.reset()
    for t in r.rt.kv_caches().values():
        t.zero_()
    r.sched.track("r2", PROMPT, len(PROMPT))
    assert r.sched.num_new_matched_tokens("r2", PROMPT, 0) == (24, False)
    pages = r.rt.allocate_blocks(PROMPT, 0, 6)
    r.sched.update_state_after_alloc("r2", pages, 24)
    meta = r.sched.build_meta()
    assert len(meta.loads) == 1 and list(meta.loads[0].block_ids) == pages
    expected = {name: t.index_select(0, torch.tensor(old)) for name, t in saved.items()}
    return meta, pages, expected


def test_layerwise_loads_put_each_layer_in_place_when_vllm_waits_for_it(rig):
    r = rig(layerwise=True)
    meta, pages, expected = _load_meta(r)
    caches = r.rt.kv_caches()
    names = sorted(caches)
    r.worker.bind(meta)
    r.worker.start_load(meta)
    assert not any(caches[n].any() for n in names)  # nothing in place before the first layer runs
    for i, name in enumerate(names):
        r.worker.wait_for_layer_load(name)
        assert torch.equal(caches[name].index_select(0, torch.tensor(pages)), expected[name]), name
        assert not any(caches[n].any() for n in names[i + 1:])  # later layers wait for their turn
    r.worker.wait_for_save(meta)
    assert r.worker.block_ids_with_load_errors() == set()
    assert r.worker.stats["blocks_loaded"] == 6 and r.worker.stats["loads_unwaited"] == 0


def test_a_load_whose_layers_were_never_waited_for_is_a_load_error(rig):
    r = rig(layerwise=True)
    meta, pages, _expected = _load_meta(r)
    r.worker.bind(meta)
    r.worker.start_load(meta)
    r.worker.wait_for_layer_load(sorted(r.rt.kv_caches())[0])  # only the first layer
    r.worker.wait_for_save(meta)
    assert r.worker.block_ids_with_load_errors() == set(pages)  # recomputed, not used half in place
    assert r.worker.stats["loads_unwaited"] == 1 and r.worker.stats["blocks_loaded"] == 0
    assert r.worker.stats["blocks_failed"] == 6
    assert r.publisher.stats["removed"] == 0  # the payloads are fine: nothing is withdrawn


def test_a_save_that_cannot_be_copied_out_is_dropped_not_raised_into_the_step(rig, monkeypatch):
    r = rig()
    meta = r.computed("r1", PROMPT)

    def broken(block_ids):
        raise RuntimeError("device lost")
    monkeypatch.setattr(r.worker._kv, "gather", broken)
    r.worker.wait_for_save(meta)
    assert r.worker.stats["saves_dropped"] == 1 and r.worker.stats["blocks_dropped"] == 6
    assert r.worker.pending_saves() == 0 and not r.worker.busy()
    assert r.announced(PROMPT) == [False] * 6
