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

**The skewed shape** (``hot > 0``; ``nexuskv replay --shape skewed``): a workload where state must
move. The ``hot`` conversations of the trace with the most turns (ties: first seen) all begin
with one shared prefix of ``shared_prefix_blocks`` trace blocks (a long system prompt or document,
its tokens seeded apart from every trace id) in front of their own blocks. Their first turns, the
*openers*, arrive ``opener_gap_s`` apart (each prefill done before the next arrives), so a
prefix-aware router puts every one of them on the engine that already holds the shared prefix:
every hot history lives on one worker. Then the rest of their turns arrive as a *burst*, round
robin over the conversations, ``burst_gap_s`` apart: routing each turn to its history's worker
queues there while the other engines idle, and recomputing a long history elsewhere is slow, so
the history should move. The warm-up is the trace's first ``warmup`` requests outside the hot
conversations (no shared prefix), one after another as in the default shape. Arrivals come from
the shape, not the trace's clock (the trace's turns are minutes apart).
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
    # The skewed shape (hot > 0): see the module's docstring.
    hot: int = 0
    shared_prefix_blocks: int = 32
    opener_gap_s: float = 2.5
    burst_gap_s: float = 0.15

    @property
    def name(self) -> str:
        return "skewed" if self.hot > 0 else "default"


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


SHARED_PREFIX_SEED = 1 << 40  # above every trace hash id: the shared prefix's blocks are nobody else's


def _block(seed: int, shape: WorkloadShape) -> list[int]:
    return np.random.default_rng(seed).integers(FIRST_TOKEN_ID, shape.vocab, shape.hash_block_tokens).tolist()


def _tokens(r: TraceRequest, shape: WorkloadShape, *, shared_prefix: bool = False) -> tuple[int, ...]:
    out: list[int] = []
    if shared_prefix:
        for b in range(shape.shared_prefix_blocks):
            out.extend(_block(SHARED_PREFIX_SEED + b, shape))
    for h in r.hash_ids:
        out.extend(_block(h, shape))
    own = max(1, r.input_length * shape.hash_block_tokens // HASH_BLOCK_TOKENS)
    extra = shape.shared_prefix_blocks * shape.hash_block_tokens if shared_prefix else 0
    n = min(len(out), own + extra, shape.max_prompt_tokens)
    return tuple(out[:n])


def _skewed(trace: list[TraceRequest], shape: WorkloadShape) -> list[tuple[TraceRequest, float, bool, bool]]:
    """(request, arrival, warm-up, shared prefix) of the skewed shape, in arrival order."""
    turns: dict[int, list[TraceRequest]] = {}
    for r in trace:
        c = _conversation(r)
        if c is not None:
            turns.setdefault(c, []).append(r)
    multi = [c for c, rs in turns.items() if len(rs) >= 2]
    hot = sorted(multi, key=lambda c: -len(turns[c]))[: shape.hot]  # stable: ties keep first-seen order
    hot = [c for c in multi if c in set(hot)]
    warm = [r for r in trace if _conversation(r) not in set(hot)][: shape.warmup]
    out: list[tuple[TraceRequest, float, bool, bool]] = [(r, 0.0, True, False) for r in warm]
    clock = 0.0
    for k, c in enumerate(hot):  # the openers, one at a time
        clock = k * shape.opener_gap_s
        out.append((turns[c][0], clock, False, True))
    rest = max((len(turns[c]) for c in hot), default=0)
    burst = [turns[c][j] for j in range(1, rest) for c in hot if j < len(turns[c])]
    for k, r in enumerate(burst):
        out.append((r, clock + shape.opener_gap_s + k * shape.burst_gap_s, False, True))
    return out[: shape.max_requests]


def build_workload(trace: list[TraceRequest], shape: WorkloadShape) -> Workload:
    if shape.hot > 0:
        picked = _skewed(trace, shape)
        requests = tuple(ReplayRequest(seq=i, arrival_s=at, tokens=_tokens(r, shape, shared_prefix=shared),
                                       output_tokens=shape.max_output_tokens, warmup=warm, conversation=_conversation(r))
                         for i, (r, at, warm, shared) in enumerate(picked))
        return Workload(requests, len(trace), len(trace) - len(picked), shape)
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
