"""HTTP lookup endpoint for routers not written in Python, served from an IndexReplica.

``POST /v1/lookup`` with ``Authorization: Bearer <token>`` and a JSON body::

    {"scope": {"model": ..., "model_revision": ..., "tokenizer_revision": ..., "descriptor_id": ...,
               "lora": null, "cache_salt": null},
     "keys": ["<32 hex digits>", ...]}            # canonical keys, block 0 first; or
     "token_ids": [...], "block_size": 16}         # the endpoint keys them (no secret needed)

answers ``{"num_blocks", "lag_events", "lag_ms", "matches": [{"worker", "tier", "group",
"publisher", "prefix_blocks", "extents": [[start, end], ...], "certain"}]}`` (``lag_ms`` null: the
replica's lag is unknown — it has not fetched every partition yet, or it stopped applying — and
``lag_events`` is then a lower bound, at least 1).

* **Authenticated**: the token must be one of ``NEXUSKV_INDEX_API_TOKENS`` (compared in constant
  time); none configured, no header, or a wrong token: 401 to everyone.
* **Tenant-scoped**: each token maps to one tenant namespace; the lookup runs in that tenant's
  scope whatever the body says (a body naming another tenant is refused with 403), and the index
  only matches blocks stored in that scope, so a caller sees only its tenant's state.

* **Robust to hostile bodies**: at most 8 MiB; JSON nested deeper than :data:`MAX_DEPTH` levels,
  malformed JSON, unknown shapes and out-of-range values (``block_size`` must be 1-65536) are a
  400 with the reason, never a 500. Token ids are keyed by the replica with a bounded keyer cache
  (:data:`streams.replica.KEYER_CACHE`), so 20,000 distinct block sizes cost nothing lasting.

``GET /healthz`` (no token) answers ``{"ok", "ready", "caught_up", "lag_events", "lag_ms"}`` and
nothing tenant-specific: ``ready`` once the replica applied the log to the end offsets it found at
start (the service's ``/readyz`` says the same, :func:`streams.replica.report_readiness`);
``caught_up`` only while its lag is known and 0; ``lag_events``/``lag_ms`` null while unknown (no
fetch yet). 503 with ``ok: false`` until ready, and once the replica stopped applying. The service
exits non-zero when its replica's apply task or its HTTP server fails
(:class:`streams.supervisor.Supervisor`).
Run: ``python -m streams.index_api`` (``nexuskv up`` starts it).
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import sys
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from nexuskv.config import Settings
from nexuskv.errors import ConfigError, IdentityError, NexusKVError
from nexuskv.identity import IdentityScope
from nexuskv.lookup import LookupResult
from streams.bus.health import HEALTH
from streams.bus.process import freeze_startup_heap
from streams.replica import IndexReplica, report_readiness
from streams.supervisor import Supervisor, run_service
from streams.telemetry import init_service

__all__ = ["make_lookup_app", "result_json", "main"]

log = logging.getLogger("nexuskv.index_api")
MAX_KEYS = 1 << 16
MAX_BLOCK_SIZE = 1 << 16
MAX_DEPTH = 8  # the deepest a valid body goes is 3 (body, scope, value)
_SCOPE_FIELDS = ("model", "model_revision", "tokenizer_revision", "descriptor_id", "lora", "cache_salt")


def result_json(result: LookupResult) -> dict[str, Any]:
    return {
        "num_blocks": result.num_blocks, "lag_events": result.lag_events,
        "lag_ms": result.lag_ms if math.isfinite(result.lag_ms) else None,  # JSON has no infinity: unknown
        "matches": [{"worker": m.location.worker, "tier": m.location.tier.value, "group": m.location.group,
                     "publisher": m.publisher, "prefix_blocks": m.prefix_blocks,
                     "extents": [[e.start, e.end] for e in m.extents], "certain": m.certain}
                    for m in result.matches],
    }


def _tenant_of(request: web.Request, tokens: Mapping[str, str]) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer" or not presented:
        return None
    found = None
    for token, tenant in tokens.items():  # constant time per token, and every token is compared
        if hmac.compare_digest(token.encode(), presented.strip().encode()):
            found = tenant
    return found


def _depth(value: Any, limit: int) -> int:
    """How deep ``value`` nests lists and objects, counting up to ``limit + 1`` (iterative)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)
                         if isinstance(child, (list, dict)))
    return deepest


