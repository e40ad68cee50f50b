"""The KV-event bridge keeping up: a 10k-batch replay from SGLang's own publisher to Apache Kafka.

Each run, per arm, uses a fresh SGLang 0.5.23 ``ZmqEventPublisher`` in a process of its own, as an
engine's is (loopback TCP, its replay
buffer of 10,000 batches) that publishes ``--batches`` - 1 engine batches (one to four stored pages
of ``--page`` tokens each, sometimes a removal) before any bridge listens: ZMQ drops them live,
SGLang buffers them. A :class:`~streams.bridge.EventBridge` then starts on that engine, and one more
batch is published: the bridge sees a first batch at ``seq = batches - 1``, fetches the whole history
through SGLang's ROUTER (``connectors.zmq_events``: rounds of replay, SGLang drops what exceeds
its send high-water mark) and forwards every batch to ``nexuskv.kv-events`` on the broker.

The figure is batches acknowledged by the broker per second, from the trigger batch to the
acknowledgement of the last one: the repair of a ``--batches`` gap, end to end. Arms, same run:

* pipelined: the bridge's window of ``--window`` records in flight, the idempotent producer;
* baseline: ``window=1``, the former send (each batch's acknowledgement awaited before the next
  is sent), with the same idempotent producer. It is stopped after ``--baseline-max-s`` seconds
  when it has not finished; its rate is then what it forwarded in that time (said in details).

After each pipelined arm the records are read back from Kafka and checked: every batch once,
in order. Broker: ``NEXUSKV_BROKER`` when set, else a local Apache Kafka started for the run.
``--mode live`` instead starts the bridge first and has the publisher send the batches back to
back: the bridge's sustained rate on live traffic (one batch per ZMQ message, no replay rounds).

Writes ``benchmarks/results/bridge_<mode>_batches_per_s.json``.

Run: ``python -m benchmarks.bench_bridge [--mode replay|live] [--batches 10000] [--runs 3] [--window 256]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._attack_broker import attack_broker
from benchmarks._result import Run, write_result
from tests.connectors.sglang_real.events import Line

# The engine: SGLang's publisher in a process of its own (as in a deployment: no GIL shared with the
# bridge). stdin: "prepare N" builds N batches, "go" publishes them, "quit" shuts the publisher down.
_ENGINE = r"""
import random, sys, time
from sglang.srt.disaggregation import kv_events as kv
port, replay, topic, page, seed = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
publisher = kv.ZmqEventPublisher(0, endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay}",
                                 topic=topic, bind=True)
rng = random.Random(seed)
def batch():
    hashes = [rng.randrange(0, 1 << 63) for _ in range(rng.randint(1, 4))]
    events = [kv.BlockStored(block_hashes=hashes, parent_block_hash=None, block_size=page, lora_id=None, medium="GPU",
                             token_ids=[rng.randrange(1, 150_000) for _ in range(page * len(hashes))])]
    if rng.random() < 0.2:
        events.append(kv.BlockRemoved(block_hashes=[rng.randrange(0, 1 << 63)], medium="GPU"))
    return events
ready = []
print("up", flush=True)
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "prepare":
        ready = [batch() for _ in range(int(cmd[1]))]
        print("ready", flush=True)
    elif cmd[0] == "go":
        for events in ready:
            publisher.publish(kv.KVEventBatch(ts=time.time(), events=events))
        while not publisher._event_queue.empty():
            time.sleep(0.01)
        print("sent", flush=True)
    elif cmd[0] == "quit":
        break
