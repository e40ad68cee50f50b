"""Wire conformance: every engine version's KV-event payloads decode to the expected events.

Golden payloads are written here as the literal msgpack structures of engines.md's field tables
(§1.5 vLLM, §4.1 SGLang) — positional arrays or tagged maps — independently of
``connectors.wire_formats``; the encoder is then checked to produce byte-identical payloads.
"""

from __future__ import annotations

import msgpack
import pytest

from connectors.kv_wire import EngineCleared, EngineRemoved, EngineStored, decode_engine_batch, normalise_hash
from connectors.wire_formats import encode_batch
from nexuskv.errors import ContractError

H1, H2 = 1234605616436508552, 153  # 0x1122334455667788 and 0x99
BIG = 2**64 - 5  # a vLLM unsigned hash >= 2**63 (msgpack uint64, 0xcf)
NEG = -5  # SGLang publishes signed int64


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# (name, engine, payload structure, expected events, expected dp rank)
GOLDEN = [
    ("vllm-0.9", "vllm",
     [1.5, [["BlockStored", [H1, H2], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None],
            ["BlockRemoved", [H2]], ["AllBlocksCleared"]]],
     [EngineStored(block_hashes=(H1, H2), parent_block_hash=None, token_ids=(1, 2, 3, 4, 5, 6, 7, 8), block_size=4),
      EngineRemoved(block_hashes=(H2,)), EngineCleared()], None),
    ("vllm-0.23-array-int-extra-keys", "vllm",
     [1.5, [["BlockStored", [H1, BIG], H2, list(range(8)), 4, None, "GPU", "adapter-a",
             [["salt-1"], None], 1, "sliding_window", 128],
            ["BlockRemoved", [BIG], "GPU", 1], ["AllBlocksCleared"]], 0],
     [EngineStored(block_hashes=(H1, BIG), parent_block_hash=H2, token_ids=tuple(range(8)), block_size=4, medium="GPU",
                   lora_name="adapter-a", extra_keys=(("salt-1",), None), group_idx=1, spec_kind="sliding_window",
                   sliding_window=128),
      EngineRemoved(block_hashes=(BIG,), medium="GPU", group_idx=1), EngineCleared()], 0),
    ("vllm-0.23-bytes-hashes", "vllm",
     [2.0, [["BlockStored", [bytes(24) + H1.to_bytes(8, "big")], bytes(32), [9, 9], 2, 3, "GPU", None, None, 0,
             "full_attention", None]], 2],
     [EngineStored(block_hashes=(H1,), parent_block_hash=0, token_ids=(9, 9), block_size=2, medium="GPU", lora_id=3,
                   group_idx=0, spec_kind="full_attention")], 2),
    ("vllm-0.23-offload-tier-event", "vllm",
     [3.0, [["BlockStored", [H1, H2], None, [], 0, None, "CPU", None, None, 0, None, None]], 0],
     [EngineStored(block_hashes=(H1, H2), parent_block_hash=None, token_ids=(), block_size=0, medium="CPU",
                   group_idx=0)], 0),
    ("vllm-0.33-map", "vllm",
     [1.5, [{"type": "BlockStored", "block_hashes": [H1, H2], "parent_block_hash": None, "token_ids": list(range(8)),
             "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None,
             "extra_keys": [None, [["mm-hash", 3]]], "group_idx": 0, "kv_cache_spec_kind": "mla_attention",
             "locality": "LOCAL", "session_id": "s-1", "lookahead_token_ids": [[1], [2]]},
            {"type": "BlockRemoved", "block_hashes": [H2], "medium": "GPU", "group_idx": 0, "ownership": "x"},
            {"type": "AllBlocksCleared"}], 0],
     [EngineStored(block_hashes=(H1, H2), parent_block_hash=None, token_ids=tuple(range(8)), block_size=4,
                   medium="GPU", extra_keys=(None, (("mm-hash", 3),)), group_idx=0, spec_kind="mla_attention"),
      EngineRemoved(block_hashes=(H2,), medium="GPU", group_idx=0), EngineCleared()], 0),
    ("vllm-0.33-offload-storage", "vllm",
     [4.0, [{"type": "BlockStored", "block_hashes": [H2], "parent_block_hash": None, "token_ids": [],
             "block_size": 0, "lora_id": None, "medium": "STORAGE", "lora_name": None, "group_idx": 0,
             "locality": "LOCAL"}], 1],
     [EngineStored(block_hashes=(H2,), parent_block_hash=None, token_ids=(), block_size=0, medium="STORAGE",
                   group_idx=0)], 1),
    ("sglang-0.5.10-array", "sglang",
     [1.5, [["BlockStored", [NEG, 7], None, [1, 2, 3, 4], 2, None, "GPU"], ["BlockRemoved", [NEG], "GPU"],
            ["AllBlocksCleared"]], 0],
     [EngineStored(block_hashes=(2**64 - 5, 7), parent_block_hash=None, token_ids=(1, 2, 3, 4), block_size=2,
                   medium="GPU"),
      EngineRemoved(block_hashes=(2**64 - 5,), medium="GPU"), EngineCleared()], 0),
    ("sglang-0.5.18-salted", "sglang",
     [1.5, [["BlockStored", [NEG], 11, [1, 2], 2, None, "CPU_PINNED", {"cache_salt": "tenant-b"}]], 3],
     [EngineStored(block_hashes=(2**64 - 5,), parent_block_hash=11, token_ids=(1, 2), block_size=2,
                   medium="CPU_PINNED", cache_salt="tenant-b")], 3),
    ("sglang-0.5.23-map", "sglang",
     [1.5, [{"type": "BlockStored", "block_hashes": [NEG], "parent_block_hash": None, "token_ids": [1, 2],
             "block_size": 2, "lora_id": None, "medium": "GPU", "cache_salt": "s", "lora_name": "l"},
            {"type": "BlockRemoved", "block_hashes": [NEG], "medium": "GPU"}, {"type": "AllBlocksCleared"}], 0],
     [EngineStored(block_hashes=(2**64 - 5,), parent_block_hash=None, token_ids=(1, 2), block_size=2, medium="GPU",
                   cache_salt="s", lora_name="l"),
      EngineRemoved(block_hashes=(2**64 - 5,), medium="GPU"), EngineCleared()], 0),
]


