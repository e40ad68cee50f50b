"""A small Mooncake Store of its own for an attack, and what another program could do to it.

Shared by ``tests/dataplane/test_remote_attacks.py`` and ``benchmarks/attack_remote_tier.py``:
:class:`Store` (``python -m streams.remote_tier`` in its own supervisor process, measured alone:
memory, threads, connections), payloads, a plain Mooncake client and its raw puts.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from nexuskv.dataplane import PayloadHeader, PayloadKey, RemoteBackend
from nexuskv.dataplane.remote_store import parse_store_address
from nexuskv.errors import TierUnavailableError
from streams.bus.process import ManagedProcess
from streams.remote_tier import local_address

__all__ = ["DID", "MIB", "Store", "payload", "raw_client", "raw_put", "children", "proc_status", "established",
           "listening_ports"]

DID = "sd1-" + "a" * 32
MIB = 1 << 20


class Store:
    """One store of ``capacity`` bytes in its own supervisor process."""

    def __init__(self, tmp_path: Path, capacity: int) -> None:
        self.address = local_address()
        env = dict(os.environ, NEXUSKV_REMOTE_TIER_BYTES=str(capacity), NEXUSKV_DATA_DIR=str(tmp_path))
        self.proc = ManagedProcess([sys.executable, "-m", "streams.remote_tier", "--listen", self.address],
                                   name="attacked-store", log_path=tmp_path / "store.log", env=env)
        self.proc.start()
        deadline = time.monotonic() + 60
        while True:
            try:
                RemoteBackend(self.address, timeout_s=2).close()
                break
            except TierUnavailableError:
                assert self.proc.alive() and time.monotonic() < deadline, self.proc.log_tail()
                time.sleep(0.2)

    def pids(self) -> list[int]:
        """The processes that hold the payloads and answer the connections (not the supervisor)."""
        return sorted(children(self.proc.pid))

    def rss(self) -> int:
        return sum(proc_status(p, "VmRSS") for p in self.pids()) * 1024

    def threads(self) -> int:
        return sum(proc_status(p, "Threads") for p in self.pids())

    def ports(self) -> list[int]:
        return sorted({port for p in self.pids() for port in listening_ports(p)})

    def stop(self) -> None:
        self.proc.stop()


def payload(key: int, n: int, seed: int | None = None) -> tuple[PayloadHeader, torch.Tensor]:
    g = torch.Generator().manual_seed(key if seed is None else seed)
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return PayloadHeader.for_data(PayloadKey(DID, key), data.numpy()), data


def raw_client(address: str):
    """A plain Mooncake client: what another program (or a buggy one) could write to the store."""
    from mooncake.store import MooncakeDistributedStore

    addr = parse_store_address(address)
    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", addr.master) == 0
    return raw


def raw_put(raw, name: str, blob: bytes) -> int:
    import numpy as np

    buf = np.frombuffer(blob, dtype=np.uint8).copy()
    return raw.put_from(name, buf.ctypes.data, buf.nbytes)


def children(pid: int) -> set[int]:
    kids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                kids.add(int(entry))
    return kids


def proc_status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def tcp_rows():
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                next(fh)
                for line in fh:
                    f = line.split()
                    yield int(f[1].rsplit(":", 1)[1], 16), f[3], f[9]  # local port, state, inode
        except FileNotFoundError:
            continue


def listening_ports(pid: int) -> set[int]:
    mine = socket_inodes(pid)
    return {port for port, state, inode in tcp_rows() if state == "0A" and inode in mine}


def established(pids: list[int], port: int) -> int:
    mine = set().union(*(socket_inodes(p) for p in pids))
    return sum(1 for p, state, inode in tcp_rows() if p == port and state == "01" and inode in mine)
