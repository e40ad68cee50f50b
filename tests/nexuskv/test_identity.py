import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nexuskv.errors import IdentityError
from nexuskv.identity import BlockKeyer, IdentityScope, block_keys, key_bytes, key_from_bytes

from tests.factories import scope

tokens_st = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=200)


@settings(max_examples=200, deadline=None)
@given(tokens=tokens_st, cut=st.integers(min_value=0, max_value=200), block=st.sampled_from([1, 4, 16]))
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(tokens, cut, block):
    keyer = BlockKeyer(scope(), block)
    full = keyer.keys(tokens)
    assert len(full) == len(tokens) // block
    assert keyer.keys(tokens[:cut]) == full[: cut // block]


@settings(max_examples=100, deadline=None)
@given(tokens=tokens_st.filter(lambda t: len(t) >= 4), tenants=st.tuples(st.text(min_size=1, max_size=8),
                                                                           st.text(min_size=1, max_size=8)))
def test_two_tenants_never_share_keys(tokens, tenants):
    a, b = tenants
    if a == b:
        return
    ka = set(block_keys(scope(a), tokens, 4))
    kb = set(block_keys(scope(b), tokens, 4))
    assert ka and not (ka & kb)


def test_every_scope_field_and_the_secret_change_the_keys():
    tokens = list(range(64))
    base = block_keys(scope(), tokens, 16)
    variants = [
        scope(model="other"), scope(model_revision="r2"), scope(tokenizer_revision="t2"),
        scope(descriptor_id="sd1-" + "1" * 32), scope(lora="adapter"), scope(cache_salt="salt"),
    ]
    for v in variants:
        assert set(block_keys(v, tokens, 16)).isdisjoint(base), v
    assert set(block_keys(scope(), tokens, 16, secret=b"deployment-secret")).isdisjoint(base)


def test_chaining_extra_keys_and_parent():
    keyer = BlockKeyer(scope(), 4)
    keys = keyer.keys(range(12))
    assert keyer.keys(range(4, 12), parent=keys[0]) == keys[1:]
    assert keyer.keys([9, 9, 9, 9, 1, 2, 3, 4])[1] != keyer.keys([0, 0, 0, 0, 1, 2, 3, 4])[1]
    with_mm = keyer.keys(range(8), extra_keys=[None, ("mm-hash", 2)])
    assert with_mm[0] == keys[0] and with_mm[1] != keys[1]
    assert keyer.keys(range(8), extra_keys=[None, None]) == keys[:2]
    assert key_from_bytes(key_bytes(keys[2])) == keys[2] and 0 <= keys[2] < 2**128


def test_same_keys_in_two_fresh_processes_with_different_hash_seeds():
    code = ("from tests.factories import scope; from nexuskv.identity import block_keys; "
            "print(block_keys(scope(), list(range(1000)), 16, secret=b's')[-1])")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.strip() for seed in ("0", "12345")}
    assert outs == {str(block_keys(scope(), list(range(1000)), 16, secret=b"s")[-1])}


def test_numpy_and_list_inputs_agree():
    toks = np.arange(100, 164, dtype=np.int64)
    assert block_keys(scope(), toks, 16) == block_keys(scope(), toks.tolist(), 16)


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], [[1, 2]], ["a"]])
def test_invalid_tokens_are_rejected(bad):
    with pytest.raises(IdentityError):
        block_keys(scope(), bad * 16, 16)


def test_invalid_block_size_extra_keys_and_secret():
    with pytest.raises(IdentityError):
        BlockKeyer(scope(), 0)
    with pytest.raises(IdentityError):
        BlockKeyer(scope(), 4).keys(range(8), extra_keys=[None])
    with pytest.raises(IdentityError):
        BlockKeyer(scope(), 4, secret=b"x" * 65)


def test_scope_encoding_is_unambiguous():
    # a field boundary cannot move: ("ab", "c") and ("a", "bc") are different scopes
    a = IdentityScope(tenant_namespace="t", model="ab", model_revision="c", tokenizer_revision="x", descriptor_id="d")
    b = IdentityScope(tenant_namespace="t", model="a", model_revision="bc", tokenizer_revision="x", descriptor_id="d")
    assert a.canonical_bytes() != b.canonical_bytes()
    c = IdentityScope(tenant_namespace="t", model="a", model_revision="b", tokenizer_revision="x", descriptor_id="d",
                      lora="")
    d = IdentityScope(tenant_namespace="t", model="a", model_revision="b", tokenizer_revision="x", descriptor_id="d")
    assert c.canonical_bytes() != d.canonical_bytes()
