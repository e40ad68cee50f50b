"""Decode vLLM's and SGLang's KV-event payloads, every published version, into one shape.

Both engines publish a msgpack ``EventBatch`` per engine step (``../shared/reference/engines.md``
§1.5, §4.1). The outer batch is always an array ``[ts, events(, data_parallel_rank)]``; events
are *arrays* (tag first, fields by position: vLLM ≤ 0.23, SGLang ≤ 0.5.18) or *maps* (tag under
``"type"``, fields by name: vLLM ≥ 0.24, SGLang ≥ 0.5.20). Older engines send fewer fields and
newer ones more: missing trailing fields take their defaults, unknown trailing fields and
unknown map keys are ignored, so a decoder written today reads tomorrow's engine (the fields it
knows keep their meaning; that is the engines' own compatibility rule).

Positions of ``BlockStored`` fields (after the tag):

=======  ====================================================================================
engine   positional fields
=======  ====================================================================================
vLLM     block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
         extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window
SGLang   block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, metadata
         (0.5.18: ``{"cache_salt": str}`` on salted stores)
=======  ====================================================================================

SGLang's EAGLE speculative decoding keys its radix tree by *bigrams*: a page's ``token_ids`` are
pairs ``[t_i, t_i+1]`` (SGLang ``mem_cache/events.py``), which chain (each pair's second token
is the next pair's first). Such a page is decoded as its first tokens, and each block gets the
extra key ``("sglang-eagle-next", t)``, ``t`` the token after the block that its last pair adds:
an EAGLE page holds the draft model's state for the next token too, and SGLang's own page hash
covers both tokens, so its blocks key apart from a plain engine's. Pairs that do not chain are
a :class:`~nexuskv.errors.ContractError`.

Hashes are normalised to unsigned 64-bit ints: an int (vLLM's unsigned low 64 bits, SGLang's
signed high 64 bits) modulo 2**64; 32-byte digests (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``)
by their last 8 bytes big-endian, as llm-d and Dynamo do. Anything else is a
:class:`~nexuskv.errors.ContractError` with the reason, never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgpack

from nexuskv.errors import ContractError

__all__ = [
    "Engine",
    "EngineStored",
    "EngineRemoved",
    "EngineCleared",
    "EngineEvent",
    "EngineBatch",
    "decode_engine_batch",
    "normalise_hash",
    "EAGLE_NEXT",
]

Engine = Literal["vllm", "sglang"]
_MASK64 = (1 << 64) - 1
_MAX_PAYLOAD = 64 * 1024 * 1024

_VLLM_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
_SGLANG_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "metadata")
_REMOVED = ("block_hashes", "medium", "group_idx")
#: The extra key of an EAGLE (bigram) block: ``(EAGLE_NEXT, token after the block)``.
EAGLE_NEXT = "sglang-eagle-next"


@dataclass(frozen=True, slots=True)
class EngineStored:
    """An engine's BlockStored, normalised. ``token_ids`` is empty for a tier (offload) event.

    Decoded as published: ``len(token_ids) == len(block_hashes) * block_size`` holds for
    ordinary events only (engines.md's own example and EAGLE bigram tokens break it); whether
    an event can be keyed is decided where it is translated (:mod:`streams.bridge`).
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    spec_kind: str | None = None
    sliding_window: int | None = None
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class EngineRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class EngineCleared:
    pass


EngineEvent = EngineStored | EngineRemoved | EngineCleared


@dataclass(frozen=True, slots=True)
class EngineBatch:
    ts: float
    events: tuple[EngineEvent, ...]
    data_parallel_rank: int | None = None


def normalise_hash(value: Any, *, field: str = "block_hashes") -> int:
    """An engine block hash as an unsigned 64-bit int."""
    if isinstance(value, bool):
        raise ContractError(f"{field}: a boolean is not a block hash")
    if isinstance(value, int):
        if not -(1 << 63) <= value <= _MASK64:
            raise ContractError(f"{field}: {value} does not fit 64 bits")
        return value & _MASK64
    if isinstance(value, (bytes, bytearray)):
        if not 1 <= len(value) <= 64:
            raise ContractError(f"{field}: a {len(value)}-byte hash")
        return int.from_bytes(bytes(value)[-8:], "big")
    raise ContractError(f"{field}: expected int or bytes, got {type(value).__name__}")


def decode_engine_batch(payload: bytes, engine: Engine = "vllm") -> EngineBatch:
    """One engine ``EventBatch`` payload (the third ZMQ frame) to an :class:`EngineBatch`."""
    if len(payload) > _MAX_PAYLOAD:
        raise ContractError(f"payload of {len(payload)} bytes exceeds {_MAX_PAYLOAD}")
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            UnicodeDecodeError) as exc:
        raise ContractError(f"undecodable msgpack: {type(exc).__name__}: {exc}"[:300]) from None
    if isinstance(batch, dict):  # defensive: an outer batch that became a map
        ts = batch.get("ts")
        events = batch.get("events")
        dp_rank = batch.get("data_parallel_rank", batch.get("attn_dp_rank", batch.get("dp_rank")))
    elif isinstance(batch, list) and len(batch) >= 2:
        ts, events = batch[0], batch[1]
        dp_rank = batch[2] if len(batch) > 2 else None
    else:
        raise ContractError("EventBatch: expected [ts, events(, data_parallel_rank)]")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise ContractError(f"EventBatch.ts: expected a number, got {type(ts).__name__}")
    if not isinstance(events, list):
        raise ContractError(f"EventBatch.events: expected an array, got {type(events).__name__}")
    if dp_rank is not None and (not isinstance(dp_rank, int) or isinstance(dp_rank, bool) or dp_rank < 0):
        raise ContractError(f"EventBatch.data_parallel_rank: invalid {dp_rank!r}")
    decoded = tuple(_event(e, engine, i) for i, e in enumerate(events))
    return EngineBatch(ts=float(ts), events=decoded, data_parallel_rank=dp_rank)


