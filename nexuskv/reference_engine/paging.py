"""Paged state: fixed-size pages of one KV group, and an LRU prefix cache over block keys.

An attention page holds one block of ``block_size`` tokens for every layer of its group
(``[layer, token, row]``); a checkpoint page holds one recurrent checkpoint for every recurrent
layer (``[layer, state]``). A page's bytes are one payload: saving and loading copy whole pages.

Eviction is least-recently-used among pages not pinned by the operation in progress. When a
prompt's pages are touched they are touched deepest block first, so the root of a prefix is the
most recent and its tail is evicted first (as vLLM's free queue does): a prefix cache keeps
prefixes, not stray tails.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch

__all__ = ["PagePool"]


class PagePool:
    """``num_pages`` pages of ``page_shape`` in ``dtype``, each caching one block key."""

    def __init__(self, num_pages: int, page_shape: Sequence[int], dtype: torch.dtype) -> None:
        if num_pages < 1:
            raise ValueError("num_pages: at least 1")
        self.pages = torch.zeros(num_pages, *page_shape, dtype=dtype)
        self._lru: OrderedDict[int, int] = OrderedDict()  # block key -> page; first = least recent
        self._free = list(range(num_pages - 1, -1, -1))
        self._pinned: set[int] = set()

    @property
    def num_pages(self) -> int:
        return self.pages.shape[0]

    @property
    def page_nbytes(self) -> int:
        return self.pages[0].numel() * self.pages.element_size()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: object) -> bool:
        return key in self._lru

    def keys(self) -> list[int]:
        return list(self._lru)

    def lookup(self, key: int) -> int | None:
        return self._lru.get(key)

    def touch(self, keys: Iterable[int]) -> None:
        """Mark ``keys`` used, in order (the last one becomes the most recent)."""
        for key in keys:
            if key in self._lru:
                self._lru.move_to_end(key)

    def pin(self, pages: Iterable[int]) -> None:
        self._pinned.update(pages)

    def unpin_all(self) -> None:
        self._pinned.clear()

    def allocate(self, key: int) -> tuple[int, list[int]] | None:
        """A page for ``key`` (now most recent) and the keys evicted for it; None if all are pinned."""
        if key in self._lru:
            raise ValueError("allocate: the key already has a page")
        evicted: list[int] = []
        if self._free:
            page = self._free.pop()
        else:
            victim = next((k for k, p in self._lru.items() if p not in self._pinned), None)
            if victim is None:
                return None
            page = self._lru.pop(victim)
            evicted.append(victim)
        self._lru[key] = page
        self._pinned.add(page)
        return page, evicted

    def release(self, key: int) -> bool:
        page = self._lru.pop(key, None)
        if page is None:
            return False
        self._pinned.discard(page)
        self._free.append(page)
        return True

    def clear(self) -> list[int]:
        keys = list(self._lru)
        for key in keys:
            self.release(key)
        return keys

    def view(self, page: int) -> torch.Tensor:
        return self.pages[page]

    def bytes_of(self, page: int) -> torch.Tensor:
        """The page as a flat uint8 view (no copy): what a payload of this page is."""
        return self.pages[page].view(-1).view(torch.uint8)
