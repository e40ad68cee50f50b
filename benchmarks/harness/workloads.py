"""Seeded request streams: Mooncake trace replay and the workload shapes of whitepaper §10.2.

A request is a list of *pieces* — ``(segment id, tokens)`` — whose token ids are drawn from a
generator seeded with the segment id (so equal segments are equal text, and the chained canonical
block keys reproduce exactly the prefix sharing the stream describes), plus its arrival time,
tenant, LoRA adapter, output length and workload label.

* **Trace replay** (:func:`trace_workload`). A Mooncake FAST'25 hash id stands for a 512-token
  block and its whole prefix; each becomes one piece (the last one partial), so the 16-token keys
  chain exactly as :mod:`benchmarks.trace_events` does. Arrival = trace timestamp / ``time_scale``
  (``time_scale`` > 1 compresses time: the trace's requests arrive faster, the cluster works harder).
* **Shapes** (:func:`shapes_workload`). Sessions of each §10.2 shape — shared system prompt,
  multi-turn chat, RAG documents, branching agent history, no-reuse control — each at a matrix
  point (context 8K / 32K / 128K tokens, prefix reuse 0 / 25 / 50 / 75 / 90 / 100 %), interleaved
  on a Poisson (or bursty) arrival process. The reuse point is the share of a request's prompt
  that an *earlier request of its session* already computed; the first request of a session
  has none. Three tenants share some system prompts token for token and a quarter of the system
  prompt sessions use a LoRA adapter, so identity (not text) decides what may be reused.
* **No-reuse control** (:func:`no_reuse_workload`): every prompt unique.

Everything is a pure function of its arguments and ``seed``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from benchmarks.trace_events import BLOCK_TOKENS, HASH_BLOCK_TOKENS, VOCAB, load_trace

__all__ = ["Request", "Workload", "SHAPES", "CONTEXT_POINTS", "REUSE_POINTS", "segment_tokens", "prompt_tokens",
           "trace_workload", "shapes_workload", "no_reuse_workload"]

SHAPES = ("system_prompt", "multi_turn", "rag", "agent_branch", "no_reuse")
CONTEXT_POINTS = (8192, 32768, 131072)
REUSE_POINTS = (0.0, 0.25, 0.5, 0.75, 0.9, 1.0)
TENANTS = ("tenant-a", "tenant-b", "tenant-c")
TRACE_TENANT = "trace"
LORA = "adapter-1"
_SHAPE_SEGMENTS = 1 << 40  # generated segment ids start here (Mooncake hash ids are small)


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a stream (token ids are derived from ``pieces``, never stored)."""

    request_id: str
    arrival_s: float  # seconds from the start of the stream
    tenant: str
    lora: str | None
    pieces: tuple[tuple[int, int], ...]  # (segment id, tokens), prompt order
    output_tokens: int
    workload: str  # shape label, or the trace's name
    context_point: int | None = None  # the §10.2 matrix point it was generated for
    reuse_point: float | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(n for _s, n in self.pieces)

    @property
    def blocks(self) -> int:
        """Full 16-token blocks (what is cached and keyed)."""
        return self.prompt_tokens // BLOCK_TOKENS


@dataclass(frozen=True, slots=True)
class Workload:
    """A request stream and how it was made (for the reproducibility record)."""

    name: str
    requests: tuple[Request, ...]
    source: str  # trace file, or generator and seed
    arrival: str  # the arrival process, in words
    time_scale: float = 1.0
    params: dict = field(default_factory=dict)

    def describe(self) -> dict:
        """Context and output lengths, the reuse points and labels, tenants: record fields."""
        prompts = np.array([r.prompt_tokens for r in self.requests], dtype=np.int64)
        outputs = np.array([r.output_tokens for r in self.requests], dtype=np.int64)
        span = (self.requests[-1].arrival_s - self.requests[0].arrival_s) if self.requests else 0.0

        def stats(a: np.ndarray) -> dict:
            if not len(a):
                return {}
            return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
                    "min": int(a.min()), "max": int(a.max())}

        labels: dict[str, int] = {}
        points: dict[str, int] = {}
        for r in self.requests:
            labels[r.workload] = labels.get(r.workload, 0) + 1
            if r.reuse_point is not None:
                key = f"{r.context_point // 1024}K@{round(r.reuse_point * 100)}%"
                points[key] = points.get(key, 0) + 1
        return {"requests": len(self.requests), "span_s": span,
                "rate_per_s": len(self.requests) / span if span > 0 else None,
                "prompt_tokens": stats(prompts), "output_tokens": stats(outputs), "labels": labels,
                "matrix_points": dict(sorted(points.items())),
                "tenants": sorted({r.tenant for r in self.requests}),
                "lora_requests": sum(1 for r in self.requests if r.lora is not None)}


