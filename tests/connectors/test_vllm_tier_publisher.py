"""The tier publisher: its own identity, a snapshot of what the tier holds at every start, never a guess.

Acceptance: announced blocks are keyed by the index exactly as the engine's blocks are; a new
incarnation re-announces exactly the blocks that are still held, keyed under the current scope and
chained to held parents (others dropped, and the manifest rewritten); the index is certain again
once the snapshot ends, and an engine's clear or restart never touches these facts; a batch that
may be lost makes the next call resync; incarnations only grow.
"""

from __future__ import annotations

import pytest

from connectors.vllm.tier_publisher import TierBlock, TierPublisher, event_hash, tier_publisher_name
from nexuskv.contracts.kv_events import AllCleared, KvEventBatch
from nexuskv.descriptor import Tier
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.index import GlobalIndex

from tests.factories import descriptor, kv_batch

D = descriptor(block_size=4)
SCOPE = IdentityScope.of(D)
TOKENS = list(range(100, 124))  # 6 blocks of 4


def _blocks(tokens=TOKENS, keyer=None) -> list[TierBlock]:
    keyer = keyer or BlockKeyer(SCOPE, 4)
    keys = keyer.keys(tokens)
    return [TierBlock(k, keys[i - 1] if i else None, tuple(tokens[4 * i:4 * i + 4])) for i, k in enumerate(keys)]


class _Tier:
    def __init__(self) -> None:
        self.held: set[int] = set()

    def __call__(self, keys) -> list[bool]:
        return [k.key in self.held for k in keys]


def _publisher(tmp_path, index: GlobalIndex, tier: _Tier, *, clock_ns=None, publish=None, secret=b"") -> TierPublisher:
    kw = {} if clock_ns is None else {"clock_ns": clock_ns}
    return TierPublisher(D, worker="vllm/pod/dp0", tier=Tier.DISK, keyer=BlockKeyer(SCOPE, 4, secret),
                         publish=publish or (lambda b: index.apply(b)), held=tier, state_dir=tmp_path, **kw)


def _on_disk(index: GlobalIndex, tokens=TOKENS) -> int:
    found = index.lookup(SCOPE, BlockKeyer(SCOPE, 4).keys(tokens))
    return max((m.prefix_blocks for m in found.matches if m.certain and m.location.tier is Tier.DISK
                and m.location.worker == "vllm/pod/dp0" and m.publisher == "vllm/pod/dp0/disk"), default=0)


def test_announced_blocks_are_keyed_like_the_engines_and_survive_its_clears(tmp_path):
    index, tier = GlobalIndex(), _Tier()
    pub = _publisher(tmp_path, index, tier)
    assert pub.name == tier_publisher_name("vllm/pod/dp0", Tier.DISK) == "vllm/pod/dp0/disk"
    assert pub.start() == 0
    blocks = _blocks()
    tier.held.update(b.key for b in blocks)
    assert pub.announce(blocks[:3]) == 3 and pub.announce(blocks[3:]) == 3
    assert _on_disk(index) == 6
    # The engine, a publisher of its own, is reset and restarts: the tier's facts stay.
    index.apply(kv_batch(0, publisher="vllm/pod/dp0", incarnation=1))
    index.apply(KvEventBatch(publisher="vllm/pod/dp0", incarnation=2, seq=0, ts=0.0, identity=kv_batch().identity,
                             events=(AllCleared(),)))
    assert _on_disk(index) == 6


def test_a_run_must_hang_from_an_announced_block(tmp_path):
    index, tier = GlobalIndex(), _Tier()
    pub = _publisher(tmp_path, index, tier)
    pub.start()
    blocks = _blocks()
    assert pub.announce(blocks[2:]) == 0  # the index could not key it: nothing is claimed
    assert _on_disk(index) == 0


def test_a_restart_re_announces_what_the_tier_still_holds(tmp_path):
    index, tier = GlobalIndex(), _Tier()
    ticks = iter([5_000, 4_000])  # a clock that went back: the incarnation still grows
    first = _publisher(tmp_path, index, tier, clock_ns=lambda: next(ticks))
    first.start()
    blocks = _blocks()
    other = _blocks(list(range(500, 508)))
    tier.held.update(b.key for b in blocks + other)
    first.announce(blocks)
    first.announce(other)
    tier.held.discard(blocks[4].key)  # deleted while no engine ran: block 5 is an orphan now
    (tmp_path / "disk.manifest.jsonl").open("a").write('{"k": "torn')  # a crash mid-line
    again = _publisher(tmp_path, index, tier, clock_ns=lambda: next(ticks))
    assert again.start() == 4 + 2
    assert again.stats["dropped_at_start"] == 3  # the deleted block, its orphan, the torn line
    status = index.publisher_status("vllm/pod/dp0/disk")
    assert status.certain and status.incarnation == 5_001
    assert _on_disk(index) == 4 and _on_disk(index, list(range(500, 508))) == 2
    assert len((tmp_path / "disk.manifest.jsonl").read_text().splitlines()) == 6  # rewritten to what is true


def test_blocks_of_another_scope_or_secret_are_not_re_announced(tmp_path):
    index, tier = GlobalIndex(), _Tier()
    pub = _publisher(tmp_path, index, tier)
    pub.start()
    blocks = _blocks()
    tier.held.update(b.key for b in blocks)
    pub.announce(blocks)
    keyed_otherwise = _publisher(tmp_path, GlobalIndex(), tier, secret=b"another deployment's secret")
    assert keyed_otherwise.start() == 0  # the tokens would key to other blocks than the payloads hold


def test_forget_removes_and_a_lost_batch_resyncs(tmp_path):
    index, tier = GlobalIndex(), _Tier()
    fail = [False]

    def publish(batch):
        if fail[0]:
            fail[0] = False
            raise ConnectionError("broker went away")
        index.apply(batch)

    pub = _publisher(tmp_path, index, tier, publish=publish)
    pub.start()
    blocks = _blocks()
    tier.held.update(b.key for b in blocks)
    pub.announce(blocks[:4])
    fail[0] = True
    with pytest.raises(ConnectionError):
        pub.announce(blocks[4:])
    assert pub.announce(blocks[4:]) == 2  # a new incarnation's snapshot first, then the run
    assert pub.stats["resyncs"] == 1 and _on_disk(index) == 6
    assert index.publisher_status("vllm/pod/dp0/disk").certain
    pub.forget([blocks[2].key])
    assert _on_disk(index) == 2
    assert event_hash(blocks[0].key) == blocks[0].key & (2**64 - 1)
