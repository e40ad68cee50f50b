"""The execution policy ``nexuskv.execution_policy.v1`` (architecture §3.6): what the planner may do.

An operator-authored, versioned file (TOML or JSON; ``infra/policy/default.toml`` is the example):

* ``backends`` — enabled transfer backends, each with the links it serves and a priority (lower
  first); the planner moves state over a link only through an enabled backend;
* ``tiers`` — allowed source and target tiers of reuse and movement;
* ``tenancy`` — cross-tenant reuse (off by default) and per-tenant quotas;
* ``budgets`` — transfers in flight, planned bandwidth, pinned bytes, index lag;
* ``planner`` — the gate's confidence, minimum gain, default hardware profile, prefetch knobs;
* ``fallback`` — what happens to a transfer whose deadline passes (cancel or let it finish) and
  to one that completes late (demote, evict or keep).

Loading validates every field and reports *all* defects with their dotted paths
(:class:`~nexuskv.errors.PolicyError`); a document nested too deeply, or larger than
:data:`MAX_POLICY_BYTES`, is a PolicyError too (never a ``RecursionError``).

**A policy file is whole or it is refused.** A TOML file cut short at a line boundary still
parses, with whole sections silently back at their defaults, so a TOML policy *file* must end
with the line :data:`POLICY_END_MARKER` (:func:`check_complete`, applied by the file watcher in
``streams/bus/policy_file.py`` at start and on every reload); a JSON object cut short never parses,
so JSON needs no marker. Writers should still write the new file beside the old one and rename it
into place (the rename is atomic; the marker catches the writer that does not). :class:`PolicyHolder` keeps the last known good policy:
an invalid new version is refused and the previous one stays in force. Every decision records
:attr:`ExecutionPolicy.tag` (``version@digest``), so two files that reuse a version label are
still told apart.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Literal

import pydantic
from pydantic import Field, field_validator, model_validator

from nexuskv.contract import Contract
from nexuskv.descriptor import Tier
from nexuskv.errors import PolicyError

__all__ = [
    "POLICY_SCHEMA",
    "Backend",
    "Tiers",
    "TenantQuota",
    "Tenancy",
    "Budgets",
    "PlannerSettings",
    "Fallback",
    "ExecutionPolicy",
    "parse_policy",
    "check_complete",
    "POLICY_END_MARKER",
    "MAX_POLICY_BYTES",
    "ReloadOutcome",
    "PolicyHolder",
]

POLICY_SCHEMA = "nexuskv.execution_policy.v1"
POLICY_END_MARKER = "# end of policy"
MAX_POLICY_BYTES = 1 << 20

Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$")]
LinkName = Annotated[str, Field(pattern=r"^(gpu|host|disk|remote|object)->(gpu|host|disk|remote|object)$")]
Bytes = Annotated[int, Field(ge=0)]
GIB = 1 << 30


class Backend(Contract):
    """A transfer backend and the links (``source->destination`` tiers) it serves."""

    name: Name
    enabled: bool = True
    priority: Annotated[int, Field(ge=0, le=1000)] = 100
    links: tuple[LinkName, ...] = Field(min_length=1, max_length=32)

    @field_validator("links")
    @classmethod
    def _distinct(cls, links: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(links)) != len(links):
            raise ValueError("a link may be listed once")
        for link in links:
            src, dst = link.split("->")
            if src == dst and src != "gpu":
                raise ValueError(f"{link}: a copy within one tier is not a link")
        return links


class Tiers(Contract):
    sources: tuple[Tier, ...] = Field(default=(Tier.GPU, Tier.HOST, Tier.DISK, Tier.REMOTE), min_length=1)
    targets: tuple[Tier, ...] = Field(default=(Tier.GPU,), min_length=1)


class TenantQuota(Contract):
    """Per-tenant limits on planned movement; ``None`` means the global budget only."""

    max_transfers_in_flight: Annotated[int, Field(ge=0)] | None = None
    max_transfer_bytes_in_flight: Bytes | None = None
    max_pinned_bytes: Bytes | None = None


class Tenancy(Contract):
    #: Lookups are keyed per tenant scope (identity.py), so no index can answer across tenants yet:
    #: turning this on is refused rather than silently ignored.
    cross_tenant_reuse: bool = False
    default_quota: TenantQuota = TenantQuota()
    quotas: dict[Name, TenantQuota] = Field(default_factory=dict)

    @field_validator("cross_tenant_reuse")
    @classmethod
    def _no_cross_tenant(cls, value: bool) -> bool:
        if value:
            raise ValueError("not supported by this build: lookups are keyed per tenant scope")
        return value


class Budgets(Contract):
    """Global limits that apply backpressure to transfers and prefetches."""

    max_transfers_in_flight: Annotated[int, Field(ge=0, le=1_000_000)] = 64
    #: Bandwidth that transfers in flight may claim together, bytes/s; each claims its bytes over
    #: the time to its deadline. The default is eight workers' PCIe5 host links.
    max_transfer_bytes_per_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 400e9
    max_pinned_bytes: Bytes = 64 * GIB
    max_index_lag_ms: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 500.0


class PlannerSettings(Contract):
    confidence_z: Annotated[float, Field(ge=0, le=6)] = 1.645  # one-sided 95% bound on EG
    min_gain_s: Annotated[float, Field(ge=0, le=60)] = 0.0  # the bound must exceed this to act
    default_hardware_profile: Name = "h200x1-rdma4x200"
    p_consume: Annotated[float, Field(gt=0, le=1)] = 0.98  # P(a ready prefetch is consumed)
    pollution_s_per_gib: Annotated[float, Field(ge=0, le=60)] = 0.001  # default eviction price
    max_alternatives: Annotated[int, Field(ge=1, le=256)] = 16
    prefetch: bool = True
    route_to_state: bool = True
    # Exploration: an uncertain option whose expected EG is positive but whose lower bound is not
    # may be taken by this share of decisions (drawn from the request id, deterministically), while
    # the least-observed fit it rests on has fewer than explore_max_observations observations: a
    # fit that is never acted upon is never observed, so without this an uncertain fit freezes.
    explore_share: Annotated[float, Field(ge=0, le=0.5)] = 0.05
    explore_max_observations: Annotated[int, Field(ge=0, le=100_000)] = 20


class Fallback(Contract):
    in_flight_at_deadline: Literal["cancel", "let_finish"] = "cancel"
    late_transfer: Literal["demote", "evict", "keep"] = "demote"
    demote_to: Tier = Tier.HOST


class ExecutionPolicy(Contract):
    schema_version: Literal["nexuskv.execution_policy.v1"] = POLICY_SCHEMA
    version: Name
    backends: tuple[Backend, ...] = (
        Backend(name="pinned-host", priority=10, links=("host->gpu", "gpu->host")),
        Backend(name="rdma", priority=20, links=("remote->gpu", "gpu->remote")),
        Backend(name="file", priority=30, links=("disk->gpu", "host->disk")),
    )
    tiers: Tiers = Tiers()
    tenancy: Tenancy = Tenancy()
    budgets: Budgets = Budgets()
    planner: PlannerSettings = PlannerSettings()
    fallback: Fallback = Fallback()

    @model_validator(mode="after")
    def _consistent(self) -> ExecutionPolicy:
        names = [b.name for b in self.backends]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise _field_error(f"backends.{i}.name", f"backend {name!r} is listed twice")
        enabled = [(i, b) for i, b in enumerate(self.backends) if b.enabled]
        for i, b in enabled:
            clash = next((j for j, o in enabled if j < i and o.priority == b.priority and set(o.links) & set(b.links)),
                         None)
            if clash is not None:
                raise _field_error(f"backends.{i}.priority",
                                   f"priority {b.priority} ties with backends.{clash} on a shared link")
        if len(set(self.tiers.sources)) != len(self.tiers.sources):
            raise _field_error("tiers.sources", "a tier may be listed once")
        if len(set(self.tiers.targets)) != len(self.tiers.targets):
            raise _field_error("tiers.targets", "a tier may be listed once")
        if self.fallback.late_transfer == "demote" and self.fallback.demote_to is Tier.GPU:
            raise _field_error("fallback.demote_to", "demotion goes to a slower tier than gpu")
        return self

    # Derived lookups, computed once per policy (cached_property: the planner reads them per decision).

    @cached_property
    def tag(self) -> str:
        """``version@digest`` of the whole policy; recorded in every decision."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return f"{self.version}@{hashlib.blake2b(canonical.encode(), digest_size=4).hexdigest()}"

    @cached_property
    def backend_table(self) -> dict[tuple[Tier, Tier], str]:
        """``(source, destination) -> backend``: the enabled backend with the best priority per link."""
        table: dict[tuple[Tier, Tier], tuple[int, str]] = {}
        for b in self.backends:
            if not b.enabled:
                continue
            for link in b.links:
                src, dst = (Tier(t) for t in link.split("->"))
                best = table.get((src, dst))
                if best is None or b.priority < best[0]:
                    table[(src, dst)] = (b.priority, b.name)
        return {k: v[1] for k, v in table.items()}

    @cached_property
    def source_tiers(self) -> frozenset[Tier]:
        return frozenset(self.tiers.sources)

    @cached_property
    def target_tiers(self) -> frozenset[Tier]:
        return frozenset(self.tiers.targets)

    def backend_for(self, source: Tier, destination: Tier) -> str | None:
        """The enabled backend with the best priority for ``source -> destination`` (None: none)."""
        return self.backend_table.get((source, destination))

    def allows_source(self, tier: Tier) -> bool:
        return tier in self.source_tiers

    def allows_target(self, tier: Tier) -> bool:
        return tier in self.target_tiers

    def quota_for(self, tenant: str) -> TenantQuota:
        return self.tenancy.quotas.get(tenant, self.tenancy.default_quota)


