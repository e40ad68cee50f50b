"""The storage core's backends: choosing one, and refusing malformed input on both."""

from __future__ import annotations

import pytest

import nexuskv.index_core as index_core
from nexuskv.index import GlobalIndex
from nexuskv.index_core import BACKENDS, NativeUnavailable, make_core


def test_auto_runs_native_when_built_and_falls_back_with_a_warning(monkeypatch):
    assert index_core.native_available(), "the native core must be built for the test run (pip install -e .)"
    assert GlobalIndex().backend == "native" and GlobalIndex().stats().backend == "native"
    monkeypatch.setattr(index_core, "native_available", lambda: False)
    with pytest.warns(RuntimeWarning, match="build_rust --inplace"):
        assert GlobalIndex().backend == "python"


def test_a_missing_native_core_is_a_clear_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_native(name, *args, **kwargs):
        if name == "nexuskv._native":
            raise ImportError("not built")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_native)
    with pytest.raises(NativeUnavailable, match="rustup.rs"):
        make_core("native", bytes(32))
    with pytest.raises(ValueError, match="index backend"):
        make_core("numpy", bytes(32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_malformed_input_is_refused_and_changes_nothing(backend):
    core = make_core(backend, bytes(32))
    pub = core.add_publisher()
    loc = core.add_location(pub)
    sid, _serial = core.add_scope(b"s" * 16)
    with pytest.raises(ValueError):
        core.store(pub, loc, sid, b"x" * 17, [1])  # not whole keys
    with pytest.raises(ValueError):
        core.store(pub, loc, sid, b"x" * 32, [1])  # two keys, one hash
    with pytest.raises(OverflowError):
        core.store(pub, loc, sid, b"x" * 16, [-1])
    with pytest.raises(ValueError):
        core.store(pub, loc + 1, sid, b"x" * 16, [1])  # a location that does not exist
    with pytest.raises(ValueError):
        core.lookup(sid + 1, b"x" * 16)  # a scope that does not exist
    other = core.add_publisher()
    with pytest.raises(ValueError):
        core.store(other, loc, sid, b"x" * 16, [1])  # another publisher's location
    assert core.memberships == 0 and core.blocks == 0
    with pytest.raises(ValueError):
        make_core(backend, b"short")
