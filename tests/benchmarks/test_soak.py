"""The soak's short version: ``nexuskv up`` on Apache Kafka overfilled for 45 seconds (CI).

``python -m benchmarks.soak_tiers --minutes 10`` is the full run (``benchmarks/README.md``); this is
the same code with a shorter duration, against the session's Apache Kafka. Every check of the soak
must hold: saves answered and none failed, tiers within capacity, the index equal to what every
tier manager's tiers hold, RSS bounded, every service alive without a traceback, the recurring
prefix found by the planner (matched whole in a tier; loading it is the cost model's call), one-off blocks evicted rather than recurring ones.
"""

from __future__ import annotations

import pytest

from benchmarks.soak_tiers import SoakConfig, run_soak


@pytest.mark.broker
@pytest.mark.slow
async def test_a_short_soak_keeps_every_promise(kafka_url, tmp_path):
    config = SoakConfig(duration_s=45.0, engines=2, remote_blocks=256, sample_s=3.0)
    result = await run_soak(config, kafka_url, tmp_path)
    assert result.failures() == [], result.as_dict()
    # The load did what a soak is for: every tier overfilled, and the checks had something to check.
    assert all(v >= 2 for k, v in result.overfill.items() if k.endswith("/host")), result.overfill
    assert result.overfill["soak-w0/gpu"] >= 2 and result.counters["soak-w0"]["garbage"] > 0
    assert result.saves["saved"] > 10 * config.host_blocks and result.evicted_one_off > 0
    assert result.recurring_requests >= 10 and result.recurring_hit_rate >= 0.8
    assert set(result.index_equal) == {"soak-e0", "soak-e1", "soak-w0", "remote-tier"}
    assert {"streams.tier_manager", "streams.planner_service", "streams.remote_tier_manager"} <= set(result.alive)
    # The shared remote tier overfilled too, and its owner evicted instead of refusing the puts.
    assert result.remote_saves["written"] > 0 and result.remote_saves["failed"] == 0
    assert result.counters["remote-tier"]["admitted"] > 0
