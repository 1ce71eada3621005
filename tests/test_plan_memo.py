"""Fragment plans remembered (``dask_octopus.groups.memo``): the same collection computed again inside
``annotate`` reuses its plan, with fresh fragment tasks running the compute at hand's functions and
constants (other ones under the same keys, a script's functions unpickled anew, blocks holding data); a
graph that differs in what the plan depends on (the keys asked for, places, budgets, a block fused
otherwise, a task that awaits) is planned anew."""

from __future__ import annotations

import functools
import gc
import pickle
import threading
import weakref

import cloudpickle
import dask
import dask.array as da
import numpy as np
import pytest
from dask._task_spec import fuse_linear_task_spec
from dask.utils import key_split
from distributed import wait
from distributed.utils_test import async_poll_for, captured_logger, gen_cluster
from test_balance import setup
from test_fragment_semantics import grouped_by  # noqa: F401 (a fixture)

import dask_octopus
from dask_octopus._compat import Alias, DataNode, Task, TaskRef, resolve_aliases
from dask_octopus.groups import rewrite
from dask_octopus.groups.blocksizes import block_bytes
from dask_octopus.groups.memo import plans
from dask_octopus.groups.rewrite import FRAGMENT_PREFIX, fragment_graph
from dask_octopus.groups.streams import pick, run_guarded
from dask_octopus.placement.bandwidth import Bandwidths


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


def plus(b):
    return b * 2 + 1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_reused_plan_s_result_held_and_computed_again_logs_no_collision(c, s, a, b, planned):
    """The fragments of a reused plan keep what their kept members read before the grouping, so that the
    plugin still drops Dask's warning about the held keys' other run spec when the same work comes again
    without ``annotate``."""
    await setup(c, s, [1.0, 1.0])
    x = await c.persist(da.random.default_rng(0).random((64, 64), chunks=(8, 8)))

    def collection():
        y = x.map_blocks(plus)
        return (y + y.T).sum(axis=0)

    for _ in range(2):  # the plans remembered at the second compute
        with dask_octopus.annotate():
            await c.compute(collection())
        await async_poll_for(lambda: len(s.tasks) == len(x.dask), 5)
    once = len(planned) // 2  # (this graph is planned in parts)
    with captured_logger("distributed.scheduler") as log:
        with dask_octopus.annotate():
            first = c.compute(collection())  # the plan reused, its result held
        await wait(first)
        second = c.compute(collection())
        np.testing.assert_array_equal(await first, await second)
    assert len(planned) < 3 * once  # reused
    assert "Detected different `run_spec`" not in log.getvalue()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_graphs_holding_data_reuse_their_plan_computing_the_data_at_hand(c, s, a, planned):
    """Blocks that hold their data (``from_array`` under a name given, so the same keys each time; Dask's
    ``ones``) reuse the plan, and what is computed is the data of the compute at hand: other data under
    the same keys included."""
    await setup(c, s, [1.0])
    data = np.arange(64 * 6, dtype=float).reshape(64, 6)
    for i in range(4):  # remembered at the second, reused from the third (other data under the same keys)
        now = data + 100.0 * i
        with dask_octopus.annotate():
            got = await c.compute(da.from_array(now, chunks=(4, 6), name="held").map_blocks(chain).sum(axis=1))
        np.testing.assert_array_equal(got, chain(now).sum(axis=1))
        await async_poll_for(lambda: not s.tasks, 5)
    assert len(planned) == 2 and len(plans) == 1
    for _ in range(3):
        with dask_octopus.annotate():
            got = await c.compute(da.ones((64, 6), chunks=(4, 6)).map_blocks(chain).sum(axis=1))
        np.testing.assert_array_equal(got, chain(np.ones((64, 6))).sum(axis=1))
        await async_poll_for(lambda: not s.tasks, 5)
    assert len(planned) == 4 and len(plans) == 2


SCRIPT = "import numpy as np\ndef scaled(b):\n    return (np.sqrt(b * 2.0 + 1.0) - 0.5) * k\n"


