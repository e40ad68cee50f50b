"""The reference engine's own block hashes (its "engine hashes"), distinct from canonical keys.

An engine names its blocks with its own hashes and publishes them in ``BlockStored`` /
``BlockRemoved``; NexusKV maps them to canonical keys from the token ids of ``BlockStored``.
The reference engine's hash is deliberately *not* the canonical key, so consumers exercise
that mapping as they must for vLLM or SGLang::

    h_i = first 8 bytes, big-endian, of SHA-256("nexuskv-reference/1" || h_{i-1} as 8 bytes big-endian
                                                || tokens of block i as uint32 little-endian)
    h_{-1} = 0

Unkeyed, unscoped (no tenant, model or descriptor), 64-bit, chained over the prefix — like
SGLang's page hash. Equal prefixes give equal hashes in every process.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from nexuskv.identity import EngineBlockHash

__all__ = ["engine_hashes"]

_DOMAIN = hashlib.sha256(b"nexuskv-reference/1")


def engine_hashes(tokens: Sequence[int], block_size: int) -> list[EngineBlockHash]:
    """Hashes of every full block of ``tokens``."""
    packed = array("I", tokens).tobytes()
    stride = 4 * block_size
    out: list[EngineBlockHash] = []
    parent = 0
    for i in range(len(tokens) // block_size):
        h = _DOMAIN.copy()
        h.update(parent.to_bytes(8, "big"))
        h.update(packed[i * stride:(i + 1) * stride])
        parent = int.from_bytes(h.digest()[:8], "big")
        out.append(EngineBlockHash(parent))
    return out
