"""The two runs of a replay, on the same request stream, arrival times, engines and machine.

* **baseline** — vLLM alone: ``workers`` engines with vLLM's own prefix caching, each request sent
  to the engine with the fewest requests waiting for their first token (round robin on ties): what
  a user has without NexusKV.
* **nexuskv** — the same engines with NexusKV: each engine runs NexusKV's KV connector (its
  scheduler side asks the planner which tokens to load; its worker side loads and saves them on
  the worker's tiers) and publishes its KV events, which a bridge per engine forwards to the bus;
  the index worker, calibration agent, planner and decision sink run as in ``nexuskv up``; each
  request goes where the planner's decision says.

Each run starts its engines fresh (nothing cached), sends every engine one short unrelated
prompt (so the engines' first-request costs are not in the figures), then sends the stream:
request ``i`` leaves at ``t0 + arrival_s``, whatever the state of the others. Each request is timed
at the client (:mod:`streams.app.replay.client`), from its arrival at the router: its TTFT is the
router's decision time plus the engine's time to first token. It is stored in ``replay_requests``
with its run, and with its trace id when the replay is traced (:mod:`~streams.app.replay.tracing`:
one trace per request, the engine's own span included).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from connectors.engine_load import EngineLoadPoller
from streams.app.replay.client import Completion, complete
from streams.app.replay.engines import EngineConfig, VllmEngine
from streams.app.replay.routing import LeastOutstanding, Loads, PlannerRouter, Routed
from streams.app.replay.tracing import ReplayTracing, engine_args, engine_trace_env, trace_id_of
from streams.app.replay.workload import ReplayRequest, Workload
from streams.bus.tracing import finite_attributes

__all__ = [
    "SERVED_NAME",
    "RunResult",
    "RunSetup",
    "outcome_attributes",
    "request_row",
    "run_row",
    "serve_stream",
    "start_engines",
]

SERVED_NAME = "nexuskv-replay"  # the model's name at the engines' OpenAI endpoint
WARM_PROMPT = tuple(range(4, 36))  # one block of token ids no trace prompt starts with


@dataclass(frozen=True, slots=True)
class RunSetup:
    """How one run's engines are built (both runs share everything but the NexusKV parts)."""

    name: str  # baseline | nexuskv
    model_dir: Path
    served_name: str
    workers: int
    block_size: int
    engine_blocks: int
    max_model_len: int
    log_dir: Path
    dtype: str = "auto"
    kv_transfer_config: Callable[[int, str], dict] | None = None  # (engine index, worker name) -> config
    kv_events_config: Callable[[int, str], dict] | None = None
    engine_env: dict[str, str] = field(default_factory=dict)
    trace_to: str | None = None  # OTLP/HTTP base URL the engines export their request spans to

    def engine_config(self, i: int, worker: str, cores: int) -> EngineConfig:
        env = {**self.engine_env, **engine_trace_env(self.trace_to, f"{self.name}-engine{i}")}
        return EngineConfig(model_dir=self.model_dir, served_name=self.served_name, block_size=self.block_size,
                            max_model_len=self.max_model_len, num_blocks=self.engine_blocks, dtype=self.dtype,
                            core=i % cores if self.workers <= cores else None,
                            kv_transfer_config=self.kv_transfer_config(i, worker) if self.kv_transfer_config else None,
                            kv_events_config=self.kv_events_config(i, worker) if self.kv_events_config else None,
                            env=env, extra_args=tuple(engine_args(self.trace_to)))


@dataclass(slots=True)
class Served:
    request: ReplayRequest
    engine: int
    routed: Routed
    completion: Completion
    trace_id: str | None = None  # the request's trace, when the replay is traced


@dataclass(slots=True)
class RunResult:
    name: str
    served: list[Served]
    started_at: float
    wall_s: float
    engine_ready_s: list[float]
    router_stats: dict[str, int] = field(default_factory=dict)  # what the router counted (the affinity arm's events)


def start_engines(setup: RunSetup, workers: Sequence[str], ports: Sequence[int], cores: int) -> list[VllmEngine]:
    engines = [VllmEngine(f"{setup.name}-engine{i}", setup.engine_config(i, workers[i], cores), setup.log_dir,
                          port=ports[i]) for i in range(setup.workers)]
    for e in engines:
        e.start()
    return engines


async def _warm(session: aiohttp.ClientSession, engines: Sequence[VllmEngine], served_name: str) -> None:
    for k, e in enumerate(engines):
        prompt = tuple((t + 97 * k) % 1000 + 4 for t in WARM_PROMPT)
        done = await complete(session, e.url, served_name, prompt, 2, request_id=f"warm-{k}")
        if done.error:
            raise RuntimeError(f"engine {e.name} failed its warm-up request: {done.error}")


