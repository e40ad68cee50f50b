"""Typed settings: every setting declared once, with type, default, environment name and doc.

:meth:`Settings.from_env` reads ``NEXUSKV_*`` variables and fails at start with a
:class:`~nexuskv.errors.ConfigError` naming the variable. Lower layers receive plain values
(a parsed :class:`BrokerUrl`, a partition count), never the whole settings object.

``nexuskv config`` prints the table in the README from these declarations.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nexuskv.errors import ConfigError

_HOSTNAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")
_STORE_ADDRESS = re.compile(r"^mooncake://(\[[^\]]+\]|[^:/?\[\]]+):([0-9]{1,5})(\?admin=([0-9]{1,5}))?/?$")

__all__ = ["BrokerUrl", "Settings", "parse_broker_url", "parse_api_tokens", "parse_publisher_keys", "parse_tenant_shares", "setting_rows",
           "MIN_SHARED_SECRET"]

#: Fewest bytes of a secret that keys tenants apart (identity) or authenticates publishers (bus).
MIN_SHARED_SECRET = 16


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


def parse_api_tokens(text: str) -> dict[str, str]:
    """``token=tenant[,token=tenant...]`` to a mapping; a defect raises ValueError (never echoing a token)."""
    out: dict[str, str] = {}
    for i, part in enumerate(p for p in (text or "").split(",") if p.strip()):
        token, sep, tenant = part.strip().partition("=")
        if not sep or not tenant.strip():
            raise ValueError(f"entry {i + 1} is not token=tenant")
        if len(token) < 16:
            raise ValueError(f"entry {i + 1}: tokens must have at least 16 characters")
        out[token] = tenant.strip()
    return out


def parse_publisher_keys(text: str) -> dict[str, bytes]:
    """``publisher=hexkey[,publisher=hexkey...]`` (keys of 64 hex digits, as ``nexuskv publisher-key``
    prints them) to a mapping; a defect raises ValueError naming the entry, never echoing a key."""
    out: dict[str, bytes] = {}
    for i, part in enumerate(p for p in (text or "").split(",") if p.strip()):
        name, sep, key = part.strip().rpartition("=")
        if not sep or not name:
            raise ValueError(f"entry {i + 1} is not publisher=key")
        try:
            raw = bytes.fromhex(key.strip())
        except ValueError:
            raise ValueError(f"entry {i + 1}: the key is not hex") from None
        if len(raw) != 32:
            raise ValueError(f"entry {i + 1}: the key must be 32 bytes (64 hex digits)")
        out[name] = raw
    return out


def parse_tenant_shares(text: str) -> tuple[float, dict[str, float]]:
    """``share[,tenant=share...]`` (shares in (0, 1]) to (default, overrides); a defect raises ValueError
    naming the entry."""
    default = 1.0
    seen_default = False
    out: dict[str, float] = {}
    for i, part in enumerate(p.strip() for p in (text or "").split(",") if p.strip()):
        tenant, sep, share = part.rpartition("=")
        try:
            value = float(share)
        except ValueError:
            raise ValueError(f"entry {i + 1} ({part!r}) is not a share or tenant=share") from None
        if not 0.0 < value <= 1.0:
            raise ValueError(f"entry {i + 1}: share {value} is not in (0, 1]")
        if not sep:
            if seen_default:
                raise ValueError(f"entry {i + 1}: a second default share")
            default, seen_default = value, True
        elif not tenant.strip():
            raise ValueError(f"entry {i + 1}: no tenant before '='")
        else:
            out[tenant.strip()] = value
    return default, out


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
        "service of a deployment. Empty: keys are still per tenant, but computable offline, so a deployment "
        "with more than one tenant (index API tokens naming two or more tenants) refuses to start without one "
        "of at least 16 bytes.",
        "",
        max_length=64,
    )
    bus_secret: str = _env(
        "NEXUSKV_BUS_SECRET",
        "Secret (16-256 bytes) that authenticates kv-events publishers and control producers: each publisher "
        "signs its batches, and each planner and executor its placement hints, transfer commands and transfer "
        "results, with a key derived from it and its name; the index worker, every index replica, the tier "
        "managers, the executors and the planner drop (and dead-letter) a record that is unsigned, signed for "
        "another producer or topic, from a producer the topic does not entitle, or replayed. Empty: nothing is "
        "authenticated, and a deployment with more than one tenant refuses to start.",
        "",
        max_length=256,
    )
    publisher_keys: str = _env(
        "NEXUSKV_PUBLISHER_KEYS",
        "Signing keys of the publishers this process sends for, `publisher=hexkey[,...]` (from `nexuskv "
        "publisher-key NAME`), for engine hosts that should not hold NEXUSKV_BUS_SECRET. Used before the "
        "bus secret. Control producers' keys (`nexuskv publisher-key --control NAME`) go here too: this "
        "process signs as them, and checks their records with them; given keys and no bus secret, a "
        "control record of a producer not listed is refused.",
        "",
    )
    control_max_age_s: float = _env(
        "NEXUSKV_CONTROL_MAX_AGE",
        "Seconds after it was sent that a signed control record (placement hint, transfer command, transfer "
        "result) is still taken; older ones are refused as stale. It bounds the replay window: a consumer "
        "remembers which records it took for this long (nexuskv.contracts.control_signature).",
        300.0, gt=0, le=86400,
    )
    kv_events_tokens: Literal["off", "on"] = _env(
        "NEXUSKV_KV_EVENTS_TOKENS",
        "Whether kv-events publishers (the event bridge, tier managers) put token ids on the bus beside the "
        "canonical keys: `off` (the default) or `on`. Token ids are prompt content: no NexusKV consumer needs "
        "them (blocks are keyed by their publisher), so turn this on only for a consumer of your own that "
        "does, and treat the kv-events topic as holding prompts then.",
        "off",
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
        "NEXUSKV_METRICS_PORT", "Port of a service's Prometheus `/metrics` endpoint; 0: off. `nexuskv up` "
        "gives its services this port, +1, +2, ... in start order.", 0, ge=0, le=65535
    )
    metrics_host: str = _env(
        "NEXUSKV_METRICS_HOST", "Address a service's `/metrics`, `/livez` and `/readyz` endpoint binds: "
        "loopback by default; `0.0.0.0` (or `::`) to let a Prometheus on another host scrape it.",
        "127.0.0.1", min_length=1, max_length=255,
    )
    decision_db: Path | None = _env(
        "NEXUSKV_DECISION_DB",
        "DuckDB file of the decision store (single writer: the decision sink). Unset: "
        "`$NEXUSKV_DATA_DIR/decisions.duckdb`; readers use the `-snapshot.duckdb` copy beside it.",
        None,
    )
    index_max_memberships: int = _env(
        "NEXUSKV_INDEX_MAX_MEMBERSHIPS",
        "Most (block, location) memberships one index holds (~40-64 bytes each); beyond it the index "
        "forgets blocks (policy `sweep`) and counts them.", 16_000_000, ge=1, le=1 << 34,
    )
    index_expected_blocks: int = _env(
        "NEXUSKV_INDEX_EXPECTED_BLOCKS",
        "Blocks the index worker and every index replica size their block table for at start (~40 bytes "
        "each, allocated lazily by the OS), so ingest up to that many never stops to grow the table "
        "(growing from empty halves the ingest rate at 1M blocks); 0: grow as blocks arrive.", 0, ge=0, le=1 << 31,
    )
    index_checkpoint_interval_s: float = _env(
        "NEXUSKV_INDEX_CHECKPOINT_INTERVAL",
        "Seconds between the index worker's per-partition checkpoints (under NEXUSKV_DATA_DIR/index); "
        "a restart replays at most this much of the event log.", 30.0, gt=0, le=86400,
    )
    index_api_host: str = _env("NEXUSKV_INDEX_API_HOST", "Address the index lookup HTTP endpoint listens on.",
                               "127.0.0.1", min_length=1)
    index_api_port: int = _env("NEXUSKV_INDEX_API_PORT", "Port of the index lookup HTTP endpoint.", 8470,
                               ge=1, le=65535)
    index_api_tokens: str = _env(
        "NEXUSKV_INDEX_API_TOKENS",
        "Bearer tokens of the index lookup endpoint and the tenant each one may see: "
        "`token=tenant[,token=tenant...]`, tokens of at least 16 characters. Empty: the endpoint answers "
        "401 to everyone.", "",
    )
    index_socket: Path | None = _env(
        "NEXUSKV_INDEX_SOCKET",
        "Unix socket of this node's index sidecar (`streams.index_sidecar`), which engine processes ask for their "
        "matches instead of holding an index. Unset: `$NEXUSKV_DATA_DIR/run/index.sock`. At most 107 bytes.",
        None,
    )
    index_ask_budget_ms: float = _env(
        "NEXUSKV_INDEX_ASK_BUDGET_MS",
        "Most milliseconds an engine waits for the index sidecar's answer (connect, send, answer); past it the "
        "request has no external hits and is recomputed.", 20.0, gt=0, le=10_000,
    )
    index_ask_backoff_ms: float = _env(
        "NEXUSKV_INDEX_ASK_BACKOFF_MS",
        "After an ask failed (timeout, sidecar down, malformed answer), milliseconds an engine answers misses at "
        "once without asking, before it tries the sidecar again.", 1000.0, ge=0, le=600_000,
    )
    index_max_ask_keys: int = _env(
        "NEXUSKV_INDEX_MAX_ASK_KEYS",
        "Most canonical keys (blocks) one ask of the index sidecar may carry: the longest prompt an engine serves "
        "divided by its block size (16,384: 256K tokens of 16-token blocks). The sidecar refuses larger asks; "
        "the engine's client asks for the first this many blocks of a longer prompt (the rest are misses).",
        16_384, ge=1, le=1 << 16,
    )
    index_max_connections: int = _env(
        "NEXUSKV_INDEX_MAX_CONNECTIONS",
        "Most engine connections the index sidecar holds; beyond it a new one takes the place of an idle one "
        "(one that never asked, idle 1 s; else one idle 10 min) or is refused with an error frame. Bounds the "
        "sidecar's memory with NEXUSKV_INDEX_MAX_ASK_KEYS (each connection buffers at most one ask).", 128, ge=1,
        le=65_536,
    )
    index_ask_nice: int = _env(
        "NEXUSKV_INDEX_ASK_NICE",
        "Nice value of the index sidecar's ask thread (Linux, -20..19): below the engines', so an ask that "
        "arrives gets a core at once. A negative one needs CAP_SYS_NICE; refused, the thread keeps the "
        "process's priority (logged).", -10, ge=-20, le=19,
    )
    index_frame_deadline_ms: float = _env(
        "NEXUSKV_INDEX_FRAME_DEADLINE_MS",
        "Milliseconds an engine connection has to finish sending a frame it began; past it the sidecar closes the "
        "connection (a slow or stalled sender holds no memory for longer).", 1000.0, gt=0, le=600_000,
    )
    worker: str = _env(
        "NEXUSKV_WORKER",
        "Worker id of this process's data plane: its tier manager owns this worker's tiers and its transfer "
        "executor serves commands whose destination is this worker.",
        "worker-0",
        min_length=1,
        max_length=256,
        pattern=r"^[^\x00-\x1f/]+$",
    )
    tier_device_bytes: int = _env(
        "NEXUSKV_TIER_DEVICE_BYTES",
        "Capacity of the device-memory tier in bytes (CUDA memory, or its host-memory stand-in without CUDA).",
        256 << 20,
        ge=0,
    )
    tier_host_bytes: int = _env(
        "NEXUSKV_TIER_HOST_BYTES", "Capacity of the host-DRAM tier in bytes (pinned when CUDA is present).",
        1 << 30, ge=0,
    )
    tier_disk_bytes: int = _env(
        "NEXUSKV_TIER_DISK_BYTES",
        "Capacity of the local-disk tier in bytes; its files live in `NEXUSKV_DATA_DIR/tiers/<worker>/disk`.",
        4 << 30,
        ge=0,
    )
    remote_tier: str | None = _env(
        "NEXUSKV_REMOTE_TIER",
        "Address `mooncake://host:port?admin=port` of the remote tier's Mooncake Store (its master's RPC and "
        "admin HTTP ports). `nexuskv up` starts the store there, or on free loopback ports when unset; other "
        "processes without it have no remote tier.",
        None,
    )
    remote_tier_bytes: int = _env(
        "NEXUSKV_REMOTE_TIER_BYTES",
        "Memory in bytes of the remote tier store this process starts (its Mooncake segment, allocated at start; "
        "a full store rejects a save, it never evicts on its own). At least 16 MiB (Mooncake's smallest segment).",
        1 << 30, ge=16 << 20,
    )
    remote_tier_owner: str = _env(
        "NEXUSKV_REMOTE_TIER_OWNER",
        "Publisher name of the remote-tier manager (`python -m streams.remote_tier_manager`, run by `nexuskv up`), "
        "the one owner of the shared remote tier's capacity: it announces that tier's blocks on "
        "`nexuskv.kv-events` and its price on `nexuskv.tier-state` under this name.",
        "remote-tier", min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$",
    )
    remote_tier_low_watermark: float = _env(
        "NEXUSKV_REMOTE_TIER_LOW_WATERMARK",
        "Share of the remote tier's capacity the remote-tier manager evicts down to (by utility, cheapest first) "
        "once use passes the high watermark, so writers' saves find room.",
        0.7, gt=0, lt=1,
    )
    remote_tier_high_watermark: float = _env(
        "NEXUSKV_REMOTE_TIER_HIGH_WATERMARK",
        "Share of the remote tier's capacity above which the remote-tier manager evicts; above the low watermark. "
        "What is above it is headroom for saves written and not yet offered, and for the store's allocator: "
        "Mooncake rounds each object up to a size class up to 1/8 larger than its bytes (a 128 KiB block "
        "takes 144 KiB), so payload bytes at 0.8 of the capacity can fill 0.9 of the segment.",
        0.8, gt=0, lt=1,
    )
    remote_tier_tenant_quotas: str = _env(
        "NEXUSKV_REMOTE_TIER_TENANT_QUOTAS",
        "Per-tenant quotas of the remote tier as shares of its capacity: a default share and `tenant=share` "
        "overrides, comma-separated (`0.5,tenant-a=0.8`). A tenant at its quota displaces only its own cheaper "
        "blocks.",
        "1.0",
    )
    remote_tier_offer_lease_s: float = _env(
        "NEXUSKV_REMOTE_TIER_OFFER_LEASE",
        "Seconds a remote-tier object may stay unoffered (written, no `nexuskv.tier-offers` record for it) before "
        "the remote-tier manager collects it as garbage (a writer that died between its put and its offer, a copy "
        "the index cannot find).",
        30.0, gt=0, le=86400,
    )
    tier_policy: str = _env(
        "NEXUSKV_TIER_POLICY",
        "How the tier manager evicts and admits: `utility` (expected gain per byte, whitepaper §7.5: a block "
        "enters a full tier only if worth more than what it displaces) or `lru` (least recently used first, "
        "everything admitted).",
        "utility",
        pattern=r"^(utility|lru)$",
    )
    tier_reuse_half_life_s: float = _env(
        "NEXUSKV_TIER_REUSE_HALF_LIFE",
        "Seconds in which a block's use count halves; P(reuse) is read from it over the same horizon.",
        600.0, gt=0, le=30 * 86400,
    )
    tier_pin_fraction: float = _env(
        "NEXUSKV_TIER_PIN_FRACTION", "Share of each managed tier's capacity that pins may hold.", 0.5, ge=0, le=1,
    )
    tier_prefetch_fraction: float = _env(
        "NEXUSKV_TIER_PREFETCH_FRACTION",
        "Share of each managed tier's capacity that prefetch hints may hold reserved at once (each hint's room "
        "counts until its copy lands or it expires); a hint beyond it is refused and counted.", 0.25, gt=0, le=1,
    )
    tier_prefetch_max_s: float = _env(
        "NEXUSKV_TIER_PREFETCH_MAX",
        "Most seconds a prefetch hint may hold its room: a later `expires_at` is cut to now plus this.",
        60.0, gt=0, le=3600,
    )
    tier_lease_s: float = _env(
        "NEXUSKV_TIER_LEASE",
        "Seconds after its deadline that a copy from outside the worker (no identity: the index cannot find it) "
        "is kept for its request before it is collected.",
        5.0, ge=0, le=3600,
    )
    tier_state_interval_s: float = _env(
        "NEXUSKV_TIER_STATE_INTERVAL",
        "Seconds between the tier manager's `nexuskv.tier-state` records (usage and displacement price).",
        1.0, gt=0, le=3600,
    )
    transfer_lanes: int = _env(
        "NEXUSKV_TRANSFER_LANES", "Threads that copy the blocks of one transfer concurrently.", 2, ge=1, le=64,
    )
    transfer_jobs: int = _env(
        "NEXUSKV_TRANSFER_JOBS", "Transfers the executor runs at once (earliest deadline first).", 2, ge=1, le=64,
    )
    policy_file: Path | None = _env(
        "NEXUSKV_POLICY_FILE",
        "Execution policy (`nexuskv.execution_policy.v1`, TOML or JSON; example: `infra/policy/default.toml`); "
        "a TOML file must end with the line `# end of policy` (a file cut short is refused). "
        "Unset: the built-in defaults. Invalid at start: the service stops naming every bad field; invalid on "
        "reload: the last valid policy stays in force.",
        None,
    )
    policy_reload_s: float = _env(
        "NEXUSKV_POLICY_RELOAD", "Seconds between checks of the policy file for changes.", 1.0, gt=0, le=3600
    )
    calibration_publish_s: float = _env(
        "NEXUSKV_CALIBRATION_PUBLISH",
        "Seconds between publications of a fitted cost-model entry that has new observations.", 1.0, gt=0, le=3600
    )
    calibration_min_observations: int = _env(
        "NEXUSKV_CALIBRATION_MIN_OBSERVATIONS",
        "Observations a fitted entry needs before it is published (until then planners keep the shipped profile).",
        20, ge=1, le=1_000_000,
    )
    calibration_forgetting: float = _env(
        "NEXUSKV_CALIBRATION_FORGETTING",
        "Forgetting factor of the online fit (1: none; 0.999 weighs about the last 1,000 observations).",
        0.999, ge=0.9, le=1.0,
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

    @field_validator("remote_tier")
    @classmethod
    def _remote(cls, value: str | None) -> str | None:
        if value is None or value.strip() == "":
            return None
        text = value.strip()
        # The form nexuskv.dataplane.remote_store.parse_store_address reads (kept apart: the core
        # does not import the data plane).
        m = _STORE_ADDRESS.match(text)
        if m is None or not all(0 < int(p) < 65536 for p in (m.group(2), m.group(4) or "9003")):
            raise ValueError(f"invalid remote tier address {value!r}: expected mooncake://host:port[?admin=port]")
        return text

    @field_validator("remote_tier_tenant_quotas")
    @classmethod
    def _remote_quotas(cls, value: str) -> str:
        parse_tenant_shares(value)
        return value.strip()

    @model_validator(mode="after")
    def _watermarks(self) -> Settings:
        if self.remote_tier_low_watermark >= self.remote_tier_high_watermark:
            raise ConfigError("NEXUSKV_REMOTE_TIER_LOW_WATERMARK", (
                f"{self.remote_tier_low_watermark} is not below NEXUSKV_REMOTE_TIER_HIGH_WATERMARK "
                f"{self.remote_tier_high_watermark}"))
        return self

    @property
    def remote_tier_quota_shares(self) -> tuple[float, dict[str, float]]:
        """(default share, tenant -> share) of the remote tier's capacity."""
        return parse_tenant_shares(self.remote_tier_tenant_quotas)

    @field_validator("policy_file", mode="before")
    @classmethod
    def _policy_file(cls, value: object) -> object:
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        level = value.upper()
        if level not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError(f"unknown logging level {value!r}")
        return level

    @field_validator("metrics_host")
    @classmethod
    def _metrics_host(cls, value: str) -> str:
        host = value.strip()
        try:
            ipaddress.ip_address(host)
        except ValueError:
            if not _HOSTNAME.fullmatch(host):
                raise ValueError(f"{host!r} is neither an IP address nor a host name") from None
        return host

    @field_validator("bus_secret")
    @classmethod
    def _bus_secret(cls, value: str) -> str:
        if value and len(value.encode("utf-8")) < MIN_SHARED_SECRET:
            raise ValueError(f"must be empty or at least {MIN_SHARED_SECRET} bytes")
        return value

    @field_validator("publisher_keys")
    @classmethod
    def _publisher_keys(cls, value: str) -> str:
        parse_publisher_keys(value)
        return value.strip()

    @model_validator(mode="after")
    def _tenants_need_a_secret(self) -> Settings:
        # Decision (issue 13): refuse rather than generate one. A generated secret would have to
        # reach every bridge and connector of the deployment, or their keys silently stop matching
        # (no reuse at all); an operator who sets one knows to hand it out.
        tenants = set(self.api_tokens.values())
        if len(tenants) > 1 and len(self.identity_secret.encode("utf-8")) < MIN_SHARED_SECRET:
            raise ConfigError("NEXUSKV_IDENTITY_SECRET", (
                f"the index API tokens name {len(tenants)} tenants; a deployment with more than one tenant needs "
                f"an identity secret of at least {MIN_SHARED_SECRET} bytes, or anyone can compute another "
                "tenant's block keys"))
        if len(tenants) > 1 and not self.bus_secret:
            raise ConfigError("NEXUSKV_BUS_SECRET", (
                f"the index API tokens name {len(tenants)} tenants; a deployment with more than one tenant needs "
                f"a bus secret of at least {MIN_SHARED_SECRET} bytes, or anyone who can write to the bus can "
                "publish another tenant's kv-events and the placement hints and transfer commands that move and "
                "evict its state"))
        return self

    @field_validator("index_api_tokens")
    @classmethod
    def _tokens(cls, value: str) -> str:
        parse_api_tokens(value)
        return value.strip()

    @property
    def api_tokens(self) -> dict[str, str]:
        """Bearer token -> tenant namespace."""
        return parse_api_tokens(self.index_api_tokens)

    @property
    def bus_secret_bytes(self) -> bytes:
        return self.bus_secret.encode("utf-8")

    @property
    def publisher_key_map(self) -> dict[str, bytes]:
        """Publisher name -> its signing key, from NEXUSKV_PUBLISHER_KEYS."""
        return parse_publisher_keys(self.publisher_keys)

    @property
    def broker_url(self) -> BrokerUrl | None:
        return parse_broker_url(self.broker) if self.broker else None

    @property
    def kv_event_tokens(self) -> bool:
        """Whether publishers put token ids on the bus (``NEXUSKV_KV_EVENTS_TOKENS=on``)."""
        return self.kv_events_tokens == "on"

    @property
    def identity_secret_bytes(self) -> bytes:
        return self.identity_secret.encode("utf-8")

    @property
    def index_socket_path(self) -> Path:
        """Where the node's index sidecar listens: ``NEXUSKV_INDEX_SOCKET``, else under the data folder.
        Raises ConfigError naming the setting when the path is too long for a Unix socket."""
        path = Path(self.index_socket) if self.index_socket else Path(self.data_dir) / "run" / "index.sock"
        check_socket_path(path)
        return path

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
            cause = (err.get("ctx") or {}).get("error")
            if isinstance(cause, ConfigError):  # a check across fields names its own variable
                raise ConfigError(cause.field, cause.message) from None
            field = str(err["loc"][0]) if err.get("loc") else "settings"
            info = cls.model_fields.get(field)
            name = _env_name(info) if info is not None else field
            raise ConfigError(name, _short(err, secret=field in _SECRETS)) from None


