"""Every wire contract round-trips through its topic codec; bad payloads fail with a reason."""

import json
from pathlib import Path

import msgpack
import pytest

from nexuskv.contracts import TOPICS, decode, encode, topic_named
from nexuskv.contracts.cost_models import ComputeFit, CostModelEntry, LinkFit
from nexuskv.contracts.dead_letter import DeadLetter
from nexuskv.contracts.decisions import Action, Alternative, CostTerms, Decision
from nexuskv.contracts.kv_events import AllCleared, BlockStored, KvEventBatch, Snapshot
from nexuskv.contracts.observations import (
    LoadObservation,
    ObservationRecord,
    PrefillObservation,
    TransferObservation,
)
from nexuskv.contracts.placement import HintKind, PlacementHint
from nexuskv.contracts.plans import PlanRequest, WorkerLoad
from nexuskv.contracts.tier_offers import OfferedBlock, TierOffer
from nexuskv.contracts.tier_state import TierStateRecord
from nexuskv.contracts.topics import KV_EVENTS, OBSERVATIONS
from nexuskv.contracts.transfers import TransferCommand, TransferResult, TransferStatus
from nexuskv.entries import EntryLocation
from nexuskv.errors import ContractError, SchemaVersionError
from nexuskv.schemas import schema_documents

from tests.factories import descriptor, kv_batch, scope

GPU_A = EntryLocation(worker="w-a", tier="gpu", group=0)
DISK_A = EntryLocation(worker="w-a", tier="disk", group=0)


