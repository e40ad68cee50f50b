"""The ``affinity`` arm's router: engine caches followed from vLLM's own KV-event payloads.

Payloads are the literal msgpack structures vLLM publishes (engines.md §1.5, the 0.33 tagged-map
form and the older positional form), so the router is checked against the wire, not against our
own encoder. The live test sends them over a real ZMQ PUB socket to the router's subscribers.
"""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import zmq

from connectors.zmq_events import RawBatch
from nexuskv.identity import BlockKeyer, IdentityScope
from streams.app.replay.affinity import AffinityRouter, EngineCaches, affinity_cost
from streams.app.replay.routing import Loads
from streams.bus.process import free_port

from tests.factories import descriptor

BS = 4
D = descriptor(block_size=BS)
KEYER = BlockKeyer(IdentityScope.of(D), BS)
PROMPT = list(range(100, 116))  # four blocks


def stored(hashes, parent, tokens, *, medium="GPU", **extra) -> dict:
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
            "token_ids": list(tokens), "block_size": BS, "lora_id": None, "medium": medium, "lora_name": None,
            "group_idx": 0, **extra}


def batch(seq: int, *events, restart: bool = False) -> RawBatch:
    return RawBatch("kv@e@m", seq, msgpack.packb([time.time(), list(events), 0], use_bin_type=True), restart=restart)


def test_stored_blocks_chain_from_their_parent_and_match_the_prompt_keys():
    caches = EngineCaches(KEYER, 2)
    caches.apply(0, batch(0, stored([11, 12], None, PROMPT[:8])))
    caches.apply(0, batch(1, stored([13], 12, PROMPT[8:12])))  # continues the run from hash 12
    keys = KEYER.keys(PROMPT)
    assert caches.overlap(0, keys) == 3 and caches.overlap(1, keys) == 0
    assert caches.stats["stored"] == 3 and caches.stats["batches"] == 2

    # The same tokens stored without their parent are a different prefix: never a hit for PROMPT.
    caches.apply(1, batch(0, stored([21], None, PROMPT[8:12])))
    assert caches.overlap(1, keys) == 0


def test_a_parent_never_announced_is_unresolved_and_keys_nothing():
    caches = EngineCaches(KEYER, 1)
    caches.apply(0, batch(0, stored([13, 14], 999, PROMPT[8:16])))
    assert caches.stats["unresolved"] == 2 and caches.stats["stored"] == 0
    assert caches.caches[0].held == {}


def test_removed_cleared_and_restart_forget_what_the_engine_dropped():
    caches = EngineCaches(KEYER, 1)
    keys = KEYER.keys(PROMPT)
    caches.apply(0, batch(0, stored([11, 12, 13], None, PROMPT[:12])))
    caches.apply(0, batch(1, {"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU", "group_idx": 0}))
    assert caches.overlap(0, keys) == 1 and caches.stats["removed"] == 1  # block 2 held, but not a prefix run
    caches.apply(0, batch(2, {"type": "BlockRemoved", "block_hashes": [11], "medium": "CPU", "group_idx": 0}))
    assert caches.overlap(0, keys) == 1  # a removal from another tier leaves the GPU block

    caches.apply(0, batch(3, {"type": "AllBlocksCleared"}))
    assert caches.overlap(0, keys) == 0 and caches.stats["cleared"] == 1

    caches.apply(0, batch(4, stored([11], None, PROMPT[:4])))
    caches.apply(0, batch(0, stored([31], None, [1, 2, 3, 4]), restart=True))  # a new engine incarnation
    assert caches.overlap(0, keys) == 0 and caches.stats["restarts"] == 1


