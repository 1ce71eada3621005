"""Fragments on random programs (hypothesis): every output as without ``annotate``.

Random low-level graphs with aliases (of inputs, of tasks, of aliases) and special tasks, rewritten by
``fragment_graph`` itself; random DAGs of delayed calls (some built inside ``annotate``, or all computed
inside it), with a node that raises, aliases and persisted nodes, some outputs cancelled as they run;
random chains of dask array operations
(elementwise, tree reductions, transposes, slices, rechunks, cumulative sums, overlaps) over in-memory
or persisted blocks; and random dask dataframe programs (partition-wise steps, filters, groupby
aggregations, cumulative sums, and Dask's P2P shuffles: ``shuffle``, ``set_index``, ``merge``). Computed
on a local scheduler (the optimizer makes the fragments) and on an in-process cluster with the scheduler
plugin (the plugin makes them, where the tasks will run); each output is compared with the same program
computed without ``annotate`` by the synchronous scheduler: its value, or the exception it raises. The
tests on a scheduler or cluster also check that fragments were made. The examples are derandomized: the
same ones each run, so that the suite's time and outcome do not vary.
"""

import contextlib
import itertools
import time

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Client, LocalCluster, wait
from hypothesis import HealthCheck, example, given, reject, settings
from hypothesis import strategies as st
from test_fragments import Barrier, alias_of

import dask_octopus
from dask_octopus._compat import Alias, Task, TaskRef
from dask_octopus.groups import marks
from dask_octopus.groups import scheduler as grouping
from dask_octopus.groups.rewrite import dependents_of, fragment_graph, fragment_of

EXAMPLES = settings(max_examples=100, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


class Boom(ValueError):
    pass


def combine(fail, c, *xs):
    """``c`` plus a weighted sum of ``xs`` (so that the order of the inputs counts), or :class:`Boom`."""
    if fail:
        raise Boom(f"node {c}")
    return c + sum((i + 1) * x for i, x in enumerate(xs)) % 1000003


@st.composite
def programs(draw):
    """Nodes ``(dependencies, built inside annotate, constant, an alias)`` of a DAG (an alias names its
    first dependency, else the node before it), the outputs asked for, the ``group`` cap and the node
    that raises (or ``None``)."""
    n = draw(st.integers(1, 25))
    nodes = [(sorted(draw(st.sets(st.integers(0, k - 1), max_size=3))) if k else [], draw(st.booleans()),
              draw(st.integers(0, 9)), k > 0 and draw(st.integers(0, 4)) == 0) for k in range(n)]
    outputs = sorted(draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=4)))
    group = draw(st.one_of(st.none(), st.integers(1, 4)))
    failing = draw(st.one_of(st.none(), st.integers(0, n - 1)))
    return nodes, outputs, group, failing


def napping_combine(nap, salt, *args):
    """:func:`combine` after ``nap`` seconds (``salt`` makes the key another)."""
    time.sleep(nap)
    return combine(*args)


def build(nodes, outputs, group, marked, failing=None, persist=None, naps=None, salt=None):
    """The delayed outputs of a program; nodes marked where ``marked`` says so, the nodes of ``persist``
    (a client and node indices) persisted on its cluster; with ``naps``, node ``k`` sleeps ``naps[k]``
    seconds first and ``salt`` is part of every key."""
    made = []
    for k, (deps, mark, c, alias) in enumerate(nodes):
        args = (k == failing, 100 * c + k, *(made[d] for d in deps))
        target = made[_reads(nodes, k)[0]] if alias else None
        with dask_octopus.annotate(group=group) if marked and mark else contextlib.nullcontext():
            if alias:
                node = alias_of(target, f"alias-{k}-{target.key}")
            elif naps is None:
                node = dask.delayed(combine, pure=True)(*args)
            else:
                node = dask.delayed(napping_combine, pure=True)(naps[k], salt, *args)
        if persist is not None and k in persist[1]:
            node = persist[0].persist(node)
        made.append(node)
    return [made[o] for o in outputs]


