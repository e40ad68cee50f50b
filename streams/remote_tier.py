"""``python -m streams.remote_tier``: the remote tier's store (Mooncake Store) as one service.

Starts Mooncake's ``mooncake_master`` on ``--listen`` or ``NEXUSKV_REMOTE_TIER`` (a
``mooncake://host:port?admin=port`` address; without either, free loopback ports) and one
``mooncake_client`` that mounts ``NEXUSKV_REMOTE_TIER_BYTES`` of memory into it
(:mod:`nexuskv.dataplane.remote_store`), waits until the store answers with that capacity, prints
one line with the address, and supervises both until SIGINT or SIGTERM: if either exits, the other
is stopped and this process exits 1, so ``nexuskv up`` and an orchestrator see it.
``nexuskv up`` runs it as a service; the test session starts it like the broker.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from nexuskv.config import Settings
from nexuskv.dataplane.remote_store import (
    StoreAddress,
    StoreAdmin,
    master_argv,
    parse_store_address,
    segment_argv,
)
from nexuskv.errors import ConfigError, NexusKVError
from streams.bus.process import ManagedProcess, free_port
from streams.bus.health import HEALTH
from streams.telemetry import init_service

__all__ = ["main", "local_address", "RemoteTierStore"]

log = logging.getLogger("nexuskv.remote_tier")


def local_address(host: str = "127.0.0.1") -> str:
    """A fresh address on free loopback ports, for a store this machine starts."""
    return str(StoreAddress(host, free_port(host), free_port(host)))


class RemoteTierStore:
    """The two Mooncake processes of one store; :meth:`start` returns once it serves ``capacity_bytes``."""

    def __init__(self, address: StoreAddress, capacity_bytes: int, *, log_dir: Path,
                 advertise_host: str | None = None) -> None:
        self.address = address
        self.capacity_bytes = capacity_bytes
        bind = address.host
        # The segment registers under the name clients connect to: the advertised host when the
        # master binds a wildcard address (a container), else the master's own host.
        seg_host = advertise_host or ("127.0.0.1" if bind in ("0.0.0.0", "::") else bind)
        env = dict(os.environ, GLOG_logtostderr="1")
        self.master = ManagedProcess(master_argv(address, bind_host=bind), name="mooncake-master",
                                     log_path=log_dir / "mooncake-master.log", env=env)
        self.segment = ManagedProcess(segment_argv(address, capacity_bytes=capacity_bytes, host=seg_host,
                                                   port=free_port(seg_host if seg_host != "0.0.0.0" else "127.0.0.1")),
                                      name="mooncake-segment", log_path=log_dir / "mooncake-segment.log", env=env)
        self.admin = StoreAdmin(StoreAddress("127.0.0.1" if bind in ("0.0.0.0", "::") else bind,
                                             address.port, address.admin_port), timeout_s=2.0)

    def start(self, timeout_s: float = 30.0) -> RemoteTierStore:
        # No open-file limit below the machine's: Mooncake's master holds idle connections without
        # a timeout (one file each, no thread), and at its file limit it stops serving established
        # clients too (benchmarks/README.md, "Remote tier attacks").
        try:
            self.master.start()
            self._wait(timeout_s, lambda: self.admin.healthy(), self.master, "the master to answer")
            self.segment.start()
            self._wait(timeout_s, self._mounted, self.segment, f"{self.capacity_bytes} bytes to be mounted")
        except BaseException:
            self.stop()
            raise
        return self

    def _mounted(self) -> bool:
        try:
            return self.admin.capacity()[0] >= self.capacity_bytes
        except OSError:
            return False

    def _wait(self, timeout_s: float, ready, proc: ManagedProcess, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if not proc.alive():
                raise NexusKVError(f"{proc.name} exited while waiting for {what}; log tail:\n{proc.log_tail()}")
            if time.monotonic() > deadline:
                raise NexusKVError(f"timed out after {timeout_s:.0f}s waiting for {what}; log tail:\n"
                                   f"{proc.log_tail()}")
            time.sleep(0.1)

    def alive(self) -> bool:
        return self.master.alive() and self.segment.alive()

    def pids(self) -> list[int]:
        return [p for p in (self.master.pid, self.segment.pid) if p is not None]

    def stop(self) -> None:
        self.segment.stop()
        self.master.stop()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m streams.remote_tier", description=__doc__.splitlines()[0])
    ap.add_argument("--listen", default=None, help="mooncake://host:port?admin=port (default: NEXUSKV_REMOTE_TIER, "
                                                   "else free loopback ports)")
    ap.add_argument("--advertise-host", default=None,
                    help="host name clients reach the memory segment at, when --listen binds 0.0.0.0")
    args = ap.parse_args(argv)
    try:
        settings = Settings.from_env()
        init_service("remote-tier", settings)
        text = args.listen or settings.remote_tier or local_address()
        try:
            address = parse_store_address(text)
        except ValueError as exc:
            raise ConfigError("NEXUSKV_REMOTE_TIER", str(exc)) from None
        log_dir = Path(settings.data_dir) / "logs"
        store = RemoteTierStore(address, settings.remote_tier_bytes, log_dir=log_dir,
                                advertise_host=args.advertise_host)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        store.start()
    except ConfigError as exc:
        print(f"nexuskv remote tier: error: {exc}", file=sys.stderr)
        return 2
    except (NexusKVError, OSError) as exc:
        print(f"nexuskv remote tier: error: {exc}", file=sys.stderr)
        return 1
    print(f"nexuskv remote tier: Mooncake Store at {address} ({settings.remote_tier_bytes} bytes; "
          f"logs in {log_dir})", flush=True)
    code = 0
    HEALTH.set_ready("store", True, "")
    HEALTH.beat()
    while not stop.wait(0.5):
        HEALTH.beat()
        if not store.alive():
            dead = store.master if not store.master.alive() else store.segment
            print(f"nexuskv remote tier: {dead.name} exited; log tail:\n{dead.log_tail()}", file=sys.stderr, flush=True)
            HEALTH.fail(f"{dead.name} exited")
            code = 1
            break
    store.stop()
    return code


if __name__ == "__main__":
    sys.exit(main())
