"""Copy bandwidth per tier pair: the transfer executor against a plain copy of the same bytes.

For each pair (``disk->host``, ``host->disk``, ``host->device``, ``device->host``, ``host->remote``,
``remote->host``) and each transfer unit (payload size), the source tier is stocked with
``--mib`` MiB of random payloads, then, interleaved in the same run:

* **ours** — one ``TransferCommand`` for all of them, run by ``TransferExecutor.execute``
  (``--lanes`` copy threads): resolve backends by capability, read each payload into the buffer
  it is stored in, verify its XXH3-128 checksum, commit it; the destination is emptied again
  between passes (not timed);
* **plain** — the same bytes moved the plainest way between the same places: ``Tensor.copy_``
  into preallocated tensors (memory tiers), ``readinto`` of the same payload files into a
  preallocated buffer / ``write`` of new files (disk), and for the remote tier the store's own
  client at its plainest: Mooncake's ``put_from`` / ``get_into`` of the same bytes from and into
  preallocated tensors (no NexusKV header, checksum or executor). No checksum.

The remote tier is a Mooncake Store started as ``nexuskv up`` starts it (``python -m
streams.remote_tier``: its master and a memory segment, over Mooncake's TCP transport).

Prints GB/s medians of ``--repeats`` passes and their ratio per pair and unit, and writes
``benchmarks/results/copy_SRC_DST.json`` (value: ours at ``--headline`` unit; baseline: plain;
details: every unit). Without CUDA the device tier is the host-memory stand-in, and the figures
say so: no GPU figure is measured here.
Run: ``python -m benchmarks.bench_copy [--mib 64] [--units 65536,2097152] [--repeats 5] [--lanes 2]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from nexuskv.contracts.transfers import TransferCommand, TransferStatus
from nexuskv.dataplane import (
    BackendCatalog,
    DeviceMemoryBackend,
    DiskBackend,
    HostMemoryBackend,
    PayloadHeader,
    PayloadKey,
    RemoteBackend,
    TransferExecutor,
    cuda_available,
)
from nexuskv.dataplane.backend import host_view
from nexuskv.dataplane.payload import HEADER_BYTES
from nexuskv.dataplane.remote_store import parse_store_address
from nexuskv.descriptor import Tier
from nexuskv.entries import EntryLocation
from nexuskv.errors import TierUnavailableError
from streams.bus.process import ManagedProcess
from streams.remote_tier import local_address

from benchmarks._result import Run, write_result

PAIRS = [("disk", "host"), ("host", "disk"), ("host", "device"), ("device", "host"), ("host", "remote"),
         ("remote", "host")]
DEFAULT_PAIRS = ",".join(f"{s}-{d}" for s, d in PAIRS)
TIERS = {"device": Tier.GPU, "host": Tier.HOST, "disk": Tier.DISK, "remote": Tier.REMOTE}
DID = "sd1-" + "b" * 32
WORKER = "bench"


class Rig:
    """Every tier, the remote tier's store, a plain client of that store, and an executor over them."""

    def __init__(self, mib: int, lanes: int, work: Path) -> None:
        cap = (mib << 20) * 3
        self.work = work
        self.procs: list[ManagedProcess] = []
        remote_addr = local_address()
        # Room for the stocked payloads, a pass of ours and a pass of the plain client, with headers.
        self._spawn([sys.executable, "-m", "streams.remote_tier", "--listen", remote_addr], "remote-tier",
                    env={"NEXUSKV_REMOTE_TIER_BYTES": str(cap + (mib << 20) * 2), "NEXUSKV_DATA_DIR": str(work)},
                    port=parse_store_address(remote_addr).port)
        self.backends = {
            "device": DeviceMemoryBackend(cap),
            "host": HostMemoryBackend(cap),
            "disk": DiskBackend(work / "disk", cap),
            "remote": _connect(remote_addr),
        }
        self.executor = TransferExecutor(BackendCatalog(WORKER, self.backends.values()), lanes=lanes)
        from mooncake.store import MooncakeDistributedStore

        self.plain_store = MooncakeDistributedStore()
        if self.plain_store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "",
                                  parse_store_address(remote_addr).master) != 0:
            raise RuntimeError("the plain Mooncake client could not join the store")

    def _spawn(self, argv: list[str], name: str, env: dict[str, str] | None = None, *, port: int) -> None:
        proc = ManagedProcess(argv, name=name, log_path=self.work / f"{name}.log", env=dict(os.environ, **(env or {})))
        proc.start()
        self.procs.append(proc)
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline or not proc.alive():
                    raise RuntimeError(f"{name} did not start: {proc.log_tail()}") from None
                time.sleep(0.1)

    def close(self) -> None:
        self.executor.close()
        self.plain_store.close()
        for b in self.backends.values():
            b.close()
        for p in self.procs:
            p.stop()


