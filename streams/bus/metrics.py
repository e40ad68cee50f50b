"""Every NexusKV process's Prometheus collectors, declared once, on one registry.

Services serve :data:`REGISTRY` on ``NEXUSKV_METRICS_PORT`` (:func:`streams.telemetry.serve_metrics`);
engine processes may count into it too (nothing is served there unless they ask).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["METRICS", "REGISTRY"]

REGISTRY = CollectorRegistry(auto_describe=True)


class _Metrics:
    """Every service's Prometheus collectors, declared once."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.events_applied = Counter("nexuskv_events_applied", "KV lifecycle batches and block operations applied",
                                      ["service", "unit"], registry=registry)
        self.events_rejected = Counter("nexuskv_events_rejected", "records sent to the dead-letter topic",
                                       ["service", "topic"], registry=registry)
        self.consumer_lag = Gauge("nexuskv_consumer_lag", "records behind the end of the consumed topic",
                                  ["service", "topic"], registry=registry)
        # reason: a short code (the planner's reason up to its first ':'), never free text.
        self.decisions = Counter("nexuskv_decisions", "planner decisions", ["action", "reason"], registry=registry)
        self.transfers = Counter("nexuskv_transfer_outcomes", "transfer results", ["status", "link"],
                                 registry=registry)
        self.index_size = Gauge("nexuskv_index_memberships", "(block, location) memberships in the index",
                                ["service"], registry=registry)
        # kind: capacity, used, reserved (prefetch room and copies landing), pinned.
        self.tier_bytes = Gauge("nexuskv_tier_bytes", "bytes of a managed tier by kind", ["tier", "kind"],
                                registry=registry)
        self.unrecoverable = Counter("nexuskv_index_unrecoverable_records",
                                     "kv-events records that retention removed before this index applied them",
                                     ["service", "topic"], registry=registry)
        self.alive = Gauge("nexuskv_service_alive", "1 while no supervised task failed and the loop answers",
                           ["service"], registry=registry)
        self.ready = Gauge("nexuskv_service_ready", "1 while every readiness condition of the service holds",
                           ["service"], registry=registry)
        # reason: connections, frame_deadline, frame_size, malformed, too_many_keys, bad_scope, bulk_busy,
        # evicted (an idle connection closed for a new one), accept_failed.
        self.index_ask_refusals = Counter("nexuskv_index_ask_refusals",
                                          "engine asks and connections the node's index sidecar refused, by reason",
                                          ["reason"], registry=registry)
        self.index_ask_connections = Gauge("nexuskv_index_ask_connections",
                                           "engine connections the node's index sidecar holds open", registry=registry)


METRICS = _Metrics(REGISTRY)
