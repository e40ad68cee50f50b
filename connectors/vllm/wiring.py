"""Building the connector's two sides from settings: what the vLLM shell runs in each process.

* :func:`build_scheduler_side` — in vLLM's engine-core process: an
  :class:`~connectors.index_client.IndexClient` of the node's index sidecar (the engine holds no
  index: it asks, within ``NEXUSKV_INDEX_ASK_BUDGET_MS``), a started
  :class:`~connectors.bus_thread.BackgroundBus` (cost-model replica, producer),
  the execution policy, file and remote-tier probes, the cold-start cost model of this model and
  worker, and the decision records published to ``nexuskv.decisions``.
* :func:`build_worker_side` — in each vLLM worker process: the worker's disk tier (under
  ``NEXUSKV_DATA_DIR/tiers/<worker>/disk``) and the remote tier when ``NEXUSKV_REMOTE_TIER`` is
  set, a :class:`~connectors.bus_thread.BackgroundProducer`, and the save tier's
  :class:`~connectors.vllm.tier_publisher.TierPublisher`, started (its snapshot re-announces what
  the tier holds) before the worker serves anything; observations go to ``nexuskv.observations``.

Both read ``NEXUSKV_BROKER`` (required: the connector is nothing without the deployment's bus),
``NEXUSKV_DATA_DIR``, ``NEXUSKV_INDEX_SOCKET``, ``NEXUSKV_REMOTE_TIER``, ``NEXUSKV_IDENTITY_SECRET`` and ``NEXUSKV_POLICY_FILE``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from connectors.bus_thread import BackgroundBus, BackgroundProducer
from connectors.index_client import client_from_settings
from connectors.vllm.config import ConnectorConfig
from connectors.vllm.scheduler_side import Readable, SchedulerSide
from connectors.vllm.tier_publisher import TierPublisher
from connectors.vllm.tracing import RequestTraces
from connectors.vllm.worker_side import WorkerSide, tier_held
from nexuskv.config import Settings
from nexuskv.contracts.topics import DECISIONS
from nexuskv.cost import CostModel, extent_bytes
from nexuskv.dataplane.payload import PayloadKey
from nexuskv.descriptor import Tier
from nexuskv.errors import ConfigError
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.policy import ExecutionPolicy
from nexuskv.priors import ColdStart
from streams.bus.policy_file import PolicyFile

__all__ = ["PROBE_DEADLINE_S", "disk_root", "tier_state_dir", "build_scheduler_side", "build_worker_side"]

#: Deadline of the scheduler side's remote-tier probe: it blocks vLLM's scheduler thread, and a
#: healthy store reads thousands of headers in milliseconds. Past it the tier holds nothing
#: (recompute) and the store's breaker opens: one stalled step, not one per request.
PROBE_DEADLINE_S = 1.0


def tier_state_dir(config: ConnectorConfig, settings: Settings) -> Path:
    """Where this worker's tiers live: the disk tier's files, the tier publishers' manifests."""
    return Path(settings.data_dir) / "tiers" / config.worker


def disk_root(config: ConnectorConfig, settings: Settings) -> Path:
    return tier_state_dir(config, settings) / "disk"


def _broker(settings: Settings):
    if settings.broker_url is None:
        raise ConfigError("NEXUSKV_BROKER", "the NexusKV connector needs the deployment's bus")
    return settings.broker_url


