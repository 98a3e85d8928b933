"""service.recent.Recent: the last N keys with their values, least recently put forgotten first,
in memory taken at creation."""

from __future__ import annotations

import random
import tracemalloc
from collections import OrderedDict

import pytest

from service.recent import Recent


def test_remembers_the_last_n_keys_and_forgets_the_oldest_first():
    r = Recent(3)
    for k in ("a", "b", "c"):
        r.put(k)
    assert len(r) == 3 and all(k in r for k in "abc")
    r.put("d")
    assert "a" not in r and all(k in r for k in "bcd") and len(r) == 3
    r.put("e")
    assert "b" not in r and all(k in r for k in "cde")


def test_put_again_refreshes_and_add_does_not():
    r = Recent(3)
    for k in ("a", "b", "c"):
        r.put(k)
    r.put("a")  # now the newest: b goes first
    r.put("d")
    assert "a" in r and "b" not in r
    assert r.add("c") is False  # already there, and left the oldest
    assert r.add("e") is True
    assert "c" not in r and all(k in r for k in ("a", "d", "e"))


def test_values_round_trip():
    r = Recent(4, width=3)
    assert r.get("x") is None
    assert r.put("x", 1, -2, 2**63 - 1) is None
    r.put(("session", "ab"), -(2**63), 0, 7)
    assert r.get("x") == (1, -2, 2**63 - 1)
    assert r.get(("session", "ab")) == (-(2**63), 0, 7)
    assert r.put("x", 4, 5, 6) == (1, -2, 2**63 - 1)  # the values replaced
    assert r.get("x") == (4, 5, 6)
    with pytest.raises(ValueError, match="3 values"):
        r.put("y", 1)


def test_width_zero_is_a_set():
    r = Recent(2)
    assert r.get("x") is None
    r.put("x")
    assert r.get("x") == () and "x" in r


def test_capacity_one_and_a_key_hashing_to_zero():
    r = Recent(1, width=1)
    r.put(0, 10)  # hash(0) == 0, which is the empty slot's mark
    assert r.get(0) == (10,)
    r.put(0, 11)
    r.put("b", 12)
    assert 0 not in r and r.get("b") == (12,) and len(r) == 1


@pytest.mark.parametrize("capacity,universe", [(1_000, 3_000), (7, 20)])
def test_heavy_churn_matches_an_lru_ordered_dict(capacity, universe):
    rng = random.Random(capacity)
    r = Recent(capacity, width=1)
    model: OrderedDict[int, int] = OrderedDict()
    sample = rng.sample(range(universe), min(50, universe))
    for n in range(1_000_000 if capacity >= 1_000 else 200_000):
        key = rng.randrange(universe)
        if rng.random() < 0.8:
            had = r.put(key, n)
            assert had == ((model[key],) if key in model else None)
            model[key] = n
            model.move_to_end(key)
            if len(model) > capacity:
                model.popitem(last=False)
        else:
            added = r.add(key)
            assert added == (key not in model)
            if added:
                model[key] = 0
                r.put(key, 0)  # the value, and the refresh, of a fresh key change nothing
                if len(model) > capacity:
                    model.popitem(last=False)
        assert len(r) == len(model)
        s = sample[n % len(sample)]
        assert r.get(s) == ((model[s],) if s in model else None)
    assert all(r.get(k) == (v,) for k, v in model.items())
    assert sum(k in r for k in range(universe)) == capacity


def test_all_memory_is_taken_at_creation():
    tracemalloc.start()
    try:
        r = Recent(100_000, width=2)
        before, _ = tracemalloc.get_traced_memory()
        assert before >= r.nbytes >= 100_000 * (24 + 16)
        for i in range(300_000):  # fills, then forgets
            r.put(f"request-{i}", i, -i)
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after - before < 4096
    assert r.nbytes < 100_000 * (32 + 16)  # tiny per key
