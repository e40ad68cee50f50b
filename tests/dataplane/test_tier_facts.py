"""A tier manager's facts as version 2 events: the keys it holds, token ids only when asked for."""

from __future__ import annotations

from nexuskv.contracts.keyed_events import Cleared, KeyedStored, Removed, TierStored, unpack_hashes
from nexuskv.dataplane.tier_facts import (
    BlockIdentity,
    TierFacts,
    event_hash,
    moved_events,
    removed_events,
    stored_events,
)
from nexuskv.descriptor import Tier

from tests.factories import publisher_identity

IDENT = publisher_identity()
KEYS = [(7 << 100) | i for i in range(1, 4)]


def _blocks():
    parent = None
    out = []
    for i, k in enumerate(KEYS):
        out.append((k, BlockIdentity(IDENT, (i, i + 1), 2, parent=parent)))
        parent = k
    return out


def test_stored_runs_carry_the_keys_and_tokens_only_when_asked():
    (plain,) = stored_events(_blocks(), Tier.HOST, 0)
    assert plain.keys == b"".join(k.to_bytes(16, "big") for k in KEYS) and plain.token_ids is None
    assert unpack_hashes(plain.engine_hashes) == [event_hash(k) for k in KEYS]
    (withtok,) = stored_events(_blocks(), Tier.HOST, 0, include_tokens=True)
    assert withtok.token_ids == b"".join(t.to_bytes(4, "little") for t in (0, 1, 1, 2, 2, 3))
    salted = [(k, BlockIdentity(IDENT, b.tokens, 2, cache_salt="s" if i == 1 else None))
              for i, (k, b) in enumerate(_blocks())]
    assert [len(e) for e in stored_events(salted, Tier.HOST, 0)] == [1, 1, 1]  # one run per scope
    (moved,) = moved_events(KEYS, Tier.DISK, 1)
    (gone,) = removed_events(KEYS[:1], Tier.HOST, 0)
    assert isinstance(moved, TierStored) and moved.group == 1 and isinstance(gone, Removed)


def test_an_incarnation_starts_with_a_full_clear():
    sent = []
    facts = TierFacts("w0", sent.append, clock=lambda: 1.0)
    facts.start(IDENT)
    facts.queue(stored_events(_blocks(), Tier.HOST, 0), IDENT)
    assert facts.flush() == 2
    assert sent[0].events == (Cleared(),) and isinstance(sent[1].events[0], KeyedStored)
    assert [b.seq for b in sent] == [0, 1]


def test_blocks_known_by_key_only_are_announced_without_token_ids():
    keyed = [(k, BlockIdentity(IDENT, (), 2, parent=KEYS[i - 1] if i else None)) for i, k in enumerate(KEYS)]
    (run,) = stored_events(keyed, Tier.REMOTE, 0, include_tokens=True)
    assert run.token_ids is None and run.keys == b"".join(k.to_bytes(16, "big") for k in KEYS)
    mixed = [keyed[0], (KEYS[1], BlockIdentity(IDENT, (1, 2), 2, parent=KEYS[0]))]
    first, second = stored_events(mixed, Tier.REMOTE, 0, include_tokens=True)  # runs split on having tokens
    assert first.token_ids is None and second.token_ids is not None
