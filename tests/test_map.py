"""dask_octopus.map: order, exact results, placement per plan, groups, faults, feedback, bad input."""

import asyncio
import functools
import logging
import os
import threading
import time
from concurrent.futures import CancelledError
from decimal import Decimal

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster, Nanny, Scheduler, Worker, wait
from distributed.core import Status
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.utils_test import async_poll_for, captured_logger, gen_cluster
from stubs import Stub, task_state
from test_balance import setup

import dask_octopus
from dask_octopus.bench.cotenant import CoTenant, pin_workers
from dask_octopus.bench.workloads import gemm_repeat
from dask_octopus.groups import streams
from dask_octopus.placement.pins import Placement
from dask_octopus.plugins.messages import WorkerInfo
from dask_octopus.profiling.itemcosts import ItemCost


class GraphsSent(SchedulerPlugin):
    """Counts the graphs the scheduler receives."""

    name = "graphs-sent"

    def __init__(self):
        self.count = 0

    def update_graph(self, *args, **kwargs):
        self.count += 1


def call(c, *args, **kwargs):
    return asyncio.get_running_loop().run_in_executor(None, lambda: dask_octopus.map(*args, client=c, **kwargs))


def plan_of(s):
    """The name and plan of the latest ``map`` (recorded by ``setup``: it goes with its tasks)."""
    return [(n, p) for n, p in s.plugins["octopus"].placement.made if "-octopus-map-" in n][-1]


NO_STEALING = {"octopus.map.steal-fraction": 0}  # for tests of the plan's shape: no stealable tails


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config=NO_STEALING)
async def test_results_in_order_and_placed_by_cost_and_speed(c, s, a, b):
    rec = await setup(c, s, [3.0, 1.0])
    items = [np.arange(n, dtype=float) for n in (5, 800, 3, 100, 250, 40, 700, 1, 60, 9)]
    futs = await call(c, np.sum, items)
    assert await c.gather(futs) == [x.sum() for x in items]
    name, plan = plan_of(s)
    fast, slow = sorted(s.workers)
    load = {fast: 0, slow: 0}
    for f in futs:
        assert f.key[0] == name and rec.worker[f.key] == plan.workers[f.key[1]]
        load[rec.worker[f.key]] += plan.costs[f.key[1]]
    assert 2.0 < load[fast] / load[slow] < 4.5  # nbytes costs, weights 3:1, indivisible items


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2), ("127.0.0.1", 1)], config=NO_STEALING)
async def test_groups_run_one_task_per_worker_thread_and_keep_one_future_per_item(c, s, a, b, monkeypatch):
    rec = await setup(c, s, [1.0, 1.0])
    groups = []
    run_group = streams.run_group
    monkeypatch.setattr(streams, "run_group",
                        lambda members, *args: groups.append(len(members)) or run_group(members, *args))
    items = list(range(20))
    futs = await call(c, lambda x, k: x * k, items, cost=[1] * 20, group=4, k=3)
    assert await c.gather(futs) == [3 * x for x in items]
    name, plan = plan_of(s)
    batches = sorted((k for k in rec.worker if isinstance(k, tuple) and k[0] == name), key=lambda k: k[1])
    assert [rec.worker[k] for k in batches] == plan.workers
    assert sorted(plan.workers) == sorted([a.address, a.address, b.address])  # a task per thread
    per_worker = [rec.worker[f.key] for f in futs]  # each item's future is computed next to its batch
    # equal weights per thread: a's two threads take 7 items each, b's one thread 6 (finish at 7 and 6)
    assert [per_worker.count(w) for w in (a.address, b.address)] == [14, 6]
    assert sorted(groups) == [2, 3, 3, 4, 4, 4]  # 7 + 7 on a's threads (4 + 3 each), 6 on b (4 + 2)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_futures_and_delayed_items(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    remote = c.scatter([np.ones(10), np.ones(20)])
    remote = await remote
    items = [*remote, dask.delayed(np.ones)(30)]
    futs = await call(c, np.sum, items, cost=[1, 2, 3])
    assert await c.gather(futs) == [10.0, 20.0, 30.0]
    futs = await call(c, np.sum, items, cost=[1, 2, 3], group=2)  # futures inside a group's list too
    assert await c.gather(futs) == [10.0, 20.0, 30.0]


def sleep_cost(x, unit):
    time.sleep(x * unit)
    return x


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config=NO_STEALING)
async def test_workers_explore_large_and_small_items_apart_until_their_item_seconds_are_fitted(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    s.plugins["octopus"].min_duration = 0.0  # setup turned refinement off; this test needs it
    costs = [1, 2, 3, 4, 10, 20, 30, 40] * 2
    shapes = []
    for r in range(3):  # other kwargs each time: other keys, not the results of the last map
        # 6 ms per cost unit (60 ms a batch of small items): a stall of the test process (a GC pass, a busy
        # CI machine) of up to about 0.2 s in one batch still leaves the fitted slope within the bounds
        futs = await call(c, sleep_cost, costs, cost=costs, group=4, unit=0.006 + r * 1e-6)
        assert await c.gather(futs) == costs
        _, plan = plan_of(s)
        shapes.append(sorted(zip(plan.workers, plan.counts)))
        s.plugins["octopus"].placement.plans.clear()
    for shape in shapes[:2]:  # no fit yet: each worker runs its larger half and its smaller half apart
        for w in s.workers:
            halves = [n for worker, n in shape if worker == w]
            assert len(halves) == 2 and abs(halves[0] - halves[1]) <= 1, shape
    points = {w: list(fit.points) for w, fit in s.plugins["octopus"].item_costs["sleep_cost-octopus-map"].items()}
    assert len(shapes[2]) == 2, points  # four batches of two mean costs per worker: fitted, one task each
    fits = await c.scheduler.octopus_workers(prefix="sleep_cost-octopus-map")  # its own, despite the _
    # each item sleeps cost * 6 ms: the fitted part per cost unit is about 6 ms on both workers
    fitted = [WorkerInfo.of(values).fit for values in fits.values()]
    assert all(fit is not None and 0.0036 < fit[1] < 0.012 for fit in fitted), (fits, points)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)] * 2, config=NO_STEALING)
