"""The index sidecar's server as it was before its bounds (main at 9c0cc94), for the attack benchmark.

:mod:`benchmarks.attack_sidecar` measures the bounded server (:class:`streams.index_sidecar.IndexSidecar`)
against this one in the same run: asks answered inline on the loop that applies kv-events, no
frame deadline, no connection cap, frames up to 4 MiB, asks of up to 65,536 keys. Kept verbatim
(only the names and the imports differ) so "pre-fix" means the code that shipped; never used by
a service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

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
from nexuskv.errors import NexusKVError
from nexuskv.identity import IdentityScope

__all__ = ["PrefixSidecar"]

log = logging.getLogger("nexuskv.bench.prefix_sidecar")
_SCOPES = 1024


class _Connection(asyncio.Protocol):
    def __init__(self, sidecar: PrefixSidecar) -> None:
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


class PrefixSidecar:
    """The Unix-socket server over a started :class:`IndexReplica` (or any object with its
    ``lookup`` and ``wait_caught_up``); :meth:`start`, then :meth:`close`."""

    def __init__(self, replica: Any, path: Path) -> None:
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