def _connect(address: str) -> RemoteBackend:
    deadline = time.monotonic() + 60
    while True:
        try:
            return RemoteBackend(address)
        except TierUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _stock(backend, unit: int, count: int, base: int) -> tuple[list[int], list[torch.Tensor]]:
    keys, data = [], []
    gen = torch.Generator().manual_seed(unit)
    for i in range(count):
        t = torch.randint(0, 256, (unit,), dtype=torch.uint8, generator=gen)
        key = base + i
        backend.put(PayloadHeader.for_data(PayloadKey(DID, key), host_view(t)), t)
        keys.append(key)
        data.append(t)
    return keys, data


def _ours(rig: Rig, src: str, dst: str, keys: list[int], unit: int) -> float:
    now = time.time()
    cmd = TransferCommand(transfer_id=f"bench-{src}-{dst}-{now}", request_id="bench", descriptor_id=DID,
                          tenant_namespace="bench", keys=tuple(keys),
                          source=EntryLocation(worker=WORKER, tier=TIERS[src]),
                          destination=EntryLocation(worker=WORKER, tier=TIERS[dst]),
                          bytes=len(keys) * unit, issued_at=now, deadline_at=now + 600)
    t0 = time.perf_counter()
    outcome = rig.executor.execute(cmd)
    elapsed = time.perf_counter() - t0
    if outcome.status is not TransferStatus.COMPLETED:
        raise RuntimeError(f"{src}->{dst}: {outcome.status.value}: {outcome.result.error}")
    target = rig.backends[dst]
    for k in keys:
        target.delete(PayloadKey(DID, k))
    return len(keys) * unit / elapsed / 1e9