async def test_exploring_workers_keep_all_their_threads_busy(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    costs = [1, 2, 3, 4, 10, 20, 30, 40] * 2
    futs = await call(c, sleep_cost, costs, cost=costs, group=8, unit=0.0001)
    assert await c.gather(futs) == costs
    _, plan = plan_of(s)
    for w in s.workers:  # no fit yet: its larger and its smaller items apart, each half over two threads
        assert len([n for worker, n in zip(plan.workers, plan.counts) if worker == w]) == 4, plan


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60,
             config={"distributed.worker.memory.pause": False})  # the worker's memory monitor would unpause it
async def test_a_paused_worker_gets_no_items_not_even_scattered_ones(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    b.status = Status.paused  # its memory is full: Dask sends it no task, and its scatter refuses it
    await async_poll_for(lambda: s.workers[b.address].status == Status.paused, timeout=5)
    items = [np.full(2**15, float(i)) for i in range(16)]  # 4 MiB in all: scattered to their planned workers
    start = time.monotonic()
    assert await call(c, np.sum, items, gather=True) == [x.sum() for x in items]
    assert time.monotonic() - start < 20  # (was: "No valid workers found" after 30 s)
    _, plan = plan_of(s)
    assert set(plan.workers) == {a.address}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def test_a_worker_where_the_worker_plugin_did_not_load_gets_no_items(c, s, a, b):
    """A worker whose plugin setup failed (its environment lacks dask_octopus: the batches would fail
    there) is planned on no more: every item runs on the other, results exact."""
    def missing(plugin, name=None, catch_errors=True):
        raise ModuleNotFoundError("No module named 'dask_octopus'", name="dask_octopus")

    b.handlers["plugin-add"] = missing
    rec = await setup(c, s, [1.0, 1.0])
    assert s.plugins["octopus"].profiles[b.address]["error"].startswith("the worker plugin did not load there")
    items = [np.full(64, float(i)) for i in range(16)]
    for gather in (True, False):
        out = await call(c, np.sum, items, gather=gather, group=2)
        assert (out if gather else await c.gather(out)) == [x.sum() for x in items]
        _, plan = plan_of(s)
        assert set(plan.workers) == {a.address}
    assert {k: w for k, w in rec.worker.items() if w != a.address} == {}


@pytest.mark.parametrize("group", [None, 4])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3, timeout=60)
async def test_items_of_a_lost_worker_placed_by_dask_keep_off_a_worker_without_the_plugin(c, s, a, b, w, group):
    """The tasks (and a batch's items) that a worker was running when it went down are placed by Dask from
    then on, but not on a worker where the worker plugin did not load, where this package's code fails,
    also by Dask's work stealing (that worker idle, the others busy: restricted loosely, 4 of 12 items ran
    there)."""
    def missing(plugin, name=None, catch_errors=True):
        raise ModuleNotFoundError("No module named 'dask_octopus'", name="dask_octopus")

    w.handlers["plugin-add"] = missing
    rec = await setup(c, s, [1.0, 1.0, 1.0])
    futures = await call(c, slow_identity, list(range(8)), group=group, to_host=True, delay=0.1)
    await async_poll_for(lambda: any(m["worker"] == a.address for _, m in s.get_events("slow-identity")), 20)
    await s.remove_worker(a.address, stimulus_id="test-lost", expected=False)  # as a worker lost mid-task
    assert await c.gather(futures) == list(range(8))
    assert {k for k, worker in rec.worker.items() if worker == w.address} == set()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60,
             config={"distributed.worker.memory.pause": False})