def samples():
    batch = kv_batch()
    tiered = KvEventBatch(publisher="p", incarnation=0, seq=5, ts=0.0, identity=batch.identity,
                          events=(AllCleared(), AllCleared(tier="host"), Snapshot(phase="begin"),
                                  BlockStored(engine_hashes=(2**64 - 1, 0), parent=2**63, block_size=16,
                                              token_ids=tuple(range(32)), extra_keys=(None, ["mm", 3]),
                                              lora="adapter", cache_salt="s", tenant_namespace="t2", group=3),
                                  Snapshot(phase="end")))
    obs = [ObservationRecord(observed_at=1.0, observation=o) for o in (
        PrefillObservation(model="m", profile="h200", worker="w", uncached_tokens=100, context_tokens=200,
                           duration_s=0.01),
        TransferObservation(source_tier="disk", destination_tier="host", backend="file", worker="w",
                            bytes=1 << 20, pages=4, duration_s=0.002),
        LoadObservation(worker="w", queued_prefill_tokens=3, decode_blocks=40, active_requests=2),
    )]
    plan = PlanRequest(request_id="r1", scope=scope(), block_size=4, prompt_tokens=9, keys=(1, 2**127),
                       arrival_at=10.0, slo_ttft_s=0.5, candidates=(WorkerLoad(worker="w-a"), WorkerLoad(worker="w-b",
                       queued_prefill_tokens=100)))
    plan_described = PlanRequest(request_id="r3", scope=scope(), block_size=4, prompt_tokens=8, keys=(5, 6),
                                 arrival_at=1.0, candidates=(WorkerLoad(worker="w-a", profile="h200x1-rdma4x200"),),
                                 descriptor=descriptor(tenant_namespace="tenant-a"), trace_id="00-ab-cd-01")
    alt = Alternative(action=Action.RECOMPUTE, worker="w-b", t_compute_s=0.3, t_with_reuse_s=0.3, eg_s=0.0,
                      eg_lower_s=0.0, rejected_reason="lower EG")
    uncosted = Alternative(action=Action.TRANSFER, worker="w-a", source=DISK_A, destination=GPU_A, t_compute_s=0.3,
                           rejected_reason="publisher uncertain: treated as a miss")
    prefetch = Alternative(action=Action.PREFETCH, worker="w-a", source=DISK_A, destination=GPU_A, backend="file",
                           reused_tokens=8, reused_blocks=2, t_compute_s=0.3, t_tail_s=0.01, t_with_reuse_s=0.2,
                           eg_s=0.09, eg_std_s=0.01, eg_lower_s=0.07, p_use=0.97, deadline_at=12.0)
    decision = Decision(request_id="r1", tenant_namespace="tenant-a", decided_at=11.0, action=Action.TRANSFER,
                        worker="w-a", source=DISK_A, destination=GPU_A, prompt_tokens=9, reused_tokens=8,
                        reused_blocks=2, t_compute_s=0.3, t_with_reuse_s=0.1,
                        terms=CostTerms(transfer_s=0.05, restore_s=0.01, total_s=0.06), eg_s=0.2, eg_lower_s=0.15,
                        reason="EG 0.2 s > 0", alternatives=(alt, uncosted, prefetch), alternatives_total=7,
                        policy_version="p1", cost_model_version="c1", baseline_worker="w-b", backend="file",
                        eg_std_s=0.02, t_tail_s=0.01, revision=1)
    hint = PlacementHint(hint_id="h1", request_id="r1", tenant_namespace="tenant-a", prefix_root=7,
                         kind=HintKind.ROUTE, worker="w-a", tier="gpu", blocks=2, issued_at=1.0, reason="state")
    cancel = PlacementHint(hint_id="h2", request_id="r1", tenant_namespace="tenant-a", kind=HintKind.CANCEL,
                           worker="w-a", tier="gpu", first_block=2, blocks=3, transfer_id="t1", issued_at=2.0,
                           reason="deadline passed")
    cmd = TransferCommand(transfer_id="t1", request_id="r1", descriptor_id="sd1-x", tenant_namespace="tenant-a",
                          keys=(1, 2), source=DISK_A, destination=GPU_A, bytes=4096, issued_at=1.0,
                          deadline_at=2.0, backend="file")
    cov = ((1e-6, 0.0, 0.0), (0.0, 1e-12, 1e-14), (0.0, 1e-14, 1e-20))
    fit_c = CostModelEntry(entry=ComputeFit(model="m", profile="h200"), mean=(0.01, 3e-5, 5e-10), cov=cov,
                           residual_rel_std=0.02, observations=100, version=3, fitted_at=5.0, publisher="cal-1",
                           method="weighted RLS")
    fit_l = CostModelEntry(entry=LinkFit(profile="h200", source_tier="host", destination_tier="gpu"),
                           mean=(1e-4, 2e-6, 2e-11), cov=cov, residual_rel_std=0.05, observations=10, version=1,
                           fitted_at=5.0, publisher="cal-1", method="weighted RLS")
    ok = TransferResult(transfer_id="t1", request_id="r1", status=TransferStatus.COMPLETED, source=DISK_A,
                        destination=GPU_A, blocks_moved=2, bytes_moved=4096, started_at=1.0, finished_at=1.5)
    late = TransferResult(transfer_id="t1", request_id="r1", status=TransferStatus.DEADLINE_EXCEEDED, source=DISK_A,
                          destination=GPU_A, started_at=1.0, finished_at=2.5, error="deadline 2.0 passed")
    dead = DeadLetter(source_topic="nexuskv.kv-events", partition=3, offset=10, key=b"pub", payload=b"\x00\xffxyz",
                      payload_size=5, reason="undecodable", error_type="ContractError", service="index",
                      rejected_at=3.0)
    pin = PlacementHint(hint_id="h3", request_id="r1", tenant_namespace="tenant-a", kind=HintKind.PIN, worker="w-a",
                        tier="host", first_block=0, blocks=2, keys=(1, 2**128 - 1), bytes=8192, descriptor_id="sd1-x",
                        transfer_id="t1", expires_at=3.0, issued_at=2.0, reason="source of a transfer")
    state = TierStateRecord(worker="w-a", tier="gpu", backend="device-memory", policy="utility",
                            capacity_bytes=1 << 28, used_bytes=1 << 27, reserved_bytes=4096, pinned_bytes=8192,
                            in_flight_bytes=4096, blocks=12, unannounced_blocks=2, price_s_per_gib=float("inf"),
                            price_bytes=1 << 22, counters={"demoted": 3}, published_at=4.0)
    offer = TierOffer(offer_id="w-a/1", writer="w-a", tenant_namespace="tenant-a", identity=batch.identity,
                      descriptor_id=batch.identity.descriptor_id, block_size=16, cache_salt="s",
                      blocks=(OfferedBlock(key=2**128 - 1, nbytes=4096, checksum=7, position=0),
                              OfferedBlock(key=5, parent=2**128 - 1, nbytes=4096, checksum=2**127, position=1)),
                      offered_at=4.0)
    return [batch, tiered, *obs, plan, plan_described, decision, hint, cancel, pin, cmd, ok, late, fit_c,
            fit_l, state, offer, dead]


