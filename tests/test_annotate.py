"""dask_octopus.annotate: grouped results equal ungrouped ones, with fewer tasks, fusion on; faults; bad input."""

import asyncio
import warnings

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from dask._task_spec import Alias
from dask.core import flatten
from dask.utils import key_split
from distributed import Event, Nanny, wait
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.utils_test import async_poll_for, captured_logger, gen_cluster
from test_balance import RESUME, WhereRan, mid_compute, run_balance, setup, slow_copy

import dask_octopus
from dask_octopus.groups import marks, streams
from dask_octopus.groups.rewrite import FRAGMENT_PREFIX, inner_keys, replaced_keys
from dask_octopus.plugins.scheduler import OctopusSchedulerPlugin


def f(b):
    return np.sqrt(b + 1.0)


def ran(rec, prefix):
    return [k for k in rec.worker if isinstance(k, tuple) and str(k[0]).startswith(prefix)]


def with_root(d):
    return d.assign(c=np.sqrt(d.a + 1.0))


def held_inputs(ts):
    """The tasks whose results ``ts`` reads, through dask-expr's alias tasks."""
    return [i for d in ts.dependencies
            for i in (held_inputs(d) if isinstance(d.run_spec, Alias) and d.state == "released" else [d])]


class GroupLog(SchedulerPlugin):
    """Each group task that ran: its members, its worker, and the workers that held its inputs."""

    name = "group-log"

    @classmethod
    def on(cls, scheduler):
        """A new log, added to ``scheduler``."""
        log = cls(scheduler)
        scheduler.add_plugin(log)
        return log

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.groups = {}
        self.covers = {}  # group: the keys whose work it did (members and the keys fused into them)
        self.inputs_at_grouping = {}  # group: workers holding its inputs, for groups of in-memory inputs
        self.reads = {}  # group: how many values it read

    def update_graph(self, scheduler, **kwargs):
        for key, ts in scheduler.tasks.items():
            inputs = held_inputs(ts)
            if key_split(key) == FRAGMENT_PREFIX and inputs and all(d.state == "memory" for d in inputs):
                self.inputs_at_grouping.setdefault(key, {ws.address for d in inputs for ws in d.who_has})

    def transition(self, key, start, finish, *args, **kwargs):
        if start == "processing" and finish == "memory" and key_split(key) == FRAGMENT_PREFIX:
            ts = self.scheduler.tasks[key]
            holders = {ws.address for d in ts.dependencies for ws in d.who_has or ()}
            self.groups[key] = (replaced_keys(ts.run_spec), kwargs["worker"], holders)
            self.covers[key] = inner_keys(key, ts.run_spec)
            self.reads[key] = len(ts.run_spec.args[0].value.inputs)  # the values it received


async def root_sum_in_groups(c, df, group):
    """``sqrt(a + 1)`` summed over ``df``'s partitions, computed inside ``annotate(group=group)``."""
    with dask_octopus.annotate(group=group):
        return await c.compute(df.map_partitions(with_root).c.sum())


async def forgotten(s):
    """Wait until the scheduler holds no task: nothing the rewrite made or left behind leaks."""
    while s.tasks:
        await asyncio.sleep(0.01)


