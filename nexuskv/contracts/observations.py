"""``nexuskv.observations``: measured timings that calibrate the cost model.

Keyed by (model, link or tier). Each observation is a measurement, with its unit in the field
name; the calibration agent fits ``T_compute`` from prefill observations and per-link transfer
costs from transfer observations. Load observations report a worker's queue and decode load.
Request observations measure the fixed cost of a request outside the engine's queue and forward
pass (HTTP, tokenisation, returning the first token), which the planner adds to every predicted
time to first token of a request it plans before the engine has it.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from nexuskv.contract import Contract
from nexuskv.descriptor import Tier

__all__ = [
    "SCHEMA_VERSION",
    "PrefillObservation",
    "TransferObservation",
    "LoadObservation",
    "RequestObservation",
    "Observation",
    "ObservationRecord",
]

SCHEMA_VERSION = 1
Text = Annotated[str, Field(min_length=1, max_length=512)]
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0)]


class PrefillObservation(Contract):
    """One prefill: ``uncached_tokens`` computed in a context of ``context_tokens``."""

    kind: Literal["prefill"] = "prefill"
    model: Text
    profile: Text  # hardware/deployment profile the timing belongs to
    worker: Text
    uncached_tokens: Count
    context_tokens: Count
    duration_s: Seconds
    queued_s: Seconds | None = None  # how long the request waited for the engine before this prefill


class TransferObservation(Contract):
    """One completed (or failed) copy over a link."""

    kind: Literal["transfer"] = "transfer"
    source_tier: Tier
    destination_tier: Tier
    backend: Text
    worker: Text
    bytes: Count
    pages: Count
    duration_s: Seconds
    ok: bool = True

    @property
    def link(self) -> str:
        return f"{self.source_tier.value}->{self.destination_tier.value}"


class LoadObservation(Contract):
    """A worker's load at one moment (what routing weighs against locality)."""

    kind: Literal["load"] = "load"
    worker: Text
    queued_prefill_tokens: Count
    decode_blocks: Count
    active_requests: Count


class RequestObservation(Contract):
    """One request's time to first token outside the engine's queue and its prefill, seconds.

    ``duration_s`` = the client's time to first token - the engine's queue wait - its prefill (the
    HTTP round trip, tokenisation, detokenising and returning the first token); the calibration
    agent fits ``o0 + o1 * prompt_tokens`` from these per (model, profile).
    """

    kind: Literal["request"] = "request"
    model: Text
    profile: Text
    worker: Text
    prompt_tokens: Count
    duration_s: Seconds


Observation = Annotated[Union[PrefillObservation, TransferObservation, LoadObservation, RequestObservation],
                        Field(discriminator="kind")]


class ObservationRecord(Contract):
    schema_version: Literal[1] = SCHEMA_VERSION
    observed_at: Annotated[float, Field(ge=0)]  # seconds since the epoch
    request_id: Text | None = None  # the request the measurement belongs to, when there is one
    trace_id: str | None = None
    observation: Observation
