"""``python -m streams.router_service``: the reference router on the bus, behind HTTP.

It keeps, in process: an :class:`~streams.replica.IndexReplica` of every ``nexuskv.kv-events``
partition (bootstrapped from the index workers' checkpoints), a cost-model replica following
``nexuskv.cost-models``, and the route hints of ``nexuskv.placement`` (:class:`PlacementFollower`),
and answers:

``POST /v1/route`` with a JSON body::

    {"request_id": "r-17",
     "token_ids": [...]                              # or "keys": ["<32 hex>", ...], "prompt_tokens": n
     "candidates": [{"worker": "vllm/10.0.0.5:8000/dp0", "queued_prefill_tokens": 2048,
                     "decode_blocks": 900, "active_requests": 3}, ...]}   # optional: --workers, idle

with ``{"request_id", "worker", "policy", "source", "predicted_ttft_s", "queue_s", "action",
"reused_tokens", "local_tokens", "formula", "scores"}`` — ``source`` is ``placement`` when the
planner service already decided for that request id, else ``policy``. Workers are publisher
names as the index knows them (the bridge names vLLM publishers ``vllm/<pod>/dp<rank>``).
``GET /healthz`` answers ``{"ok": true, "lag_events", "route_hints"}``.

The router serves one descriptor (``--model`` or ``--descriptor``) of one tenant (``--tenant``):
it keys prompts in that scope only. It listens on loopback by default; put it beside the gateway
that asks it. Run::

    python -m streams.router_service --policy nexuskv --model meta-llama/Llama-3.1-8B \\
        --workers vllm/10.0.0.5:8000/dp0,vllm/10.0.0.6:8000/dp0 --port 8480

(``--policy dynamo`` or ``--policy llm-d`` for the comparison rules; ``NEXUSKV_BROKER`` names the bus.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web
from aiokafka import AIOKafkaConsumer

from connectors.descriptors import resolve_descriptor
from nexuskv.config import BrokerUrl, Settings
from nexuskv.contracts import codec
from nexuskv.contracts.plans import WorkerLoad
from nexuskv.contracts.topics import PLACEMENT
from nexuskv.descriptor import StateDescriptor
from nexuskv.errors import ConfigError, ContractError, IdentityError, NexusKVError
from nexuskv.policy import ExecutionPolicy
from nexuskv.profiles import shipped_cost_model
from streams.bus.clients import ControlVerifier, check_control, control_verifier, make_consumer, make_producer
from streams.bus.cost_models import CostModelReplica
from streams.bus.policy_file import PolicyFile
from streams.bus.process import stop_on_signals
from streams.replica import IndexReplica
from streams.router import POLICY_NAMES, RouteHints, Router, RoutingOutcome
from streams.telemetry import init_service

__all__ = ["PlacementFollower", "RouterService", "make_router_app", "outcome_json", "main"]

log = logging.getLogger("nexuskv.router_service")
MAX_KEYS = 1 << 16


class PlacementFollower:
    """Follows ``nexuskv.placement`` from its end (no consumer group) into :class:`RouteHints`.

    Hints issued before the router started concern requests it was never asked about, so it
    does not read the topic's history. A record that does not decode, and under a bus secret one
    that no planner signed or that was taken before (:func:`~streams.bus.clients.check_control`), is
    counted and skipped (``malformed``, ``refused``, and ``nexuskv_records_refused``): the tier
    managers reading the same topic dead-letter it; this is a reader. :meth:`run` until
    cancelled, then :meth:`stop`.
    """

    def __init__(self, url: BrokerUrl, hints: RouteHints, *, client_id: str = "nexuskv-router-placement",
                 verifier: ControlVerifier | None = None, clock: Callable[[], float] = time.time) -> None:
        self.url = url
        self.hints = hints
        self.client_id = client_id
        self.verifier = verifier if verifier is not None else control_verifier(Settings.from_env())
        self.clock = clock
        self.malformed = 0
        self.refused = 0
        self._consumer: AIOKafkaConsumer | None = None

    async def start(self, timeout_s: float = 30.0) -> None:
        consumer = make_consumer(self.url, PLACEMENT, client_id=self.client_id, fetch_max_wait_ms=20)
        await consumer.start()
        self._consumer = consumer
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not consumer.assignment():
            if loop.time() > deadline:
                await self.stop()
                raise NexusKVError(f"{PLACEMENT.name}: no partitions assigned within {timeout_s:.0f}s")
            await asyncio.sleep(0.02)
        tps = sorted(consumer.assignment())
        ends = await consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, ends[tp])

    async def run(self) -> None:
        consumer = self._consumer
        if consumer is None:
            raise NexusKVError("PlacementFollower.run: start() first")
        while True:
            got = await consumer.getmany(timeout_ms=200, max_records=1000)
            for records in got.values():
                for record in records:
                    try:
                        check_control(self.verifier, PLACEMENT, record, now=self.clock(), service=self.client_id)
                    except ContractError as exc:
                        self.refused += 1
                        log.warning("route hint %d/%d refused: %s", record.partition, record.offset, exc)
                        continue
                    try:
                        hint = codec.decode(PLACEMENT, record.value)
                    except ContractError:
                        self.malformed += 1
                        continue
                    self.hints.offer(hint)  # type: ignore[arg-type]

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None


def outcome_json(outcome: RoutingOutcome, block_size: int) -> dict[str, Any]:
    p = outcome.prediction
    return {"request_id": outcome.request_id, "worker": outcome.worker, "policy": outcome.policy,
            "source": outcome.source, "predicted_ttft_s": p.ttft_s, "queue_s": p.queue_s, "action": p.action.value,
            "reused_tokens": p.reused_blocks * block_size, "local_tokens": p.local_blocks * block_size,
            "formula": outcome.formula, "scores": [[w, s] for w, s in outcome.scores]}


def _candidates(body: dict[str, Any], default_workers: Sequence[str]) -> list[WorkerLoad]:
    raw = body.get("candidates")
    if raw is None:
        if not default_workers:
            raise ValueError("candidates: none in the body and no --workers configured")
        return [WorkerLoad(worker=w) for w in default_workers]
    if not isinstance(raw, list) or not raw:
        raise ValueError("candidates: a non-empty list of worker loads")
    return [WorkerLoad.model_validate(c) for c in raw]


def make_router_app(router: Router, *, workers: Sequence[str] = (), lag: Callable[[], int] = lambda: 0,
                    clock: Callable[[], float] = time.time) -> web.Application:
    """The aiohttp application answering ``/v1/route`` and ``/healthz``."""
    bs = router.descriptor.block_size

    async def route(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            if not isinstance(body, dict) or not isinstance(body.get("request_id"), str) or not body["request_id"]:
                raise ValueError("body must be an object with a request_id string")
            candidates = _candidates(body, workers)
            now = clock()
            if "keys" in body:
                keys = body["keys"]
                if not isinstance(keys, list) or len(keys) > MAX_KEYS:
                    raise ValueError(f"keys: a list of at most {MAX_KEYS} hex strings")
                query = router.query(body["request_id"], candidates, now=now, keys=[int(k, 16) for k in keys],
                                     prompt_tokens=int(body.get("prompt_tokens", len(keys) * bs)))
            else:
                token_ids = body.get("token_ids")
                if not isinstance(token_ids, list) or not token_ids or len(token_ids) > MAX_KEYS * bs:
                    raise ValueError("give token_ids (a non-empty list) or keys")
                query = router.query(body["request_id"], candidates, now=now, token_ids=token_ids)
            outcome = router.route(query, now=now)
        except (ValueError, TypeError, KeyError, IdentityError, ContractError) as exc:
            return web.json_response({"error": f"bad request: {str(exc).splitlines()[0][:300]}"}, status=400)
        return web.json_response(outcome_json(outcome, bs))

    async def health(_request: web.Request) -> web.Response:
        hints = router.hints
        return web.json_response({"ok": True, "lag_events": lag(), "route_hints": len(hints) if hints else 0})

    app = web.Application(client_max_size=16 << 20)
    app.router.add_post("/v1/route", route)
    app.router.add_get("/healthz", health)
    return app


class RouterService:
    """The router's bus clients and HTTP endpoint; :meth:`start`, then :meth:`stop`."""

    def __init__(self, url: BrokerUrl, descriptor: StateDescriptor, *, policy: str, host: str = "127.0.0.1",
                 port: int = 8480, workers: Sequence[str] = (), secret: bytes = b"",
                 max_memberships: int = 16_000_000, checkpoint_dir: Path | None = None,
                 policy_file: Path | None = None) -> None:
        self.url = url
        self.host, self.port = host, port
        self.policy_file = PolicyFile(policy_file) if policy_file else None
        self._execution = self.policy_file.current if self.policy_file else ExecutionPolicy(version="builtin")
        self.replica = IndexReplica(url, secret=secret, max_memberships=max_memberships, checkpoint_dir=checkpoint_dir,
                                    client_id="nexuskv-router-index")
        self.costs = CostModelReplica(url, shipped_cost_model(), service="nexuskv-router")
        self.hints = RouteHints()
        self.follower = PlacementFollower(url, self.hints)
        self.router = Router(self.replica, descriptor, policy=policy, model=lambda: self.costs.model,
                             execution=self.execution, hints=self.hints, secret=secret)
        self.workers = list(workers)
        self._producer = make_producer(url, client_id="nexuskv-router")  # the cost-model reader's dead letters
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def execution(self) -> ExecutionPolicy:
        return self.policy_file.current if self.policy_file else self._execution

    async def start(self, timeout_s: float = 30.0) -> None:
        await self._producer.start()
        await self.replica.start(timeout_s=timeout_s)
        await self.costs.start(timeout_s=timeout_s)
        await self.follower.start(timeout_s=timeout_s)
        self._tasks = [asyncio.create_task(self.costs.run(self._producer), name="router-cost-models"),
                       asyncio.create_task(self.follower.run(), name="router-placement")]
        self._runner = web.AppRunner(make_router_app(self.router, workers=self.workers,
                                                     lag=lambda: self.replica.lag()[0]))
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        log.info("router (%s) for %s on http://%s:%d", self.router.policy, self.router.descriptor.model,
                 self.host, self.port)

    def reload_policy(self) -> None:
        outcome = self.policy_file.poll() if self.policy_file is not None else None
        if outcome is not None and outcome.error is not None:
            log.error("policy edit refused, the last valid policy stays in force:\n%s", outcome.error.describe())

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._runner is not None:
            await self._runner.cleanup()
        await self.follower.stop()
        await self.costs.stop()
        await self.replica.stop()
        await self._producer.stop()


