"""The reference engine: a tiny torch transformer engine with paged state (GQA, MLA, hybrid).

It stands in for an inference engine in every test and benchmark: it describes its state,
looks up, loads and saves payloads through the data plane's tiers, prefills with or without
reuse, and publishes lifecycle events and prefill observations through an injected publisher.

* :mod:`~nexuskv.reference_engine.spec` — variants and sizes; :mod:`~nexuskv.reference_engine.descriptors` — their
  State Descriptors; :mod:`~nexuskv.reference_engine.model` / :mod:`~nexuskv.reference_engine.layers` /
  :mod:`~nexuskv.reference_engine.rope` — the network; :mod:`~nexuskv.reference_engine.paging` — pages and the
  prefix cache; :mod:`~nexuskv.reference_engine.engine_hash` — its own block hashes;
  :mod:`~nexuskv.reference_engine.events` — event batches and the publisher seam;
  :mod:`~nexuskv.reference_engine.engine` — the engine facade.
"""

from nexuskv.reference_engine.descriptors import ENGINE_FAMILY, descriptor_for
from nexuskv.reference_engine.engine import (
    ATTENTION_GROUP,
    CHECKPOINT_GROUP,
    PageLoadOutcome,
    PageSaveOutcome,
    PrefillResult,
    ReferenceEngine,
    ReuseExtent,
)
from nexuskv.reference_engine.engine_hash import engine_hashes
from nexuskv.reference_engine.events import EventLog, Publisher, null_publisher
from nexuskv.reference_engine.model import TinyModel
from nexuskv.reference_engine.spec import LayerKind, ReferenceModelSpec, Variant

__all__ = [
    "ATTENTION_GROUP",
    "CHECKPOINT_GROUP",
    "ENGINE_FAMILY",
    "EventLog",
    "LayerKind",
    "PageLoadOutcome",
    "ReferenceModelSpec",
    "PrefillResult",
    "Publisher",
    "ReferenceEngine",
    "ReuseExtent",
    "PageSaveOutcome",
    "TinyModel",
    "Variant",
    "descriptor_for",
    "engine_hashes",
    "null_publisher",
]
