"""The remote tier as a backend: a client of a :class:`~nexuskv.dataplane.remote_server.RemoteTierServer`.

Payloads live in another process (``python -m streams.remote_tier``, started by ``nexuskv up``
and by tests), reached over TCP at ``tcp://host:port``, so the tier is ``out_of_process`` and
``shared``: any worker that can reach the address can read it. Each thread keeps its own
connection (the protocol answers one request at a time). The server verifies what it receives
before answering OK, so a committed payload arrived intact; reads come back with the stored
header, which the reader verifies again. A server that cannot be reached raises
:class:`~nexuskv.errors.TierUnavailableError`; the next call reconnects.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence

import msgpack
import torch

from nexuskv.dataplane.backend import Reservation, StagedBackend, host_view
from nexuskv.dataplane.capabilities import Capabilities
from nexuskv.dataplane.cuda import cuda_available
from nexuskv.dataplane.payload import HEADER_BYTES, PayloadHandle, PayloadHeader, PayloadKey
from nexuskv.dataplane.wire import (
    KEY_FRAME_BYTES,
    Op,
    Status,
    pack_frame,
    pack_key,
    parse_address,
    read_frame_header,
    recv_exact,
    recv_into,
    tune_socket,
    unpack_key,
)
from nexuskv.descriptor import Tier
from nexuskv.errors import IntegrityError, TierFullError, TierUnavailableError

__all__ = ["RemoteBackend"]

_HEADS_PER_CALL = 4096
_ABSENT = bytes(HEADER_BYTES)  # HEADS answers an all-zero header for a key it does not hold


class RemoteBackend(StagedBackend):
    """Client of the remote tier server at ``address``; capacity is the server's."""

    @classmethod
    def connect(cls, address: str, *, wait_s: float, label: str = "remote-tcp") -> RemoteBackend:
        """A backend for the server at ``address``, retrying for up to ``wait_s`` while it starts."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return cls(address, label=label)
            except TierUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def __init__(self, address: str, *, label: str = "remote-tcp", timeout_s: float = 30.0) -> None:
        self.address = address
        self._host, self._port = parse_address(address)
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._conns: list[socket.socket] = []
        self._conns_lock = threading.Lock()
        caps = Capabilities(tier=Tier.REMOTE, device="cpu", transport="tcp", out_of_process=True, shared=True,
                            note=f"payloads held by the remote tier process at {address}")
        stats = self._stats_of(self._call(Op.STATS))
        super().__init__(label=label, capacity_bytes=stats["capacity_bytes"], capabilities=caps, pin=cuda_available())

    # -- connection -------------------------------------------------------------------------

    def _sock(self) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            try:
                sock = socket.create_connection((self._host, self._port), timeout=self.timeout_s)
            except OSError as exc:
                raise TierUnavailableError(f"remote tier {self.address} cannot be reached: {exc}") from None
            tune_socket(sock)
            self._local.sock = sock
            with self._conns_lock:
                self._conns.append(sock)
        return sock

    def _drop(self) -> None:
        sock = getattr(self._local, "sock", None)
        self._local.sock = None
        if sock is not None:
            with self._conns_lock:
                if sock in self._conns:
                    self._conns.remove(sock)
            sock.close()

    def _call(self, op: Op, meta: bytes = b"", data: memoryview | None = None,
              into: memoryview | None = None) -> tuple[Status, bytes]:
        """Send one request, read its answer; the answer's data lands in ``into`` when given."""
        sock = self._sock()
        try:
            sock.sendall(pack_frame(op, meta, data.nbytes if data is not None else 0))
            if data is not None:
                sock.sendall(data)
            frame = read_frame_header(sock)
            if frame is None:
                raise ConnectionError("remote tier closed the connection")
            code, meta_len, data_len = frame
            answer = recv_exact(sock, meta_len) if meta_len else b""
            if data_len:
                if into is None or into.nbytes != data_len:
                    raise ConnectionError(f"unexpected {data_len} data bytes from the remote tier")
                recv_into(sock, into)
            return Status(code), answer or b""
        except (OSError, ConnectionError, ValueError) as exc:
            self._drop()
            raise TierUnavailableError(f"remote tier {self.address}: {exc}") from None

    @staticmethod
    def _stats_of(answer: tuple[Status, bytes]) -> dict[str, int]:
        status, meta = answer
        if status is not Status.OK:
            raise TierUnavailableError(f"remote tier answered {status.name} to STATS")
        return msgpack.unpackb(meta)

    # -- accounting lives on the server -----------------------------------------------------

    def stats(self) -> dict[str, int]:
        return self._stats_of(self._call(Op.STATS))

    def used_bytes(self) -> int:
        return self.stats()["used_bytes"]

    def free_bytes(self) -> int:
        s = self.stats()
        return s["capacity_bytes"] - s["used_bytes"]

    def ping(self) -> bool:
        try:
            return self._call(Op.PING)[0] is Status.OK
        except TierUnavailableError:
            return False

    # -- the interface ----------------------------------------------------------------------

    def header(self, key: PayloadKey) -> PayloadHeader | None:
        status, meta = self._call(Op.HEAD, pack_key(key))
        if status is Status.NOT_FOUND:
            return None
        if status is not Status.OK:
            raise TierUnavailableError(f"remote tier answered {status.name} to HEAD: {meta.decode(errors='replace')}")
        return PayloadHeader.unpack(meta)

    def keys(self) -> list[PayloadKey]:
        status, meta = self._call(Op.KEYS)
        if status is not Status.OK:
            raise TierUnavailableError(f"remote tier answered {status.name} to KEYS")
        return [unpack_key(meta[i:i + KEY_FRAME_BYTES]) for i in range(0, len(meta), KEY_FRAME_BYTES)]

    def read_into(self, key: PayloadKey, out: torch.Tensor) -> PayloadHeader | None:
        with self._host_target(out) as target:
            status, meta = self._call(Op.GET, pack_key(key), into=host_view(target))
            if status is Status.NOT_FOUND:
                return None
            if status is not Status.OK:
                raise TierUnavailableError(f"remote tier answered {status.name} to GET {key}")
            return PayloadHeader.unpack(meta)

    verifies_on_commit = True  # the server checks every PUT against its header before storing it

    def headers(self, keys: Sequence[PayloadKey]) -> list[PayloadHeader | None]:
        out: list[PayloadHeader | None] = []
        for start in range(0, len(keys), _HEADS_PER_CALL):
            chunk = keys[start:start + _HEADS_PER_CALL]
            status, meta = self._call(Op.HEADS, b"".join(pack_key(k) for k in chunk))
            if status is not Status.OK or len(meta) != len(chunk) * HEADER_BYTES:
                raise TierUnavailableError(f"remote tier answered {status.name} to HEADS")
            for i in range(len(chunk)):
                raw = meta[i * HEADER_BYTES:(i + 1) * HEADER_BYTES]
                out.append(None if raw == _ABSENT else PayloadHeader.unpack(raw))
        return out

    def reserve(self, nbytes: int) -> Reservation | None:
        """Not binding: the server is shared by every worker and admits each PUT on its own, so
        this only checks the room it has now (a transfer can still be rejected midway, and is
        then rolled back)."""
        return Reservation(self, 0) if self.free_bytes() >= nbytes else None

    def commit_view(self, header: PayloadHeader, data: torch.Tensor,
                    reservation: Reservation | None = None) -> PayloadHandle:
        status, meta = self._call(Op.PUT, header.pack(), data=host_view(data))
        if status is Status.OK:
            stored = PayloadHeader.unpack(meta) if len(meta) == HEADER_BYTES else header
            return self._handle(stored)
        reason = meta.decode(errors="replace")
        if status is Status.FULL:
            raise TierFullError(f"{self.label}: {reason}")
        if status is Status.INTEGRITY:
            raise IntegrityError(f"{self.label}: {reason}")
        raise TierUnavailableError(f"{self.label}: server answered {status.name}: {reason}")

    def delete(self, key: PayloadKey) -> bool:
        return self._call(Op.DELETE, pack_key(key))[0] is Status.OK

    def clear(self) -> None:
        self._call(Op.CLEAR)

    def close(self) -> None:
        with self._conns_lock:
            conns, self._conns = self._conns, []
        for sock in conns:
            sock.close()
        self._local = threading.local()
        super().close()
