"""Per-publisher sequence, incarnation and certainty: whether a kv-events batch applies, and what
the index may believe about a publisher's facts afterwards.

Per publisher: a batch whose ``seq`` was already applied (same incarnation) is a *duplicate* and
ignored, as is a batch of an older incarnation (*stale*); that makes at-least-once redelivery
harmless. A gap in ``seq``, a publisher first seen at ``seq > 0``, or a new incarnation makes the
publisher *uncertain*: its facts are kept, but every match it contributes is reported
``certain=False`` (the planner treats it as a miss), until it resyncs: an ``AllCleared`` for
every tier, or a ``Snapshot`` ``end`` after a ``begin`` with no gap in between. Decision:
certainty is per publisher, so facts stored *after* a gap are uncertain too (see
:mod:`nexuskv.index`).

**Bounded jumps.** A known publisher's sequence number may move forward by at most
:data:`MAX_SEQ_JUMP` in one batch, and its incarnation by at most :data:`MAX_INCARNATION_JUMP`
(incarnations are nanosecond clocks or counters; 2**56 ns is 2.3 years), and a publisher is first
seen at a sequence number of at most :data:`MAX_FIRST_SEQ`. A batch beyond any of these is
*refused*: not applied, the sequence does not move, and the publisher becomes uncertain (the
refused batch may have carried removals). Without the bound one batch claiming seq or incarnation
2**62 would make every later genuine batch of that publisher a duplicate or stale, for good. A
first sight's incarnation has nothing to be compared with: only authenticated publishing
(:mod:`nexuskv.contracts.kv_signature`) keeps a stranger from claiming a publisher's name first.

Pure bookkeeping: :class:`Publishers` says what a batch is (:meth:`Publishers.admit`) and moves
the certainty state; the index does what that implies to its facts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from nexuskv.descriptor import Tier

__all__ = ["Admission", "PublisherState", "PublisherStatus", "Publishers", "MAX_SEQ_JUMP", "MAX_INCARNATION_JUMP",
           "MAX_FIRST_SEQ"]

Admission = Literal["applied", "duplicate", "stale", "refused"]
MAX_SEQ_JUMP = 1 << 32
MAX_INCARNATION_JUMP = 1 << 56
MAX_FIRST_SEQ = 1 << 48  # a publisher first seen beyond this is refused (no state is created)


@dataclass(frozen=True, slots=True)
class PublisherStatus:
    publisher: str
    incarnation: int
    next_seq: int
    certain: bool
    reason: str | None  # why it is uncertain (None when certain)
    in_snapshot: bool


@dataclass(slots=True)
class PublisherState:
    """One publisher as the index tracks it (mutable: the index's own working state)."""

    pid: int
    name: str
    incarnation: int
    next_seq: int
    certain: bool = True
    reason: str | None = None
    in_snapshot: bool = False
    snapshot_clean: bool = False
    locs: dict[tuple[Tier, int], int] = field(default_factory=dict)  # (tier, group) -> location id
    worker: str | None = None  # the engine worker its locations belong to (None: its own name)
    mask: int = 0  # bits of every location of this publisher

    @property
    def tag(self) -> int:
        return self.pid + 1

    def status(self) -> PublisherStatus:
        return PublisherStatus(self.name, self.incarnation, self.next_seq, self.certain, self.reason,
                               self.in_snapshot)


class Publishers:
    """Every publisher seen, by name and by dense id; counts gaps and resyncs."""

    __slots__ = ("by_name", "by_id", "gaps", "resyncs")

    def __init__(self) -> None:
        self.by_name: dict[str, PublisherState] = {}
        self.by_id: list[PublisherState] = []
        self.gaps = 0
        self.resyncs = 0

    def get(self, name: str) -> PublisherState | None:
        return self.by_name.get(name)

    def add(self, name: str, *, incarnation: int = 0, next_seq: int = 0) -> PublisherState:
        pub = PublisherState(pid=len(self.by_id), name=name, incarnation=incarnation, next_seq=next_seq)
        self.by_name[name] = pub
        self.by_id.append(pub)
        return pub

    def __len__(self) -> int:
        return len(self.by_id)

    def admit(self, name: str, incarnation: int, seq: int) -> tuple[PublisherState | None, Admission]:
        """Whether batch ``seq`` of ``incarnation`` applies; on "applied" the sequence has advanced.
        The state is None only for a refused first sight (nothing was created)."""
        pub = self.by_name.get(name)
        if pub is None:
            if seq > MAX_FIRST_SEQ:
                return None, "refused"
            pub = self.add(name, incarnation=incarnation, next_seq=seq)
            if seq != 0:
                self.uncertain(pub, f"first seen at seq {seq}")
        elif incarnation < pub.incarnation:
            return pub, "stale"
        elif incarnation - pub.incarnation > MAX_INCARNATION_JUMP:
            self.uncertain(pub, f"refused incarnation jump from {pub.incarnation} to {incarnation}")
            return pub, "refused"
        elif incarnation == pub.incarnation and seq - pub.next_seq > MAX_SEQ_JUMP:
            self.uncertain(pub, f"refused sequence jump from {pub.next_seq} to {seq}")
            return pub, "refused"
        elif incarnation > pub.incarnation:
            pub.incarnation = incarnation
            self.uncertain(pub, f"new incarnation {incarnation}")
        elif seq < pub.next_seq:
            return pub, "duplicate"
        elif seq > pub.next_seq:
            self.uncertain(pub, f"sequence gap: expected {pub.next_seq}, got {seq}")
        pub.next_seq = seq + 1
        return pub, "applied"

    def uncertain(self, pub: PublisherState, reason: str) -> None:
        self.gaps += 1
        pub.certain = False
        pub.reason = reason
        pub.snapshot_clean = False

    def certain(self, pub: PublisherState) -> None:
        if not pub.certain:
            self.resyncs += 1
        pub.certain, pub.reason, pub.in_snapshot = True, None, False

    def snapshot(self, pub: PublisherState, phase: Literal["begin", "end"]) -> bool:
        """Move through a snapshot; True when the publisher's facts must be dropped first (a begin)."""
        if phase == "begin":
            if pub.certain:
                pub.certain, pub.reason = False, "snapshot in progress"
            pub.in_snapshot, pub.snapshot_clean = True, True
            return True
        if pub.in_snapshot and pub.snapshot_clean:
            self.certain(pub)
        else:
            pub.in_snapshot = False  # an end without a clean begin: stays as it is
        return False