def script_function(k):
    """A new ``scaled`` as a script defines it (module ``__main__``, which distributed pickles by value, so
    that the scheduler unpickles a new function each compute), multiplying by its global ``k``."""
    namespace = {"__name__": "__main__", "k": k}
    exec(SCRIPT, namespace)
    return namespace["scaled"]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_script_s_functions_unpickled_anew_each_compute_reuse_the_plan(c, s, a, blocks, planned):
    """The functions of a script or notebook are new objects on the scheduler each compute (Dask names
    their layer by the function's pickled bytes: the same keys each time): the plan is reused all the
    same; under a layer named by the user, also where the function now does something else, running
    the function of the compute at hand."""
    x, expected = await persisted(c, s, blocks)
    for name, k in [(None, 1.0)] * 3 + [("scaled", 1.0)] * 3 + [("scaled", 3.0)]:
        scaled = script_function(k)
        assert scaled.__module__ == "__main__" and cloudpickle.loads(cloudpickle.dumps(scaled)) is not scaled
        with dask_octopus.annotate():
            got = await c.compute(x.map_blocks(scaled, name=name).sum(axis=1))
        np.testing.assert_allclose(got, expected * k, rtol=1e-14)
        await async_poll_for(lambda: len(s.tasks) == len(x.dask), 5)
    assert len(planned) == 4  # each name's: remembered at its second compute, reused from the third on


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


REAL = rewrite._fragment_graph  # planning itself, without the memo


def graph(name, func=chain, total="total"):
    """Four tasks of ``func`` under keys of layer ``name``, and their ``total`` (its key given: Dask names
    a compute's final task anew each time)."""
    dsk = {(name, i): Task((name, i), func, float(i)) for i in range(4)}
    dsk[total] = Task(total, add_all, *(TaskRef(k) for k in dsk))
    return dsk


def arguments(dsk, keep=None, places=None, parts=None, pullable=None, made_bytes=None, marked=None, roots=None,
              loose=None, holders=None, fetch_costs=None):
    """The arguments of ``fragment_graph`` for ``dsk`` (its last task reads the others): the others marked
    (or ``marked``), the last asked for (or ``keep``)."""
    *others, total = dsk
    marked = others if marked is None else marked
    dependents = {k: {d for d in dsk if k in dsk[d].dependencies} for k in dsk}
    return (dsk, {k: {"resource": "memory"} for k in marked}, [total] if keep is None else list(keep), dependents,
            places or {}, parts or {None: 1}, pullable, None, None, None, None, made_bytes, (), roots, loose,
            holders, fetch_costs)


def plan(dsk, **kwargs):
    return fragment_graph(*arguments(dsk, **kwargs))


def fragments(out):
    return [node.args[0].value for k, node in out.items() if key_split(k) == FRAGMENT_PREFIX]


def assert_planned_anew_alike(got, dsk, **kwargs):
    """``got`` is the plan that planning ``dsk`` anew makes: the same keys in the same order, the graph's
    own tasks taken from ``dsk`` (rewritten alike where they read fragments), equal fragment tasks."""
    want, _, _ = REAL(*arguments(dsk, **kwargs))
    assert list(got) == list(want)
    for k, node in got.items():
        if key_split(k) == FRAGMENT_PREFIX:
            f, g = node.args[0].value, want[k].args[0].value
            assert vars(f) | {"_specs": f.specs()} == vars(g) | {"_specs": g.specs()}
            assert node.args[1:] == want[k].args[1:]
        elif want[k] is dsk.get(k):
            assert node is dsk[k]
        else:
            assert type(node) is type(want[k]) and node.key == want[k].key and node.args == want[k].args


def test_a_plan_remembered_is_the_plan_made_anew_with_fresh_fragments(planned):
    made = []
    marked = [("a", j) for j in range(4)]
    for i in range(4):
        dsk = {("b", 0): Task(("b", 0), chain, 9.0)} | graph("a", total=f"total-{i}")  # named anew each time
        dsk[f"total-{i}"] = Task(f"total-{i}", add_all, *(TaskRef(k) for k in list(dsk)[:-1]))
        made.append(plan(dsk, marked=marked))
        assert_planned_anew_alike(made[-1], dsk, marked=marked)
        assert ("b", 0) in made[-1]  # (a task of its own: read by the total alone)
        assert dask.get(made[-1], f"total-{i}") == pytest.approx(sum(chain(float(j)) for j in [*range(4), 9]))
    assert len(planned) == 2  # the second remembered, then reused
    f, g = fragments(made[2])[0], fragments(made[3])[0]
    assert f is not g and f.read_before == g.read_before != {}
    f.read_before.clear()  # what one compute's fragment holds, and its steps pickled when it is sent ...
    pickle.dumps(f)
    assert g.read_before != {} and g.specs() is g._specs  # ... are its own


