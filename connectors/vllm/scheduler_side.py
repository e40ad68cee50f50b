"""The connector's scheduler side: what to load (asked of the planner), what to save, what it cost.

vLLM builds one connector per role; this is the logic of the ``KVConnectorRole.SCHEDULER``
instance, in vLLM's engine-core process (:mod:`connectors.vllm.shell` translates vLLM's objects
into the plain values taken here; :mod:`tests.connectors.vllm_standin` drives it with NexusKV's
reference engine standing in for vLLM). Its worker-side counterpart is
:mod:`connectors.vllm.worker_side`; what passes between them is :mod:`connectors.vllm.meta`.

**Loads** (``num_new_matched_tokens``). The request's canonical block keys are looked up in the
index; the matches are narrowed to what this worker can read — its own tiers' publishers
(``<worker>/disk``, :mod:`connectors.vllm.tier_publisher`) and anyone's shared remote tier — plus
the truth about its own GPU prefix (vLLM's ``num_computed_tokens``); :func:`nexuskv.planner.plan`
decides for this worker alone. Only when the decision moves blocks from a readable source to this
worker's GPU does it answer that many tokens, in whole blocks, never the prompt's last token, and
only as many as the source really holds now (the tier is checked, so a payload deleted behind
NexusKV's back is recomputed, not loaded); otherwise 0. It answers ``None`` ("ask again") while the
index lags beyond the policy's limit, for at most ``decide_wait_s`` per request, and ``load_async``
only with a positive count. The index is asked, not held: ``index`` is the node's sidecar
(:class:`connectors.index_client.IndexClient`), whose answer within its budget or a miss with
infinite lag (no answer, a malformed one) is all this thread waits for; an infinite lag is not
waited out (nothing says it will shrink): the request is recomputed at once. vLLM does not tell
a connector its queue, so the planner sees an idle worker. Each decision acted upon (the allocation that follows it) is handed to ``on_decision``
(published to ``nexuskv.decisions``); a load the worker reports failed gets its fallback record.

**Saves** (``build_meta``). Every full block a step computes is saved in that step (vLLM's
``kv_connector_block_state`` gives the blocks of every scheduled request): the worker copies it
out of the paged KV before the step ends, so no block is held past its request and nothing waits
for a later step. Blocks the save tier already holds — those it just loaded, and the prefix the
index and the tier itself agree on — are not handed over again.

**Costs.** The step's prefill work goes with the metadata, so the worker can time it; the worker's
timings come back (:class:`~connectors.vllm.meta.WorkerReport`) and feed the cold-start cost model
(:class:`nexuskv.priors.ColdStart`), which fills only what the deployment's cost model lacks for
this model and worker — and the decision records name it (``cost_model_version``).

Only block-granular attention state is moved: a descriptor with recurrent checkpoints (vLLM's
hybrid models need ``SupportsHMA``) is refused at construction, with the reason.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from connectors.vllm.meta import ConnectorMeta, LoadSpec, PrefillWork, SaveSpec, WorkerReport
from connectors.vllm.tier_publisher import tier_publisher_name
from nexuskv.contracts.decisions import Action, Decision
from nexuskv.contracts.plans import WorkerLoad
from nexuskv.cost import CostModel
from nexuskv.dataplane.payload import PayloadKey
from nexuskv.descriptor import GranularityKind, StateDescriptor, Tier
from nexuskv.entries import EntryLocation
from nexuskv.errors import ConfigError, TierUnavailableError
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.lookup import IndexView, LocationMatch, LookupResult
from nexuskv.planner import Plan, PlanQuery, fallback_decision, plan
from nexuskv.policy import ExecutionPolicy
from nexuskv.priors import ColdStart, GemmProbe

__all__ = ["Probe", "Readable", "Scheduled", "SchedulerSide", "check_descriptor"]

log = logging.getLogger("nexuskv.vllm")

#: Which of ``keys`` the tier holds now. A tier that cannot be asked raises TierUnavailableError
#: (or OSError); the scheduler side then takes it as holding none of them (recompute, save again).
Probe = Callable[[Tier, Sequence[PayloadKey]], Sequence[bool]]


def check_descriptor(descriptor: StateDescriptor) -> None:
    """ConfigError unless the descriptor is one attention group of whole blocks (what this connector moves)."""
    groups = descriptor.layer_groups
    if len(groups) != 1 or groups[0].granularity.kind is not GranularityKind.BLOCK:
        raise ConfigError("descriptor", f"{descriptor.descriptor_id} has {len(groups)} layer groups "
                                        f"({', '.join(g.granularity.kind.value for g in groups)}); the vLLM connector "
                                        "moves one group of whole KV blocks (hybrid models need SupportsHMA)")


@dataclass(frozen=True, slots=True)
class Readable:
    """Locations a worker can read: its own tiers' publishers in ``own``, anyone's tiers in ``shared``."""

    worker: str
    own: frozenset[Tier] = frozenset({Tier.DISK})
    shared: frozenset[Tier] = frozenset()

    def __call__(self, location: EntryLocation) -> bool:
        return location.tier in self.shared or self.is_own(location)

    def is_own(self, location: EntryLocation) -> bool:
        """The worker's own tier: its tier publisher's locations carry the worker's name (the
        publisher's identity says whose they are), or the publisher's own name in an index fed
        before that field existed."""
        return location.tier in self.own and location.worker in (self.worker,
                                                                  tier_publisher_name(self.worker, location.tier))


@dataclass(frozen=True, slots=True)
class Scheduled:
    """One request of a step, as vLLM scheduled it: KV of ``computed`` tokens exists, ``scheduled`` more
    are computed now, into ``block_ids`` (the request's blocks from block 0; None when unknown)."""

    request_id: str
    computed: int
    scheduled: int
    block_ids: Sequence[int] | None


@dataclass(slots=True)
class _Request:
    """What the scheduler side keeps of one live request."""

    tokens: Sequence[int]  # the request's tokens, prompt and output (a live view in vLLM)
    prompt_tokens: int
    first_asked: float
    keys: list[int] = field(default_factory=list)  # canonical keys of its full blocks so far
    saved_upto: int | None = None  # blocks [0, saved_upto) are in the save tier (None: not checked yet)
    source: EntryLocation | None = None
    start: int = 0
    end: int = 0
    reason: str = ""
    plan: Plan | None = None  # the decision behind the last answer
    published: bool = False
    # Why a planned load was not made (the source did not hold it, or could not be asked): the
    # plan's record is then superseded by a recompute, so no record claims a load that never ran.
    not_made: str | None = None


class SchedulerSide:
    """The scheduler-side half; one per engine. Not thread-safe (vLLM's scheduler is one thread)."""

    def __init__(self, descriptor: StateDescriptor, *, worker: str, index: IndexView,
                 model: Callable[[], CostModel], execution: Callable[[], ExecutionPolicy], readable: Readable,
                 probe: Probe, save_tier: Tier | None = Tier.DISK, profile: str | None = None,
                 load_async: bool = False, decide_wait_s: float = 0.05, secret: bytes = b"",
                 cold_start: ColdStart | None = None, on_decision: Callable[[Decision], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        check_descriptor(descriptor)
        self.descriptor = descriptor
        self.scope = IdentityScope.of(descriptor)
        self.block_size = descriptor.block_size
        self.worker = worker
        self.index = index
        self.model = model
        self.execution = execution
        self.readable = readable
        self.probe = probe
        self.save_tier = save_tier
        self.profile = profile
        self.load_async = load_async
        self.decide_wait_s = decide_wait_s
        self.cold_start = cold_start
        self.on_decision = on_decision
        self.clock = clock
        self._keyer = BlockKeyer(self.scope, self.block_size, secret)
        self._group = descriptor.layer_groups[0].kv_group
        self._requests: dict[str, _Request] = {}
        self._loads: list[LoadSpec] = []
        self._plans: dict[str, Plan] = {}  # decisions whose loads are in flight (for their fallback record)
        self.stats = {"asked": 0, "deferred": 0, "matched_tokens": 0, "source_missing_blocks": 0,
                      "blocks_to_save": 0, "loads_finished": 0, "loads_failed": 0, "decisions": 0,
                      "tier_probes_failed": 0}

    # -- requests --------------------------------------------------------------------------------

    def track(self, request_id: str, token_ids: Sequence[int], prompt_tokens: int | None = None) -> _Request:
        """Know a request: its tokens (a live view, as vLLM's ``all_token_ids``) and prompt length."""
        st = self._requests.get(request_id)
        if st is None:
            st = self._requests[request_id] = _Request(token_ids, len(token_ids) if prompt_tokens is None
                                                       else prompt_tokens, self.clock())
        else:
            st.tokens = token_ids
        return st

    def _keys(self, st: _Request, blocks: int) -> list[int]:
        """Canonical keys of the request's first ``blocks`` full blocks (extended as tokens arrive)."""
        bs = self.block_size
        have = len(st.keys)
        if blocks > have:
            parent = st.keys[-1] if have else None
            st.keys.extend(self._keyer.keys(list(st.tokens[have * bs:blocks * bs]), parent=parent))
        return st.keys[:blocks]

    def cost_model(self) -> CostModel:
        """The snapshot decisions use: the deployment's, with the cold start's priors where it has gaps."""
        model = self.model()
        return self.cold_start.apply(model) if self.cold_start is not None else model

    # -- get_num_new_matched_tokens -------------------------------------------------------------

    def num_new_matched_tokens(self, request_id: str, token_ids: Sequence[int],
                               num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` this connector will load, and whether asynchronously."""
        self.stats["asked"] += 1
        now = self.clock()
        bs = self.block_size
        st = self.track(request_id, token_ids)
        if len(st.keys) > len(token_ids) // bs:  # a resumed request asks again: key it again
            st.keys = []
        keys = self._keys(st, len(token_ids) // bs)
        st.source, st.start, st.end, st.plan, st.not_made = None, 0, 0, None, None
        local = num_computed_tokens // bs
        limit = (len(token_ids) - 1) // bs  # the last token is always computed: its logits are the output
        execution = self.execution()
        found = self.index.lookup(self.scope, keys) if keys else None
        if found is not None and math.isfinite(found.lag_ms) and found.lag_ms > execution.budgets.max_index_lag_ms \
                and now - st.first_asked < self.decide_wait_s:
            self.stats["deferred"] += 1
            return None, False  # facts too old to move state on: ask again once the index caught up
        if st.saved_upto is None and found is not None:
            st.saved_upto = self._held_prefix(found, keys)
        if local >= limit or found is None:
            st.reason = "nothing beyond the local prefix to load"
            return 0, False
        query = PlanQuery(request_id=request_id, scope=self.scope, descriptor=self.descriptor, keys=tuple(keys),
                          prompt_tokens=len(token_ids), arrival_at=now, at_admission=False,
                          candidates=(WorkerLoad(worker=self.worker, profile=self.profile, loads_own_tiers=True,
                                                 loads_shared_tiers=Tier.REMOTE in self.readable.shared),))
        view = self._readable_view(found, local)
        for _attempt in range(2):
            p = st.plan = plan(query, view, self.cost_model(), execution, now=now)
            chosen = p.chosen
            src = chosen.source
            if chosen.action not in (Action.TRANSFER, Action.PREFETCH) or src is None or not chosen.contiguous:
                st.reason = p.decision.reason
                return 0, False
            start, end = chosen.moved  # type: ignore[misc]
            end = min(end, limit)
            if start != local or end <= start:
                st.reason = st.not_made = f"planner moves blocks [{start}, {end}) but the engine holds {local}"
                return 0, False
            did = self.descriptor.descriptor_id
            held = self._probe(src.tier, [PayloadKey(did, k, self._group) for k in keys[start:end]])
            readable = next((i for i, ok in enumerate(held) if not ok), len(held))
            if readable == end - start:
                break
            # The index is ahead of the tier (a payload deleted or evicted behind NexusKV's back):
            # decide again on what the source really holds.
            self.stats["source_missing_blocks"] += end - start - readable
            location = self._source_location(src.worker, src.tier)
            if location.tier is self.save_tier and location.worker == self.worker and st.saved_upto is not None:
                st.saved_upto = min(st.saved_upto, start + readable)  # the tier lost them: save them again
            view = _truncated(view, src.worker, src.tier, start + readable)
        else:
            st.reason = st.not_made = (f"the source {src.worker}/{src.tier.value} holds fewer blocks than the "
                                       "index says (or cannot be asked)")
            return 0, False
        st.source, st.start, st.end = self._source_location(src.worker, src.tier), start, end
        tokens = (end - start) * bs
        self.stats["matched_tokens"] += tokens
        return tokens, self.load_async

    def _source_location(self, publisher: str, tier: Tier) -> EntryLocation:
        """Where the worker reads a match: its own tiers by its own name, shared tiers as published."""
        if tier in self.readable.own and publisher == self.worker:
            return EntryLocation(worker=self.worker, tier=tier, group=self._group)
        return EntryLocation(worker=publisher, tier=tier, group=self._group)

    def _held_prefix(self, found: LookupResult, keys: Sequence[int]) -> int:
        """Blocks from 0 this worker's save tier holds: what its publisher says, confirmed by the tier."""
        tier = self.save_tier
        if tier is None:
            return 0
        mine = (self.worker, tier_publisher_name(self.worker, tier))
        said = max((m.prefix_blocks for m in found.matches
                    if m.certain and m.location.tier is tier and m.location.worker in mine), default=0)
        if not said:
            return 0
        did = self.descriptor.descriptor_id
        held = self._probe(tier, [PayloadKey(did, k, self._group) for k in keys[:said]])
        return next((i for i, ok in enumerate(held) if not ok), said)

    def _probe(self, tier: Tier, keys: Sequence[PayloadKey]) -> Sequence[bool]:
        """:attr:`probe`, with a tier that cannot be asked (a remote store gone) holding nothing: this
        runs on vLLM's scheduler thread, where an exception kills the engine."""
        try:
            return self.probe(tier, keys)
        except (TierUnavailableError, OSError) as exc:
            self.stats["tier_probes_failed"] += 1
            if self.stats["tier_probes_failed"] in (1, 10, 100) or self.stats["tier_probes_failed"] % 1000 == 0:
                log.warning("%s: the %s tier cannot be asked (%d times so far), taken as holding nothing: %s",
                            self.worker, tier.value, self.stats["tier_probes_failed"], exc)
            return [False] * len(keys)

    def _readable_view(self, found: LookupResult, local_blocks: int) -> LookupResult:
        """The lookup narrowed to what this worker can read, its own tiers under its own name, plus
        its GPU prefix as vLLM knows it (the engine's published GPU facts are not consulted)."""
        matches: list[LocationMatch] = []
        for m in found.matches:
            loc = m.location
            if loc.tier is Tier.GPU or not self.readable(loc):
                continue
            if self.readable.is_own(loc):
                m = LocationMatch(EntryLocation(worker=self.worker, tier=loc.tier, group=loc.group), self.worker,
                                  m.prefix_blocks, m.extents, m.certain)
            matches.append(m)
        if local_blocks:
            matches.append(LocationMatch(EntryLocation(worker=self.worker, tier=Tier.GPU, group=self._group),
                                         self.worker, local_blocks))
        matches.sort(key=lambda m: (m.location.worker, m.location.tier.value, m.location.group))
        return LookupResult(num_blocks=found.num_blocks, matches=tuple(matches), lag_events=found.lag_events,
                            lag_ms=found.lag_ms)

    def source_tier(self, request_id: str) -> Tier | None:
        """The tier this request's external tokens come from (None: nothing is loaded)."""
        st = self._requests.get(request_id)
        return st.source.tier if st is not None and st.source is not None else None

    def decision_reason(self, request_id: str) -> str | None:
        """Why the last answer for this request was what it was (formula and numbers; no tokens)."""
        st = self._requests.get(request_id)
        if st is None:
            return None
        return st.plan.decision.reason if st.source is not None and st.plan is not None else st.reason

    # -- allocation, metadata -------------------------------------------------------------------

    def update_state_after_alloc(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` (the request's blocks from block 0) for ``num_external_tokens``."""
        st = self._requests.get(request_id)
        if st is not None and st.plan is not None and not st.published:
            st.published = True
            self._publish(st.plan.decision)
            if st.not_made is not None:
                self._publish(fallback_decision(st.plan.decision, st.not_made, now=self.clock()))
        if num_external_tokens <= 0:
            return  # nothing to load (or the second call of an async load)
        bs = self.block_size
        count = num_external_tokens // bs
        if st is None or st.source is None or count != st.end - st.start or num_external_tokens % bs:
            # Never leave allocated blocks unfilled and unreported: fail them, vLLM recomputes.
            start = st.start if st is not None else 0
            ids = tuple(block_ids[start:start + -(-num_external_tokens // bs)])
            self._loads.append(LoadSpec(request_id, None, (), ids, start))
            return
        ids = tuple(block_ids[st.start:st.end])
        if len(ids) != count:
            self._loads.append(LoadSpec(request_id, None, (), ids, st.start))
            return
        self._loads.append(LoadSpec(request_id, st.source, tuple(st.keys[st.start:st.end]), ids, st.start,
                                    self.load_async))
        if st.plan is not None:
            self._plans[request_id] = st.plan
        if st.source.tier is self.save_tier and st.source.worker == self.worker:
            st.saved_upto = max(st.saved_upto or 0, st.end)  # the blocks come from the save tier itself

    def _publish(self, decision: Decision) -> None:
        self.stats["decisions"] += 1
        if self.on_decision is not None:
            self.on_decision(decision)

    def build_meta(self, scheduled: Sequence[Scheduled] = ()) -> ConnectorMeta:
        """This step's loads, the saves of the blocks it fills, and its prefill work (per-step state is reset)."""
        saves: list[SaveSpec] = []
        prefills: list[PrefillWork] = []
        decodes = 0
        bs = self.block_size
        for s in scheduled:
            st = self._requests.get(s.request_id)
            if st is None or s.scheduled <= 0:
                continue
            done = s.computed + s.scheduled
            if s.computed < st.prompt_tokens:
                prefills.append(PrefillWork(s.request_id, s.scheduled, done))
            else:
                decodes += 1
            spec = self._save(s, st, min(done, len(st.tokens)) // bs)
            if spec is not None:
                saves.append(spec)
        meta = ConnectorMeta(tuple(self._loads), tuple(saves), tuple(prefills), decodes)
        self._loads = []
        return meta

    def _save(self, s: Scheduled, st: _Request, full: int) -> SaveSpec | None:
        tier = self.save_tier
        if tier is None or s.block_ids is None:
            return None
        if st.saved_upto is None:  # never asked (a request vLLM did not match): check from block 0
            keys = self._keys(st, full)
            st.saved_upto = self._held_prefix(self.index.lookup(self.scope, keys), keys) if keys else 0
        start = st.saved_upto
        full = min(full, len(s.block_ids))
        if full <= start:
            return None
        keys = self._keys(st, full)
        bs = self.block_size
        self.stats["blocks_to_save"] += full - start
        st.saved_upto = full
        return SaveSpec(s.request_id, tier, tuple(keys[start:full]), tuple(s.block_ids[start:full]), start,
                        keys[start - 1] if start else None, tuple(st.tokens[start * bs:full * bs]))

    # -- finishing, worker output ------------------------------------------------------------------

    def request_finished(self, request_id: str) -> tuple[bool, dict | None]:
        """Forget the request; its blocks are free at once (every save was copied out in its step)."""
        self._requests.pop(request_id, None)
        return False, None

    def update_connector_output(self, report: WorkerReport | None = None, finished_recving: Sequence[str] = ()) -> None:
        """The worker's report (timings for the cold start, loads done and failed) and its finished async loads."""
        self.stats["loads_finished"] += len(finished_recving)
        if report is None:
            return
        now = self.clock()
        for request_id in report.loads_failed:
            self.stats["loads_failed"] += 1
            original = self._plans.pop(request_id, None)
            if original is not None:
                self._publish(fallback_decision(original.decision, "the load of its blocks failed; vLLM recomputes "
                                                                   "them", now=now))
        for request_id in report.loads_done:
            self._plans.pop(request_id, None)
        cold = self.cold_start
        if cold is None:
            return
        if report.gemm_samples_s and report.gemm_flops:
            probe = GemmProbe.of(report.gemm_flops, report.gemm_samples_s, what=report.gemm_label or "GEMM")
            if not cold.measured_probe(probe) and cold.probes_refused:
                log.warning("%s: %s", self.worker, cold.probes_refused[-1])
        elif report.gemm_flops_per_s:
            cold.measured_gemm(report.gemm_flops_per_s, report.gemm_label)
        for t in report.prefills:
            cold.observe_prefill(t.uncached, t.context, t.duration_s)
        for c in report.copies:
            if c.ok and c.destination is Tier.GPU:
                cold.observe_copy(c.source, c.destination, c.pages, c.duration_s)


def _truncated(view: LookupResult, worker: str, tier: Tier, prefix: int) -> LookupResult:
    """``view`` with the match at (worker, tier) cut to its first ``prefix`` blocks (dropped at 0)."""
    matches = []
    for m in view.matches:
        if m.location.worker == worker and m.location.tier is tier:
            if prefix <= 0:
                continue
            m = LocationMatch(m.location, m.publisher, min(m.prefix_blocks, prefix), (), m.certain)
        matches.append(m)
    return LookupResult(num_blocks=view.num_blocks, matches=tuple(matches), lag_events=view.lag_events,
                        lag_ms=view.lag_ms)
