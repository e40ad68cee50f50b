"""NexusKV's reference engine standing in for vLLM around the connector's two sides.

:class:`VllmStandIn` serves one request at a time the way vLLM's scheduler and model runner
call a ``KVConnectorBase_V1`` (``../shared/reference/engines.md`` §3), so the connector's logic
runs end to end without vLLM (the real engine runs it in ``tests/engines/vllm/``):

1. *schedule* — the engine's own prefix cache gives ``num_computed_tokens`` (whole blocks, never
   the last token); the scheduler side is asked ``num_new_matched_tokens`` (``None``: the
   request waits a step and asks again); the engine allocates pages for the external tokens and
   reports them with ``update_state_after_alloc``;
2. *load* — the step's metadata goes to the worker side, whose ``start_load`` puts the blocks into
   the registered paged KV (the reference engine's pages: block id = page); asynchronous loads make the
   request wait steps until ``get_finished`` reports it; blocks listed by
   ``block_ids_with_load_errors`` are given back and recomputed, as vLLM does with
   ``kv_load_failure_policy="recompute"``;
3. *compute* — the reference engine prefills reusing exactly the computed and loaded prefix; the step that
   filled the blocks hands them to ``wait_for_save`` (the reference engine allocates its pages
   while it prefills, so its blocks are known after the forward pass, unlike vLLM's: the save
   step comes right after it and carries no prefill to time);
4. *finish* — ``request_finished`` forgets the request; the worker's writes are flushed and its
   report handed to the scheduler side.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

from connectors.vllm.meta import ConnectorMeta
from connectors.vllm.scheduler_side import Scheduled, SchedulerSide
from connectors.vllm.worker_side import WorkerSide
from nexuskv.errors import NexusKVError
from nexuskv.reference_engine import PrefillResult, ReferenceEngine

__all__ = ["StandInServed", "VllmStandIn"]


@dataclass(frozen=True, slots=True)
class StandInServed:
    """One request as the engine served it (tokens unless said otherwise)."""

    result: PrefillResult
    computed_tokens: int  # restored from the engine's own pages
    matched_tokens: int  # what the connector said it would load
    loaded_tokens: int  # what it did load (matched minus failed blocks)
    failed_blocks: int
    load_async: bool
    waited_steps: int  # steps the request waited: undecided, or loading asynchronously
    saved_blocks: int  # blocks written to the save tier by this request


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

    def _step(self, meta: ConnectorMeta) -> set[str]:
        """One engine step's connector calls on the worker, and their report to the scheduler."""
        self.steps += 1
        self.worker.bind(meta)
        self.worker.start_load(meta)
        self.worker.wait_for_save(meta)
        _sending, recving = self.worker.get_finished()
        self.scheduler.update_connector_output(self.worker.take_report(), tuple(recving))
        if not recving and self.worker.busy():
            time.sleep(0.0005)  # an asynchronous load is still on a worker thread: let it run
        return recving

    def serve(self, request_id: str, tokens: Sequence[int]) -> StandInServed:
        rt, sched, bs = self.runtime, self.scheduler, self.runtime.block_size
        tokens = list(tokens)
        sched.track(request_id, tokens, len(tokens))
        computed = rt.computed_tokens(tokens)
        waited = 0
        while True:
            matched, load_async = sched.num_new_matched_tokens(request_id, tokens, computed)
            if matched is not None:
                break
            waited += 1
            self._bounded(waited)
            self._step(sched.build_meta())
        start, end = computed // bs, (computed + matched) // bs
        pages = rt.allocate_blocks(tokens, start, end) if matched else []
        if pages is None:  # no room: vLLM would not schedule it now; here it recomputes instead
            raise NexusKVError(f"request {request_id}: no free pages for {end - start} external blocks")
        block_ids = (rt.block_ids(tokens, start) or []) + pages
        sched.update_state_after_alloc(request_id, block_ids, matched)
        recving = self._step(sched.build_meta())
        while load_async and request_id not in recving:
            waited += 1
            self._bounded(waited)
            recving = self._step(sched.build_meta())
        failed = self.worker.block_ids_with_load_errors()
        good = next((i for i, page in enumerate(pages) if page in failed), len(pages))
        rt.release_blocks(tokens, start + good, end)
        rt.adopt_blocks(tokens, start, start + good)
        reused = computed + good * bs
        result = rt.prefill(tokens, reuse_tokens=reused, request_id=request_id)
        full = rt.block_ids(tokens, len(tokens) // bs) or []
        saved_before = self.worker.stats["blocks_saved"]
        meta = sched.build_meta([Scheduled(request_id, reused, len(tokens) - reused, full)])
        self._step(dataclasses.replace(meta, prefills=(), decodes=0))
        self.worker.flush()
        sched.request_finished(request_id)
        self.scheduler.update_connector_output(self.worker.take_report())
        saved = self.worker.stats["blocks_saved"] - saved_before
        return StandInServed(result, computed, matched, good * bs, len(pages) - good, load_async, waited, saved)

    def _bounded(self, waited: int) -> None:
        if waited > self.max_steps:
            raise NexusKVError(f"a request waited more than {self.max_steps} engine steps")
