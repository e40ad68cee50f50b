"""The compatibility predicate (whitepaper §2.1, §8.6).

``compatible(C, q) = identity_match(I, q) ∧ descriptor_match(D, q) ∧ valid(V, q)``

Each clause fails closed and says why: identity (tenant, model, LoRA, cache salt, descriptor
id, unless policy allows cross-tenant reuse), descriptor (exact equality of every
compatibility-relevant field, unless a conversion is *registered* for that exact pair), validity
(schema version known, entry certain, not expired, no unknown field). The result names the
first field that differs, so a rejected reuse is explainable.

No conversion is registered in this release; :class:`ConversionRegistry` is the seam where a
verified, costed conversion (e.g. layout repacking) will be added, each with its own version.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from nexuskv.descriptor import SCHEMA_VERSION, StateDescriptor, compatibility_view
from nexuskv.identity import IdentityScope

__all__ = [
    "Compatibility",
    "Conversion",
    "ConversionRegistry",
    "Validity",
    "compatible",
    "descriptor_match",
    "identity_match",
    "valid",
]


@dataclass(frozen=True, slots=True)
class Compatibility:
    """Outcome of the predicate. ``field`` is the dotted path of the first mismatch."""

    ok: bool
    clause: str = ""  # "identity" | "descriptor" | "validity" when not ok
    field: str = ""
    reason: str = ""
    conversion: str | None = None  # name of the registered conversion that made it compatible

    def __bool__(self) -> bool:
        return self.ok


_OK = Compatibility(ok=True)


@dataclass(frozen=True, slots=True)
class Conversion:
    """A verified transformation from one descriptor to another, with its own version."""

    name: str
    version: int
    applies: Callable[[StateDescriptor, StateDescriptor], bool]


@dataclass(slots=True)
class ConversionRegistry:
    """Registered conversions. Empty by default: exact equality is the only compatibility."""

    _conversions: list[Conversion] = field(default_factory=list)

    def register(self, conversion: Conversion) -> None:
        self._conversions.append(conversion)

    def find(self, source: StateDescriptor, target: StateDescriptor) -> Conversion | None:
        for conv in self._conversions:
            if conv.name in source.compatibility.conversions and conv.applies(source, target):
                return conv
        return None


EMPTY_REGISTRY = ConversionRegistry()


@dataclass(frozen=True, slots=True)
class Validity:
    """Validity facts of a cache entry (whitepaper §2.1, V_i)."""

    schema_version: int = SCHEMA_VERSION
    certain: bool = True  # False while the publisher's facts are in doubt (gap, restart)
    expires_at: float | None = None  # seconds since the epoch; None = no TTL
    unknown_fields: tuple[str, ...] = ()


def identity_match(entry: IdentityScope, query: IdentityScope, *, allow_cross_tenant: bool = False) -> Compatibility:
    """Same semantic identity. Cross-tenant reuse only when policy allows it.

    The descriptor id is left to :func:`descriptor_match`, which knows about conversions.
    """
    for name in ("model", "model_revision", "tokenizer_revision", "lora", "cache_salt"):
        a, b = getattr(entry, name), getattr(query, name)
        if a != b:
            return Compatibility(False, "identity", name, f"identity.{name} differs: {a!r} != {b!r}")
    if entry.tenant_namespace != query.tenant_namespace and not allow_cross_tenant:
        return Compatibility(False, "identity", "tenant_namespace", "identity.tenant_namespace differs and cross-tenant reuse is off")
    return _OK


def descriptor_match(
    entry: StateDescriptor, query: StateDescriptor, registry: ConversionRegistry = EMPTY_REGISTRY
) -> Compatibility:
    """Exact equality of every compatibility-relevant field, or a registered conversion."""
    if entry.descriptor_id == query.descriptor_id:
        return _OK
    conv = registry.find(entry, query)
    if conv is not None:
        return Compatibility(True, conversion=f"{conv.name}@v{conv.version}")
    a, b = compatibility_view(entry), compatibility_view(query)
    for path in sorted(set(a) | set(b)):
        if path not in a or path not in b:
            return Compatibility(False, "descriptor", path, f"descriptor.{path} is missing on one side")
        if a[path] != b[path]:
            return Compatibility(False, "descriptor", path, f"descriptor.{path} differs: {a[path]!r} != {b[path]!r}")
    # Equal views but different ids cannot happen for descriptors built by this schema; refuse.
    return Compatibility(False, "descriptor", "descriptor_id", "descriptor ids differ")


def valid(validity: Validity, *, now: float) -> Compatibility:
    """Validity of the entry at time ``now`` (seconds since the epoch, passed in)."""
    if validity.schema_version != SCHEMA_VERSION:
        return Compatibility(False, "validity", "schema_version", f"schema version {validity.schema_version} is not {SCHEMA_VERSION}")
    if validity.unknown_fields:
        return Compatibility(False, "validity", validity.unknown_fields[0], f"unknown field {validity.unknown_fields[0]!r}")
    if not validity.certain:
        return Compatibility(False, "validity", "certain", "publisher facts are uncertain (sequence gap or restart)")
    if validity.expires_at is not None and now >= validity.expires_at:
        return Compatibility(False, "validity", "expires_at", "entry expired")
    return _OK


def compatible(
    entry_scope: IdentityScope,
    entry_descriptor: StateDescriptor,
    validity: Validity,
    query_scope: IdentityScope,
    query_descriptor: StateDescriptor,
    *,
    now: float,
    allow_cross_tenant: bool = False,
    registry: ConversionRegistry = EMPTY_REGISTRY,
) -> Compatibility:
    """identity ∧ descriptor ∧ validity, the first failing clause with its reason."""
    identity = identity_match(entry_scope, query_scope, allow_cross_tenant=allow_cross_tenant)
    if not identity.ok:
        return identity
    descriptor = descriptor_match(entry_descriptor, query_descriptor, registry)
    if not descriptor.ok:
        return descriptor
    validity_result = valid(validity, now=now)
    return validity_result if not validity_result.ok else descriptor
