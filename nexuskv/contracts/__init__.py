"""Wire contracts of every NexusKV topic (DESIGN.md, "Topics"), versioned and validated.

:mod:`nexuskv.contract` is the base of every contract (frozen, strict, validated); one module
per topic payload; :mod:`nexuskv.contracts.topics` binds them to topic names and encodings;
:mod:`nexuskv.contracts.codec` turns them into bytes and back.

The names below are loaded on first use: the core's own values (the State Descriptor) are
contracts too, so this package must import without importing every topic's payload.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["TOPICS", "Topic", "decode", "encode", "topic_named"]

_HOMES = {"TOPICS": "topics", "Topic": "topics", "topic_named": "topics", "decode": "codec", "encode": "codec"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