@pytest.fixture
def x():
    return da.random.default_rng(0).random((64 * 8, 6), chunks=(8, 6))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_grouped_reduction_is_exact_with_fewer_tasks(c, s, a, x):
    assert dask.config.get("optimization.fuse.active") is not False  # Dask's default: fusion on
    rec = WhereRan()
    s.add_plugin(rec)
    expected = await c.compute(x.map_blocks(f).sum(axis=0))
    plain = len(rec.worker)
    rec.worker.clear()
    x = x + 0  # new keys: the grouped graph must not collide with the released plain one
    with dask_octopus.annotate(resource="memory", group=8):
        y = x.map_blocks(f)
    got = await c.compute(y.sum(axis=0))
    assert np.array_equal(got, expected)
    assert len(ran(rec, FRAGMENT_PREFIX)) == 8  # 64 blocks, 8 to a group
    assert len(rec.worker) < plain - 50  # the 64 block tasks became 8


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_grouped_blocks_keep_their_keys_for_gather_persist_and_other_consumers(c, s, a, b, x):
    plain = x.map_blocks(f)  # computed locally: the same keys must not be in flight twice
    ref, gram = plain.compute(scheduler="sync"), (plain.T @ plain).compute(scheduler="sync")
    log = GroupLog.on(s)
    with dask_octopus.annotate(group=4):
        y = x.map_blocks(f)
    assert np.array_equal(await c.compute(y), ref)  # the blocks are the output (read by finalize)
    assert np.array_equal(await c.compute(y.T @ y), gram)  # two consumers of each block
    # they ran in fragments of at most 4 blocks (with what reads only them)
    assert log.groups and all(1 <= sum(key_split(k) == "f" for k in covers) <= 4 for covers in log.covers.values())
    yp = c.persist(y)
    await wait(yp)
    assert all(s.tasks[k].state == "memory" for k in flatten(yp.__dask_keys__()))  # each block under its key
    assert np.array_equal(await c.compute(yp[::3]), ref[::3])


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_delayed_tasks_group_and_stay_exact(c, s, a):
    rec = WhereRan()
    s.add_plugin(rec)
    items = [np.arange(n, dtype=float) for n in range(1, 40)]
    with dask_octopus.annotate(resource="compute", group=5):
        parts = [dask.delayed(np.cumsum)(it) for it in items]
    total = dask.delayed(sum)([p[-1] for p in parts])
    assert await c.compute(total) == sum(np.cumsum(it)[-1] for it in items)
    assert len(ran(rec, FRAGMENT_PREFIX)) == 8  # 39 members: 7 groups of 5 and one of 4


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_groups_of_balanced_blocks_run_where_their_blocks_are(c, s, a, b):
    """With the plugin registered the optimizer only marks, and the plugin groups knowing the pins:
    8 blocks in groups of 8 make one group per worker, not one group of all (which would move half
    the blocks and undo the balance)."""
    await setup(c, s, [3.0, 1.0])
    log = GroupLog.on(s)
    x = da.random.default_rng(1).random((4000, 8), chunks=(100, 8))
    xb = await run_balance(c, x, per_worker=4)
    xb = c.persist(xb)
    await c.compute(xb.sum())
    with dask_octopus.annotate(group=8):
        y = xb.map_blocks(f)
    got = await c.compute(y.sum())
    assert got == pytest.approx(float(await c.compute(x.map_blocks(f).sum())), rel=1e-12)
    assert {w for _, w, _ in log.groups.values()} == set(s.workers)
    # one fragment per worker: it reads its 4 blocks (and runs their partial sums)
    assert sorted(log.reads.values()) == [4, 4]
    for members, worker, holders in log.groups.values():
        assert holders == {worker}, members


def test_auto_class_is_measured_once_and_remembered():
    block = np.ones(2**20)
    rt = streams.StreamRuntime(bandwidth=1e10)
    assert rt.resolve_class("auto", "probe-fn", [block]) is None
    assert rt.classify("probe-fn", [block], block, seconds=1e-4) == "memory"  # 16 GB/s
    assert rt.resolve_class("auto", "probe-fn", [block]) == "memory"
    assert rt.classify("slow-fn", [block], block, seconds=10.0) == "compute"
    assert rt.resolve_class("compute", "probe-fn", [block]) == "compute"  # declared wins


def test_marked_outputs_not_grouped_yet_keep_their_marks():
    """Marked tasks that the optimizer does not group now (the outputs asked for) keep their marks on the
    optimized graph: Dask optimizes a collection again where it becomes an input of another one (delayed
    arguments), and the scheduler plugin groups by them."""
    with dask_octopus.annotate():
        x = da.ones(8, chunks=2) + 1
        y = x * 2
    optimized = y.__dask_optimize__(y.__dask_graph__(), y.__dask_keys__())
    (layer,) = optimized.layers.values()
    assert set(layer.annotations["octopus"]) == set(flatten(y.__dask_keys__()))


