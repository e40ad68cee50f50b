"""The remote tier's wire protocol: length-prefixed frames over one TCP connection.

Every request and every answer is one frame::

    magic "NKVR" | code u8 | 3 B zero | meta length u32 | data length u64 | meta | data

``code`` is the operation in a request (:class:`Op`) and the outcome in an answer
(:class:`Status`). Payload frames carry the packed 128-byte payload header as meta and the
payload bytes as data; key frames carry a packed :class:`~nexuskv.dataplane.payload.PayloadKey`
(84 bytes; ``HEADS`` carries many and answers one 128-byte header each, all zero for a key not
held); errors carry their reason as UTF-8 meta. One request is answered before the next is
read, so a client keeps one connection per thread. Torch-free: the server process does not load
torch.
"""

from __future__ import annotations

import socket
import struct
from enum import IntEnum

from nexuskv.dataplane.payload import PayloadKey
from nexuskv.errors import TierUnavailableError

__all__ = ["Op", "Status", "FRAME", "pack_frame", "read_frame_header", "recv_exact", "recv_into",
           "pack_key", "unpack_key", "KEY_FRAME_BYTES", "parse_address", "tune_socket", "MAX_META"]

_MAGIC = b"NKVR"
FRAME = struct.Struct(">4sB3xIQ")
_KEY = struct.Struct(">I16s64s")
KEY_FRAME_BYTES = _KEY.size
MAX_META = 1 << 24
SOCKET_BUFFER = 4 << 20


class Op(IntEnum):
    PING = 1
    PUT = 2
    GET = 3
    HEAD = 4
    DELETE = 5
    STATS = 6
    KEYS = 7
    CLEAR = 8
    HEADS = 9  # many packed keys in; their packed headers out, all-zero for a key not held


class Status(IntEnum):
    OK = 0
    NOT_FOUND = 1
    FULL = 2
    INTEGRITY = 3
    BAD_REQUEST = 4


def pack_frame(code: int, meta: bytes = b"", data_len: int = 0) -> bytes:
    return FRAME.pack(_MAGIC, int(code), len(meta), data_len) + meta


def read_frame_header(sock: socket.socket) -> tuple[int, int, int] | None:
    """(code, meta length, data length) of the next frame; None when the peer closed cleanly."""
    raw = recv_exact(sock, FRAME.size, eof_ok=True)
    if raw is None:
        return None
    magic, code, meta_len, data_len = FRAME.unpack(raw)
    if magic != _MAGIC or meta_len > MAX_META:
        raise ConnectionError(f"not a NexusKV remote-tier frame (magic {magic!r}, meta {meta_len} B)")
    return code, meta_len, data_len


def recv_exact(sock: socket.socket, n: int, *, eof_ok: bool = False) -> bytes | None:
    buf = bytearray(n)
    got = 0
    view = memoryview(buf)
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            if eof_ok and got == 0:
                return None
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k


def pack_key(key: PayloadKey) -> bytes:
    return _KEY.pack(key.group, key.key.to_bytes(16, "big"), key.descriptor_id.encode("ascii"))


def unpack_key(raw: bytes) -> PayloadKey:
    group, key, descriptor = _KEY.unpack(raw)
    return PayloadKey(descriptor.rstrip(b"\x00").decode("ascii"), int.from_bytes(key, "big"), group)


def parse_address(address: str) -> tuple[str, int]:
    """``tcp://host:port`` to (host, port); TierUnavailableError naming the address otherwise."""
    text = address.strip()
    if not text.startswith("tcp://"):
        raise TierUnavailableError(f"remote tier address {address!r}: expected tcp://host:port")
    host, sep, port = text[len("tcp://"):].rstrip("/").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise TierUnavailableError(f"remote tier address {address!r}: expected tcp://host:port")
    return host.strip("[]"), int(port)


def tune_socket(sock: socket.socket) -> None:
    """No Nagle delay on small frames; large buffers so MiB payloads stream without stalls."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
