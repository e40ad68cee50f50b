"""Canonical block keys of a stream's prompts, computed once per (request, identity scope).

Keys chain: a block's key depends on its parent's key and its own tokens, so a piece that starts on
a block boundary has the same keys wherever the same parent key precedes it. The book memoises
keys per ``(scope, parent key, segment, length)`` for such pieces, which makes keying a trace
whose requests share long prefixes cost little more than keying its unique text. Keys are
computed by :class:`nexuskv.identity.BlockKeyer`, exactly as the index computes them from the
token ids the engines publish.
"""

from __future__ import annotations

import numpy as np

from nexuskv.identity import BlockKeyer, IdentityScope

from benchmarks.harness.workloads import Request, segment_tokens

__all__ = ["KeyBook"]


class KeyBook:
    """Keys of prompts per identity scope, memoised."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._keyers: dict[IdentityScope, BlockKeyer] = {}
        self._pieces: dict[tuple, tuple[int, ...]] = {}
        self._requests: dict[tuple[IdentityScope, str], tuple[int, ...]] = {}

    def keys(self, request: Request, scope: IdentityScope) -> tuple[int, ...]:
        """The canonical keys of ``request``'s full blocks in ``scope``."""
        memo = (scope, request.request_id)
        found = self._requests.get(memo)
        if found is not None:
            return found
        keyer = self._keyers.get(scope)
        if keyer is None:
            keyer = self._keyers[scope] = BlockKeyer(scope, self.block_tokens)
        bt = self.block_tokens
        out: list[int] = []
        parent: int | None = None
        pieces = request.pieces
        for i, (segment, length) in enumerate(pieces):
            if length % bt:
                # Not block-aligned: key the rest of the prompt in one go from here.
                rest = [segment_tokens(s, n) for s, n in pieces[i:]]
                out.extend(keyer.keys(np.concatenate(rest), parent=parent))
                break
            piece_key = (scope, parent, segment, length)
            keys = self._pieces.get(piece_key)
            if keys is None:
                keys = self._pieces[piece_key] = tuple(keyer.keys(segment_tokens(segment, length), parent=parent))
            out.extend(keys)
            if keys:
                parent = keys[-1]
        result = tuple(out)
        self._requests[memo] = result
        return result