def test_the_same_keys_with_other_functions_reuse_the_plan_other_arguments_plan_anew(planned):
    for func in [chain, twice, twice, functools.partial(np.multiply, 3.0), functools.partial(np.multiply, 4.0)]:
        out = plan(graph("a", func))  # the same keys each time
        assert dask.get(out, "total") == pytest.approx(sum(func(float(i)) for i in range(4)), rel=1e-15)
    assert len(planned) == 2  # remembered at the second, reused from the third: each runs its own function
    dsk = graph("a", functools.partial(np.multiply, 4.0))
    parts = {None: 2, "w1": 1}
    pullable = set(dsk) - {("a", 3)}
    # one argument more changed each time: each planned anew
    assert len(fragments(plan(dsk, parts=parts))) == 2
    assert ("a", 3) in plan(dsk, parts=parts, pullable=pullable)  # may not join a fragment: a task
    assert ("a", 0) in plan(dsk, keep=["total", ("a", 0)], parts=parts, pullable=pullable)  # asked for: a task
    places = {("a", i): "w1" for i in range(4)}
    assert len(fragments(plan(dsk, keep=["total", ("a", 0)], places=places, parts=parts, pullable=pullable))) == 1
    assert len(planned) == 6
    # held by two workers alternately: followed, two fragments; fetched where tasks cost enough, one
    places = {("a", i): f"w{i % 2}" for i in range(4)}
    parts = {None: 1, "w0": 1, "w1": 1}
    loose = dict.fromkeys(places)
    assert len(fragments(plan(dsk, places=places, parts=parts))) == 2
    links = Bandwidths(1e9)
    assert len(fragments(plan(dsk, places=places, parts=parts, loose=loose, fetch_costs=(0.0, links)))) == 2
    assert len(fragments(plan(dsk, places=places, parts=parts, loose=loose, fetch_costs=(1e-3, links)))) == 1
    assert len(planned) == 9
    links = Bandwidths(1e9, {("w0", "w1"): 2.0 ** 20})  # a figure measured between two workers: a plan anew
    assert len(fragments(plan(dsk, places=places, parts=parts, loose=loose, fetch_costs=(1e-3, links)))) == 1
    assert len(planned) == 10
    for _ in range(2):  # the same figures again (equal, not the same object): its plan (remembered) reused
        same = (1e-3, Bandwidths(1e9, {("w0", "w1"): 2.0 ** 20}))
        assert len(fragments(plan(dsk, places=places, parts=parts, loose=loose, fetch_costs=same))) == 1
    assert len(planned) == 10


def scaled_by(c):
    return lambda b: b * c


def test_lambdas_made_anew_each_compute_reuse_the_plan_running_their_own(planned):
    for c in [2.0, 2.0, 2.0, 3.0, 3.0, 3.0]:  # a function object of its own each time
        out = plan(graph("a", scaled_by(c)))  # the same keys each time
        assert dask.get(out, "total") == pytest.approx(c * 6.0)
    assert len(planned) == 2  # remembered at the second, reused from the third: each its own closure


def scaled_by_setting(setting):
    return lambda b: b * setting["k"]


def test_a_reused_plan_runs_the_compute_at_hand_s_functions_not_the_remembered_one_s(planned):
    """A reused plan makes its fragments' steps from the graph at hand: what the remembered compute's
    function closes over changing in place since changes nothing; functions closing over objects that are
    neither data nor callable, or over themselves, reuse plans too."""
    setting = {"k": 2.0}
    for _ in range(2):  # remembered at the second
        assert dask.get(plan(graph("a", scaled_by_setting(setting))), "total") == pytest.approx(12.0)
    setting["k"] = 3.0  # the remembered compute's function now triples
    out = plan(graph("a", scaled_by_setting({"k": 2.0})))  # equal to the old setting as it was
    assert dask.get(out, "total") == pytest.approx(12.0) and len(planned) == 2  # reused, running this one's
    lock = threading.Lock()
    for _ in range(3):
        assert dask.get(plan(graph("b", lambda b: b * 2.0 if lock else 0.0)), "total") == pytest.approx(12.0)
    assert len(planned) == 4

    def halve_until(b):  # closes over itself
        return b if abs(b) < 8 else halve_until(b / 2)

    for _ in range(3):
        assert dask.get(plan(graph("c", halve_until)), "total") == pytest.approx(6.0)
    assert len(planned) == 6 and len(plans) == 3


DASK_NAMED = "b-" + "0" * 32  # a layer name as Dask makes them: its prefix and the hash of what it computes


def user_named(constants, fused):
    """Tasks under keys named by the user (``("a", i)``, as ``dask_key_name`` names them), each of its own
    constant, and their total; ``fused``: each read by a task of a layer that Dask named, which low-level
    fusion fuses it into (keeping its key inside)."""
    dsk = {("a", i): Task(("a", i), chain, c) for i, c in enumerate(constants)}
    if not fused:
        dsk["total"] = Task("total", add_all, *(TaskRef(k) for k in dsk))
        return dsk, list(dsk)[:-1]
    dsk |= {(DASK_NAMED, i): Task((DASK_NAMED, i), twice, TaskRef(("a", i))) for i in range(len(constants))}
    dsk["total"] = Task("total", add_all, *(TaskRef((DASK_NAMED, i)) for i in range(len(constants))))
    fused = fuse_linear_task_spec(dsk, ["total"])
    dsk = resolve_aliases(fused, {"total"}, rewrite.dependents_of(fused))
    assert all(type(node) is Task for node in dsk.values()) and len(dsk) == 5  # four fused tasks
    return dsk, [k for k in dsk if k != "total"]


