"""Signed control records (nexuskv.contracts.control_signature): domains, entitlement, the replay window."""

from __future__ import annotations

import pytest

from nexuskv.contracts import control_signature as cs
from nexuskv.contracts import kv_signature
from nexuskv.contracts.control_signature import ControlVerifier, Envelope, Refusal, ReplayWindow

SECRET = b"bus-secret-of-the-test-deployment"
PLACEMENT, TRANSFERS, RESULTS = "nexuskv.placement", "nexuskv.transfers", "nexuskv.transfer-results"
NOW = 1_000_000.0


def _signed(topic: str, producer: str, *, seq: int = 0, key: bytes = b"acme/root", value: bytes = b'{"v":1}',
            sent_at: float = NOW, incarnation: int = 7, secret: bytes = SECRET) -> tuple[bytes, bytes, list]:
    env = Envelope(producer, incarnation, seq, sent_at)
    header = cs.sign(cs.producer_key(secret, producer), topic, env, key, value)
    return key, value, [("traceparent", b"00-x"), (cs.SIGNATURE_HEADER, header)]


def _check(v: ControlVerifier, topic: str, record: tuple[bytes, bytes, list], now: float = NOW):
    key, value, headers = record
    return v.check(topic, key, value, headers, now=now)


def test_a_signed_record_round_trips_and_names_its_producer():
    v = ControlVerifier(SECRET)
    got = _check(v, PLACEMENT, _signed(PLACEMENT, "planner/nexuskv-planner", seq=3))
    assert isinstance(got, Envelope)
    assert (got.producer, got.incarnation, got.seq, got.sent_at) == ("planner/nexuskv-planner", 7, 3, NOW)


@pytest.mark.parametrize("mutate, code", [
    (lambda k, v, h: (k, v, [x for x in h if x[0] != cs.SIGNATURE_HEADER]), "unsigned"),
    (lambda k, v, h: (k, v + b" ", h), "forged"),  # value changed after signing
    (lambda k, v, h: (b"globex/root", v, h), "forged"),  # key changed: another tenant's partition
    (lambda k, v, h: (k, v, [*h, h[-1]]), "malformed"),  # two signatures
    (lambda k, v, h: (k, v, [(cs.SIGNATURE_HEADER, h[-1][1][:20])]), "malformed"),
])
def test_unsigned_forged_and_malformed_records_are_refused(mutate, code):
    v = ControlVerifier(SECRET)
    got = _check(v, PLACEMENT, mutate(*_signed(PLACEMENT, "planner/p")))
    assert isinstance(got, Refusal) and got.code == code, got
    assert len(v.window) == 0  # a refusal is not remembered


def test_another_secret_or_the_producer_name_changed_is_forged():
    v = ControlVerifier(SECRET)
    assert _check(v, PLACEMENT, _signed(PLACEMENT, "planner/p", secret=b"x" * 32)).code == "forged"
    key, value, headers = _signed(PLACEMENT, "planner/p")
    raw = headers[-1][1]
    renamed = raw.replace(b"planner/p", b"planner/q")
    assert _check(v, PLACEMENT, (key, value, [(cs.SIGNATURE_HEADER, renamed)])).code == "forged"


def test_a_record_signed_for_one_topic_is_refused_on_another():
    v = ControlVerifier(SECRET)
    # A planner's transfer command replayed as a placement hint: same producer, same bytes, other domain.
    got = _check(v, PLACEMENT, _signed(TRANSFERS, "planner/p"))
    assert isinstance(got, Refusal) and got.code == "forged"


def test_a_kv_events_signature_is_no_control_signature():
    v = ControlVerifier(SECRET)
    key, value = b"planner/p", b"{}"
    tag = kv_signature.sign(kv_signature.publisher_key(SECRET, "planner/p"), key, value)
    assert _check(v, PLACEMENT, (key, value, [(kv_signature.SIGNATURE_HEADER, tag)])).code == "unsigned"
    assert cs.producer_key(SECRET, "planner/p") != kv_signature.publisher_key(SECRET, "planner/p")


def test_only_entitled_roles_may_produce_on_each_topic():
    v = ControlVerifier(SECRET)
    for topic, producer in ((PLACEMENT, "executor/w0"), (TRANSFERS, "executor/w0"), (RESULTS, "planner/p"),
                            (PLACEMENT, "vllm/10.0.0.5:8000/dp0"), (PLACEMENT, "plannerx/p")):
        got = _check(v, topic, _signed(topic, producer))
        assert isinstance(got, Refusal) and got.code == "not_entitled", (topic, producer, got)
    for seq, (topic, producer) in enumerate(((PLACEMENT, "planner/p"), (TRANSFERS, "planner/p"),
                                              (RESULTS, "executor/w0"))):
        assert isinstance(_check(v, topic, _signed(topic, producer, seq=seq)), Envelope)


