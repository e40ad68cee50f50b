"""``nexuskv.transfers`` and ``nexuskv.transfer-results``: movement commands and outcomes.

A command (keyed by destination worker) asks an executor to copy blocks of one descriptor
from a source location to a destination location before a deadline. A result (keyed by request
id) reports what *happened*: only ``completed`` means bytes arrived and verified. Intent is
never reported as completion; a cancelled, late, corrupt or rejected transfer says so, and the
request recomputes.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field, model_validator

from nexuskv.contract import Contract, Key128
from nexuskv.entries import EntryLocation

__all__ = ["SCHEMA_VERSION", "TransferKind", "TransferStatus", "TransferCommand", "TransferResult", "executor_of",
           "result_mismatch"]

SCHEMA_VERSION = 1
Text = Annotated[str, Field(min_length=1, max_length=1024)]
Count = Annotated[int, Field(ge=0)]


class TransferKind(StrEnum):
    MATERIALIZE = "materialize"  # needed by a request now
    PREFETCH = "prefetch"  # speculative, before the request needs it
    DEMOTE = "demote"  # move to a slower tier to free capacity
    REPLICATE = "replicate"


class TransferStatus(StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    REJECTED_CAPACITY = "rejected_capacity"
    INTEGRITY_ERROR = "integrity_error"
    NOT_FOUND = "not_found"


class TransferCommand(Contract):
    schema_version: Annotated[int, Field(ge=1, le=1)] = SCHEMA_VERSION
    transfer_id: Text
    request_id: Text
    kind: TransferKind = TransferKind.MATERIALIZE
    descriptor_id: Text
    tenant_namespace: Text
    keys: tuple[Key128, ...] = Field(min_length=1, max_length=1 << 20)
    source: EntryLocation
    destination: EntryLocation
    bytes: Count
    issued_at: Annotated[float, Field(ge=0)]
    deadline_at: Annotated[float, Field(ge=0)]
    priority: Annotated[int, Field(ge=0, le=9)] = 5
    backend: Text | None = None  # the execution policy's backend for this link; None: executor's choice

    @model_validator(mode="after")
    def _distinct(self) -> TransferCommand:
        if self.source == self.destination:
            raise ValueError("destination: must differ from source")
        if self.source.group != self.destination.group:
            raise ValueError("destination: a transfer keeps its KV group")
        return self


class TransferResult(Contract):
    schema_version: Annotated[int, Field(ge=1, le=1)] = SCHEMA_VERSION
    transfer_id: Text
    request_id: Text
    status: TransferStatus
    source: EntryLocation
    destination: EntryLocation
    blocks_moved: Count = 0
    bytes_moved: Count = 0
    started_at: Annotated[float, Field(ge=0)]
    finished_at: Annotated[float, Field(ge=0)]
    device: Text = "cpu"  # what executed the copy: "cuda:0", or "cpu" for the host stand-in
    error: str | None = None

    @property
    def duration_s(self) -> float:
        return self.finished_at - self.started_at

    @model_validator(mode="after")
    def _honest(self) -> TransferResult:
        if self.finished_at < self.started_at:
            raise ValueError("finished_at: before started_at")
        if self.status is TransferStatus.COMPLETED and self.error:
            raise ValueError("error: a completed transfer carries no error")
        if self.status is not TransferStatus.COMPLETED and not self.error:
            raise ValueError("error: every non-completed outcome says why")
        return self


def executor_of(worker: str) -> str:
    """The control producer of ``worker``'s transfer executor: the only producer whose results about a
    transfer to ``worker`` count (it runs only the commands keyed to its own worker)."""
    return f"executor/{worker}"


def result_mismatch(command: TransferCommand, result: TransferResult) -> str | None:
    """Why ``result`` cannot be the outcome of ``command`` although it names its transfer id (None: it
    can): another request, source or destination. A result is taken only for the transfer it reports."""
    for field in ("request_id", "source", "destination"):
        ours, theirs = getattr(command, field), getattr(result, field)
        if ours != theirs:
            return (f"{field}: the result of transfer {command.transfer_id[:80]!r} names {str(theirs)[:120]!r}, "
                    f"the command {str(ours)[:120]!r}")
    return None
