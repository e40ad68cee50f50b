"""The kv-events intake without a broker: who may publish for a publisher, where its records must
be, and the sliced decoder giving what the codec gives."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import msgpack
import pytest

from nexuskv.contracts import codec
from nexuskv.contracts.kv_signature import SIGNATURE_HEADER, publisher_key, sign, verify
from nexuskv.contracts.topics import KV_EVENTS
from nexuskv.errors import ContractError, UnauthenticatedError
from streams.bus.clients import BatchSigner
from streams.kv_intake import INLINE_BYTES, KvIntake, Slicer, partition_of

from benchmarks._attack import replay

BUS = b"intake-test-bus-secret"


@dataclass
class Record:
    key: bytes | None
    value: bytes
    partition: int
    headers: tuple = ()


def _record(batch, signer=None, *, key=None, partition=None, partitions=4):
    raw_key = batch.publisher.encode() if key is None else key
    value = codec.encode(KV_EVENTS, batch)
    header = signer.header(batch.publisher, raw_key, value) if signer is not None else None
    part = partition_of(raw_key, partitions) if partition is None else partition
    return Record(raw_key, value, part, (header,) if header else ())


@pytest.fixture(scope="module")
def batches():
    return replay(limit=12, workers=2)[1]


def test_a_signature_binds_key_and_value_to_the_publishers_key():
    key = publisher_key(BUS, "vllm/a/dp0")
    tag = sign(key, b"vllm/a/dp0", b"payload")
    assert verify(key, b"vllm/a/dp0", b"payload", tag) is None
    assert "does not match" in verify(key, b"vllm/a/dp0", b"payload!", tag)
    assert "does not match" in verify(key, b"vllm/b/dp0", b"payload", tag)
    assert "does not match" in verify(publisher_key(BUS, "vllm/b/dp0"), b"vllm/a/dp0", b"payload", tag)
    assert "version" in verify(key, b"vllm/a/dp0", b"payload", b"\x02" + tag[1:])
    assert verify(key, b"k", b"v", None) == f"no {SIGNATURE_HEADER} header"
    assert publisher_key(BUS, "a") != publisher_key(BUS + b"x", "a")


def test_the_intake_refuses_unsigned_foreign_misplaced_and_misattributed_records(batches):
    intake = KvIntake(KV_EVENTS, partitions=4, bus_secret=BUS)
    genuine = BatchSigner(bus_secret=BUS)
    b = batches[0]
    assert intake.batch(_record(b, genuine)) == b
    with pytest.raises(UnauthenticatedError, match="no nexuskv-sig header"):
        intake.batch(_record(b))
    mallory = BatchSigner(keys={b.publisher: publisher_key(BUS, "mallory")})
    with pytest.raises(UnauthenticatedError, match="does not match"):
        intake.batch(_record(b, mallory))
    with pytest.raises(ContractError, match="belongs on partition"):
        intake.batch(_record(b, genuine, partition=(partition_of(b.publisher.encode(), 4) + 1) % 4))
    other = batches[1].publisher if batches[1].publisher != b.publisher else "someone-else"
    impostor = Record(other.encode(), codec.encode(KV_EVENTS, b), partition_of(other.encode(), 4))
    impostor.headers = ((SIGNATURE_HEADER, sign(publisher_key(BUS, other), other.encode(), impostor.value)),)
    with pytest.raises(ContractError, match="keyed by its batch's publisher"):
        intake.batch(impostor)
    with pytest.raises(ContractError, match="no key"):
        intake.batch(Record(None, b"", 0))
    assert KvIntake(KV_EVENTS, partitions=4).batch(_record(b)) == b  # no bus secret: no signature needed


def test_sliced_decoding_gives_what_the_codec_gives(batches):
    async def both(raw: bytes):
        try:
            want = codec.decode(KV_EVENTS, raw)
        except ContractError as exc:
            want = str(exc).split(" (+")[0]
        try:
            from streams.kv_intake import _decode_sliced

            got = await _decode_sliced(raw, Slicer())
        except ContractError as exc:
            got = str(exc).split(" (+")[0]
        return want, got

    async def main():
        big = [b for b in batches if len(codec.encode(KV_EVENTS, b)) > INLINE_BYTES]
        assert big
        for b in big:
            want, got = await both(codec.encode(KV_EVENTS, b))
            assert got == want == b
        doc = msgpack.unpackb(codec.encode(KV_EVENTS, big[0]), raw=False)
        cases = []
        for change in ({"events": [{"type": "cleared"}] * 5000 + [{"type": "exploded"}]},
                       {"events": [{"type": "cleared"}] * 70_000}, {"seq": "seven"}, {"schema_version": 2},
                       {"events": [{"type": "removed", "engine_hashes": list(range(5000))}] * 10},
                       {"events": "x" * 40_000}, {"identity": None}):
            cases.append(msgpack.packb({**doc, **change}))
        reordered = {"events": [{"type": "exploded"}] * 3000, **{k: v for k, v in doc.items() if k != "events"}}
        cases.append(msgpack.packb({**reordered, "schema_version": 3}))
        cases.append(msgpack.packb([1] * 20_000))
        cases.append(cases[0] + b"\x01")
        for raw in cases:
            want, got = await both(raw)
            assert isinstance(want, str) and got == want

    asyncio.run(main())


def test_version_2_records_take_the_same_checks(batches):
    """Pre-keyed batches: signed over their raw bytes like any record, decoded in slices when large,
    with the same reasons as the codec gives."""
    from nexuskv.contracts.keyed_events import encode_keyed
    from nexuskv.edge_keys import EdgeKeyer
    from streams.kv_intake import _decode_keyed_sliced

    keyers: dict[str, EdgeKeyer] = {}
    keyed = [keyers.setdefault(b.publisher, EdgeKeyer(b"intake-identity")).key_batch(b) for b in batches]
    intake = KvIntake(KV_EVENTS, partitions=4, bus_secret=BUS)
    genuine = BatchSigner(bus_secret=BUS)
    for k in keyed[:3]:
        assert intake.batch(_record(k, genuine)) == k
    with pytest.raises(UnauthenticatedError, match="no nexuskv-sig header"):
        intake.batch(_record(keyed[0]))
    forged = _record(keyed[0], genuine)
    forged.value = forged.value.replace(keyed[0].publisher.encode(), keyed[0].publisher.encode()[:-1] + b"X")
    with pytest.raises(UnauthenticatedError, match="does not match"):
        intake.batch(forged)

    async def main():
        from nexuskv.contracts.keyed_events import Cleared, KeyedBatch

        big = KeyedBatch(publisher="p", incarnation=1, seq=0, ts=0.0, identity=keyed[0].identity,
                         events=tuple(e for k in keyed for e in k.events) + (Cleared(),) * 20_000)
        raw = encode_keyed(big)
        assert len(raw) > INLINE_BYTES
        slicer = Slicer(slice_s=0.0)
        assert await _decode_keyed_sliced(raw, slicer) == codec.decode(KV_EVENTS, raw) == big
        assert slicer.pauses > 1
        assert await intake.take(_record(big, genuine), Slicer()) == big
        broken = raw.replace(b"\xa7cleared", b"\xa7clearex", 1)
        with pytest.raises(ContractError) as sliced:
            await _decode_keyed_sliced(broken, Slicer())
        with pytest.raises(ContractError) as whole:
            codec.decode(KV_EVENTS, broken)
        assert str(sliced.value) == str(whole.value) and "events[" in str(whole.value)
        with pytest.raises(ContractError, match="truncated"):
            await _decode_keyed_sliced(raw[:-3], Slicer())

    asyncio.run(main())
