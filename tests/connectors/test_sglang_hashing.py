import hashlib

from connectors.kv_wire import normalise_hash
from connectors.sglang.hashing import event_hash, event_hash_signed, page_hash_hex, page_hashes_hex


def test_page_chain_matches_the_definition():
    p0 = hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in (1, 2))).hexdigest()
    p1 = hashlib.sha256(bytes.fromhex(p0) + b"".join(t.to_bytes(4, "little") for t in (3, 4))).hexdigest()
    assert page_hashes_hex([1, 2, 3, 4, 5], 2) == [p0, p1]
    assert page_hash_hex([(7, 8)]) == page_hash_hex([7, 8])  # EAGLE bigram tokens hash both elements


def test_event_hash_signed_and_normalised_agree():
    digest = "ff" * 32
    assert event_hash_signed(digest) == -1
    assert event_hash(digest) == 2**64 - 1 == normalise_hash(event_hash_signed(digest))
    small = "00000000000000ff" + "00" * 24
    assert event_hash_signed(small) == event_hash(small) == 255
