"""The prefetch state machine: deadline, completion, abandonment to recompute, budgets."""

from __future__ import annotations

import pytest

from nexuskv.contracts import decode, encode
from nexuskv.contracts.decisions import Action
from nexuskv.contracts.placement import HintKind
from nexuskv.contracts.plans import WorkerLoad
from nexuskv.contracts.topics import DECISIONS, PLACEMENT
from nexuskv.contracts.transfers import TransferResult
from nexuskv.descriptor import Granularity, LayerGroup, StateDescriptor, TensorSpec, Tier
from nexuskv.models import known_model
from nexuskv.planner import plan
from nexuskv.planner.prefetch import (
    Cancel,
    Demote,
    Evict,
    PrefetchFallback,
    PrefetchScheduler,
    TicketState,
    Unpin,
    effect_hint,
)
from nexuskv.policy import ExecutionPolicy, parse_policy
from nexuskv.profiles import shipped_cost_model

from tests.planning import NOW, lookup, match, query

LLAMA8 = known_model("meta-llama/Llama-3.1-8B", tenant_namespace="acme")
MODEL = shipped_cost_model()
POLICY = ExecutionPolicy(version="prefetch-test")


def _policy(extra: str) -> ExecutionPolicy:
    return parse_policy(f"schema_version='nexuskv.execution_policy.v1'\nversion='t'\n{extra}", fmt="toml")


def prefetch_plan(request_id="r1", tokens=8192, queued=50_000, policy=POLICY, headroom=None):
    q = query(LLAMA8, tokens, [WorkerLoad(worker="w-a", profile="h200x1-rdma4x200", queued_prefill_tokens=queued)],
              request_id=request_id)
    p = plan(q, lookup(len(q.keys), match("w-a", "host", len(q.keys))), MODEL, policy, now=NOW, headroom=headroom)
    assert p.decision.action is Action.PREFETCH, p.decision.reason
    return p


def result(cmd, status="completed", at=NOW + 0.05, error=None):
    return TransferResult(transfer_id=cmd.transfer_id, request_id=cmd.request_id, status=status, source=cmd.source,
                          destination=cmd.destination, blocks_moved=len(cmd.keys) if status == "completed" else 0,
                          bytes_moved=cmd.bytes if status == "completed" else 0, started_at=NOW, finished_at=at,
                          error=error)


def test_a_prefetch_ready_in_time_is_kept_and_frees_its_budget():
    s = PrefetchScheduler(POLICY)
    p = prefetch_plan()
    (ticket,) = s.track(p, now=NOW)
    assert ticket.state is TicketState.IN_FLIGHT and s.transfers == 1 and s.pinned == p.transfers[0].bytes
    room = s.headroom("acme")
    assert room.transfers == POLICY.budgets.max_transfers_in_flight - 1
    assert room.bytes_per_s == pytest.approx(POLICY.budgets.max_transfer_bytes_per_s - ticket.rate_bytes_per_s)
    effects = s.complete(result(p.transfers[0]), now=NOW + 0.05)
    assert [type(e) for e in effects] == [Unpin]  # the source pin ends when the bytes stopped moving
    unpin = effect_hint(effects[0], now=NOW + 0.05)
    source_pin = next(h for h in p.hints if h.kind is HintKind.PIN)
    assert unpin.kind is HintKind.UNPIN and unpin.worker == source_pin.worker and unpin.tier is source_pin.tier
    assert unpin.keys == source_pin.keys == p.transfers[0].keys and unpin.transfer_id == ticket.transfer_id
    assert decode(PLACEMENT, encode(PLACEMENT, unpin)) == unpin
    assert s.ticket(ticket.transfer_id).state is TicketState.READY
    assert (s.transfers, s.pinned, s.in_flight_bytes, s.rate) == (0, 0, 0, 0.0)
    assert s.tick(now=p.decision.deadline_at + 1) == []  # a ready ticket has no deadline left to miss


