"""Attacks 5, 6 and 12 (issue 13) against the home-made remote tier server at commit 30ffd34.

Kept as the evidence behind benchmarks/README.md, "Remote tier attacks"; it imports the removed
server, so it runs only in a checkout of 30ffd34 (not collected by the test suite):

    git worktree add --detach ../nexuskv-30ffd34 30ffd34 && cd ../nexuskv-30ffd34
    PYTHONPATH=$PWD python -m pytest -q -p no:cacheprovider /path/to/benchmarks/remote_attacks_30ffd34.py

Same assertions as tests/dataplane/test_remote_attacks.py on branch issue-14-store, with the old
server (python -m streams.remote_tier, tcp://) and its raw NKVR frames instead of Mooncake's.
Each test is expected to FAIL here.
"""
import os, socket, struct, sys, threading, time
import pytest, torch
from nexuskv.dataplane import PayloadHeader, PayloadKey, RemoteBackend, verify_payload
from nexuskv.dataplane.wire import Op, Status, pack_frame, read_frame_header, recv_exact
from nexuskv.errors import IntegrityError, TierFullError, TierUnavailableError
from streams.process import ManagedProcess, free_port

DID = "sd1-" + "a" * 32
MIB = 1 << 20


class Store:
    def __init__(self, tmp_path, capacity):
        self.address = f"tcp://127.0.0.1:{free_port()}"
        env = dict(os.environ, NEXUSKV_REMOTE_TIER_BYTES=str(capacity))
        self.proc = ManagedProcess([sys.executable, "-m", "streams.remote_tier", "--listen", self.address],
                                   name="old", log_path=tmp_path / "old.log", env=env)
        self.proc.start()
        deadline = time.monotonic() + 30
        while True:
            try:
                RemoteBackend(self.address, timeout_s=2).close(); break
            except TierUnavailableError:
                assert time.monotonic() < deadline; time.sleep(0.1)
        self.port = int(self.address.rsplit(":", 1)[1])

    def status(self, field):
        with open(f"/proc/{self.proc.pid}/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])

    def rss(self): return self.status("VmRSS") * 1024
    def threads(self): return self.status("Threads")


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path, 64 * MIB); yield s; s.proc.stop()


def _payload(key, n, seed=None):
    g = torch.Generator().manual_seed(key if seed is None else seed)
    d = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return PayloadHeader.for_data(PayloadKey(DID, key), d.numpy()), d


def test_5_a_delete_racing_a_read_never_yields_another_payloads_bytes(store):
    n = 4 * MIB
    ha, da = _payload(1, n)
    others = [_payload(100 + i, n) for i in range(4)]
    writer, reader = RemoteBackend(store.address, timeout_s=3), RemoteBackend(store.address, timeout_s=3)
    writer.put(ha, da)
    counts = {"verified": 0, "missed": 0, "foreign": 0}
    stop = threading.Event(); lock = threading.Lock()

    def read():
        out = torch.empty(n, dtype=torch.uint8)
        while not stop.is_set():
            try:
                h = reader.read_into(ha.key, out)
            except (IntegrityError, TierUnavailableError):
                h = None
            if h is None: kind = "missed"
            else:
                try: verify_payload(ha.key, h, out.numpy()); kind = "verified"
                except IntegrityError: kind = "foreign"
            with lock: counts[kind] += 1

    def write():
        i = 0
        while not stop.is_set():
            try:
                writer.delete(ha.key); hb, db = others[i % 4]; writer.put(hb, db); writer.put(ha, da); writer.delete(hb.key)
            except (TierUnavailableError, TierFullError): pass
            i += 1
    ts = [threading.Thread(target=read), threading.Thread(target=write)]
    [t.start() for t in ts]; time.sleep(8); stop.set(); [t.join(30) for t in ts]
    assert counts["foreign"] == 0, counts


def test_6_freed_and_rejected_saves_keep_no_memory(store):
    b = RemoteBackend(store.address)
    before = store.rss()
    for i in range(60):
        h, d = _payload(i, 6 * MIB + i * 4096, seed=1); b.put(h, d); assert b.delete(h.key)
    after = store.rss()
    assert after - before <= 64 * MIB + 48 * MIB, (before, after)


def test_6_half_sent_requests_allocate_nothing(store):
    before = store.rss()
    socks = []
    for _ in range(64):
        s = socket.create_connection(("127.0.0.1", store.port)); s.sendall(struct.pack(">4sB3xIQ", b"NKVR", 2, 1 << 24, 0)); socks.append(s)
    time.sleep(2)
    grown = store.rss() - before
    [s.close() for s in socks]
    assert grown <= 16 * MIB, grown


def test_6_idle_connections_cost_no_thread_each(store):
    t0 = store.threads()
    socks = [socket.create_connection(("127.0.0.1", store.port), timeout=2) for _ in range(600)]
    time.sleep(1)
    t1 = store.threads()
    [s.close() for s in socks]
    assert t1 <= t0 + 8, (t0, t1)


@pytest.mark.parametrize("descriptor", [b"", "d\u00e9j\u00e0".encode()])
def test_12_a_malformed_descriptor_id_gets_bad_request_not_a_dropped_connection(store, descriptor):
    s = socket.create_connection(("127.0.0.1", store.port), timeout=5)
    key = struct.pack(">I16s64s", 0, (1).to_bytes(16, "big"), descriptor)
    s.sendall(pack_frame(Op.HEAD, key))
    frame = read_frame_header(s)
    assert frame is not None, "connection dropped"
    assert frame[0] == Status.BAD_REQUEST