def test_the_member_classes_kept_are_those_used_last():
    block = np.ones(16)
    rt = streams.StreamRuntime(max_classes=2, bandwidth=1e10)
    rt.classify("a", [block], block, seconds=1.0)
    rt.classify("b", [block], block, seconds=1.0)
    assert rt.resolve_class("auto", "a", [block]) == "compute"  # a used again: b is now the oldest
    rt.classify("c", [block], block, seconds=1e-12)
    assert [rt.resolve_class("auto", t, [block]) for t in "abc"] == ["compute", None, "memory"]


def test_members_return_in_their_order_whatever_the_launch_order():
    launched = []

    def member(i):
        launched.append(i)
        return i * 10

    inputs = [[i, np.ones(n)] for i, n in enumerate((1, 400, 20, 300))]
    out = streams.run_group([lambda i, _: member(i)] * 4, inputs, ["memory", "compute", "compute", "memory"], list)
    assert out == [0, 10, 20, 30]
    assert launched == [1, 3, 2, 0]  # compute (most work) first, alternating, largest first


@pytest.mark.parametrize("kwargs, message", [
    ({"resource": "disk"}, "unknown resource 'disk'"),
    ({"resource": "disk"}, "expected one of auto, compute, memory"),
    ({"group": 0}, "group must be None or an integer >= 1"),
    ({"group": "8"}, "group must be None or an integer >= 1"),
    ({"resource": np.array(["compute", "memory"])}, "unknown resource array"),
])
def test_bad_annotations(kwargs, message):
    with pytest.raises(ValueError, match=message), dask_octopus.annotate(**kwargs):
        pass


@pytest.mark.parametrize("registered", [False, True])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def test_a_group_larger_than_any_graph_caps_nothing(c, s, a, b, registered):
    """A group past 64 bits (which Dask's messages cannot carry) is accepted as what it means: no cap
    (one fragment per worker thread, as with ``group=None``)."""
    if registered:
        await dask_octopus.register(c, calibrate=False)
    rec = WhereRan()
    s.add_plugin(rec)
    data = np.arange(100.0)
    with dask_octopus.annotate(group=2**64):
        y = da.from_array(data, chunks=10).map_blocks(f).sum()
    assert await c.compute(y) == f(data).sum()
    assert 1 <= len(ran(rec, FRAGMENT_PREFIX)) <= 2
    if registered:  # (map needs the plugin)
        futures = await asyncio.get_running_loop().run_in_executor(
            None, lambda: dask_octopus.map(f, [1.0, 2.0], group=10**30, client=c))
        assert await c.gather(futures) == [f(1.0), f(2.0)]


def test_annotate_keeps_a_choice_of_no_array_optimization(x):
    y = (x + 1) * 2
    with dask.config.set(array_optimize=False):  # Dask's way to say: do not optimize array graphs
        plain = len(dask.optimize(y)[0].__dask_graph__())
        with dask_octopus.annotate():
            z = y.map_blocks(f)
        assert len(dask.optimize(y)[0].__dask_graph__()) == plain  # not fused by Dask's optimizer since
        assert z.compute(scheduler="sync").tolist() == f((x + 1) * 2).compute(scheduler="sync").tolist()
    assert plain > len(dask.optimize(y)[0].__dask_graph__())  # (fused where optimizing)


def test_annotate_leaves_the_warning_filters_set_inside_it_alone():
    with warnings.catch_warnings():
        with dask_octopus.annotate():
            warnings.simplefilter("error", DeprecationWarning)
        with pytest.raises(DeprecationWarning):
            warnings.warn("still an error", DeprecationWarning, stacklevel=1)


def warn_once_here():
    warnings.warn("shown once from here (the 'default' action)", UserWarning, stacklevel=1)