def test_a_prefetch_that_misses_its_deadline_falls_back_to_recompute_and_is_cancelled():
    s = PrefetchScheduler(POLICY)
    p = prefetch_plan()
    s.track(p, now=NOW)
    deadline = p.decision.deadline_at
    assert s.tick(now=deadline - 1e-3) == []
    effects = s.tick(now=deadline)
    fallback = [e for e in effects if isinstance(e, PrefetchFallback)]
    cancels = [e for e in effects if isinstance(e, Cancel)]
    assert len(fallback) == 1 and len(cancels) == 1
    dec = fallback[0].decision
    assert dec.action is Action.RECOMPUTE and dec.revision == 1 and "missed its deadline" in dec.reason
    assert decode(DECISIONS, encode(DECISIONS, dec)) == dec
    # The source pin lapsed at its deadline, but the copy still holds its in-flight budget until the
    # executor says the bytes stopped moving.
    assert s.pinned == 0 and s.transfers == 1 and s.in_flight_bytes == p.transfers[0].bytes
    hint = effect_hint(cancels[0], now=deadline)
    assert hint.kind is HintKind.CANCEL and hint.transfer_id == p.transfers[0].transfer_id
    assert decode(PLACEMENT, encode(PLACEMENT, hint)) == hint
    # The executor did not stop in time: the copy lands late and is demoted, not kept in GPU.
    late = s.complete(result(p.transfers[0], at=deadline + 0.5), now=deadline + 0.5)
    assert len(late) == 1 and isinstance(late[0], Demote) and late[0].to_tier is Tier.HOST
    assert s.transfers == 0 and s.in_flight_bytes == 0
    demote = effect_hint(late[0], now=deadline + 0.5)
    assert demote.kind is HintKind.DEMOTE and demote.to_tier is Tier.HOST and demote.worker == "w-a"
    assert s.ticket(p.transfers[0].transfer_id).state is TicketState.LATE
    assert s.tick(now=deadline + 10) == []  # one fallback per request


def test_let_finish_keeps_the_budget_until_the_late_copy_lands_then_evicts():
    policy = _policy("[fallback]\nin_flight_at_deadline='let_finish'\nlate_transfer='evict'")
    s = PrefetchScheduler(policy)
    p = prefetch_plan(policy=policy)
    s.track(p, now=NOW)
    effects = s.tick(now=p.decision.deadline_at)
    assert [type(e) for e in effects] == [PrefetchFallback]
    assert s.transfers == 1  # still moving, still counted
    late = s.complete(result(p.transfers[0], at=p.decision.deadline_at + 1), now=p.decision.deadline_at + 1)
    assert [type(e) for e in late] == [Evict] and s.transfers == 0
    assert effect_hint(late[0], now=NOW).kind is HintKind.EVICT
    keep = PrefetchScheduler(_policy("[fallback]\nlate_transfer='keep'"))
    p2 = prefetch_plan()
    keep.track(p2, now=NOW)
    keep.tick(now=p2.decision.deadline_at)
    assert keep.complete(result(p2.transfers[0], at=p2.decision.deadline_at + 1), now=NOW + 9) == []


def test_a_late_result_before_the_tick_is_still_late():
    s = PrefetchScheduler(POLICY)
    p = prefetch_plan()
    s.track(p, now=NOW)
    effects = s.complete(result(p.transfers[0], at=p.decision.deadline_at + 0.2), now=p.decision.deadline_at + 0.2)
    assert [type(e) for e in effects] == [Unpin, PrefetchFallback, Demote]


def test_a_failed_transfer_falls_back_before_its_deadline():
    s = PrefetchScheduler(POLICY)
    p = prefetch_plan()
    s.track(p, now=NOW)
    effects = s.complete(result(p.transfers[0], status="integrity_error", error="checksum mismatch"), now=NOW + 0.05)
    assert [type(e) for e in effects] == [Unpin, PrefetchFallback] and "checksum mismatch" in effects[1].decision.reason
    assert s.ticket(p.transfers[0].transfer_id).state is TicketState.FAILED and s.transfers == 0
    assert s.complete(result(p.transfers[0]), now=NOW + 0.1) == []  # a duplicate result changes nothing


