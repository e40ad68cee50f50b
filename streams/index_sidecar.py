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

**Asks off the ingest path.** The replica applies kv-events on the service's event loop, in
slices (:mod:`streams.replica`). Asks never run there: the socket is served by an event loop of
its own on the thread ``index-asks``, which reads frames, answers each small ask at once
(:meth:`nexuskv.index.GlobalIndex.lookup` is thread-safe, and the native core's lookup takes
its read lock with the GIL released) and writes the answer. An ingest slice therefore never
holds an ask; what an ask shares with ingest is the GIL between the native calls, and the service
lowers the interpreter's switch interval (:data:`ASK_SWITCH_INTERVAL_S`) so a waiting ask thread
gets it within a fraction of a millisecond rather than the default 5 ms; the ask thread runs at
``NEXUSKV_INDEX_ASK_NICE`` (-10), so a waking ask is given a core before ingest and the engines.
An ask of more than
:attr:`AskLimits.bulk_keys` keys is answered on a second thread, ``index-bulk-asks`` (at most
:attr:`AskLimits.bulk_queue` of them queued; more are refused ``busy``), so a large ask cannot
hold the small ones behind it. ``OP_SYNC`` waits on the replica's loop, holding nothing here.

**Bounded** (:class:`AskLimits`, from the settings):

* an ask carries at most ``NEXUSKV_INDEX_MAX_ASK_KEYS`` keys (what an engine's longest prompt
  needs; the client asks for the first that many of a longer one): more is answered with an error;
  a frame announcing more bytes than such an ask needs is refused before it is read;
* a connection has ``NEXUSKV_INDEX_FRAME_DEADLINE_MS`` to finish a frame it began (a slowloris
  sender is closed);
