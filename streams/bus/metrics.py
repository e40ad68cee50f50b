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
        # reason: a short code (unsigned, malformed, no_key, forged, not_entitled, replayed, stale, outside_window,
        # window_full), never free text; every such record is also dead-lettered with its full reason.
        self.records_refused = Counter("nexuskv_records_refused",
                                       "signed-topic records refused before they were acted on",
                                       ["service", "topic", "reason"], registry=registry)
        # reason: tenant, pinned, in_flight, reading, anchored, size, expiry, no_tier, other.
        self.hints_refused = Counter("nexuskv_hints_refused", "placement hints (or their blocks) a tier manager "
                                     "refused to act on", ["kind", "reason"], registry=registry)
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
        # outcome: admitted, already, refused, evicted, collected, lost, undecided (the store did not answer).
        self.remote_tier_blocks = Counter("nexuskv_remote_tier_blocks",
                                          "blocks offered to the remote tier's owner, by what it did with them",
                                          ["outcome"], registry=registry)
        self.unrecoverable = Counter("nexuskv_index_unrecoverable_records",
                                     "kv-events records that retention removed before this index applied them",
                                     ["service", "topic"], registry=registry)
        # reason: queue_full (the collector is behind or down), export_failed (it refused or timed out).
        self.spans_dropped = Counter("nexuskv_spans_dropped", "ended spans not exported",
                                     ["service", "reason"], registry=registry)
        self.spans_exported = Counter("nexuskv_spans_exported", "spans the collector accepted", ["service"],
                                      registry=registry)
        self.bridge_window_full = Counter("nexuskv_bridge_window_full",
                                          "times the kv-event bridge waited for an acknowledgement before sending",
                                          ["service"], registry=registry)
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