def build_scheduler_side(config: ConnectorConfig, *, settings: Settings | None = None,
                         base_model: CostModel | None = None,
                         traces: RequestTraces | None = None) -> tuple[SchedulerSide, BackgroundBus]:
    """The scheduler side on a started background bus (stop the bus when done: it closes the index client).
    With ``traces``, each decision record carries its request's trace (:mod:`connectors.vllm.tracing`)."""
    from nexuskv.dataplane.disk import stored_header
    from nexuskv.dataplane.remote import RemoteBackend

    settings = settings or Settings.from_env()
    url = _broker(settings)
    policy = PolicyFile(settings.policy_file).current if settings.policy_file else ExecutionPolicy(version="builtin")
    index = client_from_settings(settings, name=f"nexuskv-vllm-{config.worker}")
    bus = BackgroundBus(url, client_id=f"nexuskv-vllm-{config.worker}", base_model=base_model,
                        index=index).start(settings.broker_start_timeout_s)
    root = disk_root(config, settings)
    remote = RemoteBackend(settings.remote_tier) if settings.remote_tier else None

    def probe(tier: Tier, keys: Sequence[PayloadKey]) -> list[bool]:
        if tier is Tier.DISK:
            # The worker writes these files in its own process: read them, not a second backend's index.
            return [stored_header(root, k) is not None for k in keys]
        if tier is Tier.REMOTE and remote is not None:
            return [h is not None for h in remote.headers(keys, deadline_s=PROBE_DEADLINE_S)]
        return [False] * len(keys)

    profile = config.profile or policy.planner.default_hardware_profile
    cold = None
    if config.model_spec is not None:
        cold = ColdStart(config.model_spec, profile, block_bytes=extent_bytes(config.descriptor, 1),
                         prefill_chunk_tokens=config.prefill_chunk_tokens)
    own = frozenset({Tier.DISK, Tier.REMOTE})
    shared = frozenset({Tier.REMOTE}) if settings.remote_tier else frozenset()

    def on_decision(decision: Any) -> None:
        headers = traces.decided(decision) if traces is not None else None
        bus.send(decision, topic=DECISIONS, key=decision.request_id, headers=headers or None)

    side = SchedulerSide(config.descriptor, worker=config.worker, index=index, model=lambda: bus.model,
                         execution=lambda: policy, readable=Readable(config.worker, own, shared), probe=probe,
                         save_tier=config.save_tier, profile=profile, load_async=config.load_async,
                         decide_wait_s=config.decide_wait_s, secret=settings.identity_secret_bytes, cold_start=cold,
                         on_decision=on_decision)
    return side, bus


def build_worker_side(config: ConnectorConfig, *, settings: Settings | None = None, measure: bool = True,
                      layerwise: bool = False) -> tuple[WorkerSide, BackgroundProducer]:
    """The worker side over this worker's disk (and remote) tier, its save tier's publisher started.

    ``layerwise``: the engine calls ``wait_for_layer_load`` before each attention layer (vLLM does),
    so synchronous loads are put in place layer by layer (see :mod:`connectors.vllm.worker_side`)."""
    from nexuskv.dataplane.catalog import BackendCatalog
    from nexuskv.dataplane.disk import DiskBackend
    from nexuskv.dataplane.remote import RemoteBackend

    settings = settings or Settings.from_env()
    url = _broker(settings)
    root = disk_root(config, settings)
    backends: list[Any] = [DiskBackend(root, settings.tier_disk_bytes)]
    if settings.remote_tier:
        backends.append(RemoteBackend(settings.remote_tier))
    if config.save_tier is Tier.REMOTE and not settings.remote_tier:
        raise ConfigError("kv_connector_extra_config.save_tier", "remote needs NEXUSKV_REMOTE_TIER")
    catalog = BackendCatalog(config.worker, backends)
    held = tier_held(catalog, root)
    producer = BackgroundProducer(url, client_id=f"nexuskv-vllm-worker-{config.worker}").start(
        settings.broker_start_timeout_s)
    publisher = None
    try:
        if config.save_tier is not None:
            keyer = BlockKeyer(IdentityScope.of(config.descriptor), config.descriptor.block_size,
                               settings.identity_secret_bytes)
            tier = config.save_tier
            publisher = TierPublisher(config.descriptor, worker=config.worker, tier=tier, keyer=keyer,
                                      publish=lambda batch: producer.send(batch, wait=True),
                                      held=lambda keys: held(tier, keys), state_dir=tier_state_dir(config, settings))
            publisher.start()
        policy = PolicyFile(settings.policy_file).current if settings.policy_file else ExecutionPolicy(version="builtin")
        profile = config.profile or policy.planner.default_hardware_profile
        worker = WorkerSide(config.descriptor, catalog, held=held, publisher=publisher,
                            observe=lambda record: producer.send(record), profile=profile, measure=measure,
                            layerwise=layerwise, save_queue_bytes=config.save_queue_bytes)
    except Exception:
        producer.stop()
        raise
    return worker, producer
