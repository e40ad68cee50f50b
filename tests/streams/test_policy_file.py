"""The watched policy file: only a whole, valid file goes into force, and a reload never raises."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nexuskv.errors import PolicyError
from nexuskv.policy import POLICY_END_MARKER
from streams.bus.policy_file import PolicyFile, load_policy

EXAMPLE = Path(__file__).resolve().parents[2] / "infra" / "policy" / "default.toml"


def _replace(path: Path, data: bytes) -> None:
    """Write the way a careful operator does (beside the file, then rename), with a fresh stamp."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.utime(tmp, ns=(before + 1_000_000_000, before + 1_000_000_000))
    os.replace(tmp, path)


def _edited(version: str) -> bytes:
    return EXAMPLE.read_bytes().replace(b'version = "default-2026-11"', f'version = "{version}"'.encode())


def test_a_truncated_file_never_goes_into_force_at_any_cut_point(tmp_path):
    path = tmp_path / "policy.toml"
    _replace(path, EXAMPLE.read_bytes())
    watched = PolicyFile(path)
    start = watched.current
    full = _edited("complete-edit")
    cuts = [i for i, ch in enumerate(full) if ch == ord("\n")]  # every line boundary: each still parses as TOML
    cuts += list(range(1, len(full) - len(POLICY_END_MARKER) - 2, 97))  # and cuts inside lines
    taken = []
    for cut in cuts:
        if full[:cut].rstrip().endswith(POLICY_END_MARKER.encode()):
            continue  # the whole file, up to trailing blank space
        _replace(path, full[:cut])
        outcome = watched.poll()
        assert outcome is not None
        if outcome.error is None:
            taken.append(cut)
        assert watched.current is start
    assert taken == [], f"{len(taken)} of {len(cuts)} truncated files went into force"
    _replace(path, full)
    outcome = watched.poll()
    assert outcome is not None and outcome.error is None and watched.current.version == "complete-edit"


def test_a_file_nested_too_deeply_is_a_refused_edit_not_an_exception(tmp_path):
    path = tmp_path / "policy.toml"
    _replace(path, EXAMPLE.read_bytes())
    watched = PolicyFile(path)
    for hostile in (b"x = " + b"[" * 50_000 + b"]" * 50_000, b"x = " + b"{a = " * 5_000 + b"1" + b"}" * 5_000,
                    b"[planner]\nmin_gain_s = " + b"[" * 3_000 + b"]" * 3_000):
        _replace(path, hostile + b"\n" + POLICY_END_MARKER.encode() + b"\n")
        outcome = watched.poll()
        assert outcome is not None and outcome.error is not None and not outcome.changed
        assert "nested too deeply" in str(outcome.error) or "not valid" in str(outcome.error)
    json_path = tmp_path / "policy.json"
    json_path.write_text('{"schema_version": "nexuskv.execution_policy.v1", "version": "j"}')
    watched_json = PolicyFile(json_path)
    _replace(json_path, b'{"version": ' + b"[" * 100_000)
    outcome = watched_json.poll()
    assert outcome is not None and outcome.error is not None and watched_json.current.version == "j"


def test_start_up_refuses_a_toml_file_without_its_end_marker(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_bytes(EXAMPLE.read_bytes().replace(POLICY_END_MARKER.encode(), b""))
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert info.value.errors[0][0] == "<file>" and POLICY_END_MARKER in str(info.value)
