"""NexusKV's reference engine playing vLLM's engine around the connector core.

`VllmStandIn` serves one request at a time the way vLLM's scheduler and model runner
call a ``KVConnectorBase_V1`` (``../shared/reference/engines.md`` §3), so the connector's logic
runs end to end without vLLM:

1. *schedule* — the engine's own prefix cache gives ``num_computed_tokens`` (whole blocks, never
   the last token); the scheduler side is asked ``num_new_matched_tokens`` (``None``: the
   request waits a step and asks again); the engine allocates pages for the external tokens and
   reports them with ``update_state_after_alloc``; ``build_meta`` makes the step's metadata;
2. *execute* — the worker side ``start_load``s into the registered paged KV (the runtime's pages:
   block id = page), every layer's ``wait_for_layer_load`` returns once the blocks are in place,
   (asynchronous loads: the request waits steps until ``get_finished`` reports it); blocks listed
   by ``block_ids_with_load_errors`` are given back and recomputed, as vLLM does with
   ``kv_load_failure_policy="recompute"``; the runtime prefills reusing exactly the computed and
   loaded prefix;
3. *finish* — ``request_finished`` hands the request's blocks for saving; steps run until the
   worker reports the saves written (``get_finished``), then ``update_connector_output`` and
   ``take_events`` publish what the save tier really holds through the runtime's event log.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from connectors.vllm.connector_core import ConnectorMeta, SchedulerSide, WorkerSide
from nexuskv.errors import NexusKVError
from nexuskv.reference_engine import PrefillResult, ReferenceEngine

__all__ = ["Served", "VllmStandIn"]


@dataclass(frozen=True, slots=True)
class Served:
    """One request as the engine served it (tokens unless said otherwise)."""

    result: PrefillResult
    computed_tokens: int  # restored from the engine's own pages
    matched_tokens: int  # what the connector said it would load
    loaded_tokens: int  # what it did load (matched minus failed blocks)
    failed_blocks: int
    load_async: bool
    waited_steps: int  # steps the request waited: undecided, or loading asynchronously
    saved_requests: int  # 1 when the request's blocks were handed to the save tier and reported written


class VllmStandIn:
    """One reference engine with both halves of a connector, driven like vLLM drives them."""

    def __init__(self, runtime: ReferenceEngine, scheduler: SchedulerSide, worker: WorkerSide, *,
                 max_steps: int = 10_000) -> None:
        self.runtime = runtime
        self.scheduler = scheduler
        self.worker = worker
        self.max_steps = max_steps
        self.steps = 0
        worker.register_kv_caches(runtime.kv_caches())

    def _step(self, meta: ConnectorMeta, finished: set[str]) -> tuple[set[str], set[str]]:
        """One engine step's connector calls on the worker, and their report to the scheduler."""
        self.steps += 1
        self.worker.start_load(meta)
        for name in self.runtime.kv_caches():
            self.worker.wait_for_layer_load(name)
        self.worker.wait_for_save(meta)
        sending, recving = self.worker.get_finished(finished)
        self.scheduler.update_connector_output(sending, recving)
        for event in self.scheduler.take_events():
            self.runtime.announce_copies(event.engine_hashes, event.tier)
        if not sending and not recving and (self.worker.busy()):
            time.sleep(0.0005)  # a save or load is still on a worker thread: let it run
        return sending, recving

    def serve(self, request_id: str, tokens: Sequence[int]) -> Served:
        rt, sched, bs = self.runtime, self.scheduler, self.runtime.block_size
        computed = rt.computed_tokens(tokens)
        waited = 0
        while True:
            matched, load_async = sched.num_new_matched_tokens(request_id, tokens, computed)
            if matched is not None:
                break
            waited += 1
            self._bounded(waited)
            self._step(sched.build_meta(), set())
        start, end = computed // bs, (computed + matched) // bs
        pages = rt.allocate_blocks(tokens, start, end) if matched else []
        if pages is None:  # no room: vLLM would not schedule it now; here it recomputes instead
            raise NexusKVError(f"request {request_id}: no free pages for {end - start} external blocks")
        block_ids = (rt.block_ids(tokens, start) or []) + pages
        sched.update_state_after_alloc(request_id, block_ids, matched)
        _sending, recving = self._step(sched.build_meta(), set())
        while load_async and request_id not in recving:
            waited += 1
            self._bounded(waited)
            _sending, recving = self._step(sched.build_meta(), set())
        failed = self.worker.block_ids_with_load_errors()
        good = next((i for i, page in enumerate(pages) if page in failed), len(pages))
        rt.release_blocks(tokens, start + good, end)
        rt.adopt_blocks(tokens, start, start + good)
        result = rt.prefill(tokens, reuse_tokens=computed + good * bs, request_id=request_id)
        full = rt.block_ids(tokens, len(tokens) // bs) or []
        keep, _params = sched.request_finished(request_id, tokens, full)
        saved = 0
        while keep:
            waited += 1
            self._bounded(waited)
            sending, _recving = self._step(sched.build_meta(), {request_id})
            if request_id in sending:
                saved, keep = 1, False
        return Served(result, computed, matched, good * bs, len(pages) - good, load_async, waited, saved)

    def _bounded(self, waited: int) -> None:
        if waited > self.max_steps:
            raise NexusKVError(f"a request waited more than {self.max_steps} engine steps")
