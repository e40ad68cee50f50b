"""Typed settings: every setting declared once, with type, default, environment name and doc.

:meth:`Settings.from_env` reads ``NEXUSKV_*`` variables and fails at start with a
:class:`~nexuskv.errors.ConfigError` naming the variable. Lower layers receive plain values
(a parsed :class:`BrokerUrl`, a partition count), never the whole settings object.

``nexuskv config`` prints the table in the README from these declarations.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator

from nexuskv.errors import ConfigError

__all__ = ["BrokerUrl", "Settings", "parse_broker_url", "setting_rows"]


@dataclass(frozen=True, slots=True)
class BrokerUrl:
    """A parsed ``kafka://host:port[,host:port...]`` URL."""

    url: str
    hosts: tuple[tuple[str, int], ...]

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.hosts)

    def __str__(self) -> str:
        return self.url


def parse_broker_url(url: str, *, field: str = "NEXUSKV_BROKER") -> BrokerUrl:
    """Parse a broker URL; any defect raises ConfigError naming ``field`` and the URL."""
    text = (url or "").strip()
    if not text.startswith("kafka://"):
        raise ConfigError(field, f"invalid broker URL {url!r}: expected kafka://host:port[,host:port...]")
    body = text[len("kafka://"):].rstrip("/")
    if not body:
        raise ConfigError(field, f"invalid broker URL {url!r}: no host")
    hosts: list[tuple[str, int]] = []
    for part in body.split(","):
        host, sep, port_text = part.strip().rpartition(":")
        if not sep or not host or not port_text.isdigit():
            raise ConfigError(field, f"invalid broker URL {url!r}: {part!r} is not host:port")
        port = int(port_text)
        if not 0 < port < 65536:
            raise ConfigError(field, f"invalid broker URL {url!r}: port {port} out of range")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if any(c.isspace() or c in "/?#@" for c in host):
            raise ConfigError(field, f"invalid broker URL {url!r}: bad host {host!r}")
        hosts.append((host, port))
    return BrokerUrl(url=text, hosts=tuple(hosts))


def _env(name: str, doc: str, default: Any, **kw: Any) -> Any:
    return Field(default, description=doc, json_schema_extra={"env": name}, **kw)


class Settings(BaseModel):
    """NexusKV process settings. Build with :meth:`from_env`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    broker: str | None = _env(
        "NEXUSKV_BROKER",
        "Kafka-protocol bootstrap URL `kafka://host:port[,host:port...]`. Unset: start an embedded "
        "Tansu broker on a free loopback port for the life of the process.",
        None,
    )
    topic_partitions: int = _env(
        "NEXUSKV_TOPIC_PARTITIONS", "Partitions per topic when NexusKV creates its topics.", 8, ge=1, le=1024
    )
    topic_replication: int = _env(
        "NEXUSKV_TOPIC_REPLICATION", "Replication factor when NexusKV creates its topics.", 1, ge=1, le=16
    )
    identity_secret: str = _env(
        "NEXUSKV_IDENTITY_SECRET",
        "Secret (up to 64 bytes) keying every tenant scope's block keys; keep it the same on every "
        "service of a deployment. Empty: keys are still per tenant, but computable offline.",
        "",
        max_length=64,
    )
    data_dir: Path = _env(
        "NEXUSKV_DATA_DIR", "Folder for local state: index snapshots, tier files, DuckDB.", Path(".nexuskv")
    )
    broker_start_timeout_s: float = _env(
        "NEXUSKV_BROKER_START_TIMEOUT", "Seconds to wait for a broker to accept connections.", 30.0, gt=0, le=600
    )
    log_level: str = _env("NEXUSKV_LOG_LEVEL", "Python logging level of NexusKV services.", "INFO")
    otlp_endpoint: str | None = _env(
        "NEXUSKV_OTLP_ENDPOINT",
        "OpenTelemetry collector base URL for OTLP/HTTP trace export, e.g. `http://localhost:4318`. "
        "Unset: spans are not exported.",
        None,
    )
    metrics_port: int = _env(
        "NEXUSKV_METRICS_PORT", "Port of a service's Prometheus `/metrics` endpoint; 0: off.", 0, ge=0, le=65535
    )
    decision_db: Path | None = _env(
        "NEXUSKV_DECISION_DB",
        "DuckDB file of the decision store (single writer: the decision sink). Unset: "
        "`$NEXUSKV_DATA_DIR/decisions.duckdb`; readers use the `-snapshot.duckdb` copy beside it.",
        None,
    )

    @field_validator("broker")
    @classmethod
    def _broker(cls, value: str | None) -> str | None:
        if value is None or value.strip() == "":
            return None
        try:
            parse_broker_url(value)
        except ConfigError as exc:
            raise ValueError(exc.message) from None
        return value.strip()

    @field_validator("otlp_endpoint")
    @classmethod
    def _otlp(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"expected an http(s):// URL, got {value!r}")
        return value.strip()

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        level = value.upper()
        if level not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError(f"unknown logging level {value!r}")
        return level

    @property
    def broker_url(self) -> BrokerUrl | None:
        return parse_broker_url(self.broker) if self.broker else None

    @property
    def identity_secret_bytes(self) -> bytes:
        return self.identity_secret.encode("utf-8")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from ``NEXUSKV_*`` variables (``os.environ`` by default), then ``overrides``."""
        source = os.environ if env is None else env
        values: dict[str, Any] = {}
        for name, info in cls.model_fields.items():
            var = _env_name(info)
            if var in source:
                values[name] = source[var]
        values.update(overrides)
        try:
            return cls(**values)
        except ConfigError as exc:
            raise exc from None
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            field = str(err["loc"][0]) if err.get("loc") else "settings"
            info = cls.model_fields.get(field)
            name = _env_name(info) if info is not None else field
            raise ConfigError(name, _short(err)) from None


def _env_name(info: Any) -> str:
    extra = info.json_schema_extra or {}
    return str(extra["env"])


def _short(err: Mapping[str, Any]) -> str:
    msg = str(err.get("msg", "invalid"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    got = err.get("input")
    return f"{msg} (got {got!r})" if got is not None and not isinstance(got, (dict, list)) else msg


def setting_rows() -> list[tuple[str, str, str]]:
    """(environment variable, default, description) for every setting, in declaration order."""
    rows = []
    for info in Settings.model_fields.values():
        default = info.default
        shown = "unset" if default is None else ("empty" if default == "" else str(default))
        rows.append((_env_name(info), shown, info.description or ""))
    return rows
