"""Client settings that decide start-up, rebalance and delivery latency — in one place.

Every aiokafka client and every Faust app of NexusKV takes its settings from here.

Group join: a consumer joining a group waits about half the session timeout on Tansu (and
Kafka's ``group.initial.rebalance.delay.ms`` on Apache Kafka, 3 s by default; the test broker
sets it to 0). With Faust's default 60 s session that is ~30 s before the first event. A short
session timeout brings it down; too short and a GC pause or a busy event loop on these 2-core
machines misses heartbeats and the group rebalances ("flaps"). Heartbeats every 0.5 s give a
6 s session twelve chances. Measured figures are in ``benchmarks/README.md``
(``faust_time_to_first_event``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRODUCER", "CONSUMER", "SESSION_TIMEOUT_S", "HEARTBEAT_INTERVAL_S", "REBALANCE_TIMEOUT_S"]

SESSION_TIMEOUT_S = 6.0
HEARTBEAT_INTERVAL_S = 0.5
REBALANCE_TIMEOUT_S = 10.0

PRODUCER: dict[str, Any] = {
    "acks": "all",
    "linger_ms": 2,
    "enable_idempotence": False,  # Tansu rejects InitProducerId v0, which aiokafka sends
    "max_request_size": 1 << 20,
    "request_timeout_ms": 30_000,
}

CONSUMER: dict[str, Any] = {
    "auto_offset_reset": "earliest",
    "enable_auto_commit": False,
    "session_timeout_ms": int(SESSION_TIMEOUT_S * 1000),
    "heartbeat_interval_ms": int(HEARTBEAT_INTERVAL_S * 1000),
    "rebalance_timeout_ms": int(REBALANCE_TIMEOUT_S * 1000),
    "fetch_max_wait_ms": 100,
    "max_partition_fetch_bytes": 2 << 20,
}