def dask_named(constants, links=None):
    """Blocks of a layer named as Dask names them, each a chain of ``links[i]`` steps (default 1) from its
    constant, and their total, fused as Dask's low-level fusion fuses chains (each block one task, its
    chain's keys inside)."""
    links = links or [1] * len(constants)
    dsk = {}
    for i, (c, n) in enumerate(zip(constants, links)):
        dsk[(f"a{0}-" + "0" * 32, i)] = Task((f"a{0}-" + "0" * 32, i), chain, float(c))
        for j in range(1, n + 1):
            dsk[(f"a{j}-" + "0" * 32, i)] = Task((f"a{j}-" + "0" * 32, i), twice, TaskRef((f"a{j - 1}-" + "0" * 32, i)))
    ends = [(DASK_NAMED, i) for i in range(len(constants))]
    dsk |= {k: Task(k, twice, TaskRef((f"a{n}-" + "0" * 32, k[1]))) for k, n in zip(ends, links)}
    dsk["total"] = Task("total", add_all, *(TaskRef(k) for k in ends))
    fused = fuse_linear_task_spec(dsk, ["total"])
    dsk = resolve_aliases(fused, {"total"}, rewrite.dependents_of(fused))
    assert sorted(dsk, key=str) == sorted([*ends, "total"], key=str)
    return {k: dsk[k] for k in [*ends, "total"]}


@pytest.mark.parametrize("kind", ["constant", "chain"])
def test_a_reused_plan_runs_the_tasks_of_the_compute_at_hand_under_keys_dask_named(planned, kind):
    """A plan reused runs the graph's own tasks, as Dask runs what it is given under keys it saw before
    (:func:`dask_named`'s blocks, each a chain fused into one task): another constant under the same key
    (a bag's partition changed in place; a dict that Dask's token reads in another order) is the one
    computed; a block whose chain is longer now (fused into a task of the same key and inputs) is planned
    anew."""
    constants, links = [1.0, 2.0, 3.0, 4.0], [1, 1, 1, 1]
    for _ in range(3):  # remembered at the second, reused from the third
        dsk = dask_named(constants, links)
        assert dask.get(plan(dsk), "total") == pytest.approx(4 * sum(chain(c) for c in constants))
    assert len(planned) == 2
    if kind == "constant":
        constants[1] = 40.0
    else:
        links[1] = 2
    want = sum(chain(c) * 2.0 ** (n + 1) for c, n in zip(constants, links))
    assert dask.get(plan(dask_named(constants, links)), "total") == pytest.approx(want)
    assert len(planned) == (2 if kind == "constant" else 3)  # reused; planned anew


def minus_thrice(a, b):
    return a - 3.0 * b


async def minus_thrice_later(a, b):
    return a - 3.0 * b


@pytest.mark.parametrize("change", ["order", "coroutine"])
def test_a_reused_plan_is_planned_anew_where_a_task_reads_in_another_order_or_awaits(planned, change):
    """Under the same keys, a task may read the same keys in another order, or be a coroutine function's
    (the worker awaits it: planning leaves it a task of its own): a fragment step of the plan would
    compute the other order, or return a coroutine; the graph is planned anew instead."""
    x, y, changed = "x-" + "1" * 32, "y-" + "2" * 32, 1

    def run(now):
        dsk = {(x, i): Task((x, i), float, i + 1) for i in range(4)}
        for i in range(4):
            a, b = TaskRef((x, i)), TaskRef((x, (i + 1) % 4))
            if i == changed and now == "order":
                a, b = b, a
            func = minus_thrice_later if i == changed and now == "coroutine" else minus_thrice
            dsk[(y, i)] = Task((y, i), func, a, b)
        dsk["total"] = Task("total", add_all, *(TaskRef((y, i)) for i in range(4)))
        out = plan(dsk)
        if now != "coroutine":
            assert dask.get(out, "total") == pytest.approx(dask.get(dsk, "total"))
        return out

    for _ in range(3):
        run(None)
    out = run(change)
    assert len(planned) == 3  # remembered at the second, reused at the third, planned anew at the fourth
    if change == "coroutine":  # a task of its own, as planning makes it (a plain dask.get cannot await it)
        assert out[(y, changed)].func is minus_thrice_later


