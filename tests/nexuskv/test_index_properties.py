"""Property tests: the compact GlobalIndex answers every lookup exactly as the brute-force model.

Random interleavings of stored runs, token-less tier moves, removals, clears (all tiers or one),
snapshots, duplicated batches, dropped sequence numbers and new incarnations, from three
publishers (two of which use the same engine hashes for the same blocks, as vLLM engines with
one hash seed do) over prompts that share prefixes, in two tenants. After every step, every
prompt's lookup in every scope, and the full set of facts, must equal the reference's
(``tests/oracles/reference_index.py``).
"""

from __future__ import annotations

import hashlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nexuskv.contracts.kv_events import AllCleared, BlockRemoved, BlockStored, KvEventBatch, Snapshot
from nexuskv.descriptor import Tier
from nexuskv.identity import BlockKeyer
from nexuskv.index import GlobalIndex

from tests.factories import publisher_identity, scope
from tests.oracles.reference_index import ReferenceIndex

BS = 2
PUBLISHERS = ("pub-a", "pub-b", "pub-c")
HASH_SEED = {"pub-a": b"s1", "pub-b": b"s1", "pub-c": b"s2"}  # a and b collide on purpose
TENANTS = ("tenant-x", "tenant-y")
BASE = list(range(100, 112))
PROMPTS = (BASE, BASE[:6] + [7, 7, 8, 8, 9, 9], BASE[:2] + [5, 5, 5, 5, 5, 5, 5, 5, 5, 5], [1] * 12)
TIERS = (Tier.GPU, Tier.HOST, Tier.DISK)
SECRET = b"prop"
IDENTITY = publisher_identity()


def ehash(pub: str, tenant: str, prompt: int, block: int) -> int:
    tokens = repr((tenant, PROMPTS[prompt][: (block + 1) * BS])).encode()
    return int.from_bytes(hashlib.blake2b(tokens, digest_size=8, key=HASH_SEED[pub]).digest(), "big")


pub_s = st.sampled_from(PUBLISHERS)
prompt_s = st.integers(0, len(PROMPTS) - 1)
span_s = st.tuples(st.sampled_from((0, 0, 0, 1, 2, 3, 4, 5)), st.integers(1, 6))
tier_s = st.sampled_from((Tier.GPU, Tier.GPU, Tier.HOST, Tier.DISK))
move_s = st.sampled_from((Tier.HOST, Tier.HOST, Tier.DISK))
group_s = st.sampled_from((0, 0, 0, 1))
# Most prompts in one tenant, the third (whose first block equals the others') in the other one.
TENANT_OF = ("tenant-x", "tenant-x", "tenant-y", "tenant-x")

ops = st.one_of(
    st.tuples(st.just("store"), pub_s, prompt_s, span_s, group_s),
    st.tuples(st.just("store"), pub_s, prompt_s, span_s, group_s),
    st.tuples(st.just("tier"), pub_s, prompt_s, span_s, move_s, group_s),
    st.tuples(st.just("tier"), pub_s, prompt_s, span_s, move_s, group_s),
    st.tuples(st.just("remove"), pub_s, prompt_s, span_s, tier_s, group_s),
    st.tuples(st.just("remove"), pub_s, prompt_s, span_s, tier_s, group_s),
    st.tuples(st.just("clear"), pub_s, st.one_of(st.none(), tier_s)),
    st.tuples(st.just("snapshot"), pub_s, st.sampled_from(("begin", "end"))),
    st.tuples(st.just("duplicate"), pub_s),
    st.tuples(st.just("drop_seq"), pub_s),
    st.tuples(st.just("restart"), pub_s),
)


def _event(op):
    kind = op[0]
    if kind == "store":
        _, pub, prompt, (start, count), group = op
        tenant = TENANT_OF[prompt]
        stop = min(6, start + count)
        tokens = PROMPTS[prompt][start * BS: stop * BS]
        return BlockStored(engine_hashes=tuple(ehash(pub, tenant, prompt, b) for b in range(start, stop)),
                           parent=ehash(pub, tenant, prompt, start - 1) if start else None,
                           token_ids=tuple(tokens), block_size=BS, group=group, tenant_namespace=tenant)
    if kind in ("tier", "remove"):
        _, pub, prompt, (start, count), tier, group = op
        tenant = TENANT_OF[prompt]
        hashes = tuple(ehash(pub, tenant, prompt, b) for b in range(start, min(6, start + count)))
        if kind == "tier":
            return BlockStored(engine_hashes=hashes, block_size=BS, tier=tier, group=group)
        return BlockRemoved(engine_hashes=hashes, tier=tier, group=group)
    if kind == "clear":
        return AllCleared(tier=op[2])
    return Snapshot(phase=op[2])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, min_size=1, max_size=40))
