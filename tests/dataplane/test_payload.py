"""Payload addresses, headers and checksums: what binds bytes to the state they belong to."""

from __future__ import annotations

import numpy as np
import pytest

from nexuskv.dataplane.payload import (
    HEADER_BYTES,
    PayloadHeader,
    PayloadKey,
    payload_checksum,
    verify_payload,
)
from nexuskv.errors import IntegrityError

DID = "sd1-" + "a" * 32


def _data(n: int = 4096, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_header_packs_to_a_fixed_size_and_round_trips():
    key = PayloadKey(DID, 2**128 - 1, group=7)
    header = PayloadHeader.for_data(key, _data())
    raw = header.pack()
    assert len(raw) == HEADER_BYTES
    assert PayloadHeader.unpack(raw) == header


@pytest.mark.parametrize("position", [0, 1, 2047, 4095])
def test_one_flipped_byte_anywhere_is_caught(position):
    key = PayloadKey(DID, 42)
    data = _data()
    header = PayloadHeader.for_data(key, data)
    verify_payload(key, header, data)
    data[position] ^= 0x01
    with pytest.raises(IntegrityError, match="checksum"):
        verify_payload(key, header, data)


@pytest.mark.parametrize("other", [PayloadKey("sd1-" + "b" * 32, 42), PayloadKey(DID, 43), PayloadKey(DID, 42, 1)],
                         ids=["descriptor", "block", "group"])
def test_the_checksum_binds_the_address(other):
    key = PayloadKey(DID, 42)
    data = _data()
    header = PayloadHeader.for_data(key, data)
    assert payload_checksum(other, data) != header.checksum
    relabelled = PayloadHeader(key=other, nbytes=header.nbytes, checksum=header.checksum)
    with pytest.raises(IntegrityError, match="checksum"):
        verify_payload(other, relabelled, data)  # same bytes, another address: caught
    with pytest.raises(IntegrityError, match="names"):
        verify_payload(other, header, data)  # a header naming another payload: caught


def test_size_mismatch_and_garbage_headers_are_integrity_errors():
    key = PayloadKey(DID, 1)
    header = PayloadHeader.for_data(key, _data(100))
    with pytest.raises(IntegrityError, match="bytes"):
        verify_payload(key, header, _data(99))
    with pytest.raises(IntegrityError, match="magic"):
        PayloadHeader.unpack(b"X" * HEADER_BYTES)
    with pytest.raises(IntegrityError):
        PayloadHeader.unpack(b"short")


@pytest.mark.parametrize("bad", [dict(descriptor_id=""), dict(descriptor_id="é"), dict(descriptor_id="x" * 65),
                                 dict(key=-1), dict(key=2**128), dict(group=-1)])
def test_payload_keys_reject_what_the_header_cannot_carry(bad):
    fields = dict(descriptor_id=DID, key=1, group=0) | bad
    with pytest.raises(ValueError):
        PayloadKey(**fields)
