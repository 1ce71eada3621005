"""Fragment plans remembered (``dask_octopus.groups.memo``): the same collection computed again inside
``annotate`` reuses its plan, with fresh fragment tasks; a graph that differs in what the plan depends on
(the functions of a layer under the same keys, the keys asked for, places, budgets) is planned anew;
graphs holding data are not remembered."""

from __future__ import annotations

import functools
import pickle

import dask
import dask.array as da
import numpy as np
import pytest
from dask.utils import key_split
from distributed import wait
from distributed.utils_test import async_poll_for, gen_cluster
from test_balance import setup
from test_fragment_semantics import grouped_by  # noqa: F401 (a fixture)

import dask_octopus
from dask_octopus._compat import Task, TaskRef
from dask_octopus.groups import memo, rewrite
from dask_octopus.groups.memo import plans
from dask_octopus.groups.rewrite import FRAGMENT_PREFIX, fragment_graph


def add_all(*values):
    return sum(values)


def chain(b):
    return np.sqrt(b * 2.0 + 1.0) - 0.5


def twice(b):
    return b * 2.0


@pytest.fixture
def planned(monkeypatch):
    """The graphs planned since the test began (each a call of ``rewrite._fragment_graph``)."""
    made = []
    real = rewrite._fragment_graph

    def counting(*args):
        out = real(*args)
        made.append(out[0])
        return out

    monkeypatch.setattr(rewrite, "_fragment_graph", counting)
    return made


@pytest.fixture
def blocks():
    return da.random.default_rng(0).random((64 * 4, 6), chunks=(4, 6))


async def persisted(c, s, blocks):
    """Register with fixed speeds, persist ``blocks`` and compute their chain's row sums unannotated
    (under other keys than the tests': Dask would reuse them)."""
    await setup(c, s, [1.0])
    x = await c.persist(blocks)
    await wait(x)
    return x, await c.compute(x.map_blocks(chain, name="plain").sum(axis=1))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_the_same_collection_computed_again_reuses_its_plan(c, s, a, blocks, planned, grouped_by):  # noqa: F811
    x, expected = await persisted(c, s, blocks)
    remembered = []
    for _ in range(4):
        with dask_octopus.annotate():
            got = await c.compute(x.map_blocks(chain).sum(axis=1))  # the same keys but Dask's final task's
        np.testing.assert_array_equal(got, expected)
        remembered.append(len(plans))
        await async_poll_for(lambda: len(s.tasks) == len(x.dask), 5)  # forgotten: none is reused
    assert len(planned) == 2  # computed once: planned, not remembered; twice: remembered; then reused
    assert remembered == [0, 1, 1, 1]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_graphs_holding_data_are_not_remembered(c, s, a, planned):
    await setup(c, s, [1.0])
    data = np.arange(64 * 6, dtype=float).reshape(64, 6)
    for _ in range(2):
        with dask_octopus.annotate():
            got = await c.compute(da.from_array(data, chunks=(4, 6), name="held").map_blocks(chain).sum(axis=1))
        np.testing.assert_array_equal(got, chain(data).sum(axis=1))
    assert len(planned) == 2 and len(plans) == 0


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config={"octopus.fragments.plan-memo": 0})
async def test_plan_memo_zero_plans_every_compute(c, s, a, blocks, planned):
    x, expected = await persisted(c, s, blocks)
    for _ in range(2):
        with dask_octopus.annotate():
            np.testing.assert_array_equal(await c.compute(x.map_blocks(chain).sum(axis=1)), expected)
    assert len(planned) == 2 and len(plans) == 0


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_smaller_memory_budget_plans_anew(c, s, a, blocks, planned):
    x, expected = await persisted(c, s, blocks)
    for budget in [None, None, "2kB"]:  # remembered at the second compute
        with dask.config.set({"octopus.fragments.max-bytes": budget or "auto"}), dask_octopus.annotate():
            np.testing.assert_array_equal(await c.compute(x.map_blocks(chain).sum(axis=1)), expected)
        await async_poll_for(lambda: len(s.tasks) == len(x.dask), 5)
    counts = [len([k for k in out if key_split(k) == FRAGMENT_PREFIX]) for out in planned]
    assert len(counts) == 3 and counts[:2] == [1, 1] and counts[2] > 1


