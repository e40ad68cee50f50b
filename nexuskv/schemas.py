"""JSON Schema export of every wire contract and of the State Descriptor.

``nexuskv schemas`` writes one file per topic payload (``<topic>.schema.json``) plus
``state-descriptor.schema.json`` into ``infra/schemas/``, for consumers in other languages.
``nexuskv.kv-events`` has two payload versions: ``nexuskv.kv-events.schema.json`` is version 1
(pydantic), ``nexuskv.kv-events.v2.schema.json`` version 2 (msgspec, pre-keyed; bytes fields are
msgpack ``bin``, base64 in the JSON form). 128-bit keys are lowercase hex strings in every JSON
form (:data:`nexuskv.contract.Key128`).
A test keeps the committed files equal to what this build exports.
"""

from __future__ import annotations

import json
from pathlib import Path

from nexuskv.contracts.keyed_events import keyed_schema
from nexuskv.contracts.topics import KV_EVENTS, TOPICS
from nexuskv.descriptor import StateDescriptor
from nexuskv.entries import CacheEntry, QueryKey

__all__ = ["schema_documents", "export_schemas"]


def schema_documents() -> dict[str, dict]:
    """File name -> JSON Schema document, for every exported contract."""
    docs: dict[str, dict] = {}
    for topic in TOPICS:
        schema = topic.contract.model_json_schema(mode="serialization")
        schema["$comment"] = f"topic {topic.name}; key: {topic.key}; encoding: {topic.encoding}"
        docs[f"{topic.name}.schema.json"] = schema
    docs[f"{KV_EVENTS.name}.v2.schema.json"] = keyed_schema()
    for name, model in (("state-descriptor", StateDescriptor), ("query-key", QueryKey), ("cache-entry", CacheEntry)):
        docs[f"{name}.schema.json"] = model.model_json_schema(mode="serialization")
    return docs


def export_schemas(out_dir: Path) -> list[Path]:
    """Write every schema document under ``out_dir``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, doc in sorted(schema_documents().items()):
        path = out_dir / name
        path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        paths.append(path)
    return paths
