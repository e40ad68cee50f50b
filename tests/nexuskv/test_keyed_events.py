"""kv-events version 2 (pre-keyed, msgspec): round trips, and every malformed payload refused with a reason."""

from __future__ import annotations

import json

import msgpack
import msgspec
import pytest

from nexuskv.contract import Contract, Key128
from nexuskv.contracts import codec
from nexuskv.contracts.keyed_events import (
    Cleared,
    KeyedBatch,
    KeyedStored,
    Removed,
    SnapshotMark,
    TierStored,
    encode_keyed,
    is_keyed_payload,
    keyed_schema,
    pack_hashes,
    to_jsonable,
    unpack_hashes,
)
from nexuskv.contracts.placement import PlacementHint
from nexuskv.contracts.topics import KV_EVENTS
from nexuskv.descriptor import Tier
from nexuskv.errors import ContractError, SchemaVersionError
from nexuskv.schemas import schema_documents

from tests.factories import publisher_identity

IDENT = publisher_identity()


def batch(events=None, **kw) -> KeyedBatch:
    events = events if events is not None else (
        KeyedStored(engine_hashes=pack_hashes([1, 2**64 - 1]), keys=bytes(range(32)), block_size=16, tier=Tier.HOST,
                    group=1, cache_salt="s"),
        TierStored(engine_hashes=pack_hashes([1]), tier=Tier.DISK),
        Removed(engine_hashes=pack_hashes([2**64 - 1])),
        Cleared(tier=Tier.GPU), Cleared(), SnapshotMark(phase="begin"), SnapshotMark(phase="end"))
    fields = dict(publisher="vllm/p/dp0", incarnation=2**62, seq=7, ts=1.5, identity=IDENT, events=tuple(events))
    fields.update(kw)
    return KeyedBatch(**fields)


def raw_map(**over) -> bytes:
    """A v2 payload built by hand (as another language's encoder would), with ``over`` replacing fields."""
    good = {"schema_version": 2, "publisher": "p", "incarnation": 1, "seq": 0, "ts": 0.0,
            "identity": IDENT.model_dump(mode="json"),
            "events": [{"type": "stored", "engine_hashes": b"\0" * 8, "keys": b"\1" * 16, "block_size": 4}]}
    good.update(over)
    return msgspec.msgpack.encode(good)


def test_round_trip_and_shape():
    b = batch()
    raw = codec.encode(KV_EVENTS, b)
    assert is_keyed_payload(raw) and raw[0] == 0x87  # a 7-field map whose first key is schema_version
    back = codec.decode(KV_EVENTS, raw)
    assert back == b and back.identity == IDENT and back.block_operations == 4
    assert unpack_hashes(back.events[0].engine_hashes) == [1, 2**64 - 1] and back.events[0].token_ids is None
    assert [e.type for e in back.events] == ["stored", "tier", "removed", "cleared", "cleared", "snapshot", "snapshot"]
    # the same batch from a foreign encoder (fields in another order) decodes the same
    plain = msgspec.to_builtins(b, builtin_types=(bytes,), enc_hook=lambda o: o.model_dump(mode="json"))
    reordered = msgpack.packb(dict(reversed(list(plain.items()))), use_bin_type=True)
    assert not is_keyed_payload(reordered) and codec.decode(KV_EVENTS, reordered) == b


def test_version_1_still_decodes_and_unknown_versions_are_named():
    from tests.factories import kv_batch

    v1 = kv_batch()
    assert codec.decode(KV_EVENTS, codec.encode(KV_EVENTS, v1)) == v1
    with pytest.raises(SchemaVersionError, match="schema_version 3 is not supported"):
        codec.decode(KV_EVENTS, raw_map(schema_version=3))


