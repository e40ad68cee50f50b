"""The vLLM shell with vLLM imported: what vLLM's factory and its multiprocess engine do to it.

* vLLM's factory finds ``NexusKVConnector`` in ``connectors.vllm.connector`` and it is a
  ``KVConnectorBase_V1``;
* the step metadata and the worker's report pickled in this process unpickle in another — the
  defect that killed vLLM's multiprocess engine on its first request (``Can't pickle local object
  '_build_connector_class.<locals>.NexusKVConnectorMetadata'``; the engine tests run the real
  multiprocess engine);
* the connector's configuration from a real ``VllmConfig`` of the tiny model is the model's own
  descriptor, the one ``nexuskv descriptor`` writes from its ``config.json``;
* requests with a LoRA adapter, multimodal inputs, a cache salt or prompt embeddings are not the
  connector's (their block keys need extra keys), and tensor parallel engines are refused.

One other process does both of the last two (each process that imports vLLM costs seconds).
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest

from connectors.vllm.meta import ConnectorMeta, CopyTiming, LoadSpec, PrefillWork, SaveSpec, WorkerReport
from nexuskv.descriptor import Tier
from nexuskv.entries import EntryLocation

from tests.engines.vllm.engines import ROOT, cpu_env

pytestmark = pytest.mark.vllm

META = ConnectorMeta(loads=(LoadSpec("r1", EntryLocation(worker="w", tier=Tier.DISK), (1, 2), (7, 8), 0),),
                     saves=(SaveSpec("r2", Tier.DISK, (3,), (9,), 4, 2, tuple(range(32))),),
                     prefills=(PrefillWork("r2", 100, 228),), decodes=1)
REPORT = WorkerReport(gemm_flops_per_s=1e11, gemm_label="x", copies=(CopyTiming(Tier.DISK, Tier.GPU, 2, 1e-3),),
                      loads_done=("r1",))

_OTHER_PROCESS = """
import json, pickle, sys
from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import EngineArgs
from connectors.vllm.shell import config_of
meta, report = pickle.loads(sys.stdin.buffer.read())
args = EngineArgs(model=sys.argv[1], block_size=32, enforce_eager=True, kv_cache_memory_bytes=8 << 20,
                  kv_transfer_config=KVTransferConfig(kv_connector="NexusKVConnector",
                      kv_connector_module_path="connectors.vllm.connector", kv_role="kv_both",
                      kv_connector_extra_config={"worker": "w", "tenant": "acme"}))
cfg = config_of(args.create_engine_config())
print(json.dumps({"meta": [type(meta).__module__, type(meta).__qualname__, len(meta.meta.loads),
                           meta.meta.saves[0].parent],
                  "report": [type(report).__qualname__, report.aggregate(report).report.copies.__len__()],
                  "id": cfg.descriptor.descriptor_id, "profile": cfg.profile, "layers": cfg.model_spec.layers,
                  "chunk": cfg.prefill_chunk_tokens}))
"""


def test_vllms_factory_loads_the_connector_class():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    config = KVTransferConfig(kv_connector="NexusKVConnector", kv_connector_module_path="connectors.vllm.connector",
                              kv_role="kv_both")
    cls = KVConnectorFactory.get_connector_class(config)
    assert issubclass(cls, KVConnectorBase_V1) and cls.__module__ == "connectors.vllm.shell"


@pytest.fixture(scope="module")
def other_process(tiny_model) -> dict:
    from connectors.vllm.shell import NexusKVConnectorMetadata, NexusKVWorkerMetadata

    blob = pickle.dumps((NexusKVConnectorMetadata(META), NexusKVWorkerMetadata(REPORT)))
    out = subprocess.run([sys.executable, "-c", _OTHER_PROCESS, str(tiny_model)], input=blob, capture_output=True,
                         cwd=ROOT, env=cpu_env(multiprocess=False), timeout=300)
    assert out.returncode == 0, out.stderr.decode(errors="replace")[-3000:]
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def test_the_metadata_crosses_processes_by_pickle(other_process):
    assert other_process["meta"] == ["connectors.vllm.shell", "NexusKVConnectorMetadata", 1, 2]
    assert other_process["report"] == ["NexusKVWorkerMetadata", 2]  # aggregated as vLLM does across workers


def test_the_configuration_from_vllms_own_config_is_the_models_descriptor(other_process, tiny_model):
    cli = subprocess.run([sys.executable, "-m", "streams.app.cli", "descriptor", str(tiny_model), "--model", str(tiny_model),
                          "--block-size", "32", "--layout", "paged_hn_kvd", "--tenant", "acme"],
                         capture_output=True, text=True, cwd=ROOT, env=cpu_env(multiprocess=False), check=True)
    assert other_process["id"] == json.loads(cli.stdout)["descriptor_id"]
    assert other_process["profile"] == "vllm-cpu" and other_process["layers"] == 2 and other_process["chunk"] > 0


def test_requests_whose_blocks_need_extra_keys_are_not_the_connectors():
    from types import SimpleNamespace

    from connectors.vllm.shell import plain

    base = dict(lora_request=None, mm_features=None, cache_salt=None, prompt_embeds=None)
    assert plain(SimpleNamespace(**base))
    for field, value in (("lora_request", object()), ("mm_features", [object()]), ("cache_salt", "s"),
                         ("prompt_embeds", object())):
        assert not plain(SimpleNamespace(**{**base, field: value})), field


def test_tensor_parallel_engines_are_refused_at_start():
    from types import SimpleNamespace

    from connectors.vllm.shell import config_of
    from nexuskv.errors import ConfigError

    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}),
                                  kv_events_config=None, cache_config=SimpleNamespace(block_size=32),
                                  parallel_config=SimpleNamespace(tensor_parallel_size=2, data_parallel_rank=0),
                                  model_config=SimpleNamespace(model="m"))
    with pytest.raises(ConfigError) as err:
        config_of(vllm_config)
    assert err.value.field == "tensor_parallel_size"