def test_other_tiers_other_scopes_and_bad_payloads_are_counted_not_kept():
    caches = EngineCaches(KEYER, 1)
    caches.apply(0, batch(0, stored([11], None, [], medium="CPU")))  # vLLM's offload tier: no tokens
    caches.apply(0, batch(1, stored([12], None, PROMPT[:4], lora_name="adapter-a")))
    caches.apply(0, batch(2, stored([13], None, PROMPT[:4], extra_keys=[[["mm-hash", 3]]])))
    caches.apply(0, RawBatch("kv@e@m", 3, b"\xc1\xc1"))
    assert caches.stats["other_tiers"] == 1 and caches.stats["unkeyable"] == 2 and caches.stats["malformed"] == 1
    assert caches.caches[0].held == {} and caches.stats["batches"] == 3

    # Positional (pre-0.33) payloads decode the same way.
    caches.apply(0, RawBatch("kv@e@m", 4, msgpack.packb([1.0, [["BlockStored", [41], None, PROMPT[:4], BS, None]]],
                                                        use_bin_type=True)))
    assert caches.overlap(0, KEYER.keys(PROMPT)) == 1


def test_the_cost_is_queued_prefill_blocks_plus_uncached_prompt_blocks():
    assert affinity_cost(prompt_tokens=16, overlap_blocks=0, queued_prefill_tokens=0, block_size=BS) == 4
    assert affinity_cost(prompt_tokens=17, overlap_blocks=3, queued_prefill_tokens=8, block_size=BS) == 2 + 2
    assert affinity_cost(prompt_tokens=16, overlap_blocks=9, queued_prefill_tokens=0, block_size=BS) == 0


def route(router: AffinityRouter, tokens, loads: Loads) -> int:
    return asyncio.run(router.route("r", tokens, loads, 0.0)).engine


def test_route_prefers_the_cached_engine_until_its_queue_outweighs_the_overlap():
    router = AffinityRouter(D, ("w0", "w1"), endpoints=(("tcp://127.0.0.1:1", None),) * 2)
    router.caches.apply(1, batch(0, stored([11, 12, 13], None, PROMPT[:12])))
    loads = Loads.of(2)
    assert route(router, PROMPT, loads) == 1  # cost 1 on w1 against 4 on w0
    loads.sent(1, "busy", 4 * BS)  # four queued blocks on w1: 5 against 4
    assert route(router, PROMPT, loads) == 0


def test_ties_rotate_between_the_tied_engines():
    router = AffinityRouter(D, ("w0", "w1", "w2"), endpoints=(("tcp://127.0.0.1:1", None),) * 3)
    loads = Loads.of(3)
    assert [route(router, PROMPT, loads) for _ in range(4)] == [0, 1, 2, 0]


def test_mismatched_endpoints_fail_at_construction():
    with pytest.raises(ValueError, match="endpoints"):
        AffinityRouter(D, ("w0", "w1"), endpoints=(("tcp://127.0.0.1:1", None),))


def test_live_events_over_zmq_steer_the_route():
    ctx = zmq.Context()
    pubs = [ctx.socket(zmq.PUB) for _ in range(2)]
    ports = [free_port() for _ in pubs]
    for s, p in zip(pubs, ports, strict=True):
        s.bind(f"tcp://127.0.0.1:{p}")

    async def run() -> tuple[int, dict[str, int]]:
        router = AffinityRouter(D, ("w0", "w1"), endpoints=tuple((f"tcp://127.0.0.1:{p}", None) for p in ports),
                                topics=("kv@e0", "kv@e1"))
        await router.start()
        try:
            payload = msgpack.packb([time.time(), [stored([11, 12, 13, 14], None, PROMPT)], 0], use_bin_type=True)
            deadline = time.monotonic() + 10
            while router.stats["stored"] == 0 and time.monotonic() < deadline:  # slow joiner: resend
                pubs[1].send_multipart([b"kv@e1@m", (0).to_bytes(8, "big"), payload])
                await asyncio.sleep(0.05)
            routed = await router.route("r", PROMPT, Loads.of(2), 0.0)
            return routed.engine, router.stats
        finally:
            await router.stop()

    try:
        engine, stats = asyncio.run(run())
    finally:
        for s in pubs:
            s.close(linger=0)
        ctx.term()
    assert stats["stored"] == 4 and engine == 1
