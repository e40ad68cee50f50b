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
from streams.bus import BatchSigner
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
