"""The State Descriptor an engine adapter serves: a known model, or a descriptor file.

Every adapter of one deployment (the event bridge, the router, the vLLM connector, the SGLang
HiCache backend) must key blocks in the same identity scope, so they resolve their descriptor
the same way: ``descriptor_path`` (a :class:`~nexuskv.descriptor.StateDescriptor` JSON file)
when given, else ``model`` among :data:`nexuskv.models.KNOWN_MODELS` with the tenant, block
size and engine family as overrides. A model that is neither fails with the field named.
"""

from __future__ import annotations

from pathlib import Path

from nexuskv.contracts.kv_events import PublisherIdentity
from nexuskv.descriptor import StateDescriptor
from nexuskv.errors import ConfigError, ContractError
from nexuskv.models import KNOWN_MODELS, known_model

__all__ = ["resolve_descriptor", "publisher_identity"]


def resolve_descriptor(*, model: str | None = None, descriptor_path: str | Path | None = None,
                       tenant: str = "default", block_size: int | None = None,
                       engine_family: str = "vllm") -> StateDescriptor:
    """The descriptor of a descriptor file, or of a known model; ConfigError naming the field."""
    if descriptor_path:
        try:
            desc = StateDescriptor.model_validate_json(Path(descriptor_path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError("descriptor", f"cannot read {descriptor_path}: {exc.strerror or exc}") from None
        except ContractError as exc:
            raise ConfigError("descriptor", f"{descriptor_path} is not a StateDescriptor: {exc}") from None
        return desc if desc.tenant_namespace == tenant else desc.with_tenant(tenant)
    if not model or model not in KNOWN_MODELS:
        raise ConfigError("model", f"{model!r} is not a known model ({', '.join(KNOWN_MODELS)}); "
                                   "give a descriptor file instead")
    overrides: dict[str, object] = {"tenant_namespace": tenant, "engine_family": engine_family}
    if block_size is not None:
        overrides["block_size"] = block_size
    return known_model(model, **overrides)


def publisher_identity(descriptor: StateDescriptor, *, worker: str | None = None) -> PublisherIdentity:
    """What a publisher of ``descriptor``'s blocks names in its kv-events batches; ``worker``: the
    engine worker whose tier it announces (its name must be under the worker's)."""
    d = descriptor
    return PublisherIdentity(tenant_namespace=d.tenant_namespace, model=d.model, model_revision=d.model_revision,
                             tokenizer_revision=d.tokenizer_revision, descriptor_id=d.descriptor_id,
                             engine_family=d.engine_family, worker=worker)
