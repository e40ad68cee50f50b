"""The request stream of a replay: which trace requests, their tokens, arrivals, and the warm-up.

A Mooncake trace carries no text: each 512-token hash id stands for a block *and its whole
prefix*, so equal ids are a reusable prefix. A replay turns each hash id into
``hash_block_tokens`` deterministic token ids (a generator seeded with the id), so prefix
sharing is kept exactly while prompts shrink by ``512 / hash_block_tokens``; ids 0-3 are left out
of the vocabulary (special tokens of the random models). Prompts are capped at
``max_prompt_tokens`` and every request generates ``max_output_tokens`` tokens (the trace's
output lengths, hundreds of tokens, would make CPU decode dominate what is measured).

Which requests: by default every turn of the trace's multi-turn conversations (a conversation is
keyed by its second hash id; the first is the trace's shared system prompt), in time order, from
the whole trace, until the cap; the rest are *skipped* and counted. ``conversations=N`` takes the
first N such conversations instead; ``follow_ups=False`` takes the trace's first requests as they
come. Arrivals follow the trace's timestamps divided by ``time_scale``, with idle gaps longer
than ``max_gap_s`` shortened to it (a selection drops the requests between two turns, which
would otherwise leave the engines idle for minutes). The first ``warmup`` requests are the
warm-up: served one after another (each prefill alone on its engine), recorded, and excluded
from the figures (the cost model learns the engines on them); the measured requests then arrive
at their trace offsets from the first measured one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from streams.app.traces import HASH_BLOCK_TOKENS, TraceRequest

__all__ = ["ReplayRequest", "Workload", "WorkloadShape", "build_workload"]

FIRST_TOKEN_ID = 4  # 0-3: the random models' special tokens (streams.app.tiny_model.SPECIAL_TOKENS)


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    seq: int
    arrival_s: float  # seconds after the replay's first request
    tokens: tuple[int, ...]
    output_tokens: int
    warmup: bool
    conversation: int | None  # the trace's second hash id, when the request has one

    @property
    def request_id(self) -> str:
        """The request's id in both runs (the decision store joins the runs on it)."""
        return f"r{self.seq:05d}"


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    max_requests: int = 48
    conversations: int = 0  # > 0: the first N multi-turn conversations (every turn)
    follow_ups: bool = True  # False: the trace's first requests, as they come
    hash_block_tokens: int = 32
    max_prompt_tokens: int = 2048
    max_output_tokens: int = 8
    time_scale: float = 6.0
    max_gap_s: float = 4.0
    warmup: int = 12
    vocab: int = 1024


@dataclass(frozen=True, slots=True)
class Workload:
    requests: tuple[ReplayRequest, ...]
    trace_requests: int
    skipped: int
    shape: WorkloadShape

    @property
    def measured(self) -> tuple[ReplayRequest, ...]:
        return tuple(r for r in self.requests if not r.warmup)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.requests)

    def describe(self) -> str:
        s = self.shape
        return (f"{len(self.requests)} of the trace's {self.trace_requests} requests ({self.skipped} skipped; "
                f"cap {s.max_requests}: --requests), {len(self.requests) - len(self.measured)} of them warm-up, "
                f"{self.prompt_tokens} prompt tokens ({s.hash_block_tokens} per trace block, at most "
                f"{s.max_prompt_tokens} per prompt), {s.max_output_tokens} output tokens each, arrivals over "
                f"{self.requests[-1].arrival_s if self.requests else 0:.0f} s")


def _conversation(r: TraceRequest) -> int | None:
    return r.hash_ids[1] if len(r.hash_ids) > 1 else None


def _select(trace: list[TraceRequest], shape: WorkloadShape) -> list[TraceRequest]:
    if not shape.follow_ups and shape.conversations <= 0:
        return trace[: shape.max_requests]
    turns: dict[int, int] = {}
    for r in trace:
        c = _conversation(r)
        if c is not None:
            turns[c] = turns.get(c, 0) + 1
    multi = [c for c in dict.fromkeys(_conversation(r) for r in trace) if c is not None and turns[c] >= 2]
    if shape.conversations > 0:
        multi = multi[: shape.conversations]
    chosen: set[int] = set()
    total = 0
    for c in multi:  # whole conversations, in order of first appearance, while they fit the cap
        if total + turns[c] > shape.max_requests:
            if total == 0:
                chosen.add(c)
            break
        chosen.add(c)
        total += turns[c]
    return [r for r in trace if _conversation(r) in chosen][: shape.max_requests]


def _tokens(r: TraceRequest, shape: WorkloadShape) -> tuple[int, ...]:
    out: list[int] = []
    for h in r.hash_ids:
        out.extend(np.random.default_rng(h).integers(FIRST_TOKEN_ID, shape.vocab, shape.hash_block_tokens).tolist())
    n = min(len(out), max(1, r.input_length * shape.hash_block_tokens // HASH_BLOCK_TOKENS), shape.max_prompt_tokens)
    return tuple(out[:n])


def build_workload(trace: list[TraceRequest], shape: WorkloadShape) -> Workload:
    picked = _select(trace, shape)
    requests: list[ReplayRequest] = []
    clock, last_ms = 0.0, None
    for i, r in enumerate(picked):
        if last_ms is not None:
            clock += min(shape.max_gap_s, max(0.0, (r.timestamp_ms - last_ms) / 1000.0 / shape.time_scale))
        last_ms = r.timestamp_ms
        requests.append(ReplayRequest(seq=i, arrival_s=clock, tokens=_tokens(r, shape),
                                      output_tokens=shape.max_output_tokens, warmup=i < shape.warmup,
                                      conversation=_conversation(r)))
    return Workload(tuple(requests), len(trace), len(trace) - len(picked), shape)
