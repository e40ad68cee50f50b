"""The compatibility predicate fails closed, and says which field made it fail."""

import json

from nexuskv.compat import (
    Compatibility,
    Conversion,
    ConversionRegistry,
    Validity,
    compatible,
    descriptor_match,
    identity_match,
    valid,
)
from nexuskv.descriptor import StateDescriptor, compatibility_view
from nexuskv.errors import ContractError
from nexuskv.identity import IdentityScope

from tests.factories import descriptor, mla

NOW = 1_700_000_000.0


def _set_path(data, path, value):
    parts = path.replace("[", ".[").split(".")
    node = data
    for part in parts[:-1]:
        node = node[int(part[1:-1])] if part.startswith("[") else node[part]
    last = parts[-1]
    if last.startswith("["):
        node[int(last[1:-1])] = value
    else:
        node[last] = value


def _candidates(value):
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value - 1, value * 2 + 1]
    if isinstance(value, float):
        return [value * 2]
    if isinstance(value, str):
        known = {"gqa": ["mha", "mqa"], "mha": ["gqa"], "mla": ["dsa"], "bfloat16": ["float16", "float32"],
                 "key": ["latent"], "value": ["rope_key"], "block": ["checkpoint"], "none": ["per_tensor"],
                 "rope_applied": ["rope_deferred", "none"], "rope_deferred": ["rope_applied"],
                 "latent": ["key"], "rope_key": ["value"],
                 "index_key": ["rope_key"], "per_tensor": ["per_token", "per_channel"],
                 "float32": ["float16", "bfloat16"]}
        return known.get(value, []) + [value + "-x"]
    if value is None:
        return ["x", 1]
    return []


def _variants(base: StateDescriptor):
    """For each compatibility-relevant leaf: a valid descriptor differing from base only there."""
    data = json.loads(base.model_dump_json())
    for path, value in compatibility_view(base).items():
        if path.endswith("__len__"):
            continue
        for candidate in _candidates(value):
            mutated = json.loads(json.dumps(data))
            mutated["descriptor_id"] = ""
            mutated["semantic_type"] = None  # derived from the groups
            _set_path(mutated, path, candidate)
            try:
                other = StateDescriptor.model_validate(mutated)
            except ContractError:
                continue
            diff = {k for k, v in compatibility_view(other).items() if compatibility_view(base).get(k) != v}
            if diff == {path}:
                yield path, other
                break
        else:
            yield path, None


def _normalise(path: str) -> str:
    import re

    return re.sub(r"\[\d+\]", "[]", path)


def _quantized(scheme: str = "per_group") -> StateDescriptor:
    data = json.loads(descriptor().model_dump_json())
    quant = {"scheme": scheme, "scale_dtype": "float32"}
    if scheme == "per_group":
        quant["group_size"] = 32
    data.update(descriptor_id="", quantization=quant)
    return StateDescriptor.model_validate(data)


def _with_extra_tensor() -> StateDescriptor:
    data = json.loads(descriptor().model_dump_json())
    data.update(descriptor_id="")
    data["layer_groups"][0]["tensors"].append({"role": "index_key", "shape": [4], "dtype": "float8_e4m3"})
    return StateDescriptor.model_validate(data)


def _windowed() -> StateDescriptor:
    data = json.loads(descriptor().model_dump_json())
    data.update(descriptor_id="", semantic_type=None)
    data["layer_groups"][0].update(semantic_type="sliding_window", sliding_window=128, layers=[0, 2, 5])
    return StateDescriptor.model_validate(data)


BASES = [descriptor(), mla(), descriptor(tp_size=2, num_kv_heads=4, tp_rank=0), _quantized(),
         _quantized("per_tensor"), _windowed(), _with_extra_tensor()]

#: Every compatibility-relevant leaf (indices normalised). schema_version has one legal value
#: today, so no valid pair can differ in it; test_descriptor checks that others are refused.
EXPECTED_LEAVES = {
    "model", "model_revision", "tokenizer_revision", "engine_family",
    "parallel.tp_rank", "parallel.tp_size", "parallel.pp_size",
    "layer_groups[].kv_group", "layer_groups[].semantic_type", "layer_groups[].layers[]",
    "layer_groups[].granularity.tokens", "layer_groups[].sliding_window",
    "layer_groups[].tensors[].role", "layer_groups[].tensors[].shape[]", "layer_groups[].tensors[].dtype",
    "quantization.scheme", "quantization.scale_dtype", "quantization.group_size",
    "layout.layout", "layout.position", "layout.rope_theta", "layout.rope_scaling",
}