def test_annotate_sets_its_warning_filter_once():
    """Setting a filter makes Python show every warning of the 'default' and 'once' actions again."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        with dask_octopus.annotate():
            pass
        warn_once_here()
        with dask_octopus.annotate():
            pass
        warn_once_here()
    assert len(seen) == 1, [str(w.message) for w in seen]


def test_unannotated_graphs_pass_through_unchanged(x):
    from dask.base import collections_to_expr

    dask_octopus.groups.marks.install()
    y = x.map_blocks(f).sum()
    graph = collections_to_expr([y]).optimize().__dask_graph__()
    assert not any(str(k[0] if isinstance(k, tuple) else k).startswith(FRAGMENT_PREFIX) for k in graph)
    assert y.compute(scheduler="sync") == x.map_blocks(f).sum().compute(scheduler="sync", optimize_graph=False)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, Worker=Nanny, timeout=120)
async def test_killed_worker_mid_compute_with_groups_and_balance(c, s, a, b):
    rec = await setup(c, s, [1.0, 1.0])
    x = da.arange(4000, chunks=250).reshape(400, 10).rechunk((25, 10))
    y = await run_balance(c, x, per_worker=8)
    with dask_octopus.annotate(group=4):
        z = y.map_blocks(slow_copy, 0.05, 4, dtype=y.dtype)
    fut = c.compute(z.sum(axis=1))
    victim = min(s.workers)
    await mid_compute(rec, victim, FRAGMENT_PREFIX)  # the victim finished a group of 4 blocks
    assert not fut.done()  # its second group waits for RESUME
    assert any(isinstance(k, tuple) and str(k[0]).startswith(FRAGMENT_PREFIX) for k in s.tasks)
    await (a if a.worker_address == victim else b).kill()
    await Event(RESUME).set()
    np.testing.assert_array_equal(await fut, np.arange(4000).reshape(400, 10).sum(axis=1))
    assert not s.unrunnable


@pytest.fixture
def frame():
    return pd.DataFrame({"a": np.arange(2000.0), "b": np.arange(2000) % 7})


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_dataframe_computed_inside_annotate_groups_on_the_scheduler(c, s, a, b, frame):
    rec = await setup(c, s, [1.0, 1.0])
    log = GroupLog.on(s)
    y = dd.from_pandas(frame, npartitions=32).map_partitions(with_root)
    plain = await c.compute(y.c.sum())
    plain_keys = set(rec.worker)
    rec.worker.clear()
    await forgotten(s)  # the same keys again: not while the plain ones are still held
    with dask_octopus.annotate(resource="memory", group=8):
        got = await c.compute(y.c.sum())
        grouped_keys, groups = set(rec.worker), dict(log.groups)
        whole = await c.compute(y)
    assert got == plain
    pd.testing.assert_frame_equal(whole, with_root(frame))
    members = [m for ms, _, _ in groups.values() for m in ms]
    assert len(members) == len(set(members)) >= 64
    for ms, _, _ in groups.values():  # at most 8 partitions to a fragment, each with its chain (getitem, chunk)
        partitions = {m[1] for m in ms if key_split(m) == "with_root"}
        assert 1 <= len(partitions) <= 8 and {m[1] for m in ms if key_split(m) == "chunk"} == partitions, ms
    assert set(members) <= plain_keys and not set(members) & grouped_keys  # members ran only in groups
    assert grouped_keys == (plain_keys - set(members)) | set(groups)  # and nothing else changed
    del y, whole
    await forgotten(s)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_groups_of_balanced_partitions_run_where_their_partitions_are(c, s, a, b, frame):
    await setup(c, s, [3.0, 1.0])
    log = GroupLog.on(s)
    bdf = await run_balance(c, dd.from_pandas(frame, npartitions=5), per_worker=8)
    bdf = c.persist(bdf)
    await wait(bdf)
    got = await root_sum_in_groups(c, bdf, 4)
    assert got == pytest.approx(np.sqrt(frame.a + 1.0).sum(), rel=1e-12)
    assert {w for _, w, _ in log.groups.values()} == set(s.workers)
    for members, worker, holders in log.groups.values():
        assert holders == {worker}, members  # no group mixes workers or moves a partition


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_same_annotated_dataframe_computed_twice_at_once(c, s, a, frame):
    await setup(c, s, [1.0])
    y = dd.from_pandas(frame, npartitions=16).map_partitions(with_root).c.sum()
    expected = y.compute(scheduler="sync")
    log = GroupLog.on(s)
    with dask_octopus.annotate(group=4), captured_logger("distributed.scheduler") as messages:
        first, second = c.compute(y), c.compute(y)
        assert await c.gather([first, second]) == [expected, expected]
    assert log.groups  # the partitions ran in groups
    assert "Detected different `run_spec`" not in messages.getvalue()  # only our grouping differs
    del first, second
    await forgotten(s)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_array_built_outside_and_computed_inside_groups_on_the_scheduler(c, s, a, x):
    await setup(c, s, [1.0])
    log = GroupLog.on(s)
    y = x.map_blocks(f)  # built outside annotate: no layer marks
    expected = y.sum(axis=0).compute(scheduler="sync")
    with dask_octopus.annotate(group=8):
        built_inside = x.map_blocks(f) * 2
        got, twice = await c.gather(c.compute([y.sum(axis=0), built_inside.sum(axis=0)]))
    assert np.array_equal(got, expected) and np.array_equal(twice, 2 * expected)
    members = {key_split(m) for covers in log.covers.values() for m in covers}
    assert key_split(y.name) in members  # built outside: grouped on the scheduler
    assert FRAGMENT_PREFIX not in members  # the optimizer's groups (built inside) are not grouped again


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, Worker=Nanny, timeout=120)
async def test_killed_worker_mid_compute_with_balanced_dataframe_groups(c, s, a, b, frame):
    rec = await setup(c, s, [1.0, 1.0])
    df = await run_balance(c, dd.from_pandas(frame, npartitions=4), per_worker=8)
    with dask_octopus.annotate(group=4):
        fut = c.compute(df.map_partitions(slow_copy, 0.05, 4, meta=df._meta).a.sum())
    await mid_compute(rec, min(s.workers), FRAGMENT_PREFIX)  # the victim finished a group of 4 partitions
    assert not fut.done()  # its second group waits for RESUME
    groups = [ts for k, ts in s.tasks.items() if key_split(k) == FRAGMENT_PREFIX]
    assert groups and all(ts.worker_restrictions for ts in groups)  # pinned where their partitions are
    pinned_on = s.plugins["octopus"].placement._pinned_on  # what a pause of their worker loosens
    assert all({pinned_on[ts.key]} == ts.worker_restrictions for ts in groups)
    victim = min(s.workers)
    await (a if a.worker_address == victim else b).kill()
    await Event(RESUME).set()
    assert await fut == frame.a.sum()
    assert not s.unrunnable


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def test_p2p_shuffles_inside_annotate_stay_exact(c, s, a, b, frame, x):
    """Dask's P2P extension tracks a shuffle's transfer and output tasks by key: tasks next to its
    barrier are never grouped (grouping them stalled the shuffle)."""
    await setup(c, s, [1.0, 1.0])
    df = dd.from_pandas(frame, npartitions=16)
    other = dd.from_pandas(pd.DataFrame({"b": np.arange(7), "w": np.arange(7) * 2.0}), npartitions=4)
    with dask.config.set({"dataframe.shuffle.method": "p2p", "array.rechunk.method": "p2p"}):
        expected = await c.gather(c.compute([df.shuffle("b").a.sum(), df.merge(other, on="b").w.sum(),
                                             x.rechunk((64, 3)).sum(axis=0)]))
        await forgotten(s)
        log = GroupLog.on(s)
        with dask_octopus.annotate(group=4):
            y = x.rechunk((64, 3)) + 0  # built inside: grouped by the array optimizer
            got = await c.gather(c.compute([df.shuffle("b").a.sum(), df.merge(other, on="b").w.sum(),
                                            y.sum(axis=0)]))
    assert got[:2] == expected[:2] and np.array_equal(got[2], expected[2])
    members = {key_split(m) for ms, _, _ in log.groups.values() for m in ms}
    assert members and not any("transfer" in m or "barrier" in m or "unpack" in m for m in members), members
    del y
    await forgotten(s)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config={"octopus.fragments.task-cost": "0ms"})
async def test_groups_of_persisted_partitions_never_pull_inputs_from_two_workers_where_tasks_cost_nothing(
        c, s, a, b, frame):
    """With tasks costing nothing (``octopus.fragments.task-cost``), fragments follow the workers holding
    their inputs, however those spread them."""
    await setup(c, s, [1.0, 1.0])
    log = GroupLog.on(s)
    df = c.persist(dd.from_pandas(frame, npartitions=32))  # Dask spreads the partitions over both workers
    await wait(df)
    assert len({ws.address for ts in s.tasks.values() for ws in ts.who_has or ()}) == 2
    got = await root_sum_in_groups(c, df, 8)
    assert got == pytest.approx(np.sqrt(frame.a + 1.0).sum(), rel=1e-12)
    assert len(log.inputs_at_grouping) >= 4  # the 32 with_root tasks, in groups of up to 8
    for key, holders in log.inputs_at_grouping.items():
        assert len(holders) == 1, key  # all inputs of a group on one worker when it was made


@pytest.mark.parametrize("task_cost, bandwidth, fetched, optimizer", [
    ("1ms", None, True, True),  # 32 blocks of 16 bytes: moving half of them costs less than the tasks of the tree
    ("1ms", None, True, False),  # ... also where update_graph makes the fragments
    ("1ms", 1024, False, True),  # ... but at 1 KiB/s it does not
    ("1ms", 1024, False, False),
    ("1ms", (1e12, 1024), False, True),  # 1 KiB/s measured from one worker to the other: that figure counts
    ("1ms", (1024, 1e12), False, True),  # fast one way, but the fragments fetch both ways: at the overall 1 KiB/s ...
    ("1ms", (1024, 1e12, 1e12), True, True),  # ... unless measured fast too
    ("0ms", None, False, True),  # tasks that cost nothing: following the blocks never costs more
    ("1ms", float("inf"), False, True),  # a bandwidth that is no number of bytes a second: not priced, followed
])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_fragments_fetch_blocks_held_apart_where_that_costs_less_than_the_tasks_following_them_leaves(
        c, s, a, b, task_cost, bandwidth, fetched, optimizer, monkeypatch):
    """docs/fragments.md: blocks persisted on two workers alternately, mapped and summed inside
    ``annotate``: the plan that fetches costs 3 tasks and half the blocks moved, the plan that follows the
    blocks every task of the sum's tree; the cheaper one at the task cost and the bandwidths measured
    each way between the workers, else the scheduler's overall figure (rounded to powers of two),
    following where they cost the same."""
    ran = await setup(c, s, [1.0, 1.0])
    if not optimizer:
        monkeypatch.setattr(marks, "fragment_here", lambda *args: None)
    workers = [a.address, b.address]
    with dask.annotate(workers=lambda key: workers[key[1] % 2]):
        x = da.arange(64, chunks=2) * 1.0
    x = c.persist(x, optimize_graph=False)
    await wait(x)
    who = await c.who_has(x)
    assert [who[(x.name, i)] for i in range(4)] == [(a.address,), (b.address,)] * 2  # every other block
    log = GroupLog.on(s)
    ran.worker.clear()
    if bandwidth is not None:  # (the workers' too: their heartbeats move the scheduler's figure)
        overall, *pairs = bandwidth if isinstance(bandwidth, tuple) else (bandwidth,)
        s.bandwidth = a.bandwidth = b.bandwidth = overall
        # as the scheduler keeps the figures of the transfers between a pair of workers (receiver first)
        for pair, figure in zip([(a.address, b.address), (b.address, a.address)], pairs):
            s.bandwidth_workers[pair] = figure
    with dask.config.set({"octopus.fragments.task-cost": task_cost}):
        with dask_octopus.annotate():
            y = x.map_blocks(np.multiply, 3.0, name=f"tripled-{task_cost}-{bandwidth}")
        assert await c.compute(y.sum()) == 3.0 * sum(range(64))
    holders = sorted(map(len, log.inputs_at_grouping.values()))
    assert holders == ([2, 2] if fetched else [1, 1])  # one fragment per worker thread: fetched, or one per holder
    # fetched: the two fragments and the top; followed: each fragment holds every other block, so every sum
    # of two neighbours reads both fragments and stays a task, with a pick task for each partial sum
    assert len(ran.worker) == 3 if fetched else len(ran.worker) > 32, sorted(map(str, ran.worker))


@pytest.mark.parametrize("overall, priced", [(3e8, True), (0.5, False), (float("inf"), False), (1e308, False),
                                             (None, False), (2 ** 1100, False)])
def test_the_scheduler_s_bandwidth_figures_price_fetching_rounded_to_powers_of_two(overall, priced):
    """The scheduler keeps its figure per pair receiver first: each becomes the (sender, receiver) link's,
    rounded to the nearest power of two (a graph computed again is cut alike while they move a little);
    a pair's below a byte a second or not finite counts as none; without such an overall figure (or one
    whose power of two a float may not hold, or none a float holds), fetching is not priced."""
    from types import SimpleNamespace

    from dask_octopus.groups import scheduler as groups_scheduler
    from dask_octopus.placement.bandwidth import Bandwidths

    scheduler = SimpleNamespace(bandwidth=overall, bandwidth_workers={  # (the last two: no figures Dask makes)
        ("a", "b"): 3e8, ("b", "a"): 1.1e9, ("a", "c"): float("inf"), ("c", "a"): 0.5, ("a", "d"): None,
        ("d", "a"): 2 ** 1100})
    places, loose = {"x": ("a",), "y": ("b",)}, {"x": None, "y": None}
    got = groups_scheduler._fetch(scheduler, places, loose, [])
    if not priced:
        assert got == {}
        return
    assert got["fetch_costs"] == (1e-3, Bandwidths(2 ** 28, {("b", "a"): 2 ** 28, ("a", "b"): 2 ** 30}))
    assert got["loose"] is loose and got["holders"] == {}
    assert groups_scheduler._fetch(scheduler, places, places, []) == {}  # where both places group tasks alike


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_holders_changing_while_the_optimizer_reads_them_leave_the_fragments_to_update_graph(
        c, s, a, b, monkeypatch):
    """The optimizer reads where the inputs are off the scheduler's event loop: a set that changes size
    while read (a block moving meanwhile) leaves the fragments to ``update_graph``, which makes them."""
    from dask_octopus.groups import scheduler as groups_scheduler

    ran = await setup(c, s, [1.0, 1.0])
    workers = [a.address, b.address]
    with dask.annotate(workers=lambda key: workers[key[1] % 2]):
        x = da.arange(64, chunks=2) * 1.0
    x = c.persist(x, optimize_graph=False)
    await wait(x)
    fetch, calls = groups_scheduler._fetch, []

    def changing(*args):
        calls.append(groups_scheduler.in_offload_thread())
        if len(calls) == 1:
            raise RuntimeError("Set changed size during iteration")
        return fetch(*args)

    monkeypatch.setattr(groups_scheduler, "_fetch", changing)
    ran.worker.clear()
    with dask_octopus.annotate():
        y = x.map_blocks(np.multiply, 3.0, name="tripled-changing")
    assert await c.compute(y.sum()) == 3.0 * sum(range(64))
    assert calls == [True, False]  # the optimizer's read failed; update_graph's made the fragments
    assert len(ran.worker) == 3, sorted(map(str, ran.worker))  # the two fragments, fetching, and the top


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_the_same_work_groups_alike_each_time_it_comes(c, s, a):
    """Groups made on the scheduler follow the order the graph was built in, not Dask's traversal
    (which follows random keys): a repeated set of frames forms the same groups, so a captured CUDA
    graph of each group can be replayed."""
    await setup(c, s, [1.0])
    log = GroupLog.on(s)
    items = [c.submit(np.ones, n, pure=False) for n in (9, 3, 7, 5, 1, 8, 2, 6, 4, 10, 11, 12)]
    await wait(items)
    partitions = []
    for _ in range(3):
        log.groups.clear()
        with dask_octopus.annotate(resource="memory", group=4):
            parts = [dask.delayed(np.cumsum, pure=False)(it) for it in items]  # new random keys each time
        position = {p.key: i for i, p in enumerate(parts)}
        total = await c.compute(dask.delayed(sum)([p[-1] for p in parts]))
        assert total == sum(range(1, 13))
        # (the items' last elements, read only by the groups, join them: members of no position)
        partitions.append(sorted(sorted(position[m] for m in ms if m in position) for ms, _, _ in log.groups.values()))
    assert partitions[0] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]  # in the order they were built
    assert partitions[1] == partitions[2] == partitions[0]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_the_optimizer_groups_when_a_scheduler_of_the_process_has_no_plugin(c, s, a):
    from distributed import Scheduler

    from dask_octopus.groups.scheduler import grouping_here

    assert not grouping_here()  # no plugin yet
    await setup(c, s, [1.0])
    assert grouping_here()  # the only scheduler here groups
    async with Scheduler(dashboard_address=":0", validate=True):
        assert not grouping_here()  # a second one, without the plugin
    assert grouping_here()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_registration_longer_than_a_weight_sample_leaves_the_grouping_to_the_plugin(c, s, a, monkeypatch):
    from dask_octopus.groups.scheduler import grouping_here
    from dask_octopus.plugins import scheduler as plugin_module

    monkeypatch.setattr(plugin_module, "HISTORY_INTERVAL", 0.005)  # a sample due while the workers calibrate
    await c.register_plugin(OctopusSchedulerPlugin(calibration_seconds=0.2))
    plugin = s.plugins["octopus"]
    await async_poll_for(lambda: len(plugin.history.points) > 0, timeout=5)  # sampling, not stopped
    assert grouping_here() and plugin._sampler is not None
    rec = WhereRan()
    s.add_plugin(rec)
    with dask.config.set(num_workers=4), dask_octopus.annotate():  # the optimizer would cut 4 fragments
        got = await c.compute(da.ones((64, 6), chunks=(4, 6)).map_blocks(f).sum())
    assert got == pytest.approx(64 * 6 * np.sqrt(2.0))
    assert [key_split(k) for k in rec.worker].count(FRAGMENT_PREFIX) == 1  # the plugin: one per thread


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_an_unregistered_plugin_leaves_the_grouping_at_once(c, s, a):
    from dask_octopus.groups.scheduler import _hosts, grouping_here

    await setup(c, s, [1.0])
    await c.unregister_scheduler_plugin("octopus")
    assert not grouping_here() and _hosts() == []  # before its sampler notices
    await c.register_plugin(OctopusSchedulerPlugin(calibrate=False))
    assert grouping_here() and _hosts() == [s.plugins["octopus"]]  # the new one alone plans fragments


def test_a_mark_on_map_blocks_alone_does_not_stop_dask_fusing_it_with_the_sum():
    from dask.array.optimization import optimize
    from dask.utils import ensure_dict

    from dask_octopus.groups.marks import GroupingOptimizer, pull_marks
    from dask_octopus.groups.planning import ANNOTATION

    x = da.ones((64, 6), chunks=(4, 6))
    with dask_octopus.annotate():
        z = x.map_blocks(f)
    y = z.sum()
    graph = y.__dask_graph__()
    pulled = pull_marks(graph)
    sum_layer = next(name for name, deps in graph.dependencies.items() if z.name in deps)
    assert pulled.layers[sum_layer].annotations[ANNOTATION] == graph.layers[z.name].annotations[ANNOTATION]
    assert graph.layers[sum_layer].annotations is None  # the user's graph is left as it was
    with dask.config.set({"optimization.fuse.active": False}):  # blockwise fusion only
        fused, apart = (len(ensure_dict(optimize(g, y.__dask_keys__()))) for g in (pulled, graph))
    assert apart - fused == 16  # one task fewer per block: map_blocks and the sum's first step fused
    seen = []  # the optimizer of annotate hands Dask's optimizer the graph with the mark pulled
    GroupingOptimizer(lambda dsk, keys, **kwargs: seen.append(dsk) or optimize(dsk, keys))(graph, y.__dask_keys__())
    assert seen[0].layers[sum_layer].annotations == pulled.layers[sum_layer].annotations
