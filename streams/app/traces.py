"""Mooncake FAST'25 request traces: the format, read into frozen values.

One JSON object per line: ``timestamp`` (ms since the trace's start), ``input_length`` and
``output_length`` (tokens), ``hash_ids`` (one id per 512-token block; an id stands for the block
*and its whole prefix*, so equal ids mean a reusable prefix). No text is included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from nexuskv.errors import ContractError

__all__ = ["HASH_BLOCK_TOKENS", "TraceRequest", "load_trace"]

HASH_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path, *, limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests of a trace file (all when None); a bad line names itself."""
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                out.append(TraceRequest(int(row["timestamp"]), int(row["input_length"]), int(row["output_length"]),
                                        tuple(int(h) for h in row["hash_ids"])))
            except (ValueError, KeyError, TypeError) as exc:
                raise ContractError(f"{path}:{number}: not a trace request ({type(exc).__name__}: {exc})") from None
    return out
