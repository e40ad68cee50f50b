"""``NexusKVConnector``: a vLLM ``KVConnectorBase_V1`` over NexusKV's planner, index and data plane.

Load it into vLLM with::

    vllm serve meta-llama/Llama-3.1-8B --prefix-caching-hash-algo sha256_cbor \\
      --kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",
                           "replay_endpoint":"tcp://*:5558","topic":"kv@10.0.0.5:8000@meta-llama/Llama-3.1-8B"}' \\
      --kv-transfer-config '{"kv_connector":"NexusKVConnector",
                             "kv_connector_module_path":"connectors.vllm.connector",
                             "kv_role":"kv_both","kv_load_failure_policy":"recompute",
                             "kv_connector_extra_config":{"tenant":"acme","save_tier":"disk"}}'

(``kv_load_failure_policy`` where the vLLM version has it: with the default ``fail`` a failed load
aborts the request instead of recomputing it), with ``NEXUSKV_BROKER`` naming the deployment's bus (and ``NEXUSKV_REMOTE_TIER`` its remote tier,
``NEXUSKV_DATA_DIR`` where the disk tier lives) in vLLM's environment, and the event bridge
(``python -m connectors.bridge --engine vllm --endpoint tcp://10.0.0.5:5557 --replay-endpoint
tcp://10.0.0.5:5558 --model meta-llama/Llama-3.1-8B --tenant acme``) forwarding the engine's KV
events, including this connector's tier events, to ``nexuskv.kv-events``.

**Versions.** Written against the connector API of vLLM 0.23 to 0.33 as recorded in
``../shared/reference/engines.md`` §3: constructed as ``(vllm_config, role, kv_cache_config)``
(0.33 refuses out-of-tree connectors without ``kv_cache_config``; 0.15 passed it optionally, 0.11
not at all — the constructor accepts both), ``get_num_new_matched_tokens(request,
num_computed_tokens) -> (int | None, bool)``, ``update_state_after_alloc(request, blocks,
num_external_tokens)``, ``build_connector_meta(scheduler_output)``, ``request_finished(request,
block_ids)``, ``update_connector_output(connector_output)``, ``take_events()``, and on the worker
``register_kv_caches``, ``start_load_kv``, ``wait_for_layer_load``, ``save_kv_layer``,
``wait_for_save``, ``get_finished``, ``get_block_ids_with_load_errors``. vLLM cannot be installed
where NexusKV is tested, so this shell has not run inside vLLM: its logic lives in
:mod:`connectors.vllm.connector_core`, which the tests drive with the reference engine
(:mod:`connectors.vllm.standin`); this module only translates vLLM's objects.

**Lazy import.** Importing this module does not import vLLM. vLLM's factory takes the attribute
``NexusKVConnector`` from the module, and the module's ``__getattr__`` builds the class (a
subclass of vLLM's base) on that first access.

**Configuration** (``kv_connector_extra_config``; unknown keys are refused by name):

* ``worker`` — this engine's publisher name in the index. Default: from the KV-events topic
  ``kv@<pod>@<model>``, ``vllm/<pod>/dp<rank>`` (what the bridge names it);
* ``tenant`` (``default``), ``model`` (vLLM's model) or ``descriptor`` (a StateDescriptor JSON file);
* ``save_tier`` — ``disk`` (default), ``remote`` or ``none``; ``load_async`` (false);
* ``profile`` — the hardware profile of this worker in the cost model (the policy's default);
* ``decide_wait_ms`` — how long a request may wait for a lagging index before the planner
  decides with what it has (50).

Block hashes: the connector computes vLLM's own block hashes (:mod:`connectors.vllm.hashing`,
the engine's ``--prefix-caching-hash-algo`` — ``sha256_cbor`` or ``sha256`` — and
``PYTHONHASHSEED``) for the tier events it emits, so they name the same blocks as the engine's
events. Requests with LoRA adapters, multimodal inputs or a cache salt carry extra keys this
connector does not hash: it neither loads nor saves them. One connector per TP rank is not
supported: run it with tensor parallel size 1.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from connectors.descriptors import resolve_descriptor
from connectors.lazy import lazy_attribute
from connectors.vllm.hashing import VllmBlockHasher
from nexuskv.dataplane.payload import PayloadKey
from nexuskv.descriptor import StateDescriptor, Tier
from nexuskv.errors import ConfigError, IdentityError

__all__ = ["ConnectorConfig", "vllm_engine_hasher", "scheduler_side", "worker_side", "NexusKVConnector"]

log = logging.getLogger("nexuskv.vllm")

_KEYS = frozenset({"worker", "tenant", "model", "descriptor", "save_tier", "load_async", "profile", "decide_wait_ms"})
_SAVE_TIERS = {"disk": Tier.DISK, "remote": Tier.REMOTE, "none": None}
_MEDIUM = {Tier.DISK: "DISK", Tier.REMOTE: "REMOTE"}


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """The connector's settings, from ``kv_connector_extra_config`` and vLLM's own config."""

    worker: str
    descriptor: StateDescriptor
    save_tier: Tier | None = Tier.DISK
    load_async: bool = False
    profile: str | None = None
    decide_wait_s: float = 0.05
    hash_algo: str = "sha256_cbor"
    python_hash_seed: str | None = None
    vllm_version: str = "0.33"

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None, *, model: str, block_size: int, kv_events_topic: str = "",
              data_parallel_rank: int = 0, hash_algo: str = "sha256_cbor", python_hash_seed: str | None = None,
              vllm_version: str = "0.33") -> ConnectorConfig:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config.{unknown[0]}",
                              f"unknown key (known: {', '.join(sorted(_KEYS))})")
        worker = extra.get("worker") or _worker_from_topic(kv_events_topic, data_parallel_rank)
        if not worker:
            raise ConfigError("kv_connector_extra_config.worker", "give this engine's publisher name, or a KV-events "
                                                                  "topic kv@<pod>@<model> to derive it from")
        tier_name = str(extra.get("save_tier", "disk")).lower()
        if tier_name not in _SAVE_TIERS:
            raise ConfigError("kv_connector_extra_config.save_tier", f"{tier_name!r} is not one of disk, remote, none")
        descriptor = resolve_descriptor(model=extra.get("model", model), descriptor_path=extra.get("descriptor"),
                                        tenant=str(extra.get("tenant", "default")), block_size=block_size,
                                        engine_family="vllm")
        if descriptor.block_size != block_size:
            raise ConfigError("kv_connector_extra_config.descriptor",
                              f"block size {descriptor.block_size} is not vLLM's --block-size {block_size}")
        wait_ms = extra.get("decide_wait_ms", 50)
        if not isinstance(wait_ms, (int, float)) or wait_ms < 0:
            raise ConfigError("kv_connector_extra_config.decide_wait_ms", "a number of milliseconds >= 0")
        load_async = extra.get("load_async", False)
        if not isinstance(load_async, bool):
            raise ConfigError("kv_connector_extra_config.load_async", "true or false")
        try:  # refuse, at start, a hash configuration no one outside vLLM can reproduce
            VllmBlockHasher(block_size=block_size, algo=hash_algo, python_hash_seed=python_hash_seed,
                            vllm_version=vllm_version)
        except IdentityError as exc:
            raise ConfigError("prefix_caching_hash_algo", str(exc)) from None
        return cls(worker=str(worker), descriptor=descriptor, save_tier=_SAVE_TIERS[tier_name], load_async=load_async,
                   profile=extra.get("profile"), decide_wait_s=float(wait_ms) / 1000.0, hash_algo=hash_algo,
                   python_hash_seed=python_hash_seed, vllm_version=vllm_version)


def _worker_from_topic(topic: str, dp_rank: int) -> str | None:
    if topic.startswith("kv@"):
        parts = topic.split("@", 2)
        if len(parts) == 3 and parts[1]:
            return f"vllm/{parts[1]}/dp{dp_rank}"
    return None


def vllm_engine_hasher(config: ConnectorConfig):
    """Tokens -> the block hashes vLLM publishes for them (low 64 bits of each digest)."""
    hasher = VllmBlockHasher(block_size=config.descriptor.block_size, algo=config.hash_algo,
                             python_hash_seed=config.python_hash_seed, vllm_version=config.vllm_version)
    return hasher.event_hashes


# -- the vLLM shell, built on first access -----------------------------------------------------------

def _build_connector_class() -> type:
    try:
        base = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
        events = importlib.import_module("vllm.distributed.kv_events")
        import vllm
    except ImportError as exc:
        raise ImportError(f"NexusKVConnector needs vLLM (0.23-0.33) installed: {exc}") from None
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole = (base.KVConnectorBase_V1, base.KVConnectorMetadata,
                                                                base.KVConnectorRole)
    BlockStored = events.BlockStored
    takes_cache_config = "kv_cache_config" in inspect.signature(KVConnectorBase_V1.__init__).parameters
    stored_fields = set(getattr(BlockStored, "__struct_fields__", ()))

    class NexusKVConnectorMetadata(KVConnectorMetadata):
        def __init__(self, meta: Any) -> None:
            self.meta = meta

    class NexusKVConnector(KVConnectorBase_V1):  # type: ignore[misc, valid-type]
        """NexusKV as a vLLM KV connector (see :mod:`connectors.vllm.connector`)."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            if takes_cache_config:
                super().__init__(vllm_config, role, kv_cache_config)
            else:
                super().__init__(vllm_config, role)
            self._config = _config_of(vllm_config, getattr(vllm, "__version__", "0.33"))
            self._num_blocks = getattr(kv_cache_config, "num_blocks", None)
            self._scheduler = self._worker = self._bus = None
            if role == KVConnectorRole.SCHEDULER:
                self._scheduler, self._bus = scheduler_side(self._config)
            else:
                self._worker = worker_side(self._config)

        # scheduler side
        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
            if not _plain(request):
                return 0, False
            return self._scheduler.num_new_matched_tokens(request.request_id, list(request.all_token_ids),
                                                          num_computed_tokens)

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
            self._scheduler.update_state_after_alloc(request.request_id, list(ids), num_external_tokens)

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            return NexusKVConnectorMetadata(self._scheduler.build_meta())

        def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
            if not _plain(request):
                return False, None
            return self._scheduler.request_finished(request.request_id, list(request.all_token_ids), block_ids)

        def update_connector_output(self, connector_output: Any) -> None:
            self._scheduler.update_connector_output(connector_output.finished_sending or (),
                                                    connector_output.finished_recving or ())

        def take_events(self) -> list[Any]:
            out = []
            for e in self._scheduler.take_events():
                fields: dict[str, Any] = dict(block_hashes=list(e.engine_hashes), parent_block_hash=None,
                                              token_ids=[], block_size=self._config.descriptor.block_size,
                                              lora_id=None, medium=_MEDIUM[e.tier])
                if "lora_name" in stored_fields:
                    fields["lora_name"] = None
                out.append(BlockStored(**fields))
            return out

        # worker side
        def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
            self._worker.register_kv_caches(kv_caches, _block_dims(kv_caches, self._num_blocks))

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            self._worker.start_load(self._get_connector_metadata().meta)

        def wait_for_layer_load(self, layer_name: str) -> None:
            self._worker.wait_for_layer_load(layer_name)

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            # Saves are of finished requests' blocks, which vLLM keeps allocated until get_finished
            # reports them written; they are read from the registered caches in wait_for_save.
            return None

        def wait_for_save(self) -> None:
            self._worker.wait_for_save(self._get_connector_metadata().meta)

        def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
            sending, recving = self._worker.get_finished(finished_req_ids)
            return sending or None, recving or None

        def get_block_ids_with_load_errors(self) -> set[int]:
            return self._worker.block_ids_with_load_errors()

        def shutdown(self) -> None:
            if self._worker is not None:
                self._worker.close()
            if self._bus is not None:
                self._bus.stop()

    NexusKVConnector.__module__ = __name__
    return NexusKVConnector


