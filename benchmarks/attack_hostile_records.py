"""Hostile records into the index worker, among a genuine (signed) stream: none may crash it, each
must be dead-lettered once with its reason, and the genuine facts must come out exact.

Ten kinds, ``--records`` in all (1,000 each at the default 10,000), interleaved with the genuine
batches of 8 simulated workers (signed with ``NEXUSKV_BUS_SECRET``, which the worker is given):
truncated, wrong field type, unknown event tag, oversized event, unknown schema version (the
malformed five, signed by the victim's key: a publisher gone wrong), a spoofed unsigned clear carrying the victim's next sequence number, a clear
signed with another publisher's key, a genuine record replayed onto another partition, a batch
under a record key that is not its publisher, and the victim's own key signing sequence number
2**62 (refused by the bounded jump). The figure is the time from the first record sent to the
last dead letter acknowledged, with the worker already running; ``--malformed-only`` sends only
the first five kinds and no signatures (the comparison with commit 30ffd34, whose worker awaited
each dead letter on its own).

Run: ``python -m benchmarks.attack_hostile_records [--records 10000] [--malformed-only]``
(``NEXUSKV_BROKER`` to use a running broker; otherwise a local Apache Kafka is started).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import tempfile
import time
from pathlib import Path

import msgpack

from benchmarks._attack import (
    PARTITIONS,
    checkpoints,
    dead_letters,
    encoded,
    end_offsets,
    home,
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

BUS = "hostile-records-bus-secret"
KINDS = ("truncated", "wrong type", "unknown tag", "oversized", "schema version", "spoofed clear",
         "another publisher's key", "misfiled partition", "key is not the publisher", "absurd sequence")


def _hostile(kind: str, template: bytes, victim: str, victim_seq: int, signer, mallory) -> tuple:
    doc = msgpack.unpackb(template, raw=False)
    key = victim.encode()

    def signed(value: bytes) -> tuple:  # the malformed kinds come from an authenticated publisher gone wrong
        return key, value, None, ([signer.header(victim, key, value)] if signer is not None else None)

    if kind == "truncated":
        return signed(template[: max(1, len(template) // 3)])
    if kind == "wrong type":
        doc["seq"] = "seven"
    elif kind == "unknown tag":
        doc["events"] = [{"type": "exploded", "engine_hashes": [1]}]
    elif kind == "oversized":
        doc["events"] = [{"type": "removed", "engine_hashes": list(range(5000))}]
    elif kind == "schema version":
        doc["schema_version"] = 2
    elif kind in ("spoofed clear", "another publisher's key"):
        doc.update(publisher=victim, seq=victim_seq, events=[{"type": "cleared"}])
        value = msgpack.packb(doc, use_bin_type=True)
        header = mallory.header(victim, key, value) if kind != "spoofed clear" else None
        return key, value, None, [header] if header else None
    elif kind == "misfiled partition":
        value = template
        header = signer.header(doc["publisher"], doc["publisher"].encode(), value)
        return doc["publisher"].encode(), value, (home(doc["publisher"]) + 1) % PARTITIONS, [header]
    elif kind == "key is not the publisher":
        other = f"{doc['publisher']}-imposter"
        header = signer.header(other, other.encode(), template)
        return other.encode(), template, None, [header]
    elif kind == "absurd sequence":
        doc.update(publisher=victim, seq=2 ** 62, events=[{"type": "cleared"}])
        value = msgpack.packb(doc, use_bin_type=True)
        return key, value, None, [signer.header(victim, key, value)]
    return signed(msgpack.packb(doc, use_bin_type=True))


async def run(url, *, records: int, malformed_only: bool, folder: Path) -> dict:
    r, batches = replay(limit=60)
    kinds = KINDS[:5] if malformed_only else KINDS
    victim = sorted({b.publisher for b in batches})[-1]
    signer = mallory = None
    if not malformed_only:
        from nexuskv.contracts.kv_signature import publisher_key
        from streams.bus.clients import BatchSigner

        signer = BatchSigner(bus_secret=BUS.encode())
        mallory = BatchSigner(keys={victim: publisher_key(BUS.encode(), "mallory")})
    genuine = encoded(batches, signer)
    # Hostile records are built from small batches (one event of 16 blocks), as an attacker sends
    # many of them: the genuine batches here are ~100 KB each.
    small = [b.model_copy(update={"events": (_first_blocks(b.events[0]),)}) for b in batches[:8]]
    templates = [item[1] for item in encoded(small)]
    victim_seq = sum(1 for b in batches if b.publisher == victim)  # the next seq after the whole stream
    items, expected = [], collections.Counter()
    for i in range(records):
        kind = kinds[i % len(kinds)]
        items.append(_hostile(kind, templates[i % len(templates)], victim, victim_seq, signer, mallory))
        expected[kind] += 1
        if i % max(1, records // len(genuine)) == 0 and genuine:
            items.append(genuine.pop(0))
    items.extend(genuine)
    hostile_bytes = sum(len(item[1]) for item in items) - sum(len(v) for _k, v, *_ in encoded(batches))
    topic, group, dead = names()
    await topics(url, topic, dead)
    proc = worker(url, folder, topic, group, dead, bus_secret=None if malformed_only else BUS)
    try:
        await produce(url, topic, encoded(batches[:1], signer))  # the worker has its partitions before the clock starts
        await wait_checkpointed([folder], topic, group, await end_offsets(url, topic), [proc])
        began = time.monotonic()
        await produce(url, topic, items)
        letters = await dead_letters(url, dead, records, timeout_s=600)
        elapsed = time.monotonic() - began
        best = await wait_checkpointed([folder], topic, group, await end_offsets(url, topic), [proc], timeout_s=300)
        alive = proc.alive()
    finally:
        proc.stop()
    truth = reference(batches).facts()
    index = restored(best)
    lost, phantom = lost_and_phantom(index.facts(), truth)
    reasons = collections.Counter(_reason_class(le.reason) for le in letters)
    return {"records": records, "kinds": dict(expected), "genuine_batches": len(batches), "worker_alive": alive,
            "dead_lettered": len(letters), "distinct_offsets": len({(le.partition, le.offset) for le in letters}),
            "reasons": dict(reasons), "seconds": round(elapsed, 2), "hostile_mb": round(hostile_bytes / 1e6, 1),
            "dead_letter_mb": round(sum(len(le.model_dump_json()) for le in letters) / 1e6, 1), "lost": lost, "phantom": phantom,
            "checkpointed_partitions": len(checkpoints([folder], topic, group)),
            "victim_certain": bool(index.publisher_status(victim) and index.publisher_status(victim).certain)}


def _first_blocks(event, n: int = 16):
    from nexuskv.contracts.kv_events import BlockStored

    if not isinstance(event, BlockStored) or len(event.engine_hashes) <= n:
        return event
    tokens = event.token_ids[: n * event.block_size] if event.token_ids else ()
    return event.model_copy(update={"engine_hashes": event.engine_hashes[:n], "token_ids": tokens})


def _reason_class(reason: str) -> str:
    for word, name in (("unauthenticated", "unauthenticated"), ("belongs on partition", "misfiled partition"),
                       ("keyed by its batch's publisher", "key is not the publisher"), ("refused", "refused jump"),
                       ("schema_version", "schema version"), ("undecodable", "undecodable"), ("tag", "unknown tag"),
                       ("at most 4096", "oversized"), ("seq", "wrong type")):
        if word in reason:
            return name
    return "other"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.attack_hostile_records", description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=10_000)
    ap.add_argument("--malformed-only", action="store_true")
    ap.add_argument("--repeats", "--runs", dest="runs", type=int, default=3,
                    help="attacks on fresh topics of one broker; one run each, the figure the median (default 3)")
    ap.add_argument("--baseline-seconds", type=float, default=0.0,
                    help="the same attack's seconds on commit 30ffd34 (--malformed-only), for the result file: "
                         "the baseline of every run, given, not measured here")
    ap.add_argument("--no-write", action="store_true")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    runs = []
    with attack_broker() as url:
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="nexuskv-hostile-") as tmp:
                runs.append(asyncio.run(run(url, records=args.records, malformed_only=args.malformed_only,
                                            folder=Path(tmp))))
    out = sorted(runs, key=lambda o: o["seconds"])[len(runs) // 2]
    out["runs_s"] = [o["seconds"] for o in runs]
    out["load_average"] = os.getloadavg()
    print(f"{out['records']} hostile records among {out['genuine_batches']} genuine batches: worker alive "
          f"{out['worker_alive']}, dead-lettered {out['dead_lettered']} ({out['distinct_offsets']} distinct) in "
          f"{out['seconds']} s ({out['hostile_mb']} MB hostile, {out['dead_letter_mb']} MB of dead letters); genuine facts lost {out['lost']}, phantom {out['phantom']}; reasons {out['reasons']}")
    if not args.no_write:
        name = "reliability_dead_letters_malformed" if args.malformed_only else "reliability_hostile_records"
        baseline = ("commit 30ffd34 (one awaited send per dead letter), malformed only"
                    if args.malformed_only else
                    "none: commit 30ffd34 checks no signature, partition or key (compare --malformed-only)")
        write_result(name, f"seconds to dead-letter {args.records} hostile kv-events records", "s", [Run(o["seconds"], args.baseline_seconds if args.malformed_only else 0.0) for o in runs], baseline, "python -m benchmarks.attack_hostile_records --records "
                     f"{args.records} --runs {args.runs}{' --malformed-only' if args.malformed_only else ''}"
                     + (f" --baseline-seconds {args.baseline_seconds:g}" if args.malformed_only else ""),
                     details={**out, **({"baseline_source": "given with --baseline-seconds (commit 30ffd34's run of "
                                         "the same attack), not measured in this run"} if args.malformed_only else {})})


if __name__ == "__main__":
    main()