@st.composite
def aliased_graphs(draw):
    """A low-level graph of up to 20 nodes over up to 3 inputs that exist already: tasks (some special),
    each reading up to three earlier nodes or inputs, and aliases of one; the keys asked for, the tasks
    to run as fragments and the places of each, the aliases to read through, the keys that may be pulled
    into fragments (``None``: any), the inputs' bytes and a budget per place."""
    n_in = draw(st.integers(0, 3))
    graph: dict = {}
    for k in range(draw(st.integers(1, 20))):
        key, pool = ("n", k), [("in", i) for i in range(n_in)] + list(graph)
        kind = draw(st.sampled_from(["task", "task", "alias", "alias", "special"]))
        if kind == "alias" and pool:
            graph[key] = Alias(key, draw(st.sampled_from(pool)))
        else:
            reads = sorted(draw(st.sets(st.sampled_from(pool), max_size=3))) if pool else []
            graph[key] = (Barrier if kind == "special" else Task)(key, combine, False, k, *map(TaskRef, reads))
    keys = sorted(graph)
    keep = sorted(draw(st.sets(st.sampled_from(keys), min_size=1, max_size=3)))
    marked = {k for k in keys if draw(st.integers(0, 3))}  # most
    through = {k for k in keys if draw(st.booleans())}
    places = {k: draw(st.sampled_from(["w0", "w1", None])) for k in marked}
    parts = {p: draw(st.integers(1, 3)) for p in ("w0", "w1", None)}
    pullable = draw(st.one_of(st.none(), st.sets(st.sampled_from(keys)).map(lambda p: p | marked)))
    sizes = {("in", i): draw(st.integers(0, 100)) for i in range(n_in)}
    budgets = {p: draw(st.one_of(st.none(), st.integers(1, 300))) for p in ("w0", "w1", None)}
    return graph, n_in, keep, marked, through, places, parts, pullable, sizes, budgets


@given(aliased_graphs())
@example((  # an alias read through (A1), read by one that is not (A2), which a fragment reads: A1 stays for A2
    {"A1": Alias("A1", ("in", 0)), "A2": Alias("A2", "A1"), "m1": Task("m1", combine, False, 1, TaskRef("A2")),
     "m2": Task("m2", combine, False, 2, TaskRef("m1")), "out": Task("out", combine, False, 3, TaskRef("m2"))},
    1, ["out"], {"m1", "m2"}, {"A1"}, {}, {None: 1}, None, {}, {}))
@settings(EXAMPLES, max_examples=200)
def test_random_graphs_with_aliases_give_every_asked_key_s_value_after_the_rewrite(graph):
    """``fragment_graph`` over any graph with aliases (of inputs, tasks, special tasks and aliases; each
    read through or not): the keys asked for are tasks of the result with the graph's values, and every
    key the result reads is one of its tasks or an input (the plugin forgets the others). An alias read
    through by fragments stays where an alias that is not read through reads it."""
    graph, n_in, keep, marked, through, places, parts, pullable, sizes, budgets = graph
    inputs = {("in", i): 10 * i + 1 for i in range(n_in)}
    out = fragment_graph(graph, {k: {"resource": "memory"} for k in marked}, keep, dependents_of(graph), places,
                         parts, pullable, sizes=sizes, budgets=budgets,
                         read_through={k for k in through if type(graph[k]) is Alias})
    assert set(keep) <= out.keys()
    assert {d for node in out.values() for d in node.dependencies} <= out.keys() | inputs.keys()
    assert dask.get({**out, **inputs}, keep) == dask.get({**graph, **inputs}, keep)


def outcome_alone(value):
    """The value of a collection computed by the synchronous scheduler, or ``("error", type name)``."""
    try:
        return dask.compute(value, scheduler="sync")[0]
    except Boom:
        return ("error", "Boom")


def outcomes(client, values, apart=False):
    """The value of each collection computed on the cluster, or ``("error", type name)``; ``apart``: each
    by a compute of its own, all in flight at once (sharing the tasks they have in common)."""
    futures = [client.compute(v) for v in values] if apart else client.compute(values)
    wait(futures)
    return [("error", type(f.exception()).__name__) if f.status == "error" else f.result() for f in futures]


class Counted:
    """Counts the fragments made by a module's ``fragment_graph``."""

    def __init__(self, module, monkeypatch):
        self.made = 0
        inner = module.fragment_graph

        def counted(*args, **kwargs):
            out = inner(*args, **kwargs)
            self.made += sum(fragment_of(node) is not None for node in out.values())
            return out

        monkeypatch.setattr(module, "fragment_graph", counted)


