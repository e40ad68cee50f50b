"""The remote tier (a real Mooncake Store, ``python -m streams.remote_tier``) attacked by a plain Mooncake
client and by a stalled or flooded transport: what NexusKV's backend acknowledges, how long its
calls take past their deadline, and whether its deletes get through. Each figure has its baseline
measured in the same run, on the same store: a client that does what NexusKV's backend did before
(trust Mooncake's put result; call Mooncake directly, with Mooncake's own timeouts; retry a
removal for a fixed 3 s while readers hold leases).

* ``reliability_remote_unreadable_acks`` — saves acknowledged that no read can serve: 32 payloads,
  16 of whose names a plain client filled first (garbage, another payload's header and bytes, the
  payload's header over other bytes), then saved by NexusKV's backend. Goal: 0.
* ``reliability_remote_deadline_overrun`` — the longest a call (a new client's set-up, put, get,
  exists, delete) outlived its deadline (``--deadline``, 3 s) while the process holding the store's
  bytes is stopped (SIGSTOP: every transfer stalls) and while 600 idle connections flood its
  transfer port. Goal: at most 1 s.
* ``reliability_remote_delete_starvation`` — deletes that gave up: 9 payloads read without pause by
  two readers (every read renews Mooncake's lease), each deleted once. Goal: 0.

Run: ``python -m benchmarks.attack_remote_tier --runs 3``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from nexuskv.dataplane import RemoteBackend
from nexuskv.dataplane.payload import HEADER_BYTES
from nexuskv.dataplane.remote_store import object_name
from nexuskv.errors import IntegrityError, ObjectConflictError, TierUnavailableError

from benchmarks._result import Run, write_result
from tests.dataplane.remote_stores import MIB, Store, listening_ports, payload, raw_client, raw_put

PAYLOADS = 32


def _trusting_put(raw, header, data) -> bool:
    """A save as NexusKV's backend made it before: Mooncake's put result taken as the answer."""
    head = np.frombuffer(header.pack(), dtype=np.uint8)
    rc = raw.batch_put_from_multi_buffers([object_name(header.key)], [[head.ctypes.data, data.data_ptr()]],
                                          [[HEADER_BYTES, header.nbytes]])[0]
    return rc == 0


def _readable(backend: RemoteBackend, header) -> bool:
    try:
        return backend.read_verified(header.key, torch.empty(header.nbytes, dtype=torch.uint8)) == header
    except (IntegrityError, TierUnavailableError):
        return False


def unreadable_acks(store: Store) -> tuple[int, int, dict]:
    """(NexusKV's unreadable acknowledged saves, the trusting client's, details)."""
    raw = raw_client(store.address)
    backend = RemoteBackend(store.address)
    counts = {}
    for who, base in (("nexuskv", 1000), ("trusting", 2000)):
        acked_unreadable = refused = 0
        for i in range(PAYLOADS):
            h, d = payload(base + i, MIB)
            if i % 2 == 0:  # squatted first by a plain client
                other_h, other_d = payload(base + 500 + i, MIB)
                blob = [bytes(HEADER_BYTES + MIB), other_h.pack() + other_d.numpy().tobytes(),
                        h.pack() + other_d.numpy().tobytes()][(i // 2) % 3]
                raw_put(raw, object_name(h.key), blob)
            if who == "nexuskv":
                try:
                    backend.put(h, d)
                    acked = True
                except ObjectConflictError:
                    acked, refused = False, refused + 1
            else:
                acked = _trusting_put(raw, h, d)
            if acked and not _readable(backend, h):
                acked_unreadable += 1
        counts[who] = {"acked_unreadable": acked_unreadable, "refused_with_reason": refused}
    raw.close()
    backend.close()
    return counts["nexuskv"]["acked_unreadable"], counts["trusting"]["acked_unreadable"], counts


def _timed(fn) -> float:
    t0 = time.monotonic()
    with contextlib.suppress(TierUnavailableError, IntegrityError, ObjectConflictError):
        fn()
    return time.monotonic() - t0


def _raw_timed(fn, cap_s: float) -> float:
    """How long a direct Mooncake call blocks its caller (waited for at most ``cap_s``)."""
    done = threading.Event()
    t0 = time.monotonic()

    def run() -> None:
        with contextlib.suppress(Exception):
            fn()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    done.wait(cap_s)
    return time.monotonic() - t0


def deadline_overrun(store: Store, deadline_s: float, cap_s: float) -> tuple[float, float, dict]:
    """(NexusKV's worst overrun past ``deadline_s``, a direct Mooncake client's, details)."""
    backend = RemoteBackend(store.address, timeout_s=deadline_s)
    raw = raw_client(store.address)
    h, d = payload(1, MIB)
    backend.put(h, d)
    master = min(store.pids())
    segment = [p for p in store.pids() if p != master]
    ours: dict[str, float] = {}
    theirs: dict[str, float] = {}

    def calls(tag: str) -> None:
        h2, d2 = payload(2 + len(ours), MIB)
        ours[f"{tag} put"] = _timed(lambda: backend.put(h2, d2))
        ours[f"{tag} get"] = _timed(lambda: backend.read_into(h.key, torch.empty(MIB, dtype=torch.uint8)))
        ours[f"{tag} exists"] = _timed(lambda: backend.headers([h.key]))
        ours[f"{tag} delete"] = _timed(lambda: backend.delete(h2.key))
        ours[f"{tag} new client"] = _timed(lambda: RemoteBackend(store.address, timeout_s=deadline_s).close())
        h3, d3 = payload(900 + len(theirs), MIB)
        theirs[f"{tag} put"] = _raw_timed(lambda: _trusting_put(raw, h3, d3), cap_s)
        theirs[f"{tag} get"] = _raw_timed(lambda: raw.get_size(object_name(h.key)) and raw.batch_get_into_multi_buffers(
            [object_name(h.key)], [[torch.empty(HEADER_BYTES + MIB, dtype=torch.uint8).data_ptr()]],
            [[HEADER_BYTES + MIB]]), cap_s)

    for pid in segment:
        os.kill(pid, signal.SIGSTOP)
    try:
        calls("stalled")
    finally:
        for pid in segment:
            os.kill(pid, signal.SIGCONT)
    time.sleep(2)
    ports = sorted({p for pid in segment for p in listening_ports(pid)})
    socks = []
    try:
        for port in ports:
            for _ in range(600 // max(1, len(ports))):
                with contextlib.suppress(OSError):
                    socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        calls("flooded")
    finally:
        for s in socks:
            s.close()
    details = {"deadline_s": deadline_s, "nexuskv_s": ours, "direct_mooncake_s": theirs,
               "flood_connections": len(socks), "counters": backend.counters()}
    raw.close()
    with contextlib.suppress(TierUnavailableError):
        backend.close()
    worst = max(0.0, max(ours.values()) - deadline_s)
    worst_raw = max(0.0, max(theirs.values()) - deadline_s)
    return worst, worst_raw, details


def delete_starvation(store: Store, readers_n: int = 2, deletes: int = 9) -> tuple[int, int, dict]:
    """(NexusKV's deletes that gave up, a 3 s fixed-retry removal's, details)."""
    backend = RemoteBackend(store.address, delete_wait_s=1.0)
    raw = raw_client(store.address)
    out: dict[str, dict] = {}
    for who in ("nexuskv", "fixed-retry"):
        base = 3000 if who == "nexuskv" else 4000
        payloads = [payload(base + i, MIB) for i in range(deletes)]
        for h, d in payloads:
            backend.put(h, d)
        stop = threading.Event()
        clients = [RemoteBackend(store.address) for _ in range(readers_n)]

        def read(client: RemoteBackend) -> None:
            buf = torch.empty(MIB, dtype=torch.uint8)
            while not stop.is_set():
                for h, _ in payloads:
                    with contextlib.suppress(IntegrityError, TierUnavailableError):
                        client.read_into(h.key, buf)

        threads = [threading.Thread(target=read, args=(c,), daemon=True) for c in clients]
        for t in threads:
            t.start()
        time.sleep(0.3)
        gave_up, took = 0, []
        for h, _ in payloads:
            t0 = time.monotonic()
            if who == "nexuskv":
                try:
                    ok = backend.delete(h.key)
                except TierUnavailableError:
                    ok = False
            else:
                ok = False
                while time.monotonic() - t0 < 3.0:
                    if raw.remove(object_name(h.key)) == 0:
                        ok = True
                        break
                    time.sleep(0.02)
            took.append(time.monotonic() - t0)
            gave_up += 0 if ok else 1
        stop.set()
        for t in threads:
            t.join(30)
        for c in clients:
            c.close()
        for h, _ in payloads:
            with contextlib.suppress(TierUnavailableError):
                backend.delete(h.key)
        out[who] = {"gave_up": gave_up, "max_s": max(took), "median_s": statistics.median(took)}
    out["counters"] = backend.counters()
    raw.close()
    backend.close()
    return out["nexuskv"]["gave_up"], out["fixed-retry"]["gave_up"], out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=3.0)
    ap.add_argument("--cap", type=float, default=90.0, help="longest a direct Mooncake call is waited for")
    args = ap.parse_args()
    acks, overruns, starved = [], [], []
    details: dict[str, list] = {"unreadable_acks": [], "deadline_overrun": [], "delete_starvation": []}
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="attack-remote-") as tmp:
            store = Store(Path(tmp), 256 * MIB)
            try:
                a, b, d = unreadable_acks(store)
                acks.append(Run(a, b))
                details["unreadable_acks"].append(d)
                a, b, d = delete_starvation(store)
                starved.append(Run(a, b))
                details["delete_starvation"].append(d)
                a, b, d = deadline_overrun(store, args.deadline, args.cap)
                overruns.append(Run(a, b))
                details["deadline_overrun"].append(d)
            finally:
                store.stop()
        print(f"run {i + 1}/{args.runs}: unreadable acks {acks[-1]}, deletes gave up {starved[-1]}, "
              f"worst overrun {overruns[-1]}", flush=True)
    command = f"python -m benchmarks.attack_remote_tier --runs {args.runs} --deadline {args.deadline} --cap {args.cap}"
    write_result("reliability_remote_unreadable_acks", "remote-tier saves acknowledged that no read can serve "
                 f"({PAYLOADS} saves, half of the names squatted by a plain Mooncake client)", "saves", acks,
                 "a client trusting Mooncake's put result (NexusKV before), same run, same store", command,
                 details={"runs": details["unreadable_acks"]})
    write_result("reliability_remote_deadline_overrun", "longest a remote-tier call outlived its "
                 f"{args.deadline:.0f} s deadline (store's transfer stalled; its transfer port flooded)", "s",
                 overruns, f"direct Mooncake calls (its own timeouts, waited up to {args.cap:.0f} s), same run", command,
                 details={"runs": details["deadline_overrun"]})
    write_result("reliability_remote_delete_starvation", "remote-tier deletes that gave up under two nonstop "
                 "readers (9 deletes)", "deletes", starved, "removal retried for a fixed 3 s (NexusKV before), "
                 "same run", command, details={"runs": details["delete_starvation"]})


if __name__ == "__main__":
    main()