#: The longest path a Unix socket may have on Linux (``sun_path`` is 108 bytes, NUL included).
MAX_SOCKET_PATH = 107


def check_socket_path(path: Path) -> None:
    """ConfigError naming ``NEXUSKV_INDEX_SOCKET`` when ``path`` cannot be a Unix socket's."""
    size = len(os.fsencode(path))
    if size > MAX_SOCKET_PATH:
        raise ConfigError("NEXUSKV_INDEX_SOCKET", f"{path} is {size} bytes; a Unix socket path has at most "
                                                  f"{MAX_SOCKET_PATH}")


def _env_name(info: Any) -> str:
    extra = info.json_schema_extra or {}
    return str(extra["env"])


_SECRETS = frozenset({"identity_secret", "index_api_tokens", "bus_secret", "publisher_keys"})  # never echoed in an error


def _short(err: Mapping[str, Any], *, secret: bool = False) -> str:
    msg = str(err.get("msg", "invalid"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    got = None if secret else err.get("input")
    return f"{msg} (got {got!r})" if got is not None and not isinstance(got, (dict, list)) else msg


def setting_rows() -> list[tuple[str, str, str]]:
    """(environment variable, default, description) for every setting, in declaration order."""
    rows = []
    for info in Settings.model_fields.values():
        default = info.default
        shown = "unset" if default is None else ("empty" if default == "" else str(default))
        rows.append((_env_name(info), shown, info.description or ""))
    return rows
