"""GlobalIndex: exact answers, scoped removals, tenant isolation, sequence and incarnation rules."""

from __future__ import annotations

import numpy as np
import pytest

from nexuskv.contracts.kv_events import AllCleared, BlockRemoved, BlockStored, KvEventBatch, Snapshot
from nexuskv.descriptor import Tier
from nexuskv.identity import BlockKeyer, digest_array
from nexuskv.index import GlobalIndex
from nexuskv.index_core import make_core
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


def test_core_matches_a_model_through_growth_removals_clears_and_shrinking():
    """Thousands of blocks through one core (tables grow, member lists compact, tables shrink),
    checked against a dict model after every round; several hashes name the same block."""
    rng = np.random.default_rng(1)
    core = make_core(bytes(32))
    pub = core.add_publisher()
    gpu, host = core.add_location(pub), core.add_location(pub)
    scopes = [core.add_scope(bytes([i]) * 16)[0] for i in range(3)]
    blocks: dict[tuple[int, bytes], set[int]] = {}  # (scope, key) -> locations
    entry: dict[int, tuple[int, bytes]] = {}  # engine hash -> block, valid while the block is held

    def valid(h):
        b = entry.get(h)
        return b if b is not None and blocks.get(b) else None

    next_hash = 0
    for round_ in range(12):
        n = 3000
        keys = rng.bytes(16 * n)
        keys = keys[:16] * 5 + keys[80:]  # the same key five times: one block, five hashes
        sid = scopes[round_ % 3]
        hashes = list(range(next_hash, next_hash + n))
        next_hash += n
        core.store(pub, gpu, sid, keys, hashes)
        for i, h in enumerate(hashes):
            b = (sid, keys[16 * i:16 * i + 16])
            entry[h] = b
            blocks.setdefault(b, set()).add(gpu)
        moved = hashes[::4]
        assert core.store_tier(pub, host, moved) == len(moved)
        for h in moved:
            blocks[valid(h)].add(host)
        gone = [h for h in list(entry) if h % 3 == round_ % 3][: n // 2]
        want_known = 0
        for h in gone:
            b = valid(h)
            if b is not None:
                want_known += 1
                blocks[b].discard(gpu)
        assert core.remove(pub, gpu, gone) == want_known
        if round_ % 5 == 4:
            core.clear(pub, [host], False)
            for locs in blocks.values():
                locs.discard(host)
        want: dict[int, set[tuple[int, bytes]]] = {}
        for b, locs in blocks.items():
            for loc in locs:
                want.setdefault(loc, set()).add(b)
        got = {loc: set(zip(np.frombuffer(sids, "<u4").tolist(), [ks[i:i + 16] for i in range(0, len(ks), 16)]))
               for loc, sids, ks in core.facts()}
        assert got == want
        assert core.memberships == sum(len(v) for v in want.values())
        assert core.blocks == sum(1 for locs in blocks.values() if locs)
        for b in list(blocks)[:: 97]:
            found = core.lookup(b[0], b[1])
            assert [(loc, prefix) for loc, prefix, _ in found] == [(loc, 1) for loc in sorted(blocks[b])]
    core.clear(pub, [gpu, host], True)
    assert core.memberships == 0 and core.blocks == 0
    assert core.take_empty_scopes() == sorted(scopes)


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


def test_checkpoints_of_a_large_state_restore_exactly():
    """Thousands of blocks per publisher, restored publisher group by group into a fresh index
    (its tables grow and rebuild while the rows come in)."""
    rng = np.random.default_rng(5)
    index = GlobalIndex(secret=SECRET)
    for p in range(5):
        for seq in range(6):
            toks = rng.integers(0, 1000, 1000 * BS).tolist()
            base = (p * 10 + seq) * 1000
            events = [stored(range(base, base + 1000), toks, tenant_namespace=f"t{p % 2}"),
                      BlockStored(engine_hashes=tuple(range(base, base + 300)), block_size=BS, tier=Tier.HOST)]
            if seq:
                events.append(BlockRemoved(engine_hashes=tuple(range(base - 1000, base - 700))))
            index.apply(batch(seq, *events, publisher=f"w{p}"))
    copy = GlobalIndex(secret=SECRET)
    names = index.publishers()
    for part in (names[0::2], names[1::2]):
        copy.restore(index.checkpoint(list(part)))
    assert copy.facts() == index.facts() and copy.memberships == index.memberships
    for p in range(5):  # engine maps came along: a removal by hash acts the same on both
        for ix in (index, copy):
            ix.apply(batch(6, BlockRemoved(engine_hashes=tuple(range(p * 10000, p * 10000 + 5000, 7))),
                           publisher=f"w{p}"))
    assert copy.facts() == index.facts()


def test_a_presized_index_answers_the_same():
    small, big = GlobalIndex(secret=SECRET), GlobalIndex(secret=SECRET,
                                                                            expected_blocks=100_000)
    for ix in (small, big):
        ix.apply(batch(0, stored([1, 2, 3], TOKENS[:12]), BlockRemoved(engine_hashes=(2,))))
    assert big.facts() == small.facts() and big.lookup(scope(), keys()) == small.lookup(scope(), keys())
    assert big.stats().core_nbytes > small.stats().core_nbytes
    # ... and the sizing survives the first stores: the shrink rule keeps the presized floor
    sized = GlobalIndex(secret=SECRET, expected_blocks=100_000).stats().core_nbytes
    assert big.stats().core_nbytes >= sized


def test_a_tier_publishers_locations_are_its_workers_and_survive_a_checkpoint():
    """A tier publisher (``w1/disk``) whose identity names worker ``w1``: its blocks are at w1's disk
    (what the planner prices as w1's own tier), still under its own publisher name and sequence."""
    index = GlobalIndex(secret=SECRET)
    tier_ident = IDENT.model_copy(update={"worker": "w1"})
    tiered = KvEventBatch(publisher="w1/disk", incarnation=1, seq=0, ts=0.0, identity=tier_ident,
                          events=(stored([1, 2, 3], TOKENS[:12], tier=Tier.DISK),))
    index.apply(tiered)
    index.apply(batch(0, stored([1], TOKENS[:4])))  # the engine's own GPU block
    m = one(index, publisher="w1/disk", tier=Tier.DISK)
    assert (m.location.worker, m.location.tier, m.prefix_blocks) == ("w1", Tier.DISK, 3)
    restored = GlobalIndex(secret=SECRET)
    restored.restore(index.checkpoint(index.publishers()))
    assert one(restored, publisher="w1/disk", tier=Tier.DISK) == m
    assert one(restored, tier=Tier.GPU).location.worker == "w1"


def test_a_publisher_cannot_speak_for_a_worker_its_name_is_not_under():
    with pytest.raises(ValueError, match="identity.worker"):
        KvEventBatch(publisher="w2/disk", incarnation=1, seq=0, ts=0.0,
                     identity=IDENT.model_copy(update={"worker": "w1"}), events=())
    with pytest.raises(ValueError, match="identity.worker"):  # a name prefix is not a path prefix
        KvEventBatch(publisher="w10/disk", incarnation=1, seq=0, ts=0.0,
                     identity=IDENT.model_copy(update={"worker": "w1"}), events=())