* at most ``NEXUSKV_INDEX_MAX_CONNECTIONS`` connections: a new one beyond takes the place of the
  one idle longest among those that never sent an ask (idle :attr:`AskLimits.idle_evict_s`, 1 s),
  else among those that did (:attr:`AskLimits.asked_idle_evict_s`, 10 min: an engine's
  connection asks at once and survives a flood of silent ones), else it is refused
  (an error frame written at accept, then closed) and the sidecar stops accepting for
  :data:`ACCEPT_PAUSE_S`, so a flood of reconnects costs it one refusal per pause, not one per
  connect (they wait in the kernel's backlog meanwhile);
* one ask per connection at a time: reading pauses while an ask of the connection is answered
  on another thread or while its answers are not read, so a connection buffers at most one frame
  (plus one socket read) and one answer. Memory is at most connections x (frame + answer).

Every refusal is counted on ``nexuskv_index_ask_refusals{reason}`` (and :attr:`IndexSidecar.refusals`)
and answered with an error frame where the wire allows: with the ask's id for an ask refused
(``too_many_keys``, ``bad_scope``, ``bulk_busy``), with id 0 before closing a connection
(``connections``, ``frame_deadline``, ``frame_size``, ``malformed``); ``evicted`` counts idle
connections closed for a new one, ``accept_failed`` accepts the OS refused (out of descriptors).
Refusals are logged at most once per :data:`REFUSAL_LOG_S` per reason (with how many were not).

**Hostile or broken clients.** The socket is created mode 0660: only the node's NexusKV user and
group reach it; it is the trust boundary (a local process may look up any tenant's blocks, as an
engine of that tenant needs to). Within it, no client can hold another's asks past the bounds
above.

**Supervised.** The replica's apply task and the server run under a
:class:`~streams.supervisor.Supervisor`: either failing (the ask thread ending included) ends the
process with status 1 (``nexuskv up`` notices). ``/livez`` and ``/readyz`` on
``NEXUSKV_METRICS_PORT``: ready once the socket listens and the replica has caught up with the end
offsets it found at start (:func:`streams.replica.report_readiness`).

Run: ``python -m streams.index_sidecar`` (``nexuskv up`` starts it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
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
    ask_frame_limit,
    decode_ask,
    encode_answer,
    frame_length,
    scope_of,
)
from nexuskv.errors import ConfigError, NexusKVError
from nexuskv.identity import IdentityScope
from streams.bus.health import HEALTH
from streams.bus.metrics import METRICS
from streams.bus.process import freeze_startup_heap
from streams.replica import IndexReplica, report_readiness
from streams.supervisor import Supervisor, run_service
from streams.telemetry import init_service

__all__ = ["ASK_SWITCH_INTERVAL_S", "AskLimits", "IndexSidecar", "main", "prefer_asks"]

log = logging.getLogger("nexuskv.index_sidecar")
_SCOPES = 1024
#: The interpreter's switch interval in the sidecar process (CPython's default is 5 ms): how long
#: the ingest loop may keep the GIL from an ask thread that wants it. An ask takes the GIL about
#: three times (woken by the socket, back from the native lookup, after the write), each a wait of
#: up to this long while ingest runs Python (``benchmarks/README.md``, ``sidecar_ask_*``).
ASK_SWITCH_INTERVAL_S = 0.00005
#: Seconds between two log lines of refusals of one reason (all are counted on the metric).
REFUSAL_LOG_S = 10.0
#: Seconds the sidecar stops accepting after refusing a connection at its cap: connects wait in the
#: kernel's backlog meanwhile, so a flood of reconnects cannot keep the ask thread busy refusing.
ACCEPT_PAUSE_S = 0.05
_BACKLOG = 256


def prefer_asks() -> None:
    """Lower this process's switch interval to :data:`ASK_SWITCH_INTERVAL_S` (the service does)."""
    sys.setswitchinterval(ASK_SWITCH_INTERVAL_S)


@dataclass(frozen=True, slots=True)
class AskLimits:
    """What one engine connection may cost the sidecar (see the module docstring)."""

    max_keys: int = 16_384
    max_connections: int = 128
    frame_deadline_s: float = 1.0
    idle_evict_s: float = 1.0  # a connection that never asked, idle this long, gives way to a new one
    asked_idle_evict_s: float = 600.0  # one that asked (an engine's) only after this long idle
    bulk_keys: int = 2048
    bulk_queue: int = 4

    def __post_init__(self) -> None:
        for name in ("max_keys", "max_connections", "bulk_keys", "bulk_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"AskLimits.{name} must be at least 1, not {getattr(self, name)}")
        if not (self.frame_deadline_s > 0 and 0 <= self.idle_evict_s <= self.asked_idle_evict_s):
            raise ValueError(f"AskLimits: frame_deadline_s {self.frame_deadline_s} must be positive, idle_evict_s "
                             f"{self.idle_evict_s} non-negative and at most asked_idle_evict_s "
                             f"{self.asked_idle_evict_s}")

    @classmethod
    def from_settings(cls, settings: Settings) -> AskLimits:
        return cls(max_keys=settings.index_max_ask_keys, max_connections=settings.index_max_connections,
                   frame_deadline_s=settings.index_frame_deadline_ms / 1000.0)

    @property
    def frame_limit(self) -> int:
        """The largest ask body read: one of :attr:`max_keys` keys."""
        return ask_frame_limit(self.max_keys)


class _Connection(asyncio.Protocol):
    """One engine connection, on the ask loop: frames in, one ask at a time, answers out."""

    def __init__(self, sidecar: IndexSidecar) -> None:
        self.sidecar = sidecar
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self.last_active = self.loop.time()
        self.asked = False  # it sent a valid ask (every engine's connection does, at once)
        self.busy = False  # one of its asks is answered on another thread: reading paused
        self.write_paused = False  # its answers are not read: reading paused
        self._deadline: asyncio.TimerHandle | None = None

    @property
    def idle(self) -> bool:
        return not self.busy and not self.buffer and self.transport is not None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.sidecar._opened(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.buffer = bytearray()
        self._stop_clock()
        self.sidecar._gone(self)

    def pause_writing(self) -> None:
        self.write_paused = True
        self._pause()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._resume()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self.last_active = self.loop.time()
        self._process()

    def _process(self) -> None:
        buf, limit = self.buffer, self.sidecar.limits.frame_limit
        while len(buf) >= 4 and not self.busy and not self.write_paused and self.transport is not None:
            try:
                n = frame_length(bytes(buf[:4]), limit)
            except WireError as exc:
                self.refuse("frame_size", str(exc))
                return
            if len(buf) < 4 + n:
                break
            body = bytes(buf[4:4 + n])
            del buf[:4 + n]
            self._stop_clock()  # the frame is whole: the next one gets a deadline of its own
            try:
                ask = decode_ask(body)
            except WireError as exc:
                self.sidecar.malformed += 1
                self.refuse("malformed", str(exc))
                return
            self.asked = True
            self.sidecar.answer(ask, self)
        if buf and self.transport is not None and not self.busy and not self.write_paused:
            if self._deadline is None:
                self._deadline = self.loop.call_later(self.sidecar.limits.frame_deadline_s, self._expired)
        else:
            self._stop_clock()

    def _stop_clock(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.buffer and not self.busy and not self.write_paused:
            ms = self.sidecar.limits.frame_deadline_s * 1000
            self.refuse("frame_deadline", f"a frame not finished within {ms:.0f} ms")

    def _pause(self) -> None:
        self._stop_clock()
        if self.transport is not None:
            with contextlib.suppress(RuntimeError):
                self.transport.pause_reading()

    def _resume(self) -> None:
        if self.transport is None or self.busy or self.write_paused:
            return
        with contextlib.suppress(RuntimeError):
            self.transport.resume_reading()
        self._process()

    def hold(self) -> None:
        """An ask of this connection goes to another thread: read nothing more until it is answered."""
        self.busy = True
        self._pause()

    def release(self, answer: Answer) -> None:
        self.busy = False
        self.send(answer)
        self._resume()

    def refuse(self, reason: str, why: str, *, request_id: int = 0) -> None:
        """Count ``reason``; answer the error (id 0: then close the connection)."""
        self.sidecar._count(reason, why)
        if request_id:
            self.send(Answer(VERSION, request_id, f"{reason}: {why}"))
            return
        self.send(Answer(VERSION, 0, f"{reason}: {why}"))
        self.buffer = bytearray()
        self._stop_clock()
        if self.transport is not None:
            self.transport.close()

    def send(self, answer: Answer) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(encode_answer(answer))
            self.last_active = self.loop.time()


class IndexSidecar:
    """The Unix-socket server over a started :class:`IndexReplica` (or any object with its
    ``lookup``, callable from any thread, and ``wait_caught_up``, a coroutine of the loop that
    calls :meth:`start`); :meth:`start`, then :meth:`close`. Asks are served on a thread of
    their own (module docstring)."""

    def __init__(self, replica: Any, path: Path, limits: AskLimits | None = None, *,
                 ask_nice: int | None = None) -> None:
        check_socket_path(path)
        self.replica = replica
        self.path = path
        self.limits = limits or AskLimits()
        #: The nice value asked for the ask thread (None: the process's own); :attr:`ask_priority`
        #: is what it got (the OS refuses a negative one without CAP_SYS_NICE: logged, not fatal).
        self.ask_nice = ask_nice
        self.ask_priority: int | None = None
        self.lookups = 0
        self.errors = 0  # lookups answered with an error (a scope that does not validate, a failed lookup)
        self.malformed = 0  # connections closed for a malformed frame
        self.connections = 0
        self.refusals: dict[str, int] = {}
        self._listener: socket.socket | None = None
        self._admitting = 0  # accepted, their transports not made yet
        self._accept_paused = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._full = f"the sidecar holds its {self.limits.max_connections} connections"
        self._full_frame = encode_answer(Answer(VERSION, 0, f"connections: {self._full}"))
        self._scopes: OrderedDict[WireScope, IdentityScope] = OrderedDict()
        self._open: set[_Connection] = set()
        self._home: asyncio.AbstractEventLoop | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ended: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._bulk = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="index-bulk-asks")
        self._bulk_waiting = 0
        self._closing = False
        self._logged: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    # -- lifecycle (the caller's loop) --------------------------------------------------------------

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() or self.path.is_symlink():
            if _listening(self.path):
                raise ConfigError("NEXUSKV_INDEX_SOCKET", f"another sidecar already listens on {self.path}")
            self.path.unlink()  # a previous sidecar's socket file: it is gone
        self._home = asyncio.get_running_loop()
        listening: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(listening,), name="index-asks", daemon=True)
        self._thread.start()
        await asyncio.wrap_future(listening)
        log.info("index sidecar listening on %s (asks on their own thread; at most %d connections, %d keys per ask)",
                 self.path, self.limits.max_connections, self.limits.max_keys)

    async def serve_forever(self) -> None:
        """Until :meth:`close`; raises when the ask thread ended otherwise (the supervisor's failure)."""
        await asyncio.shield(asyncio.wrap_future(self._ended))  # cancelling this task stops nothing
        if not self._closing:
            raise RuntimeError("the index sidecar's ask thread stopped")

    async def close(self) -> None:
        self._closing = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._shutdown)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._ended)), 10)
        self._bulk.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    # -- the ask thread -----------------------------------------------------------------------------

    def _run(self, listening: concurrent.futures.Future[None]) -> None:
        loop = self._loop = asyncio.new_event_loop()
        self.ask_priority = _set_thread_nice(self.ask_nice)
        try:
            asyncio.set_event_loop(loop)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old = os.umask(0o117)  # the socket is created 0660
            try:
                listener.bind(str(self.path))
            except BaseException:
                listener.close()
                raise
            finally:
                os.umask(old)
            listener.listen(_BACKLOG)
            listener.setblocking(False)
            self._listener = listener
            loop.add_reader(listener.fileno(), self._accept)
        except BaseException as exc:  # noqa: BLE001 - handed to start(), which raises it
            listening.set_exception(exc)
            loop.close()
            self._ended.set_result(None)
            return
        listening.set_result(None)
        error: BaseException | None = None
        try:
            loop.run_forever()
        except BaseException as exc:
            error = exc
            log.error("index sidecar: the ask thread failed", exc_info=exc)
        finally:
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            if error is not None:
                self._ended.set_exception(error)
            else:
                self._ended.set_result(None)

    def _shutdown(self) -> None:
        self._closing = True
        if self._listener is not None:
            self._loop.remove_reader(self._listener.fileno())  # type: ignore[union-attr]
            self._listener.close()
        for conn in list(self._open):  # clients see the stop at once, as when the process ends
            if conn.transport is not None:
                conn.transport.close()
        assert self._loop is not None
        self._loop.call_soon(self._loop.stop)  # after the transports' closing callbacks

    def _count(self, reason: str, why: str) -> None:
        """Count a refusal; log it, at most once per :data:`REFUSAL_LOG_S` per reason (an attacker
        choosing how often it is refused must not choose how much this process writes)."""
        self.refusals[reason] = self.refusals.get(reason, 0) + 1
        METRICS.index_ask_refusals.labels(reason).inc()
        now = time.monotonic()
        last = self._logged.get(reason)
        if last is not None and now - last < REFUSAL_LOG_S:
            self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
            return
        self._logged[reason] = now
        more = self._unlogged.pop(reason, 0)
        log.warning("index sidecar: refused (%s): %s%s", reason, why,
                    f" (and {more} more since the last such line)" if more else "")

    # -- admission: accepted here, so a refusal costs one accept and one small write --------------

    def _accept(self) -> None:
        listener, loop = self._listener, self._loop
        assert listener is not None and loop is not None
        for _ in range(64):
            try:
                sock, _addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, say: stop accepting a while
                self._count("accept_failed", str(exc))
                self._pause_accepting()
                return
            self.connections += 1
            if not self._room():
                self._count("connections", self._full)
                with contextlib.suppress(OSError):
                    sock.setblocking(False)
                    sock.send(self._full_frame)
                sock.close()
                self._pause_accepting()  # a flood of connects costs at most one per pause
                return
            sock.setblocking(False)
            self._admitting += 1
            task = loop.create_task(self._connect(sock))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _connect(self, sock: socket.socket) -> None:
        assert self._loop is not None
        try:
            await self._loop.connect_accepted_socket(lambda: _Connection(self), sock=sock)
        except OSError:
            sock.close()
        finally:
            self._admitting -= 1

    def _room(self) -> bool:
        """Whether a new connection may be held: under the cap, or taking the place of the one idle
        longest among those that never asked (idle at least :attr:`AskLimits.idle_evict_s`), else
        among those that did (at least :attr:`AskLimits.asked_idle_evict_s`): a flood of silent
        connections gives way to engines, and an engine's connection survives the flood."""
        if len(self._open) + self._admitting < self.limits.max_connections:
            return True
        assert self._loop is not None
        now, victim = self._loop.time(), None
        for asked, after in ((False, self.limits.idle_evict_s), (True, self.limits.asked_idle_evict_s)):
            idle = [c for c in self._open if c.idle and c.asked is asked and now - c.last_active >= after]
            victim = min(idle, key=lambda c: c.last_active, default=None)
            if victim is not None:
                break
        if victim is None:
            return False
        self._count("evicted", "an idle connection makes room for a new one")
        assert victim.transport is not None
        victim.transport.close()
        self._open.discard(victim)
        return True

    def _pause_accepting(self) -> None:
        loop, listener = self._loop, self._listener
        if self._accept_paused or loop is None or listener is None or self._closing:
            return
        self._accept_paused = True
        loop.remove_reader(listener.fileno())
        loop.call_later(ACCEPT_PAUSE_S, self._resume_accepting)

    def _resume_accepting(self) -> None:
        self._accept_paused = False
        if not self._closing and self._listener is not None and self._loop is not None:
            self._loop.add_reader(self._listener.fileno(), self._accept)

    def _opened(self, conn: _Connection) -> None:
        self._open.add(conn)
        METRICS.index_ask_connections.set(len(self._open))

    def _gone(self, conn: _Connection) -> None:
        self._open.discard(conn)
        METRICS.index_ask_connections.set(len(self._open))

    def _scope(self, wire: WireScope) -> IdentityScope:
        scope = self._scopes.get(wire)
        if scope is None:
            scope = self._scopes[wire] = scope_of(wire)
            while len(self._scopes) > _SCOPES:
                self._scopes.popitem(last=False)
        return scope

    def answer(self, ask: Ask, conn: _Connection) -> None:
        """Answer ``ask`` (on the ask loop): small lookups at once, large ones and syncs elsewhere."""
        if ask.op != OP_LOOKUP:
            self._sync(ask, conn)
            return
        assert ask.scope is not None
        n = len(ask.keys) // 16
        if n > self.limits.max_keys:
            conn.refuse("too_many_keys", f"{n} keys; this sidecar answers at most {self.limits.max_keys}",
                        request_id=ask.id)
            return
        try:
            scope = self._scope(ask.scope)
        except ValueError as exc:
            self.errors += 1
            conn.refuse("bad_scope", str(exc).splitlines()[0], request_id=ask.id)
            return
        self.lookups += 1
        if n <= self.limits.bulk_keys:
            conn.send(self._lookup(ask.id, scope, ask.keys))
            return
        if self._bulk_waiting >= self.limits.bulk_queue:
            conn.refuse("bulk_busy", f"{self._bulk_waiting} large asks are being answered; ask again",
                        request_id=ask.id)
            return
        self._bulk_waiting += 1
        conn.hold()
        loop = conn.loop

        def done(future: concurrent.futures.Future[Answer]) -> None:
            self._bulk_waiting -= 1
            if future.cancelled():
                answer = Answer(VERSION, ask.id, "stopping")
            else:
                answer = future.result()
            conn.release(answer)

        future = self._bulk.submit(self._lookup, ask.id, scope, ask.keys)
        future.add_done_callback(lambda f: _call_soon(loop, done, f))

    def _lookup(self, request_id: int, scope: IdentityScope, keys: bytes) -> Answer:
        try:
            return answer_of(request_id, self.replica.lookup(scope, keys))
        except Exception as exc:
            self.errors += 1
            log.exception("index sidecar: a lookup failed")
            return Answer(VERSION, request_id, f"lookup failed: {type(exc).__name__}")

    def _sync(self, ask: Ask, conn: _Connection) -> None:
        home, loop = self._home, conn.loop
        assert home is not None
        conn.hold()

        async def wait() -> Answer:
            try:
                await self.replica.wait_caught_up(timeout_s=ask.timeout_ms / 1000.0)
            except (TimeoutError, NexusKVError) as exc:
                return Answer(VERSION, ask.id, f"not caught up: {exc}")
            return Answer(VERSION, ask.id)

        def done(future: concurrent.futures.Future[Answer]) -> None:
            try:
                answer = future.result()
            except BaseException as exc:  # noqa: BLE001 - the replica's loop stopped meanwhile
                answer = Answer(VERSION, ask.id, f"not caught up: {type(exc).__name__}")
            conn.release(answer)

        try:
            future = asyncio.run_coroutine_threadsafe(wait(), home)
        except RuntimeError:  # the replica's loop is closed
            conn.release(Answer(VERSION, ask.id, "not caught up: stopping"))
            return
        future.add_done_callback(lambda f: _call_soon(loop, done, f))


