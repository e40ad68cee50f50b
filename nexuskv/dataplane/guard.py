"""Which payloads may be loaded into which state: descriptor compatibility at the data plane.

Every payload names its descriptor id (and its checksum binds that name to the bytes). Before a
payload is restored into a runtime, :func:`loadable` compares the payload's descriptor with the
runtime's using :func:`nexuskv.compat.descriptor_match`, so a refusal names the first field that
differs (``descriptor.layer_groups[0].tensors[0].dtype differs: 'float32' != 'bfloat16'``). A
payload whose descriptor this data plane has never been told about is refused too: compatibility
fails closed.
"""

from __future__ import annotations

import threading

from nexuskv.compat import Compatibility, descriptor_match
from nexuskv.descriptor import StateDescriptor

__all__ = ["DescriptorRegistry", "loadable"]


class DescriptorRegistry:
    """Descriptors by id, as registered by the runtimes and services of this process."""

    def __init__(self) -> None:
        self._by_id: dict[str, StateDescriptor] = {}
        self._lock = threading.Lock()

    def register(self, descriptor: StateDescriptor) -> str:
        with self._lock:
            self._by_id[descriptor.descriptor_id] = descriptor
        return descriptor.descriptor_id

    def get(self, descriptor_id: str) -> StateDescriptor | None:
        return self._by_id.get(descriptor_id)

    def __contains__(self, descriptor_id: object) -> bool:
        return descriptor_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)


def loadable(payload_descriptor_id: str, target: StateDescriptor, registry: DescriptorRegistry) -> Compatibility:
    """May a payload of ``payload_descriptor_id`` be restored as ``target``'s state? With the reason."""
    if payload_descriptor_id == target.descriptor_id:
        return Compatibility(True)
    source = registry.get(payload_descriptor_id)
    if source is None:
        return Compatibility(False, "descriptor", "descriptor_id",
                             f"payload descriptor {payload_descriptor_id} is unknown here and is not "
                             f"{target.descriptor_id}; refusing (compatibility fails closed)")
    return descriptor_match(source, target)