@pytest.fixture(scope="module")
def cluster_client():
    with (LocalCluster(n_workers=2, threads_per_worker=2, processes=False, dashboard_address=":0") as cluster,
          Client(cluster) as client):
        dask_octopus.register(client, calibrate=False)
        yield client


@pytest.fixture(scope="module")
def fragments_made_on_the_scheduler():
    """Fragments made by the scheduler plugin over one module's examples (checked at its end)."""
    with pytest.MonkeyPatch.context() as mp:
        counted = Counted(grouping, mp)
        yield counted
    assert counted.made > 0


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_random_delayed_programs_give_every_output_on_a_local_scheduler(scheduler, monkeypatch):
    counted = Counted(marks, monkeypatch)

    @given(programs())
    @EXAMPLES
    def check(program):
        nodes, outputs, group, _ = program
        expected = dask.compute(*build(nodes, outputs, group, marked=False), scheduler=scheduler)
        assert dask.compute(*build(nodes, outputs, group, marked=True), scheduler=scheduler) == expected

    check()
    assert counted.made > 0


@given(programs(), st.booleans(), st.data())
@EXAMPLES
def test_random_delayed_programs_give_every_output_or_its_error_on_a_cluster(
        cluster_client, fragments_made_on_the_scheduler, program, whole, data):
    """Built with some nodes inside ``annotate``, or computed inside it; up to two nodes persisted first;
    the outputs computed together or each by a compute of its own, at once; the outputs that read the
    failing node raise its error, the others are exact."""
    nodes, outputs, group, failing = program
    persisted = data.draw(st.sets(st.integers(0, len(nodes) - 1), max_size=2))
    apart = data.draw(st.booleans())
    expected = [outcome_alone(v) for v in build(nodes, outputs, group, marked=False, failing=failing)]
    values = build(nodes, outputs, group, marked=not whole, failing=failing, persist=(cluster_client, persisted))
    with dask_octopus.annotate(group=group) if whole else contextlib.nullcontext():
        got = outcomes(cluster_client, values, apart)
    assert got == expected


def _read_by_another(nodes, outputs):
    """The outputs (indices into ``outputs``) that another output reads, directly or not."""
    read, todo = set(), [d for o in outputs for d in _reads(nodes, o)]
    while todo:
        k = todo.pop()
        if k not in read:
            read.add(k)
            todo.extend(_reads(nodes, k))
    return {i for i, o in enumerate(outputs) if o in read}


def _reads(nodes, k):
    """The nodes that node ``k`` reads: an alias names its first dependency, else the node before it."""
    deps, _, _, alias = nodes[k]
    return (deps[:1] or [k - 1]) if alias else deps


SALTS = itertools.count()


def test_random_delayed_programs_with_outputs_cancelled_as_they_run_leave_the_others_exact_and_nothing_held(
        cluster_client, fragments_made_on_the_scheduler):
    """Outputs computed apart at once, nodes taking some milliseconds, some outputs cancelled (those no
    other output reads: Dask's own cancel fails on a dependent no client wants), some of them as they
    run (counted): the others exact; the program computed again (new keys) exact; and once the futures
    are let go the scheduler holds no task of theirs."""
    scheduler = cluster_client.cluster.scheduler
    running = []  # cancels of futures still pending at the time

    @given(programs(), st.booleans(), st.data())
    @settings(EXAMPLES, max_examples=40)
    def check(program, whole, data):
        nodes, outputs, group, failing = program
        naps = data.draw(st.lists(st.sampled_from([0, 0, 0.002, 0.01]), min_size=len(nodes), max_size=len(nodes)))
        alone = sorted(set(range(len(outputs))) - _read_by_another(nodes, outputs))
        cancel = data.draw(st.sets(st.sampled_from(alone)) if alone else st.just(set()))
        delay = data.draw(st.sampled_from([0, 0.002, 0.01]))
        expected = [outcome_alone(v) for v in build(nodes, outputs, group, marked=False, failing=failing)]
        before = set(scheduler.tasks)
        # the second time with new keys: Dask's report of the cancelled keys may reach the client after it
        # computed the same keys again, and cancel those futures too
        for salt, cancelled in ((next(SALTS), cancel), (next(SALTS), set())):
            values = build(nodes, outputs, group, marked=not whole, failing=failing, naps=naps, salt=salt)
            with dask_octopus.annotate(group=group) if whole else contextlib.nullcontext():
                futures = [cluster_client.compute(v) for v in values]
            time.sleep(delay)
            running.extend(futures[i].status == "pending" for i in cancelled)
            cluster_client.cancel([futures[i] for i in cancelled])
            wait([f for i, f in enumerate(futures) if i not in cancelled], timeout=30)
            got = [("error", type(f.exception()).__name__) if f.status == "error" else f.result()
                   for i, f in enumerate(futures) if i not in cancelled]
            assert got == [e for i, e in enumerate(expected) if i not in cancelled]
            del futures, values
        deadline = time.monotonic() + 10
        while set(scheduler.tasks) - before:
            assert time.monotonic() < deadline, (set(scheduler.tasks) - before)
            time.sleep(0.02)

    check()
    assert sum(running) >= 5, running  # (the derandomized examples: 20 of 22 cancels hit a pending future)