def _topic_for(value):
    return next(t for t in TOPICS if isinstance(value, t.contract))


@pytest.mark.parametrize("value", samples(), ids=lambda v: type(v).__name__)
def test_round_trip_through_the_topic_codec(value):
    topic = _topic_for(value)
    raw = encode(topic, value)
    assert decode(topic, raw) == value
    assert decode(topic, encode(topic, decode(topic, raw))) == value


def test_every_topic_has_a_sample():
    assert {_topic_for(v).name for v in samples()} == {t.name for t in TOPICS}


def test_a_tier_offer_is_refused_when_inconsistent():
    ident = kv_batch().identity.model_dump()
    block = {"key": 1, "nbytes": 4096, "checksum": 7, "position": 0}
    base = {"offer_id": "o", "writer": "w", "tenant_namespace": "t", "identity": ident,
            "descriptor_id": ident["descriptor_id"], "block_size": 16, "blocks": [block], "offered_at": 1.0}
    assert TierOffer.model_validate(base).nbytes == 4096
    with pytest.raises(ContractError, match="offered twice"):
        TierOffer.model_validate({**base, "blocks": [block, block]})
    with pytest.raises(ContractError, match="identity"):
        TierOffer.model_validate({**base, "descriptor_id": "sd1-other"})
    with pytest.raises(ContractError, match="blocks"):
        TierOffer.model_validate({**base, "blocks": []})


def test_kv_events_are_msgpack_and_others_json():
    assert msgpack.unpackb(encode(KV_EVENTS, kv_batch()))["publisher"] == "vllm/pod-a/dp0"
    obs = samples()[2]
    assert json.loads(encode(OBSERVATIONS, obs))["observation"]["kind"] == "prefill"
    assert topic_named("nexuskv.decisions").contract is Decision
    assert topic_named("nope") is None


def test_encoding_the_wrong_type_is_refused():
    with pytest.raises(ContractError):
        encode(KV_EVENTS, samples()[2])


def _good():
    return msgpack.unpackb(encode(KV_EVENTS, kv_batch()))


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (encode(KV_EVENTS, kv_batch())[:-7], "undecodable"),
        (b"\xc1\xc1\xc1", "undecodable"),
        (msgpack.packb([1, 2, 3]), "top level must be a map"),
        (msgpack.packb({**_good(), "schema_version": 3}), "schema_version 3"),
        (msgpack.packb({k: v for k, v in _good().items() if k != "schema_version"}), "schema_version is missing"),
        (msgpack.packb({**_good(), "seq": "seven"}), "seq"),
        (msgpack.packb({**_good(), "events": [{"type": "exploded"}]}), "events"),
        (msgpack.packb({**_good(), "events": [{"type": "stored", "engine_hashes": list(range(5000)),
                                                "block_size": 4}]}), "engine_hashes"),
        (msgpack.packb({**_good(), "events": [{"type": "stored", "engine_hashes": [1, 2], "block_size": 4,
                                                "token_ids": [1, 2, 3]}]}), "token_ids"),
        (msgpack.packb({**_good(), "events": [{"type": "removed", "engine_hashes": [-1]}]}), "engine_hashes"),
        (msgpack.packb({**_good(), "extra": 1}), "extra"),
    ],
    ids=["truncated", "garbage", "not-a-map", "version", "no-version", "wrong-type", "unknown-tag", "oversized",
         "token-count", "negative-hash", "unknown-field"],
)
def test_malformed_kv_events_fail_with_a_reason(raw, reason):
    with pytest.raises(ContractError) as info:
        decode(KV_EVENTS, raw)
    assert reason in str(info.value)


