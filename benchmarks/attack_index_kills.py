"""SIGKILL the index worker again and again while a trace streams through it; count what is lost.

The Mooncake conversation slice (``--requests``, 8 simulated workers, ~100k block operations at
the default) goes to ``nexuskv.kv-events`` in ``--kills + 1`` chunks. During each of the first
``--kills`` chunks the index worker process is SIGKILLed at a random moment (seeded) and started
again on the same data folder; its *recovery time* is the time from that restart until its
checkpoints cover every record produced before the kill. At the end the checkpoints, restored into
one index, and an index replica bootstrapped from them are compared with the reference (a
GlobalIndex fed the same batches): memberships *lost* (in the reference, not in ours) and
*phantom* (in ours, not in the reference).

Run: ``python -m benchmarks.attack_index_kills [--kills 10] [--requests 40] [--seed 13]``
(``NEXUSKV_BROKER`` to use a running broker; otherwise a local Apache Kafka is started).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import tempfile
import time
from pathlib import Path

from streams.replica import IndexReplica

from benchmarks._attack import (
    SECRET,
    checkpoints,
    encoded,
    end_offsets,
    lost_and_phantom,
    names,
    produce,
    reference,
    replay,
    restored,
    topics,
    wait_checkpointed,
    worker,
)
from benchmarks._attack_broker import attack_broker
from benchmarks._result import Run, write_result


async def run(url, *, kills: int, requests: int, seed: int, folder: Path) -> dict:
    rng = random.Random(seed)
    r, batches = replay(limit=requests)
    topic, group, dead = names()
    await topics(url, topic, dead)
    chunks = []
    step = -(-len(batches) // (kills + 1))
    for i in range(0, len(batches), step):
        chunks.append(batches[i:i + step])
    proc = worker(url, folder, topic, group, dead)
    recoveries, checkpointed_at_kill = [], []
    try:
        for i, chunk in enumerate(chunks):
            producing = asyncio.create_task(produce(url, topic, encoded(chunk)))
            if i >= kills:
                await producing
                break
            await asyncio.sleep(rng.uniform(0.0, 1.5))
            os.killpg(proc.pid, signal.SIGKILL)
            await producing
            ends = await end_offsets(url, topic)
            checkpointed_at_kill.append(sum(c.next_offset for c in checkpoints([folder], topic, group).values())
                                        / max(1, sum(ends.values())))
            proc.stop()
            restart = time.monotonic()
            proc = worker(url, folder, topic, group, dead)
            await wait_checkpointed([folder], topic, group, ends, [proc], timeout_s=300)
            recoveries.append(time.monotonic() - restart)
        ends = await end_offsets(url, topic)
        best = await wait_checkpointed([folder], topic, group, ends, [proc], timeout_s=300)
    finally:
        proc.stop()
    truth = reference(batches).facts()
    lost, phantom = lost_and_phantom(restored(best).facts(), truth)
    async with IndexReplica(url, secret=SECRET.encode(), topic=topic, checkpoint_dir=folder / "index" / group,
                            bus_secret=b"") as rep:
        await rep.wait_caught_up()
        rep_lost, rep_phantom = lost_and_phantom(rep.index.facts(), truth)
    return {"kills": kills, "batches": len(batches), "block_ops": r.block_ops,
            "memberships": sum(len(v) for v in truth.values()), "lost": lost, "phantom": phantom,
            "replica_lost": rep_lost, "replica_phantom": rep_phantom,
            "recovery_s": [round(x, 2) for x in recoveries],
            "recovery_median_s": round(statistics.median(recoveries), 2) if recoveries else None,
            "recovery_max_s": round(max(recoveries), 2) if recoveries else None,
            "checkpointed_share_at_kill": [round(x, 3) for x in checkpointed_at_kill]}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.attack_index_kills", description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--repeats", type=int, default=1,
                    help="attacks, each on fresh topics and folders; one run each (default 1: ten kills with their "
                         "recoveries take minutes)")
    ap.add_argument("--no-write", action="store_true", help="print only; do not write benchmarks/results")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    outs = []
    with attack_broker() as url:
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory(prefix="nexuskv-kills-") as tmp:
                outs.append(asyncio.run(run(url, kills=args.kills, requests=args.requests, seed=args.seed,
                                            folder=Path(tmp))))
    out = {**sorted(outs, key=lambda o: o["lost"] + o["phantom"])[len(outs) // 2], "load_average": os.getloadavg()}
    if len(outs) > 1:
        out["per_run"] = outs
    print(f"{out['kills']} SIGKILLs during {out['batches']} batches ({out['block_ops']} block operations, "
          f"{out['memberships']} memberships at the end): lost {out['lost']}, phantom {out['phantom']} "
          f"(replica: {out['replica_lost']}, {out['replica_phantom']}); recovery median {out['recovery_median_s']} s, "
          f"worst {out['recovery_max_s']} s")
    if not args.no_write:
        write_result("reliability_index_kills", "memberships lost + phantom after SIGKILLs of the index worker", "memberships", [Run(o["lost"] + o["phantom"], 0) for o in outs], "reference index (no kill)", f"python -m benchmarks.attack_index_kills --kills {args.kills} --requests {args.requests} "
                     f"--seed {args.seed}" + (f" --repeats {args.repeats}" if args.repeats != 1 else ""), details=out)


if __name__ == "__main__":
    main()
