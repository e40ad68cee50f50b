"""NexusKV's KV connector inside real vLLM (0.32, CPU build), in its multiprocess and in-process engines.

One story per engine kind, with a tiny random Llama and 32-token blocks:

1. a first engine process serves a warm-up prompt and a 3,000-token prompt A: nothing to load
   (the cold-start cost model learns this worker from the warm-up), every full block saved;
2. after ``reset_prefix_cache`` (vLLM's GPU cache is empty) a prompt B sharing A's 93 blocks is
   served with those blocks loaded from the disk tier;
3. a fresh engine process (the same worker: a restart) serves a warm-up, then A with A's blocks
   loaded — saved by the other process, re-announced by the tier's publisher, not written again;
4. A with a ``cache_salt`` is neither loaded nor saved (its block keys need the salt);
5. tier files deleted behind NexusKV's back: the next A loads only what is still there (80 blocks),
   vLLM recomputes the rest, and the deleted blocks are saved again.

Every output — greedy tokens and their logprobs — equals vLLM's without the connector with the
same number of prompt tokens cached (``reference``; see the conftest for why not fewer);
vLLM's own count of externally computed tokens (``external_prefix_cache_hits`` and the request's
``num_cached_tokens``, local hits being 0 after a reset or in a fresh engine) equals what the
decision record says NexusKV moved and what the worker's transfer observations say it loaded;
and the decision records of the loads name the cold-start prior they were priced with.
The multiprocess engine is the regression test of the metadata pickling defect: vLLM pickles the
connector's step metadata to its worker process and its report back.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid

import pytest

from connectors.vllm.tier_publisher import tier_publisher_name
from nexuskv.contracts.observations import TransferObservation
from nexuskv.contracts.topics import DECISIONS, OBSERVATIONS
from nexuskv.dataplane.disk import payload_file
from nexuskv.dataplane.payload import PayloadKey
from nexuskv.descriptor import Tier
from nexuskv.hf_config import descriptor_from_hf_config
from nexuskv.identity import BlockKeyer, IdentityScope
from streams.app.tiny_model import word_id
from streams.bus.process import free_port

from tests.engines.vllm.records import read_topic, wait_for

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.vllm]

BS = 32
MODES = {"multiprocess": True, "in-process": False}


def _words(seed: int, n: int) -> list[int]:
    return [word_id((seed * 7919 + i * 104729) % 1000) for i in range(n)]


A = _words(1, 3000)  # 93 full blocks loadable (the last token is always computed)
B = A[:93 * BS] + _words(2, 20)  # shares all 93 of them
WARM_1, WARM_2 = _words(3, 1024), _words(4, 1056)
KEPT = 80  # of A's 93 saved blocks, after the others' files are deleted


def _connector(worker: str, tenant: str) -> dict:
    # The README's --kv-transfer-config, with this test's worker name and tenant.
    return {"kv_connector": "NexusKVConnector", "kv_connector_module_path": "connectors.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"worker": worker, "tenant": tenant, "save_tier": "disk"}}


@pytest.fixture(scope="module")
def index(kv_topics):
    """The test's own replica of the index (the engine's scheduler asks the node's sidecar)."""
    from tests.sidecar import ThreadReplica

    replica = ThreadReplica(kv_topics, client_id=f"vllm-test-index-{uuid.uuid4().hex[:6]}")
    yield replica
    replica.stop()


def _on_disk(index, descriptor, worker: str, keys: list[int]) -> int:
    """Blocks from 0 the index says ``worker``'s disk tier holds, certainly."""
    found = index.lookup(IdentityScope.of(descriptor), keys)
    return max((m.prefix_blocks for m in found.matches if m.certain and m.location.tier is Tier.DISK
                and m.location.worker == worker and m.publisher == tier_publisher_name(worker, Tier.DISK)), default=0)


def _last_decision(url, tenant: str, prompt_tokens: int) -> str:
    """The latest decision for a prompt of that length, as formula and numbers (for a failure message)."""
    mine = [d for d in read_topic(url, DECISIONS, idle_ms=500) if d.tenant_namespace == tenant
            and d.prompt_tokens == prompt_tokens]
    if not mine:
        return "no decision record"
    d = max(mine, key=lambda d: (d.decided_at, d.revision))
    return f"{d.action.value}: {d.reason} [cost model {d.cost_model_version}]"


