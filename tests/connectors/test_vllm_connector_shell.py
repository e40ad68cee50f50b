"""The vLLM shell around the connector core: lazy vLLM import, configuration, vLLM's block hashes.

vLLM cannot be installed here, so the shell's class is not built in these tests; what runs
without vLLM is tested: the module imports without it, its configuration is parsed and refused
by field, the hashes in its tier events are vLLM's (engines.md §2.2), and the two sides as the
shell builds them (background bus, disk tier, file probe) serve a reloaded prompt over Kafka.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import uuid

import pytest

from connectors.vllm.connector import ConnectorConfig, vllm_engine_hasher
from connectors.vllm.connector_core import Readable, SchedulerSide
from nexuskv.descriptor import Tier
from nexuskv.errors import ConfigError
from nexuskv.index import GlobalIndex
from tests.connectors.reference import POLICY, cost_model

MODEL = "meta-llama/Llama-3.1-8B"
TOPIC = "kv@10.0.0.5:8000@meta-llama/Llama-3.1-8B"
BLOCK_1_16 = 8866452693264111234  # engines.md §2.2: tokens 1..16, sha256_cbor, NONE_HASH("vllm-none-hash")
BLOCK_17_32 = 807986237951177663
BLOCK_1_16_SEED0 = 3236607068019569386  # PYTHONHASHSEED=0


def _config(**extra) -> ConnectorConfig:
    return ConnectorConfig.parse(extra, model=MODEL, block_size=16, kv_events_topic=TOPIC)


def test_importing_the_module_does_not_import_vllm():
    code = ("import sys, connectors.vllm.connector as c; assert 'vllm' not in sys.modules; "
            "print(c.ConnectorConfig.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ConnectorConfig"


def test_the_class_is_built_on_access_and_needs_vllm():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the class builds")
    module = importlib.import_module("connectors.vllm.connector")
    with pytest.raises(ImportError, match="needs vLLM"):
        module.NexusKVConnector  # noqa: B018 - the attribute access is what vLLM's factory does
    with pytest.raises(AttributeError):
        module.SomethingElse  # noqa: B018


def test_configuration_defaults_and_the_worker_from_the_events_topic():
    cfg = _config(tenant="acme")
    assert cfg.worker == "vllm/10.0.0.5:8000/dp0"  # what the bridge names this engine
    assert cfg.descriptor.tenant_namespace == "acme" and cfg.descriptor.block_size == 16
    assert cfg.save_tier is Tier.DISK and cfg.load_async is False and cfg.decide_wait_s == pytest.approx(0.05)
    assert ConnectorConfig.parse({"save_tier": "none", "worker": "w"}, model=MODEL, block_size=16).save_tier is None


@pytest.mark.parametrize("extra, field", [
    ({"bogus": 1}, "kv_connector_extra_config.bogus"),
    ({"save_tier": "tape"}, "kv_connector_extra_config.save_tier"),
    ({"decide_wait_ms": -1}, "kv_connector_extra_config.decide_wait_ms"),
    ({"load_async": "yes"}, "kv_connector_extra_config.load_async"),
    ({"model": "no/such-model"}, "model"),
])
def test_bad_configuration_names_the_field(extra, field):
    with pytest.raises(ConfigError) as err:
        _config(**extra)
    assert err.value.field == field


def test_no_worker_name_without_a_kv_topic():
    with pytest.raises(ConfigError, match="publisher name"):
        ConnectorConfig.parse({}, model=MODEL, block_size=16, kv_events_topic="free-form")


def test_an_unreproducible_none_hash_is_refused_at_start():
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        ConnectorConfig.parse({"worker": "w"}, model=MODEL, block_size=16, vllm_version="0.23")


def test_the_connectors_block_hashes_are_vllms():
    tokens = list(range(1, 34))
    assert list(vllm_engine_hasher(_config())(tokens)) == [BLOCK_1_16, BLOCK_17_32]
    seeded = ConnectorConfig.parse({}, model=MODEL, block_size=16, kv_events_topic=TOPIC, python_hash_seed="0")
    assert vllm_engine_hasher(seeded)(tokens)[0] == BLOCK_1_16_SEED0


def _scheduler(cfg: ConnectorConfig, held: list[bool] | None = None) -> SchedulerSide:
    model = cost_model(cfg.descriptor)
    return SchedulerSide(cfg.descriptor, worker=cfg.worker, index=GlobalIndex(), model=lambda: model,
                         execution=lambda: POLICY, readable=Readable(cfg.worker), engine_hashes=vllm_engine_hasher(cfg),
                         probe=lambda tier, keys: held if held is not None else [True] * len(keys),
                         save_tier=Tier.DISK)


def test_tier_events_of_saved_blocks_carry_vllms_hashes():
    sched = _scheduler(_config())
    keep, params = sched.request_finished("r1", list(range(1, 34)), [7, 9, 11])
    assert keep is True and params is None
    (save,) = sched.build_meta().saves
    assert save.engine_hashes == (BLOCK_1_16, BLOCK_17_32) and save.block_ids == (7, 9)
    assert sched.take_events() == []  # nothing is announced before the worker reports the save
    sched.update_connector_output(finished_sending={"r1"})
    (event,) = sched.take_events()
    assert event.engine_hashes == (BLOCK_1_16, BLOCK_17_32) and event.tier is Tier.DISK
    assert sched.take_events() == []


def test_only_blocks_the_tier_holds_are_announced():
    sched = _scheduler(_config(), held=[True, False])  # the second write did not land
    sched.request_finished("r1", list(range(1, 34)), [7, 9])
    sched.update_connector_output(finished_sending={"r1"})
    (event,) = sched.take_events()
    assert event.engine_hashes == (BLOCK_1_16,)
    assert sched.stats["saves_announced"] == 1 and sched.stats["saves_missing"] == 1


@pytest.mark.broker
def test_the_shells_wiring_serves_saved_blocks_over_the_bus(kafka_url, tmp_path):
    """The scheduler and worker sides as the shell builds them (background bus, disk tier, file
    probe), with the reference engine playing vLLM and publishing to the real Kafka."""
    import asyncio

    import torch

    from connectors.vllm.connector import scheduler_side, worker_side
    from connectors.vllm.standin import VllmStandIn
    from nexuskv.config import Settings
    from nexuskv.contracts.kv_events import KvEventBatch
    from nexuskv.reference_engine import ReferenceModelSpec, ReferenceEngine, engine_hashes
    from streams.topics import ensure_topics
    from tests.connectors.reference import PROFILE

    asyncio.run(ensure_topics(kafka_url, partitions=8))
    tenant = f"vllm-shell-{uuid.uuid4().hex[:8]}"
    spec = ReferenceModelSpec.gqa()
    probe_rt = ReferenceEngine(spec, tenant_namespace=tenant, worker="w-shell")
    path = tmp_path / "descriptor.json"
    path.write_text(probe_rt.descriptor.model_dump_json())
    cfg = ConnectorConfig.parse({"descriptor": str(path), "tenant": tenant, "worker": probe_rt.publisher_id,
                                 "profile": PROFILE}, model="n/a", block_size=spec.block_size)
    settings = Settings.from_env({"NEXUSKV_BROKER": str(kafka_url), "NEXUSKV_DATA_DIR": str(tmp_path)})
    sched, bus = scheduler_side(cfg, settings=settings, base_model=cost_model(cfg.descriptor),
                                engine_hashes=lambda toks: engine_hashes(toks, spec.block_size))
    worker = worker_side(cfg, settings=settings)
    try:
        runtime = ReferenceEngine(spec, tenant_namespace=tenant, worker="w-shell", model=probe_rt.model,
                                   publisher=lambda r: bus.publish(r) if isinstance(r, KvEventBatch) else None)
        engine = VllmStandIn(runtime, sched, worker)
        prompt = torch.randint(0, 256, (26,), generator=torch.Generator().manual_seed(9)).tolist()
        assert engine.serve("r1", prompt).saved_requests == 1
        runtime.reset()
        bus.wait_caught_up()
        served = engine.serve("r2", prompt)
        assert served.matched_tokens == 24 and served.loaded_tokens == 24
        expected = ReferenceEngine(spec, model=probe_rt.model).prefill(prompt, reuse=False).logits
        assert (served.result.logits - expected).abs().max().item() <= 1e-5
    finally:
        worker.close()
        bus.stop()