def _overlap(b):
    return b + np.roll(b, 1, axis=0)


def apply(x, op, c):
    """``x`` after the array operation ``op`` (with the constant ``c``); ``x`` where ``op`` does not fit."""
    if op == "add":
        return x + c
    if op == "mul":
        return x * (c % 3 + 1) - c
    if op == "map_blocks":
        return x.map_blocks(np.multiply, c + 1, dtype=x.dtype)
    if op == "mean":
        return x.mean(axis=-1, keepdims=True)
    if op == "max":
        return x.max(axis=0, keepdims=True)
    if op == "slice":
        return x[::2] if x.shape[0] > 2 else x
    if op == "rechunk":
        return x.rechunk(max(1, x.shape[0] // 3))
    if op == "sum0":
        return x.sum(axis=0, keepdims=True)
    if op == "sum1":
        return x.sum(axis=1, keepdims=True)
    if op == "T":
        return x.T
    if op == "plusT" and x.shape[0] == x.shape[1]:
        return x + x.T
    if op == "cumsum0":
        return x.cumsum(axis=0)
    if op == "overlap" and min(min(c_) for c_ in x.chunks) >= 2:
        return x.map_overlap(_overlap, depth=1, boundary="none", dtype=x.dtype)
    return x


OPS = ["add", "mul", "map_blocks", "mean", "max", "slice", "rechunk", "sum0", "sum1", "T", "plusT", "cumsum0",
       "overlap"]


@given(st.integers(2, 12), st.integers(1, 5), st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 9)),
                                                       min_size=1, max_size=6),
       st.sampled_from(["whole compute", "built inside", "persisted input", "balanced input"]),
       st.one_of(st.none(), st.integers(1, 4)))
@EXAMPLES
def test_random_array_programs_give_the_unannotated_values_on_a_cluster(
        cluster_client, fragments_made_on_the_scheduler, side, chunk, ops, how, group):
    """A square integer array in blocks of ``chunk`` through up to six operations: annotated around the
    whole compute, around building the program only (the README pattern: what reads the marked blocks
    joins them), or computed inside ``annotate`` over persisted blocks or over blocks ``balance`` planned
    (its pins and renamed blocks beside the fragments)."""
    data = np.arange(side * side, dtype=np.int64).reshape(side, side)

    def program(x):
        for op, c in ops:
            x = apply(x, op, c)
        return x

    x = da.from_array(data, chunks=chunk)
    if how == "persisted input":
        x = cluster_client.persist(x)
    if how == "balanced input":
        x = dask_octopus.balance(x, client=cluster_client, per_worker=1)
    # (some operations depend on the blocks: the reference is in the blocks the program gets)
    expected = program(da.from_array(data, chunks=x.chunks)).compute(scheduler="sync")
    if how == "built inside":
        with dask_octopus.annotate(group=group):
            y = program(x)
        got = cluster_client.compute(y).result()
    else:
        with dask_octopus.annotate(group=group):
            got = cluster_client.compute(program(x)).result()
    np.testing.assert_array_equal(got, expected)


def _shift(part, c):
    return part.assign(a=part.a + c)