async def test_items_planned_on_workers_all_paused_wait_for_them_unscattered(c, s, a, b):
    """Every worker paused: the items are planned on them all the same (Dask sends tasks to none), and
    the map waits, as Dask's ``client.map`` does, for them to run again (scattered to them, its 4 MiB
    of items failed with "No valid workers found" after the connect timeout)."""
    await setup(c, s, [1.0, 1.0])
    for w in (a, b):
        w.status = Status.paused
    await async_poll_for(lambda: all(ws.status == Status.paused for ws in s.workers.values()), timeout=5)
    info = await c.scheduler.octopus_workers()
    assert all(WorkerInfo.of(values).held is True for values in info.values())
    items = [np.full(2**15, float(i)) for i in range(16)]
    scattered, scatter = [], c.scatter
    c.scatter = lambda *args, **kwargs: scattered.append(kwargs.get("workers")) or scatter(*args, **kwargs)
    run = call(c, np.sum, items, gather=True)
    await asyncio.sleep(2)
    assert not run.done()
    for w in (a, b):
        w.status = Status.running
    assert await asyncio.wait_for(run, 20) == [x.sum() for x in items]
    assert scattered == []


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_map_plan_goes_with_its_tasks(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    futs = await call(c, np.sum, [np.ones(n) for n in range(1, 40)], group=4)
    assert await c.gather(futs) == [float(n) for n in range(1, 40)]
    name, _ = plan_of(s)
    del futs  # the user's futures released: Dask forgets the tasks
    await async_poll_for(lambda: name not in s.plugins["octopus"].placement.plans, timeout=5)
    assert not s.plugins["octopus"].placement._pins_of  # (each worker leaving or joining walked them all)
    # a GPU worker's timings of these tasks come later (every 200 ms): they still find the tasks' costs
    assert s.plugins["octopus"].placement.cost_of((name, 0)) is not None


def slow_identity(x, delay):
    from distributed import get_worker

    worker = get_worker()
    worker.log_event("slow-identity", {"worker": worker.address, "item": x})  # tells the test it started
    time.sleep(delay)
    return x


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, Worker=Nanny, timeout=120)
async def test_a_lost_worker_items_are_rerun_elsewhere(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    futs = await call(c, slow_identity, list(range(16)), cost=[1] * 16, group=2, delay=0.2)

    def started_on_a():
        return [m for _, m in s.get_events("slow-identity") if m["worker"] == a.worker_address]

    await async_poll_for(lambda: len(started_on_a()) >= 2, timeout=30)  # a is into its batch of 8 items of 0.2 s
    assert not all(f.done() for f in futs)
    await a.kill()
    assert await c.gather(futs) == list(range(16))
    assert not s.unrunnable


def slow_total(x, delay):
    return float(slow_identity(float(x.sum()), delay))


@pytest.mark.parametrize("learn", [False, True])  # with a first item run alone (a function new to the scheduler)
@pytest.mark.parametrize("how", ["map", "imap", "map, no rounds left", "imap, no rounds left"])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)] * 2, Worker=Nanny, timeout=120)
async def test_local_items_scattered_to_a_lost_worker_are_sent_again(c, s, a, b, how, learn, monkeypatch):
    await setup(c, s, [1.0, 1.0])
    dask.config.set({"octopus.map.learn-result-size": learn})  # (gen_cluster restores the configuration)
    if "no rounds left" in how:
        monkeypatch.setattr("dask_octopus.placement.items.LOST_ROUNDS", 0)
    items = [np.full(2**14, float(i)) for i in range(32)]  # 4 MiB in all: scattered to their planned workers
    expected = [float(x.sum()) for x in items]
    # a's two threads each run a batch and a stealable tail of two tasks: 6 batch tasks lost with it
    if how.startswith("map"):
        run = call(c, slow_total, items, cost=[1] * 32, group=2, delay=0.2, gather=True)
    else:  # (the items lost for good skipped)
        run = asyncio.get_running_loop().run_in_executor(None, lambda: sorted(dask_octopus.imap(
            slow_total, items, client=c, cost=[1] * 32, group=2, delay=0.2, errors="skip")))

    def started_on_a():
        return [m for _, m in s.get_events("slow-identity") if m["worker"] == a.worker_address]

    await async_poll_for(lambda: len(started_on_a()) >= 2, timeout=30)  # a is into its batch of 8 items of 0.2 s
    assert not run.done()
    await a.kill()
    if how == "map, no rounds left":  # the first item lost, with its own error
        with pytest.raises(CancelledError, match=r"already forgotten.\nitem \d+ of the map was lost with the "
                                                 r"worker holding it .* sent again 0 times, the most allowed \(0\)"):
            await run
        return
    got = await run
    if how == "imap, no rounds left":  # a's items lost for good, b's results all there
        assert 0 < len(got) < 32 and all(r == expected[i] for i, r in got)
        on_b = {m["item"] for _, m in s.get_events("slow-identity") if m["worker"] == b.worker_address}
        assert on_b <= {r for _, r in got}  # (item: its total; a first item run alone may come from a too)
        return
    assert (got if how == "map" else [r for _, r in got]) == expected
    assert how == "map" or [i for i, _ in got] == list(range(32))


def test_a_batch_of_scattered_items_cancelled_for_no_reason_is_sent_again():
    """A batch whose worker died as the client read its result, its scattered items with it: the client
    asks again, and the scheduler, which forgot the batch, reports it cancelled for no reason ("unknown";
    imap raised that FutureCancelledError where ``client.map`` recomputes: 2 of 6 runs of 30 items of 40
    MB on two 500 MB nanny workers, a helper's hunt). It is sent again as for "lost dependencies"."""
    from distributed.client import FutureCancelledError

    from dask_octopus.placement.items import _Batches

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        dask_octopus.register(client, calibrate=False)
        items = [np.full(2**16, float(i)) for i in range(4)]  # 2 MiB in all: scattered to their planned workers
        run = _Batches(client, np.sum, items, [1, 1, 1, 1], None, "compute", False, {}, {})
        futures = run.take()
        wait(futures)
        lost, other = sorted(futures, key=lambda f: not run._scattered & set(run.where[f.key]))[:2]
        indices = run.where[lost.key]
        assert run._scattered & set(indices)  # (a batch that read scattered items)
        again = run.again(lost, FutureCancelledError(lost.key, None))
        assert again is not None  # (None: its FutureCancelledError raised to the caller)
        wait(again)
        results = {i: r for f in again for i, r in zip(run.where[f.key], f.result(), strict=True)}
        assert results == {i: float(items[i].sum()) for i in indices}
        # a batch cancelled for any other reason is not sent again
        assert run.again(other, FutureCancelledError(other.key, "some other reason")) is None


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def test_local_items_of_a_worker_lost_between_the_plan_and_their_scatter_travel_in_the_graph(c, s, a, b):
    """A worker lost after the plan put items on it, before they were scattered there: its items travel in
    the graph, its blocks go to the other worker (the scatter's error, ``KeyError`` or ``CommClosedError``,
    failed the map)."""
    await setup(c, s, [1.0, 1.0])
    items = [np.full(2**15, float(i)) for i in range(16)]  # 4 MiB in all: scattered to their planned workers
    scatter, tried = c.scatter, []

    def scatter_once_a_left(data, workers, **kwargs):
        tried.append(workers)
        if workers == [a.address] and a.address in s.workers:
            c.sync(s.remove_worker, a.address, stimulus_id="test-lost")
        return scatter(data, workers=workers, **kwargs)

    c.scatter = scatter_once_a_left
    assert await call(c, np.sum, items, gather=True) == [x.sum() for x in items]
    assert [a.address] in tried and list(s.workers) == [b.address]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60)
async def test_a_map_whose_only_worker_left_as_its_plan_was_made_waits_for_the_next_one(c, s, a):
    """The only worker lost after the plan put items on it, before the plan was registered: its blocks
    wait for the next worker (registering the plan raised that the cluster had no workers)."""
    await setup(c, s, [1.0])
    items = [np.full(2**15, float(i)) for i in range(16)]  # 4 MiB in all: scattered to their planned workers
    scatter = c.scatter

    def scatter_once_a_left(data, workers, **kwargs):
        if a.address in s.workers:
            c.sync(s.remove_worker, a.address, stimulus_id="test-lost")
        return scatter(data, workers=workers, **kwargs)

    c.scatter = scatter_once_a_left
    run = call(c, np.sum, items, gather=True)
    await asyncio.sleep(0.5)
    assert not run.done() and not s.workers
    async with Worker(s.address, nthreads=1):
        assert await run == [x.sum() for x in items]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], Worker=Nanny, timeout=60)