async def _serve(args: argparse.Namespace, settings: Settings, url: BrokerUrl) -> None:
    descriptor = resolve_descriptor(model=args.model, descriptor_path=args.descriptor, tenant=args.tenant,
                                    block_size=args.block_size, engine_family=args.engine)
    service = RouterService(url, descriptor, policy=args.policy, host=args.host, port=args.port,
                            workers=[w for w in (args.workers or "").split(",") if w],
                            secret=settings.identity_secret_bytes, max_memberships=settings.index_max_memberships,
                            checkpoint_dir=settings.data_dir / "index" / "nexuskv-index",
                            policy_file=settings.policy_file)
    await service.start(timeout_s=settings.broker_start_timeout_s)
    stop = stop_on_signals()
    try:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=settings.policy_reload_s)
            service.reload_policy()
    finally:
        await service.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m streams.router_service", description=__doc__.splitlines()[0])
    ap.add_argument("--policy", choices=POLICY_NAMES, default=POLICY_NAMES[0])
    ap.add_argument("--model", default="meta-llama/Llama-3.1-8B", help="a known model (nexuskv.models)")
    ap.add_argument("--descriptor", default=None, help="a StateDescriptor JSON file (instead of --model)")
    ap.add_argument("--tenant", default="default")
    ap.add_argument("--engine", default="vllm", help="engine family of the workers' state (vllm, sglang)")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--workers", default="", help="comma-separated workers used when a request names none")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8480)
    args = ap.parse_args(argv)
    try:
        settings = Settings.from_env()
        url = settings.broker_url
        if url is None:
            raise ConfigError("NEXUSKV_BROKER", "the router needs a broker URL (the bus of `nexuskv up`)")
        resolve_descriptor(model=args.model, descriptor_path=args.descriptor, tenant=args.tenant,
                           block_size=args.block_size, engine_family=args.engine)
    except NexusKVError as exc:
        print(f"nexuskv router: error: {exc}", file=sys.stderr)
        return 2
    init_service("router", settings)
    asyncio.run(_serve(args, settings, url))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
