"""Keying at the edge: an index fed version 2 batches keyed by :class:`EdgeKeyer` holds exactly the
facts, and gives exactly the answers, of the brute-force reference fed the version 1 batches.

Same random interleavings as ``test_index_properties`` (stored runs, tier moves, removals, clears,
snapshots, duplicates, gaps, restarts; three publishers, two tenants), each batch keyed once by
its publisher's keyer and sent through the wire codec (encode, decode) before it is applied.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nexuskv.contracts import codec
from nexuskv.contracts.keyed_events import KeyedBatch, KeyedStored, Removed, TierStored, unpack_hashes
from nexuskv.contracts.kv_events import BlockRemoved, BlockStored, KvEventBatch
from nexuskv.contracts.topics import KV_EVENTS
from nexuskv.descriptor import Tier
from nexuskv.edge_keys import EdgeKeyer, scope_of
from nexuskv.identity import BlockKeyer
from nexuskv.index import GlobalIndex

from tests.factories import scope
from tests.nexuskv.test_index_properties import BS, IDENTITY, PROMPTS, PUBLISHERS, SECRET, TENANTS, _event, ops
from tests.oracles.reference_index import ReferenceIndex


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, min_size=1, max_size=40))
def test_edge_keyed_index_equals_reference(steps):
    index = GlobalIndex(secret=b"not-the-identity-secret")  # the index no longer keys anything
    ref = ReferenceIndex(secret=SECRET)
    keyers = {p: EdgeKeyer(SECRET) for p in PUBLISHERS}
    seq = dict.fromkeys(PUBLISHERS, 0)
    incarnation = dict.fromkeys(PUBLISHERS, 1)
    sent: dict[str, list[tuple[KvEventBatch, bytes]]] = {p: [] for p in PUBLISHERS}
    scopes = [scope(tenant=t) for t in TENANTS]
    keys = {(s.tenant_namespace, i): BlockKeyer(s, BS, SECRET).keys(p) for s in scopes for i, p in enumerate(PROMPTS)}
    for op in steps:
        pub = op[1]
        if op[0] == "duplicate":
            if not sent[pub]:
                continue
            batch, wire = sent[pub][-1]
        elif op[0] == "drop_seq":
            seq[pub] += 1
            continue
        elif op[0] == "restart":
            incarnation[pub] += 1
            seq[pub] = 0
            continue
        else:
            batch = KvEventBatch(publisher=pub, incarnation=incarnation[pub], seq=seq[pub], ts=0.0,
                                 identity=IDENTITY, events=(_event(op),))
            wire = codec.encode(KV_EVENTS, keyers[pub].key_batch(batch))
            seq[pub] += 1
            sent[pub].append((batch, wire))
        keyed = codec.decode(KV_EVENTS, wire)
        assert isinstance(keyed, KeyedBatch)
        assert all(e.token_ids is None for e in keyed.events if isinstance(e, KeyedStored))
        assert index.apply(keyed).status == ref.apply(batch)
        for s in scopes:
            for i in range(len(PROMPTS)):
                want = keys[(s.tenant_namespace, i)]
                assert index.lookup(s, want) == ref.lookup(s, want), op
        assert index.facts() == ref.nonempty_facts()


def test_keys_tokens_and_passthrough():
    keyer = EdgeKeyer(SECRET, include_tokens=True)
    tokens = PROMPTS[0][: 3 * BS]
    stored = BlockStored(engine_hashes=(11, 12, 13), token_ids=tuple(tokens), block_size=BS)
    child = BlockStored(engine_hashes=(14,), parent=13, token_ids=tuple(PROMPTS[0][3 * BS: 4 * BS]), block_size=BS)
    orphan = BlockStored(engine_hashes=(99,), parent=98, token_ids=(1, 2), block_size=BS)
    moved = BlockStored(engine_hashes=(11, 12), block_size=BS, tier=Tier.HOST)
    removed = BlockRemoved(engine_hashes=(13,))
    out = keyer.key_events(IDENTITY, [stored, child, orphan, moved, removed])
    want = BlockKeyer(scope_of(IDENTITY, None, None, None), BS, SECRET).digests(PROMPTS[0][: 4 * BS])
    assert [type(e) for e in out] == [KeyedStored, KeyedStored, TierStored, Removed]
    assert out[0].keys == b"".join(want[:3]) and out[1].keys == want[3]
    assert unpack_hashes(out[0].engine_hashes) == [11, 12, 13]
    assert out[0].token_ids is not None and len(out[0].token_ids) == 3 * BS * 4
    assert keyer.stats.keyed_blocks == 4 and keyer.stats.unresolved_blocks == 1
    # 13 left its only tier: a run hanging from it can no longer be keyed, as the index would refuse it.
    assert keyer.parent_key(13) is None and keyer.parent_key(12) == want[1]
    orphaned = BlockStored(engine_hashes=(15,), parent=13, token_ids=(1, 2), block_size=BS)
    assert keyer.key_events(IDENTITY, [orphaned]) == []


def test_bounded_map_forgets_oldest():
    keyer = EdgeKeyer(SECRET, max_blocks=32)
    for i in range(40):
        keyer.key_events(IDENTITY, [BlockStored(engine_hashes=(i,), token_ids=(i, i), block_size=BS)])
    assert len(keyer) <= 32 and keyer.stats.forgotten_blocks >= 8
    assert keyer.parent_key(0) is None and keyer.parent_key(39) is not None


def test_consecutive_removals_of_one_tier_merge():
    keyer = EdgeKeyer(SECRET)
    gpu = [BlockRemoved(engine_hashes=(h,)) for h in range(5)]
    host = BlockRemoved(engine_hashes=(7,), tier=Tier.HOST)
    out = keyer.key_events(IDENTITY, [*gpu, host, BlockRemoved(engine_hashes=(8,), tier=Tier.HOST),
                                      BlockStored(engine_hashes=(1,), token_ids=(1, 2), block_size=BS), gpu[0]])
    assert [(type(e).__name__, e.tier, unpack_hashes(e.engine_hashes)) for e in out] == [
        ("Removed", Tier.GPU, [0, 1, 2, 3, 4]), ("Removed", Tier.HOST, [7, 8]), ("KeyedStored", Tier.GPU, [1]),
        ("Removed", Tier.GPU, [0])]


def test_export_restore_keeps_the_map():
    keyer = EdgeKeyer(SECRET)
    keyer.key_events(IDENTITY, [BlockStored(engine_hashes=(1, 2), token_ids=(1, 2, 3, 4), block_size=BS),
                                BlockStored(engine_hashes=(1,), block_size=BS, tier=Tier.HOST)])
    again = EdgeKeyer(SECRET)
    again.restore(keyer.export())
    child = BlockStored(engine_hashes=(3,), parent=2, token_ids=(5, 6), block_size=BS)
    assert again.key_events(IDENTITY, [child]) == keyer.key_events(IDENTITY, [child])
    again.key_events(IDENTITY, [BlockRemoved(engine_hashes=(1,))])
    assert again.parent_key(1) is not None  # still held on the host tier
    with pytest.raises(ValueError, match="not an edge keyer map"):
        again.restore(b"junk")