def _same_as_reference(out: dict, reference, prompt: list[int], computed_as: list[int] | None = None) -> None:
    """``out`` equals vLLM's own without the connector, its cached prefix computed by a prefill like ``computed_as``."""
    ref = reference(prompt, out["num_cached_tokens"], computed_as=computed_as)
    assert out["token_ids"] == ref["token_ids"]
    assert out["logprobs"] == ref["logprobs"]  # exact, not approximately


def _readme_worker_and_tenant(flags: dict[str, str]) -> tuple[str, str]:
    topic = json.loads(flags["--kv-events-config"])["topic"]
    pod = topic.split("@", 2)[1]
    return f"vllm/{pod}/dp0", json.loads(flags["--kv-transfer-config"])["kv_connector_extra_config"]["tenant"]


def _free_events_ports(flags: dict[str, str]) -> dict[str, str]:
    """The README's flags; its ZMQ ports replaced by free ones only if another process holds them here."""
    from streams.bus.process import free_port

    events = json.loads(flags["--kv-events-config"])
    for field in ("endpoint", "replay_endpoint"):
        port = int(events[field].rsplit(":", 1)[1])
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                events[field] = f"tcp://*:{free_port()}"
    return {**flags, "--kv-events-config": json.dumps(events, separators=(",", ":"))}