def test_budgets_apply_backpressure_to_the_planner():
    tight = _policy("[budgets]\nmax_transfers_in_flight=1")
    s = PrefetchScheduler(tight)
    first = prefetch_plan("r1", policy=tight, headroom=s.headroom("acme"))
    s.track(first, now=NOW)
    q = query(LLAMA8, 8192, [WorkerLoad(worker="w-a", profile="h200x1-rdma4x200", queued_prefill_tokens=50_000)],
              request_id="r2")
    second = plan(q, lookup(len(q.keys), match("w-a", "host", len(q.keys))), MODEL, tight, now=NOW,
                  headroom=s.headroom("acme"))
    assert second.decision.action is Action.RECOMPUTE
    assert "no transfer slot" in second.decision.reason or any(
        "no transfer slot" in (a.rejected_reason or "") for a in second.decision.alternatives)
    s.complete(result(first.transfers[0]), now=NOW + 0.05)
    third = prefetch_plan("r3", policy=tight, headroom=s.headroom("acme"))
    assert third.transfers


def test_tenant_quotas_count_per_tenant():
    quota = _policy("[tenancy.quotas.acme]\nmax_transfers_in_flight=1\nmax_transfer_bytes_in_flight=2000000000")
    s = PrefetchScheduler(quota)
    p = prefetch_plan(policy=quota)
    s.track(p, now=NOW)
    room = s.headroom("acme")
    assert room.tenant_transfers == 0 and room.tenant_bytes == 2_000_000_000 - p.transfers[0].bytes
    assert s.headroom("other").tenant_transfers is None  # no default quota in this policy: global budgets only
    s.update_policy(POLICY)
    assert s.headroom("acme").tenant_transfers is None


def test_every_group_of_a_request_falls_back_together():

    d = StateDescriptor(
        tenant_namespace="acme", model="meta-llama/Llama-3.1-8B", model_revision="r", tokenizer_revision="t",
        engine_family="vllm",
        layer_groups=tuple(
            LayerGroup(kv_group=g, semantic_type="gqa", layers=(2 * g, 2 * g + 1),
                       granularity=Granularity(kind="block", tokens=16),
                       tensors=(TensorSpec(role="key", shape=(8, 128), dtype="bfloat16"),
                                TensorSpec(role="value", shape=(8, 128), dtype="bfloat16")))
            for g in range(2)),
        layout={"layout": "paged_nhd", "position": "rope_applied", "rope_theta": 5e5},
    )
    q = query(d, 32768, [WorkerLoad(worker="w-a", profile="h200x1-rdma4x200", queued_prefill_tokens=200_000)])
    nb = len(q.keys)
    p = plan(q, lookup(nb, match("w-a", "host", nb, group=0), match("w-a", "host", nb, group=1)), MODEL, POLICY,
             now=NOW)
    assert len(p.transfers) == 2
    s = PrefetchScheduler(POLICY)
    s.track(p, now=NOW)
    effects = s.complete(result(p.transfers[0], status="failed", error="nic down"), now=NOW + 0.01)
    assert [type(e) for e in effects] == [Unpin, PrefetchFallback, Cancel]
    assert effects[2].ticket.transfer_id == p.transfers[1].transfer_id
    assert s.transfers == 1  # the sibling is cancelled, but counted until its bytes stop moving
    stopped = s.complete(result(p.transfers[1], status="cancelled", error="cancelled after 3 blocks"),
                         now=NOW + 0.02)
    assert [type(e) for e in stopped] == [Unpin] and s.transfers == 0 and s.pinned == 0
    with pytest.raises(ValueError, match="already tracked"):
        s.track(p, now=NOW)