async def test_a_map_that_lost_its_only_worker_waits_for_the_next_one(c, s, a):
    """Planned again after its only worker left with the items scattered to it, a map waits for a worker,
    as Dask's tasks do, instead of raising that the cluster has no workers (``imap`` plans again alike)."""
    await setup(c, s, [1.0])
    items = [np.full(2**14, float(i)) for i in range(16)]  # 2 MiB in all: scattered to the worker
    run = call(c, slow_total, items, cost=[1] * 16, group=2, delay=0.1, gather=True)
    await async_poll_for(lambda: s.get_events("slow-identity"), timeout=30)
    await a.close()  # (killed, its nanny would start it again at once)
    await async_poll_for(lambda: not s.workers, timeout=10)
    await asyncio.sleep(0.5)  # (planned again meanwhile: waiting, not raising)
    assert not run.done()
    async with Nanny(s.address, nthreads=2):
        assert await run == [float(x.sum()) for x in items]


@pytest.mark.parametrize("group", [None, 2])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, Worker=Nanny, timeout=120)
async def test_futures_of_large_local_items_survive_a_lost_worker(c, s, a, b, group):
    """The futures of ``gather=False`` are the user's to hold: their large local items travel in the
    graph, as ``client.map`` sends them, so that Dask runs them again elsewhere when a worker is lost (scattered
    to their planned worker, they were lost with it, their futures cancelled)."""
    await setup(c, s, [1.0, 1.0])
    items = [np.full(2**14, float(i)) for i in range(16)]  # 2 MiB in all
    futs = await call(c, slow_total, items, cost=[1] * 16, group=group, delay=0.2)

    def started_on_a():
        return [m for _, m in s.get_events("slow-identity") if m["worker"] == a.worker_address]

    await async_poll_for(lambda: len(started_on_a()) >= 2, timeout=30)
    await a.kill()
    assert await c.gather(futs) == [float(x.sum()) for x in items]


@pytest.mark.parametrize("how", ["map", "imap"])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)] * 2, Worker=Nanny, timeout=120)
async def test_local_items_scattered_to_a_worker_lost_before_their_batches_were_submitted_are_sent_again(
        c, s, a, b, how, monkeypatch):
    """The scheduler refuses a graph that reads a key it lost (every batch of it cancelled for "lost
    dependencies"): the batches are submitted again, their items scattered again."""
    await setup(c, s, [1.0, 1.0])
    scattered, go = threading.Event(), threading.Event()
    scatter = dask_octopus.placement.items._scatter_to_plan

    def then_wait(*args, **kwargs):
        scatter(*args, **kwargs)
        scattered.set()
        go.wait(60)

    monkeypatch.setattr("dask_octopus.placement.items._scatter_to_plan", then_wait)
    items = [np.full(2**14, float(i)) for i in range(32)]  # 4 MiB in all: scattered to their planned workers
    if how == "map":
        run = call(c, slow_total, items, cost=[1] * 32, group=2, delay=0.01, gather=True)
    else:
        run = asyncio.get_running_loop().run_in_executor(None, lambda: sorted(dask_octopus.imap(
            slow_total, items, client=c, cost=[1] * 32, group=2, delay=0.01)))
    assert await asyncio.get_running_loop().run_in_executor(None, scattered.wait, 60)
    await a.kill()
    await async_poll_for(lambda: len(s.workers) == 1, timeout=30)
    go.set()
    got = await run
    assert (got if how == "map" else [r for _, r in got]) == [float(x.sum()) for x in items]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, Worker=Nanny, timeout=120)