@pytest.mark.parametrize("mode", MODES)
def test_saved_by_one_engine_loaded_after_a_reset_and_by_a_fresh_one(mode, tiny_model, kv_topics, index, reference,
                                                                      engine_factory, tmp_path, index_sidecar):
    """In-process: two ``vllm.LLM`` engines. Multiprocess: a ``vllm.LLM`` engine, then the OpenAI server
    started with the README's exact ``--kv-transfer-config`` and ``--kv-events-config``."""
    from tests.engines.vllm.server import Server, readme_flags

    multiprocess = MODES[mode]
    data = tmp_path / "data"
    # The gate acts on the expected gain, not its 95% bound: on this 2-layer model a load and a
    # recompute cost about the same (a ~30 ms prefill), so the bound straddles zero, and whether the
    # README's gate loads depends on how fast this machine's GEMM probe ran (283 to 837 GFLOP/s
    # seen). This test is about what the connector saves and loads, not about the gate's confidence.
    policy = tmp_path / "policy.toml"
    policy.write_text("schema_version = 'nexuskv.execution_policy.v1'\nversion = 'connector-test'\n"
                      "[planner]\nconfidence_z = 0.0\n# end of policy\n", encoding="utf-8")
    env = {"NEXUSKV_BROKER": str(kv_topics), "NEXUSKV_DATA_DIR": str(data), "NEXUSKV_POLICY_FILE": str(policy),
           **index_sidecar.env}
    flags = readme_flags()
    if multiprocess:
        worker, tenant = _readme_worker_and_tenant(flags)
    else:
        worker, tenant = f"vllm/{mode}-{uuid.uuid4().hex[:6]}/dp0", f"t-{uuid.uuid4().hex[:8]}"
    spec = {"model": str(tiny_model), "kv_transfer_config": _connector(worker, tenant)}
    root = data / "tiers" / worker / "disk"
    descriptor = descriptor_from_hf_config(json.loads((tiny_model / "config.json").read_text()),
                                           model=str(tiny_model), block_size=BS, tenant=tenant, layout="paged_hn_kvd")
    keys = BlockKeyer(IdentityScope.of(descriptor), BS).keys(A)
    files = [payload_file(root, PayloadKey(descriptor.descriptor_id, k)) for k in keys]
    started = time.time()

    # 1-2: one engine process: save, reset, load.
    first = engine_factory(spec, multiprocess=multiprocess, env=env, name="first")
    for prompt in (WARM_1, A):
        (out,) = first.generate([prompt])
        assert out["num_cached_tokens"] == 0  # nothing saved yet, nothing cached locally
        _same_as_reference(out, reference, prompt)
    wait_for(lambda: all(os.path.exists(f) for f in files), message="A's blocks were not all saved")
    wait_for(lambda: _on_disk(index, descriptor, worker, keys) == 93, message="the tier's publisher did not announce A")
    time.sleep(0.5)  # the node's index sidecar, which the engine asks, follows the same topic
    saved_at = [os.stat(f).st_mtime_ns for f in files]
    assert first.call("reset")["reset"]
    before = first.call("metrics")["external_prefix_cache_hits"]
    (b,) = first.generate([B])
    assert b["num_cached_tokens"] == 93 * BS, _last_decision(kv_topics, tenant, len(B))  # the GPU cache was reset
    assert first.call("metrics")["external_prefix_cache_hits"] - before == 93 * BS
    _same_as_reference(b, reference, B, computed_as=A)  # the blocks were computed by A's prefill
    first.close()
    was = index._replica.index.publisher_status(tier_publisher_name(worker, Tier.DISK)).incarnation

    # 3: a fresh engine process, the same worker: a warm-up, then A from the tier.
    if multiprocess:
        fresh = Server(tiny_model, port=free_port(), flags=_free_events_ports(flags), env=env,
                       log_path=tmp_path / "server.log")
    else:
        fresh = engine_factory(spec, multiprocess=False, env=env, name="fresh")
    try:
        wait_for(lambda: index._replica.index.publisher_status(tier_publisher_name(worker, Tier.DISK)).incarnation > was
                 and _on_disk(index, descriptor, worker, keys) == 93,
                 message="the fresh engine's tier publisher did not re-announce A")
        status = index._replica.index.publisher_status(tier_publisher_name(worker, Tier.DISK))
        assert status.certain  # a new incarnation, resynced by its snapshot
        (warm,) = fresh.generate([WARM_2])
        _same_as_reference(warm, reference, WARM_2)
        (a,) = fresh.generate([A])
        assert a["num_cached_tokens"] == 93 * BS, _last_decision(kv_topics, tenant, len(A))
        assert fresh.call("metrics")["external_prefix_cache_hits"] == 93 * BS
        _same_as_reference(a, reference, A, computed_as=A)  # by A's prefill in the other process
        assert [os.stat(f).st_mtime_ns for f in files] == saved_at  # loaded, not written again

        # A request with a cache salt keys its blocks with it: NexusKV neither loads nor saves it.
        written = sorted(p.name for p in root.rglob("*.nkv"))
        (salted,) = fresh.generate([A], cache_salt="tenant-secret")
        assert salted["num_cached_tokens"] == 0  # vLLM's own cache does not match it either
        _same_as_reference(salted, reference, A)
        assert sorted(p.name for p in root.rglob("*.nkv")) == written

        # 5: files deleted behind NexusKV's back: only what is left is loaded, the rest recomputes.
        for f in files[KEPT:]:
            os.unlink(f)
        assert fresh.call("reset")["reset"]
        before = fresh.call("metrics")["external_prefix_cache_hits"]
        (again,) = fresh.generate([A])
        decision = _last_decision(kv_topics, tenant, len(A))
        # The index offers the 80 blocks left; loading them is the cost model's call, and on this
        # model it is close (expected gains of -2 to +0.3 ms seen): a recompute is taken only from
        # the gate, on the price of that transfer. Never is a deleted block loaded.
        if again["num_cached_tokens"] == 0:
            assert decision.startswith("recompute") and "best reuse option transfer" in decision \
                and "<= 0" in decision, decision
        else:
            assert again["num_cached_tokens"] == KEPT * BS, decision
        assert fresh.call("metrics")["external_prefix_cache_hits"] - before == again["num_cached_tokens"]
        _same_as_reference(again, reference, A, computed_as=A)
        wait_for(lambda: all(os.path.exists(f) for f in files[KEPT:]), message="the deleted blocks were not saved again")
    finally:
        fresh.close()

    # The records: every load decided, priced by the cold-start prior, and carried out as decided.
    decisions = sorted((d for d in read_topic(kv_topics, DECISIONS) if d.tenant_namespace == tenant
                        and d.decided_at >= started), key=lambda d: (d.decided_at, d.revision))
    loads = [d for d in decisions if d.action.value == "transfer" and d.revision == 0]
    # Phase 5's load is there only when the gate took it (above): a recompute decided no load.
    phase5 = [(len(A), KEPT * BS)] if again["num_cached_tokens"] else []
    assert [(d.prompt_tokens, d.reused_tokens) for d in loads] == [(len(B), 93 * BS), (len(A), 93 * BS)] + phase5
    for d in loads:
        assert d.source.tier is Tier.DISK and d.source.worker == worker
        assert "+cold-start(vllm-cpu: " in d.cost_model_version and f"compute {tiny_model}: FLOP prior" \
            in d.cost_model_version
    assert not [d for d in decisions if d.revision > 0]  # no load failed
    ids = {d.request_id for d in loads}
    copies = [o for o in read_topic(kv_topics, OBSERVATIONS) if o.request_id in ids
              and isinstance(o.observation, TransferObservation) and o.observation.destination_tier is Tier.GPU]
    assert sorted(o.observation.pages * BS for o in copies) == sorted(d.reused_tokens for d in loads)
    assert all(o.observation.ok and o.observation.source_tier is Tier.DISK for o in copies)