class Plain:
    """The plain copies of one (pair, unit) cell, with their preallocated buffers."""

    def __init__(self, rig: Rig, src: str, dst: str, keys: list[int], data: list[torch.Tensor], unit: int) -> None:
        self.rig, self.src, self.dst, self.keys, self.unit = rig, src, dst, keys, unit
        device = torch.device(rig.backends["device"].capabilities.device)
        pin = cuda_available()
        self.src_tensors = [d.to(device) if src == "device" else (d.pin_memory() if pin else d.clone()) for d in data]
        self.dst_tensors = [torch.empty(unit, dtype=torch.uint8, device=device if dst == "device" else "cpu",
                                        pin_memory=pin and dst != "device") for _ in data]
        for t in self.dst_tensors:
            t.fill_(0)
        self.files = [rig.backends["disk"].path(PayloadKey(DID, k)) for k in keys]
        self.out_dir = rig.work / "plain"
        if src == "remote":  # the plain client reads its own copies of the same bytes
            for i, t in enumerate(self.src_tensors):
                rig.plain_store.remove(f"plain/{i}", True)
                if rig.plain_store.put_from(f"plain/{i}", t.data_ptr(), unit) != 0:
                    raise RuntimeError("the plain Mooncake client could not stock the store")

    def run(self) -> float:
        t0 = time.perf_counter()
        if self.src == "disk":
            for path, out in zip(self.files, self.dst_tensors):
                with open(path, "rb", buffering=0) as fh:
                    fh.seek(HEADER_BYTES)
                    fh.readinto(host_view(out))
        elif self.dst == "disk":
            self.out_dir.mkdir(exist_ok=True)
            for i, t in enumerate(self.src_tensors):
                with open(self.out_dir / f"{i}.bin", "wb", buffering=0) as fh:
                    fh.write(host_view(t))
        elif self.dst == "remote":
            for i, t in enumerate(self.src_tensors):
                if self.rig.plain_store.put_from(f"plain/{i}", t.data_ptr(), self.unit) != 0:
                    raise RuntimeError("plain put_from failed")
        elif self.src == "remote":
            for i, out in enumerate(self.dst_tensors):
                if self.rig.plain_store.get_into(f"plain/{i}", out.data_ptr(), self.unit) != self.unit:
                    raise RuntimeError("plain get_into failed")
        else:
            for s, d in zip(self.src_tensors, self.dst_tensors):
                d.copy_(s, non_blocking=True)
            if cuda_available():
                torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        if self.dst == "disk":
            shutil.rmtree(self.out_dir)
        if self.dst == "remote":
            self.rig.plain_store.remove_by_regex("^plain/", True)
        return len(self.keys) * self.unit / elapsed / 1e9


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_copy", description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="MiB moved per pass (default 64)")
    ap.add_argument("--units", default="65536,2097152", help="transfer units (payload sizes) in bytes")
    ap.add_argument("--headline", type=int, default=2097152, help="the unit whose figure goes in the result file")
    ap.add_argument("--repeats", type=int, default=5,
                    help="repeats per pair and unit, each one pass of ours then the plain copy; one run each (default 5)")
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--pairs", default=DEFAULT_PAIRS)
    ap.add_argument("--no-write", action="store_true")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    units = [int(u) for u in args.units.split(",")]
    pairs = [tuple(p.split("-")) for p in args.pairs.split(",")]
    work = Path(tempfile.mkdtemp(prefix="nexuskv-bench-copy-"))
    rig = Rig(args.mib, args.lanes, work)
    device_note = rig.backends["device"].capabilities.note or rig.backends["device"].capabilities.device
    print(f"device tier: {device_note}; lanes={args.lanes}; {args.mib} MiB per pass; medians of {args.repeats}")
    print(f"{'pair':<14}{'unit':>10}{'ours GB/s':>11}{'plain GB/s':>12}{'ratio':>8}")
    cells: dict[tuple[str, str], dict[int, dict]] = {}
    try:
        for u_index, unit in enumerate(units):
            count = max(1, (args.mib << 20) // unit)
            stocks = {}
            for t_index, tier in enumerate(sorted({s for s, _ in pairs})):
                stocks[tier] = _stock(rig.backends[tier], unit, count, base=1_000_000 * (10 * u_index + t_index + 1))
            for src, dst in pairs:
                keys, data = stocks[src]
                plain = Plain(rig, src, dst, keys, data, unit)
                _ours(rig, src, dst, keys, unit), plain.run()  # warm-up: pools, page cache, sockets
                ours_runs, plain_runs = [], []
                for _ in range(args.repeats):
                    ours_runs.append(_ours(rig, src, dst, keys, unit))
                    plain_runs.append(plain.run())
                o, p = statistics.median(ours_runs), statistics.median(plain_runs)
                cells.setdefault((src, dst), {})[unit] = {"ours": o, "plain": p, "ratio": o / p,
                                                          "ours_runs": ours_runs, "plain_runs": plain_runs}
                print(f"{src + '->' + dst:<14}{unit:>10}{o:>11.2f}{p:>12.2f}{o / p:>8.2f}", flush=True)
            for tier in stocks:
                rig.backends[tier].clear()
    finally:
        rig.close()
        shutil.rmtree(work, ignore_errors=True)
    if args.no_write:
        return
    for (src, dst), by_unit in cells.items():
        head = by_unit.get(args.headline) or by_unit[max(by_unit)]
        head_unit = args.headline if args.headline in by_unit else max(by_unit)
        baseline = {"disk": "plain file readinto", "remote": "Mooncake get_into from the same store, no checks"}.get(
            src, {"disk": "plain file write", "remote": "Mooncake put_from into the same store, no checks"}.get(
                dst, "torch Tensor.copy_"))
        path = write_result(f"copy_{src}_{dst}", f"copy bandwidth {src}->{dst}, {head_unit}-byte payloads, checksum verified", "GB/s", [Run(o, p) for o, p in zip(head["ours_runs"], head["plain_runs"])], baseline, f"python -m benchmarks.bench_copy --mib {args.mib} --units {args.units} --headline {args.headline} "
            f"--repeats {args.repeats} --lanes {args.lanes}"
            + (f" --pairs {args.pairs}" if args.pairs != DEFAULT_PAIRS else ""), details={"units": {str(u): c for u, c in by_unit.items()}, "lanes": args.lanes, "mib_per_pass": args.mib,
                     "device_tier": device_note, "cuda": cuda_available(),
                     "remote_store": "Mooncake Store (mooncake-transfer-engine-non-cuda), TCP transport, loopback",
                     "load_average": os.getloadavg()})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