def test_every_compatibility_field_alone_makes_descriptors_incompatible():
    covered = set()
    for base in BASES:
        for path, other in _variants(base):
            if other is None:
                continue  # this base has no valid single-field change there; another base does
            result = descriptor_match(base, other)
            assert not result.ok
            assert result.clause == "descriptor"
            assert result.field == path, (path, result)
            assert path in result.reason
            covered.add(_normalise(path))
    assert EXPECTED_LEAVES <= covered, EXPECTED_LEAVES - covered


def test_parallel_scope_differences_are_named():
    a = descriptor(tp_size=2, tp_rank=0)
    b = descriptor(tp_size=2, tp_rank=1)
    result = descriptor_match(a, b)
    assert not result.ok and result.field == "parallel.tp_rank"
    c = descriptor(tp_size=4, num_kv_heads=4, tp_rank=0)
    assert not descriptor_match(descriptor(tp_size=2, tp_rank=0, num_kv_heads=4), c).ok


def test_quantization_and_layer_scope_are_relevant():
    q = json.loads(descriptor().model_dump_json())
    q.update(descriptor_id="", quantization={"scheme": "per_token", "scale_dtype": "float32"})
    result = descriptor_match(descriptor(), StateDescriptor.model_validate(q))
    assert not result.ok and result.field.startswith("quantization.")
    fewer_layers = descriptor(num_layers=3)
    result = descriptor_match(descriptor(), fewer_layers)
    assert not result.ok and result.field.startswith("layer_groups[0].layers")


def test_identical_descriptors_and_other_tenant_descriptors_match():
    assert descriptor_match(descriptor(), descriptor()).ok
    assert descriptor_match(descriptor(), descriptor().with_tenant("b")).ok


def _scope(d, tenant="a", **kw):
    return IdentityScope.of(d.with_tenant(tenant), **kw)


def test_identity_clause():
    d = descriptor()
    assert identity_match(_scope(d), _scope(d)).ok
    r = identity_match(_scope(d, "a"), _scope(d, "b"))
    assert not r.ok and r.field == "tenant_namespace"
    assert identity_match(_scope(d, "a"), _scope(d, "b"), allow_cross_tenant=True).ok
    r = identity_match(_scope(d, lora="l1"), _scope(d, lora="l2"))
    assert not r.ok and r.field == "lora"
    r = identity_match(_scope(d, cache_salt="s"), _scope(d))
    assert not r.ok and r.field == "cache_salt"


def test_validity_clause_fails_closed():
    assert valid(Validity(), now=NOW).ok
    assert valid(Validity(certain=False), now=NOW).field == "certain"
    assert valid(Validity(expires_at=NOW), now=NOW).field == "expires_at"
    assert valid(Validity(expires_at=NOW + 1), now=NOW).ok
    assert valid(Validity(schema_version=2), now=NOW).field == "schema_version"
    assert valid(Validity(unknown_fields=("new_thing",)), now=NOW).field == "new_thing"


def test_compatible_is_the_conjunction_with_the_first_failing_reason():
    d = descriptor()
    ok = compatible(_scope(d), d, Validity(), _scope(d), d, now=NOW)
    assert ok.ok and isinstance(ok, Compatibility) and bool(ok)
    bad_identity = compatible(_scope(d, "a"), d, Validity(certain=False), _scope(d, "b"), d, now=NOW)
    assert bad_identity.clause == "identity"
    bad_desc = compatible(_scope(d), d, Validity(), _scope(d), descriptor(block_size=8), now=NOW)
    assert bad_desc.clause == "descriptor" and "granularity.tokens" in bad_desc.field
    bad_valid = compatible(_scope(d), d, Validity(certain=False), _scope(d), d, now=NOW)
    assert bad_valid.clause == "validity"


def test_conversion_applies_only_when_registered_and_declared():
    src_data = json.loads(descriptor().model_dump_json())
    src_data.update(descriptor_id="", compatibility={"conversions": ["nhd-to-hnd"]})
    src = StateDescriptor.model_validate(src_data)
    dst = descriptor(layout="paged_hnd")
    assert not descriptor_match(src, dst).ok  # declared, not registered: still incompatible
    registry = ConversionRegistry()
    registry.register(Conversion("nhd-to-hnd", 1, lambda a, b: a.layout.layout == "paged_nhd" and b.layout.layout == "paged_hnd"))
    result = descriptor_match(src, dst, registry)
    assert result.ok and result.conversion == "nhd-to-hnd@v1"
    assert not descriptor_match(descriptor(), dst, registry).ok  # registered but not declared by the state
