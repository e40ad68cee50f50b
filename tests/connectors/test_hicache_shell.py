"""The SGLang shell around the HiCache core: lazy import, configuration, and the core on the real bus.

SGLang cannot be installed here, so the ``HiCacheStorage`` subclass is not built; its wiring
(:func:`connectors.sglang.hicache.build_core`: the background bus, the tier, the core) runs
against the test session's Apache Kafka.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import uuid

import pytest
import torch

from connectors.sglang.hashing import page_hashes_hex
from connectors.sglang.hicache import HiCacheConfig, build_core
from nexuskv.config import Settings
from nexuskv.descriptor import Tier
from nexuskv.errors import ConfigError
from streams.topics import ensure_topics

MODEL = "meta-llama/Llama-3.1-8B"


def test_importing_the_module_does_not_import_sglang():
    code = "import sys, connectors.sglang.hicache as h; assert 'sglang' not in sys.modules; print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "ok\n"


def test_the_class_is_built_on_access_and_needs_sglang():
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here: the class builds")
    module = importlib.import_module("connectors.sglang.hicache")
    with pytest.raises(ImportError, match="needs SGLang"):
        module.NexusKVHiCacheStorage  # noqa: B018 - what SGLang's backend factory does


def test_configuration_defaults():
    cfg = HiCacheConfig.parse({"backend_name": "nexuskv", "module_path": "connectors.sglang.hicache",
                               "class_name": "NexusKVHiCacheStorage", "tenant": "acme"},
                              model_name=MODEL, page_size=64, host="node-1", tp_rank=0)
    assert cfg.worker == "sglang-hicache/node-1/tp0" and cfg.tier is Tier.DISK
    assert cfg.descriptor.block_size == 64 and cfg.descriptor.engine_family == "sglang"
    assert cfg.descriptor.tenant_namespace == "acme"
    assert HiCacheConfig.parse({}, model_name=MODEL, page_size=64, remote_configured=True).tier is Tier.REMOTE


@pytest.mark.parametrize("extra, kw, field", [
    ({"colour": "blue"}, {}, "hicache_storage_backend_extra_config.colour"),
    ({"interface_v1": True}, {}, "hicache_storage_backend_extra_config.interface_v1"),
    ({"tier": "tape"}, {}, "hicache_storage_backend_extra_config.tier"),
    ({"tier": "remote"}, {}, "NEXUSKV_REMOTE_TIER"),
    ({}, {"page_size": None}, "hicache_storage_backend_extra_config.page_size"),
    ({}, {"tp_size": 2, "tp_rank": 1}, "hicache_storage_backend_extra_config.descriptor"),
])
def test_bad_configuration_names_the_field(extra, kw, field):
    args = {"model_name": MODEL, "page_size": 64, **kw}
    with pytest.raises(ConfigError) as err:
        HiCacheConfig.parse(extra, **args)
    assert err.value.field == field


@pytest.mark.broker
async def test_pages_and_their_facts_over_the_bus(kafka_url, tmp_path):
    await ensure_topics(kafka_url, partitions=8)
    settings = Settings.from_env({"NEXUSKV_BROKER": str(kafka_url), "NEXUSKV_DATA_DIR": str(tmp_path)})
    cfg = HiCacheConfig.parse({"tenant": f"hicache-{uuid.uuid4().hex[:8]}", "worker": "sglang-hicache/bus-test/tp0"},
                              model_name=MODEL, page_size=16)
    core, bus = build_core(cfg, settings)
    try:
        keys = page_hashes_hex(list(range(48)), 16)
        pages = [torch.full((2, 16, 8), float(i), dtype=torch.float16) for i in range(3)]
        for key, page in zip(keys, pages):
            assert core.set(key, page)
        bus.wait_caught_up()
        assert [core.exists(k) for k in keys] == [True, True, True]
        target = torch.empty(2, 16, 8, dtype=torch.float16)
        assert core.get(keys[1], target) is target and torch.equal(target, pages[1])
        assert core.delete(keys[1])
        bus.wait_caught_up()
        assert [core.exists(k) for k in keys] == [True, False, True]
        assert core.get(keys[1], target) is None
    finally:
        bus.stop()
