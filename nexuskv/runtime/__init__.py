"""The reference runtime: a tiny torch transformer engine with paged state (GQA, MLA, hybrid).

It stands in for an inference engine in every test and benchmark: it describes its state,
looks up, loads and saves payloads through the data plane's tiers, prefills with or without
reuse, and publishes lifecycle events and prefill observations through an injected publisher.

* :mod:`~nexuskv.runtime.spec` — variants and sizes; :mod:`~nexuskv.runtime.descriptors` — their
  State Descriptors; :mod:`~nexuskv.runtime.model` / :mod:`~nexuskv.runtime.layers` /
  :mod:`~nexuskv.runtime.rope` — the network; :mod:`~nexuskv.runtime.paging` — pages and the
  prefix cache; :mod:`~nexuskv.runtime.engine_hash` — its own block hashes;
  :mod:`~nexuskv.runtime.events` — event batches and the publisher seam;
  :mod:`~nexuskv.runtime.runtime` — the engine facade.
"""

from nexuskv.runtime.descriptors import ENGINE_FAMILY, descriptor_for
from nexuskv.runtime.engine_hash import engine_hashes
from nexuskv.runtime.events import EventLog, Publisher, null_publisher
from nexuskv.runtime.model import TinyModel
from nexuskv.runtime.runtime import (
    ATTENTION_GROUP,
    CHECKPOINT_GROUP,
    LoadOutcome,
    PrefillResult,
    ReferenceRuntime,
    ReuseExtent,
    SaveOutcome,
)
from nexuskv.runtime.spec import LayerKind, ModelSpec, Variant

__all__ = [
    "ATTENTION_GROUP",
    "CHECKPOINT_GROUP",
    "ENGINE_FAMILY",
    "EventLog",
    "LayerKind",
    "LoadOutcome",
    "ModelSpec",
    "PrefillResult",
    "Publisher",
    "ReferenceRuntime",
    "ReuseExtent",
    "SaveOutcome",
    "TinyModel",
    "Variant",
    "descriptor_for",
    "engine_hashes",
    "null_publisher",
]