def graph(name, func=chain):
    """Four tasks of ``func`` and their total, under keys of layer ``name``."""
    dsk = {(name, i): Task((name, i), func, float(i)) for i in range(4)}
    dsk["total"] = Task("total", add_all, *(TaskRef(k) for k in dsk))
    return dsk


def plan(dsk, keep=("total",), places=None, parts=None, pullable=None):
    return fragment_graph(dsk, {k: {"resource": "memory"} for k in dsk if k != "total"}, list(keep),
                          {k: {"total"} for k in dsk if k != "total"} | {"total": set()}, places or {},
                          parts or {None: 1}, pullable)


def fragments(out):
    return [node.args[0].value for k, node in out.items() if key_split(k) == FRAGMENT_PREFIX]


def test_a_plan_remembered_comes_with_fresh_fragments_each_time(planned):
    made = [plan(graph("a")) for _ in range(4)][1:]  # the second remembered, then reused
    assert len(planned) == 2
    first, *again = (fragments(out)[0] for out in made)
    first.read_before["x"] = frozenset()  # the scheduler's state of the first compute's fragment
    pickle.dumps(first)  # sent: its steps are bytes from now on
    for f in again:
        assert f is not first and f.read_before == {} and f.specs() is f._specs  # steps as first made
    assert [f.names for f in again] == [first.names] * 2
    assert all(dask.get(out, "total") == pytest.approx(sum(chain(float(i)) for i in range(4))) for out in made)


def test_the_same_keys_with_other_functions_or_inputs_are_planned_anew(planned):
    for func in [chain, twice, twice, functools.partial(np.multiply, 3.0), functools.partial(np.multiply, 4.0)]:
        out = plan(graph("a", func))  # the same keys each time
        assert dask.get(out, "total") == pytest.approx(sum(func(float(i)) for i in range(4)), rel=1e-15)
    assert len(planned) == 4  # twice again: remembered (the last plan of these keys is)
    dsk = graph("a", functools.partial(np.multiply, 4.0))
    parts = {None: 2, "w1": 1}
    pullable = set(dsk) - {("a", 3)}
    # one argument more changed each time: each planned anew
    assert len(fragments(plan(dsk, parts=parts))) == 2
    assert ("a", 3) in plan(dsk, parts=parts, pullable=pullable)  # may not join a fragment: a task
    assert ("a", 0) in plan(dsk, ["total", ("a", 0)], parts=parts, pullable=pullable)  # asked for: a task
    assert len(fragments(plan(dsk, ["total", ("a", 0)], {("a", i): "w1" for i in range(4)}, parts, pullable))) == 1
    assert len(planned) == 8


def test_the_least_recently_used_plans_are_dropped_first(planned):
    with dask.config.set({"octopus.fragments.plan-memo": 2}):
        for name in ["a", "b", "c", "a", "b", "a", "c", "b", "a"]:  # each planned once first, then remembered
            assert [key_split(k) for k in plan(graph(name))] == ["total", FRAGMENT_PREFIX]
    # a, b, a reused (now used last), c (b goes), b (a goes), a (c goes): five plans more
    assert len(planned) == 3 + 5 and len(plans) == 2


def test_forms_tell_numbers_of_other_types_and_functions_apart_and_refuse_data():
    f = memo._form
    assert f(1) != f(1.0) != f(True) and f(np.float32(1)) != f(1.0)
    assert f((1, "a", None)) == f((1, "a", None)) and f([1]) != f((1,))
    assert f(functools.partial(np.multiply, 3.0)) == f(functools.partial(np.multiply, 3.0))
    assert f(functools.partial(np.multiply, 3.0)) != f(functools.partial(np.multiply, 4.0))
    assert f(twice) != f(chain) and f({"a": slice(1, 2)}) == f({"a": slice(1, 2)}) != f({"a": slice(1, 3)})
    with pytest.raises(memo._Data):
        f(np.arange(3))
    with pytest.raises(memo._Data):
        f([1, object()])
