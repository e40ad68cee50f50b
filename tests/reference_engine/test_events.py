"""The runtime's lifecycle events and observations: what an index and a calibrator consume."""

from __future__ import annotations

import hashlib
import struct

import pytest

from nexuskv.contracts import codec
from nexuskv.contracts.keyed_events import Cleared, KeyedBatch, KeyedStored, Removed, TierStored, unpack_hashes
from nexuskv.contracts.observations import ObservationRecord, PrefillObservation
from nexuskv.contracts.topics import KV_EVENTS, OBSERVATIONS
from nexuskv.dataplane import DiskBackend, HostMemoryBackend
from nexuskv.descriptor import Tier
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.reference_engine import ReferenceEngine, ReferenceModelSpec, engine_hashes

PROMPT = [(5 * i + 1) % 256 for i in range(18)]


class Sink(list):
    @property
    def batches(self) -> list[KeyedBatch]:
        return [r for r in self if isinstance(r, KeyedBatch)]

    @property
    def observations(self) -> list[PrefillObservation]:
        return [r.observation for r in self if isinstance(r, ObservationRecord)]

    def events(self, kind):
        return [e for b in self.batches for e in b.events if isinstance(e, kind)]


def test_engine_hash_matches_its_documented_formula():
    tokens = list(range(8))
    parent = 0
    expected = []
    for i in range(2):
        h = hashlib.sha256(b"nexuskv-reference/1" + parent.to_bytes(8, "big")
                           + struct.pack("<4I", *tokens[4 * i:4 * i + 4])).digest()
        parent = int.from_bytes(h[:8], "big")
        expected.append(parent)
    assert engine_hashes(tokens + [9, 9], 4) == expected


def test_stored_events_carry_canonical_keys_and_engine_hashes():
    sink = Sink()
    rt = ReferenceEngine(ReferenceModelSpec.gqa(), publisher=sink.append, incarnation=7, worker="w-a")
    rt.prefill(PROMPT[:9])
    rt.prefill(PROMPT)
    stored = sink.events(KeyedStored)
    assert [len(e) for e in stored] == [2, 2]  # blocks 0-1, then 2-3
    hashes = engine_hashes(PROMPT, 4)
    assert unpack_hashes(stored[0].engine_hashes) == hashes[:2] and unpack_hashes(stored[1].engine_hashes) == hashes[2:4]
    assert all(e.token_ids is None for e in stored) and stored[0].tier is Tier.GPU  # no prompt content on the bus
    batches = sink.batches
    assert [b.seq for b in batches] == [0, 1] and {b.incarnation for b in batches} == {7}
    assert batches[0].publisher == "nexuskv-reference/w-a"
    assert batches[0].identity.descriptor_id == rt.describe().descriptor_id
    # the runtime keyed the blocks canonically, in the scope of the batch's identity (not by engine hash)
    ident = batches[0].identity
    scope = IdentityScope(tenant_namespace=ident.tenant_namespace, model=ident.model,
                          model_revision=ident.model_revision, tokenizer_revision=ident.tokenizer_revision,
                          descriptor_id=ident.descriptor_id)
    keys = b"".join(e.keys for e in stored)
    assert keys == b"".join(BlockKeyer(scope, 4).digests(PROMPT[:16]))
    assert [int.from_bytes(keys[i:i + 16], "big") for i in range(0, 64, 16)] == rt.block_keys(PROMPT)
    assert set(hashes).isdisjoint(rt.block_keys(PROMPT))
    for b in batches:  # every batch survives the topic codec
        assert codec.decode(KV_EVENTS, codec.encode(KV_EVENTS, b)) == b


def test_evictions_are_removed_events_and_reset_clears():
    sink = Sink()
    rt = ReferenceEngine(ReferenceModelSpec.gqa(), publisher=sink.append, num_pages=4)
    a, b = PROMPT[:16], [200 + i % 50 for i in range(16)]
    rt.prefill(a)
    rt.prefill(b)  # four new pages: a's four are evicted, deepest first
    removed = sink.events(Removed)
    a_hashes = engine_hashes(a, 4)
    assert [h for e in removed for h in unpack_hashes(e.engine_hashes)] == a_hashes[::-1]
    assert rt.cached_blocks() == 4 and rt.lookup(a).tokens == 0
    rt.reset()
    assert isinstance(sink.batches[-1].events[-1], Cleared) and sink.batches[-1].events[-1].tier is Tier.GPU
    assert rt.cached_blocks() == 0


def test_the_hybrid_announces_checkpoints_in_their_own_group():
    sink = Sink()
    rt = ReferenceEngine(ReferenceModelSpec.hybrid(), publisher=sink.append)
    rt.prefill(PROMPT)  # 18 tokens: 4 blocks, checkpoints after 8 and 16
    stored = sink.events(KeyedStored)
    groups = [(e.group, unpack_hashes(e.engine_hashes)) for e in stored]
    hashes = engine_hashes(PROMPT, 4)
    assert groups == [(0, hashes[:4]), (1, [hashes[1]]), (1, [hashes[3]])]
    assert stored[2].keys == stored[0].keys[48:64]  # the checkpoint after block 3 names block 3's state


def test_prefills_are_observed_for_calibration():
    sink = Sink()
    rt = ReferenceEngine(ReferenceModelSpec.mla(), publisher=sink.append, profile="cpu-test", worker="w-o")
    rt.prefill(PROMPT[:9])
    rt.prefill(PROMPT)
    first, second = sink.observations
    assert (first.uncached_tokens, first.context_tokens) == (9, 9)
    assert (second.uncached_tokens, second.context_tokens) == (10, 18)
    assert first.model == "nexuskv-reference/mla" and first.profile == "cpu-test" and first.worker == "w-o"
    assert first.duration_s > 0
    for r in sink:
        if isinstance(r, ObservationRecord):
            assert codec.decode(OBSERVATIONS, codec.encode(OBSERVATIONS, r)) == r


def test_save_announces_tier_copies_and_load_announces_restored_blocks(tmp_path):
    sink = Sink()
    writer = ReferenceEngine(ReferenceModelSpec.gqa(), publisher=sink.append)
    writer.prefill(PROMPT)
    disk = DiskBackend(tmp_path, 1 << 20)
    writer.save(PROMPT, disk)
    tier_event = sink.batches[-1].events[0]
    assert tier_event.tier is Tier.DISK and isinstance(tier_event, TierStored)
    assert unpack_hashes(tier_event.engine_hashes) == engine_hashes(PROMPT, 4)
    quiet = Sink()
    writer2 = ReferenceEngine(ReferenceModelSpec.gqa(), publisher=quiet.append)
    writer2.prefill(PROMPT)
    writer2.save(PROMPT, HostMemoryBackend(1 << 20), announce=False)
    assert not any(e.tier is Tier.HOST for e in quiet.events(KeyedStored) + quiet.events(TierStored))

    reader_sink = Sink()
    reader = ReferenceEngine(ReferenceModelSpec.gqa(), publisher=reader_sink.append)
    reader.load(PROMPT, disk)
    (loaded,) = reader_sink.events(KeyedStored)
    assert loaded.tier is Tier.GPU and loaded.keys == b"".join(BlockKeyer(reader.scope, 4).digests(PROMPT[:16]))


@pytest.mark.parametrize("bad", [[], [256], [-1]])
def test_bad_prompts_are_refused(bad):
    from nexuskv.errors import IdentityError

    with pytest.raises(IdentityError):
        ReferenceEngine(ReferenceModelSpec.gqa()).prefill(bad)
