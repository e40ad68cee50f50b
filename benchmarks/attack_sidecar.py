"""The node's index sidecar attacked by local clients: a well-behaved engine's ask p99, the sidecar's
memory and crashes, the bounded server against the pre-fix one in the same run.

The sidecar (a **separate process**, as in production) serves the live index of
:mod:`benchmarks.bench_planner_live` (~1M memberships from the Mooncake trace) while applying live
kv-events batches on its event loop (2 ms of batches, 2 ms pause: a busy replica). Two servers,
each started fresh for every run, the same index, the same attacks:

* ``fixed`` — :class:`streams.index_sidecar.IndexSidecar` with the default
  :class:`~streams.index_sidecar.AskLimits` (asks on their own thread, the frame deadline, the
  connection cap, 16,384 keys per ask), the service's switch interval
  (:func:`~streams.index_sidecar.prefer_asks`) and its ask thread's nice value
  (``Settings.index_ask_nice``);
* ``prefix`` — the server as it shipped before (:mod:`benchmarks._sidecar_prefix`, main at
  9c0cc94): asks inline on the ingest loop, no deadline, no cap, 4 MiB frames, 65,536-key asks.

Attacks, each from a separate attacker process (asyncio), while one engine
(:class:`connectors.index_client.IndexClient` with a 1 s budget, so the true round trip is
measured; the production budget is 20 ms), connected before the attack as an engine connects at
start, asks 512-key questions (8K-token prompts of the trace) back to back on its connection; at
the end of each attack a second engine connects and asks once within 20 ms (``newcomer``: an
engine restarting during the attack):

* ``none`` — no attack;
* ``slowloris`` — 200 connections each announcing a 4 MiB frame (the pre-fix largest; a
  connection the server closes at once announces the largest frame the bounded server reads
  instead) and sending 16 KiB of it every 50 ms, then holding it; a closed or refused connection
  reconnects after 0.1 s;
* ``large`` — 4 connections asking 65,536-key and 16,384-key questions back to back (real keys:
  one 512-key question repeated), reconnecting 0.1 s after a close;
* ``flood`` — 1,000 connections opened and held, each reopened 0.5 s after it is closed or refused
  (faster churn measures the attacker's CPU on these 2 shared cores, not the sidecar);
* ``combined`` — ``slowloris`` plus ``large`` (the issue's goal: p99 <= 20 ms, RSS growth <= 64 MiB).

Per attack: the engine's p50/p99 round trip and asks over 20 ms, the sidecar's peak resident
memory (VmRSS, sampled every 50 ms) minus its memory before the attack, and whether it survived.
Figures: ``attack_sidecar_ask_p99`` (the engine's p99 under ``combined``, bounded / pre-fix) and
``attack_sidecar_rss_growth`` (MiB under ``combined``), median of per-run ratios.

Run: ``python -m benchmarks.attack_sidecar [--runs 3] [--seconds 4] [--no-write]``
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import asyncio
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from nexuskv.contracts.lookup_wire import MAX_FRAME, OP_LOOKUP, VERSION, Ask, ask_frame_limit, encode_ask, wire_scope

from benchmarks._result import Run, write_result

ROOT = Path(__file__).resolve().parents[1]
ATTACKS = ("none", "slowloris", "large", "flood", "combined")
MODES = ("fixed", "prefix")
BUDGET_MS = 20.0
RECONNECT_S = 0.1  # a slowloris or large-ask connection closed (or refused) opens again after this
FLOOD_RECONNECT_S = 0.5  # each of the 1,000 flood connections, once closed or refused


# -- the sidecar process --------------------------------------------------------------------------


def serve(path: str, mode: str, live: bool = True) -> None:
    """The sidecar in ``mode`` over the live benchmark index; prints ``ready`` once it listens."""
    from nexuskv.config import Settings
    from streams.index_sidecar import AskLimits, IndexSidecar, prefer_asks

    from benchmarks._sidecar_prefix import PrefixSidecar
    from benchmarks.bench_planner_live import Fleet, LiveReplica, trace

    fleet = Fleet(trace())

    async def main() -> None:
        replica = LiveReplica(fleet)
        if mode == "prefix":
            sidecar: object = PrefixSidecar(replica, Path(path))
        else:
            # fixed-nice0: the service's server at the process's own priority (no CAP_SYS_NICE).
            nice = None if mode == "fixed-nice0" else Settings.model_fields["index_ask_nice"].default
            sidecar = IndexSidecar(replica, Path(path), AskLimits(), ask_nice=nice)
            if mode != "fixed-5ms":
                prefer_asks()
        await sidecar.start()  # type: ignore[attr-defined]
        began, applied = time.perf_counter(), sum(fleet.seq.values())
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        print("ready", flush=True)
        work = [asyncio.ensure_future(c) for c in [sidecar.serve_forever(),  # type: ignore[attr-defined]
                                                   *([replica.run()] if live else [])]]
        await stop.wait()
        Path(path).with_name("ingest.json").write_text(json.dumps(
            {"batches": sum(fleet.seq.values()) - applied, "seconds": time.perf_counter() - began}))
        for w in work:
            w.cancel()
        await sidecar.close()  # type: ignore[attr-defined]

    asyncio.run(main())


def start_server(mode: str, *, live: bool = True) -> tuple[subprocess.Popen, str]:
    folder = tempfile.mkdtemp(prefix="nkv-att-", dir="/tmp")
    path = os.path.join(folder, "index.sock")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.attack_sidecar", "--serve", path, "--mode", mode]
                            + ([] if live else ["--idle"]), stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready", "the sidecar did not start"
    return proc, path


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


# -- the attacker process -------------------------------------------------------------------------


def _question() -> tuple[object, bytes]:
    from benchmarks.bench_planner_live import SCOPE, blocks_of, trace

    requests = trace()
    rng = random.Random(5)
    raw = b""
    while len(raw) < 16 * 512:
        raw = blocks_of(requests[rng.randrange(len(requests))])
    return SCOPE, raw[: 16 * 512]


async def _slowloris(path: str, stop: float, counts: dict) -> None:
    sizes = [MAX_FRAME - 1, ask_frame_limit(16_384)]
    size = sizes[0]
    chunk = bytes(16 << 10)
    while time.monotonic() < stop:
        try:
            reader, writer = await asyncio.open_unix_connection(path)
        except OSError:
            counts["connect_failed"] += 1
            await asyncio.sleep(RECONNECT_S)
            continue
        counts["connections"] += 1
        opened = time.monotonic()
        try:
            writer.write(size.to_bytes(4, "big"))
            sent = 0
            while time.monotonic() < stop and sent + len(chunk) < size:
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), 1.0)
                sent += len(chunk)
                if reader.at_eof() or writer.is_closing():
                    break
                try:  # anything back (an error frame, or EOF) means closed
                    got = await asyncio.wait_for(reader.read(1 << 16), 0.05)
                    if got or reader.at_eof():
                        break
                except TimeoutError:
                    pass
            else:
                while time.monotonic() < stop and not reader.at_eof():
                    with_timeout = asyncio.wait_for(reader.read(1 << 16), 0.2)
                    try:
                        if not await with_timeout:
                            break
                    except TimeoutError:
                        pass
        except (OSError, TimeoutError):
            pass
        finally:
            writer.close()
        counts["closed"] += 1
        if time.monotonic() - opened < 0.2 and size == sizes[0]:
            size = sizes[1]  # refused at once: announce what this server reads
        await asyncio.sleep(RECONNECT_S)


async def _large(path: str, stop: float, counts: dict, scope, raw: bytes) -> None:
    wire = wire_scope(scope)  # type: ignore[arg-type]
    asks = [encode_ask(Ask(VERSION, OP_LOOKUP, 1, wire, raw * 128)), encode_ask(Ask(VERSION, OP_LOOKUP, 2, wire, raw * 32))]
    while time.monotonic() < stop:
        try:
            reader, writer = await asyncio.open_unix_connection(path)
        except OSError:
            counts["connect_failed"] += 1
            await asyncio.sleep(RECONNECT_S)
            continue
        counts["connections"] += 1
        try:
            i = 0
            while time.monotonic() < stop:
                writer.write(asks[i % 2])
                await writer.drain()
                header = await asyncio.wait_for(reader.readexactly(4), 5.0)
                await reader.readexactly(int.from_bytes(header, "big"))
                counts["large_answered"] += 1
                i += 1
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            counts["closed"] += 1
        finally:
            writer.close()
        await asyncio.sleep(RECONNECT_S)


async def _flood(path: str, stop: float, counts: dict) -> None:
    while time.monotonic() < stop:
        try:
            reader, writer = await asyncio.open_unix_connection(path)
        except OSError:
            counts["connect_failed"] += 1
            await asyncio.sleep(FLOOD_RECONNECT_S)
            continue
        counts["connections"] += 1
        try:
            while time.monotonic() < stop:
                try:
                    if not await asyncio.wait_for(reader.read(1 << 16), 0.5):
                        break
                except TimeoutError:
                    pass
        except OSError:
            pass
        finally:
            writer.close()
        counts["closed"] += 1
        await asyncio.sleep(FLOOD_RECONNECT_S)


def attack(path: str, kind: str, seconds: float) -> None:
    counts = {"connections": 0, "closed": 0, "connect_failed": 0, "large_answered": 0}
    scope, raw = _question()

    async def main() -> None:
        stop = time.monotonic() + seconds
        tasks = []
        if kind in ("slowloris", "combined"):
            tasks += [_slowloris(path, stop, counts) for _ in range(200)]
        if kind in ("large", "combined"):
            tasks += [_large(path, stop, counts, scope, raw) for _ in range(4)]
        if kind == "flood":
            tasks += [_flood(path, stop, counts) for _ in range(1000)]
        print("attacking", flush=True)
        await asyncio.gather(*tasks)

    asyncio.run(main())
    print(json.dumps(counts), flush=True)


# -- the measurement ------------------------------------------------------------------------------


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(len(s) * q))] * 1000.0


def connected(path: str, qs: list):
    """An engine's client, connected and warm (an engine connects at start and keeps its connection)."""
    from connectors.index_client import IndexClient

    client = IndexClient(path, budget_s=1.0, backoff_s=0.0)
    for q in qs[:50]:
        client.lookup(q.scope, q.keys)
    return client


