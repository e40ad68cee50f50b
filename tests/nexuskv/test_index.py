"""GlobalIndex: exact answers, scoped removals, tenant isolation, sequence and incarnation rules."""

from __future__ import annotations

import numpy as np
import pytest

from nexuskv.contracts.kv_events import AllCleared, BlockRemoved, BlockStored, KvEventBatch, Snapshot
from nexuskv.descriptor import Tier
from nexuskv.identity import BlockKeyer, digest_array
from nexuskv.index import GlobalIndex
from nexuskv.keytable import KeyTable
from nexuskv.lookup import Extent
from tests.factories import publisher_identity, scope

BS = 4
TOKENS = tuple(range(1, 25))  # six blocks
SECRET = b"unit"
IDENT = publisher_identity()


def batch(seq, *events, publisher="w1", incarnation=1):
    return KvEventBatch(publisher=publisher, incarnation=incarnation, seq=seq, ts=0.0, identity=IDENT, events=events)


def stored(hashes, tokens, parent=None, **kw):
    return BlockStored(engine_hashes=tuple(hashes), parent=parent, token_ids=tuple(tokens), block_size=BS, **kw)


def keys(tenant="default", tokens=TOKENS):
    return BlockKeyer(scope(tenant=tenant), BS, SECRET).keys(tokens)


def one(index, publisher="w1", tenant="default", tier=Tier.GPU):
    result = index.lookup(scope(tenant=tenant), keys(tenant))
    got = [m for m in result.matches if m.publisher == publisher and m.location.tier == tier]
    return got[0] if got else None


def test_prefix_extents_and_lookup_by_tokens():
    index = GlobalIndex(secret=SECRET)
    index.apply(batch(0, stored([1, 2, 3], TOKENS[:12]), stored([5, 6], TOKENS[16:24], parent=4)))
    m = one(index)
    assert (m.prefix_blocks, m.extents, m.certain) == (3, (), True)  # parent 4 unknown: 5, 6 unresolved
    assert index.stats().unresolved_blocks == 2
    index.apply(batch(1, stored([4], TOKENS[12:16], parent=3), stored([5, 6], TOKENS[16:24], parent=4),
                      BlockRemoved(engine_hashes=(2,))))
    m = one(index)
    assert (m.prefix_blocks, m.extents) == (1, (Extent(2, 6),))
    assert m.location.worker == "w1" and m.present_blocks == 5
    assert index.lookup_tokens(scope(), TOKENS, BS) == index.lookup(scope(), keys())
    arr = digest_array(BlockKeyer(scope(), BS, SECRET).digests(TOKENS))
    assert index.lookup(scope(), arr) == index.lookup(scope(), keys())


def test_removals_and_clears_touch_only_their_publisher_and_tier():
    index = GlobalIndex(secret=SECRET)
    for pub in ("w1", "w2"):
        index.apply(batch(0, stored([1, 2, 3], TOKENS[:12]), BlockStored(engine_hashes=(1, 2), block_size=BS, tier=Tier.HOST),
                          publisher=pub))
    index.apply(batch(1, BlockRemoved(engine_hashes=(1, 2, 3)), publisher="w1"))
    assert one(index, "w1") is None
    assert one(index, "w1", tier=Tier.HOST).prefix_blocks == 2  # the host copies stay
    assert one(index, "w2").prefix_blocks == 3 and one(index, "w2", tier=Tier.HOST).prefix_blocks == 2
    index.apply(batch(2, AllCleared(tier=Tier.HOST), publisher="w2"))
    assert one(index, "w2", tier=Tier.HOST) is None and one(index, "w2").prefix_blocks == 3
    index.apply(batch(2, AllCleared(), publisher="w1"))
    assert one(index, "w1", tier=Tier.HOST) is None and one(index, "w2").prefix_blocks == 3
    assert index.memberships == 3


def test_tenants_never_see_each_others_blocks():
    index = GlobalIndex(secret=SECRET)
    index.apply(batch(0, stored([1, 2], TOKENS[:8], tenant_namespace="acme")))
    assert one(index, tenant="acme").prefix_blocks == 2
    assert index.lookup(scope(tenant="globex"), keys("globex")).matches == ()
    # Presenting acme's keys in globex's scope finds nothing either.
    assert index.lookup(scope(tenant="globex"), keys("acme")).matches == ()


def test_duplicates_are_ignored_and_a_dropped_seq_makes_the_publisher_uncertain_until_resync():
    index = GlobalIndex(secret=SECRET)
    b0 = batch(0, stored([1, 2], TOKENS[:8]))
    assert index.apply(b0).status == "applied"
    assert index.apply(b0).status == "duplicate"
    assert index.apply(batch(2, stored([3], TOKENS[8:12], parent=2))).uncertain  # seq 1 never arrived
    m = one(index)
    assert m.prefix_blocks == 3 and m.certain is False
    assert index.lookup(scope(), keys()).best_certain_prefix() is None
    assert "gap" in index.publisher_status("w1").reason
    index.apply(batch(3, AllCleared(), stored([1, 2], TOKENS[:8])))  # resync
    m = one(index)
    assert m.certain and m.prefix_blocks == 2
    assert index.stats().gaps == 1 and index.stats().resyncs == 1


