"""vLLM's own KV events through NexusKV's bridge into the index, against vLLM's real prefix cache.

A real vLLM engine (in-process engine: its scheduler's prefix cache is readable by the driver)
publishes its KV events with its own ZMQ publisher; ``python -m streams.bridge`` (keyed by a
descriptor ``nexuskv descriptor`` wrote from the model's ``config.json``) forwards them to Kafka;
an index replica follows the topic. After every step of a series — prompts sharing prefixes,
prompts that evict older blocks from a small KV cache, ``reset_prefix_cache``, the bridge stopped
while the engine serves and restarted from its state file (gaps repaired through vLLM's replay
socket), the engine restarted (a new incarnation, certain at once) — the blocks the index places on the engine's GPU are exactly the blocks in vLLM's
prefix cache, block by block; vLLM's block hashes are the ones NexusKV recomputes
(``sha256_cbor``); nothing is dead-lettered. The engine also runs the connector: a reset leaves
the blocks it saved to disk in the index (a clear concerns the GPU cache only), and the bridge's
descriptor and the connector's derived one are the same scope.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest

from connectors.vllm.tier_publisher import tier_publisher_name
from nexuskv.contracts.topics import DEAD_LETTER
from nexuskv.descriptor import StateDescriptor, Tier
from nexuskv.identity import BlockKeyer, IdentityScope
from streams.app.tiny_model import word_id
from streams.bus.process import ManagedProcess, free_port

from tests.connectors.vllm_hashing import VllmBlockHasher
from tests.engines.vllm.engines import ROOT, cpu_env
from tests.engines.vllm.records import read_topic, wait_for

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.vllm]

BS = 32
KV_BLOCKS = 40  # vLLM's whole GPU (here: CPU) cache: a few prompts fill it


def _words(seed: int, n: int) -> list[int]:
    return [word_id((seed * 7919 + i * 104729) % 1000) for i in range(n)]


# Lengths leave the last block partial even with the 7 decoded tokens whose KV is computed, so a
# prompt's cached blocks are exactly its full prompt blocks.
P1 = _words(11, 320)
P2 = P1[:256] + _words(12, 100)  # shares 8 blocks with P1
P3 = _words(13, 600)
P4 = _words(14, 690)  # does not fit beside the others: evicts
P5 = P3[:512] + _words(15, 50)
P6 = _words(17, 100)


ENGINE_ENV = ("NEXUSKV_BROKER", "NEXUSKV_DATA_DIR", "NEXUSKV_INDEX_SOCKET")


@pytest.fixture(scope="module")
def index(kv_topics):
    """The test's own replica of the index (the engine's connector asks the node's sidecar)."""
    from tests.sidecar import ThreadReplica

    replica = ThreadReplica(kv_topics, client_id=f"vllm-events-index-{uuid.uuid4().hex[:6]}")
    yield replica
    replica.stop()