def test_a_record_is_taken_once():
    v = ControlVerifier(SECRET)
    rec = _signed(PLACEMENT, "planner/p", seq=5)
    assert isinstance(_check(v, PLACEMENT, rec), Envelope)
    again = _check(v, PLACEMENT, rec)
    assert isinstance(again, Refusal) and again.code == "replayed" and "taken already" in again.reason
    # the same seq of another incarnation (the planner restarted) is a new record
    assert isinstance(_check(v, PLACEMENT, _signed(PLACEMENT, "planner/p", seq=5, incarnation=8)), Envelope)


def test_the_window_takes_records_out_of_order_and_refuses_what_is_too_far_behind():
    w = ReplayWindow(window=8)
    env = lambda seq: Envelope("planner/p", 1, seq, NOW)  # noqa: E731
    for seq in (10, 7, 12, 3):  # 3 is 9 behind 12: outside
        got = w.admit(env(seq), now=NOW)
        assert got is None or (seq == 3 and got.code == "outside_window"), (seq, got)
    assert w.admit(env(11), now=NOW) is None
    for seq in (10, 7, 12, 11):
        assert w.admit(env(seq), now=NOW).code == "replayed"
    assert w.admit(env(100), now=NOW) is None  # a jump past the window forgets everything below it
    assert w.admit(env(12), now=NOW).code == "outside_window"
    assert w.admit(env(99), now=NOW) is None and w.admit(env(99), now=NOW).code == "replayed"


def test_stale_and_future_records_are_refused():
    w = ReplayWindow(max_age_s=60, skew_s=5)
    assert w.admit(Envelope("planner/p", 1, 0, NOW - 61), now=NOW).code == "stale"
    assert w.admit(Envelope("planner/p", 1, 1, NOW + 6), now=NOW).code == "stale"
    assert w.admit(Envelope("planner/p", 1, 2, NOW - 59), now=NOW) is None
    assert len(w) == 1


def test_the_window_is_bounded_and_forgets_only_streams_that_cannot_be_replayed():
    w = ReplayWindow(max_age_s=60, max_streams=2)
    assert w.admit(Envelope("planner/a", 1, 0, NOW), now=NOW) is None
    assert w.admit(Envelope("planner/b", 1, 0, NOW), now=NOW) is None
    full = w.admit(Envelope("planner/c", 1, 0, NOW), now=NOW + 1)
    assert full is not None and full.code == "window_full"  # both fresh: forgetting one would reopen it
    # Later, a's newest record is older than max_age: every replay of it is stale, so a goes.
    assert w.admit(Envelope("planner/b", 1, 1, NOW + 50), now=NOW + 50) is None
    assert w.admit(Envelope("planner/c", 1, 0, NOW + 61), now=NOW + 61) is None
    assert len(w) == 2
    assert w.admit(Envelope("planner/a", 1, 0, NOW), now=NOW + 61).code == "stale"
    assert w.admit(Envelope("planner/b", 1, 1, NOW + 50), now=NOW + 61).code == "replayed"


def test_without_a_secret_nothing_is_checked():
    v = ControlVerifier(b"")
    assert not v.authenticated
    assert _check(v, PLACEMENT, (b"k", b"v", [])) is None


def test_producer_names_and_keys_are_checked():
    with pytest.raises(ValueError):
        cs.producer_key(b"", "planner/p")
    with pytest.raises(ValueError):
        cs.sign(b"k" * 32, PLACEMENT, Envelope("", 1, 0, NOW), b"k", b"v")
    with pytest.raises(ValueError):
        cs.sign(b"k" * 32, PLACEMENT, Envelope("p" * 300, 1, 0, NOW), b"k", b"v")
    assert cs.role_of("planner/nexuskv-planner") == "planner" and cs.role_of("executor") == "executor"


def test_a_host_given_keys_but_no_secret_checks_with_them_and_fails_closed():
    planner_key = cs.producer_key(SECRET, "planner/p")
    v = ControlVerifier(b"", keys={"planner/p": planner_key})
    assert v.authenticated
    assert isinstance(_check(v, PLACEMENT, _signed(PLACEMENT, "planner/p")), Envelope)
    got = _check(v, PLACEMENT, _signed(PLACEMENT, "planner/q", seq=1))  # a planner this host has no key for
    assert isinstance(got, Refusal) and got.code == "no_key"
    assert _check(v, PLACEMENT, (b"k", b"v", [])).code == "unsigned"


def test_a_record_not_acted_on_is_checked_for_its_signature_only():
    v = ControlVerifier(SECRET)
    old = _signed(TRANSFERS, "planner/p", sent_at=NOW - 3600)  # another worker's command, an hour old
    got = v.check(TRANSFERS, *old, now=NOW, admit=False)
    assert isinstance(got, Envelope) and len(v.window) == 0
    assert v.check(TRANSFERS, *old, now=NOW).code == "stale"
    forged = _signed(TRANSFERS, "planner/p", secret=b"y" * 32)
    assert v.check(TRANSFERS, *forged, now=NOW, admit=False).code == "forged"
