"""The vLLM connector's configuration and its wiring, without running vLLM.

The module vLLM loads imports without vLLM; its configuration derives the descriptor from the
model's own config and checks it against the KV cache vLLM allocated, refusing bad values by
field; and the two sides as :mod:`connectors.vllm.wiring` builds them (background bus, disk tier,
tier publisher, file probes, decision and observation records) serve a reloaded prompt over a real
Kafka, across a GPU reset and a worker restart, with the reference runtime playing vLLM. The real
engine runs the same code in ``tests/engines/vllm/``.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid

import pytest

from connectors.vllm.config import ConnectorConfig, KvCacheShape
from nexuskv.descriptor import Tier
from nexuskv.errors import ConfigError
from nexuskv.models import known_model

MODEL = "meta-llama/Llama-3.1-8B"
TOPIC = "kv@10.0.0.5:8000@meta-llama/Llama-3.1-8B"
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
        "vocab_size": 1024, "dtype": "bfloat16", "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}


def _config(extra=None, **kw) -> ConnectorConfig:
    args = dict(model="/models/tiny", block_size=32, hf_config=TINY, kv_events_topic=TOPIC, layout="paged_hn_kvd")
    args.update(kw)
    return ConnectorConfig.parse(extra or {}, **args)


def test_importing_the_module_does_not_import_vllm():
    code = ("import sys, connectors.vllm.connector as c; assert 'vllm' not in sys.modules; "
            "print(c.ConnectorConfig.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ConnectorConfig"


def test_the_descriptor_is_the_models_own():
    cfg = _config({"tenant": "acme"})
    d = cfg.descriptor
    assert cfg.worker == "vllm/10.0.0.5:8000/dp0"  # what the bridge names this engine
    assert (d.model, d.tenant_namespace, d.block_size, d.layout.layout) == ("/models/tiny", "acme", 32, "paged_hn_kvd")
    assert tuple(d.layer_groups[0].layers) == (0, 1) and d.layer_groups[0].tensors[0].shape == (2, 32)
    assert d.layer_groups[0].bytes_per_token == 2 * 2 * 2 * 32 * 2  # layers x (K, V) x heads x dim x bf16
    assert cfg.model_spec.layers == 2 and cfg.model_spec.active_params == 2 * (3 * 128 * 128 + 3 * 128 * 256)
    assert cfg.save_tier is Tier.DISK and cfg.load_async is False and cfg.decide_wait_s == pytest.approx(0.05)
    named = _config({"model": "acme/tiny-chat"})
    assert named.descriptor.model == "acme/tiny-chat" and named.descriptor.descriptor_id != d.descriptor_id
    assert _config({"save_tier": "none", "worker": "w"}).save_tier is None


def test_a_known_models_own_config_gives_its_shipped_descriptor():
    """Llama-3.1-8B's published config.json shape: the derivation equals nexuskv.models' descriptor."""
    llama = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
             "intermediate_size": 14336, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    cfg = ConnectorConfig.parse({}, model=MODEL, block_size=16, hf_config=llama, kv_events_topic=TOPIC)
    assert cfg.descriptor.descriptor_id == known_model(MODEL).descriptor_id


def test_the_descriptor_must_describe_vllms_kv_cache():
    ok = KvCacheShape(layers=2, kv_heads=2, head_size=32, dtype="bfloat16", block_size=32)
    assert _config(kv_cache=ok).descriptor.block_size == 32
    for bad, what in ((KvCacheShape(3, 2, 32, "bfloat16", 32), "2 layers, vLLM 3"),
                      (KvCacheShape(2, 2, 32, "float16", 32), "dtype bfloat16, vLLM float16")):
        with pytest.raises(ConfigError, match=what) as err:
            _config(kv_cache=bad)
        assert err.value.field == "kv_connector_extra_config.descriptor"
    assert _config(kv_dtype="float16", kv_cache=KvCacheShape(2, 2, 32, "float16", 32)).descriptor  # vLLM's dtype wins


@pytest.mark.parametrize("extra, field", [
    ({"bogus": 1}, "kv_connector_extra_config.bogus"),
    ({"save_tier": "tape"}, "kv_connector_extra_config.save_tier"),
    ({"decide_wait_ms": -1}, "kv_connector_extra_config.decide_wait_ms"),
    ({"load_async": "yes"}, "kv_connector_extra_config.load_async"),
    ({"profile": ""}, "kv_connector_extra_config.profile"),
    ({"descriptor": "/no/such/file.json"}, "descriptor"),
])
def test_bad_configuration_names_the_field(extra, field):
    with pytest.raises(ConfigError) as err:
        _config(extra)
    assert err.value.field == field


def test_a_model_the_connector_cannot_describe_is_refused_by_its_config_key():
    with pytest.raises(ConfigError) as err:
        _config(hf_config={**TINY, "sliding_window": 4096})
    assert err.value.field == "config.sliding_window"


def test_no_worker_name_without_a_kv_topic():
    with pytest.raises(ConfigError, match="engine's name"):
        _config(kv_events_topic="free-form")


@pytest.mark.broker
def test_the_wiring_serves_saved_blocks_over_the_bus_across_a_reset_and_a_restart(kafka_url, tmp_path, index_sidecar):
    """Both sides as the shell builds them, the reference runtime playing vLLM, a real Kafka: the
    tier's publisher announces what the worker wrote, a GPU reset leaves it, a new worker side
    re-announces it, and every acted-upon decision and every timing is on the bus."""
    import torch

    from connectors.vllm.tier_publisher import tier_publisher_name
    from connectors.vllm.wiring import build_scheduler_side, build_worker_side
    from nexuskv.config import Settings
    from nexuskv.contracts.keyed_events import KeyedBatch
    from nexuskv.contracts.kv_events import KvEventBatch
    from nexuskv.contracts.topics import DECISIONS, OBSERVATIONS
    from nexuskv.reference_engine import ReferenceEngine, ReferenceModelSpec
    from streams.bus.topics import ensure_topics

    from tests.connectors.reference import PROFILE, cost_model
    from tests.connectors.vllm_standin import VllmStandIn

    asyncio.run(ensure_topics(kafka_url, partitions=8))
    tenant = f"vllm-shell-{uuid.uuid4().hex[:8]}"
    spec = ReferenceModelSpec.gqa()
    probe_rt = ReferenceEngine(spec, tenant_namespace=tenant, worker="w-shell")
    path = tmp_path / "descriptor.json"
    path.write_text(probe_rt.descriptor.model_dump_json())
    cfg = ConnectorConfig.parse({"descriptor": str(path), "tenant": tenant, "worker": probe_rt.publisher_id,
                                 "profile": PROFILE}, model="n/a", block_size=spec.block_size)
    settings = Settings.from_env({"NEXUSKV_BROKER": str(kafka_url), "NEXUSKV_DATA_DIR": str(tmp_path),
                                  **index_sidecar.env})
    sched, bus = build_scheduler_side(cfg, settings=settings, base_model=cost_model(cfg.descriptor))
    worker, producer = build_worker_side(cfg, settings=settings, measure=False)
    engines = []
    try:
        def engine(incarnation: int, w) -> VllmStandIn:
            rt = ReferenceEngine(spec, tenant_namespace=tenant, worker="w-shell", model=probe_rt.model,
                                  incarnation=incarnation,
                                  publisher=lambda r: bus.publish(r) if isinstance(r, (KvEventBatch, KeyedBatch)) else None)
            return VllmStandIn(rt, sched, w)

        first = engine(1, worker)
        engines.append(first)
        prompt = torch.randint(0, 256, (26,), generator=torch.Generator().manual_seed(9)).tolist()
        assert first.serve("r1", prompt).saved_blocks == 6
        first.runtime.reset()
        bus.index.wait_caught_up()
        served = first.serve("r2", prompt)
        assert served.matched_tokens == 24 and served.loaded_tokens == 24
        expected = ReferenceEngine(spec, model=probe_rt.model).prefill(prompt, reuse=False).logits
        assert (served.result.logits - expected).abs().max().item() <= 1e-5

        worker.close()
        producer.stop()
        worker, producer = build_worker_side(cfg, settings=settings, measure=False)  # a restarted worker process
        assert worker.publisher.stats["reannounced"] == 6
        bus.index.wait_caught_up()
        found = bus.index.lookup(sched.scope, sched._keyer.keys(prompt))  # what the engine's ask sees
        mine = [m for m in found.matches if m.publisher == tier_publisher_name(probe_rt.publisher_id, Tier.DISK)]
        assert [m.prefix_blocks for m in mine] == [6] and mine[0].certain
        again = engine(2, worker)
        served = again.serve("r3", prompt)
        assert served.matched_tokens == 24 and served.saved_blocks == 0
    finally:
        worker.close()
        producer.stop()
        bus.stop()

    from tests.engines.vllm.records import read_topic

    decisions, observations = read_topic(kafka_url, DECISIONS), read_topic(kafka_url, OBSERVATIONS)
    mine = {d.request_id: d for d in decisions if d.tenant_namespace == tenant}
    assert mine["r2"].action.value == "transfer" and mine["r3"].action.value == "transfer"
    loads = [o.observation for o in observations if o.request_id in ("r2", "r3")
             and o.observation.kind == "transfer" and o.observation.worker == probe_rt.publisher_id]
    assert {(o.source_tier, o.destination_tier, o.pages) for o in loads} == {(Tier.DISK, Tier.GPU, 6)}