def test_closed_tickets_are_forgotten():
    s = PrefetchScheduler(POLICY)
    p = prefetch_plan()
    s.track(p, now=NOW)
    s.complete(result(p.transfers[0]), now=NOW + 1)
    assert s.forget(before=NOW) == 0 and s.forget(before=NOW + 2) == 1
    assert s.ticket(p.transfers[0].transfer_id) is None and s.open_tickets() == ()
    unknown = result(p.transfers[0])
    assert s.complete(unknown, now=NOW + 3) == []


def test_a_cancelled_copy_whose_result_never_comes_is_released_after_a_grace_and_counted():
    s = PrefetchScheduler(POLICY, lost_result_s=30.0)
    p = prefetch_plan()
    s.track(p, now=NOW)
    deadline = p.decision.deadline_at
    s.tick(now=deadline)
    assert s.transfers == 1 and s.lost_results == 0
    assert s.tick(now=deadline + 29.0) == [] and s.transfers == 1
    s.tick(now=deadline + 30.0)
    assert s.transfers == 0 and s.in_flight_bytes == 0 and s.lost_results == 1
    # A result that comes after all changes nothing more.
    assert s.complete(result(p.transfers[0], status="cancelled", error="late"), now=deadline + 31) == []
    assert s.transfers == 0


def test_pinned_bytes_are_counted_apart_from_bytes_in_flight():
    quota = _policy("[tenancy.quotas.acme]\nmax_pinned_bytes=10000000000\nmax_transfer_bytes_in_flight=20000000000")
    s = PrefetchScheduler(quota)
    p = prefetch_plan(policy=quota)
    s.track(p, now=NOW)
    nbytes = p.transfers[0].bytes
    room = s.headroom("acme")
    assert room.tenant_pinned_bytes == 10_000_000_000 - nbytes and room.tenant_bytes == 20_000_000_000 - nbytes
    # A reused prefix in GPU memory is pinned until consumed, but nothing is in flight for it.
    reuse_q = query(LLAMA8, 8192, [WorkerLoad(worker="w-b", profile="h200x1-rdma4x200")], request_id="r-reuse")
    reuse = plan(reuse_q, lookup(len(reuse_q.keys), match("w-b", "gpu", len(reuse_q.keys))), MODEL, quota, now=NOW)
    assert reuse.decision.action is Action.FULL_REUSE and not reuse.transfers
    pin_hint = next(h for h in reuse.hints if h.kind is HintKind.PIN)
    assert pin_hint.bytes > 0 and pin_hint.keys == reuse_q.keys[:-1]  # the last block is computed
    s.track(reuse, now=NOW)
    assert s.pinned == nbytes + pin_hint.bytes and s.in_flight_bytes == nbytes and s.transfers == 1
    assert s.headroom("acme").tenant_bytes == 20_000_000_000 - nbytes  # in flight: unchanged by the pin
    s.tick(now=pin_hint.expires_at)  # consumed: the pin lapses
    assert s.pinned == nbytes


def test_a_result_that_does_not_report_its_command_changes_nothing():
    """A result is taken only for the transfer it names as ordered: another request, source or
    destination under the same transfer id raises (the service dead-letters it) and the ticket stays open."""
    from nexuskv.entries import EntryLocation
    from nexuskv.errors import ContractError

    s = PrefetchScheduler(POLICY)
    p = prefetch_plan()
    (ticket,) = s.track(p, now=NOW)
    cmd = p.transfers[0]
    elsewhere = EntryLocation(worker="w-z", tier=cmd.destination.tier, group=cmd.destination.group)
    for update in ({"request_id": "r-other"}, {"destination": elsewhere}):
        bad = result(cmd).model_copy(update=update)
        with pytest.raises(ContractError, match="^mismatch: "):
            s.complete(bad, now=NOW + 0.05)
    assert s.ticket(ticket.transfer_id).state is TicketState.IN_FLIGHT
    assert [type(e) for e in s.complete(result(cmd), now=NOW + 0.05)] == [Unpin]