async def test_a_restart_mid_map_cancels_it_rather_than_sending_the_items_again(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    items = [np.full(2**14, float(i)) for i in range(16)]
    run = call(c, slow_total, items, cost=[1] * 16, group=2, delay=0.2, gather=True)
    await async_poll_for(lambda: len(s.get_events("slow-identity")) >= 2, timeout=30)
    await c.restart()
    with pytest.raises(CancelledError, match="scheduler-restart"):
        await run


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_bad_input(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    assert await call(c, np.sum, []) == []
    lock = threading.Lock()

    def cost_fails(x):
        if x == 2:
            raise KeyError("no size")
        return 1

    class Sized:
        def __init__(self, nbytes):
            self.nbytes = nbytes

    items = [0, 1, 2]
    cases = [
        (items, dict(cost=[1, 2]), ValueError, "cost has 2 entries for 3 items"),
        (items, dict(cost=[1, 2, 3, 4]), ValueError, "cost has 4 entries for 3 items"),
        ([], dict(cost=[1]), ValueError, "cost has 1 entries for 0 items"),
        (items, dict(cost=[1, -2, 3]), ValueError, "cost of item 1"),
        (items, dict(cost=[1, float("nan"), 3]), ValueError, "cost of item 1"),
        (items, dict(cost=cost_fails), ValueError, "cost raised for item 2"),
        (items, dict(group=0), ValueError, "group must be"),
        (items, dict(resource="disk"), ValueError, "unknown resource"),
        ([Sized(8), Sized("big")], {}, ValueError, r"^item 1 has nbytes 'big', not a number, .* pass cost="),
        ([Sized(8), Sized(-1)], {}, ValueError, "cost of item 1 must be"),
        (items, dict(cost="big"), TypeError, "cost must be a callable, one number per item or None, got str 'big'"),
        (items, dict(cost=3), TypeError, "cost must be a callable, one number per item or None, got int 3"),
        (items, dict(cost=np.array(3.0)), TypeError,
         r"cost must be a callable, one number per item or None, got ndarray array\(3\.\)"),
        (items, dict(cost={0: 1.0, 1: 5.0, 2: 1.0}), TypeError,
         r"cost must be a callable, one number per item or None, got dict \{0: 1.0"),
        (items, dict(cost=[1, "2", 3]), TypeError,
         r"^cost of item 1 must be a real number \(int, float or a NumPy one\), got str '2'$"),
        (items, dict(cost=[1, 2, Decimal(3)]), TypeError, r"cost of item 2 must be a real number .* got Decimal"),
        (items, dict(cost=lambda x: "big"), TypeError, "cost of item 0 must be a real number"),
        (items, dict(to_host="no"), TypeError, "to_host must be True or False, got 'no'"),
        (items, dict(pure=None), TypeError, "pure must be True or False, got None"),
        (None, {}, TypeError, "^items must be an iterable, got NoneType None$"),
        (items, dict(retries=2), TypeError,  # client.map's keyword: map's other keywords go to func
         r"^func 'len' cannot be called as func\(item, \*\*kwargs\) with the keyword arguments \['retries'\]: "
         r"got an unexpected keyword argument 'retries' \(map passes .* use dask.annotate\(...\) around the call\)$"),
    ]
    ways = {"futures": lambda *a, **k: c.gather(dask_octopus.map(*a, client=c, **k)),
            "gathered": lambda *a, **k: dask_octopus.map(*a, client=c, gather=True, **k),
            "streamed": lambda *a, **k: [r for _, r in sorted(dask_octopus.imap(*a, client=c, **k))]}
    loop = asyncio.get_running_loop()
    for run in ways.values():
        for values, kwargs, exc, match in cases:
            with pytest.raises(exc, match=match):
                await loop.run_in_executor(None, functools.partial(run, len, values, **kwargs))
        with pytest.raises(TypeError, match="func must be callable, got int 5"):
            await loop.run_in_executor(None, functools.partial(run, 5, items))
        # what does not pickle, named (distributed's own error named only the graph's type)
        held = await c.scatter([1, 2])
        for args, kwargs, match in [((keywords, items), dict(lk=lock), r"^kwargs\['lk'\] cannot be pickled"),
                                    ((str, [1, lock]), {}, "^item 1 cannot be pickled"),
                                    ((str, held), dict(cost=lambda x: bool(lock)), "^cost cannot be pickled")]:
            with pytest.raises(TypeError, match=match):
                await loop.run_in_executor(None, functools.partial(run, *args, **kwargs))
        del held
        # any iterable of costs, one per item, in every way
        costs = (1 for _ in items)
        assert await loop.run_in_executor(None, functools.partial(run, str, items, cost=costs)) == ["0", "1", "2"]
        graphs = GraphsSent()
        s.add_plugin(graphs)
        delayed_items = [dask.delayed(list)([1]), dask.delayed(list)([2])]
        for costs, match in (([1], "cost has 1 entries for 2 items"), ([1, -2], "cost of item 1 must be")):
            with pytest.raises(ValueError, match=match):
                await loop.run_in_executor(None, functools.partial(run, len, delayed_items, cost=costs))
        assert await c.submit(int, 0, pure=False) == 0  # (after any graph the calls sent: one client's in order)
        assert graphs.count == 1  # that one: the costs were checked before the delayed items were computed
        s.remove_plugin(graphs.name)
    with pytest.raises(TypeError, match="gather must be True or False, got 'yes'"):
        await call(c, len, items, gather="yes")
    with captured_logger("distributed", level=logging.ERROR) as log, \
            pytest.raises(TypeError, match="cannot be pickled"):
        await call(c, lambda x: lock, [1])
    assert log.getvalue() == ""  # our TypeError alone, no serialisation traceback before it
    with pytest.raises(TypeError, match="'awaited_inc' is a coroutine function: map runs items in batches"):
        await call(c, awaited_inc, [1])  # (its results were coroutines, never awaited)
    with pytest.raises(TypeError, match=r"^func 'scaled' cannot be .* \['factor', 'offset'\]: missing a required "
                                        r"argument: 'k'"):
        await call(c, scaled, [1], factor=2, offset=1)
    # what takes them by name, by **kwargs, or has no signature to check against, is called as it is
    assert await c.gather(await call(c, scaled, [1, 2], k=3)) == [3, 6]
    assert await c.gather(await call(c, lambda x, **kw: x + sum(kw.values()), [1], a=1, b=2)) == [4]
    assert await c.gather(await call(c, max, [[1, 2], []], default=0)) == [2, 0]  # (max has no signature)


def scaled(x, k):
    return x * k


def keywords(x, **kwargs):
    return x


def first_probed(x):
    return x


@pytest.mark.package_defaults  # (octopus.map.learn-result-size on: the cheapest item runs alone first)
@pytest.mark.parametrize("gather", [True, False])
def test_an_item_that_cannot_be_pickled_is_named_by_its_index_among_the_map_s_items(gather):
    """A function none of whose tasks ran: its cheapest item runs alone first, the others after; the item
    that cannot be pickled is named by its index in the map's items, not in those sent (it was item 2)."""
    lock = threading.Lock()
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as c:
        dask_octopus.register(c, calibrate=False)
        with pytest.raises(TypeError, match=r"^item 3 cannot be pickled"):
            if gather:
                dask_octopus.map(first_probed, [1, 2, 3, lock], gather=True)
            else:
                list(dask_octopus.imap(first_probed, [1, 2, 3, lock]))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_an_item_that_is_a_future_of_another_scheduler_is_refused_naming_it(c, s, a):
    """The scheduler knows no such key: a bare KeyError from it before (and its tracebacks logged)."""
    await setup(c, s, [1.0])
    async with Scheduler(dashboard_address=":0") as other, Client(other.address, asynchronous=True) as elsewhere:
        foreign = elsewhere.submit(abs, -1)  # (pending: that scheduler has no worker)
        mine = await c.scatter(2)
        again = await Client(s.address.replace("127.0.0.1", "localhost"), asynchronous=True)
        try:  # a client of the same scheduler under another address: its futures are items as any
            # (held until read: another client's release travels on its own connection, and may reach
            # the scheduler before this client's graph does, as with Dask's own ``client.submit``)
            theirs = await again.scatter(-3)
            assert await c.gather(await call(c, abs, [mine, theirs])) == [2, 3]
        finally:
            await again.close()
        message = (rf"^item 1 is a future of another scheduler \({other.address}\) than this client's "
                   rf"\({s.address}\)$")
        for gather in (False, True):
            with pytest.raises(ValueError, match=message):
                await call(c, abs, [mine, foreign], gather=gather)
        with pytest.raises(ValueError, match=message):
            await asyncio.to_thread(lambda: list(dask_octopus.imap(abs, [mine, foreign], client=c)))


def draw(item):
    return np.random.default_rng().random()  # a new value each call: an impure function


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config=NO_STEALING)
async def test_pure_false_gives_a_call_futures_of_its_own(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    items = [1, 2, 3]
    first = await call(c, draw, items, cost=[1, 1, 1])
    again = await call(c, draw, items, cost=[1, 1, 1])  # the same work, same plan: Dask's reuse of its keys
    assert [f.key for f in again] == [f.key for f in first] and await c.gather(again) == await c.gather(first)
    impure = await call(c, draw, items, cost=[1, 1, 1], pure=False)
    other = await call(c, draw, items, cost=[1, 1, 1], pure=False)
    keys = [f.key for f in first + impure + other]
    assert len(set(keys)) == 9  # each call's own futures, computed anew
    values = await c.gather(first + impure + other)
    assert len(set(values)) == 9  # (three draws of [0, 1) alike are as likely as a collision of floats)


async def awaited_inc(x):
    return x + 1


@pytest.mark.xdist_group("cpu-cotenant")  # (tests/conftest.py)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPU cores")
def test_a_second_map_is_better_planned_after_a_slowdown():
    with dask.config.set(NO_STEALING), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cl, \
            Client(cl) as c:
        plan = pin_workers(c)
        dask_octopus.register(c, calibrate=False)  # equal weights until task timings say otherwise
        slow = min(plan)
        block = np.ones((384, 384))
        fast = max(plan)
        with CoTenant(cores=[plan[slow]], procs=2):
            counts = []
            for _ in range(2):
                # the other worker kept busy after its items: idle, it would hand its share of their
                # process group's CPU time (Linux's autogroups) to the slowed one, whose last items then
                # ran as fast as its own
                busy = [c.submit(gemm_repeat, block, 15, workers=[fast], pure=False, priority=-1) for _ in range(12)]
                futs = dask_octopus.map(gemm_repeat, [block] * 12, cost=[1] * 12, reps=15)
                wait(futs + busy)
                who = c.who_has(futs)
                counts.append(sum(who[f.key][0] == slow for f in futs))
        assert counts[0] == 6  # equal weights: 6 items each
        assert counts[1] < counts[0], counts  # the slowed worker got fewer items the second time


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config=NO_STEALING)
async def test_future_items_stay_where_their_data_is_when_moving_it_costs_more(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    holder, other = sorted(s.workers)
    items = [c.submit(np.ones, 2**17, workers=[holder], pure=False) for _ in range(8)]  # 1 MiB each, on holder
    await wait(items)
    for w in s.workers:  # np.sum was observed: one unit of cost takes a microsecond on either worker
        s.plugins["octopus"].model.observe(w, "sum-octopus-map", 1e6, 1.0)
    futs = await call(c, np.sum, items, group=2)  # moving an item (1 MiB) costs far more than its work
    assert await c.gather(futs) == [2.0**17] * 8
    (_, plan), = [(n, p) for n, p in s.plugins["octopus"].placement.plans.items() if n.startswith("sum-octopus-map")]
    assert plan.workers == [holder]  # one task per worker thread
    futs = await call(c, np.max, items, group=2)  # never observed: transfers are not counted yet
    assert await c.gather(futs) == [1.0] * 8
    (_, plan), = [(n, p) for n, p in s.plugins["octopus"].placement.plans.items() if n.startswith("max-octopus-map")]
    assert sorted(plan.workers) == sorted([holder, other])  # 4 + 4 by the equal weights


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config=NO_STEALING)
async def test_items_are_packed_by_each_worker_s_fixed_and_proportional_seconds(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    launches, crunches = sorted(s.workers)  # slow to start an item, fast on big ones / the reverse
    truth = {launches: ItemCost(1.0, 0.001), crunches: ItemCost(0.0, 0.01)}
    fits = s.plugins["octopus"].item_costs.use("sum-octopus-map")
    for w, t in truth.items():
        for n, cost in [(1, 10.0), (2, 1000.0), (1, 5000.0)]:
            fits[w].add(n, cost, n * t.fixed + cost * t.per_unit)
    items = [np.ones(4)] * 2 + [np.ones(1)] * 10
    futs = await call(c, np.sum, items, cost=[1000] * 2 + [1] * 10, group=4)
    assert await c.gather(futs) == [4.0] * 2 + [1.0] * 10
    _, plan = plan_of(s)
    # by weights (equal) each would take one big item (10 s on crunches); by their seconds per
    # item both big ones go to launches (2 x 2 s) and the ten small ones to crunches (0.1 s)
    assert sorted(zip(plan.workers, plan.costs, plan.counts)) == sorted([(launches, 2000, 2), (crunches, 10, 10)])


@pytest.mark.parametrize("truth, cost", [(ItemCost(0.0, 0.01), 100),  # 1 s per item, all proportional
                                         (ItemCost(1.0, 0.001), 1)])  # 1.001 s per item, nearly all fixed
@gen_cluster(client=True, nthreads=[("127.0.0.1", 3), ("127.0.0.1", 1)], config=NO_STEALING)
async def test_a_worker_s_fitted_seconds_per_item_count_once_per_thread(c, s, a, b, truth, cost):
    await setup(c, s, [1.0, 1.0])
    fits = s.plugins["octopus"].item_costs.use("sum-octopus-map")
    for w in s.workers:  # the same seconds per item on one thread of either worker
        for n, cost in [(1, 10.0), (2, 1000.0), (1, 5000.0)]:
            fits[w].add(n, cost, n * truth.fixed + cost * truth.per_unit)
    futs = await call(c, np.sum, [np.ones(2)] * 12, cost=[cost] * 12)
    assert await c.gather(futs) == [2.0] * 12
    _, plan = plan_of(s)
    per_worker = {w: sum(n for x, n in zip(plan.workers, plan.counts) if x == w) for w in (a.address, b.address)}
    assert list(per_worker.values()) == [9, 3]  # a's three threads run three items at once: 3 s each


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2), ("127.0.0.1", 1)], config=NO_STEALING)
async def test_a_gpu_worker_s_weight_counts_once_whatever_its_threads(c, s, a, b):
    """Until seconds per item are fitted, items go by weight times the threads that run at that speed: a CPU
    worker's two threads count twice, a GPU worker's once (its weight is its device's, which they share)."""
    await setup(c, s, [1.0, 1.0])

    async def per_worker():
        futs = await call(c, np.sum, [np.ones(2)] * 12, group=4)
        assert await c.gather(futs) == [2.0] * 12
        _, plan = plan_of(s)
        return [sum(n for x, n in zip(plan.workers, plan.counts) if x == w) for w in (a.address, b.address)]

    assert await per_worker() == [8, 4]
    s.plugins["octopus"].profiles[a.address].update(device="gpu", memory_free=2**30)
    assert await per_worker() == [6, 6]


