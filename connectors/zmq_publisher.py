"""An engine-side KV-event publisher that speaks vLLM's and SGLang's ZMQ protocol.

It behaves like vLLM's ``ZmqEventPublisher`` (``../shared/reference/engines.md`` §1.3-1.4): a PUB
socket sends ``[topic, seq, payload]`` per batch with ``seq`` counting from 0, a bounded buffer
keeps the last ``buffer_steps`` batches, and a ROUTER socket answers replay requests
``[identity, b"", start_seq]`` with every buffered batch from ``start_seq`` then ``END_SEQ``, in
the reply shape of the chosen engine version. Payloads are encoded by
:mod:`connectors.wire_formats` in that version's exact format.

NexusKV's reference engine uses it to stand in for a vLLM or SGLang engine on real sockets;
``skip()`` buffers a batch without sending it, which is how a test makes a deliberate gap.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

import zmq

from connectors.kv_wire import EngineEvent
from connectors.wire_formats import WireFormat, encode_batch
from connectors.zmq_events import END_SEQ

__all__ = ["EngineEventPublisher"]


class EngineEventPublisher:
    """PUB + ROUTER replay, one engine (data-parallel rank) per instance."""

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 fmt: WireFormat = "vllm-0.33", buffer_steps: int = 10_000, data_parallel_rank: int | None = 0,
                 replay_with_topic: bool | None = None, hwm: int = 100_000) -> None:
        self.topic = topic.encode("utf-8")
        self.fmt = fmt
        self.data_parallel_rank = data_parallel_rank
        # vLLM >= 0.26 and SGLang >= 0.5.22 put the topic in replay replies.
        self.replay_with_topic = fmt in ("vllm-0.33", "sglang-0.5.23") if replay_with_topic is None else replay_with_topic
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._seq = 0
        self._stop = threading.Event()
        self.replay_endpoint: str | None = None
        self._thread: threading.Thread | None = None
        if replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
            router.setsockopt(zmq.LINGER, 0)
            router.bind(replay_endpoint)
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve_replay, args=(router,), name="kv-replay", daemon=True)
            self._thread.start()

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: Sequence[EngineEvent], *, ts: float) -> int:
        """Encode, buffer and send one batch; returns its sequence number."""
        seq, payload = self._buffer_batch(events, ts)
        self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def skip(self, events: Sequence[EngineEvent], *, ts: float) -> int:
        """Buffer a batch for replay without sending it: a deliberate, repairable gap."""
        seq, _ = self._buffer_batch(events, ts)
        return seq

    def _buffer_batch(self, events: Sequence[EngineEvent], ts: float) -> tuple[int, bytes]:
        payload = encode_batch(list(events), fmt=self.fmt, ts=ts, data_parallel_rank=self.data_parallel_rank)
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
        return seq, payload

    def _serve_replay(self, router: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not dict(poller.poll(100)):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                    continue  # vLLM logs and ignores anything else
                identity, start = frames[0], int.from_bytes(frames[2], "big")
                with self._lock:
                    todo = [(s, p) for s, p in self._buffer if s >= start]
                for seq, payload in todo:
                    head = [identity, b"", self.topic] if self.replay_with_topic else [identity, b""]
                    router.send_multipart(head + [seq.to_bytes(8, "big"), payload])
                tail = [identity, b"", b""] if self.replay_with_topic else [identity, b""]
                router.send_multipart(tail + [END_SEQ, b""])
        finally:
            router.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        self._pub.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> EngineEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _event_from_json(item: dict) -> EngineEvent:
    from connectors.kv_wire import EngineCleared, EngineRemoved, EngineStored

    kind = item["type"]
    if kind == "stored":
        return EngineStored(block_hashes=tuple(item["hashes"]), parent_block_hash=item.get("parent"),
                            token_ids=tuple(item.get("tokens", ())), block_size=item["block_size"],
                            medium=item.get("medium", "GPU"), group_idx=item.get("group"))
    if kind == "removed":
        return EngineRemoved(block_hashes=tuple(item["hashes"]), medium=item.get("medium", "GPU"),
                             group_idx=item.get("group"))
    return EngineCleared()


def main(argv: list[str] | None = None) -> int:
    """Replay a scripted engine: ``python -m connectors.zmq_publisher SCRIPT.jsonl``.

    Each line is ``{"events": [...], "skip": bool, "ts": float}``. The publisher binds, prints
    ``READY <pub endpoint> <replay endpoint>``, waits for ``go`` on stdin, publishes every line
    (``skip`` lines are buffered but not sent: a deliberate gap), prints ``DONE <next seq>`` and
    keeps serving replay until stdin closes. It stands in for a vLLM engine in the live tests and
    demos (a restart is simply a new process on the same endpoints).
    """
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser(prog="python -m connectors.zmq_publisher")
    ap.add_argument("script")
    ap.add_argument("--endpoint", default="tcp://127.0.0.1:*")
    ap.add_argument("--replay-endpoint", default="tcp://127.0.0.1:*")
    ap.add_argument("--topic", default="kv@sim-0@sim-model")
    ap.add_argument("--format", default="vllm-0.33")
    args = ap.parse_args(argv)
    lines = [json.loads(line) for line in open(args.script, encoding="utf-8") if line.strip()]
    with EngineEventPublisher(args.endpoint, replay_endpoint=args.replay_endpoint, topic=args.topic,
                              fmt=args.format) as pub:
        print(f"READY {pub.endpoint} {pub.replay_endpoint}", flush=True)
        sys.stdin.readline()
        for line in lines:
            events = [_event_from_json(e) for e in line["events"]]
            (pub.skip if line.get("skip") else pub.publish)(events, ts=float(line.get("ts", 0.0)))
        print(f"DONE {pub.next_seq}", flush=True)
        sys.stdin.read()  # serve replay until the parent closes stdin
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
