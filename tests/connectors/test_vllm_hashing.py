"""vLLM's block hash, reproduced: the test vectors of engines.md §2.2 (vLLM 0.33.0 hashing.py)."""

import pytest

from nexuskv.errors import IdentityError

from tests.connectors.vllm_hashing import (
    VllmBlockHasher,
    hash_block_tokens,
    none_hash,
    request_block_hashes,
    to_event_hash,
)


def test_default_seed_none_hash():
    assert none_hash().hex() == "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"


def test_first_two_blocks_and_their_event_ints():
    digests = request_block_hashes(list(range(1, 33)))
    assert digests[0].hex() == "cd7c51bc5a8fc8643f383a2b9e01522fba7473c669e9270c7b0bf7bf7fd01682"
    assert to_event_hash(digests[0]) == 8866452693264111234
    assert digests[1].hex().startswith("2533ea50") and digests[1].hex().endswith("d87bf3bf")
    assert to_event_hash(digests[1]) == 807986237951177663


def test_pythonhashseed_zero():
    nh = none_hash(python_hash_seed="0")
    assert nh.hex().startswith("4e1195df") and nh.hex().endswith("2e61c3e")
    block = hash_block_tokens(None, range(1, 17), none=nh)
    assert block.hex().startswith("202da172") and block.hex().endswith("e6d332ea")
    assert to_event_hash(block) == 3236607068019569386
    assert VllmBlockHasher(python_hash_seed="0").event_hashes(list(range(1, 17))) == [3236607068019569386]


def test_pickle_sha256_none_hash():
    nh = none_hash("sha256")
    assert nh.hex().startswith("066b1e89") and nh.hex().endswith("f0d71198")


def test_irreproducible_configurations_say_so():
    with pytest.raises(IdentityError, match="PYTHONHASHSEED"):
        none_hash(vllm_version="0.25.1")
    assert none_hash(vllm_version="0.25.1", python_hash_seed="0") == none_hash(python_hash_seed="0")
    with pytest.raises(IdentityError, match="xxhash"):
        none_hash("xxhash")


def test_partial_blocks_are_not_hashed_and_extra_keys_count():
    hasher = VllmBlockHasher(block_size=16)
    assert len(hasher.digests(list(range(40)))) == 2
    with pytest.raises(IdentityError):
        hasher.digests(list(range(32)), extra_keys=[None])
    salted = hasher.digests(list(range(16)), extra_keys=[("tenant-salt",)])
    assert salted != hasher.digests(list(range(16)))
