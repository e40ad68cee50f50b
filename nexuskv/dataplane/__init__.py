"""The data plane: tiers that hold payloads, and the executor that moves them between tiers.

* :mod:`~nexuskv.dataplane.payload` — payload address, header, checksum (XXH3-128), handle.
* :mod:`~nexuskv.dataplane.capabilities` — what a backend advertises.
* :mod:`~nexuskv.dataplane.backend` — the tier backend interface.
* :mod:`~nexuskv.dataplane.memory` — host DRAM and device memory (CUDA, or a host stand-in).
* :mod:`~nexuskv.dataplane.disk` — local disk, one file per payload.
* :mod:`~nexuskv.dataplane.remote` / :mod:`~nexuskv.dataplane.remote_store` — the remote tier:
  payloads in a Mooncake Store, with NexusKV's checks on top.
* :mod:`~nexuskv.dataplane.catalog` — choosing backends by capability and policy.
* :mod:`~nexuskv.dataplane.guard` — descriptor compatibility of payloads (refusals with reasons).
* :mod:`~nexuskv.dataplane.executor` — transfer commands in, honest results and observations out.
* :mod:`~nexuskv.dataplane.tiers` — ``TierManager``, one worker's tiers under one capacity authority
  (the in-engine adapter's object; the service is :mod:`streams.tier_manager`): a facade over
  :mod:`~nexuskv.dataplane.tier_ledger` (pure: what is where, pins, reservations, leases),
  :mod:`~nexuskv.dataplane.tier_mover` (the only I/O on backends) and
  :mod:`~nexuskv.dataplane.tier_announcer` (kv-events and tier state); a managed folder is locked by
  :mod:`~nexuskv.dataplane.folder_lock`.
* :mod:`~nexuskv.dataplane.cuda` — streams, pinned staging and events, used only with CUDA.

Torch is imported here (and in :mod:`nexuskv.reference_engine`) and nowhere else in the core.
"""

from __future__ import annotations

import importlib
from typing import Any

# Exports resolve lazily, so a process that needs only the torch-free parts (the remote tier's
# store supervisor: payload, remote_store) does not pay for importing torch.
_EXPORTS = {
    "TierBackend": "backend",
    "Capabilities": "capabilities",
    "POLICIES": "catalog", "BackendCatalog": "catalog", "DurableFirst": "catalog", "FastestFirst": "catalog",
    "MostFree": "catalog", "Need": "catalog",
    "cuda_available": "cuda",
    "DiskBackend": "disk",
    "TransferExecutor": "executor", "TransferOutcome": "executor",
    "DescriptorRegistry": "guard", "loadable": "guard",
    "DeviceMemoryBackend": "memory", "HostMemoryBackend": "memory",
    "CHECKSUM_ALGORITHM": "payload", "PayloadHandle": "payload", "PayloadHeader": "payload", "PayloadKey": "payload",
    "payload_checksum": "payload", "verify_payload": "payload",
    "RemoteBackend": "remote",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nexuskv.dataplane' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"nexuskv.dataplane.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "CHECKSUM_ALGORITHM",
    "POLICIES",
    "BackendCatalog",
    "Capabilities",
    "DescriptorRegistry",
    "DeviceMemoryBackend",
    "DiskBackend",
    "DurableFirst",
    "FastestFirst",
    "HostMemoryBackend",
    "MostFree",
    "Need",
    "PayloadHandle",
    "PayloadHeader",
    "PayloadKey",
    "RemoteBackend",
    "TierBackend",
    "TransferExecutor",
    "TransferOutcome",
    "cuda_available",
    "loadable",
    "payload_checksum",
    "verify_payload",
]
