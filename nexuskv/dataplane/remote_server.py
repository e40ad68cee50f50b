"""The remote tier's server: payloads held in another process's memory, served over TCP.

It verifies every payload it receives against the checksum in its header before storing it (so
"stored" means "arrived intact"), enforces its own capacity (a full server answers ``FULL`` and
stores nothing), and serves reads with the stored header so the reader can verify again. One
thread per connection; the store is guarded by one lock. It imports no torch: the process stays
small. Run it as a process with ``python -m streams.remote_tier``; :class:`RemoteTierServer`
is the in-process object that process runs.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading

import msgpack
import numpy as np

from nexuskv.dataplane.payload import HEADER_BYTES, PayloadHeader, PayloadKey, verify_payload
from nexuskv.dataplane.wire import (
    KEY_FRAME_BYTES,
    Op,
    Status,
    pack_frame,
    pack_key,
    read_frame_header,
    recv_exact,
    recv_into,
    tune_socket,
    unpack_key,
)
from nexuskv.errors import IntegrityError

__all__ = ["RemoteTierServer", "RemoteStore"]

log = logging.getLogger(__name__)
_DRAIN = 1 << 20


class RemoteStore:
    """The server's payloads: numpy byte buffers with their headers, within a capacity."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: dict[PayloadKey, tuple[PayloadHeader, np.ndarray]] = {}
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def admit(self, header: PayloadHeader) -> Status:
        """Reserve room for ``header``'s payload: OK, FULL, or NOT_FOUND meaning "already held"."""
        with self._lock:
            if header.key in self._entries:
                return Status.NOT_FOUND
            if self.used_bytes + header.nbytes > self.capacity_bytes:
                return Status.FULL
            self.used_bytes += header.nbytes
            return Status.OK

    def unadmit(self, nbytes: int) -> None:
        with self._lock:
            self.used_bytes -= nbytes

    def buffer(self, nbytes: int) -> np.ndarray:
        with self._lock:
            stack = self._free.get(nbytes)
            if stack:
                return stack.pop()
        return np.empty(nbytes, dtype=np.uint8)

    def recycle(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.setdefault(buf.nbytes, []).append(buf)

    def store(self, header: PayloadHeader, buf: np.ndarray) -> None:
        with self._lock:
            if header.key in self._entries:  # raced with an equal copy: keep the first
                self.used_bytes -= header.nbytes
                self._free.setdefault(buf.nbytes, []).append(buf)
            else:
                self._entries[header.key] = (header, buf)

    def get(self, key: PayloadKey) -> tuple[PayloadHeader, np.ndarray] | None:
        return self._entries.get(key)

    def delete(self, key: PayloadKey) -> bool:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self.used_bytes -= entry[0].nbytes
            self._free.setdefault(entry[1].nbytes, []).append(entry[1])
            return True

    def keys(self) -> list[PayloadKey]:
        with self._lock:
            return list(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._free.clear()
            self.used_bytes = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"capacity_bytes": self.capacity_bytes, "used_bytes": self.used_bytes,
                    "payloads": len(self._entries)}


class _Handler(socketserver.BaseRequestHandler):
    server: _TCPServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        tune_socket(sock)
        store = self.server.store
        try:
            while True:
                frame = read_frame_header(sock)
                if frame is None:
                    return
                code, meta_len, data_len = frame
                meta = recv_exact(sock, meta_len) if meta_len else b""
                self._serve(sock, store, code, meta or b"", data_len)
        except (ConnectionError, OSError) as exc:
            log.debug("remote tier: connection ended: %s", exc)

    def _serve(self, sock: socket.socket, store: RemoteStore, code: int, meta: bytes, data_len: int) -> None:
        try:
            op = Op(code)
        except ValueError:
            _drain(sock, data_len)
            sock.sendall(pack_frame(Status.BAD_REQUEST, f"unknown operation {code}".encode()))
            return
        if op is Op.PUT:
            self._put(sock, store, meta, data_len)
            return
        if data_len:
            _drain(sock, data_len)
        if op is Op.PING:
            sock.sendall(pack_frame(Status.OK))
        elif op is Op.STATS:
            sock.sendall(pack_frame(Status.OK, msgpack.packb(store.stats())))
        elif op is Op.KEYS:
            sock.sendall(pack_frame(Status.OK, b"".join(pack_key(k) for k in store.keys())))
        elif op is Op.CLEAR:
            store.clear()
            sock.sendall(pack_frame(Status.OK))
        elif op is Op.HEADS:
            if len(meta) % KEY_FRAME_BYTES:
                sock.sendall(pack_frame(Status.BAD_REQUEST, b"HEADS expects packed payload keys"))
                return
            answer = bytearray()
            for i in range(0, len(meta), KEY_FRAME_BYTES):
                entry = store.get(unpack_key(meta[i:i + KEY_FRAME_BYTES]))
                answer += entry[0].pack() if entry is not None else bytes(HEADER_BYTES)
            sock.sendall(pack_frame(Status.OK, bytes(answer)))
        elif len(meta) != KEY_FRAME_BYTES:
            sock.sendall(pack_frame(Status.BAD_REQUEST, b"expected a packed payload key"))
        else:
            key = unpack_key(meta)
            if op is Op.DELETE:
                sock.sendall(pack_frame(Status.OK if store.delete(key) else Status.NOT_FOUND))
                return
            entry = store.get(key)
            if entry is None:
                sock.sendall(pack_frame(Status.NOT_FOUND))
            elif op is Op.HEAD:
                sock.sendall(pack_frame(Status.OK, entry[0].pack()))
            else:  # GET
                header, buf = entry
                sock.sendall(pack_frame(Status.OK, header.pack(), header.nbytes))
                sock.sendall(memoryview(buf))

    def _put(self, sock: socket.socket, store: RemoteStore, meta: bytes, data_len: int) -> None:
        try:
            header = PayloadHeader.unpack(meta) if len(meta) == HEADER_BYTES else None
        except IntegrityError:
            header = None
        if header is None or header.nbytes != data_len:
            _drain(sock, data_len)
            sock.sendall(pack_frame(Status.BAD_REQUEST, b"PUT needs a payload header matching its data length"))
            return
        admitted = store.admit(header)
        if admitted is not Status.OK:
            _drain(sock, data_len)
            if admitted is Status.FULL:
                stats = store.stats()
                reason = (f"remote tier full: {header.nbytes} bytes for {header.key} do not fit "
                          f"({stats['capacity_bytes'] - stats['used_bytes']} of {stats['capacity_bytes']} free)")
                sock.sendall(pack_frame(Status.FULL, reason.encode()))
            else:  # already held: the first copy wins
                held = store.get(header.key)
                sock.sendall(pack_frame(Status.OK, (held[0] if held else header).pack()))
            return
        buf = store.buffer(header.nbytes)
        try:
            recv_into(sock, memoryview(buf))
        except BaseException:
            store.unadmit(header.nbytes)
            store.recycle(buf)
            raise
        try:
            verify_payload(header.key, header, buf)
        except IntegrityError as exc:
            store.unadmit(header.nbytes)
            store.recycle(buf)
            sock.sendall(pack_frame(Status.INTEGRITY, str(exc).encode()))
            return
        store.store(header, buf)
        sock.sendall(pack_frame(Status.OK, header.pack()))


def _drain(sock: socket.socket, n: int) -> None:
    scratch = memoryview(bytearray(min(n, _DRAIN) or 1))
    while n > 0:
        k = sock.recv_into(scratch[: min(n, scratch.nbytes)])
        if not k:
            raise ConnectionError("connection closed while draining a frame")
        n -= k


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    store: RemoteStore


class RemoteTierServer:
    """Serve a :class:`RemoteStore` of ``capacity_bytes`` on ``host:port`` (port 0: any free one)."""

    def __init__(self, host: str, port: int, capacity_bytes: int) -> None:
        self.store = RemoteStore(capacity_bytes)
        self._server = _TCPServer((host, port), _Handler)
        self._server.store = self.store
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"tcp://{host}:{port}"

    def serve_forever(self) -> None:
        self._server.serve_forever(poll_interval=0.2)

    def start(self) -> RemoteTierServer:
        """Serve from a background thread (in-process use); :meth:`stop` ends it."""
        self._thread = threading.Thread(target=self.serve_forever, name="remote-tier", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)
        self.store.clear()