def first(pair):
    return pair[0] * 1.0


@pytest.mark.parametrize("now", ["pick", "guard"])
def test_a_member_now_a_task_of_this_package_s_is_planned_anew(planned, now):
    """Planning never groups the package's own tasks (a fragment's result picked, a guard): a key that now
    holds one, reading the same keys, makes the graph plan anew rather than run it as a step."""
    def run(changed):
        dsk = {("x", i): Task(("x", i), tuple, [float(i), 1.0]) for i in range(4)}
        dsk |= {("a", i): Task(("a", i), first, TaskRef(("x", i))) for i in range(4)}
        k = ("a", 1)
        if changed == "pick":
            dsk[k] = Task(k, pick, TaskRef(("x", 1)), 0)
        elif changed == "guard":
            dsk[k] = Task(k, run_guarded, DataNode(None, k), DataNode(None, Task(k, first, TaskRef(("x", 1)))),
                          DataNode(None, (("x", 1),)), 0, TaskRef(("x", 1)))
        dsk["total"] = Task("total", add_all, *(TaskRef(("a", i)) for i in range(4)))
        marked = [("a", i) for i in range(4)]
        out = plan(dsk, marked=marked)
        assert dask.get(out, "total") == pytest.approx(6.0)
        assert_planned_anew_alike(out, dsk, marked=marked)
        return out

    for _ in range(3):
        run(None)
    assert len(planned) == 2
    out = run(now)
    assert len(planned) == 3 and ("a", 1) in out  # planned anew: a task of its own


def test_a_reused_plan_records_what_its_outputs_read_now(planned):
    """An output whose task reads other fragments' results inline (a graph grouped before) records the
    keys it read before that grouping (which keeps Dask's collision warning away when the same work comes
    again): a reused plan records those of the compute at hand."""
    done = ("octopus-fragments-" + "f" * 32, 0)

    def run(picked):
        dsk = {done: Task(done, tuple, [1.0, 2.0, 3.0])}
        dsk |= {("m", i): Task(("m", i), add_all, *(Task(("p", j), pick, TaskRef(done), j) for j in picked[i]))
                for i in range(2)}
        dsk |= {("n", i): Task(("n", i), twice, TaskRef(("m", i))) for i in range(2)}
        dsk["total"] = Task("total", add_all, *(TaskRef(("n", i)) for i in range(2)), TaskRef(("m", 0)))
        marked = [("m", 0), ("m", 1), ("n", 0), ("n", 1)]
        out = plan(dsk, marked=marked)
        assert_planned_anew_alike(out, dsk, marked=marked)
        (fragment,) = fragments(out)
        return fragment.read_before

    for _ in range(3):
        assert run([(0, 1), (0, 1)])[("m", 0)] == {("p", 0), ("p", 1)}
    assert run([(0, 2), (0, 1)])[("m", 0)] == {("p", 0), ("p", 2)}
    assert len(planned) == 2  # reused


def test_a_reused_plan_s_guard_runs_the_task_of_the_compute_at_hand(planned):
    """Tasks that two fragments read (no fragment may take them) run under guards of the plan: each the
    graph's own task under its key, whichever constant it holds now."""
    x = "x-" + "1" * 32

    def run(constants):
        dsk = {(x, j): Task((x, j), chain, c) for j, c in enumerate(constants)}
        dsk |= {(DASK_NAMED, i): Task((DASK_NAMED, i), add_all, TaskRef((x, 0)), TaskRef((x, 1)), float(i))
                for i in range(4)}
        dsk["total"] = Task("total", add_all, *(TaskRef((DASK_NAMED, i)) for i in range(4)))
        out = plan(dsk, marked=[(DASK_NAMED, i) for i in range(4)], parts={None: 2})
        assert len(fragments(out)) == 2 and sum(rewrite.is_guard(node) for node in out.values()) == 2
        assert dask.get(out, "total") == pytest.approx(4 * sum(map(chain, constants)) + 6.0)

    for _ in range(3):
        run([1.0, 5.0])
    run([1.0, 50.0])
    assert len(planned) == 2  # reused


