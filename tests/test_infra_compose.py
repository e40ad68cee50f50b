"""The deployment files stay consistent with the code: every service command names a module that
exists, every setting is NexusKV's and parses, and the collector's configuration routes OTLP traces
to its Jaeger exporter. These read the files; they run nothing (no Docker engine runs on the CI
machines; `docker compose config` is the next check where one does)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

from nexuskv.config import Settings
from streams.app.services import SERVICES

COMPOSE = Path(__file__).resolve().parents[1] / "infra" / "compose"


def test_compose_declares_every_registered_service_with_valid_settings():
    doc = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    services = doc["services"]
    assert {"kafka", "otel-collector", "jaeger"} <= set(services)
    modules = {s["command"][0] for name, s in services.items() if "command" in s and name not in
               ("otel-collector",)}
    for module in modules:
        assert importlib.util.find_spec(module) is not None, module
    assert {s.module for s in SERVICES} <= modules | {"streams.index_api"}
    assert "streams.sink" in modules
    env = services["planner"]["environment"]
    names = {f.json_schema_extra["env"] for f in Settings.model_fields.values()}
    assert set(env) <= names
    Settings.from_env({k: str(v) for k, v in env.items()})  # the values parse
    assert env["NEXUSKV_BROKER"] == "kafka://kafka:9092"
    kafka = services["kafka"]["environment"]
    assert kafka["KAFKA_PROCESS_ROLES"] == "broker,controller"


def test_collector_config_routes_otlp_traces_to_the_jaeger_exporter():
    cfg = yaml.safe_load((COMPOSE / "otel-collector.yaml").read_text())
    assert cfg["service"]["pipelines"]["traces"]["exporters"] == ["otlp/jaeger"]
    assert cfg["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")