def test_snapshot_replaces_facts_and_a_gap_inside_keeps_it_uncertain():
    index = GlobalIndex(secret=SECRET)
    index.apply(batch(0, stored([1, 2, 3], TOKENS[:12])))
    index.apply(batch(1, Snapshot(phase="begin"), stored([1], TOKENS[:4])))
    assert one(index).certain is False and one(index).prefix_blocks == 1
    index.apply(batch(2, Snapshot(phase="end")))
    assert one(index).certain and one(index).prefix_blocks == 1
    index.apply(batch(3, Snapshot(phase="begin")))
    index.apply(batch(5, stored([1, 2], TOKENS[:8]), Snapshot(phase="end")))  # seq 4 lost inside
    assert one(index).certain is False


def test_new_incarnation_is_uncertain_and_old_incarnations_are_stale():
    index = GlobalIndex(secret=SECRET)
    index.apply(batch(0, stored([1, 2], TOKENS[:8])))
    assert index.apply(batch(0, stored([9], TOKENS[:4]), incarnation=2)).uncertain
    assert one(index).certain is False
    assert index.apply(batch(7, AllCleared(), incarnation=1)).status == "stale"
    index.apply(batch(1, AllCleared(), stored([9], TOKENS[:4]), incarnation=2))
    assert one(index).certain and one(index).prefix_blocks == 1


def test_a_publisher_first_seen_mid_stream_is_uncertain():
    index = GlobalIndex(secret=SECRET)
    index.apply(batch(40, stored([1], TOKENS[:4])))
    assert one(index).certain is False


def test_memory_bound_forgets_with_the_sweep_policy_and_counts():
    index = GlobalIndex(secret=SECRET, max_memberships=64)
    rng = np.random.default_rng(0)
    for seq in range(20):
        toks = rng.integers(0, 1000, 40).tolist()
        index.apply(batch(seq, stored(range(seq * 100, seq * 100 + 10), toks)))
    s = index.stats()
    assert index.memberships <= 64 and s.forgotten_memberships == 200 - index.memberships
    assert s.forgotten_blocks == s.forgotten_memberships and s.forget_policy == "sweep"
    assert sum(len(v) for v in index.facts().values()) == index.memberships


def test_keytable_matches_a_dict_through_inserts_deletes_and_rehashes():
    rng = np.random.default_rng(1)
    moves = []
    t = KeyTable(wide=True, values=("v",), on_move=moves.append)
    model: dict[tuple[int, int, int], int] = {}
    for round_ in range(30):
        k1 = rng.integers(0, 2**64 - 1, 300, dtype=np.uint64)
        k2 = rng.integers(0, 2**64 - 1, 300, dtype=np.uint64)
        k1[:5] = k1[0]  # same first word, different second word: must stay distinct keys
        tag = round_ % 3 + 1
        slots = t.insert(k1, k2, tag)
        t.values["v"][slots] = np.arange(300) + round_ * 1000
        for mv in moves:
            model = {k: int(mv[s]) for k, s in model.items()}
        moves.clear()
        model.update({(int(a), int(b), tag): int(s) for a, b, s in zip(k1, k2, slots)})
        drop = list(model)[:: 3]
        t.delete(np.array([model.pop(k) for k in drop], np.intp))
        ks = list(model)
        found = t.find(np.array([k[0] for k in ks], np.uint64), np.array([k[1] for k in ks], np.uint64),
                       np.array([k[2] for k in ks], np.uint32))
        assert found.tolist() == [model[k] for k in ks]
        gone = t.find(np.array([k[0] for k in drop], np.uint64), np.array([k[1] for k in drop], np.uint64),
                      np.array([k[2] for k in drop], np.uint32))
        assert (gone == -1).all()
    assert t.rehashes > 0 and t.live == len(model)


def test_lookup_rejects_malformed_keys():
    from nexuskv.errors import IdentityError

    with pytest.raises(IdentityError):
        GlobalIndex().lookup(scope(), [-1])


def test_checkpoint_restore_reproduces_publishers_exactly():
    index = GlobalIndex(secret=SECRET)
    index.apply(batch(0, stored([1, 2, 3], TOKENS[:12]), BlockStored(engine_hashes=(2, 3), block_size=BS, tier=Tier.DISK)))
    index.apply(batch(0, stored([1, 2], TOKENS[:8], tenant_namespace="acme"), publisher="w2"))
    index.apply(batch(2, stored([3], TOKENS[8:12], parent=2, tenant_namespace="acme"), publisher="w2"))  # gap
    copy = GlobalIndex(secret=SECRET)
    copy.apply(batch(0, stored([7], TOKENS[:4]), publisher="w2"))  # replaced by the restore
    assert set(copy.restore(index.checkpoint(["w1", "w2"]))) == {"w1", "w2"}
    assert copy.facts() == index.facts()
    for tenant in ("default", "acme"):
        assert copy.lookup(scope(tenant=tenant), keys(tenant)) == index.lookup(scope(tenant=tenant), keys(tenant))
    assert copy.publisher_status("w2") == index.publisher_status("w2")
    # Engine maps came along: a removal by engine hash works on the copy.
    for ix in (index, copy):
        ix.apply(batch(1, BlockRemoved(engine_hashes=(3,), tier=Tier.DISK)))
    assert copy.facts() == index.facts()
    only_w1 = GlobalIndex(secret=SECRET)
    only_w1.restore(index.checkpoint(["w1"]))
    assert set(only_w1.facts()) == {k for k in index.facts() if k[0] == "w1"}