def test_a_reused_plan_s_guard_runs_an_alias_of_the_compute_at_hand(planned):
    """An alias that two fragments read is guarded too; its plan is reused like the others."""
    def run(c):
        dsk = {"t": Task("t", chain, c), "al": Alias("al", "t")}
        dsk |= {(DASK_NAMED, i): Task((DASK_NAMED, i), add_all, TaskRef("al"), float(i)) for i in range(4)}
        dsk["total"] = Task("total", add_all, *(TaskRef((DASK_NAMED, i)) for i in range(4)))
        out = plan(dsk, marked=[(DASK_NAMED, i) for i in range(4)], parts={None: 2})
        assert len(fragments(out)) == 2 and any(rewrite.is_guard(node) for node in out.values())
        assert dask.get(out, "total") == pytest.approx(4 * chain(c) + 6.0)

    for c in [1.0, 1.0, 1.0, 2.0]:
        run(c)
    assert len(planned) == 2  # reused by the third and the fourth


@pytest.mark.parametrize("fused", [False, True])
def test_a_constant_changed_under_a_key_the_user_named_is_the_one_computed(planned, fused):
    """Keys named by the user may hold other constants from one compute to the next (Dask, having
    released the tasks, runs what it is given): a reused plan computes the constant at hand, also where
    fusion put the task inside a task of a layer Dask named."""
    runs = 0
    for changed in range(4):
        constants = [float(i) for i in range(4)]
        for now in [*[list(constants)] * 3, [c + 10.0 * (i == changed) for i, c in enumerate(constants)]]:
            dsk, marked = user_named(now, fused)
            factor = 2.0 if fused else 1.0
            got = dask.get(plan(dsk, marked=marked, keep=["total"]), "total")
            assert got == pytest.approx(factor * sum(chain(c) for c in now)), (changed, now)
            runs += 1
    assert len(planned) == 2 and runs == 16  # remembered at the second compute, reused by the others


def test_a_remembered_plan_holds_none_of_a_compute_s_data(monkeypatch):
    planned = []  # (counted, not kept: the plans made hold their computes' tasks)
    monkeypatch.setattr(rewrite, "_fragment_graph", lambda *args: planned.append(1) or REAL(*args))
    held = []
    for i in range(4):  # remembered at the second compute, reused from the third
        block = np.full(3, float(i))
        held.append(weakref.ref(block))
        dsk = {("a", j): Task(("a", j), np.multiply, block, float(j)) for j in range(4)}
        dsk["total"] = Task("total", add_all, *(TaskRef(k) for k in dsk))
        assert dask.get(plan(dsk), "total") == pytest.approx(np.full(3, 6.0 * i))
        del block, dsk
    gc.collect()
    assert len(planned) == 2 and len(plans) == 1 and [ref() is None for ref in held] == [True] * 4


def test_keys_of_mixed_types_with_block_sizes_are_remembered(planned):
    dsk = {i: Task(i, chain, float(i)) for i in range(4)} | {("s", 0): Task(("s", 0), chain, 1.0)}
    dsk["total"] = Task("total", add_all, *(TaskRef(k) for k in dsk))
    for _ in range(3):
        assert_planned_anew_alike(plan(dsk, made_bytes=block_bytes()), dsk, made_bytes=block_bytes())
    assert len(planned) == 2


def test_outputs_of_one_name_or_inside_a_fragment_are_not_remembered(planned):
    dsk = graph("a")
    dsk["also"] = Task("also", add_all, *(TaskRef(("a", i)) for i in range(4)))  # reads what "total" reads
    total = sum(chain(float(i)) for i in range(4))
    for _ in range(3):
        assert dask.get(plan(dsk, keep=["total", "also"]), ["total", "also"]) == (pytest.approx(total),) * 2
    dsk = graph("a", total="end")
    for _ in range(3):  # an output nothing reads, marked, that the caller lets join a fragment
        out = plan(dsk, keep=[], marked=list(dsk), roots=["end"])
        assert list(out) == fragments_keys(out)  # it joined the fragment
    assert len(planned) == 6 and len(plans) == 0


def fragments_keys(out):
    return [k for k in out if key_split(k) == FRAGMENT_PREFIX]


def test_a_graph_whose_form_has_no_hash_is_planned_as_usual(planned):
    dsk = graph("a")
    args = list(arguments(dsk))
    args[1] = {k: {"resource": "memory", "tags": ["unhashable"]} for k in list(dsk)[:-1]}  # marks with a list
    for _ in range(3):
        assert dask.get(fragment_graph(*args), "total") == pytest.approx(sum(chain(float(i)) for i in range(4)))
    assert len(planned) == 3 and len(plans) == 0


def test_the_least_recently_used_plans_are_dropped_first(planned):
    with dask.config.set({"octopus.fragments.plan-memo": 2}):
        for name in ["a", "b", "c", "a", "b", "a", "c", "b", "a"]:  # each planned once first, then remembered
            assert [key_split(k) for k in plan(graph(name))] == ["total", FRAGMENT_PREFIX]
    # a, b, a reused (now used last), c (b goes), b (a goes), a (c goes): five plans more
    assert len(planned) == 3 + 5 and len(plans) == 2