def _plain(request: Any) -> bool:
    """A request whose blocks vLLM hashes without extra keys (no LoRA, multimodal input or salt)."""
    return (getattr(request, "lora_request", None) is None and not getattr(request, "mm_features", None)
            and not getattr(request, "mm_hashes", None) and getattr(request, "cache_salt", None) is None)


def _config_of(vllm_config: Any, version: str) -> ConnectorConfig:
    transfer = vllm_config.kv_transfer_config
    events = getattr(vllm_config, "kv_events_config", None)
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    if getattr(parallel, "tensor_parallel_size", 1) != 1:
        raise ConfigError("tensor_parallel_size", "the NexusKV connector supports TP=1 per engine")
    return ConnectorConfig.parse(
        getattr(transfer, "kv_connector_extra_config", None), model=vllm_config.model_config.model,
        block_size=cache.block_size, kv_events_topic=getattr(events, "topic", "") or "",
        data_parallel_rank=getattr(parallel, "data_parallel_rank", 0) or 0,
        hash_algo=getattr(cache, "prefix_caching_hash_algo", "sha256") or "sha256",
        python_hash_seed=os.environ.get("PYTHONHASHSEED"), vllm_version=version)


def _disk_root(config: ConnectorConfig, settings: Any) -> Path:
    return Path(settings.data_dir) / "tiers" / config.worker / "disk"


