"""Issue 13's index defects, each designed out of the storage core (``nexuskv.index_core``):

* 13.2 — a clear costs what it removes, not the whole index;
* 13.4 — a repeated engine hash inside one store event leaves no phantom membership, the
  checkpoint equals the live state and no block slot leaks;
* 13.7 — a lookup in tenant A's scope with keys that exist only in tenant B's scope does the same
  work as a lookup with keys that exist nowhere;
* 13.10 — the index's scope and keyer tables are bounded (vLLM's cache salt is per request).

Each fails on the index of commit 30ffd34. The two timing tests compare two runs of the same
operation in one process (a ratio, medians of interleaved repeats), never a wall-clock bound.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
import tracemalloc

import numpy as np
import pytest

from nexuskv.contracts.kv_events import AllCleared, BlockRemoved, BlockStored, KvEventBatch
from nexuskv.descriptor import Tier
from nexuskv.identity import BlockKeyer
from nexuskv.index import GlobalIndex, KeyedBlocks

from tests.factories import publisher_identity, scope
from tests.oracles.reference_index import ReferenceIndex

BS = 4
SECRET = b"reliability"
IDENT = publisher_identity()


def batch(seq, *events, publisher="w1"):
    return KvEventBatch(publisher=publisher, incarnation=1, seq=seq, ts=0.0, identity=IDENT, events=events)


def runs(index, publisher, first_seq, blocks, *, seed=0, per_event=1024, tenant=None):
    """Batches storing ``blocks`` random blocks for ``publisher``, ``per_event`` a batch."""
    rng = np.random.default_rng(seed)
    out = []
    for i, start in enumerate(range(0, blocks, per_event)):
        n = min(per_event, blocks - start)
        tokens = tuple(rng.integers(0, 50_000, n * BS).tolist())
        hashes = tuple(range(seed << 32 | start, (seed << 32 | start) + n))
        out.append(batch(first_seq + i, BlockStored(engine_hashes=hashes, token_ids=tokens, block_size=BS,
                                                    tenant_namespace=tenant), publisher=publisher))
    return out


def test_a_clear_costs_what_it_removes_not_the_whole_index():
    """2,000 clears of a small publisher, with 2,000 or 120,000 blocks of another publisher
    beside it: the same cost (on 30ffd34 the second took ~40x longer: every clear remapped the
    location set of every block in the index)."""
    clears = batch(10, *[AllCleared(tier=Tier.HOST) if i % 2 else AllCleared() for i in range(2000)], publisher="small")
    costs = {}
    for big in (2_000, 120_000):
        index = GlobalIndex(secret=SECRET)
        for b in runs(index, "big", 0, big, per_event=4096):
            index.apply(b)
        for b in runs(index, "small", 0, 64, seed=1, per_event=32):
            index.apply(b)
        index.apply(batch(2, BlockStored(engine_hashes=(1 << 32,), block_size=BS, tier=Tier.HOST), publisher="small"))
        times = []
        for seq in range(5):
            again = clears.model_copy(update={"seq": 10 + seq})
            gc.collect()
            t0 = time.perf_counter()
            assert index.apply(again).status == "applied"
            times.append(time.perf_counter() - t0)
        costs[big] = min(times)
        assert index.memberships == big  # the big publisher's facts are untouched
    assert costs[120_000] < 4 * costs[2_000], costs


def test_a_repeated_engine_hash_in_one_event_leaves_no_phantom():
    index = GlobalIndex(secret=SECRET)
    ref = ReferenceIndex(secret=SECRET)
    tokens = tuple(range(1, 64 * BS + 1))
    hashes = tuple([7] * 63 + [8])  # one engine hash for 63 different blocks, as a buggy engine may send
    b0 = batch(0, BlockStored(engine_hashes=hashes, token_ids=tokens, block_size=BS))
    index.apply(b0)
    ref.apply(b0)
    assert index.facts() == ref.nonempty_facts()  # only the last block hash 7 named, and hash 8's
    assert index.memberships == 2 and index.stats().blocks == 2
    copy = GlobalIndex(secret=SECRET)
    copy.restore(index.checkpoint(["w1"]))
    assert copy.facts() == index.facts()
    keys = BlockKeyer(scope(tenant=IDENT.tenant_namespace), BS, SECRET).keys(tokens)
    assert copy.lookup(scope(tenant=IDENT.tenant_namespace), keys) == index.lookup(scope(tenant=IDENT.tenant_namespace), keys)
    b1 = batch(1, BlockRemoved(engine_hashes=(7, 8)))
    index.apply(b1)
    ref.apply(b1)
    assert index.facts() == ref.nonempty_facts() == {}
    assert index.memberships == 0 and index.stats().blocks == 0  # no slot is left behind
    assert index.lookup(scope(tenant=IDENT.tenant_namespace), keys).matches == ()


def test_foreign_scope_keys_cost_what_absent_keys_cost():
    """Tenant B holds 30,000 blocks; a lookup in tenant A's scope with 512 of B's keys takes as
    long as one with 512 keys that exist nowhere (on 30ffd34: ~1.7x as long, a timing oracle)."""
    index = GlobalIndex(secret=SECRET)
    for b in runs(index, "w1", 0, 30_000, per_event=4096, tenant="tenant-b"):
        index.apply(b)
    index.apply(batch(0, BlockStored(engine_hashes=(1,), token_ids=(1, 2, 3, 4), block_size=BS, tenant_namespace="tenant-a"),
                      publisher="w2"))
    a, b = scope(tenant="tenant-a"), scope(tenant="tenant-b")
    b_keys = [k for _s, k in next(iter(index.facts().values()))][:512]
    assert len(index.lookup(b, b_keys).matches) == 1 and index.lookup(a, b_keys).matches == ()
    absent = [int.from_bytes(os.urandom(16), "big") for _ in range(512)]
    foreign_q, absent_q = np.array([[k >> 64, k & (2**64 - 1)] for k in b_keys], np.uint64), \
        np.array([[k >> 64, k & (2**64 - 1)] for k in absent], np.uint64)
    ratios = []
    for i in range(400):
        pair = []
        for q in ((foreign_q, absent_q) if i % 2 else (absent_q, foreign_q)):
            t0 = time.perf_counter_ns()
            index.lookup(a, q)
            pair.append(time.perf_counter_ns() - t0)
        ratios.append(pair[0] / pair[1] if i % 2 else pair[1] / pair[0])
    assert 0.8 < statistics.median(ratios) < 1.25, statistics.median(ratios)


def test_scope_and_keyer_tables_are_freed_with_their_blocks():
    """20,000 requests with distinct cache salts come and go: the index's tables shrink back
    (on 30ffd34 every salt's scope and keyer stayed for good: tens of MiB)."""
    index = GlobalIndex(secret=SECRET)
    index.apply(batch(0, BlockStored(engine_hashes=(1,), token_ids=(1, 2, 3, 4), block_size=BS)))

    def salted(seq, n, removed):
        events = []
        for i in range(n):
            h = 1000 + seq * n + i
            events.append(BlockRemoved(engine_hashes=(h,)) if removed else
                          BlockStored(engine_hashes=(h,), token_ids=(5, 6, 7, 8), block_size=BS, cache_salt=f"req-{h}"))
        return batch(seq + 1, *events)

    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for seq in range(20):
        index.apply(salted(seq * 2, 1000, False))
        index.apply(salted(seq * 2, 1000, True).model_copy(update={"seq": seq * 2 + 2}))
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert index.memberships == 1
    assert grown < 2 << 20, f"{grown} bytes kept after 20,000 salted requests left"
    assert index.stats().scopes == 1


def test_live_scopes_are_bounded_by_forgetting_the_least_recently_used():
    index = GlobalIndex(secret=SECRET, max_scopes=64)
    for seq in range(10):
        events = [BlockStored(engine_hashes=(seq * 100 + i,), token_ids=(1, 2, 3, 4), block_size=BS,
                              cache_salt=f"s-{seq}-{i}") for i in range(100)]
        index.apply(batch(seq, *events))
    stats = index.stats()
    assert stats.scopes <= 64 and stats.forgotten_scopes == 1000 - stats.scopes
    assert stats.forgotten_memberships == stats.forgotten_blocks == 1000 - index.memberships
    keys = BlockKeyer(scope(tenant=IDENT.tenant_namespace), BS, SECRET).keys((1, 2, 3, 4))
    newest = scope(tenant=IDENT.tenant_namespace, cache_salt="s-9-99")
    oldest = scope(tenant=IDENT.tenant_namespace, cache_salt="s-0-0")
    newest_keys = BlockKeyer(newest, BS, SECRET).keys((1, 2, 3, 4))
    assert index.lookup(newest, newest_keys).matches[0].prefix_blocks == 1
    assert index.lookup(oldest, BlockKeyer(oldest, BS, SECRET).keys((1, 2, 3, 4))).matches == ()
    assert index.lookup(scope(tenant=IDENT.tenant_namespace), keys).matches == ()
    assert len(index._keyers) <= 256


def test_pre_keyed_blocks_answer_as_blocks_keyed_from_tokens():
    tokens = tuple(range(100, 100 + 8 * BS))
    s = scope(tenant=IDENT.tenant_namespace)
    digests = BlockKeyer(s, BS, SECRET).digests(tokens)
    by_tokens = GlobalIndex(secret=SECRET)
    by_tokens.apply(batch(0, BlockStored(engine_hashes=tuple(range(8)), token_ids=tokens, block_size=BS)))
    keyed = GlobalIndex(secret=SECRET)
    keyed.apply_events("w1", 1, 0, IDENT, [KeyedBlocks(engine_hashes=np.arange(8, dtype="<u8").tobytes(),
                                                       keys=b"".join(digests))])
    keys = [int.from_bytes(d, "big") for d in digests]
    assert keyed.lookup(s, keys) == by_tokens.lookup(s, keys)
    assert keyed.facts() == by_tokens.facts()
    for ix in (keyed, by_tokens):  # the engine map came along: removals and tier events resolve
        ix.apply(batch(1, BlockRemoved(engine_hashes=(3,)), BlockStored(engine_hashes=(0, 1), block_size=BS, tier=Tier.HOST)))
    assert keyed.facts() == by_tokens.facts()
    with pytest.raises(ValueError):
        keyed.apply_events("w1", 1, 2, IDENT, [KeyedBlocks(engine_hashes=(1, 2), keys=b"".join(digests[:3]))])
    assert keyed.publisher_status("w1").next_seq == 2  # a refused batch changes nothing
