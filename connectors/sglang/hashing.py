"""SGLang's page hash (``../shared/reference/engines.md`` §4.1), reproduced.

Per page of ``page_size`` tokens: ``digest_i = SHA256(digest_{i-1} || token ids as uint32
little-endian)`` with no prior digest for page 0 (EAGLE bigram tokens hash both elements). The
hex digest is the HiCache storage key of the page; KV events carry the first 8 bytes as a
signed int64 (``int(hex[:16], 16)`` mapped to two's complement), which NexusKV normalises to an
unsigned 64-bit int like every engine hash.

Not reproduced: 0.5.23's namespaced event hashes (LoRA / extra-key / dynamo-format salt), whose
seed encoding the reference does not pin down; NexusKV never needs to recompute an engine's
hash from tokens (it keys blocks canonically and maps engine hashes as they arrive).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from nexuskv.identity import EngineBlockHash

__all__ = ["page_hash_hex", "page_hashes_hex", "event_hash", "event_hash_signed"]


def page_hash_hex(token_ids: Sequence[int | tuple[int, ...]], prior_hash: str | None = None) -> str:
    """The hex SHA-256 of one page, chained onto ``prior_hash`` (hex, or None at the start)."""
    hasher = hashlib.sha256()
    if prior_hash:
        hasher.update(bytes.fromhex(prior_hash))
    for t in token_ids:
        for elem in (t if isinstance(t, tuple) else (t,)):
            hasher.update(int(elem).to_bytes(4, "little", signed=False))
    return hasher.hexdigest()


def page_hashes_hex(token_ids: Sequence[int], page_size: int, prior_hash: str | None = None) -> list[str]:
    """Hex hashes of every full page of ``token_ids`` (a short last page is never hashed)."""
    out: list[str] = []
    prev = prior_hash
    for i in range(len(token_ids) // page_size):
        prev = page_hash_hex(token_ids[i * page_size:(i + 1) * page_size], prev)
        out.append(prev)
    return out


def event_hash_signed(hex_digest: str) -> int:
    """What SGLang publishes: the first 64 bits of the digest as a signed int64."""
    value = int(hex_digest[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


def event_hash(hex_digest: str) -> EngineBlockHash:
    """The same hash normalised to unsigned 64 bits, as NexusKV's kv-events carry it."""
    return EngineBlockHash(int(hex_digest[:16], 16))
