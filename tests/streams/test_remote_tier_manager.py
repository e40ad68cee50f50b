"""The remote tier's owner on Apache Kafka and the real Mooncake Store.

Writers put objects and offer them on ``nexuskv.tier-offers``; the owner admits them (announced
under its own publisher), evicts by utility once its capacity is reached instead of refusing the
saves, refuses an offer whose stored header is not the offered one, collects an object nobody
offered, dead-letters a malformed offer with the reason, and publishes the tier's price on
``nexuskv.tier-state``. At the end an index rebuilt from the owner's ``nexuskv.kv-events`` holds
exactly what the store holds.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import torch

from nexuskv.admission import ReuseModel
from nexuskv.contracts.control_signature import ControlVerifier, ReplayWindow, producer_key
from nexuskv.contracts.dead_letter import DeadLetter
from nexuskv.contracts.keyed_events import KeyedBatch
from nexuskv.contracts.tier_state import TierStateRecord
from nexuskv.contracts.topics import DEAD_LETTER, KV_EVENTS, TIER_OFFERS, TIER_STATE
from nexuskv.dataplane.backend import host_view
from nexuskv.dataplane.payload import HEADER_BYTES, PayloadHeader, PayloadKey
from nexuskv.dataplane.remote_ledger import RemoteLedger
from nexuskv.dataplane.remote_offers import save_and_offer
from nexuskv.dataplane.tier_facts import TierFacts
from nexuskv.descriptor import Tier
from nexuskv.index import GlobalIndex
from streams.bus.clients import ControlSigner, make_producer, send
from streams.bus.topic_keys import route
from streams.bus.topics import ensure_topics
from streams.remote_tier_manager import RemoteTierBus, RemoteTierOwner

from tests.dataplane.tiering import BLOCK_BYTES, BLOCK_TOKENS, IDENTITY, chain_tokens, save_blocks
from tests.streams.test_tier_manager import _collect

TIMEOUT_S = 60
OBJ = BLOCK_BYTES + HEADER_BYTES
SECRET = b"remote-tier-test-secret-0123456789"


async def _until(check, timeout_s: float = TIMEOUT_S, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = await asyncio.to_thread(check)
        if got:
            return got
        await asyncio.sleep(0.2)
    raise AssertionError(f"{what} not met in {timeout_s}s")


@pytest.mark.broker
async def test_the_owner_admits_evicts_collects_and_keeps_its_index_true(kafka_url, remote_backend):
    await ensure_topics(kafka_url, partitions=2)
    name = f"remote-{uuid.uuid4().hex[:8]}"
    holder: list[RemoteTierBus] = []
    # The ledger owns 40 objects' worth of the store (high watermark: 36, low: 32), so it fills.
    ledger = RemoteLedger(40 * OBJ, low_watermark=0.8, high_watermark=0.9, lease_s=30.0,
                          reuse=ReuseModel(half_life_s=5.0))
    owner = RemoteTierOwner(remote_backend, ledger, TierFacts(name, lambda b: holder[0].publish_batch(b)), name=name)
    # Under a bus secret: offers are taken only when signed by a writer, once.
    bus = RemoteTierBus(kafka_url, owner, state_interval_s=0.2, sweep_interval_s=0.5, group_id=f"test-{name}",
                        verifier=ControlVerifier(SECRET, window=ReplayWindow(max_age_s=300)))
    writer = ControlSigner("writer/w-test", key=producer_key(SECRET, "writer/w-test"))
    holder.append(bus)
    stop = asyncio.Event()
    task = asyncio.create_task(bus.run(stop))
    producer = make_producer(kafka_url, client_id="test-remote-writer")
    await producer.start()
    try:
        await asyncio.wait_for(bus.ready.wait(), TIMEOUT_S)
        recurring = save_blocks(chain_tokens(1, 4))
        written = sent = 0
        for i in range(30):  # 4 recurring blocks and 120 one-off ones through 36 objects of room
            chains = [recurring] if i % 3 == 0 else []
            chains.append(save_blocks(chain_tokens(100 + i, 4)))
            for j, chain in enumerate(chains):
                save = await asyncio.to_thread(save_and_offer, remote_backend, chain, writer="w-test", tenant="acme",
                                               identity=IDENTITY, block_size=BLOCK_TOKENS, offer_id=f"o-{i}-{j}",
                                               now=time.time())
                assert save.failed == 0, save.reasons  # the owner keeps room: no put fails
                written += save.written + save.already
                for offer in save.offers:
                    await send(producer, *route(offer), offer, control=writer)
                    sent += 1
            # The headroom of 40 objects is for the saves of one round in flight, not for 160 at once.
            await _until(lambda: bus.offers >= sent, what=f"{sent} offers decided")
        assert written == 160  # the recurring chain is offered again each time (written again once evicted)
        await _until(lambda: bus.offers >= 40, what="every offer decided")
        rkeys = [b.key for b in recurring]
        assert all(ledger.holds(k) for k in rkeys), (ledger.counters, owner.counters)  # reused state stays
        assert ledger.counters["evicted"] > 0 and ledger.held_bytes() <= ledger.high_bytes
        assert all(remote_backend.header(k) is not None for k in rkeys)
        ledger.lease_s = 1.0  # from here on, what is not offered within a second is garbage
        # An offer whose stored object is not the one offered is refused and admits nothing.
        forged = save_blocks(chain_tokens(900, 1))
        save = await asyncio.to_thread(save_and_offer, remote_backend, forged, writer="w-test", tenant="acme",
                                       identity=IDENTITY, block_size=BLOCK_TOKENS, offer_id="forged", now=time.time())
        (offer,) = save.offers
        bad = offer.model_copy(update={"blocks": (offer.blocks[0].model_copy(update={"checksum": 1}),)})
        await send(producer, *route(bad), bad, control=writer)
        # An unsigned offer, and one signed by a producer that is not a writer, are dead-lettered
        # and change nothing (here: the blocks would have been admitted otherwise).
        stray = save_blocks(chain_tokens(901, 2))
        save = await asyncio.to_thread(save_and_offer, remote_backend, stray, writer="w-test", tenant="acme",
                                       identity=IDENTITY, block_size=BLOCK_TOKENS, offer_id="stray", now=time.time())
        (offer,) = save.offers
        await send(producer, *route(offer), offer)
        planner = ControlSigner("planner/p", key=producer_key(SECRET, "planner/p"))
        await send(producer, *route(offer), offer.model_copy(update={"offer_id": "stray-2"}), control=planner)
        # A malformed offer is dead-lettered with the reason.
        value = b"not an offer"
        await producer.send_and_wait(TIER_OFFERS.name, value, key=b"w-test",
                                     headers=[writer.header(TIER_OFFERS, b"w-test", value)])
        # An object nobody offers is collected after the lease (as is the forged one).
        orphan = PayloadKey("tiny-desc", (77 << 64) | 1)
        data = torch.full((BLOCK_BYTES,), 3, dtype=torch.uint8)
        await asyncio.to_thread(remote_backend.put, PayloadHeader.for_data(orphan, host_view(data)), data)
        await _until(lambda: all(remote_backend.header(k) is None for k in (orphan, forged[0].key, stray[0].key)),
                     what="unoffered objects collected")
        assert not any(ledger.holds(b.key) for b in stray)
        assert not ledger.holds(forged[0].key) and owner.counters["header_mismatch"] >= 1
        letters = await _collect(kafka_url, DEAD_LETTER, lambda d: isinstance(d, DeadLetter)
                                 and d.source_topic == TIER_OFFERS.name and d.payload == b"not an offer",
                                 until=lambda ds: len(ds) >= 1)
        assert letters[0].reason and letters[0].service == "remote-tier-manager"
        refused = await _collect(kafka_url, DEAD_LETTER, lambda d: isinstance(d, DeadLetter)
                                 and d.source_topic == TIER_OFFERS.name and b"stray" in d.payload,
                                 until=lambda ds: len(ds) >= 2)
        reasons = " | ".join(d.reason for d in refused)
        assert "unsigned" in reasons and "may not send here" in reasons, reasons
        states = await _collect(kafka_url, TIER_STATE, lambda r: isinstance(r, TierStateRecord) and r.worker == name,
                                until=lambda rs: any(r.counters.get("evicted", 0) > 0 for r in rs))
        last = states[-1]
        assert last.tier is Tier.REMOTE and last.capacity_bytes == 40 * OBJ
        assert last.used_bytes + last.reserved_bytes <= last.capacity_bytes and last.price_s_per_gib >= 0
    finally:
        stop.set()
        await asyncio.wait_for(task, TIMEOUT_S)
        await producer.stop()

    # An index rebuilt from the owner's events holds exactly what the store holds.
    index = GlobalIndex()
    batches = await _collect(kafka_url, KV_EVENTS, lambda b: isinstance(b, KeyedBatch) and b.publisher == name,
                             until=lambda bs: len(bs) >= owner.facts.batches)
    for b in sorted(batches, key=lambda b: b.seq):
        index.apply(b)
    facts = {k for (pub, tier, _g), members in index.facts().items() if pub == name and tier is Tier.REMOTE
             for _scope, k in members}
    held = {k.key for k in remote_backend.keys()}
    assert facts == {k.key for k in ledger.keys()} == held
    assert index.stats().unresolved_blocks == 0 and index.stats().uncertain_publishers == 0