@pytest.mark.parametrize(("name", "engine", "structure", "expected", "rank"), GOLDEN, ids=[g[0] for g in GOLDEN])
def test_golden_batches_decode_to_the_expected_events(name, engine, structure, expected, rank):
    batch = decode_engine_batch(pack(structure), engine)
    assert batch.events == tuple(expected)
    assert batch.ts == structure[0]
    assert batch.data_parallel_rank == rank


def test_engines_md_decoded_examples_decode_exactly():
    # §1.5 "Verified byte examples": the same logical batch as vLLM 0.23.0 and 0.33.0 publish it.
    v023 = [1.5, [["BlockStored", [1234605616436508552, 153], None, [1, 2, 3, 4], 4, None, "GPU", None,
                   [None, ["tenantA"]], 0, None, None], ["BlockRemoved", [153], "GPU", 0], ["AllBlocksCleared"]], 0]
    v033 = [1.5, [{"type": "BlockStored", "block_hashes": [1234605616436508552, 153], "parent_block_hash": None,
                   "token_ids": [1, 2, 3, 4], "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None,
                   "extra_keys": [None, ["tenantA"]], "group_idx": 0},
                  {"type": "BlockRemoved", "block_hashes": [153], "medium": "GPU", "group_idx": 0},
                  {"type": "AllBlocksCleared"}], 0]
    sgl = [1.5, [{"type": "BlockStored", "block_hashes": [-5], "parent_block_hash": None, "token_ids": [1, 2],
                  "block_size": 2, "lora_id": None, "medium": "GPU"},
                 {"type": "BlockRemoved", "block_hashes": [-5], "medium": "GPU"}, {"type": "AllBlocksCleared"}], 0]
    a, b = decode_engine_batch(pack(v023)), decode_engine_batch(pack(v033))
    assert a == b
    stored = a.events[0]
    assert stored.block_hashes == (1234605616436508552, 153) and stored.token_ids == (1, 2, 3, 4)
    assert stored.extra_keys == (None, ("tenantA",)) and stored.medium == "GPU" and stored.group_idx == 0
    assert a.events[1] == EngineRemoved(block_hashes=(153,), medium="GPU", group_idx=0)
    assert decode_engine_batch(pack(sgl), "sglang").events[0].block_hashes == (2**64 - 5,)
    # The hex prefixes quoted in engines.md, reproduced by our encoder.
    events = list(a.events)
    assert encode_batch(events, fmt="vllm-0.23", ts=1.5).hex().startswith(
        "93cb3ff8000000000000939cab" + b"BlockStored".hex() + "92cf1122334455667788cc99c094010203040" + "4c0a3"
        + b"GPU".hex() + "c0")
    assert encode_batch(events, fmt="vllm-0.33", ts=1.5).hex().startswith(
        "93cb3ff800000000000093de000aa4" + b"type".hex() + "ab" + b"BlockStored".hex() + "ac" + b"block_hashes".hex())


