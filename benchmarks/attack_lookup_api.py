"""The index lookup endpoint (``python -m streams.index_api``, a real process) probed by a hostile
caller: 5xx answers, cross-tenant hits, and what 20,000 caller-chosen block sizes leave behind.

Two tenants hold the *same* conversations (the Mooncake slice published once in tenant ``acme``
and once in ``globex``, so every prefix exists in both scopes); the endpoint has one token per
tenant and the deployment an identity secret. Probes:

* **hostile bodies** (``--fuzz`` in all): deeply nested JSON, malformed JSON, wrong shapes, wrong
  types, out-of-range block sizes, random bytes and random JSON — every answer must be a 4xx;
  the figure counts answers >= 500 and dropped connections;
* **cross tenant** (165 probes): acme's token asking for globex's blocks by token ids, by
  canonical keys computed in globex's scope with the deployment's secret (what an insider could
  do), naming globex in the body (refused, 403), and without a token (401) — a hit is any match
  of a globex publisher returned;
* **block sizes**: 20,000 requests each with a block size of its own; the endpoint's resident
  memory (VmRSS) before and after.

Run: ``python -m benchmarks.attack_lookup_api [--fuzz 3000]`` (``NEXUSKV_BROKER`` to use a running
broker; otherwise a local Apache Kafka is started; the endpoint reads ``nexuskv.kv-events``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from nexuskv.contracts.kv_events import PublisherIdentity
from nexuskv.contracts.topics import KV_EVENTS
from nexuskv.identity import BlockKeyer
from streams.bus.clients import BatchSigner
from streams.bus.process import ManagedProcess, free_port
from streams.bus.topics import ensure_topics

from benchmarks._attack import ROOT, encoded, produce, replay
from benchmarks._attack_broker import attack_broker
from benchmarks._result import Run, write_result

IDENTITY_SECRET = "lookup-api-identity-secret"  # two tenants: at least 16 bytes, or the endpoint refuses to start
BUS_SECRET = "lookup-api-bus-secret-of-the-attack"  # two tenants need one too (issue 23); the batches are signed
TOKENS = {"acme": "acme-token-0123456789abcdef", "globex": "globex-token-0123456789abcd"}


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _fuzz_bodies(n: int, scope: dict, rng: random.Random) -> list[bytes]:
    fixed = [b"[" * 100_000, b'{"scope": ' + b'{"a": ' * 20_000 + b"1" + b"}" * 20_001, b"\xff\xfe", b"", b"null",
             b"[]", b'{"scope": {}, "keys": ' + b"[" * 50 + b"]" * 50 + b"}"]
    shapes = [{"scope": "x"}, {"scope": scope}, {"scope": scope, "keys": "00"}, {"scope": scope, "keys": [1]},
              {"scope": scope, "keys": ["zz" * 16]}, {"scope": scope, "token_ids": [1], "block_size": True},
              {"scope": scope, "token_ids": [1], "block_size": 1 << 40}, {"scope": scope, "token_ids": ["x"] * 16,
                                                                         "block_size": 16},
              {"scope": {**scope, "lora": ["x"]}, "token_ids": [1] * 16, "block_size": 16}]
    out = list(fixed) + [json.dumps(s).encode() for s in shapes]
    while len(out) < n:
        kind = rng.random()
        if kind < 0.3:
            out.append(bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 300))))
        else:
            def value(depth: int):
                pick = rng.random()
                if depth > 4 or pick < 0.3:
                    return rng.choice([None, True, 1, -7, 1 << 70, 3.5, "s", "00" * 16, [], {}])
                if pick < 0.65:
                    return [value(depth + 1) for _ in range(rng.randint(0, 4))]
                keys = ["scope", "keys", "token_ids", "block_size", "tenant_namespace", "model", "x"]
                return {rng.choice(keys): value(depth + 1) for _ in range(rng.randint(0, 4))}
            body = value(0)
            if isinstance(body, dict) and rng.random() < 0.5:
                body["scope"] = {**scope, **(body.get("scope") if isinstance(body.get("scope"), dict) else {})}
            out.append(json.dumps(body).encode())
    return out[:n]


async def run(url, *, fuzz: int, sizes: int, folder: Path) -> dict:
    rng = random.Random(13)
    await ensure_topics(url, partitions=4, topics=(KV_EVENTS,))
    base, batches = replay(limit=20, workers=2, prefix="acme-engine")
    ident = base.identity
    globex_ident = PublisherIdentity(**{**ident.model_dump(), "tenant_namespace": "globex"})
    _g, globex_batches = replay(limit=64, workers=2, prefix="globex-engine", identity=globex_ident)
    await produce(url, KV_EVENTS.name, encoded([*[b.model_copy(update={"identity": ident.model_copy(
        update={"tenant_namespace": "acme"})}) for b in batches], *globex_batches],
        BatchSigner(bus_secret=BUS_SECRET.encode())))
    port = free_port()
    env = dict(os.environ, NEXUSKV_BROKER=str(url), NEXUSKV_DATA_DIR=str(folder), NEXUSKV_IDENTITY_SECRET=IDENTITY_SECRET,
               NEXUSKV_BUS_SECRET=BUS_SECRET, NEXUSKV_INDEX_API_PORT=str(port), NEXUSKV_INDEX_API_TOKENS=",".join(f"{t}={n}" for n, t in TOKENS.items()),
               NEXUSKV_LOG_LEVEL="WARNING", PYTHONPATH=str(ROOT))
    proc = ManagedProcess([sys.executable, "-m", "streams.index_api"], name="index-api", log_path=folder / "api.log",
                          env=env, cwd=ROOT)
    proc.start()
    endpoint = f"http://127.0.0.1:{port}/v1/lookup"
    scope = {k: getattr(base.scope, k) for k in ("model", "model_revision", "tokenizer_revision", "descriptor_id")}
    try:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 60
            while True:  # up, and caught up: globex's blocks are found with globex's token
                try:
                    req = _g.requests[5]
                    toks = _g.tokens(_g.blocks_of(req)).tolist()
                    async with http.post(endpoint, json={"scope": scope, "token_ids": toks, "block_size": 16},
                                         headers={"Authorization": f"Bearer {TOKENS['globex']}"}) as r:
                        if r.status == 200 and (await r.json())["matches"]:
                            break
                except aiohttp.ClientError:
                    pass
                assert proc.alive() and time.monotonic() < deadline, proc.log_tail(20)
                await asyncio.sleep(0.3)

            async def post(body: bytes, token: str | None = TOKENS["acme"]) -> int:
                headers = {"Content-Type": "application/json"}
                if token:
                    headers["Authorization"] = f"Bearer {token}"
                try:
                    async with http.post(endpoint, data=body, headers=headers) as r:
                        await r.read()
                        return r.status
                except aiohttp.ClientError:
                    return 599  # dropped connection

            statuses = [await post(b) for b in _fuzz_bodies(fuzz, scope, rng)]
            # Cross tenant: blocks only globex has (its trace runs on past acme's 20 requests).
            only_globex = [q for q in _g.requests[20:] if _g.blocks_of(q)]
            keyer = BlockKeyer(base.scope.model_copy(update={"tenant_namespace": "globex"}), 16, IDENTITY_SECRET.encode())
            cross_hits, cross_status = 0, []
            for q in itertools.cycle(only_globex):
                toks = _g.tokens(_g.blocks_of(q)).tolist()
                keys = [format(k, "032x") for k in keyer.keys(toks)]
                for body, token in (({"scope": scope, "token_ids": toks, "block_size": 16}, TOKENS["acme"]),
                                    ({"scope": scope, "keys": keys}, TOKENS["acme"]),
                                    ({"scope": {**scope, "tenant_namespace": "globex"}, "keys": keys}, TOKENS["acme"]),
                                    ({"scope": scope, "keys": keys}, None)):
                    if len(cross_status) >= 165:
                        break
                    headers = {"Authorization": f"Bearer {token}"} if token else {}
                    async with http.post(endpoint, json=body, headers=headers) as r:
                        cross_status.append(r.status)
                        if r.status == 200:  # a hit: any match that is globex's
                            matches = (await r.json())["matches"]
                            cross_hits += any(m["publisher"].startswith("globex-") for m in matches)
                if len(cross_status) >= 165:
                    break
            rss_before = _rss_kib(proc.pid)
            toks = _g.tokens(_g.blocks_of(_g.requests[3])).tolist()
            for size in range(17, 17 + sizes):
                await post(json.dumps({"scope": scope, "token_ids": toks[:size], "block_size": size}).encode())
            rss_after = _rss_kib(proc.pid)
            alive = proc.alive()
    finally:
        proc.stop()
    return {"fuzz_probes": len(statuses), "answers_5xx": sum(s >= 500 for s in statuses),
            "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
            "cross_tenant_probes": len(cross_status), "cross_tenant_hits": cross_hits,
            "cross_tenant_statuses": {str(s): cross_status.count(s) for s in sorted(set(cross_status))},
            "block_sizes": sizes, "rss_growth_mib": round((rss_after - rss_before) / 1024, 1), "api_alive": alive}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.attack_lookup_api", description=__doc__.splitlines()[0])
    ap.add_argument("--fuzz", type=int, default=3000)
    ap.add_argument("--block-sizes", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=1,
                    help="attacks, each on a fresh API and folder; one run each (default 1)")
    ap.add_argument("--baseline-5xx", type=float, default=0.0,
                    help="answers >= 500 of the same attack on commit 30ffd34, for the result file: the baseline of "
                         "every run, given, not measured here")
    ap.add_argument("--baseline-rss-mib", type=float, default=None, help="its RSS growth, kept in the details")
    ap.add_argument("--no-write", action="store_true")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    outs = []
    with attack_broker() as url:
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory(prefix="nexuskv-api-") as tmp:
                outs.append(asyncio.run(run(url, fuzz=args.fuzz, sizes=args.block_sizes, folder=Path(tmp))))
    out = {**sorted(outs, key=lambda o: o["answers_5xx"])[len(outs) // 2], "load_average": os.getloadavg(),
           "baseline_source": "given with --baseline-5xx (commit 30ffd34's run of the same attack), not measured "
                              "in this run"}
    if len(outs) > 1:
        out["per_run"] = outs
    print(f"{out['fuzz_probes']} hostile bodies: {out['answers_5xx']} answers >= 500 ({out['statuses']}); "
          f"{out['cross_tenant_probes']} cross-tenant probes: {out['cross_tenant_hits']} hits "
          f"({out['cross_tenant_statuses']}); {out['block_sizes']} block sizes: RSS +{out['rss_growth_mib']} MiB; "
          f"endpoint alive {out['api_alive']}")
    if not args.no_write:
        if args.baseline_rss_mib is not None:
            out["baseline_rss_growth_mib"] = args.baseline_rss_mib
        write_result("reliability_lookup_api", "lookup API answers >= 500 to hostile bodies", "answers", [Run(o["answers_5xx"], args.baseline_5xx) for o in outs], "commit 30ffd34, the same attack", f"python -m benchmarks.attack_lookup_api --fuzz {args.fuzz} --block-sizes {args.block_sizes}"
                     + (f" --repeats {args.repeats}" if args.repeats != 1 else "") + f" --baseline-5xx {args.baseline_5xx:g}"
                     + (f" --baseline-rss-mib {args.baseline_rss_mib:g}" if args.baseline_rss_mib is not None else ""), details=out)


if __name__ == "__main__":
    main()