class _Bridge:
    def __init__(self, argv: list[str], env: dict[str, str], log) -> None:
        self.argv, self.env, self.log = argv, env, log
        self.proc: ManagedProcess | None = None
        self.runs = 0

    def start(self) -> None:
        self.proc = ManagedProcess(self.argv, name="kv-bridge", log_path=self.log, env=self.env, cwd=ROOT)
        self.proc.start()
        self.runs += 1
        wait_for(lambda: self.log.read_text().count("bridge ready") == self.runs, timeout_s=60,
                 message=f"the bridge did not start:\n{self.proc.log_tail()}")
        time.sleep(1.0)  # its SUB socket's subscription reaches vLLM's PUB (ZMQ's slow joiner)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def test_the_index_follows_vllms_prefix_cache_through_the_bridge(tiny_model, kv_topics, index, engine_factory,
                                                                 tmp_path, index_sidecar):
    pod = f"events-{uuid.uuid4().hex[:6]}"
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    publisher = f"vllm/{pod}/dp0"
    pub_port, replay_port = free_port(), free_port()
    env = cpu_env(multiprocess=False, extra={"NEXUSKV_BROKER": str(kv_topics), "NEXUSKV_DATA_DIR": str(tmp_path),
                                             **index_sidecar.env})

    # The bridge's descriptor, from the model's config.json (what the connector derives inside vLLM).
    desc_path = tmp_path / "descriptor.json"
    subprocess.run([sys.executable, "-m", "streams.app.cli", "descriptor", str(tiny_model), "--model", str(tiny_model),
                    "--block-size", str(BS), "--layout", "paged_hn_kvd", "--tenant", tenant, "--out", str(desc_path)],
                   check=True, cwd=ROOT, env=env, capture_output=True)
    descriptor = StateDescriptor.model_validate_json(desc_path.read_text())
    scope = IdentityScope.of(descriptor)
    keyer = BlockKeyer(scope, BS)
    hasher = VllmBlockHasher(block_size=BS, algo="sha256_cbor", python_hash_seed=env["PYTHONHASHSEED"],
                             vllm_version="0.32")

    spec = {"model": str(tiny_model), "max_model_len": 1024, "kv_cache_memory_bytes": KV_BLOCKS * BS * 512,
            "kv_events_config": {"enable_kv_cache_events": True, "publisher": "zmq",
                                 "endpoint": f"tcp://*:{pub_port}", "replay_endpoint": f"tcp://*:{replay_port}",
                                 "topic": f"kv@{pod}@{tiny_model}"},
            "kv_transfer_config": {"kv_connector": "NexusKVConnector",
                                   "kv_connector_module_path": "connectors.vllm.connector", "kv_role": "kv_both",
                                   "kv_load_failure_policy": "recompute",
                                   "kv_connector_extra_config": {"tenant": tenant, "save_tier": "disk"}}}
    engine = engine_factory(spec, multiprocess=False, env={k: env[k] for k in ENGINE_ENV},
                            name="events")
    bridge = _Bridge([sys.executable, "-m", "streams.bridge", "--engine", "vllm",
                      "--endpoint", f"tcp://127.0.0.1:{pub_port}", "--replay-endpoint", f"tcp://127.0.0.1:{replay_port}",
                      "--descriptor", str(desc_path), "--tenant", tenant, "--block-size", str(BS),
                      "--state-file", str(tmp_path / "bridge-state.json")], env, tmp_path / "bridge.log")
    bridge.start()
    issued: list[list[int]] = []
    try:
        def engine_blocks() -> set[tuple[int, int]]:
            cached = set(engine.call("cached_blocks")["hashes"])
            out = set()
            for p, prompt in enumerate(issued):
                for i, h in enumerate(hasher.event_hashes(prompt)):
                    if h in cached:
                        out.add((p, i))
            known = {h for prompt in issued for h in hasher.event_hashes(prompt)}
            assert cached <= known, "vLLM caches blocks whose hashes NexusKV does not recompute"
            return out

        def index_blocks(tier: Tier = Tier.GPU, where: str = publisher) -> set[tuple[int, int]]:
            out = set()
            for p, prompt in enumerate(issued):
                found = index.lookup(scope, keyer.keys(prompt))
                for m in found.matches:
                    if m.publisher == where and m.location.tier is tier and m.certain:
                        out.update((p, i) for i in range(m.prefix_blocks))
                        out.update((p, i) for e in m.extents for i in range(e.start, e.end))
            return out

        def converged(expected: set[tuple[int, int]]) -> None:
            try:
                wait_for(lambda: index_blocks() == expected, timeout_s=30)
            except AssertionError:
                from nexuskv.contracts.topics import KV_EVENTS

                seqs = sorted(b.seq for b in read_topic(kv_topics, KV_EVENTS, idle_ms=500) if b.publisher == publisher)
                raise AssertionError(f"index and vLLM's prefix cache differ in {sorted(index_blocks() ^ expected)[:20]}"
                                     f" (batches on the topic: {seqs})") from None

        for prompt in (P1, P2, P3, P4):
            issued.append(prompt)
            engine.generate([prompt])
            converged(engine_blocks())
        distinct = {h for prompt in issued for h in hasher.event_hashes(prompt)}
        assert len(engine.call("cached_blocks")["hashes"]) < len(distinct) <= 2 * KV_BLOCKS  # blocks were evicted

        # The connector saved every full block to the worker's disk tier, under its own publisher.
        on_disk = tier_publisher_name(publisher, Tier.DISK)
        wait_for(lambda: {(p, i) for p, prompt in enumerate(issued) for i in range(len(prompt) // BS)}
                 <= index_blocks(Tier.DISK, on_disk), message="the saved blocks are not in the index")

        # reset_prefix_cache: vLLM's AllBlocksCleared clears the GPU tier; the disk tier stays. vLLM
        # publishes the clear with its next step's events: a prompt shorter than a block steps it.
        assert engine.call("reset")["reset"]
        engine.generate([_words(16, 8)])
        assert engine_blocks() == set()
        converged(set())
        assert index_blocks(Tier.DISK, on_disk)  # a clear concerns the medium it names
        status = index._replica.index.publisher_status(publisher)
        assert status is not None and status.certain

        # The bridge stops; the engine goes on; the restarted bridge (resuming from its state file)
        # repairs the gap through vLLM's replay socket as soon as the engine's next batch shows it.
        bridge.stop()
        for prompt in (P5, P1):
            issued.append(prompt)
            engine.generate([prompt])
        bridge.start()
        issued.append(P6)
        engine.generate([P6])
        converged(engine_blocks())
        assert index._replica.index.publisher_status(publisher).certain

        # The engine restarts (same endpoints, its sequence from 0): the bridge starts a new
        # incarnation with a clear, so the index is certain again at once and holds exactly the new
        # engine's cache; the blocks saved to disk by the old process are still there.
        was = index._replica.index.publisher_status(publisher).incarnation
        engine.close()
        engine = engine_factory(spec, multiprocess=False, env={k: env[k] for k in ENGINE_ENV},
                                name="events-restarted")
        time.sleep(1.0)  # the bridge's SUB reconnects to the new PUB socket
        issued.append(P3)
        engine.generate([P3])
        converged(engine_blocks())
        status = index._replica.index.publisher_status(publisher)
        assert status.incarnation > was and status.certain
        assert {(0, i) for i in range(len(P1) // BS)} <= index_blocks(Tier.DISK, on_disk)
    finally:
        bridge.stop()
    letters = [d for d in read_topic(kv_topics, DEAD_LETTER, idle_ms=500) if pod in json.dumps(d.model_dump(mode="json"))]
    assert letters == []
    log = (tmp_path / "bridge.log").read_text()
    assert "dead-lettered" not in log