#: Golden array payloads and the format that must reproduce them byte for byte. (Map payloads
#: carry optional fields in whatever subset the engine set, so they are checked by decoding.)
ENCODABLE = {"vllm-0.9": "vllm-0.9", "vllm-0.23-array-int-extra-keys": "vllm-0.23",
             "vllm-0.23-offload-tier-event": "vllm-0.23", "sglang-0.5.10-array": "sglang-0.5.10",
             "sglang-0.5.18-salted": "sglang-0.5.18"}


@pytest.mark.parametrize("name", sorted(ENCODABLE))
def test_our_encoder_reproduces_each_versions_bytes(name):
    _, engine, structure, expected, rank = next(g for g in GOLDEN if g[0] == name)
    raw = encode_batch(expected, fmt=ENCODABLE[name], ts=structure[0], data_parallel_rank=rank)
    assert raw == pack(structure)
    assert decode_engine_batch(raw, engine).events == tuple(expected)


@pytest.mark.parametrize("fmt", ["vllm-0.9", "vllm-0.23", "vllm-0.33", "sglang-0.5.10", "sglang-0.5.18",
                                 "sglang-0.5.23"])
def test_round_trip_every_format(fmt):
    engine = "sglang" if fmt.startswith("sglang") else "vllm"
    stored = EngineStored(block_hashes=(1, 2**64 - 1), parent_block_hash=2**63, token_ids=(5, 6, 7, 8),
                          block_size=2, medium=None if fmt == "vllm-0.9" else "GPU")
    events = [stored, EngineRemoved(block_hashes=(1,), medium=stored.medium), EngineCleared()]
    out = decode_engine_batch(encode_batch(events, fmt=fmt, ts=9.0), engine)
    assert out.events == tuple(events)


def test_tolerates_older_shorter_and_newer_longer_events():
    shorter = [1.0, [["BlockStored", [1], None, [1, 2], 2]]]  # fewer fields than even 0.9
    assert decode_engine_batch(pack(shorter)).events[0].medium is None
    longer = [1.0, [["BlockStored", [1], None, [1, 2], 2, None, "GPU", None, None, 0, None, None, "future", 42],
                    ["BlockRemoved", [1], "GPU", 0, "LOCAL", "owner", "more"]], 0, "extra-batch-field"]
    out = decode_engine_batch(pack(longer))
    assert out.events[0].medium == "GPU" and out.events[1] == EngineRemoved(block_hashes=(1,), medium="GPU", group_idx=0)
    mapped = [1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2],
                     "block_size": 2, "brand_new": {"x": 1}}], 0]
    assert decode_engine_batch(pack(mapped)).events[0].token_ids == (1, 2)
    as_map = {"ts": 2.0, "events": [["AllBlocksCleared"]], "data_parallel_rank": 4}
    assert decode_engine_batch(pack(as_map)).data_parallel_rank == 4


def test_hash_normalisation():
    assert normalise_hash(-1) == 2**64 - 1
    assert normalise_hash(5) == 5
    assert normalise_hash(b"\x01" * 24 + (7).to_bytes(8, "big")) == 7
    assert normalise_hash(b"\x07") == 7
    for bad in (True, 2**64, -(2**63) - 1, 1.5, "abc", b""):
        with pytest.raises(ContractError):
            normalise_hash(bad)


@pytest.mark.parametrize(
    "structure",
    [
        b"\xc1",
        [1.0],
        ["ts", []],
        [1.0, {"not": "a list"}],
        [1.0, [["NewEventType", 1]]],
        [1.0, [{"no": "type"}]],
        [1.0, [["BlockStored", "nope", None, [], 0]]],
        [1.0, [["BlockStored", [1], None, [-1, 2], 2]]],
        [1.0, [["BlockStored", [1], None, [1, 2]]]],
        [1.0, [["BlockStored", [], None, [], 2]]],
        [1.0, [["BlockRemoved", [1], 7]]],
        [1.0, [["BlockStored", [1], None, [1, 2], 2, None, "GPU", None, ["a", "b"]]]],
        [1.0, [], -1],
    ],
)
def test_malformed_payloads_raise_with_a_reason(structure):
    raw = structure if isinstance(structure, bytes) else pack(structure)
    with pytest.raises(ContractError) as info:
        decode_engine_batch(raw)
    assert str(info.value)