def test_a_user_named_constant_changed_from_zero_to_negative_zero_computes_negative_zero(planned):
    """A reviewer's case: ``map_blocks(np.multiply, c, name=...)`` computed with ``c = 0.0`` three times
    (the third reuses the plan), then with ``-0.0`` (``0.0 == -0.0``): the result has the sign bit set,
    as without annotate."""
    x = da.arange(16, chunks=4, dtype="f8")
    with dask.config.set(scheduler="sync"):
        for const in [0.0, 0.0, 0.0, -0.0]:
            with dask_octopus.annotate():
                z = x.map_blocks(np.multiply, const, name="scaled") * 1
            assert np.signbit(z.compute()).all() == np.signbit(const)
    assert len(planned) == 2  # the second's plan reused by the third and the fourth


def guarded(i):
    """The guard test's graph on the data of compute ``i``, its layers named anew each time as Dask names
    them (prefix and token): the same shape under new keys; its total's key and expected value."""
    token = f"{i:032x}"
    x, a, total = f"x-{token}", f"add_all-{token}", f"total-{token}"
    dsk = {(x, j): Task((x, j), chain, c + i) for j, c in enumerate([1.0, 5.0])}
    dsk |= {(a, k): Task((a, k), add_all, TaskRef((x, 0)), TaskRef((x, 1)), float(k)) for k in range(4)}
    dsk[total] = Task(total, add_all, *(TaskRef((a, k)) for k in range(4)))
    return dsk, [(a, k) for k in range(4)], total, 4 * (chain(1.0 + i) + chain(5.0 + i)) + 6.0


def test_a_plan_is_reused_renamed_for_new_keys_of_the_same_shape(planned):
    """The same work on new data comes under new keys (Dask names each layer by a token of what it
    computes): the plan is reused renamed, the fragments and guards that planning anew makes, under keys
    of their own each compute (two computes in flight share none), computing the values at hand."""
    plan_keys = set()
    for i in range(5):
        dsk, marked, total, expected = guarded(i)
        out = plan(dsk, marked=marked, parts={None: 2})
        assert dask.get(out, total) == pytest.approx(expected)
        want, _, _ = REAL(*arguments(dsk, marked=marked, parts={None: 2}))
        assert [(f.members, f.outputs, f.names, f.covers) for f in fragments(out)] == \
            [(f.members, f.outputs, f.names, f.covers) for f in fragments(want)]
        made = [k for k, node in out.items() if rewrite.fragment_of(node) or rewrite.is_guard(node)]
        assert len(made) == 4 and not plan_keys & set(made)
        plan_keys |= set(made)
    assert len(planned) == 2  # remembered at the second compute, reused renamed by the others


def test_layers_are_named_by_their_shape_where_no_two_share_a_name():
    from dask_octopus.groups.memo import layer_names

    def graph_of(token, second="g"):
        dsk = {(f"f-{token}", j): Task((f"f-{token}", j), chain, TaskRef(("x", j))) for j in range(2)}
        return dsk | {(f"{second}-{token}", j): Task((f"{second}-{token}", j), chain, TaskRef(("x", j)))
                      for j in range(2)}

    one, two = layer_names(graph_of("1" * 32)), layer_names(graph_of("2" * 32))
    assert one["x"] == two["x"] == one["x"] and one["f-" + "1" * 32] == two["f-" + "2" * 32] != one["x"]
    assert one["g-" + "1" * 32] == two["g-" + "2" * 32] != one["f-" + "1" * 32]
    same = graph_of("1" * 32, second="f-0")  # two layers of one prefix reading the same layer alike
    assert layer_names(same) == {layer: layer for layer in ["f-" + "1" * 32, "f-0-" + "1" * 32, "x"]}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_computes_of_new_data_reuse_the_plan_renamed_also_in_flight_at_once(c, s, a, planned):
    """A loop over new data (new blocks persisted, the chain named anew): the plan of the second compute is
    reused renamed by the others, fused blocks included; two computes of other data in flight at once
    get fragment tasks of their own and each its own values."""
    await setup(c, s, [1.0])
    data = [np.arange(64 * 6, dtype=float).reshape(64, 6) + 100.0 * i for i in range(4)]
    xs = [await c.persist(da.from_array(d, chunks=(4, 6))) for d in data]
    await wait(xs)

    def collection(i, x):
        return x.map_blocks(chain, name=f"chain-{i}").sum(axis=1)

    for i in range(3):
        with dask_octopus.annotate():
            got = await c.compute(collection(i, xs[i % 2]))
        np.testing.assert_array_equal(got, chain(data[i % 2]).sum(axis=1))
    assert len(planned) == 2  # remembered at the second compute, reused renamed by the third
    with dask_octopus.annotate():
        both = [c.compute(collection(3, xs[2])), c.compute(collection(4, xs[3]))]  # two graphs, both sent
    got = await c.gather(both)
    for values, d in zip(got, data[2:]):
        np.testing.assert_array_equal(values, chain(d).sum(axis=1))
    assert len(planned) == 2