def test_engine_hashes_are_normalised_u64():
    from nexuskv.contracts.kv_events import BlockRemoved

    assert BlockRemoved(engine_hashes=(2**64 - 1,)).engine_hashes == (2**64 - 1,)
    with pytest.raises(ValueError):
        BlockRemoved(engine_hashes=(2**64,))


def test_schema_version_errors_are_their_own_type():
    with pytest.raises(SchemaVersionError):
        decode(KV_EVENTS, msgpack.packb({**_good(), "schema_version": 9}))


def test_transfer_results_never_claim_completion_with_an_error_nor_fail_silently():
    base = dict(transfer_id="t", request_id="r", source=DISK_A, destination=GPU_A, started_at=1.0, finished_at=2.0)
    with pytest.raises(ValueError):
        TransferResult(status="completed", error="checksum mismatch", **base)
    with pytest.raises(ValueError):
        TransferResult(status="integrity_error", **base)
    with pytest.raises(ValueError):
        TransferCommand(transfer_id="t", request_id="r", descriptor_id="d", tenant_namespace="t", keys=(1,),
                        source=GPU_A, destination=GPU_A, bytes=1, issued_at=0, deadline_at=1)


def test_plan_request_needs_keys_or_tokens_consistent_with_prompt():
    with pytest.raises(ValueError):
        PlanRequest(request_id="r", scope=scope(), block_size=4, prompt_tokens=9, keys=(1,), arrival_at=0,
                    candidates=(WorkerLoad(worker="a"),))
    with pytest.raises(ValueError):
        PlanRequest(request_id="r", scope=scope(), block_size=4, prompt_tokens=4, arrival_at=0,
                    candidates=(WorkerLoad(worker="a"),))


def test_committed_json_schemas_match_the_contracts():
    folder = Path(__file__).resolve().parents[2] / "infra" / "schemas"
    docs = schema_documents()
    assert {p.name for p in folder.glob("*.schema.json")} == set(docs)
    for name, doc in docs.items():
        committed = json.loads((folder / name).read_text())
        assert committed == json.loads(json.dumps(doc, sort_keys=True)), f"{name} is stale: run `nexuskv schemas`"


def test_cost_model_entries_are_keyed_and_their_covariance_checked():
    fits = [v for v in samples() if isinstance(v, CostModelEntry)]
    assert [f.key for f in fits] == ["compute/m/h200", "link/h200/host->gpu"]
    data = fits[0].model_dump()
    with pytest.raises(ValueError, match="symmetric"):
        CostModelEntry(**{**data, "cov": ((1.0, 2.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))})
    with pytest.raises(ValueError, match="negative"):
        CostModelEntry(**{**data, "cov": ((-1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))})
    with pytest.raises(ValueError):
        CostModelEntry(**{**data, "mean": (float("nan"), 0.0, 0.0)})


def test_a_plan_request_descriptor_must_match_its_scope_and_block_size():
    good = dict(request_id="r", scope=scope(), block_size=4, prompt_tokens=4, keys=(1,), arrival_at=0,
                candidates=(WorkerLoad(worker="a"),))
    PlanRequest(**good, descriptor=descriptor())
    with pytest.raises(ValueError, match="descriptor_id"):
        PlanRequest(**good, descriptor=descriptor(num_layers=5))
    with pytest.raises(ValueError, match="block_size"):
        PlanRequest(**{**good, "block_size": 2, "prompt_tokens": 2}, descriptor=descriptor())


def test_placement_hints_of_version_1_still_decode_and_keys_fit_the_contract():
    from nexuskv.contracts.topics import PLACEMENT

    v1 = (b'{"schema_version":1,"hint_id":"h","tenant_namespace":"t","kind":"pin","worker":"w","issued_at":1.0,'
          b'"reason":"r"}')
    hint = decode(PLACEMENT, v1)
    assert hint.keys == () and hint.bytes == 0 and hint.descriptor_id is None
    with pytest.raises(SchemaVersionError):
        decode(PLACEMENT, v1.replace(b'"schema_version":1', b'"schema_version":3'))
    with pytest.raises(ContractError):
        decode(PLACEMENT, v1.replace(b'"reason":"r"', b'"reason":"r","keys":[-1]'))
