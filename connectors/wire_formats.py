"""Encode events exactly as each engine version publishes them (the inverse of ``kv_wire``).

The struct layouts below are declared from the field tables of ``../shared/reference/engines.md``
(§1.5 for vLLM, §4.1 for SGLang) with the same msgspec options the engines use, so the bytes
match what a real engine of that version puts in frame 2 — including msgspec's quirks: an
``array_like`` struct emits every field (``omit_defaults`` does not apply to arrays), and a map
struct with more than 15 fields gets a map16 header.

Used by the vLLM-compatible publisher (so the reference engine can stand in for a vLLM or
SGLang engine on a real ZMQ socket) and by the wire-conformance tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from connectors.kv_wire import EngineCleared, EngineEvent, EngineRemoved, EngineStored

__all__ = ["WIRE_FORMATS", "WireFormat", "encode_batch"]

Hash = int | bytes
_Opt = Any  # msgspec field type for "anything, including None"

WireFormat = Literal["vllm-0.9", "vllm-0.23", "vllm-0.33", "sglang-0.5.10", "sglang-0.5.18", "sglang-0.5.23"]


@dataclass(frozen=True, slots=True)
class _Layout:
    batch: type
    stored: type
    removed: type
    cleared: type
    stored_fields: tuple[str, ...]
    removed_fields: tuple[str, ...]
    signed_hashes: bool  # SGLang publishes signed int64 hashes
    batch_has_rank: bool


def _defstruct(name: str, fields: list[tuple], *, array_like: bool, tag: bool = True,
               omit_defaults: bool = True) -> type:
    return msgspec.defstruct(name, fields, array_like=array_like, omit_defaults=omit_defaults, gc=False,
                             tag=name if tag else None, tag_field="type")


def _required(*names: str) -> list[tuple]:
    return [(n, _Opt) for n in names]


def _optional(*names: str) -> list[tuple]:
    return [(n, _Opt, None) for n in names]


def _layout(version: str, *, array_like: bool, stored: list[tuple], removed: list[tuple], rank: bool,
            signed: bool, batch_omit: bool = True) -> _Layout:
    batch_fields: list[tuple] = [("ts", float), ("events", list)]
    if rank:
        batch_fields.append(("data_parallel_rank", _Opt, None))
    return _Layout(
        batch=msgspec.defstruct(f"EventBatch_{version}", batch_fields, array_like=True, omit_defaults=batch_omit,
                                gc=False),
        stored=_defstruct("BlockStored", stored, array_like=array_like),
        removed=_defstruct("BlockRemoved", removed, array_like=array_like),
        cleared=_defstruct("AllBlocksCleared", [], array_like=array_like),
        stored_fields=tuple(f[0] for f in stored),
        removed_fields=tuple(f[0] for f in removed),
        signed_hashes=signed,
        batch_has_rank=rank,
    )


_VLLM_023_STORED = _required("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                             "lora_name") + _optional("extra_keys", "group_idx", "kv_cache_spec_kind",
                                                      "kv_cache_spec_sliding_window")
_VLLM_033_STORED = _VLLM_023_STORED + _optional("locality", "ownership", "session_id", "lookahead_token_ids")

WIRE_FORMATS: dict[str, _Layout] = {
    "vllm-0.9": _layout("vllm09", array_like=True, rank=False, signed=False,
                        stored=_required("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"),
                        removed=_required("block_hashes")),
    "vllm-0.23": _layout("vllm023", array_like=True, rank=True, signed=False, stored=_VLLM_023_STORED,
                         removed=_required("block_hashes", "medium") + _optional("group_idx")),
    "vllm-0.33": _layout("vllm033", array_like=False, rank=True, signed=False, stored=_VLLM_033_STORED,
                         removed=_required("block_hashes", "medium") + _optional("group_idx", "locality",
                                                                                 "ownership")),
    "sglang-0.5.10": _layout("sgl0510", array_like=True, rank=True, signed=True, batch_omit=False,
                             stored=_required("block_hashes", "parent_block_hash", "token_ids", "block_size",
                                              "lora_id", "medium"),
                             removed=_required("block_hashes", "medium")),
    "sglang-0.5.18": _layout("sgl0518", array_like=True, rank=True, signed=True, batch_omit=False,
                             stored=_required("block_hashes", "parent_block_hash", "token_ids", "block_size",
                                              "lora_id", "medium") + _optional("metadata"),
                             removed=_required("block_hashes", "medium")),
    "sglang-0.5.23": _layout("sgl0523", array_like=False, rank=True, signed=True, batch_omit=False,
                             stored=_required("block_hashes", "parent_block_hash", "token_ids", "block_size",
                                              "lora_id") + _optional("medium", "cache_salt", "session_id",
                                                                     "lora_name"),
                             removed=_required("block_hashes") + _optional("medium")),
}


def _signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def encode_batch(events: list[EngineEvent] | tuple[EngineEvent, ...], *, fmt: WireFormat, ts: float = 0.0,
                 data_parallel_rank: int | None = 0, hashes_as_bytes: bool = False,
                 raw_hashes: dict[int, bytes] | None = None) -> bytes:
    """The msgpack payload an engine of ``fmt`` publishes for ``events``.

    ``hashes_as_bytes`` emits 32-byte digests (vLLM with int hashes turned off): taken from
    ``raw_hashes`` (normalised int -> digest) when given, else the int left-padded to 32 bytes.
    """
    layout = WIRE_FORMATS[fmt]

    def h(value: int | None) -> Hash | None:
        if value is None:
            return None
        if hashes_as_bytes:
            return raw_hashes[value] if raw_hashes and value in raw_hashes else value.to_bytes(32, "big")
        return _signed(value) if layout.signed_hashes else value

    out = []
    for e in events:
        if isinstance(e, EngineStored):
            values = {
                "block_hashes": [h(x) for x in e.block_hashes],
                "parent_block_hash": h(e.parent_block_hash),
                "token_ids": list(e.token_ids),
                "block_size": e.block_size,
                "lora_id": e.lora_id,
                "medium": e.medium,
                "lora_name": e.lora_name,
                "extra_keys": None if e.extra_keys is None else [_thaw(x) for x in e.extra_keys],
                "group_idx": e.group_idx,
                "kv_cache_spec_kind": e.spec_kind,
                "kv_cache_spec_sliding_window": e.sliding_window,
                "cache_salt": e.cache_salt,
                "metadata": {"cache_salt": e.cache_salt} if e.cache_salt is not None else None,
            }
            stored, names = layout.stored, layout.stored_fields
            if fmt == "sglang-0.5.18" and e.cache_salt is None:  # 0.5.18 adds `metadata` on salted stores only
                plain = WIRE_FORMATS["sglang-0.5.10"]
                stored, names = plain.stored, plain.stored_fields
            out.append(stored(**{k: values.get(k) for k in names}))
        elif isinstance(e, EngineRemoved):
            values = {"block_hashes": [h(x) for x in e.block_hashes], "medium": e.medium, "group_idx": e.group_idx}
            out.append(layout.removed(**{k: values.get(k) for k in layout.removed_fields}))
        elif isinstance(e, EngineCleared):
            out.append(layout.cleared())
        else:  # pragma: no cover - EngineEvent is closed
            raise TypeError(type(e).__name__)
    batch = layout.batch(ts, out, data_parallel_rank) if layout.batch_has_rank else layout.batch(ts, out)
    return msgspec.msgpack.encode(batch)


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value
