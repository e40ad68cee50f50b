"""The execution policy: validation with field-level errors, last-known-good reload, lookups."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from nexuskv.descriptor import Tier
from nexuskv.errors import ConfigError, PolicyError
from nexuskv.policy import POLICY_SCHEMA, ExecutionPolicy, PolicyHolder, parse_policy
from streams.bus.policy_file import PolicyFile, load_policy

EXAMPLE = Path(__file__).resolve().parents[2] / "infra" / "policy" / "default.toml"

BAD = """
schema_version = "nexuskv.execution_policy.v1"
version = "broken"

[[backends]]
name = "rdma"
links = ["remote->gpu", "tape->gpu"]

[budgets]
max_transfers_in_flight = -3
max_index_lag_ms = "soon"

[planner]
confidence_z = 12
default_hardware_profile = ""

[fallback]
late_transfer = "shred"
"""


def test_the_shipped_example_loads_and_says_what_it_enables():
    policy = load_policy(EXAMPLE)
    assert policy.schema_version == POLICY_SCHEMA
    assert policy.tag.startswith("default-2026-11@")
    assert policy.backend_for(Tier.HOST, Tier.GPU) == "pinned-host"
    assert policy.backend_for(Tier.DISK, Tier.GPU) == "file"
    assert policy.backend_for(Tier.OBJECT, Tier.GPU) is None  # listed but disabled
    assert policy.tenancy.cross_tenant_reuse is False
    assert policy.quota_for("batch").max_transfers_in_flight == 4
    assert policy.quota_for("anyone").max_transfers_in_flight == 16
    assert policy.allows_source(Tier.DISK) and not policy.allows_source(Tier.OBJECT)
    assert policy.allows_target(Tier.GPU) and not policy.allows_target(Tier.HOST)


def test_defaults_are_safe():
    policy = ExecutionPolicy(version="v")
    assert policy.tenancy.cross_tenant_reuse is False
    assert policy.fallback.in_flight_at_deadline == "cancel" and policy.fallback.late_transfer == "demote"
    assert policy.planner.confidence_z > 0


def test_an_invalid_file_is_rejected_with_every_field_named():
    with pytest.raises(PolicyError) as info:
        parse_policy(BAD, fmt="toml", origin="bad.toml")
    err = info.value
    paths = [p for p, _m in err.errors]
    assert paths == ["backends.0.links.1", "budgets.max_transfers_in_flight", "budgets.max_index_lag_ms",
                     "planner.confidence_z", "planner.default_hardware_profile", "fallback.late_transfer"]
    assert isinstance(err, ConfigError) and err.field == "backends.0.links.1"
    assert str(err).startswith("bad.toml: backends.0.links.1:") and "(+5 more)" in str(err)
    assert "got -3" in err.describe() and "got 'shred'" in err.describe()


@pytest.mark.parametrize(
    ("text", "path", "message"),
    [
        ("version = 'x'", "schema_version", "nexuskv.execution_policy.v1"),
        ("schema_version = 'nexuskv.execution_policy.v2'\nversion = 'x'", "schema_version", "v2"),
        ("schema_version = 'nexuskv.execution_policy.v1'", "version", "required"),
        ("schema_version = 'nexuskv.execution_policy.v1'\nversion = 'x'\nsurprise = 1", "surprise", "not permitted"),
        ("this is = not toml [", "<document>", "not valid toml"),
        ("schema_version = 'nexuskv.execution_policy.v1'\nversion = 'x'\n[[backends]]\nname='a'\nlinks=['host->gpu']\n"
         "[[backends]]\nname='a'\nlinks=['disk->gpu']", "backends.1.name", "listed twice"),
        ("schema_version = 'nexuskv.execution_policy.v1'\nversion = 'x'\n[[backends]]\nname='a'\npriority=1\n"
         "links=['host->gpu']\n[[backends]]\nname='b'\npriority=1\nlinks=['host->gpu']", "backends.1.priority", "ties"),
        ("schema_version = 'nexuskv.execution_policy.v1'\nversion = 'x'\n[[backends]]\nname='a'\nlinks=['host->host']",
         "backends.0.links", "within one tier"),
        ("schema_version = 'nexuskv.execution_policy.v1'\nversion = 'x'\n[tiers]\nsources=['gpu','gpu']",
         "tiers.sources", "once"),
        ("schema_version = 'nexuskv.execution_policy.v1'\nversion = 'x'\n[fallback]\ndemote_to='gpu'",
         "fallback.demote_to", "slower tier"),
        ("schema_version = 'nexuskv.execution_policy.v1'\nversion = 'x'\n[tenancy.quotas.t1]\nmax_pinned_bytes=-1",
         "tenancy.quotas.t1.max_pinned_bytes", "greater than or equal"),
    ],
    ids=["no-schema", "future-schema", "no-version", "unknown-field", "not-toml", "duplicate-backend",
         "priority-tie", "same-tier-link", "duplicate-tier", "demote-to-gpu", "negative-quota"],
)
def test_each_defect_names_its_field(text, path, message):
    with pytest.raises(PolicyError) as info:
        parse_policy(text, fmt="toml")
    assert info.value.errors[0][0] == path
    assert message in info.value.errors[0][1]


def test_json_policies_are_read_too(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"schema_version": POLICY_SCHEMA, "version": "j1",
                                "planner": {"min_gain_s": 0.01}}))
    assert load_policy(path).planner.min_gain_s == 0.01
    path.write_text("[1, 2]")
    with pytest.raises(PolicyError, match="top level must be a table"):
        load_policy(path)


def test_a_missing_file_fails_at_start_naming_the_file(tmp_path):
    with pytest.raises(PolicyError) as info:
        load_policy(tmp_path / "absent.toml")
    assert info.value.errors[0][0] == "<file>" and "absent.toml" in str(info.value)


def test_same_label_different_content_gets_a_different_tag():
    a = parse_policy(f"schema_version='{POLICY_SCHEMA}'\nversion='v1'", fmt="toml")
    b = parse_policy(f"schema_version='{POLICY_SCHEMA}'\nversion='v1'\n[planner]\nmin_gain_s=0.5", fmt="toml")
    assert a.tag.split("@")[0] == b.tag.split("@")[0] == "v1" and a.tag != b.tag
    assert parse_policy(f"schema_version='{POLICY_SCHEMA}'\nversion='v1'", fmt="toml").tag == a.tag


def test_holder_keeps_the_last_known_good_policy():
    holder = PolicyHolder(ExecutionPolicy(version="first"))
    outcome = holder.offer(BAD, fmt="toml", origin="edit-1")
    assert outcome.error is not None and not outcome.changed
    assert holder.current.version == "first" and outcome.policy is holder.current
    good = holder.offer(f"schema_version='{POLICY_SCHEMA}'\nversion='second'", fmt="toml", origin="edit-2")
    assert good.error is None and good.changed and holder.current.version == "second"
    same = holder.offer(f"schema_version='{POLICY_SCHEMA}'\nversion='second'", fmt="toml", origin="edit-3")
    assert same.error is None and not same.changed


def _touch(path: Path, text: str) -> None:
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    os.utime(path, ns=(before + 1_000_000_000, before + 1_000_000_000))  # a new stamp even on coarse clocks


def test_file_hot_reload_keeps_last_known_good_when_the_new_file_is_bad(tmp_path):
    path = tmp_path / "policy.toml"
    _touch(path, EXAMPLE.read_text())
    watched = PolicyFile(path)
    first = watched.current
    assert watched.poll() is None  # unchanged

    _touch(path, BAD + "\n# end of policy\n")
    outcome = watched.poll()
    assert outcome is not None and outcome.error is not None and not outcome.changed
    assert [p for p, _ in outcome.error.errors][0] == "backends.0.links.1"
    assert watched.current is first  # the previous policy stays in force
    assert watched.poll() is None  # a bad file is reported once, not on every poll

    _touch(path, EXAMPLE.read_text().replace('version = "default-2026-11"', 'version = "edited"'))
    outcome = watched.poll()
    assert outcome is not None and outcome.error is None and outcome.changed
    assert watched.current.version == "edited"

    path.unlink()
    outcome = watched.poll()
    assert outcome is not None and outcome.error is not None and watched.current.version == "edited"


def test_an_invalid_file_at_start_is_fatal(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text(BAD + "\n# end of policy\n")
    with pytest.raises(PolicyError):
        PolicyFile(path)
