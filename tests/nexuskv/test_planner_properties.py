"""Properties of the planner over random requests, lookups, loads and policies (hypothesis).

* No decision other than recompute has EG <= 0 (nor a lower bound at or below min_gain).
* No incompatible, uncertain or disallowed candidate is ever chosen — judged by an oracle written
  here from the rules, not by the planner's own predicate.
* The same inputs give the same plan, and every record is a valid wire contract.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nexuskv.contracts import decode, encode
from nexuskv.contracts.decisions import Action
from nexuskv.contracts.plans import WorkerLoad
from nexuskv.contracts.topics import DECISIONS, PLACEMENT, TRANSFERS
from nexuskv.descriptor import Tier
from nexuskv.models import known_model
from nexuskv.planner import Headroom, plan
from nexuskv.policy import parse_policy
from nexuskv.profiles import HARDWARE, shipped_cost_model

from tests.factories import descriptor as tiny
from tests.planning import NOW, lookup, match, query

MODEL = shipped_cost_model()
PROFILES = sorted(HARDWARE)
TIERS = [Tier.GPU, Tier.HOST, Tier.DISK, Tier.REMOTE, Tier.OBJECT]


def _descriptors():
    llama = known_model("meta-llama/Llama-3.1-8B", tenant_namespace="p")
    qwen = known_model("Qwen/Qwen3-32B", tenant_namespace="p")
    dsv3 = known_model("deepseek-ai/DeepSeek-V3", tenant_namespace="p")
    no_partial = tiny(model="meta-llama/Llama-3.1-8B", tenant_namespace="p", block_size=16)
    no_partial = no_partial.model_validate({**no_partial.model_dump(), "materialization": {"partial_prefix": False}})
    return [llama, qwen, dsv3, no_partial]


DESCRIPTORS = _descriptors()


def _weighted(common, rare, p_rare: float = 0.1):
    """Mostly ``common``, sometimes ``rare`` (both strategies)."""
    return st.integers(0, 999).flatmap(lambda r: rare if r < p_rare * 1000 else common)


ALL_SOURCES = ["gpu", "host", "disk", "remote", "object"]
ALL_BACKENDS = ["pinned-host", "rdma", "file", "s3"]


@st.composite
def scenarios(draw):
    d = draw(st.sampled_from(DESCRIPTORS))
    tokens = draw(st.sampled_from([16, 1024, 4096, 8192, 32768, 32768, 131072]))
    nb = tokens // d.block_size
    names = draw(st.lists(st.sampled_from(["w-a", "w-b", "w-c", "w-d"]), min_size=1, max_size=4, unique=True))
    profile = _weighted(st.sampled_from(PROFILES + [None]), st.just("unknown-profile"))
    loads = [WorkerLoad(worker=w, profile=draw(profile),
                        queued_prefill_tokens=draw(st.sampled_from([0, 0, 0, 1000, 50_000, 400_000])),
                        decode_blocks=draw(st.sampled_from([0, 0, 0, 5000, 200_000])))
             for w in names]
    matches = []
    places = draw(st.lists(st.tuples(st.sampled_from(["w-a", "w-b", "w-c", "w-d", "w-far"]), st.sampled_from(TIERS)),
                           min_size=1, max_size=6, unique=True))
    for worker, tier in places:
        prefix = draw(st.one_of(st.just(nb), st.integers(0, nb)))
        group = draw(_weighted(st.just(0), st.just(3)))  # 3 is never a group of these descriptors
        certain = draw(_weighted(st.just(True), st.just(False), 0.15))
        gap_end = min(nb, prefix + 1 + draw(st.integers(0, 8)))
        extents = [(prefix + 1, gap_end)] if draw(st.booleans()) and prefix + 1 < gap_end else []
        if prefix or extents:
            matches.append(match(worker, tier, prefix, group=group, certain=certain, extents=extents))
            if group == 0 and prefix and draw(_weighted(st.just(False), st.just(True))):
                matches.append(match(worker, tier, prefix, group=3))  # an extra, foreign group at the same place
    sources = draw(_weighted(st.just(ALL_SOURCES),
                             st.lists(st.sampled_from(ALL_SOURCES), min_size=1, unique=True), 0.3))
    enabled = draw(_weighted(st.just(ALL_BACKENDS), st.lists(st.sampled_from(ALL_BACKENDS), unique=True), 0.3))
    backends = "".join(
        f"[[backends]]\nname='{name}'\npriority={i}\nenabled={str(name in enabled).lower()}\nlinks=['{link}']\n"
        for i, (name, link) in enumerate([("pinned-host", "host->gpu"), ("rdma", "remote->gpu"),
                                          ("file", "disk->gpu"), ("s3", "object->gpu")]))
    policy = parse_policy(
        "schema_version='nexuskv.execution_policy.v1'\nversion='prop'\n"
        f"[tiers]\nsources={sources!r}\n"
        f"[planner]\nmin_gain_s={draw(st.sampled_from([0.0, 0.0, 0.01]))}\n"
        f"prefetch={str(draw(_weighted(st.just(True), st.just(False), 0.2))).lower()}\n"
        f"route_to_state={str(draw(_weighted(st.just(True), st.just(False), 0.2))).lower()}\n"
        f"confidence_z={draw(st.sampled_from([0.0, 1.645, 1.645, 3.0]))}\n"
        "[budgets]\nmax_index_lag_ms=500\n" + backends, fmt="toml")
    lag = draw(_weighted(st.just(0.0), st.just(900.0)))
    headroom = draw(_weighted(st.just(None), st.sampled_from(
        [Headroom(transfers=0, bytes_per_s=1e12, pinned_bytes=1 << 50),
         Headroom(transfers=8, bytes_per_s=1e9, pinned_bytes=1 << 50)]), 0.2))
    q = query(d, tokens, loads)
    return q, lookup(nb, *matches, lag_ms=lag), policy, headroom


def _oracle_violation(q, lk, policy, decision) -> str | None:
    """Why the chosen candidate breaks a rule (None when it does not), judged from the rules."""
    if decision.action is Action.RECOMPUTE:
        return None
    src = decision.source
    if src is None:
        return "a reuse decision without a source"
    d = q.descriptor
    groups = [g.kv_group for g in d.layer_groups]
    here = [m for m in lk.matches if m.location.worker == src.worker and m.location.tier is src.tier]
    if not here:
        return "chosen source is not in the lookup"
    if any(m.location.group not in groups for m in here):
        return "chosen source holds a KV group the descriptor does not have"
    if {m.location.group for m in here} != set(groups):
        return "chosen source lacks a KV group"
    if not all(m.certain for m in here):
        return "chosen source is uncertain"
    if any(m.prefix_blocks < decision.reused_blocks for m in here):
        return "reuses more blocks than the source holds from block 0"
    # The engine computes the prompt's last token itself: a block-aligned prompt's last block is never reused.
    reusable = min(len(q.keys), (q.prompt_tokens - 1) // d.block_size)
    if decision.reused_blocks > len(q.keys):
        return "reuses more blocks than the prompt has"
    if decision.reused_blocks > reusable:
        return "reuses the block of the prompt's last token, which the engine computes"
    if not policy.allows_source(src.tier):
        return "source tier not allowed"
    if decision.reused_blocks < reusable and not d.materialization.partial_prefix:
        return "partial reuse of a full-only descriptor"
    if decision.action in (Action.TRANSFER, Action.PREFETCH):
        if decision.backend is None or decision.backend not in {b.name for b in policy.backends if b.enabled}:
            return "moved without an enabled backend"
        if lk.lag_ms > policy.budgets.max_index_lag_ms:
            return "moved on a lagging index"
    if decision.worker not in {c.worker for c in q.candidates}:
        return "runs on a worker that is not a candidate"
    return None


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_no_action_but_recompute_without_positive_gain(case):
    q, lk, policy, headroom = case
    dec = plan(q, lk, MODEL, policy, now=NOW, headroom=headroom).decision
    if dec.action is not Action.RECOMPUTE:
        assert dec.eg_s > 0 and dec.eg_lower_s > policy.planner.min_gain_s, dec.reason
    for alt in dec.alternatives:
        if alt.chosen and alt.action is not Action.RECOMPUTE:
            assert alt.eg_s > 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_no_incompatible_uncertain_or_disallowed_candidate_is_chosen(case):
    q, lk, policy, headroom = case
    dec = plan(q, lk, MODEL, policy, now=NOW, headroom=headroom).decision
    violation = _oracle_violation(q, lk, policy, dec)
    assert violation is None, f"{violation}: {dec.reason}"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_same_inputs_same_plan_and_valid_records(case):
    q, lk, policy, headroom = case
    a = plan(q, lk, MODEL, policy, now=NOW, headroom=headroom)
    b = plan(q, lk, MODEL, policy, now=NOW, headroom=headroom)
    assert a.decision == b.decision and a.hints == b.hints and a.transfers == b.transfers
    assert decode(DECISIONS, encode(DECISIONS, a.decision)) == a.decision
    for h in a.hints:
        assert decode(PLACEMENT, encode(PLACEMENT, h)) == h
    for t in a.transfers:
        assert decode(TRANSFERS, encode(TRANSFERS, t)) == t
        assert t.keys == tuple(k for k in q.keys if k in set(t.keys))  # in prompt order
        assert t.source != t.destination
