"""``nexuskv.plan-requests``: describe-and-match requests at admission.

Keyed by request id. A request names its identity scope (which fixes the descriptor), its
canonical block keys, when it arrived, its deadline or TTFT SLO, and the candidate workers with
their current load. It may carry its State Descriptor; without one the planner resolves
``scope.descriptor_id`` among the descriptors it knows (the known models).

Keys are computed once, at the edge that knows the scope and the identity secret (the router,
the engine's connector: :class:`nexuskv.identity.BlockKeyer`); token ids never travel in a plan
request. Version 2 dropped version 1's ``token_ids`` alternative (the planner re-keyed them): a
version 1 request that carries token ids is refused, naming the field.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from nexuskv.contract import Contract, Key128
from nexuskv.descriptor import StateDescriptor
from nexuskv.identity import IdentityScope

__all__ = ["SCHEMA_VERSION", "WorkerLoad", "PlanRequest"]

SCHEMA_VERSION = 2
Text = Annotated[str, Field(min_length=1, max_length=512)]
Count = Annotated[int, Field(ge=0)]


class WorkerLoad(Contract):
    """A candidate worker and its load when the request arrived."""

    worker: Text
    queued_prefill_tokens: Count = 0  # tokens waiting for prefill ahead of this request
    # The rest of the queue's compute, when the engine reports it: the prefills waiting (each pays
    # the fixed per-prefill cost) and the sum over them of uncached x context tokens (the
    # attention part, which tokens alone miss: one queued 128K prompt takes longer than 128K
    # tokens of short ones). 0 when unknown: the queue is then priced by its tokens alone.
    queued_prefill_requests: Count = 0
    queued_prefill_token_products: Count = 0
    decode_blocks: Count = 0  # KV blocks of in-flight decoding requests
    active_requests: Count = 0
    profile: Text | None = None  # hardware profile name, when workers differ
    #: The engine loads its own host and disk tiers itself when it schedules the request (vLLM
    #: with NexusKV's KV connector): a move from them is no transfer command and cannot hide
    #: behind the queue (the load starts when the request leaves it).
    loads_own_tiers: bool = False
    #: With ``loads_own_tiers``: the engine's connector also reads the shared remote tier itself
    #: (NexusKV's vLLM connector with ``NEXUSKV_REMOTE_TIER``), whoever wrote the blocks there, so a
    #: move from it is the engine's own load as well.
    loads_shared_tiers: bool = False
    #: A transfer executor serves this worker's transfer commands (the tier manager runs one).
    #: False: nothing copies into its engine but the engine itself, so a move only it cannot make
    #: (another worker's GPU, host or disk) is refused instead of planned and then missed.
    has_executor: bool = True


class PlanRequest(Contract):
    schema_version: Annotated[int, Field(ge=1, le=2)] = SCHEMA_VERSION
    request_id: Text
    scope: IdentityScope
    block_size: Annotated[int, Field(ge=1, le=1 << 16)]
    prompt_tokens: Count
    keys: tuple[Key128, ...] = Field(max_length=1 << 20)
    arrival_at: Annotated[float, Field(ge=0)]  # seconds since the epoch
    deadline_at: Annotated[float, Field(ge=0)] | None = None  # latest useful start of decode
    slo_ttft_s: Annotated[float, Field(gt=0)] | None = None
    candidates: tuple[WorkerLoad, ...] = Field(min_length=1, max_length=4096)
    expected_output_tokens: Count | None = None
    workload: Text | None = None  # label for analysis ("chat", "rag", ...)
    descriptor: StateDescriptor | None = None  # the state the request needs; else looked up by id
    trace_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_token_ids(cls, data: object) -> object:
        if isinstance(data, dict) and "token_ids" in data:
            raise ValueError("token_ids: a plan request carries the canonical keys of its blocks, computed at the edge "
                             "(nexuskv.identity.BlockKeyer); version 1's token_ids alternative is no longer read")
        return data

    @model_validator(mode="after")
    def _keys_fit(self) -> PlanRequest:
        full = self.prompt_tokens // self.block_size
        if len(self.keys) != full:
            raise ValueError(f"keys: {len(self.keys)} keys for {full} full blocks of prompt_tokens")
        if self.descriptor is not None:
            if self.descriptor.descriptor_id != self.scope.descriptor_id:
                raise ValueError("descriptor: its descriptor_id differs from scope.descriptor_id")
            if self.descriptor.block_size != self.block_size:
                raise ValueError(f"block_size: {self.block_size} differs from the descriptor's "
                                 f"{self.descriptor.block_size}")
        workers = [c.worker for c in self.candidates]
        if len(set(workers)) != len(workers):
            raise ValueError("candidates: each worker may appear once")
        return self
