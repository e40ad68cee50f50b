"""vLLM's own prefix-cache block hash, reproduced (``../shared/reference/engines.md`` §2).

vLLM hashes each full block as ``hash_fn((parent_hash, tuple(block_token_ids), extra_keys))``
with ``parent_hash = NONE_HASH`` for block 0, and publishes the low 64 bits (last 8 bytes,
big-endian, unsigned) in its KV events. ``sha256_cbor`` (SHA-256 over canonical CBOR) is the
cross-language reproducible choice; ``sha256`` (over pickle) is Python-only.

``NONE_HASH`` depends on the vLLM version and on ``PYTHONHASHSEED``:

====================  =====================================================================
vLLM                  NONE_HASH
====================  =====================================================================
0.10.2 – 0.28.x       seed set: ``hash_fn(seed)``; unset: ``os.urandom(32)`` (not reproducible)
0.30.0 – 0.33.x       seed set: ``hash_fn(seed)``; unset: ``hash_fn("vllm-none-hash")`` for
                      sha256 / sha256_cbor, a random seed for the xxhash functions
====================  =====================================================================

Where vLLM's NONE_HASH is random, no external party can reproduce its hashes; this module says
so (IdentityError) instead of returning hashes that will never match.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cbor2

from nexuskv.errors import IdentityError
from nexuskv.identity import EngineBlockHash

__all__ = [
    "DEFAULT_NONE_HASH_SEED",
    "HASH_FUNCTIONS",
    "sha256_cbor",
    "sha256_pickle",
    "none_hash",
    "hash_block_tokens",
    "request_block_hashes",
    "to_event_hash",
    "VllmBlockHasher",
]

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_MASK64 = (1 << 64) - 1


def sha256_cbor(obj: Any) -> bytes:
    """``hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()`` (vLLM ``sha256_cbor``)."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def sha256_pickle(obj: Any) -> bytes:
    """vLLM's default ``sha256``: SHA-256 over the highest-protocol pickle (Python-only)."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {"sha256_cbor": sha256_cbor, "sha256": sha256_pickle}


def _version_tuple(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise IdentityError(f"vllm_version: cannot parse {version!r}") from None


def none_hash(algo: str = "sha256_cbor", *, python_hash_seed: str | None = None, vllm_version: str = "0.33") -> bytes:
    """The NONE_HASH (parent of block 0) a vLLM engine of ``vllm_version`` uses."""
    fn = _fn(algo)
    if python_hash_seed is not None:
        return fn(python_hash_seed)
    if _version_tuple(vllm_version) >= (0, 30):
        return fn(DEFAULT_NONE_HASH_SEED)
    raise IdentityError(
        f"vLLM {vllm_version} draws NONE_HASH from os.urandom when PYTHONHASHSEED is unset; "
        "set PYTHONHASHSEED on the engine and pass it here"
    )


def hash_block_tokens(parent: bytes | None, block_tokens: Sequence[int], extra_keys: tuple | None = None, *,
                      algo: str = "sha256_cbor", none: bytes | None = None) -> bytes:
    """One block's 32-byte hash: ``hash_fn((parent or NONE_HASH, tuple(tokens), extra_keys))``."""
    if not parent:
        if none is None:
            raise IdentityError("hash_block_tokens: block 0 needs the engine's NONE_HASH")
        parent = none
    return _fn(algo)((parent, tuple(int(t) for t in block_tokens), extra_keys))


def to_event_hash(digest: bytes) -> EngineBlockHash:
    """The int a vLLM KV event carries for ``digest``: its last 8 bytes, big-endian, unsigned."""
    return EngineBlockHash(int.from_bytes(digest[-8:], "big") & _MASK64)


class VllmBlockHasher:
    """vLLM block hashes for one engine configuration (algorithm, seed, version, block size)."""

    __slots__ = ("algo", "block_size", "none", "_fn")

    def __init__(self, *, block_size: int = 16, algo: str = "sha256_cbor", python_hash_seed: str | None = None,
                 vllm_version: str = "0.33") -> None:
        self.algo = algo
        self.block_size = block_size
        self._fn = _fn(algo)
        self.none = none_hash(algo, python_hash_seed=python_hash_seed, vllm_version=vllm_version)

    def digests(self, token_ids: Sequence[int], *, parent: bytes | None = None,
                extra_keys: Sequence[tuple | None] | None = None) -> list[bytes]:
        """32-byte hashes of every full block of ``token_ids``, chained from ``parent``."""
        n = len(token_ids) // self.block_size
        if extra_keys is not None and len(extra_keys) != n:
            raise IdentityError(f"extra_keys: {len(extra_keys)} entries for {n} full blocks")
        out = []
        prev = parent or self.none
        bs = self.block_size
        for i in range(n):
            extra = extra_keys[i] if extra_keys is not None else None
            prev = self._fn((prev, tuple(int(t) for t in token_ids[i * bs:(i + 1) * bs]), extra))
            out.append(prev)
        return out

    def event_hashes(self, token_ids: Sequence[int], **kw: Any) -> list[EngineBlockHash]:
        """What vLLM publishes in ``BlockStored.block_hashes`` for these tokens."""
        return [to_event_hash(d) for d in self.digests(token_ids, **kw)]


def request_block_hashes(token_ids: Sequence[int], *, block_size: int = 16, algo: str = "sha256_cbor",
                         python_hash_seed: str | None = None, vllm_version: str = "0.33") -> list[bytes]:
    """Convenience: 32-byte block hashes of a prompt as a fresh vLLM engine computes them."""
    hasher = VllmBlockHasher(block_size=block_size, algo=algo, python_hash_seed=python_hash_seed,
                             vllm_version=vllm_version)
    return hasher.digests(token_ids)


def _fn(algo: str) -> Callable[[Any], bytes]:
    try:
        return HASH_FUNCTIONS[algo]
    except KeyError:
        raise IdentityError(
            f"prefix_caching_hash_algo {algo!r} is not reproducible outside vLLM; use sha256_cbor or sha256"
        ) from None
