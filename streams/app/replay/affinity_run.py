"""The ``affinity`` run of a replay: vLLM alone behind a KV-event prefix- and load-aware router.

The baseline's engines (prefix caching on, no NexusKV connector) with vLLM's own ZMQ KV-event
publisher on (``--kv-events-config``), and :class:`~streams.app.replay.affinity.AffinityRouter`
subscribed to every engine's events: it keeps each engine's cached blocks from what vLLM says it
stored and removed, and sends each request where Dynamo's published cost rule is lowest (queued
prefill plus the prompt's blocks that engine has not cached). This is what llm-d's precise
prefix-cache scorer and Dynamo's KV router give a user without NexusKV: no tiers, no moves, no
calibration; nothing of NexusKV runs (no bus, no index service, no connector).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from streams.app.replay.affinity import AffinityRouter
from streams.app.replay.nexuskv_run import replay_descriptor
from streams.app.replay.runs import SERVED_NAME, RunResult, RunSetup, serve_stream, start_engines
from streams.app.replay.tracing import ReplayTracing
from streams.app.replay.workload import Workload
from streams.bus.process import free_port

__all__ = ["run_affinity"]


def run_affinity(config, workload: Workload, model_dir: Path, progress,
                 tracing: ReplayTracing) -> tuple[RunResult, list[str]]:
    log_dir = config.out / "affinity" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    descriptor = replay_descriptor(model_dir, block_size=config.block_size, tenant=config.tenant,
                                   dtype=config.engine_dtype)
    ports = [free_port() for _ in range(config.workers)]
    events = [(free_port(), free_port()) for _ in range(config.workers)]
    workers = [f"vllm/127.0.0.1:{p}/dp0" for p in ports]
    topics = [f"kv@127.0.0.1:{p}@{model_dir}" for p in ports]

    def kv_events(i: int, worker: str) -> dict:
        pub, replay = events[i]
        return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                "replay_endpoint": f"tcp://*:{replay}", "topic": topics[i]}

    setup = RunSetup("affinity", model_dir, SERVED_NAME, config.workers, config.block_size, config.engine_blocks,
                     config.max_model_len, log_dir, dtype=config.engine_dtype, kv_events_config=kv_events,
                     trace_to=config.trace_to)
    engines = start_engines(setup, workers, ports, os.cpu_count() or 1)
    try:
        ready = [e.wait_ready(config.start_timeout_s) for e in engines]
        router = AffinityRouter(descriptor, tuple(workers),
                                endpoints=tuple((f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}")
                                                for pub, rep in events), topics=tuple(topics))
        result = asyncio.run(serve_stream(workload, engines, SERVED_NAME, router, name="affinity",
                                          progress=progress, tracing=tracing))
        result.engine_ready_s = ready
        result.router_stats = router.stats
    finally:
        for e in engines:
            e.stop()
    return result, workers
