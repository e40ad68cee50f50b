"""The Mooncake trace replay: its events rebuild exactly the simulated workers' caches."""

from nexuskv.descriptor import Tier
from nexuskv.index import GlobalIndex

from benchmarks.trace_events import BLOCK_TOKENS, CONVERSATION_SLICE, TraceReplay, load_trace


def test_replayed_events_rebuild_the_simulated_caches_exactly():
    requests = load_trace(CONVERSATION_SLICE, limit=120)
    replay = TraceReplay(requests, workers=8, gpu_blocks=2048, host_blocks=3072)
    index = GlobalIndex(secret=b"t")
    batches = list(replay.batches())
    for b in batches:
        assert index.apply(b).status == "applied"
    truth = replay.resident(b"t")
    assert index.facts() == truth
    stats = index.stats()
    assert stats.blocks_removed > 0 and stats.unresolved_blocks == 0 and stats.unknown_removals == 0
    assert any(where[1] == Tier.HOST for where in truth)  # tier moves happened
    assert {b.publisher for b in batches} == {w.name for w in replay.workers}
    assert all(ev.block_size == BLOCK_TOKENS for b in batches for ev in b.events if hasattr(ev, "block_size"))
