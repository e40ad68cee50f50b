"""The breaker in front of a remote service: open after a failure, one check per backoff, closed by a success."""

from __future__ import annotations

import pytest

from nexuskv.dataplane.deadlines import Breaker
from nexuskv.errors import TierUnavailableError


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_open_fails_at_once_backs_off_while_down_and_closes_on_success():
    clock, up = Clock(), [False]
    checks = []

    def alive() -> bool:
        checks.append(clock.t)
        return up[0]

    b = Breaker("store", alive=alive, first_backoff_s=1.0, max_backoff_s=4.0, clock=clock)
    b.check("GET a")  # closed: goes through
    b.failed("RPC failed")
    assert b.is_open and b.opened == 1
    with pytest.raises(TierUnavailableError, match=r"GET b not tried: the service is down \(RPC failed\); next try in 1.0s"):
        b.check("GET b")
    assert checks == []  # not asked again inside the backoff

    for backoff in (2.0, 4.0, 4.0):  # each check that finds it still down doubles the wait, up to the cap
        clock.t += 10
        with pytest.raises(TierUnavailableError, match=f"next try in {backoff}s"):
            b.check("GET c")
    assert len(checks) == 3 and b.short_circuited == 4

    up[0] = True
    clock.t += 10
    b.check("GET d")  # half open: this one call tries ...
    with pytest.raises(TierUnavailableError):
        b.check("GET e")  # ... the others still fail at once until it answers
    b.succeeded()
    assert not b.is_open
    b.check("GET f")
    b.failed("again")
    assert b.opened == 2
    with pytest.raises(TierUnavailableError, match="next try in 1.0s"):  # the backoff starts over
        b.check("GET g")