def fails_on_seven(x):
    if x == 7:
        raise ZeroDivisionError(f"item {x} is bad")
    return x * 2


@pytest.mark.parametrize("group", [None, 8])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_failing_item_fails_alone_with_its_own_exception_and_traceback(c, s, a, b, group):
    import traceback

    await setup(c, s, [1.0, 1.0])
    futs = await call(c, fails_on_seven, list(range(40)), group=group)
    await wait(futs)
    assert [f.status for f in futs].count("error") == 1 and futs[7].status == "error"
    assert await c.gather(futs[:7] + futs[8:]) == [2 * x for x in range(40) if x != 7]
    with pytest.raises(ZeroDivisionError, match="item 7 is bad"):
        await futs[7]
    assert "fails_on_seven" in "".join(traceback.format_tb(await futs[7].traceback()))
    assert await c.gather(futs, errors="skip") == [2 * x for x in range(40) if x != 7]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_delayed_items_with_the_default_cost_and_a_cost_callable(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    items = [dask.delayed(np.ones)(n) for n in (10, 20, 30)]
    assert await c.gather(await call(c, np.sum, items)) == [10.0, 20.0, 30.0]
    futs = await call(c, np.sum, items, cost=len, group=2)  # len runs on the worker that holds the item
    assert await c.gather(futs) == [10.0, 20.0, 30.0]
    _, plan = [(n, p) for n, p in s.plugins["octopus"].placement.plans.items() if "-octopus-map-" in n][-1]
    assert sum(plan.costs) == 60.0  # the items' lengths
    with pytest.raises(ValueError, match="cost raised for item 1") as info:
        await call(c, np.sum, items, cost=lambda a: 1 / (len(a) - 20))
    assert isinstance(info.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize("how", ["futures", "gather", "imap"])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_map_whose_cost_raises_leaves_no_task_behind(c, s, a, b, how):
    """The futures map made before it failed (the delayed items computed, the costs' tasks) are released,
    although the error's traceback, which the caller keeps, refers to them."""
    await setup(c, s, [1.0, 1.0])
    items = [dask.delayed(np.ones)(n) for n in (10, 20, 30)]
    cost = lambda a: 1 / (len(a) - 20)  # noqa: E731
    with pytest.raises(ValueError, match="cost raised for item 1") as info:
        if how == "imap":
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: dask_octopus.imap(np.sum, items, client=c, cost=cost))
        else:
            await call(c, np.sum, items, cost=cost, gather=how == "gather")
    await async_poll_for(lambda: not s.tasks, timeout=5)
    assert info.value.__traceback__ is not None


@pytest.mark.package_defaults
@pytest.mark.parametrize("fail_at", [1, 2])  # the first plan, or the second (after the first item ran alone)
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_map_whose_submission_fails_leaves_no_task_behind(c, s, a, b, fail_at, monkeypatch):
    """Items scattered to their workers, and the task of the first item where it ran alone first (the
    function is new: ``octopus.map.learn-result-size``), are released where a later step fails."""
    await setup(c, s, [1.0, 1.0])
    plans = []
    call_scheduler = dask_octopus.placement.items.call_scheduler

    def failing(client, handler, **kwargs):
        if handler == "octopus_add_plan":
            plans.append(kwargs["counts"])
            if len(plans) == fail_at:
                raise OSError("the scheduler went away")
        return call_scheduler(client, handler, **kwargs)

    monkeypatch.setattr("dask_octopus.placement.items.call_scheduler", failing)
    items = [np.full(2**14, float(i)) for i in range(32)]  # 4 MiB in all: scattered to their planned workers
    with dask.config.set({"octopus.map.learn-result-size": fail_at == 2}), \
            pytest.raises(OSError, match="the scheduler went away") as info:
        await call(c, np.sum, items, group=2, gather=True)
    assert [sum(counts) for counts in plans] == ([32] if fail_at == 1 else [1, 31])
    await async_poll_for(lambda: not s.tasks, timeout=5)
    assert info.value.__traceback__ is not None


class InputsWhereRun(SchedulerPlugin):
    """For each task of a map batch: where its inputs were when it ran, and where it ran."""

    name = "inputs-where-run"

    def __init__(self):
        self.seen = {}

    def transition(self, key, start, finish, *args, **kwargs):
        if finish == "memory" and "-octopus-map-" in str(key):
            ts = self.scheduler.tasks[key]
            self.seen[key] = ({ws.address for d in ts.dependencies for ws in d.who_has}, kwargs["worker"],
                              len(ts.dependencies))

    async def start(self, scheduler):
        self.scheduler = scheduler


def test_large_local_items_go_to_their_planned_worker_not_into_the_graph(recwarn):
    """Gathered results (and ``imap``'s): the items are scattered to their planned workers, which the run
    sends again where a worker is lost. (The futures of ``gather=False`` carry them in the graph, as
    ``client.map`` does: ``test_futures_of_large_local_items_survive_a_lost_worker``.)"""
    items = [np.full(2**18, float(i)) for i in range(60)]  # 2 MiB each: 120 MiB in all
    with dask.config.set({"octopus.refine.min-duration": "1h", **NO_STEALING}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as c:
        dask_octopus.register(c, calibrate=False)
        rec = InputsWhereRun()
        c.register_plugin(rec)
        rec = cluster.scheduler.plugins[rec.name]
        assert dask_octopus.map(np.sum, items, group=4, gather=True) == [2**18 * float(i) for i in range(60)]
    assert sum(n for _, _, n in rec.seen.values()) == 60  # every item is a key: its data is not in the graph
    assert len({worker for _, worker, _ in rec.seen.values()}) == 2
    assert all(holders == {worker} for holders, worker, _ in rec.seen.values())  # and sat where it ran
    assert not [w for w in recwarn if "Sending large graph" in str(w.message)]


@pytest.mark.parametrize("group", [None, 3])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_futures_in_kwargs_reach_func_as_their_values(c, s, a, b, group):
    await setup(c, s, [1.0, 1.0])
    scale = c.submit(lambda: 10.0)
    futs = await call(c, lambda x, k: x * k, [1.0, 2.0, 3.0, 4.0], group=group, k=scale)
    assert await c.gather(futs) == [10.0, 20.0, 30.0, 40.0]


def test_a_map_plan_given_again_before_the_last_pin_of_its_name_is_forgotten_stays():
    """A map of the same items under the same plan name: its plan arrives, then Dask forgets the last
    task of the earlier one; the new graph still finds its plan (the scheduler's side alone)."""
    placement = Placement()
    name = "f-octopus-map-0123"
    tasks = {(name, 0): task_state((name, 0))}
    scheduler = Stub(tasks=tasks)
    placement.add_plan(name, ["a"], counts=[1], costs=[1.0])
    assert placement.update_graph(scheduler, [(name, 0)]) == 1
    placement.add_plan(name, ["a"], counts=[1], costs=[1.0])  # the second map's plan, its graph to come
    placement.forget((name, 0))  # the first map's task
    assert name in placement.plans
    tasks[(name, 0)].worker_restrictions = None
    assert placement.update_graph(scheduler, [(name, 0)]) == 1
    placement.forget((name, 0))
    assert name not in placement.plans  # (with its last pin)


def test_a_map_plan_stays_until_the_last_of_its_pinned_tasks_is_forgotten():
    """The pins of a plan are counted one by one: a map plan retires with the last of its tasks, not with
    the first ones Dask forgets (results released one by one)."""
    placement = Placement()
    name = "f-octopus-map-4567"
    tasks = {(name, i): task_state((name, i)) for i in range(3)}
    placement.add_plan(name, ["a", "a", "b"], counts=[1, 1, 1], costs=[1.0, 2.0, 3.0])
    assert placement.update_graph(Stub(tasks=tasks), list(tasks)) == 3
    placement.forget((name, 0))
    placement.forget((name, 1))
    assert name in placement.plans and placement.worker_of((name, 2)) == "b"
    placement.forget((name, 2))
    assert name not in placement.plans and placement.cost_of((name, 2)) == (3.0, 1)  # retired, costs kept


def test_only_the_tasks_of_a_map_plan_with_bytes_have_items_bytes():
    """``items_bytes_of`` is None for any task that is not a block of a map plan with counts and bytes:
    the scheduler plugin asks it of every finished task (an error there would be logged as a failed
    hook), and without it map would not learn its results' size."""
    placement = Placement()
    placement.add_plan("f-octopus-map-1", ["a", "b"], counts=[2, 3], costs=[1.0, 1.0], nbytes=[10.0, 20.0])
    placement.add_plan("f-octopus-map-2", ["a"], counts=[1], costs=[1.0])  # no bytes given
    placement.add_plan("y", ["a"], source="x", nbytes=[8.0])  # a balance plan
    assert placement.items_bytes_of(("f-octopus-map-1", 1)) == 20.0
    for key in ["x", ("x", 0), ("f-octopus-map-2", 0), ("y", 0), "f-octopus-map-1"]:
        assert placement.items_bytes_of(key) is None


def test_an_exploring_worker_runs_its_large_and_small_items_apart_also_for_costs_under_one():
    """A worker with no per-item seconds fitted splits its larger and smaller items between halves of its
    threads whatever the scale of the costs (costs under 1 included)."""
    from dask_octopus.placement.items import _batches

    costs = [1.0, 1.0, 0.2, 0.2]
    packing = Stub(assignment=[0, 0, 0, 0], finish=[2.4])
    out = _batches(costs, packing, [2], True, [True], 0.0, None, [0.0] * 4, [None])
    assert out == [(0, [0, 1], False), (0, [2, 3], False)]
    scaled = _batches([c * 10 for c in costs], packing, [2], True, [True], 0.0, None, [0.0] * 4, [None])
    assert scaled == out  # the same split, costs ten times larger


def test_local_items_small_in_all_travel_in_the_graph_and_large_ones_are_scattered_to_their_worker():
    """Local items under SCATTER_BYTES in all are not scattered (one round trip less); at SCATTER_BYTES
    they are, to the worker planned for them."""
    from dask_octopus.placement.items import SCATTER_BYTES, _scatter_to_plan

    scattered = []

    def scatter(data, workers, hash):
        scattered.append((list(data), workers))
        return [f"future-{x}" for x in data]

    client = Stub(scatter=scatter)
    items = ["a", "b", "c"]
    _scatter_to_plan(client, items, [100.0, 100.0, 100.0], [("w1", [0, 1]), ("w2", [2])], set())
    assert items == ["a", "b", "c"] and scattered == []
    large = [SCATTER_BYTES / 2, SCATTER_BYTES / 4, SCATTER_BYTES / 4]
    _scatter_to_plan(client, items, large, [("w1", [0, 1]), ("w2", [2])], {"w2"})  # w2 paused: c stays here
    assert items == ["future-a", "future-b", "c"] and scattered == [(["a", "b"], ["w1"])]
    items = ["a", "b", "c"]
    _scatter_to_plan(client, items, large, [("w1", [0, 1]), ("w2", [2])], set())
    assert items == ["future-a", "future-b", "future-c"]
    assert scattered[1:] == [(["a", "b"], ["w1"]), (["c"], ["w2"])]
