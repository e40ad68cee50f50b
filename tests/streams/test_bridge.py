"""Engine batches become NexusKV batches: publishers, tiers, incarnations, fail-closed rejects."""

from __future__ import annotations

import pytest

from connectors.kv_wire import EngineBatch, EngineCleared, EngineRemoved, EngineStored
from connectors.wire_formats import encode_batch
from connectors.zmq_events import RawBatch, SequenceTracker
from nexuskv.contracts import codec
from nexuskv.contracts.keyed_events import Cleared, KeyedBatch, KeyedStored, Removed, unpack_hashes
from nexuskv.contracts.kv_events import AllCleared, BlockRemoved, BlockStored
from nexuskv.contracts.topics import KV_EVENTS
from nexuskv.descriptor import Tier
from nexuskv.edge_keys import scope_of
from nexuskv.errors import ContractError
from nexuskv.identity import BlockKeyer
from streams.bridge import ENGINE_CLEARS, BridgeConfig, EventBridge, publisher_name, tier_of, translate

from tests.factories import publisher_identity

IDENTITY = publisher_identity()


def test_publisher_names_from_topics():
    assert publisher_name("vllm", "kv@10.1.2.3:8000@meta-llama/Llama-3.1-8B", 1, "x") == "vllm/10.1.2.3:8000/dp1"
    assert publisher_name("sglang", "kv@pod@org@model", None, "x") == "sglang/pod/dp0"
    assert publisher_name("vllm", "", 0, "engine-7") == "vllm/engine-7/dp0"
    assert publisher_name("vllm", "my-free-form-topic", 2, "engine-7") == "vllm/engine-7/dp2"


def test_tiers_of_engine_mediums():
    assert tier_of(None) is Tier.GPU
    assert tier_of("gpu") is Tier.GPU
    assert tier_of("CPU") is tier_of("CPU_PINNED") is Tier.HOST
    assert tier_of("STORAGE") is tier_of("FS") is tier_of("DISK") is Tier.DISK
    assert tier_of("OBJ") is Tier.OBJECT and tier_of("EXTERNAL") is Tier.REMOTE
    with pytest.raises(ContractError, match="LocalDiskBackend"):
        tier_of("LocalDiskBackend")
    assert tier_of("LocalDiskBackend", {"LOCALDISKBACKEND": Tier.DISK}) is Tier.DISK


def test_translate_maps_every_event():
    batch = EngineBatch(ts=5.0, data_parallel_rank=0, events=(
        EngineStored(block_hashes=(1, 2), parent_block_hash=9, token_ids=tuple(range(8)), block_size=4, medium="GPU",
                     lora_id=3, extra_keys=(("salt",), None), group_idx=1),
        EngineStored(block_hashes=(1,), parent_block_hash=None, token_ids=(), block_size=0, medium="CPU"),
        EngineRemoved(block_hashes=(2,), medium="GPU", group_idx=1),
        EngineCleared(),
    ))
    out = translate(batch, publisher="vllm/p/dp0", incarnation=7, seq=3, identity=IDENTITY, default_block_size=4)
    assert (out.publisher, out.incarnation, out.seq, out.ts) == ("vllm/p/dp0", 7, 3, 5.0)
    assert out.events == (
        BlockStored(engine_hashes=(1, 2), parent=9, token_ids=tuple(range(8)), block_size=4, tier="gpu", group=1,
                    lora="lora-id:3", extra_keys=(("salt",), None)),
        BlockStored(engine_hashes=(1,), token_ids=(), block_size=4, tier="host"),
        BlockRemoved(engine_hashes=(2,), tier="gpu", group=1),
        AllCleared(tier="gpu"),  # vLLM's AllBlocksCleared: its GPU cache, nothing it offloaded
    )
    assert out.block_operations == 4


def test_an_engines_clear_concerns_its_own_memory_only():
    """vLLM's prefix-cache reset leaves every tier but the GPU's (DESIGN invariants); SGLang's clears
    its publisher, whose facts are its radix caches (its storage pages have their own publisher)."""
    from nexuskv.identity import IdentityScope, block_keys
    from nexuskv.index import GlobalIndex

    from tests.factories import descriptor

    d = descriptor()
    identity = publisher_identity(d)
    tokens = tuple(range(8))
    stored = EngineBatch(ts=0, events=(
        EngineStored(block_hashes=(1, 2), parent_block_hash=None, token_ids=tokens, block_size=4, medium="GPU"),
        EngineStored(block_hashes=(1, 2), parent_block_hash=None, token_ids=(), block_size=4, medium="STORAGE"),
        EngineStored(block_hashes=(1, 2), parent_block_hash=None, token_ids=(), block_size=4, medium="CPU"),
    ))
    for engine, gone in (("vllm", {Tier.GPU}), ("sglang", {Tier.GPU, Tier.HOST, Tier.DISK})):
        index = GlobalIndex()
        index.apply(translate(stored, publisher="p", incarnation=1, seq=0, identity=identity, default_block_size=4))
        cleared = translate(EngineBatch(ts=1, events=(EngineCleared(),)), publisher="p", incarnation=1, seq=1,
                            identity=identity, default_block_size=4, clears=ENGINE_CLEARS[engine])
        index.apply(cleared)
        found = index.lookup(IdentityScope.of(d), block_keys(IdentityScope.of(d), tokens, 4))
        left = {m.location.tier for m in found.matches if m.prefix_blocks == 2 and m.certain}
        assert left == {Tier.GPU, Tier.HOST, Tier.DISK} - gone, engine