def apply_frame(df, op, c):
    """``df`` after the dataframe operation ``op`` (with the constant ``c``). The shuffles (``shuffle``,
    ``set_index`` with its divisions given, ``merge``) run as Dask's P2P on the cluster, whose special
    tasks stay out of fragments: ``set_index`` without divisions would compute them while the graph is
    built, and an in-process scheduler can then deadlock on Python 3.11 (its ``functools.cached_property``
    lock is one per property, held by the client's thread while the scheduler's thread needs it)."""
    if op == "map_partitions":
        return df.map_partitions(_shift, c)
    if op == "filter":
        return df[df.b % 3 != c % 3]
    if op == "assign":
        return df.assign(b=df.b * 2 + c)
    if op == "groupby sum":
        return df.groupby("k").a.sum().to_frame().reset_index().assign(b=c)
    if op == "groupby agg":
        return df.groupby("k").agg({"a": "sum", "b": "max"}).reset_index()
    if op == "cumsum":
        return df.assign(a=df.a.cumsum())
    if op == "shuffle":
        return df.shuffle("k")
    if op == "set_index":
        return df.set_index("b", divisions=[-10**9, 3, 10**9]).reset_index()
    other = pd.DataFrame({"k": np.arange(5), "w": np.arange(5) * 10 + c})
    return df.merge(dd.from_pandas(other, npartitions=2), on="k", how="left").drop(columns="w")


FRAME_OPS = ["map_partitions", "filter", "assign", "groupby sum", "groupby agg", "cumsum", "shuffle", "set_index",
             "merge"]


def _in_order(value):
    """A dataframe's rows sorted by all its columns (shuffles deal them out in another order)."""
    if isinstance(value, pd.DataFrame):
        return value.sort_values(list(value.columns)).reset_index(drop=True)
    return value


@given(st.integers(1, 120), st.integers(1, 6),
       st.lists(st.tuples(st.sampled_from(FRAME_OPS), st.integers(0, 9)), min_size=1, max_size=4),
       st.sampled_from(["frame", "sum", "mean"]), st.sampled_from(["in memory", "persisted", "balanced"]))
@settings(EXAMPLES, max_examples=60)
def test_random_dataframe_programs_give_the_unannotated_values_on_a_cluster(
        cluster_client, fragments_made_on_the_scheduler, rows, partitions, ops, result, given):
    """A pandas-backed dask dataframe (from memory, persisted, or balanced by ``balance``) through up to
    four operations, the frame or a sum or mean asked for, computed inside ``annotate`` (the plugin makes
    the fragments in ``update_graph``): the same rows and values as the synchronous scheduler without
    ``annotate``."""
    data = pd.DataFrame({"a": np.arange(rows, dtype=np.int64), "b": np.arange(rows) % 7, "k": np.arange(rows) % 5})

    def program(df):
        for op, c in ops:
            df = apply_frame(df, op, c)
        return df if result == "frame" else df.a.sum() if result == "sum" else df.b.mean()

    df = reference = dd.from_pandas(data, npartitions=partitions)
    if given == "persisted":
        df = cluster_client.persist(df)
    if given == "balanced" and rows >= 2:  # (a row for each of the two workers)
        df = dask_octopus.balance(df, client=cluster_client, per_worker=1)
        # in the same partitions: a shuffle deals rows out by partition, and a cumulative sum follows their order
        ends = np.cumsum([0, *cluster_client.compute(df.map_partitions(len)).result()])
        reference = dd.from_delayed([dask.delayed(data.iloc[a:b]) for a, b in itertools.pairwise(ends)],
                                    meta=data.iloc[:0], divisions=df.divisions if df.known_divisions else None)
    with dask.config.set({"dataframe.shuffle.method": "tasks"}):  # (P2P needs a cluster)
        try:
            expected = _in_order(program(reference).compute(scheduler="sync"))
        except AssertionError as e:  # dask-expr's own, without dask_octopus: a program Dask cannot run
            assert "Mismatched divisions" in str(e), e  # (set_index with divisions, then a filter)
            reject()
    with dask_octopus.annotate():
        got = _in_order(cluster_client.compute(program(df)).result())
    if isinstance(expected, pd.DataFrame):
        pd.testing.assert_frame_equal(got, expected)
    else:
        assert got == expected or (np.isnan(got) and np.isnan(expected))
