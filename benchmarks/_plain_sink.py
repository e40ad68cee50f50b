"""A plain TCP byte sink/source, the baseline for the remote tier's copy figures.

``python -m benchmarks._plain_sink PORT MAX_BYTES`` serves one connection at a time. Requests
are 9 bytes: op (``P`` put, ``G`` get) and a u64 length. ``P``: the server reads that many bytes
into a preallocated buffer and answers one byte. ``G``: the server sends that many bytes from
it. No headers, no checksums, no bookkeeping: the least work that moves the same bytes between
the same two processes over the same kind of socket.
"""

from __future__ import annotations

import socket
import struct
import sys

from nexuskv.dataplane.wire import recv_exact, recv_into, tune_socket


def serve(port: int, max_bytes: int) -> None:
    buf = memoryview(bytearray(max_bytes))
    srv = socket.create_server(("127.0.0.1", port))
    print(f"listening on {port}", flush=True)
    while True:
        conn, _ = srv.accept()
        tune_socket(conn)
        with conn:
            while True:
                head = recv_exact(conn, 9, eof_ok=True)
                if head is None:
                    break
                op, n = struct.unpack(">cQ", head)
                if op == b"P":
                    recv_into(conn, buf[:n])
                    conn.sendall(b"k")
                else:
                    conn.sendall(buf[:n])


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