def test_index_equals_reference_after_every_step(steps):
    index = GlobalIndex(secret=SECRET)
    ref = ReferenceIndex(secret=SECRET)
    seq = dict.fromkeys(PUBLISHERS, 0)
    incarnation = dict.fromkeys(PUBLISHERS, 1)
    sent: dict[str, list[KvEventBatch]] = {p: [] for p in PUBLISHERS}
    scopes = [scope(tenant=t) for t in TENANTS]
    keys = {(s.tenant_namespace, i): BlockKeyer(s, BS, SECRET).keys(p) for s in scopes for i, p in enumerate(PROMPTS)}
    for op in steps:
        pub = op[1]
        if op[0] == "duplicate":
            if not sent[pub]:
                continue
            batch = sent[pub][-1]
        elif op[0] == "drop_seq":
            seq[pub] += 1  # this number is never sent: a gap
            continue
        elif op[0] == "restart":
            incarnation[pub] += 1
            seq[pub] = 0
            continue
        else:
            batch = KvEventBatch(publisher=pub, incarnation=incarnation[pub], seq=seq[pub], ts=0.0,
                                 identity=IDENTITY, events=(_event(op),))
            seq[pub] += 1
            sent[pub].append(batch)
        before = {p: _facts_of(ref, p) for p in PUBLISHERS}
        got, want = index.apply(batch).status, ref.apply(batch)
        assert got == want
        for s in scopes:
            for i in range(len(PROMPTS)):
                assert index.lookup(s, keys[(s.tenant_namespace, i)]) == ref.lookup(s, keys[(s.tenant_namespace, i)]), op
        assert index.facts() == ref.nonempty_facts()
        assert index.memberships == sum(len(v) for v in ref.nonempty_facts().values())
        # A removal or a clear never touches another publisher's, or another tier's, facts.
        after = {p: _facts_of(ref, p) for p in PUBLISHERS}
        for other in PUBLISHERS:
            if other != pub:
                assert after[other] == before[other]
        if op[0] == "remove" or (op[0] == "clear" and op[2] is not None):
            tier = op[4] if op[0] == "remove" else op[2]
            for where, blocks in before[pub].items():
                if where[1] != tier:
                    assert after[pub].get(where, set()) == blocks
        if op[0] == "remove":
            group = op[5]
            for where, blocks in before[pub].items():
                if where[2] != group:
                    assert after[pub].get(where, set()) == blocks


def _facts_of(ref: ReferenceIndex, pub: str) -> dict:
    return {where: set(blocks) for where, blocks in ref.nonempty_facts().items() if where[0] == pub}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(("store", "remove")), pub_s, prompt_s, span_s, tier_s), max_size=40))
def test_memory_bound_forgets_and_counts(steps):
    """With a tiny bound, the index never holds more than the bound and counts what it forgot;
    whatever it still reports is a fact the reference also holds (forgetting makes misses only)."""
    bound = 12
    index = GlobalIndex(secret=SECRET, max_memberships=bound)
    ref = ReferenceIndex(secret=SECRET)
    seq = dict.fromkeys(PUBLISHERS, 0)
    for kind, pub, prompt, span, tier in steps:
        op = ("store", pub, prompt, span, 0) if kind == "store" else ("remove", pub, prompt, span, tier, 0)
        batch = KvEventBatch(publisher=pub, incarnation=1, seq=seq[pub], ts=0.0, identity=IDENTITY, events=(_event(op),))
        seq[pub] += 1
        index.apply(batch)
        ref.apply(batch)
        assert index.memberships <= bound
        stats = index.stats()
        have = sum(len(v) for v in index.facts().values())
        assert have == index.memberships
        for where, blocks in index.facts().items():
            assert blocks <= ref.facts.get(where, set())
        if stats.forgotten_memberships == 0:
            assert index.facts() == ref.nonempty_facts()