@lru_cache(maxsize=16384)
def _segment(segment_id: int, length: int) -> np.ndarray:
    tokens = np.random.default_rng(segment_id).integers(0, VOCAB, length, dtype=np.uint32)
    tokens.setflags(write=False)
    return tokens


def segment_tokens(segment_id: int, length: int) -> np.ndarray:
    """The ``length`` token ids of a segment (the same ids every time; read-only)."""
    return _segment(segment_id, length)


def prompt_tokens(request: Request) -> np.ndarray:
    """All token ids of a request's prompt (uint32)."""
    parts = [segment_tokens(s, n) for s, n in request.pieces if n > 0]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint32)


# -- trace replay -------------------------------------------------------------------------------------

def trace_workload(path: Path, *, requests: int | None, time_scale: float = 1.0, name: str | None = None) -> Workload:
    """The first ``requests`` requests of a Mooncake trace; arrival = timestamp / ``time_scale``."""
    if time_scale <= 0:
        raise ValueError(f"time_scale: {time_scale} is not positive")
    rows = load_trace(path, limit=requests)
    label = name or path.stem.removesuffix("_trace").split("_head")[0]
    out = []
    for i, row in enumerate(rows):
        ids = row.hash_ids
        if not ids:
            continue
        tokens = min(row.input_length, HASH_BLOCK_TOKENS * len(ids))
        last = tokens - HASH_BLOCK_TOKENS * (len(ids) - 1)
        pieces = tuple((h, HASH_BLOCK_TOKENS) for h in ids[:-1]) + (((ids[-1], last),) if last > 0 else ())
        out.append(Request(f"{label}-{i:06d}", row.timestamp_ms / 1000.0 / time_scale, TRACE_TENANT, None, pieces,
                           max(1, row.output_length), label))
    scale = "" if time_scale == 1 else f", time compressed {time_scale:g}x"
    return Workload(label, tuple(out), source=str(path), arrival=f"trace replay (timestamps{scale})",
                    time_scale=time_scale, params={"requests": len(out)})


# -- generated shapes ---------------------------------------------------------------------------------

class _Ids:
    """Fresh segment ids, deterministic in order of use."""

    def __init__(self, start: int) -> None:
        self.next = start

    def __call__(self) -> int:
        self.next += 1
        return self.next


