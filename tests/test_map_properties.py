"""``dask_octopus.map`` and ``imap`` on random inputs (hypothesis): every item's result, or its own error.

Random lists of items (local values, futures and delayed objects mixed), some of which make the function
raise, with or without costs and ``group``, returned as futures, gathered (raising or skipping failures)
or iterated with ``imap``; and random blocks under a memory budget that cuts the batches. On one in-
process cluster of two workers with the plugin. Each item's outcome is compared with the function called
on it here. The examples are derandomized: the same ones each run.
"""

import dask
import numpy as np
import pytest
from distributed import wait
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fragment_properties import cluster_client  # noqa: F401 (a fixture)

import dask_octopus


class Bad(ValueError):
    pass


def work(x, fail=frozenset(), offset=0):
    if x in fail:
        raise Bad(f"item {x} is bad")
    return 3 * x + offset


HOWS = ["futures", "gather", "skip", "imap", "imap-skip"]


@given(st.lists(st.integers(0, 40), max_size=24), st.data())
@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_random_maps_give_every_item_its_result_or_its_own_error(cluster_client, values, data):  # noqa: F811
    n = len(values)
    kinds = data.draw(st.lists(st.sampled_from(["local", "future", "delayed"]), min_size=n, max_size=n))
    failing = frozenset(data.draw(st.sets(st.sampled_from(values)))) if values else frozenset()
    group = data.draw(st.one_of(st.none(), st.integers(1, 6)))
    cost = data.draw(st.one_of(st.none(), st.lists(st.floats(0, 100), min_size=n, max_size=n)))
    how = data.draw(st.sampled_from(HOWS))
    offset = data.draw(st.integers(0, 5))
    items = [x if kind == "local" else cluster_client.scatter(x, hash=False) if kind == "future"
             else dask.delayed(lambda v: v, pure=False)(x) for x, kind in zip(values, kinds, strict=True)]
    expected = [None if x in failing else 3 * x + offset for x in values]
    options = {"client": cluster_client, "group": group, "cost": cost, "fail": failing, "offset": offset}
    if how == "futures":
        futures = dask_octopus.map(work, items, **options)
        wait(futures)
        assert len(futures) == n
        for future, x, value in zip(futures, values, expected, strict=True):
            if value is None:
                assert future.status == "error" and str(future.exception()) == f"item {x} is bad"
                assert isinstance(future.exception(), Bad)
            else:
                assert future.result() == value
    elif how in ("gather", "skip"):
        errors = "raise" if how == "gather" else "skip"
        if failing and how == "gather":
            first = next(x for x in values if x in failing)  # the first failed item in the order given
            with pytest.raises(Bad, match=f"^item {first} is bad$"):
                dask_octopus.map(work, items, gather=True, errors=errors, **options)
        else:
            got = dask_octopus.map(work, items, gather=True, errors=errors, **options)
            assert got == [v for v in expected if v is not None]
    else:
        errors = "raise" if how == "imap" else "skip"
        if failing and how == "imap":
            with pytest.raises(Bad, match=r"^item [0-9]+ is bad$") as info:
                list(dask_octopus.imap(work, items, errors=errors, **options))
            assert int(str(info.value).split()[1]) in failing
        else:
            pairs = list(dask_octopus.imap(work, items, errors=errors, **options))
            assert sorted(pairs) == [(i, v) for i, v in enumerate(expected) if v is not None]


def scaled(block, fail=frozenset()):
    if int(block[0]) in fail:
        raise Bad(f"block {int(block[0])} is bad")
    return block * 3.0


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 4000)), max_size=16), st.data())
@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_random_maps_of_blocks_under_a_memory_budget_give_every_block_its_result(cluster_client, blocks, data):  # noqa: F811
    """Blocks of up to 32 kB under a budget of 8 to 64 kB per task: batches are cut to fit (or hold one
    block each), and every block's result is its own, or its own error."""
    budget = data.draw(st.sampled_from(["8kB", "16kB", "64kB"]))
    failing = frozenset(data.draw(st.sets(st.sampled_from([x for x, _ in blocks])))) if blocks else frozenset()
    group = data.draw(st.one_of(st.none(), st.integers(1, 8)))
    items = [np.full(size, float(x)) for x, size in blocks]
    with dask.config.set({"octopus.fragments.max-bytes": budget}):
        got = dask_octopus.map(scaled, items, client=cluster_client, group=group, gather=True, errors="skip",
                               fail=failing)
    expected = [b * 3.0 for (x, _), b in zip(blocks, items, strict=True) if x not in failing]
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_array_equal(g, e)