def _set_thread_nice(nice: int | None) -> int:
    """Give the calling thread ``nice`` (Linux: a thread's nice value is its own); the nice value it
    runs at. A refusal (a negative value without CAP_SYS_NICE) is logged and the thread runs on at
    the process's priority: a nice value is never worth a failed start."""
    tid = threading.get_native_id()
    if nice is not None:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError as exc:
            log.warning("the index sidecar's ask thread keeps its priority (nice %d refused: %s); a negative "
                        "NEXUSKV_INDEX_ASK_NICE needs CAP_SYS_NICE", nice, exc.strerror or exc)
    return os.getpriority(os.PRIO_PROCESS, tid)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the ask loop is closed: the sidecar stopped
        loop.call_soon_threadsafe(fn, *args)


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


async def _serve(settings: Settings, stop: Any) -> None:
    url = settings.broker_url
    assert url is not None
    path = settings.index_socket_path
    replica = IndexReplica(url, secret=settings.identity_secret_bytes, max_memberships=settings.index_max_memberships,
                           checkpoint_dir=settings.data_dir / "index" / "nexuskv-index",
                           bus_secret=settings.bus_secret_bytes, client_id=f"nexuskv-index-sidecar-{settings.worker}")
    HEALTH.set_ready("replica", False, "starting: lag unknown (no fetch yet)")
    await replica.start(timeout_s=settings.broker_start_timeout_s)
    sidecar = IndexSidecar(replica, path, AskLimits.from_settings(settings), ask_nice=settings.index_ask_nice)
    prefer_asks()
    supervisor = Supervisor("index-sidecar")
    assert replica.task is not None
    supervisor.watch(replica.task, name="index-replica")
    try:
        await sidecar.start()
        supervisor.spawn(sidecar.serve_forever(), name="socket-server")
        supervisor.spawn(report_readiness(replica), name="catch-up")
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
