"""HTTP lookup endpoint for routers not written in Python, served from an IndexReplica.

``POST /v1/lookup`` with ``Authorization: Bearer <token>`` and a JSON body::

    {"scope": {"model": ..., "model_revision": ..., "tokenizer_revision": ..., "descriptor_id": ...,
               "lora": null, "cache_salt": null},
     "keys": ["<32 hex digits>", ...]}            # canonical keys, block 0 first; or
     "token_ids": [...], "block_size": 16}         # the endpoint keys them (no secret needed)

answers ``{"num_blocks", "lag_events", "lag_ms", "matches": [{"worker", "tier", "group",
"publisher", "prefix_blocks", "extents": [[start, end], ...], "certain"}]}``.

* **Authenticated**: the token must be one of ``NEXUSKV_INDEX_API_TOKENS`` (compared in constant
  time); none configured, no header, or a wrong token: 401 to everyone.
* **Tenant-scoped**: each token maps to one tenant namespace; the lookup runs in that tenant's
  scope whatever the body says (a body naming another tenant is refused with 403), and the index
  only matches blocks stored in that scope, so a caller sees only its tenant's state.

``GET /healthz`` (no token) answers ``{"ok": true, "lag_events": n}`` and nothing tenant-specific.
Run: ``python -m streams.index_api`` (``nexuskv up`` starts it).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import sys
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from nexuskv.config import Settings
from nexuskv.errors import ConfigError, IdentityError, NexusKVError
from nexuskv.identity import IdentityScope
from nexuskv.lookup import LookupResult
from streams.replica import IndexReplica
from streams.telemetry import init_service

__all__ = ["make_lookup_app", "result_json", "main"]

log = logging.getLogger("nexuskv.index_api")
MAX_KEYS = 1 << 16
_SCOPE_FIELDS = ("model", "model_revision", "tokenizer_revision", "descriptor_id", "lora", "cache_salt")


def result_json(result: LookupResult) -> dict[str, Any]:
    return {
        "num_blocks": result.num_blocks, "lag_events": result.lag_events, "lag_ms": result.lag_ms,
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
            body = await request.json()
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
                if not isinstance(token_ids, list) or not isinstance(block_size, int) or block_size < 1:
                    raise ValueError("give keys, or token_ids with a positive block_size")
                if len(token_ids) > MAX_KEYS * block_size:
                    raise ValueError("token_ids: too many")
                result = replica.lookup_tokens(scope, token_ids, block_size)
        except (ValueError, TypeError, KeyError, IdentityError) as exc:
            return web.json_response({"error": f"bad request: {str(exc).splitlines()[0][:300]}"}, status=400)
        return web.json_response(result_json(result))

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "lag_events": replica.lag()[0]})

    app = web.Application(client_max_size=8 << 20)
    app.router.add_post("/v1/lookup", lookup)
    app.router.add_get("/healthz", health)
    return app


async def _serve(settings: Settings) -> None:
    url = settings.broker_url
    assert url is not None
    replica = IndexReplica(url, secret=settings.identity_secret_bytes, max_memberships=settings.index_max_memberships,
                           checkpoint_dir=settings.data_dir / "index" / "nexuskv-index")
    await replica.start()
    runner = web.AppRunner(make_lookup_app(replica, settings.api_tokens))
    await runner.setup()
    site = web.TCPSite(runner, settings.index_api_host, settings.index_api_port)
    await site.start()
    log.info("index lookup endpoint on http://%s:%d", settings.index_api_host, settings.index_api_port)
    try:
        await asyncio.Event().wait()
    finally:
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
    try:
        asyncio.run(_serve(settings))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
