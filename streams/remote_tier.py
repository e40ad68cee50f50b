"""``python -m streams.remote_tier``: the remote tier server as its own process.

Listens on ``--listen`` or ``NEXUSKV_REMOTE_TIER`` (``tcp://host:port``; port 0 picks a free one)
and holds at most ``NEXUSKV_REMOTE_TIER_BYTES`` of payloads in its memory
(:class:`nexuskv.dataplane.remote_server.RemoteTierServer`). Prints one line with the address it
listens on, then serves until SIGINT or SIGTERM. ``nexuskv up`` runs it as a service; tests
start it with :class:`streams.process.ManagedProcess`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence

from nexuskv.config import Settings
from nexuskv.dataplane.remote_server import RemoteTierServer
from nexuskv.dataplane.wire import parse_address
from nexuskv.errors import ConfigError, NexusKVError
from streams.telemetry import init_service

__all__ = ["main"]

log = logging.getLogger("nexuskv.remote_tier")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m streams.remote_tier", description=__doc__.splitlines()[0])
    ap.add_argument("--listen", default=None, help="tcp://host:port (default: NEXUSKV_REMOTE_TIER, else a free "
                                                   "loopback port)")
    args = ap.parse_args(argv)
    try:
        settings = Settings.from_env()
        init_service("remote-tier", settings)
        host, port = parse_address(args.listen or settings.remote_tier or "tcp://127.0.0.1:0")
        server = RemoteTierServer(host, port, settings.remote_tier_bytes)
    except ConfigError as exc:
        print(f"nexuskv remote tier: error: {exc}", file=sys.stderr)
        return 2
    except (NexusKVError, OSError) as exc:
        print(f"nexuskv remote tier: error: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    print(f"nexuskv remote tier: listening on {server.address} ({settings.remote_tier_bytes} bytes)", flush=True)
    while not stop.wait(0.5):
        pass
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
