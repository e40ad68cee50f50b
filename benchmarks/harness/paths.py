"""What a policy decides for a request (a :class:`Choice`) and what then really happened (an :class:`Outcome`).

A choice names the worker that runs the request and, optionally, one copy of a prefix extent
into that worker's GPU (a :class:`Move` from a :class:`Place`). Whatever the choice, the worker's
engine also consumes its own GPU prefix cache (when :attr:`ExecMode.local_reuse` is on): the engine
keeps final authority over its memory, a planner only adds state to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from nexuskv.descriptor import Tier

__all__ = ["Place", "Move", "Choice", "ExecMode", "Outcome"]


class Place(NamedTuple):
    """Where a copy of state lives: a worker's tier, or the shared store (worker ``STORE``)."""

    worker: str
    tier: Tier

    def __str__(self) -> str:
        return f"{self.worker}/{self.tier.value}"


class Move(NamedTuple):
    """Copy blocks ``[start, end)`` of the prompt from ``source`` to the worker's GPU.

    ``blocks`` is how many of them are copied (fewer than ``end - start`` when the destination
    already holds some beyond its prefix).
    """

    source: Place
    start: int
    end: int
    blocks: int


@dataclass(frozen=True, slots=True)
class Choice:
    """A policy's decision for one request."""

    worker: str
    move: Move | None = None
    action: str = "recompute"  # the planner's action, or what the policy did in its words
    predicted_eg_s: float | None = None  # what the policy expected to gain (None: it does not predict)
    deadline_at: float | None = None  # the copy is abandoned if not done by then (None: waited for)


@dataclass(frozen=True, slots=True)
class ExecMode:
    """How the data plane and engine behave in one run (the mechanism ablations switch these)."""

    local_reuse: bool = True  # the engine consumes its own GPU prefix cache
    async_copy: bool = True  # copies start at admission, overlapping the queue (False: when scheduled)
    layerwise: bool = True  # a copy may overlap the prefill of the layers that already arrived
    fallback: bool = True  # a copy late for its deadline is abandoned and the request recomputes


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the choice truly cost (seconds) and what it truly reused (blocks)."""

    worker: str
    reused_blocks: int
    unsafe_blocks: int  # reused blocks holding another identity's state (only without validation)
    moved_blocks: int
    moved_bytes: int
    link: str | None  # the copy's link kind (None: no copy)
    queue_s: float  # waiting for the worker
    visible_transfer_s: float  # what the copy added to the wait
    transfer_s: float  # the copy's own duration
    prefill_s: float  # the prefill job: compute, decode interference, restore, sync, copy interference
    ttft_s: float  # arrival to first token, simulated (planning time not included)
    start: float
    end: float
    ready: float  # when the prefill may start (its copy in, or the copy given up)
    copy_start: float | None
    copy_end: float | None  # when the copy finished, failed or was abandoned
    copy_status: str | None  # "completed", "not_found" or "abandoned"
    fallback: str | None  # why the request recomputed what it planned to reuse
    uncached_tokens: int
    compute_s: float  # the compute part of prefill_s (what a prefill observation measures)