def engine_asks(client, seconds: float, qs: list) -> tuple[list[float], dict]:
    times = []
    stop = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < stop:
        q = qs[i % len(qs)]
        t0 = time.perf_counter()
        client.lookup(q.scope, q.keys)
        times.append(time.perf_counter() - t0)
        i += 1
    stats = dict(client.stats)
    client.close()
    return times, stats


def newcomer(path: str, qs: list) -> dict:
    """An engine (re)starting during the attack: its first ask on a new connection, 20 ms budget."""
    from connectors.index_client import IndexClient

    client = IndexClient(path, budget_s=BUDGET_MS / 1000.0, backoff_s=0.0)
    t0 = time.perf_counter()
    got = client.lookup(qs[0].scope, qs[0].keys)
    out = {"ms": (time.perf_counter() - t0) * 1000, "answered": bool(client.stats["answered"]),
           "hits": bool(got.matches), **{k: v for k, v in client.stats.items() if v and k != "asked"}}
    client.close()
    return out


def one_mode(mode: str, seconds: float, qs: list) -> dict:
    proc, path = start_server(mode)
    out: dict = {}
    try:
        engine_asks(connected(path, qs), 1.0, qs)  # warm the server
        for kind in ATTACKS:
            client = connected(path, qs)
            base = rss_mib(proc.pid)
            peak = [base]
            sampling = threading.Event()

            def sample(sampling: threading.Event = sampling, peak: list[float] = peak) -> None:
                while not sampling.wait(0.05):
                    if proc.poll() is None:
                        peak[0] = max(peak[0], rss_mib(proc.pid))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            attacker = None
            if kind != "none":
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
                attacker = subprocess.Popen([sys.executable, "-m", "benchmarks.attack_sidecar", "--attack", kind,
                                             "--path", path, "--seconds", str(seconds + 1.5)],
                                            stdout=subprocess.PIPE, env=env)
                assert attacker.stdout is not None and attacker.stdout.readline().strip() == b"attacking"
                time.sleep(1.0)  # let it ramp up
            times, stats = engine_asks(client, seconds, qs) if proc.poll() is None else ([1.0], {})
            late = newcomer(path, qs) if proc.poll() is None else {}
            counts = {}
            if attacker is not None:
                assert attacker.stdout is not None
                try:
                    line = attacker.communicate(timeout=30)[0].decode().strip().splitlines()
                    counts = json.loads(line[-1]) if line else {}
                except subprocess.TimeoutExpired:
                    attacker.kill()
            sampling.set()
            sampler.join()
            out[kind] = {"p50_ms": pct(times, 0.5), "p99_ms": pct(times, 0.99), "max_ms": max(times) * 1000,
                         "asks": len(times), "over_budget": sum(t * 1000 > BUDGET_MS for t in times),
                         "rss_before_mib": round(base, 1), "rss_growth_mib": round(peak[0] - base, 1),
                         "alive": proc.poll() is None, "client": stats, "attacker": counts, "newcomer": late}
            print(f"  {mode:<7} {kind:<10} p50 {out[kind]['p50_ms']:7.2f} ms  p99 {out[kind]['p99_ms']:7.2f} ms  "
                  f"over {BUDGET_MS:.0f} ms {out[kind]['over_budget']:5d}/{len(times):<6d} "
                  f"RSS +{out[kind]['rss_growth_mib']:.0f} MiB  alive {out[kind]['alive']}  newcomer {late}", flush=True)
            time.sleep(0.5)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="fixed", help=argparse.SUPPRESS)
    ap.add_argument("--idle", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--attack", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.mode, live=not args.idle)
        return
    if args.attack:
        attack(args.path, args.attack, args.seconds)
        return
    from benchmarks.bench_planner_live import queries, trace

    qs = queries(trace(), 400, random.Random(11))
    load = os.getloadavg()
    runs: list[dict] = []
    for r in range(args.runs):
        print(f"run {r + 1}/{args.runs}", flush=True)
        order = MODES if r % 2 == 0 else MODES[::-1]  # alternate which server goes first: drift hits both
        runs.append({mode: one_mode(mode, args.seconds, qs) for mode in order})
    crashes = {m: sum(not a["alive"] for run in runs for a in run[m].values()) for m in MODES}
    summary = {m: {k: {"p99_ms": statistics.median(run[m][k]["p99_ms"] for run in runs),
                       "rss_growth_mib": statistics.median(run[m][k]["rss_growth_mib"] for run in runs)}
                   for k in ATTACKS} for m in MODES}
    print(json.dumps(summary, indent=1))
    print(f"crashes: {crashes}; load average before {load}, after {os.getloadavg()}")
    if args.no_write:
        return
    command = f"python -m benchmarks.attack_sidecar --runs {args.runs} --seconds {args.seconds}"
    details = {"summary_medians": summary, "crashes": crashes, "budget_ms": BUDGET_MS, "runs": runs,
               "machine": f"{os.cpu_count()} CPUs shared with other engineers' jobs; load average {load} before, "
                          f"{os.getloadavg()} after",
               "goal": "combined: p99 <= 20 ms, RSS growth <= 64 MiB, 0 crashes"}
    p = write_result("attack_sidecar_ask_p99", "a well-behaved engine's ask round trip p99 under 200 slowloris "
                     "clients plus 65,536- and 16,384-key asks (512-key asks, sidecar applying live batches)", "ms",
                     [Run(run["fixed"]["combined"]["p99_ms"], run["prefix"]["combined"]["p99_ms"]) for run in runs],
                     "the pre-fix sidecar (main at 9c0cc94), same attack, same run", command, details=details)
    print(f"wrote {p}")
    p = write_result("attack_sidecar_rss_growth", "index sidecar resident memory growth under 200 slowloris clients "
                     "plus large asks (peak VmRSS minus before)", "MiB",
                     [Run(run["fixed"]["combined"]["rss_growth_mib"], run["prefix"]["combined"]["rss_growth_mib"])
                      for run in runs],
                     "the pre-fix sidecar (main at 9c0cc94), same attack, same run", command,
                     details={"per_attack_medians": {m: {k: v["rss_growth_mib"] for k, v in summary[m].items()}
                                                     for m in MODES}, "crashes": crashes})
    print(f"wrote {p}")


if __name__ == "__main__":
    main()
