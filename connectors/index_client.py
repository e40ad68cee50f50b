"""The engine's side of the index: ask the node's sidecar, within a budget, and fail closed.

An engine process holds no index (:mod:`streams.index_sidecar` explains why). Its connector calls
:meth:`IndexClient.lookup` — an :class:`~nexuskv.lookup.IndexView` — from the engine's own thread
(vLLM's scheduler thread, SGLang's cache controller threads): a plain blocking Unix-socket round
trip, no event loop hop, bounded by ``budget_s`` from the call (connecting, sending, waiting for
and reading the answer, and waiting for another thread's ask on the same connection, together).

**Fail closed.** Whatever goes wrong, the answer is a lookup with no matches and infinite lag —
no external hits: the engine recomputes, and its output is the one it computes without NexusKV:

* no answer within the budget: ``timeouts``; the connection is dropped (a late answer can never
  be read as the next one's);
* the sidecar is not there (no socket, refused, reset, closed mid-answer): ``unavailable``. A
  connection that was fine before is tried once more at once, on a new connection, within what
  is left of the budget — a restarted sidecar is asked again without losing the request;
* an answer that does not decode or does not fit the question (another id, another number of
  blocks, a prefix beyond the query, an unknown tier...): ``malformed``, and the connection is
  dropped.

* an error answer (the sidecar refused the ask: too many keys, a bad scope, large asks queued, or
  the connection itself — at its connection cap, a frame it found malformed): ``refused``; a
  refused connection (id 0) is dropped and backs off like a failure, a refused ask does not.

**Bounded asks.** An ask carries at most ``max_keys`` keys (``NEXUSKV_INDEX_MAX_ASK_KEYS``, the
sidecar's own cap): a longer prompt asks for its first ``max_keys`` blocks (``trimmed``) and the
rest are misses, a prefix of the answer the whole ask would have had.

After a failure the client answers misses at once for ``backoff_s`` (``skipped``), so a hung or
dead sidecar costs the engine one budget per ``backoff_s``, not one per request; then it asks
again. ``stats`` counts everything; each change between answering and failing is logged once.

Thread-safe: one connection, one ask at a time (asks from several threads queue on a lock, and
the wait counts against each one's budget).
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from nexuskv.config import Settings
from nexuskv.contracts.lookup_wire import (
    MAX_KEYS,
    OP_LOOKUP,
    OP_SYNC,
    VERSION,
    Answer,
    Ask,
    LocationCache,
    WireError,
    WireScope,
    decode_answer,
    encode_ask,
    frame_length,
    pack_keys,
    result_of,
    wire_scope,
)
from nexuskv.errors import BrokerError
from nexuskv.identity import IdentityScope
from nexuskv.lookup import LookupResult

__all__ = ["IndexClient", "client_from_settings"]

log = logging.getLogger("nexuskv.index_client")


class _Timeout(Exception):
    pass


class _Gone(Exception):
    pass


class IndexClient:
    """Asks the index sidecar at ``path``; see the module docstring."""

    def __init__(self, path: Path | str, *, budget_s: float = 0.02, backoff_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, name: str = "engine", max_keys: int = 16_384) -> None:
        if not budget_s > 0:
            raise ValueError(f"budget_s must be positive, not {budget_s}")
        if not 1 <= max_keys <= MAX_KEYS:
            raise ValueError(f"max_keys must be 1 to {MAX_KEYS}, not {max_keys}")
        self.max_keys = max_keys
        self.path = str(path)
        self.budget_s = budget_s
        self.backoff_s = backoff_s
        self.clock = clock
        self.name = name
        self.stats = {"asked": 0, "answered": 0, "timeouts": 0, "unavailable": 0, "malformed": 0, "skipped": 0,
                      "busy": 0, "connects": 0, "refused": 0, "trimmed": 0}
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._next_id = 1
        self._down_until = -math.inf
        self._failing = False
        self._locations = LocationCache()
        self._scopes: dict[IdentityScope, WireScope] = {}

    # -- the IndexView ------------------------------------------------------------------------------

    def lookup(self, scope: IdentityScope, keys: Sequence[int] | np.ndarray | bytes) -> LookupResult:
        """The sidecar's matches for ``keys`` in ``scope``, or a miss with infinite lag (see above)."""
        packed = pack_keys(keys)
        n = asked = len(packed) // 16
        start = self.clock()
        self.stats["asked"] += 1
        if n > self.max_keys:
            self.stats["trimmed"] += 1
            asked = self.max_keys
            packed = packed[: 16 * asked]
        if start < self._down_until:
            self.stats["skipped"] += 1
            return _miss(n)
        if not self._lock.acquire(timeout=self.budget_s):
            self.stats["busy"] += 1
            return _miss(n)
        try:
            deadline = start + self.budget_s
            wire = self._scopes.get(scope)
            if wire is None:
                if len(self._scopes) > 256:
                    self._scopes.clear()
                wire = self._scopes[scope] = wire_scope(scope)
            request_id = self._take_id()
            request = encode_ask(Ask(VERSION, OP_LOOKUP, request_id, wire, packed))
            try:
                body = self._round_trip(request, deadline)
                answer = decode_answer(body)
                if answer.error and answer.id in (0, request_id):
                    return self._refused(answer, request_id, n)
                result = result_of(answer, request_id, asked, self._locations)
            except _Timeout:
                return self._failed("timeouts", f"no answer within {self.budget_s * 1000:.1f} ms", n)
            except _Gone as exc:
                return self._failed("unavailable", str(exc), n)
            except WireError as exc:
                return self._failed("malformed", str(exc), n)
            self.stats["answered"] += 1
            if self._failing:
                self._failing = False
                log.info("%s: the index sidecar at %s answers again", self.name, self.path)
            if asked < n:  # the first max_keys blocks' answer; the rest are misses
                return LookupResult(num_blocks=n, matches=result.matches, lag_events=result.lag_events,
                                    lag_ms=result.lag_ms)
            return result
        finally:
            self._lock.release()

    def wait_caught_up(self, timeout_s: float = 30.0) -> None:
        """Block until the sidecar's replica applied everything published so far (tests, operators)."""
        with self._lock:
            request_id = self._take_id()
            request = encode_ask(Ask(VERSION, OP_SYNC, request_id, timeout_ms=timeout_s * 1000.0))
            try:
                body = self._round_trip(request, self.clock() + timeout_s + 5.0)
                answer = decode_answer(body)
            except (_Timeout, _Gone, WireError) as exc:
                self._drop()
                raise BrokerError(f"{self.name}: the index sidecar at {self.path} did not sync: {exc}") from None
            if answer.id != request_id or answer.error:
                self._drop()
                raise BrokerError(f"{self.name}: the index sidecar did not sync: {answer.error or 'wrong id'}")

    def close(self) -> None:
        with self._lock:
            self._drop()

    def stop(self) -> None:
        self.close()

    # -- the socket ---------------------------------------------------------------------------------

    def _take_id(self) -> int:
        request_id = self._next_id
        self._next_id = (self._next_id + 1) & ((1 << 62) - 1) or 1
        return request_id

    def _round_trip(self, request: bytes, deadline: float) -> bytes:
        reused = self._sock is not None
        try:
            return self._exchange(request, deadline)
        except _Gone:
            self._drop()
            if not reused:
                raise
        # The connection was fine before: the sidecar restarted (or dropped idle clients). Once more.
        return self._exchange(request, deadline)

    def _exchange(self, request: bytes, deadline: float) -> bytes:
        sock = self._connected(deadline)
        try:
            self._settimeout(sock, deadline)
            sock.sendall(request)
            header = self._read(sock, 4, deadline)
            return self._read(sock, frame_length(header), deadline)
        except TimeoutError:
            self._drop()
            raise _Timeout() from None
        except WireError:
            self._drop()
            raise
        except OSError as exc:
            self._drop()
            raise _Gone(f"the index sidecar at {self.path}: {exc}") from None

    def _connected(self, deadline: float) -> socket.socket:
        if self._sock is not None:
            return self._sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._settimeout(sock, deadline)
            sock.connect(self.path)
        except TimeoutError:
            sock.close()
            raise _Timeout() from None
        except OSError as exc:
            sock.close()
            raise _Gone(f"cannot reach the index sidecar at {self.path}: {exc}") from None
        self.stats["connects"] += 1
        self._sock = sock
        return sock

    def _settimeout(self, sock: socket.socket, deadline: float) -> None:
        left = deadline - self.clock()
        if left <= 0:
            raise _Timeout()
        sock.settimeout(left)

    def _read(self, sock: socket.socket, n: int, deadline: float) -> bytes:
        chunks, have = [], 0
        while have < n:
            self._settimeout(sock, deadline)
            chunk = sock.recv(min(n - have, 1 << 20))
            if not chunk:
                raise OSError("the sidecar closed the connection")
            chunks.append(chunk)
            have += len(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def _refused(self, answer: Answer, request_id: int, n: int) -> LookupResult:
        if answer.id == 0:  # the connection was refused (or closed) with the reason: drop it, back off
            return self._failed("refused", answer.error[:300], n)
        self.stats["refused"] += 1
        log.debug("%s: the index sidecar refused ask %d: %s", self.name, request_id, answer.error[:300])
        return _miss(n)

    def _failed(self, counter: str, why: str, n: int) -> LookupResult:
        self._drop()
        self.stats[counter] += 1
        self._down_until = self.clock() + self.backoff_s
        if not self._failing:
            self._failing = True
            log.warning("%s: index sidecar ask failed (%s): %s; misses (recompute) for %.0f ms, then asking again",
                        self.name, counter, why, self.backoff_s * 1000)
        return _miss(n)


def _miss(n: int) -> LookupResult:
    return LookupResult(num_blocks=n, matches=(), lag_events=0, lag_ms=math.inf)


def client_from_settings(settings: Settings, *, name: str) -> IndexClient:
    """The client of this node's sidecar, as the settings place it and budget it."""
    return IndexClient(settings.index_socket_path, budget_s=settings.index_ask_budget_ms / 1000.0,
                       backoff_s=settings.index_ask_backoff_ms / 1000.0, name=name,
                       max_keys=settings.index_max_ask_keys)
