import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from spanserve.cache.hashing import block_key, chain_keys, seed

TOKS = [1, 2, 3, 4, 5, 6, 7, 8]


def test_deterministic_and_in_range():
    s = seed("tenant", "anchor", [1, 2, 3])
    assert s == seed("tenant", "anchor", [1, 2, 3])
    k = block_key(s, TOKS, b"x")
    assert k == block_key(s, TOKS, b"x")
    assert 0 <= s < 2**128 and 0 <= k < 2**128
    # Container type must not matter.
    assert block_key(s, tuple(TOKS)) == block_key(s, np.array(TOKS, dtype=np.int64))


def test_plain_seed_is_default():
    assert seed() == seed("")
    assert seed("") != seed("a")


def test_seed_part_boundaries_and_types():
    assert seed("ab") != seed("a", "b")
    assert seed("a", "bc") != seed("ab", "c")
    assert seed("", "x") != seed("x")
    assert seed("", "") != seed("")
    assert seed("", b"1") != seed("", "1")
    assert seed("", "1") != seed("", 1)
    assert seed("", 1) != seed("", [1])
    assert seed("", [1, 2]) != seed("", [1], [2])
    assert seed("", [1, 2]) != seed("", [2, 1])
    assert seed("", 0) != seed("", -1) != seed("", 2**70)


def test_seed_never_equals_block_key():
    assert seed("") != block_key(0, [])


def test_block_key_sensitive_to_parent():
    assert block_key(1, TOKS) != block_key(2, TOKS)
    assert block_key(0, TOKS) != block_key(2**127, TOKS)


@pytest.mark.parametrize("i", range(len(TOKS)))
def test_block_key_sensitive_to_each_token(i):
    other = list(TOKS)
    other[i] += 1
    assert block_key(7, TOKS) != block_key(7, other)


def test_block_key_sensitive_to_extra():
    assert block_key(7, TOKS) != block_key(7, TOKS, b"lora:1")
    assert block_key(7, TOKS, b"a") != block_key(7, TOKS, b"b")


def test_extra_cannot_pose_as_tokens():
    # Bytes of token 9 appended as `extra` must not reproduce the 9-token key.
    tail = np.array([9], dtype="<i4").tobytes()
    assert block_key(7, TOKS, tail) != block_key(7, TOKS + [9])


def test_rejects_out_of_range():
    with pytest.raises(OverflowError):
        block_key(2**128, TOKS)
    with pytest.raises(OverflowError):
        block_key(-1, TOKS)
    with pytest.raises(OverflowError):
        block_key(0, [2**40])


def test_partial_key_differs_from_full_keys():
    s = seed("")
    full = chain_keys(s, TOKS, 4)
    partial = chain_keys(s, TOKS[:6], 4, include_partial=True)
    assert len(full) == 2 and len(partial) == 2
    assert partial[0] == full[0]
    assert partial[1] not in full
    # A partial block of 0-padded tokens is still not the full block.
    assert block_key(full[0], [5, 6]) != block_key(full[0], [5, 6, 0, 0])


def test_chain_keys_matches_manual_chaining():
    s = seed("ns", [42])
    toks = list(range(100, 111))  # 11 tokens, block 4 -> 2 full + 3 partial
    manual, parent = [], s
    for i in range(0, len(toks), 4):
        parent = block_key(parent, toks[i : i + 4])
        manual.append(parent)
    assert chain_keys(s, toks, 4) == manual[:2]
    assert chain_keys(s, toks, 4, include_partial=True) == manual
    assert chain_keys(s, np.array(toks), 4) == manual[:2]


def test_chain_keys_edge_cases():
    s = seed()
    assert chain_keys(s, [], 4) == []
    assert chain_keys(s, [], 4, include_partial=True) == []
    assert chain_keys(s, [1, 2, 3], 4) == []
    assert chain_keys(s, [1, 2, 3, 4], 4, include_partial=True) == chain_keys(s, [1, 2, 3, 4], 4)
    with pytest.raises(ValueError):
        chain_keys(s, TOKS, 0)


def test_chain_depends_on_seed():
    assert chain_keys(seed("a"), TOKS, 4)[1] != chain_keys(seed("b"), TOKS, 4)[1]


@given(st.lists(st.integers(0, 50), min_size=16, max_size=80), st.booleans(), st.sampled_from([2, 4]))
def test_memoized_chains_equal_manual_chaining(toks, partial, bs):
    """Long units are memoized: a second call (and a call with another seed, block size or
    partial flag) must still return exactly the block-by-block chain."""
    for s in (seed("m"), seed("n")):
        manual, parent = [], s
        for i in range(0, len(toks), bs):
            blk = toks[i:i + bs]
            if len(blk) < bs and not partial:
                break
            parent = block_key(parent, blk)
            manual.append(parent)
        assert chain_keys(s, toks, bs, include_partial=partial) == manual
        got = chain_keys(s, toks, bs, include_partial=partial)
        assert got == manual
        got.append(0)  # the caller owns the returned list: the memo must not change
        assert chain_keys(s, toks, bs, include_partial=partial) == manual
