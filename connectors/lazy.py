"""A module attribute built on first access.

Engine shells subclass an engine's base class (vLLM's ``KVConnectorBase_V1``, SGLang's
``HiCacheStorage``), but NexusKV imports them where the engine is not installed. The engine's
loader takes the class by attribute name from the module (``getattr(module, name)``), so the
module's ``__getattr__`` builds it then, importing the engine only at that moment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["lazy_attribute"]


def lazy_attribute(namespace: dict[str, Any], name: str, build: Callable[[], Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that builds ``name`` once with ``build()`` and keeps it in ``namespace``."""

    def __getattr__(attr: str) -> Any:
        if attr != name:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {attr!r}")
        value = namespace[attr] = build()
        return value
    return __getattr__
