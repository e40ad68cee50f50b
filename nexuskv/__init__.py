"""NexusKV core: the pure layer that decides.

Descriptors, identity, compatibility, index, cost model, planner, placement and prefetch live
here as pure, synchronous code over snapshots. Nothing in this package imports Kafka, Faust,
DuckDB or an inference engine; the edges (``streams``, ``connectors``, ``analytics``) do I/O.
"""

from nexuskv.compat import Compatibility, compatible
from nexuskv.config import BrokerUrl, Settings, parse_broker_url
from nexuskv.descriptor import (
    DType,
    Granularity,
    GranularityKind,
    LayerGroup,
    LayoutConvention,
    ParallelScope,
    Quantization,
    SemanticType,
    StateDescriptor,
    TensorRole,
    TensorSpec,
    Tier,
)
from nexuskv.entries import CacheEntry, EntryLocation, QueryKey
from nexuskv.errors import (
    BrokerError,
    ConfigError,
    ContractError,
    IdentityError,
    IncompatibleStateError,
    NexusKVError,
    SchemaVersionError,
)
from nexuskv.identity import BlockKey, BlockKeyer, EngineBlockHash, IdentityScope, block_keys

__version__ = "0.1.0"

__all__ = [
    "BlockKey",
    "BlockKeyer",
    "BrokerError",
    "BrokerUrl",
    "CacheEntry",
    "Compatibility",
    "ConfigError",
    "ContractError",
    "DType",
    "EngineBlockHash",
    "EntryLocation",
    "Granularity",
    "GranularityKind",
    "IdentityError",
    "IdentityScope",
    "IncompatibleStateError",
    "LayerGroup",
    "LayoutConvention",
    "NexusKVError",
    "ParallelScope",
    "Quantization",
    "QueryKey",
    "SchemaVersionError",
    "SemanticType",
    "Settings",
    "StateDescriptor",
    "TensorRole",
    "TensorSpec",
    "Tier",
    "block_keys",
    "compatible",
    "parse_broker_url",
]
