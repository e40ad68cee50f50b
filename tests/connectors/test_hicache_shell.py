"""The SGLang shell around the HiCache core: lazy import, configuration, and the core on the real bus.

These run without SGLang (the shell inside SGLang's own controllers is
``tests/connectors/sglang_real/test_hicache_engine.py``): the configuration SGLang's storage
config and host pool resolve to, and the wiring (:func:`connectors.sglang.hicache.build_core`:
the background bus, the tier, the core) against the test session's Apache Kafka.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from types import SimpleNamespace

import pytest
import torch

from connectors.sglang.hashing import page_hashes_hex
from connectors.sglang.hicache import EngineShard, HiCacheConfig, HostPages, build_core, component_key
from nexuskv.config import Settings
from nexuskv.descriptor import DType, Tier
from nexuskv.errors import ConfigError
from nexuskv.models import gqa_descriptor
from streams.bus.topics import ensure_topics

MODEL = "meta-llama/Llama-3.1-8B"
README = {"backend_name": "nexuskv", "module_path": "connectors.sglang.hicache", "class_name": "NexusKVHiCacheStorage",
          "tier": "remote", "tenant": "acme", "model": MODEL}


def llama_pages(page: int = 64, *, tp_size: int = 1, dtype: str = "bfloat16", layout: str = "layer_first") -> HostPages:
    """What SGLang's host pool of Llama-3.1-8B looks like on one of ``tp_size`` ranks."""
    itemsize = 1 if dtype.startswith("float8") else 2
    return HostPages(page_size=page, dtype=dtype, page_bytes=2 * 32 * page * (8 // tp_size) * 128 * itemsize,
                     layout=layout, pages=1024)


def test_importing_the_module_does_not_import_sglang():
    code = "import sys, connectors.sglang.hicache as h; assert 'sglang' not in sys.modules; print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "ok\n"


def test_the_class_is_built_on_access_and_needs_sglang():
    code = ("import sys; sys.modules['sglang'] = None  # SGLang absent\n"
            "import connectors.sglang.hicache as h\n"
            "try:\n    h.NexusKVHiCacheStorage\nexcept ImportError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("NexusKVHiCacheStorage needs SGLang (0.5.10-0.5.23) installed")


def test_the_readme_config_resolves_with_sglangs_page_size():
    cfg = HiCacheConfig.parse({**README, "file_storage_path": "/tmp/hicache", "interface_v1": 0},
                              pages=llama_pages(64), remote_configured=True, host="node-1")
    assert cfg.worker == cfg.owner == "sglang-hicache/node-1/tp0" and cfg.tier is Tier.REMOTE
    d = cfg.descriptor
    assert d.block_size == 64 and d.engine_family == "sglang" and d.tenant_namespace == "acme"
    assert d.layout.layout == "sglang-layer_first" and d.layer_groups[0].tensors[0].dtype is DType.BFLOAT16
    assert HiCacheConfig.parse({}, pages=llama_pages(16), model_name=MODEL).tier is Tier.DISK


def test_the_host_pool_decides_dtype_and_layout_and_must_match_the_model():
    fp8 = HiCacheConfig.parse(README, pages=llama_pages(16, dtype="float8_e4m3fn", layout="page_first"),
                              remote_configured=True)
    bf16 = HiCacheConfig.parse(README, pages=llama_pages(16), remote_configured=True)
    assert fp8.descriptor.layer_groups[0].tensors[0].dtype is DType.FLOAT8_E4M3
    assert fp8.descriptor.descriptor_id != bf16.descriptor.descriptor_id  # never read each other's pages
    wrong = HostPages(page_size=16, dtype="bfloat16", page_bytes=12345, layout="layer_first", pages=8)
    with pytest.raises(ConfigError) as err:
        HiCacheConfig.parse(README, pages=wrong, remote_configured=True)
    assert err.value.field == "hicache_storage_backend_extra_config.model"


def test_every_tp_rank_gets_its_own_shard_and_name():
    ranks = [HiCacheConfig.parse(README, pages=llama_pages(16, tp_size=2), shard=EngineShard(tp_rank=r, tp_size=2),
                                 remote_configured=True, host="h") for r in range(2)]
    assert [c.worker for c in ranks] == ["sglang-hicache/h/tp0", "sglang-hicache/h/tp1"]
    assert [c.descriptor.parallel.tp_rank for c in ranks] == [0, 1]
    assert ranks[0].descriptor.descriptor_id != ranks[1].descriptor.descriptor_id
    dp = HiCacheConfig.parse(README, pages=llama_pages(16), shard=EngineShard(dp_rank=1), remote_configured=True,
                             host="h")
    assert dp.worker == "sglang-hicache/h/dp1-tp0"


def test_mla_ranks_share_one_descriptor_and_read_the_writers_pages():
    pages = HostPages(page_size=16, dtype="bfloat16", page_bytes=61 * 576 * 16 * 2, layout="layer_first", pages=64)
    extra = {"model": "deepseek-ai/DeepSeek-V3", "tier": "disk"}
    ranks = [HiCacheConfig.parse(extra, pages=pages, shard=EngineShard(tp_rank=r, tp_size=4, replicated=True),
                                 host="h") for r in range(4)]
    assert len({c.descriptor.descriptor_id for c in ranks}) == 1
    assert [c.owner for c in ranks] == ["sglang-hicache/h/tp0"] * 4
    assert ranks[2].worker == "sglang-hicache/h/tp2"
    assert component_key("k", "mamba", ranks[2].shard) == "k.mamba.tp2"  # Mamba state stays per rank
    assert component_key("k", "indexer", ranks[2].shard) == "k.indexer" and component_key("k", "kv", ranks[2].shard) == "k"


def test_a_descriptor_file_gets_the_ranks_shard(tmp_path):
    d = gqa_descriptor(model="test/file-model", num_layers=2, num_kv_heads=4, head_dim=16, block_size=8,
                       engine_family="sglang", tp_size=2)
    path = tmp_path / "d.json"
    path.write_text(d.model_dump_json())
    pages = HostPages(page_size=8, dtype="bfloat16", page_bytes=2 * 2 * 8 * 2 * 16 * 2, layout="page_first", pages=8)
    cfg = HiCacheConfig.parse({"descriptor": str(path)}, pages=pages, shard=EngineShard(tp_rank=1, tp_size=2))
    assert cfg.descriptor.parallel.tp_rank == 1 and cfg.descriptor.model == "test/file-model"


def test_engine_shard_reads_every_versions_storage_config():
    old = SimpleNamespace(tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, is_mla_model=False, model_name=MODEL,
                          extra_config={})  # 0.5.10: no dp_rank, no DCP fields
    assert EngineShard.of(old) == EngineShard(tp_rank=1, tp_size=2, model_name=MODEL)
    new = SimpleNamespace(tp_rank=3, tp_size=4, pp_rank=0, pp_size=1, is_mla_model=True, dp_rank=2, attn_cp_size=1,
                          dcp_size=1, dcp_rank=0, model_name=None)
    shard = EngineShard.of(new)
    assert shard.replicated and not shard.writer and shard.rank_name() == "dp2-tp3"


@pytest.mark.parametrize("extra, kw, field", [
    ({"colour": "blue"}, {}, "hicache_storage_backend_extra_config.colour"),
    ({"tier": "tape"}, {}, "hicache_storage_backend_extra_config.tier"),
    ({"tier": "remote"}, {}, "NEXUSKV_REMOTE_TIER"),
    ({"page_size": 32}, {}, "hicache_storage_backend_extra_config.page_size"),
    ({"model": "nope/unknown"}, {}, "model"),
    ({"model": "deepseek-ai/DeepSeek-V3"}, {}, "hicache_storage_backend_extra_config.model"),  # MLA vs an MHA pool
    ({}, {"shard": EngineShard(pp_rank=1, pp_size=2)}, "hicache_storage_backend_extra_config.model"),
    ({}, {"shard": EngineShard(cp_size=2)}, "hicache_storage_backend_extra_config.backend_name"),
    ({"tier": "host"}, {"shard": EngineShard(tp_rank=1, tp_size=2, replicated=True)},
     "hicache_storage_backend_extra_config.tier"),
])
def test_bad_configuration_names_the_field(extra, kw, field):
    args = {"model_name": MODEL, "pages": llama_pages(64), **kw}
    with pytest.raises(ConfigError) as err:
        HiCacheConfig.parse(extra, **args)
    assert err.value.field == field


@pytest.mark.broker
async def test_pages_and_their_facts_over_the_bus(kafka_url, tmp_path, index_sidecar):
    await ensure_topics(kafka_url, partitions=8)
    settings = Settings.from_env({"NEXUSKV_BROKER": str(kafka_url), "NEXUSKV_DATA_DIR": str(tmp_path),
                                  **index_sidecar.env})
    d = gqa_descriptor(model="test/bus-model", num_layers=1, num_kv_heads=1, head_dim=8, block_size=16,
                       engine_family="sglang")
    path = tmp_path / "d.json"
    path.write_text(d.model_dump_json())
    pages = HostPages(page_size=16, dtype="bfloat16", page_bytes=2 * 16 * 8 * 2, layout="layer_first", pages=64)
    cfg = HiCacheConfig.parse({"tenant": f"hicache-{uuid.uuid4().hex[:8]}", "worker": "sglang-hicache/bus-test",
                               "descriptor": str(path)}, pages=pages)
    core, bus = build_core(cfg, settings)
    try:
        keys = page_hashes_hex(list(range(48)), 16)
        page_data = [torch.full((2, 16, 8), float(i), dtype=torch.bfloat16) for i in range(3)]
        assert core.set_many(list(zip(keys, page_data))) == [True, True, True]
        await asyncio.to_thread(bus.index.wait_caught_up)
        assert [core.exists(k) for k in keys] == [True, True, True]
        target = torch.empty(2, 16, 8, dtype=torch.bfloat16)
        assert core.get(keys[1], target) is target and torch.equal(target, page_data[1])
        assert core.delete(keys[1])
        await asyncio.to_thread(bus.index.wait_caught_up)
        assert [core.exists(k) for k in keys] == [True, False, True]
        assert core.get(keys[1], target) is None
    finally:
        bus.stop()