async def serve_stream(workload: Workload, engines: Sequence[VllmEngine], served_name: str,
                       router: LeastOutstanding | PlannerRouter, *, name: str,
                       progress: Callable[[int], None] = lambda n: None, settle_s: float = 2.0,
                       tracing: ReplayTracing | None = None,
                       baseline_ttft: dict[str, float] | None = None, engine_reports: bool = False) -> RunResult:
    """Serve the warm-up one request after another, wait ``settle_s`` (the calibration publishes its fit),
    then send the measured requests at their arrival times (relative to the first measured one);
    returns every request as served. Each request is one trace under ``tracing``; ``baseline_ttft``
    (the baseline run's TTFT by request id) puts each request's observed EG on its span.
    ``engine_reports``: the loads the router sees add each engine's own gauges, scraped from its
    ``/metrics`` every 0.1 s (:class:`~connectors.engine_load.EngineLoadPoller`)."""
    tracing = tracing or ReplayTracing.start(None)
    loads = Loads.of(len(engines))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await _warm(session, engines, served_name)
        poller = None
        if engine_reports:
            poller = EngineLoadPoller([e.url for e in engines], session, interval_s=0.1)
            loads.reported = poller.latest
            loads.engine_blocks = (engines[0].config.num_blocks or 0) if engines else 0
            poller.start()
        await router.start()
        served: list[Served] = []
        t0 = time.monotonic()
        started_at = time.time()

        async def one(r: ReplayRequest, at: float) -> None:
            delay = at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            rid = r.request_id
            with tracing.request(name, rid, {"nexuskv.seq": r.seq, "nexuskv.warmup": r.warmup,
                                             "nexuskv.prompt_tokens": len(r.tokens)}) as span:
                routed = await router.route(rid, r.tokens, loads, time.time())
                i = routed.engine
                loads.sent(i, rid, len(r.tokens))
                try:
                    with tracing.completion(engines[i].url) as headers:
                        done = await complete(session, engines[i].url, served_name, r.tokens, r.output_tokens,
                                              request_id=f"{name}-{rid}", headers=headers,
                                              on_first_token=lambda: loads.first_token(i, rid))
                finally:
                    loads.first_token(i, rid)
                span.set_attributes(outcome_attributes(routed, done, (baseline_ttft or {}).get(rid)))
                served.append(Served(r, i, routed, done, trace_id_of(span)))
            progress(1)

        warmup = [r for r in workload.requests if r.warmup]
        measured = [r for r in workload.requests if not r.warmup]
        try:
            # The warm-up one request at a time: each prefill runs alone, so the engines' timings
            # are clean and the cost model is fitted before the measured requests arrive.
            for r in warmup:
                await one(r, 0.0)
            if warmup:
                await asyncio.sleep(settle_s)
            t1 = time.monotonic()
            first = measured[0].arrival_s if measured else 0.0
            await asyncio.gather(*(one(r, t1 + r.arrival_s - first) for r in measured))
        finally:
            await router.stop()
            if poller is not None:
                await poller.stop()
        wall = time.monotonic() - t0
    served.sort(key=lambda s: s.request.seq)
    result = RunResult(name, served, started_at, wall, [])
    if poller is not None:
        result.router_stats = {"load_scrapes": poller.stats["scrapes"], "load_scrapes_failed": poller.stats["failed"]}
    return result


def outcome_attributes(routed: Routed, done: Completion, baseline_ttft_s: float | None) -> dict:
    """A served request's figures as span attributes: its TTFT as the user saw it, and in the NexusKV
    run the decision's action, tier, reused tokens, predicted EG and (against the baseline run's TTFT
    of the same request) observed EG."""
    attrs: dict = {"nexuskv.engine_worker": routed.engine, "nexuskv.cached_tokens": done.cached_tokens,
                   "nexuskv.routing_s": routed.routing_s}
    ttft = None if done.error else routed.routing_s + done.ttft_s
    if ttft is not None:
        attrs["nexuskv.ttft_s"] = ttft
    if done.error:
        attrs["error.type"] = done.error[:200]
    d = routed.decision
    if d is not None:
        attrs.update({"nexuskv.action": d.action.value, "nexuskv.reused_tokens": d.reused_tokens,
                      "nexuskv.predicted_eg_s": d.eg_s, "nexuskv.predicted_ttft_s": d.t_with_reuse_s,
                      "nexuskv.tier": d.source.tier.value if d.source is not None else "none",
                      "nexuskv.decision_id": d.request_id})
        if ttft is not None and baseline_ttft_s is not None:
            attrs["nexuskv.observed_eg_s"] = baseline_ttft_s - ttft
    return finite_attributes(attrs)


def _digest(ids: Sequence[int]) -> str:
    return hashlib.blake2b(json.dumps(list(ids)).encode(), digest_size=8).hexdigest()


def request_row(replay_id: str, run: str, s: Served, workers: Sequence[str]) -> dict:
    c = s.completion
    routing = s.routed.routing_s  # the user waits for the router's choice too
    return {"replay_id": replay_id, "run": run, "request_id": s.request.request_id, "seq": s.request.seq,
            "warmup": s.request.warmup, "engine": workers[s.engine], "arrival_s": s.request.arrival_s,
            "sent_at": c.sent_at, "ttft_s": None if c.error else routing + c.ttft_s, "e2e_s": routing + c.e2e_s,
            "prompt_tokens": len(s.request.tokens), "cached_tokens": c.cached_tokens,
            "output_tokens": len(c.output_ids), "output_digest": _digest(c.output_ids),
            "routing_s": s.routed.routing_s,
            "decision_id": s.routed.decision.request_id if s.routed.decision is not None else None,
            "engine_request_id": c.engine_request_id, "error": c.error, "trace_id": s.trace_id}


def run_row(replay_id: str, result: RunResult, *, engine: str, engines: int, model: str, router: str,
            config: dict) -> dict:
    return {"replay_id": replay_id, "run": result.name, "started_at": result.started_at, "wall_s": result.wall_s,
            "engine": engine, "engines": engines, "model": model, "router": router,
            "config_json": json.dumps(config, sort_keys=True, default=str)}