def scheduler_side(config: ConnectorConfig, *, settings: Any = None, base_model: Any = None,
                   engine_hashes: Any = None) -> tuple[Any, Any]:
    """What the shell builds in vLLM's scheduler: the scheduler side on a started background bus.

    ``settings`` default to the environment's; ``base_model`` is the cost model before the
    calibration topic says otherwise (the shipped one by default); ``engine_hashes`` is vLLM's
    block hash (an engine playing vLLM passes its own). Stop the bus when done.
    """
    from connectors.bus_thread import BackgroundBus
    from connectors.vllm.connector_core import Readable, SchedulerSide
    from nexuskv.config import Settings
    from nexuskv.dataplane.disk import stored_header
    from nexuskv.dataplane.remote import RemoteBackend
    from nexuskv.policy import ExecutionPolicy
    from streams.policy_file import PolicyFile

    settings = settings or Settings.from_env()
    if settings.broker_url is None:
        raise ConfigError("NEXUSKV_BROKER", "the NexusKV connector needs the deployment's bus")
    bus = BackgroundBus(settings.broker_url, client_id=f"nexuskv-vllm-{config.worker}",
                        secret=settings.identity_secret_bytes, max_memberships=settings.index_max_memberships,
                        checkpoint_dir=settings.data_dir / "index" / "nexuskv-index",
                        base_model=base_model).start(settings.broker_start_timeout_s)
    policy = PolicyFile(settings.policy_file).current if settings.policy_file else ExecutionPolicy(version="builtin")
    disk_root = _disk_root(config, settings)
    remote = RemoteBackend(settings.remote_tier) if settings.remote_tier else None

    def probe(tier: Tier, keys: Sequence[PayloadKey]) -> list[bool]:
        if tier is Tier.DISK:
            # The worker writes these files in its own process: read them, not a second backend's index.
            return [stored_header(disk_root, k) is not None for k in keys]
        if tier is Tier.REMOTE and remote is not None:
            return [h is not None for h in remote.headers(keys)]
        return [False] * len(keys)

    shared = frozenset({Tier.REMOTE}) if settings.remote_tier else frozenset()
    side = SchedulerSide(config.descriptor, worker=config.worker, index=bus, model=lambda: bus.model,
                         execution=lambda: policy, readable=Readable(config.worker, frozenset({Tier.DISK}), shared),
                         engine_hashes=engine_hashes or vllm_engine_hasher(config), probe=probe, save_tier=config.save_tier,
                         profile=config.profile, load_async=config.load_async, decide_wait_s=config.decide_wait_s,
                         secret=settings.identity_secret_bytes)
    return side, bus