def test_unkeyable_events_are_refused_not_guessed():
    bad = EngineBatch(ts=0, events=(EngineStored(block_hashes=(1, 2), parent_block_hash=None,
                                                 token_ids=(1, 2, 3, 4), block_size=4),))
    with pytest.raises(ContractError, match="cannot be keyed"):
        translate(bad, publisher="p", incarnation=1, seq=0, identity=IDENTITY, default_block_size=4)
    unknown = EngineBatch(ts=0, events=(EngineRemoved(block_hashes=(1,), medium="NVME-OF"),))
    with pytest.raises(ContractError, match="unknown medium"):
        translate(unknown, publisher="p", incarnation=1, seq=0, identity=IDENTITY, default_block_size=4)


def _raw(seq, *, topic="kv@pod-a@m", restart=False, events=None):
    events = events or [EngineStored(block_hashes=(seq + 1,), parent_block_hash=None, token_ids=(1, 2),
                                     block_size=2, medium="GPU")]
    return RawBatch(topic, seq, encode_batch(events, fmt="vllm-0.33", ts=float(seq)), restart=restart)


def test_bridge_incarnations_and_clears_on_restart(tmp_path):
    ticks = iter(range(1000, 2000, 10))
    bridge = EventBridge(BridgeConfig(engine="vllm", identity=IDENTITY, state_file=tmp_path / "bridge.json"),
                         clock_ns=lambda: next(ticks))
    first = bridge.handle(_raw(0))
    assert first.publisher == "vllm/pod-a/dp0" and first.incarnation == 1000
    assert isinstance(first.events[0], Cleared)  # a fresh engine starts empty
    second = bridge.handle(_raw(1))
    assert second.incarnation == 1000 and not isinstance(second.events[0], Cleared)
    restarted = bridge.handle(_raw(0, restart=True))
    assert restarted.incarnation > 1000 and restarted.events[0] == Cleared()  # every tier: ends the uncertainty
    assert bridge.stats["restarts"] == 1
    bridge._save_state()  # nothing was acknowledged by a broker: the state file records no progress
    again = EventBridge(BridgeConfig(engine="vllm", identity=IDENTITY, state_file=tmp_path / "bridge.json"),
                        clock_ns=lambda: 5000)
    assert again.resume_points() == {} and bridge.acknowledged_points() == {}
    # (a bridge restart keeping the acknowledged resume point and incarnation: tests/streams/test_bridge_pipeline.py)


def test_the_window_is_a_positive_int():
    from nexuskv.errors import ConfigError

    for bad in (0, -1, True, 2.5):
        with pytest.raises(ConfigError, match="^window: "):
            BridgeConfig(engine="vllm", identity=IDENTITY, window=bad)
    assert BridgeConfig(engine="vllm", identity=IDENTITY).window == 256


def test_sequence_tracker_verdicts():
    t = SequenceTracker()
    assert t.classify("a", 0).kind == "first"
    t.delivered("a", 0)
    assert t.classify("a", 1).kind == "next"
    gap = t.classify("a", 4)
    assert gap.kind == "gap" and gap.replay_from == 1
    t.delivered("a", 4)
    restart = t.classify("a", 2)
    assert restart.kind == "restart" and restart.replay_from == 0
    assert t.classify("a", 0).replay_from is None
    late = SequenceTracker(resume={"b": 10})
    assert late.classify("b", 12).replay_from == 10
    assert late.classify("b", 3).kind == "restart"
    fresh = SequenceTracker()
    assert fresh.classify("c", 5).replay_from == 0  # joined late: fetch history from 0


def test_bridge_publishes_keys_not_tokens():
    """The bridge keys each stored run at the edge (the index's own keys) and leaves token ids off."""
    events = [EngineStored(block_hashes=(5, 6), parent_block_hash=None, token_ids=(1, 2, 3, 4), block_size=2,
                           medium="GPU"),
              EngineStored(block_hashes=(7,), parent_block_hash=6, token_ids=(5, 6), block_size=2, medium="CPU"),
              EngineStored(block_hashes=(9,), parent_block_hash=8, token_ids=(7, 8), block_size=2, medium="GPU"),
              EngineRemoved(block_hashes=(5,), medium="GPU")]
    raw = RawBatch("kv@pod-a@m", 0, encode_batch(events, fmt="vllm-0.33", ts=1.0))
    for tokens in (False, True):
        bridge = EventBridge(BridgeConfig(engine="vllm", identity=IDENTITY, identity_secret=b"s" * 16,
                                          include_tokens=tokens))
        out = codec.decode(KV_EVENTS, codec.encode(KV_EVENTS, bridge.handle(raw)))
        assert isinstance(out, KeyedBatch)
        want = BlockKeyer(scope_of(IDENTITY, None, None, None), 2, b"s" * 16).digests([1, 2, 3, 4, 5, 6])
        stored = [e for e in out.events if isinstance(e, KeyedStored)]
        assert [unpack_hashes(e.engine_hashes) for e in stored] == [[5, 6], [7]]  # 9 hangs from an unknown 8
        assert stored[0].keys == want[0] + want[1] and stored[1].keys == want[2] and stored[1].tier is Tier.HOST
        assert all((e.token_ids is not None) is tokens for e in stored)
        assert isinstance(out.events[-1], Removed) and bridge.stats["unresolved_blocks"] == 1