def _event(raw: Any, engine: Engine, index: int) -> EngineEvent:
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise ContractError(f"events[{index}]: an array event starts with its tag")
        tag, fields = raw[0], _positional(raw[0], raw[1:], engine, index)
    elif isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise ContractError(f"events[{index}]: a map event needs a string 'type'")
        fields = raw
    else:
        raise ContractError(f"events[{index}]: expected an array or a map, got {type(raw).__name__}")
    where = f"events[{index}]"
    if tag == "BlockStored":
        return _stored(fields, where)
    if tag == "BlockRemoved":
        return EngineRemoved(block_hashes=_hashes(fields, where), medium=_opt_str(fields, "medium", where),
                             group_idx=_opt_int(fields, "group_idx", where))
    if tag == "AllBlocksCleared":
        return EngineCleared()
    raise ContractError(f"{where}: unknown event tag {tag!r}")


def _positional(tag: str, values: list[Any], engine: Engine, index: int) -> dict[str, Any]:
    if tag == "BlockStored":
        names = _VLLM_STORED if engine == "vllm" else _SGLANG_STORED
    elif tag == "BlockRemoved":
        names = _REMOVED
    else:
        names = ()
    # Shorter arrays are older engines (missing fields take defaults); longer ones are newer
    # engines whose extra trailing fields this decoder does not know.
    return dict(zip(names, values))


def _stored(f: dict[str, Any], where: str) -> EngineStored:
    hashes = _hashes(f, where)
    if "token_ids" not in f or "block_size" not in f:
        raise ContractError(f"{where}: BlockStored needs token_ids and block_size")
    block_size = f["block_size"]
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 0:
        raise ContractError(f"{where}.block_size: expected a non-negative int")
    tokens, next_tokens = _token_ids(f["token_ids"], block_size, len(hashes), where)
    parent = f.get("parent_block_hash")
    extra = f.get("extra_keys")
    if extra is not None:
        if not isinstance(extra, list) or len(extra) != len(hashes):
            raise ContractError(f"{where}.extra_keys: expected one entry per block")
        extra = tuple(_freeze(e) for e in extra)
    if next_tokens is not None:
        eagle = tuple((EAGLE_NEXT, t) for t in next_tokens)
        extra = eagle if extra is None else tuple(e if x is None else (x, e) for x, e in zip(extra, eagle))
    metadata = f.get("metadata")
    salt = f.get("cache_salt")
    if salt is None and isinstance(metadata, dict):
        salt = metadata.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise ContractError(f"{where}.cache_salt: expected a string")
    return EngineStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else normalise_hash(parent, field=f"{where}.parent_block_hash"),
        token_ids=tuple(tokens),
        block_size=block_size,
        medium=_opt_str(f, "medium", where),
        lora_id=_opt_int(f, "lora_id", where),
        lora_name=_opt_str(f, "lora_name", where),
        extra_keys=extra,
        group_idx=_opt_int(f, "group_idx", where),
        spec_kind=_opt_str(f, "kv_cache_spec_kind", where),
        sliding_window=_opt_int(f, "kv_cache_spec_sliding_window", where),
        cache_salt=salt,
    )


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < (1 << 32)


def _token_ids(raw: Any, block_size: int, blocks: int, where: str) -> tuple[list[int], list[int] | None]:
    """Plain token ids, or EAGLE bigram pairs as (first tokens, the token after each block)."""
    if not isinstance(raw, list):
        raise ContractError(f"{where}.token_ids: expected an array of ints")
    if not raw or not isinstance(raw[0], list):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
            raise ContractError(f"{where}.token_ids: expected an array of ints or of [int, int] pairs")
        if not all(_is_id(t) for t in raw):
            raise ContractError(f"{where}.token_ids: ids must be in [0, 2**32)")
        return raw, None
    if not all(isinstance(p, list) and len(p) == 2 and _is_id(p[0]) and _is_id(p[1]) for p in raw):
        raise ContractError(f"{where}.token_ids: EAGLE bigrams must be [int, int] pairs of ids in [0, 2**32)")
    if any(raw[i][1] != raw[i + 1][0] for i in range(len(raw) - 1)):
        raise ContractError(f"{where}.token_ids: EAGLE bigrams do not chain (a pair's second token is not the "
                            "next pair's first)")
    if block_size < 1 or len(raw) != blocks * block_size:
        raise ContractError(f"{where}.token_ids: {len(raw)} EAGLE bigrams do not fill {blocks} blocks of "
                            f"{block_size}")
    return [p[0] for p in raw], [raw[(i + 1) * block_size - 1][1] for i in range(blocks)]


def _hashes(f: dict[str, Any], where: str) -> tuple[int, ...]:
    raw = f.get("block_hashes")
    if not isinstance(raw, list) or not raw:
        raise ContractError(f"{where}.block_hashes: expected a non-empty array")
    return tuple(normalise_hash(h, field=f"{where}.block_hashes") for h in raw)


def _opt_str(f: dict[str, Any], name: str, where: str) -> str | None:
    value = f.get(name)
    if value is not None and not isinstance(value, str):
        raise ContractError(f"{where}.{name}: expected a string or nil")
    return value


def _opt_int(f: dict[str, Any], name: str, where: str) -> int | None:
    value = f.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise ContractError(f"{where}.{name}: expected an int or nil")
    return value


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value
