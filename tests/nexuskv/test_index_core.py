"""The storage core: required (no fallback), and refusing malformed input."""

from __future__ import annotations

import builtins

import pytest

from nexuskv.index import GlobalIndex
from nexuskv.index_core import NativeUnavailable, make_core


def test_the_index_runs_on_the_native_core():
    index = GlobalIndex()
    assert type(index._core).__module__ == "nexuskv._native"
    assert index.stats().backend == "native"


def test_without_the_native_core_an_index_cannot_be_built_and_says_how_to_build_it(monkeypatch):
    real_import = builtins.__import__

    def no_native(name, *args, **kwargs):
        if name == "nexuskv._native":
            raise ImportError("not built")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_native)
    for build in (lambda: make_core(bytes(32)), GlobalIndex):  # every service builds one at start
        with pytest.raises(NativeUnavailable, match=r"pip install -e \.") as err:
            build()
        assert "rustup.rs" in str(err.value) and "build_rust --inplace" in str(err.value)


def test_malformed_input_is_refused_and_changes_nothing():
    core = make_core(bytes(32))
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
        make_core(b"short")


def test_a_lookup_naming_a_freed_scope_by_its_serial_answers_none():
    core = make_core(bytes(32))
    pub = core.add_publisher()
    loc = core.add_location(pub)
    sid, serial = core.add_scope(b"a" * 16)
    core.store(pub, loc, sid, b"k" * 16, [1])
    assert core.lookup(sid, b"k" * 16, serial) == [(loc, 1, ())]
    core.remove(pub, loc, [1])
    assert core.take_empty_scopes() == [sid] and core.release_scope(sid)
    again, later = core.add_scope(b"b" * 16)
    core.store(pub, loc, again, b"k" * 16, [1])
    assert again == sid and later != serial
    assert core.lookup(sid, b"k" * 16, serial) is None, "the id names another scope now"
    assert core.lookup(sid, b"k" * 16, later) == [(loc, 1, ())]


def test_a_presize_past_32_bit_slot_ids_is_refused_before_anything_changes():
    core = make_core(bytes(32))
    with pytest.raises(ValueError, match="32-bit slot ids"):
        core.presize(1 << 40)
    with pytest.raises(ValueError, match="32-bit slot ids"):
        GlobalIndex(expected_blocks=1 << 40)
    core.presize(1000)  # the core still works
    assert core.add_publisher() == 0 and core.blocks == 0