class _FieldError(ValueError):
    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


def _field_error(path: str, message: str) -> _FieldError:
    return _FieldError(path, message)


def _errors_of(exc: pydantic.ValidationError) -> list[tuple[str, str]]:
    out = []
    for err in exc.errors():
        ctx_error = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_error, _FieldError):
            out.append((ctx_error.path, ctx_error.message))
            continue
        path = ".".join(str(p) for p in err.get("loc", ())) or "<root>"
        msg = str(err.get("msg", "invalid"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        got = err.get("input")
        if err.get("type") != "missing" and isinstance(got, (str, int, float, bool)) and len(repr(got)) < 80:
            msg = f"{msg} (got {got!r})"
        out.append((path, msg))
    return out


def check_complete(raw: bytes | str, *, fmt: Literal["toml", "json"], origin: str = "<policy>") -> None:
    """Raise PolicyError unless a policy *file*'s bytes are visibly whole (module docstring)."""
    if fmt == "json":
        return  # a JSON object cut short does not parse
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, (bytes, bytearray)) else raw
    lines = text.rstrip().splitlines()
    if not lines or lines[-1].strip() != POLICY_END_MARKER:
        raise PolicyError(origin, [("<file>", (
            f"the last line must be {POLICY_END_MARKER!r}: without it the file may have been cut short "
            "(write the new policy beside the old file and rename it into place)"))])


def parse_policy(raw: bytes | str, *, fmt: Literal["toml", "json"], origin: str = "<policy>") -> ExecutionPolicy:
    """Parse and validate a policy document; raises PolicyError listing every defective field."""
    if len(raw) > MAX_POLICY_BYTES:
        raise PolicyError(origin, [("<document>", f"{len(raw)} bytes: a policy has at most {MAX_POLICY_BYTES}")])
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, (bytes, bytearray)) else raw
    try:
        data = tomllib.loads(text) if fmt == "toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise PolicyError(origin, [("<document>", f"not valid {fmt}: {exc}")]) from None
    except RecursionError:
        raise PolicyError(origin, [("<document>", f"not valid {fmt}: nested too deeply")]) from None
    if not isinstance(data, dict):
        raise PolicyError(origin, [("<document>", f"top level must be a table, got {type(data).__name__}")])
    schema = data.get("schema_version")
    if schema != POLICY_SCHEMA:
        raise PolicyError(origin, [("schema_version", f"must be {POLICY_SCHEMA!r} (got {schema!r})")])
    try:
        # pydantic's validator itself, so that every field error is collected (Contract.model_validate
        # reports the first one only, as a ContractError).
        return ExecutionPolicy.__pydantic_validator__.validate_python(data)
    except pydantic.ValidationError as exc:
        raise PolicyError(origin, _errors_of(exc)) from None
    except RecursionError:
        raise PolicyError(origin, [("<document>", "nested too deeply")]) from None


@dataclass(frozen=True, slots=True)
class ReloadOutcome:
    """What an attempt to install a new policy did. ``policy`` is the one in force afterwards."""

    policy: ExecutionPolicy
    changed: bool
    error: PolicyError | None = None


class PolicyHolder:
    """The policy in force, replaced only by a valid one (last known good)."""

    __slots__ = ("_current",)

    def __init__(self, initial: ExecutionPolicy) -> None:
        self._current = initial

    @property
    def current(self) -> ExecutionPolicy:
        return self._current

    def offer(self, raw: bytes | str, *, fmt: Literal["toml", "json"], origin: str,
              whole_file: bool = False) -> ReloadOutcome:
        """Install ``raw`` if it is a valid policy (and, with ``whole_file``, visibly complete:
        :func:`check_complete`); otherwise keep the current one and say why."""
        try:
            if whole_file:
                check_complete(raw, fmt=fmt, origin=origin)
            candidate = parse_policy(raw, fmt=fmt, origin=origin)
        except PolicyError as exc:
            return ReloadOutcome(self._current, changed=False, error=exc)
        changed = candidate.tag != self._current.tag
        self._current = candidate
        return ReloadOutcome(candidate, changed=changed)