def worker_side(config: ConnectorConfig, *, settings: Any = None) -> Any:
    """What the shell builds in each vLLM worker: the worker side over this worker's disk (and remote) tier."""
    from connectors.vllm.connector_core import WorkerSide
    from nexuskv.config import Settings
    from nexuskv.dataplane.catalog import BackendCatalog
    from nexuskv.dataplane.disk import DiskBackend
    from nexuskv.dataplane.remote import RemoteBackend

    settings = settings or Settings.from_env()
    backends: list[Any] = [DiskBackend(_disk_root(config, settings), settings.tier_disk_bytes)]
    if settings.remote_tier:
        backends.append(RemoteBackend(settings.remote_tier))
    return WorkerSide(config.descriptor, BackendCatalog(config.worker, backends))


def _block_dims(kv_caches: Mapping[str, Any], num_blocks: int | None) -> dict[str, int]:
    """Where each layer's block dimension is: 1 for FlashAttention's ``(2, num_blocks, ...)``, else 0.

    A wrong guess cannot go unnoticed: the worker side checks the bytes of one block against the
    descriptor at registration.
    """
    dims = {}
    for name, t in kv_caches.items():
        shape = tuple(t.shape)
        leading_blocks = num_blocks is not None and shape[0] == num_blocks
        dims[name] = 1 if not leading_blocks and len(shape) >= 2 and shape[0] == 2 else 0
    return dims


__getattr__ = lazy_attribute(globals(), "NexusKVConnector", _build_connector_class)
