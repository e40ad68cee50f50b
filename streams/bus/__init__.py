"""The bus and transport layer: what both engine adapters and services use to reach the bus.

Below the services (``streams/``) and the engine adapters (``connectors/``), above the core
(``nexuskv/``); it imports neither of the first two, nor Faust, DuckDB or the OpenTelemetry SDK
(``lint-imports`` checks it), so an engine process that imports it loads nothing heavy:

* :mod:`~streams.bus.clients` — aiokafka producers and consumers speaking the topic contracts,
  signing, dead letters, waiting out a broker outage;
* :mod:`~streams.bus.broker` — the broker: an embedded Tansu for a laptop, Apache Kafka for tests,
  any Kafka by URL; :mod:`~streams.bus.topics` — topic bootstrap;
* :mod:`~streams.bus.topic_keys` — which topic and key a record goes to;
  :mod:`~streams.bus.tuning` — client settings that decide start-up, rebalance and delivery latency;
* :mod:`~streams.bus.cost_models` — reading the compacted ``nexuskv.cost-models`` topic;
  :mod:`~streams.bus.runtime_publisher` — the reference engine's ordered publisher;
* :mod:`~streams.bus.tracing` (OpenTelemetry API only), :mod:`~streams.bus.metrics`,
  :mod:`~streams.bus.health` — trace context in record headers, the Prometheus collectors, the
  process's liveness and readiness;
* :mod:`~streams.bus.process` — child processes that never outlive NexusKV, signal handling;
  :mod:`~streams.bus.policy_file` — the execution policy file, read at start and watched.
"""