publisher.shutdown()
"""


class _Engine:
    """SGLang 0.5.23's ZmqEventPublisher in a child process, bound on the line's ports."""

    def __init__(self, line: Line, page: int, seed: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _ENGINE, str(line.port), str(line.replay_port), line.topic,
                                      str(page), str(seed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._expect("up")

    def _expect(self, word: str) -> None:
        got = self.proc.stdout.readline().strip()
        if got != word:
            raise RuntimeError(f"the engine process said {got!r}, not {word!r} (exit {self.proc.poll()})")

    async def command(self, cmd: str, reply: str) -> None:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        await asyncio.to_thread(self._expect, reply)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


async def _arm(url, folder: Path, *, mode: str, batches: int, page: int, window: int, max_s: float, seed: int,
               verify: bool) -> dict:
    """One arm: ``replay``: publish the history, start the bridge, time the repair; ``live``: start the
    bridge, publish the batches back to back, time their forwarding. Returns its figures."""
    line = Line(url, folder, page=page, window=window)
    engine = _Engine(line, page, seed)
    try:
        if mode == "replay":
            await engine.command(f"prepare {batches - 1}", "ready")  # the history; with the trigger, ``batches``
            await engine.command("go", "sent")  # fill SGLang's buffer
            await asyncio.sleep(0.5)
        await engine.command(f"prepare {1 if mode == 'replay' else batches}", "ready")
        await line.start_bridge()
        await asyncio.sleep(0.5)  # the SUB connection settles
        start = time.perf_counter()
        await engine.command("go", "sent")
        total = batches
        deadline = start + max_s
        while line.bridge.stats["forwarded"] < total and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        elapsed = time.perf_counter() - start
        forwarded = line.bridge.stats["forwarded"]
        finished = forwarded >= total
        out = {"window": window, "forwarded": forwarded, "finished": finished, "elapsed_s": round(elapsed, 3),
               "batches_per_s": forwarded / elapsed, "subscriber": dict(line.subscriber.stats),
               "window_stats": dict(line.bridge.window_stats)}
        await line.stop_bridge()
        if verify and finished:
            received = await line.read(total, timeout=120)
            seqs = [b.seq for b in received]
            if seqs != list(range(total)):
                raise AssertionError(f"window {window}: Kafka holds {len(seqs)} batches, not 0..{total - 1} in order")
            out["verified_in_order"] = total
        return out
    finally:
        engine.close()
        await line.close()


async def _main(args: argparse.Namespace) -> None:
    name = f"bridge_{args.mode}_batches_per_s"
    with attack_broker() as url, tempfile.TemporaryDirectory(prefix="bench-bridge-") as tmp:
        runs, arms = [], []
        for r in range(args.runs):
            folder = Path(tmp) / f"run{r}"
            folder.mkdir()
            piped = await _arm(url, folder, mode=args.mode, batches=args.batches, page=args.page, window=args.window,
                               max_s=args.max_s, seed=r, verify=True)
            base = await _arm(url, folder, mode=args.mode, batches=args.batches, page=args.page, window=1,
                              max_s=args.baseline_max_s, seed=r, verify=False)
            print(f"run {r}: pipelined {piped['batches_per_s']:.0f} batches/s ({piped['elapsed_s']:.2f} s for "
                  f"{piped['forwarded']}), window=1 {base['batches_per_s']:.0f} batches/s "
                  f"({base['forwarded']} in {base['elapsed_s']:.1f} s{'' if base['finished'] else ', stopped'}); "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
            runs.append(Run(piped["batches_per_s"], base["batches_per_s"]))
            arms.append({"pipelined": piped, "window_1": base, "load_average_1m": os.getloadavg()[0]})
        load = os.getloadavg()
        details = {
            "mode": args.mode, "batches": args.batches, "page_tokens": args.page, "window": args.window,
            "seconds_pipelined_median": statistics.median(a["pipelined"]["elapsed_s"] for a in arms),
            "seconds_pipelined_max": max(a["pipelined"]["elapsed_s"] for a in arms),
            "baseline_finished": [a["window_1"]["finished"] for a in arms],
            "baseline_max_s": args.baseline_max_s,
            "broker": "NEXUSKV_BROKER" if os.environ.get("NEXUSKV_BROKER") else "local Apache Kafka (streams.bus.broker)",
            "publisher": "SGLang 0.5.23 ZmqEventPublisher, loopback TCP",
            "machine": f"{os.cpu_count()} cores, load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} at the end "
                       "(shared with other engineers' work)",
            "arms": arms,
        }
        what = (f"a {args.batches}-batch replay (gap repair) from SGLang's publisher" if args.mode == "replay"
                else f"{args.batches} batches published back to back by SGLang's publisher")
        path = write_result(name, f"batches/s through the bridge to Kafka, {what}", "batches/s", runs,
                            "window=1 (each acknowledgement awaited, the previous send)",
                            f"python -m benchmarks.bench_bridge --mode {args.mode} --batches {args.batches} "
                            f"--runs {args.runs} --window {args.window} --page {args.page} "
                            f"--baseline-max-s {args.baseline_max_s:g}", details)
        print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["replay", "live"], default="replay")
    ap.add_argument("--batches", type=int, default=10_000, help="batches (a replay: SGLang buffers 10,000)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--max-s", type=float, default=300.0, help="give up on the pipelined arm after this long")
    ap.add_argument("--baseline-max-s", type=float, default=60.0)
    asyncio.run(_main(ap.parse_args()))


if __name__ == "__main__":
    main()
