"""Client settings that decide start-up, rebalance and delivery latency — in one place.

Every aiokafka client and every Faust app of NexusKV takes its settings from here (Faust apps
through :func:`streams.faust_app.make_faust_app`).

Group join: a consumer joining a group waits exactly half the session timeout on Tansu 0.6
(measured: 2 s at 4 s, 3 s at 6 s, 5 s at 10 s; the rebalance timeout and heartbeat interval do
not matter), and Kafka's ``group.initial.rebalance.delay.ms`` on Apache Kafka (3 s by default;
the test broker sets it to 0). With Faust's default 60 s session that is ~31 s before a worker's
first event on Tansu. The session cannot go below 6 s: Apache Kafka rejects shorter ones with
INVALID_SESSION_TIMEOUT (``group.min.session.timeout.ms`` defaults to 6000), so 6 s is the floor
that works on both brokers, and it gives Tansu a 3 s join.

Flapping: Faust heartbeats from its consumer thread, so an agent that blocks its event loop
(measured: 9 s of CPU-bound work, longer than the session) keeps its membership. What a blocked
loop does delay is the answer to a rebalance: a member that has not rejoined within the
rebalance timeout is dropped and rejoins later, one extra rebalance. Heartbeats every 0.5 s let
members notice a rebalance within half a second and give a 6 s session twelve chances.

Measured figures are in ``benchmarks/README.md`` (``faust_time_to_first_event``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRODUCER", "CONSUMER", "FAUST", "SESSION_TIMEOUT_S", "HEARTBEAT_INTERVAL_S", "REBALANCE_TIMEOUT_S",
           "TOPIC_PARTITIONS", "LOW_LATENCY_PRODUCER", "LOW_LATENCY_CONSUMER"]

SESSION_TIMEOUT_S = 6.0  # the lowest Apache Kafka accepts by default; Tansu joins in half of it
HEARTBEAT_INTERVAL_S = 0.5
REBALANCE_TIMEOUT_S = 10.0  # longest a rebalance waits for a busy member before dropping it
TOPIC_PARTITIONS = 8  # nexuskv.config.Settings.topic_partitions' default; apps override with theirs

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

# faust.App settings (faust-streaming 0.15.3). Measured effect: first event 4.0 s after process
# start on Tansu (Faust defaults: 31.9 s) and 1.1 s on Apache Kafka (defaults: 2.2 s).
FAUST: dict[str, Any] = {
    # Group membership, as for aiokafka consumers above. The session decides Tansu's join (half of
    # it); Faust's 60 s default costs 30 s per start there, and a dead worker's partitions wait
    # the whole session before they move.
    "broker_session_timeout": SESSION_TIMEOUT_S,
    # Faust's 3 s default makes every member take up to 3 s to notice a rebalance (a second
    # worker joining got its partitions 3.6 s after its start instead of 1.6 s on Kafka).
    "broker_heartbeat_interval": HEARTBEAT_INTERVAL_S,
    # Faust's 60 s default lets one stuck member stall the whole group's rebalance for a minute.
    "broker_rebalance_timeout": REBALANCE_TIMEOUT_S,
    # Faust's default too; explicit because a worker that joins after events were produced must
    # still see them (with "latest" a first start skips them, and recovery can stall: faust #651).
    "consumer_auto_offset_reset": CONSUMER["auto_offset_reset"],
    # Per-partition fetch size, as for aiokafka consumers: at least the largest record we produce.
    "consumer_max_fetch_size": CONSUMER["max_partition_fetch_bytes"],
    # Partitions of topics Faust creates itself (table changelogs, repartition topics); must equal
    # the source topics' count, which ensure_topics creates with NEXUSKV_TOPIC_PARTITIONS.
    "topic_partitions": TOPIC_PARTITIONS,
    # Finish the event an agent is processing before a rebalance or stop (Faust's default): fewer
    # re-deliveries for a short wait, since NexusKV agents handle an event in milliseconds.
    "stream_wait_empty": True,
    # No pause after a rebalance before recovery and processing resume (faust-streaming's default;
    # the original Faust slept 3 s there).
    "stream_recovery_delay": 0.0,
    # exactly_once needs the idempotent, transactional producer that Tansu rejects at start-up.
    "processing_guarantee": "at_least_once",
    # Producer as for aiokafka producers: acks from all replicas, a short linger, no idempotence
    # (Faust enables it only for exactly_once), the same size and timeout limits. Faust's 1200 s
    # request timeout would hide a dead broker for 20 minutes.
    "producer_acks": -1,
    "producer_linger": PRODUCER["linger_ms"] / 1000,
    "producer_max_request_size": PRODUCER["max_request_size"],
    "producer_request_timeout": PRODUCER["request_timeout_ms"] / 1000,
    # No HTTP server unless make_faust_app is given a port: tests and several workers on one
    # machine would fight over port 6066, and it is one more service to start.
    "web_enabled": False,
    # Not patched: Faust's TableManager sleeps a fixed 1 s at start before the consumer may
    # subscribe (faust-streaming 0.15.3, TableManager.on_start). Skipping it meant overriding a
    # private method (an earlier PromptTableManager did: Tansu 5.1 s -> 4.1 s, Kafka 2.1 s ->
    # 0.8 s); NexusKV uses Faust's public settings only, and pays that second per worker start.
    # Left at Faust's defaults, checked and found not to cost start-up time:
    # broker_max_poll_interval (1000 s; Faust polls from its consumer thread whatever the agents
    # do), broker_request_timeout (90 s, must stay >= the session), broker_commit_interval (2.8 s),
    # table_standby_replicas (1), topic_disable_leader (False: the leader topic costs ~5-45 ms and
    # @app.timer(on_leader=True) needs it), table recovery (an empty changelog adds nothing).
    # Not settable: Faust's worker consumer always fetches with fetch_max_wait_ms=1500, and Tansu
    # answers a waiting fetch only after half of that even when a record arrives sooner, so on
    # Tansu an idle worker sees a new event up to ~0.75 s late (Kafka answers at once).
}

# Overrides for the request/response path (the planner service: plan request in, decision out),
# where every millisecond is on a request's admission path. Measured in benchmarks/README.md
# (planner_decision_bus_p99).
LOW_LATENCY_PRODUCER: dict[str, Any] = {
    # Send at once: a 2 ms linger is 2 ms on every decision (the service has one record in hand,
    # not a stream of them to batch).
    "linger_ms": 0,
}
LOW_LATENCY_CONSUMER: dict[str, Any] = {
    # Tansu answers a waiting fetch only after half of fetch_max_wait_ms even when a record arrives
    # sooner (see FAUST above): 100 ms would add ~50 ms per hop. 10 ms costs an idle consumer about
    # 100 fetch requests a second against a broker on loopback, and bounds Tansu's wait at ~5 ms.
    "fetch_max_wait_ms": 10,
}
