"""The node's index sidecar: one index replica per node, asked by every engine process on it.

Engine processes (vLLM's scheduler, SGLang's HiCache backend) hold no index. They ask this
process over a Unix socket (``NEXUSKV_INDEX_SOCKET``, default ``$NEXUSKV_DATA_DIR/run/index.sock``)
with :class:`connectors.index_client.IndexClient`, in the binary frames of
:mod:`nexuskv.contracts.lookup_wire`: the request's canonical keys in, the matches out (per location: tier,
group, publisher, prefix, extents, certainty, and the replica's lag). The answer is what an
in-process replica would have given; the engine keeps planning for itself.

Why a sidecar per node and not a replica per engine: a replica costs the whole index's memory and
applies every event of the fleet; in every engine process that is engines x events of work inside
the engine's interpreter, next to vLLM's scheduler. Here one process per node applies them, and a
node's engines share it (as Dynamo's and LMCache's per-node services are shared).

**Bounded time.** The replica applies in slices of at most :data:`streams.kv_intake.SLICE_S` of
work and yields between them (:mod:`streams.replica`); lookups are answered on the same loop, as
soon as their frame is read, so an ask waits behind at most one slice of ingest plus the asks
queued before it. The client gives up after its budget (``NEXUSKV_INDEX_ASK_BUDGET_MS``) and the
engine recomputes.

**Hostile or broken clients.** A frame larger than :data:`nexuskv.contracts.lookup_wire.MAX_FRAME` or not an
ask closes that connection (counted in :attr:`IndexSidecar.malformed`); a lookup whose scope does
not validate is answered with an error. The socket is created mode 0660: only the node's NexusKV
user and group reach it; it is the trust boundary (a local process may look up any tenant's
blocks, as an engine of that tenant needs to).

**Supervised.** The replica's apply task and the server run under a
:class:`~streams.supervisor.Supervisor`: either failing ends the process with status 1 (``nexuskv
up`` notices). ``/livez`` and ``/readyz`` on ``NEXUSKV_METRICS_PORT``: ready once the socket
listens and the replica has caught up with the log it found at start.

Run: ``python -m streams.index_sidecar`` (``nexuskv up`` starts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

from nexuskv.config import Settings, check_socket_path
from nexuskv.contracts.lookup_wire import (
    OP_LOOKUP,
    VERSION,
    Answer,
    Ask,
    WireError,
    WireScope,
    answer_of,
    decode_ask,
    encode_answer,
    frame_length,
    scope_of,
)
from nexuskv.errors import ConfigError, NexusKVError
from nexuskv.identity import IdentityScope
from streams.bus.health import HEALTH
from streams.bus.process import freeze_startup_heap
from streams.replica import IndexReplica
from streams.supervisor import Supervisor, run_service
from streams.telemetry import init_service

__all__ = ["IndexSidecar", "main"]

log = logging.getLogger("nexuskv.index_sidecar")
_SCOPES = 1024


class _Connection(asyncio.Protocol):
    def __init__(self, sidecar: IndexSidecar) -> None:
        self.sidecar = sidecar
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.sidecar.connections += 1
        self.sidecar._open.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.sidecar._open.discard(self)

    def data_received(self, data: bytes) -> None:
        buf = self.buffer
        buf += data
        while len(buf) >= 4 and self.transport is not None:
            try:
                n = frame_length(bytes(buf[:4]))
            except WireError as exc:
                self._refuse(exc)
                return
            if len(buf) < 4 + n:
                return
            body = bytes(buf[4:4 + n])
            del buf[:4 + n]
            try:
                ask = decode_ask(body)
            except WireError as exc:
                self._refuse(exc)
                return
            self.sidecar.answer(ask, self)

    def _refuse(self, exc: WireError) -> None:
        self.sidecar.malformed += 1
        log.warning("index sidecar: closing a connection that sent a malformed frame: %s", exc)
        if self.transport is not None:
            self.transport.close()
        self.buffer.clear()

    def send(self, answer: Answer) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(encode_answer(answer))


class IndexSidecar:
    """The Unix-socket server over a started :class:`IndexReplica` (or any object with its
    ``lookup`` and ``wait_caught_up``); :meth:`start`, then :meth:`close`."""

    def __init__(self, replica: Any, path: Path) -> None:
        check_socket_path(path)
        self.replica = replica
        self.path = path
        self.lookups = 0
        self.errors = 0  # lookups answered with an error (a scope that does not validate)
        self.malformed = 0  # connections closed for a malformed frame
        self.connections = 0
        self._server: asyncio.AbstractServer | None = None
        self._scopes: OrderedDict[WireScope, IdentityScope] = OrderedDict()
        self._syncs: set[asyncio.Task[None]] = set()
        self._open: set[_Connection] = set()

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() or self.path.is_symlink():
            if _listening(self.path):
                raise ConfigError("NEXUSKV_INDEX_SOCKET", f"another sidecar already listens on {self.path}")
            self.path.unlink()  # a previous sidecar's socket file: it is gone
        loop = asyncio.get_running_loop()
        old = os.umask(0o117)  # the socket is created 0660
        try:
            self._server = await loop.create_unix_server(lambda: _Connection(self), str(self.path))
        finally:
            os.umask(old)
        log.info("index sidecar listening on %s", self.path)

    async def serve_forever(self) -> None:
        assert self._server is not None
        await self._server.serve_forever()

    async def close(self) -> None:
        for task in list(self._syncs):
            task.cancel()
        if self._server is not None:
            self._server.close()
            for conn in list(self._open):  # clients see the stop at once, as when the process ends
                if conn.transport is not None:
                    conn.transport.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _scope(self, wire: WireScope) -> IdentityScope:
        scope = self._scopes.get(wire)
        if scope is None:
            scope = self._scopes[wire] = scope_of(wire)
            while len(self._scopes) > _SCOPES:
                self._scopes.popitem(last=False)
        return scope

    def answer(self, ask: Ask, conn: _Connection) -> None:
        if ask.op == OP_LOOKUP:
            assert ask.scope is not None
            try:
                scope = self._scope(ask.scope)
            except ValueError as exc:
                self.errors += 1
                conn.send(Answer(VERSION, ask.id, f"bad scope: {str(exc).splitlines()[0]}"))
                return
            self.lookups += 1
            conn.send(answer_of(ask.id, self.replica.lookup(scope, ask.keys)))
            return
        task = asyncio.get_running_loop().create_task(self._sync(ask, conn))
        self._syncs.add(task)
        task.add_done_callback(self._syncs.discard)

    async def _sync(self, ask: Ask, conn: _Connection) -> None:
        try:
            await self.replica.wait_caught_up(timeout_s=ask.timeout_ms / 1000.0)
        except (TimeoutError, NexusKVError) as exc:
            conn.send(Answer(VERSION, ask.id, f"not caught up: {exc}"))
            return
        conn.send(Answer(VERSION, ask.id))


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


async def _ready_when_caught_up(replica: IndexReplica) -> None:
    """Ready once the replica applied the log as it was at start; then keep running (supervised)."""
    await replica.wait_caught_up(timeout_s=86400.0)
    HEALTH.set_ready("replica", True)
    log.info("index sidecar: replica caught up (%d records)", replica.records)
    await asyncio.Event().wait()


async def _serve(settings: Settings, stop: Any) -> None:
    url = settings.broker_url
    assert url is not None
    path = settings.index_socket_path
    HEALTH.set_ready("replica", False, "catching up with the log")
    replica = IndexReplica(url, secret=settings.identity_secret_bytes, max_memberships=settings.index_max_memberships,
                           checkpoint_dir=settings.data_dir / "index" / "nexuskv-index",
                           bus_secret=settings.bus_secret_bytes, client_id=f"nexuskv-index-sidecar-{settings.worker}")
    await replica.start(timeout_s=settings.broker_start_timeout_s)
    sidecar = IndexSidecar(replica, path)
    supervisor = Supervisor("index-sidecar")
    assert replica.task is not None
    supervisor.watch(replica.task, name="index-replica")
    try:
        await sidecar.start()
        supervisor.spawn(sidecar.serve_forever(), name="socket-server")
        supervisor.spawn(_ready_when_caught_up(replica), name="catch-up")
        HEALTH.set_ready("socket", True)
        freeze_startup_heap()
        await supervisor.until(stop)
    finally:
        await supervisor.stop()
        await sidecar.close()
        await replica.stop()


def main() -> int:
    try:
        settings = Settings.from_env()
        if settings.broker_url is None:
            raise ConfigError("NEXUSKV_BROKER", "the index sidecar needs a broker URL (nexuskv up sets it)")
        settings.index_socket_path  # noqa: B018 - fails at start, naming the setting, when too long
    except NexusKVError as exc:
        print(f"index-sidecar: error: {exc}", file=sys.stderr)
        return 2
    init_service("index-sidecar", settings)
    return run_service("index-sidecar", lambda stop: _serve(settings, stop))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