@pytest.mark.parametrize(("raw", "reason"), [
    (encode_keyed(batch())[:-5], "undecodable msgpack: Input data was truncated"),
    (encode_keyed(batch()) + b"\x00", "trailing characters"),
    (raw_map(events=[{"type": "stored", "engine_hashes": b"\0" * 8, "keys": b"\1" * 15, "block_size": 4}]),
     "events[0].keys: Expected `bytes` of length >= 16"),
    (raw_map(events=[{"type": "stored", "engine_hashes": b"\0" * 16, "keys": b"\1" * 16, "block_size": 4}]),
     "keys: 16 bytes for 2 engine hashes"),
    (raw_map(events=[{"type": "removed", "engine_hashes": b"\0" * 9}]), "not a whole number of 8-byte"),
    (raw_map(events=[{"type": "stored", "engine_hashes": b"\0" * 8 * 4097, "keys": b"\1" * 16 * 4097,
                      "block_size": 4}]), "events[0].engine_hashes"),
    (raw_map(events=[{"type": "stored", "engine_hashes": b"\0" * 8, "keys": b"\1" * 16, "block_size": 4,
                      "token_ids": b"\0" * 12}]), "token_ids: 12 bytes, not 1 blocks of 4"),
    (raw_map(events=[{"type": "stored", "engine_hashes": [1], "keys": b"\1" * 16, "block_size": 4}]),
     "Expected `bytes`, got `array`"),
    (raw_map(events=[{"type": "exploded"}]), "Invalid value 'exploded'"),
    (raw_map(events=[{"type": "removed", "engine_hashes": b"\0" * 8, "tier": "nvme"}]), "events[0].tier"),
    (raw_map(events=[{"type": "removed", "engine_hashes": b"\0" * 8, "group": 5000}]), "events[0].group"),
    (raw_map(extra=1), "unknown field `extra`"),
    (raw_map(seq=-1), "seq"),
    (raw_map(identity={"model": "m"}), "identity"),
    (raw_map(events=[{"type": "cleared"}] * 65537), "events"),
])
def test_malformed_payloads_are_refused_with_a_reason(raw, reason):
    with pytest.raises(ContractError) as info:
        codec.decode(KV_EVENTS, raw)
    assert reason in str(info.value)


def test_oversized_payload_is_refused_before_decoding():
    raw = raw_map(publisher="p" * 100) + b"\0" * (codec.MAX_PAYLOAD_BYTES)
    with pytest.raises(ContractError, match="exceeds"):
        codec.decode(KV_EVENTS, raw)


def test_building_a_bad_event_fails_in_code_too():
    with pytest.raises(ValueError, match="16 bytes per key"):
        KeyedStored(engine_hashes=pack_hashes([1]), keys=b"\0" * 8, block_size=4)


def test_json_forms_render_keys_as_hex():
    doc = to_jsonable(batch())
    assert doc["events"][0]["keys"] == [bytes(range(16)).hex(), bytes(range(16, 32)).hex()]
    assert doc["events"][0]["engine_hashes"] == ["0000000000000001", "ffffffffffffffff"]
    json.dumps(doc)  # plain JSON data

    class Keys(Contract):
        key: Key128
        keys: tuple[Key128, ...]

    big = 2**128 - 1
    text = Keys(key=big, keys=(0, 5)).model_dump_json()
    assert json.loads(text) == {"key": "f" * 32, "keys": ["0" * 32, "0" * 31 + "5"]}
    assert Keys.model_validate_json(text) == Keys(key=big, keys=(0, 5))
    assert Keys.model_validate({"key": 7, "keys": []}).key == 7  # ints written before keys were hex still read
    for bad in ("0x1", "F" * 32, "1" * 33, ""):
        with pytest.raises(ContractError):
            Keys.model_validate({"key": bad, "keys": []})


def test_placement_keys_are_hex_on_the_topic():
    from nexuskv.contracts.topics import PLACEMENT

    fields = PlacementHint.model_fields
    assert "keys" in fields and "prefix_root" in fields
    schema = schema_documents()["nexuskv.placement.schema.json"]
    assert '"pattern": "^[0-9a-f]{32}$"' in json.dumps(schema)
    assert PLACEMENT.encoding == "json"


def test_schema_documents_cover_both_versions():
    docs = schema_documents()
    v2 = docs["nexuskv.kv-events.v2.schema.json"]
    assert v2 == keyed_schema()
    stored = v2["$defs"]["KeyedStored"]["properties"]
    assert stored["keys"]["contentEncoding"] == "base64" and "token_ids" not in v2["$defs"]["KeyedStored"]["required"]
    assert "nexuskv.kv-events.schema.json" in docs


def test_a_renamed_kv_events_topic_reads_both_versions():
    import dataclasses

    renamed = dataclasses.replace(KV_EVENTS, name="test.kv-events.x")
    b = batch()
    assert codec.decode(renamed, codec.encode(renamed, b)) == b


def test_a_v2_publisher_speaks_only_for_the_worker_its_name_is_under():
    ident = IDENT.model_dump(mode="json")
    ok = codec.decode(KV_EVENTS, raw_map(publisher="vllm/p/dp0/disk", identity={**ident, "worker": "vllm/p/dp0"}))
    assert ok.identity.worker == "vllm/p/dp0"
    for publisher in ("vllm/q/dp0/disk", "vllm/p/dp00/disk"):
        with pytest.raises(ContractError, match="identity.worker"):
            codec.decode(KV_EVENTS, raw_map(publisher=publisher, identity={**ident, "worker": "vllm/p/dp0"}))
    with pytest.raises(ValueError, match="identity.worker"):
        batch(publisher="elsewhere/disk", identity=IDENT.model_copy(update={"worker": "vllm/p/dp0"}))