def _pieces(*parts: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    return tuple((s, n) for s, n in parts if n > 0)


def _session(shape: str, context: int, reuse: float, tenant: str, size: int, rng: np.random.Generator, ids: _Ids,
             shared: dict) -> tuple[str | None, list[tuple[tuple[int, int], ...]]]:
    """One session's prompts, in order, and its LoRA adapter."""
    new = round((1.0 - reuse) * context)
    kept = context - new
    lora = None
    prompts: list[tuple[tuple[int, int], ...]] = []
    if shape == "system_prompt":
        # A few templates per matrix point, shared by every tenant token for token.
        template = int(rng.integers(0, 2))
        sys_id = shared.setdefault(("sys", context, reuse, template), ids())
        lora = LORA if rng.random() < 0.25 else None
        prompts = [_pieces((sys_id, kept), (ids(), new)) for _ in range(size)]
    elif shape == "multi_turn":
        # Turn k's prompt is turn k-1's plus new text: contexts context*reuse^(T-1-k), each
        # turn reusing `reuse` of its prompt; the last turn is at the matrix point.
        turns = []
        for k in range(size):
            target = round(context * reuse ** (size - 1 - k)) if reuse > 0 else (context if k == size - 1 else 0)
            turns.append(target)
        history: tuple[tuple[int, int], ...] = ()
        have = 0
        for target in turns:
            grow = max(0, target - have)
            if target < BLOCK_TOKENS and grow == 0:
                continue
            history = history + _pieces((ids(), grow))
            have += grow
            if have >= BLOCK_TOKENS:
                prompts.append(history)
    elif shape == "rag":
        sys_id = shared.setdefault(("rag-sys", tenant), ids())
        sys_len = min(512, kept)
        docs = [shared.setdefault(("doc", context, reuse, j), ids()) for j in range(8)]
        weights = 1.0 / np.arange(1, 9) ** 1.2
        for _ in range(size):
            doc = docs[int(rng.choice(8, p=weights / weights.sum()))]
            prompts.append(_pieces((sys_id, sys_len), (doc, kept - sys_len), (ids(), new)))
    elif shape == "agent_branch":
        base = round(0.6 * kept)
        branches = [ids() for _ in range(3)]
        root = ids()
        for _ in range(size):
            prompts.append(_pieces((root, base), (branches[int(rng.integers(0, 3))], kept - base), (ids(), new)))
    elif shape == "no_reuse":
        prompts = [_pieces((ids(), context)) for _ in range(size)]
    else:
        raise ValueError(f"shape: {shape!r} is not one of {SHAPES}")
    return lora, prompts


def _arrivals(count: int, rate_per_s: float, process: str, rng: np.random.Generator) -> np.ndarray:
    if rate_per_s <= 0:
        raise ValueError(f"rate_per_s: {rate_per_s} is not positive")
    if process == "poisson":
        gaps = rng.exponential(1.0 / rate_per_s, count)
    elif process == "burst":
        # Bursts of 8 back-to-back arrivals (1 ms apart), the bursts Poisson at rate/8: same mean rate.
        gaps = np.where(np.arange(count) % 8 == 0, rng.exponential(8.0 / rate_per_s, count), 0.001)
    else:
        raise ValueError(f"arrival: {process!r} is not 'poisson' or 'burst'")
    gaps[0] = 0.0
    return np.cumsum(gaps)


def shapes_workload(*, requests: int, seed: int, rate_per_s: float, arrival: str = "poisson",
                    shapes: Sequence[str] = SHAPES, contexts: Sequence[int] = CONTEXT_POINTS,
                    context_weights: Sequence[float] = (0.55, 0.35, 0.10), reuse_points: Sequence[float] = REUSE_POINTS,
                    session_size: int = 6, output_tokens: int = 256) -> Workload:
    """``requests`` requests of the §10.2 shapes at the matrix points, sessions interleaved.

    Each session draws its shape (uniformly), context point (by ``context_weights``: long
    prompts are costly to simulate as well as to serve) and reuse point (uniformly; the no-reuse
    control is always 0 %). Arrivals follow ``arrival`` at ``rate_per_s``; each arrival is the next
    request of a session drawn among the open ones, so sessions overlap in time.
    """
    if len(contexts) != len(context_weights):
        raise ValueError("context_weights: one weight per context point")
    rng = np.random.default_rng(seed)
    ids = _Ids(_SHAPE_SEGMENTS + (seed % 1024) * (1 << 30))
    shared: dict = {}
    cw = np.asarray(context_weights, dtype=float) / sum(context_weights)
    pending: list[list] = []  # open sessions: [shape, context, reuse, tenant, lora, prompts, next]
    out: list[Request] = []
    times = _arrivals(requests, rate_per_s, arrival, rng)
    while len(out) < requests:
        while len(pending) < 8:
            shape = shapes[int(rng.integers(0, len(shapes)))]
            context = int(contexts[int(rng.choice(len(contexts), p=cw))])
            reuse = 0.0 if shape == "no_reuse" else float(reuse_points[int(rng.integers(0, len(reuse_points)))])
            tenant = TENANTS[int(rng.integers(0, len(TENANTS)))]
            lora, prompts = _session(shape, context, reuse, tenant, session_size, rng, ids, shared)
            if prompts:
                pending.append([shape, context, reuse, tenant, lora, prompts, 0])
        k = int(rng.integers(0, len(pending)))
        shape, context, reuse, tenant, lora, prompts, nxt = pending[k]
        i = len(out)
        out.append(Request(f"shapes-{i:06d}", float(times[i]), tenant, lora, prompts[nxt],
                           max(1, int(rng.poisson(output_tokens))), shape, context, reuse))
        pending[k][6] += 1
        if pending[k][6] >= len(prompts):
            pending.pop(k)
    return Workload("shapes", tuple(out), source=f"generated: shapes_workload(seed={seed})",
                    arrival=f"{arrival}, {rate_per_s:.3g} requests/s", params={
                        "seed": seed, "rate_per_s": rate_per_s, "shapes": list(shapes), "contexts": list(contexts),
                        "context_weights": list(context_weights), "reuse_points": list(reuse_points),
                        "session_size": session_size, "output_tokens": output_tokens})


def no_reuse_workload(*, requests: int, seed: int, rate_per_s: float, context: int = 8192,
                      output_tokens: int = 256) -> Workload:
    """The no-reuse control: ``requests`` unique prompts of ``context`` tokens, Poisson arrivals."""
    rng = np.random.default_rng(seed)
    ids = _Ids(_SHAPE_SEGMENTS + (1 << 39) + (seed % 1024) * (1 << 30))
    times = _arrivals(requests, rate_per_s, "poisson", rng)
    out = tuple(Request(f"control-{i:06d}", float(times[i]), TENANTS[i % len(TENANTS)], None, ((ids(), context),),
                        max(1, int(rng.poisson(output_tokens))), "no_reuse", context, 0.0) for i in range(requests))
    return Workload("no-reuse-control", out, source=f"generated: no_reuse_workload(seed={seed})",
                    arrival=f"poisson, {rate_per_s:.3g} requests/s",
                    params={"seed": seed, "rate_per_s": rate_per_s, "context": context})