def read_through_alias(i):
    """Compute ``i``'s graph: four marked tasks read a persisted block ``(P, 0)`` (held by the scheduler,
    not in the graph) through an alias that planning reads through, and a second output is a task under
    the key ``P`` itself, a name like the block's layer; the arguments of ``fragment_graph``."""
    t = f"{i:032x}"
    p, al, m, total = f"P-{t}", f"al-{t}", f"m-{t}", f"total-{t}"
    dsk = {(al, 0): Alias((al, 0), (p, 0))}
    dsk |= {(m, j): Task((m, j), add_all, TaskRef((al, 0)), float(j)) for j in range(4)}
    dsk[total] = Task(total, add_all, *(TaskRef((m, j)) for j in range(4)))
    dsk[p] = Task(p, chain, 3.0)
    args = list(arguments(dsk, keep=[total, p], marked=[(m, j) for j in range(4)]))
    args[12] = {(al, 0)}  # read_through
    return args, p, total


def test_a_renamed_plan_reads_the_block_of_the_compute_at_hand_through_its_alias(planned):
    """A reviewer's case: the fragment task reads the block an alias names, not the alias; renamed for
    new keys, it reads the block of the compute at hand, also where an output is named like that
    block's layer (which named the plan's layers otherwise: the previous compute's block was read)."""
    held = {}
    for i in range(4):
        args, p, total = read_through_alias(i)
        held[(p, 0)] = 100.0 * (i + 1)  # every compute's block held, as a scheduler holds persisted ones
        out = fragment_graph(*args)
        assert [ref.key for f in out.values() if rewrite.fragment_of(f) for ref in f.args[1:]] == [(p, 0)]
        assert dask.get({**held, **out}, total) == dask.get({**held, **args[0]}, total) == 4 * held[(p, 0)] + 6
    assert len(planned) == 2


def test_two_shapes_of_one_outline_under_new_keys_are_each_remembered_and_reused(planned):
    """Graphs of one outline (as many layers of each prefix, as many keys) but two shapes, alternating
    under new keys: each shape's plan is remembered at its second compute and reused renamed after."""
    def shaped(i, shape):
        t = f"{i:032x}"
        x, a, total = f"x-{t}", f"add_all-{t}", f"total-{t}"
        dsk = {(x, j): Task((x, j), chain, 1.0 + j + i) for j in range(2)}
        dsk |= {(a, k): Task((a, k), add_all, *([TaskRef((x, 0)), TaskRef((x, 1))] if shape == "A"
                                                 else [TaskRef((x, k % 2))]), float(k)) for k in range(4)}
        dsk[total] = Task(total, add_all, *(TaskRef((a, k)) for k in range(4)))
        return dsk, [(a, k) for k in range(4)], total

    for i in range(12):
        dsk, marked, total = shaped(i, "AB"[i % 2])
        assert dask.get(plan(dsk, marked=marked, parts={None: 2}), total) == pytest.approx(dask.get(dsk, total))
    assert len(planned) == 4 and len(plans) == 2


def test_a_plan_whose_fragment_reads_what_an_alias_no_longer_names_is_stale():
    """A fragment task reads the block an alias names in place of the alias: where the alias of the
    compute at hand names another block, the plan is stale (planned anew), not run on the old block."""
    args, _, _ = read_through_alias(0)
    (node,) = [n for n in fragment_graph(*args).values() if rewrite.fragment_of(n)]
    layout = rewrite._fresh(node)
    (alias,) = [k for k, n in args[0].items() if type(n) is Alias]
    assert rewrite._fresh(layout, args[0], {}).args[1:] == node.args[1:]  # as planned: fresh
    with pytest.raises(rewrite.Stale, match="no longer names"):
        rewrite._fresh(layout, {**args[0], alias: Alias(alias, ("other", 0))}, {})


def test_a_cycle_of_aliases_makes_a_plan_stale_rather_than_hang():
    dsk = {"a": Alias("a", "b"), "b": Alias("b", "a")}
    with pytest.raises(rewrite.Stale, match="no longer names"):
        rewrite._check_given(dsk, ["a"], [TaskRef(("x", 0))])
    rewrite._check_given(dsk, ["a"], [TaskRef("a")])  # the key itself: fine