def parse_body(raw: bytes) -> Any:
    """The request body as JSON; ValueError (a 400) for anything else, nested too deeply included."""
    try:
        body = json.loads(raw)
    except RecursionError:  # CPython's decoder refuses nesting beyond the interpreter's recursion limit
        raise ValueError(f"body nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        raise ValueError(f"body is not JSON: {type(exc).__name__}") from None
    if _depth(body, MAX_DEPTH) > MAX_DEPTH:
        raise ValueError(f"body nested deeper than {MAX_DEPTH} levels")
    return body


def make_lookup_app(replica: IndexReplica, tokens: Mapping[str, str]) -> web.Application:
    """The aiohttp application; ``tokens`` maps bearer token -> tenant namespace."""
    tokens = dict(tokens)
    if not tokens:
        log.warning("no NEXUSKV_INDEX_API_TOKENS configured: the lookup endpoint answers 401 to everyone")

    async def lookup(request: web.Request) -> web.Response:
        tenant = _tenant_of(request, tokens)
        if tenant is None:
            return web.json_response({"error": "unauthorized"}, status=401,
                                     headers={"WWW-Authenticate": 'Bearer realm="nexuskv-index"'})
        try:
            body = parse_body(await request.read())
            if not isinstance(body, dict) or not isinstance(body.get("scope"), dict):
                raise ValueError("body must be an object with a scope object")
            asked = body["scope"].get("tenant_namespace")
            if asked is not None and asked != tenant:
                return web.json_response({"error": "forbidden: the token's tenant is not the one asked for"},
                                         status=403)
            scope = IdentityScope(tenant_namespace=tenant, **{k: body["scope"].get(k) for k in _SCOPE_FIELDS})
            if "keys" in body:
                keys = body["keys"]
                if not isinstance(keys, list) or len(keys) > MAX_KEYS:
                    raise ValueError(f"keys: a list of at most {MAX_KEYS} hex strings")
                result = replica.lookup(scope, [int(k, 16) for k in keys])
            else:
                token_ids, block_size = body.get("token_ids"), body.get("block_size")
                if (not isinstance(token_ids, list) or not isinstance(block_size, int) or isinstance(block_size, bool)
                        or not 1 <= block_size <= MAX_BLOCK_SIZE):
                    raise ValueError(f"give keys, or token_ids with a block_size from 1 to {MAX_BLOCK_SIZE}")
                if len(token_ids) > MAX_KEYS * block_size:
                    raise ValueError("token_ids: too many")
                result = replica.lookup_tokens(scope, token_ids, block_size)
        except (ValueError, TypeError, KeyError, AttributeError, IdentityError, RecursionError) as exc:
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            return web.json_response({"error": f"bad request: {first[:300]}"}, status=400)
        return web.json_response(result_json(result))

    async def health(_request: web.Request) -> web.Response:
        behind, ms = replica.lag()
        ready = replica.caught_up()
        ok = ready and replica.failure is None
        return web.json_response({"ok": ok, "ready": ready, "caught_up": ok and behind == 0, "lag_events": behind,
                                  "lag_ms": ms if math.isfinite(ms) else None}, status=200 if ok else 503)

    app = web.Application(client_max_size=8 << 20)
    app.router.add_post("/v1/lookup", lookup)
    app.router.add_get("/healthz", health)
    return app


async def _serve(settings: Settings, stop: Any) -> None:
    url = settings.broker_url
    assert url is not None
    replica = IndexReplica(url, secret=settings.identity_secret_bytes, max_memberships=settings.index_max_memberships,
                           checkpoint_dir=settings.data_dir / "index" / "nexuskv-index",
                           bus_secret=settings.bus_secret_bytes, client_id="nexuskv-index-api",
                           expected_blocks=settings.index_expected_blocks)
    HEALTH.set_ready("replica", False, "starting: lag unknown (no fetch yet)")
    await replica.start()
    supervisor = Supervisor("index-api")
    assert replica.task is not None
    supervisor.watch(replica.task, name="index-replica")
    runner = web.AppRunner(make_lookup_app(replica, settings.api_tokens))
    await runner.setup()
    site = web.TCPSite(runner, settings.index_api_host, settings.index_api_port)
    await site.start()
    HEALTH.set_ready("http", True)
    supervisor.spawn(report_readiness(replica), name="catch-up")
    freeze_startup_heap()
    log.info("index lookup endpoint on http://%s:%d", settings.index_api_host, settings.index_api_port)
    try:
        await supervisor.until(stop)
    finally:
        await supervisor.stop()
        await runner.cleanup()
        await replica.stop()


def main() -> int:
    try:
        settings = Settings.from_env()
        if settings.broker_url is None:
            raise ConfigError("NEXUSKV_BROKER", "the index API needs a broker URL (nexuskv up sets it)")
    except NexusKVError as exc:
        print(f"index-api: error: {exc}", file=sys.stderr)
        return 2
    init_service("index-api", settings)
    return run_service("index-api", lambda stop: _serve(settings, stop))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
