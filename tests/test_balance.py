"""balance(): sizes from the weights, exact values, placement from the scheduler's records, faults, bad input."""

import asyncio
import gc
import logging
import sys
import time
from types import SimpleNamespace

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from dask.core import flatten
from dask.sizeof import sizeof
from dask.utils import key_split
from distributed import Event, Nanny, Worker, futures_of, get_worker, wait
from distributed.core import Status
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.utils_test import async_poll_for, captured_logger, gen_cluster
from stubs import Stub, task_state

import dask_octopus
from dask_octopus import NotRegisteredError, PlanningError
from dask_octopus.groups.rewrite import FRAGMENT_PREFIX
from dask_octopus.placement import blocks
from dask_octopus.placement.blocks import aligned
from dask_octopus.placement.pins import Placement
from dask_octopus.plugins.scheduler import OctopusSchedulerPlugin


class WhereRan(SchedulerPlugin):
    """Records the worker that computed each key, and every restriction the scheduler saw."""

    name = "where-ran"

    def __init__(self):
        self.worker = {}
        self.restricted = set()

    def transition(self, key, start, finish, *args, **kwargs):
        if finish == "memory" and "worker" in kwargs:
            self.worker[key] = kwargs["worker"]

    def update_graph(self, scheduler, *, tasks, **kwargs):
        self.restricted |= {k for k in tasks if scheduler.tasks[k].worker_restrictions}


def record_plans(placement):
    """Keep every plan ``placement`` is given, in order, as ``placement.made`` (``(name, plan)``): a
    ``map`` plan goes from ``placement.plans`` once Dask forgot its tasks."""
    placement.made = []
    add = placement.add_plan

    def add_plan(name, *args, **kwargs):
        add(name, *args, **kwargs)
        placement.made.append((name, placement.plans[name]))

    placement.add_plan = add_plan


async def setup(c, s, speeds):
    """Register without calibration or refinement and give the workers fixed, known speeds."""
    with dask.config.set({"octopus.refine.min-duration": "1h"}):  # no task is long enough to refine
        await c.register_plugin(OctopusSchedulerPlugin(calibrate=False))
    for w, v in zip(sorted(s.workers), speeds):
        s.plugins["octopus"].model.set_prior(w, {"compute": v, "memory": v})
    record_plans(s.plugins["octopus"].placement)
    rec = WhereRan()
    s.add_plugin(rec)
    return rec


async def mid_compute(rec, victim, name, timeout=30):
    """Wait until the worker ``victim`` finished a task whose key contains ``name`` (``rec`` is the
    :class:`WhereRan` of the test): it did some of the work, so a kill after this lands mid-compute,
    not before the worker started."""
    await async_poll_for(lambda: any(w == victim and name in str(k) for k, w in list(rec.worker.items())), timeout)


def run_balance(c, x, **kwargs):
    return asyncio.get_running_loop().run_in_executor(None, lambda: dask_octopus.balance(x, client=c, **kwargs))


def per_block_tasks(rec, skip=("random", "rechunk-split", "finalize")):
    return {k: w for k, w in rec.worker.items() if isinstance(k, tuple) and not key_split(k).startswith(skip)}


@pytest.mark.parametrize("fuse", [True, False])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_array_blocks_and_their_consumers_run_where_planned(c, s, a, b, fuse):
    rec = await setup(c, s, [3.0, 1.0])
    with dask.config.set({"optimization.fuse.active": fuse}):
        await blocks_run_where_planned(c, s, rec)
    assert not any("p2p" in key_split(k) for k in rec.worker)


async def blocks_run_where_planned(c, s, rec):
    """Balance 800 rows over workers of speeds 3:1 in two blocks each: the planned sizes and workers,
    exact results, and every per-block task on its block's worker. Returns the input and the plan."""
    x = da.random.default_rng(1).random((800, 30), chunks=(100, 15))
    y = await run_balance(c, x, per_worker=2)
    assert y.chunks == ((300, 300, 100, 100), (15, 15))
    fast, slow = sorted(s.workers)
    planned = s.plugins["octopus"].placement.plans[y.name].workers
    assert planned == [fast, fast, slow, slow]
    reference = await c.compute((x * 2 + 1).sum(axis=1))
    rec.worker.clear()
    result = await c.compute((y * 2 + 1).sum(axis=1))
    np.testing.assert_array_equal(result, reference)
    blocks = per_block_tasks(rec)
    assert len(blocks) >= 8
    assert all(w == planned[k[1]] for k, w in blocks.items()), blocks
    return x, y, planned


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_persisted_balance_pins_downstream_passes(c, s, a, b):
    rec = await setup(c, s, [1.0, 3.0])
    x = da.ones((400, 8), chunks=(50, 8))
    y = c.persist(await run_balance(c, x, per_worker=1))
    await wait(y)
    slow, fast = sorted(s.workers)
    assert {key[1]: rec.worker[key] for key in y.__dask_keys__() for key in key} == {0: slow, 1: fast}
    assert y.chunks[0] == (100, 300)
    z = c.compute((y @ np.ones((8, 2))).sum())
    assert await z == 400 * 8 * 2
    mm = [k for k in rec.worker if isinstance(k, tuple) and "matmul" in key_split(k)]
    assert mm and all(rec.worker[k] == (slow, fast)[k[1]] for k in mm)


NO_AMM = {"distributed.scheduler.active-memory-manager.start": False}  # (retire_workers runs it still)
AMM_BY_HAND = {"distributed.scheduler.active-memory-manager.start": False,  # run by the test (amm.run_once)
               "distributed.scheduler.active-memory-manager.measure": "managed"}


async def blocks_copied_to_both(c, s, a, b):
    """Four balanced blocks persisted, two per worker, then read by a task on each worker (a copy of
    each on both), the first worker holding more data: Dask's ReduceReplicas would drop the copies
    there, its own blocks' included. Returns the recorder of where tasks ran, the input, the balanced
    array, its keys, each one's worker, and the extra data."""
    rec = await setup(c, s, [1.0, 1.0])
    x = da.arange(800 * 8, chunks=800).reshape((800, 8)).rechunk((100, 8))
    y = c.persist(await run_balance(c, x, per_worker=2))
    await wait(y)
    blocks = list(flatten(y.__dask_keys__()))
    home = {k: rec.worker[k] for k in blocks}
    assert sorted(home.values()) == sorted([a.address, b.address] * 2)
    for w in (a, b):
        await c.submit(lambda parts: len(parts), futures_of(y), workers=[w.address], pure=False)
    assert all(len(s.tasks[k].who_has) == 2 for k in blocks)
    heavy = await c.scatter(np.ones(2**22), workers=[a.address])
    return SimpleNamespace(rec=rec, x=x, y=y, blocks=blocks, home=home, heavy=heavy)


def holders(s, blocks):
    return {k: sorted(ws.address for ws in s.tasks[k].who_has) for k in blocks}


async def same_sums(c, t):
    np.testing.assert_array_equal(await c.compute((t.y + 1).sum(axis=1)),
                                  (t.x + 1).sum(axis=1).compute(scheduler="sync"))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config=AMM_BY_HAND)
async def test_the_memory_manager_keeps_persisted_blocks_on_their_planned_workers(c, s, a, b):
    t = await blocks_copied_to_both(c, s, a, b)
    await c.amm.run_once()
    await async_poll_for(lambda: all(len(s.tasks[k].who_has) == 1 for k in t.blocks), 10)
    assert holders(s, t.blocks) == {k: [w] for k, w in t.home.items()}
    t.rec.worker.clear()
    await same_sums(c, t)
    ran = per_block_tasks(t.rec)  # each block's sum, and its aggregate
    assert len(ran) == 8 and all(w == t.home[(t.y.name, k[1], 0)] for k, w in ran.items()), ran


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2,
             config={**AMM_BY_HAND, "distributed.worker.memory.pause": False})  # (the worker would unpause it)
async def test_the_memory_manager_drops_first_the_copies_on_a_paused_worker(c, s, a, b):
    t = await blocks_copied_to_both(c, s, a, b)
    a.status = Status.paused  # (its memory monitor's doing): Dask drops the copies there, its blocks' too
    await async_poll_for(lambda: s.workers[a.address].status == Status.paused, 5)
    await c.amm.run_once()
    await async_poll_for(lambda: all(len(s.tasks[k].who_has) == 1 for k in t.blocks), 10)
    assert holders(s, t.blocks) == {k: [b.address] for k in t.blocks}
    a.status = Status.running
    await same_sums(c, t)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config=AMM_BY_HAND)
async def test_a_worker_retired_while_its_blocks_have_copies_elsewhere_loses_none(c, s, a, b):
    t = await blocks_copied_to_both(c, s, a, b)
    for _ in range(3):  # the policies in either order (a set): the copies on the other worker stay
        await c.retire_workers([a.address], close_workers=False, remove=False)
    assert holders(s, t.blocks) == {k: [b.address] for k in t.blocks}
    await same_sums(c, t)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_dataframe_partitions_run_where_planned(c, s, a, b):
    rec = await setup(c, s, [3.0, 1.0])
    pdf = pd.DataFrame({"a": np.arange(800), "b": np.arange(800) * 0.5})
    df = dd.from_pandas(pdf, npartitions=7)
    bdf = await run_balance(c, df, per_worker=1)
    fast, slow = sorted(s.workers)
    # the workers take the rows in the order of those they hold (balance computed the input's partitions)
    (order,) = [p.workers for n, p in s.plugins["octopus"].placement.plans.items() if n.startswith("octopus-rows")]
    assert sorted(order) == [fast, slow]
    sizes = [600 if w == fast else 200 for w in order]
    assert bdf.npartitions == 2 and bdf.known_divisions and bdf.divisions == (0, sizes[0], 799)
    lengths, total = await c.gather(c.compute([bdf.map_partitions(len), (bdf.a * 2 + bdf.b).sum()]))
    assert list(lengths) == sizes
    assert total == (pdf.a * 2 + pdf.b).sum()
    names = ("mul", "add", "getitem", "octopus-rows")
    blocks = {k: w for k, w in rec.worker.items() if isinstance(k, tuple) and key_split(k) in names}
    assert len(blocks) >= 8 and all(w == order[k[1]] for k, w in blocks.items()), blocks
    pd.testing.assert_frame_equal(await c.compute(bdf), pdf)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_series_with_duplicate_index_values_keeps_values(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    ser = pd.Series(np.arange(10.0), index=[0, 0, 0, 0, 0, 1, 1, 1, 1, 1])
    bs = await run_balance(c, dd.from_pandas(ser, npartitions=2, sort=True))
    pd.testing.assert_series_equal(await c.compute(bs), ser)
    assert bs.npartitions == 2


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_unbalanced_compute_is_not_touched(c, s, a, b):
    rec = await setup(c, s, [3.0, 1.0])
    await run_balance(c, da.ones((100, 2), chunks=10))  # a plan exists, for another collection
    x = da.ones((100, 2), chunks=10) * 3
    assert await c.compute(x.sum()) == 600
    assert rec.restricted == set()


RESUME = "octopus-test-resume"


def slow_copy(block, delay, free):
    """``block`` copied after ``delay`` seconds; past its first ``free`` calls on a worker, only once the
    test sets the event :data:`RESUME`: a worker killed before that is surely mid-compute."""
    worker = get_worker()
    worker.octopus_test_calls = getattr(worker, "octopus_test_calls", 0) + 1
    if worker.octopus_test_calls > free:
        Event(RESUME).wait()
    time.sleep(delay)
    return block.copy()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, Worker=Nanny, timeout=120)
async def test_killed_worker_blocks_move_to_survivors(c, s, a, b):
    rec = await setup(c, s, [1.0, 1.0])
    x = da.arange(4000, chunks=250).reshape(400, 10).rechunk((50, 10))
    y = await run_balance(c, x, per_worker=4)
    z = y.map_blocks(slow_copy, 0.05, 1, dtype=y.dtype).sum(axis=1)
    fut = c.compute(z)
    victim = sorted(s.workers)[0]
    await mid_compute(rec, victim, "octopus-blocks")  # a block (its slow_copy fused in) is done
    assert not fut.done()  # the workers' other blocks wait for RESUME
    nanny = a if a.worker_address == victim else b
    await nanny.kill()
    await Event(RESUME).set()
    result = await fut
    np.testing.assert_array_equal(result, np.arange(4000).reshape(400, 10).sum(axis=1))
    assert not s.unrunnable
    plan = s.plugins["octopus"].placement.plans[y.name].workers
    assert victim not in plan


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_blocks_pinned_to_a_worker_that_leaves_after_unregistering_run_elsewhere(c, s, a, b):
    rec = await setup(c, s, [1.0, 1.0])
    x = da.arange(4000, chunks=250).reshape(400, 10).rechunk((50, 10))
    y = await run_balance(c, x, per_worker=4)
    fut = c.compute(y.map_blocks(slow_copy, 0.05, 1, dtype=y.dtype).sum(axis=1))
    await mid_compute(rec, a.address, "octopus-blocks")
    await c.unregister_scheduler_plugin("octopus")  # its remove_worker hook no longer runs
    await a.close(executor_wait=False)  # (its thread waits for RESUME)
    await Event(RESUME).set()
    result = await asyncio.wait_for(fut, 20)  # not waiting in no-worker for the worker that left
    np.testing.assert_array_equal(result, np.arange(4000).reshape(400, 10).sum(axis=1))
    assert not s.unrunnable


def call(c, x, **kwargs):
    return asyncio.get_running_loop().run_in_executor(None, lambda: dask_octopus.balance(x, client=c, **kwargs))


def never_computed(part):
    raise AssertionError("the input was computed")


@gen_cluster(client=True, nthreads=[])
async def test_a_dataframe_is_not_waited_for_on_a_cluster_without_workers(c, s):
    await c.register_plugin(OctopusSchedulerPlugin(calibrate=False))
    df = dd.from_pandas(pd.DataFrame({"a": range(10)}), npartitions=2)
    for coll in (df, da.ones(10, chunks=5)):
        with pytest.raises(ValueError, match=r"^the cluster has no workers$"):
            await asyncio.wait_for(call(c, coll), 10)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
async def test_fewer_rows_than_workers_go_to_the_fastest(c, s, a, b, w3):
    """Without ``per_worker``, a collection of fewer rows than workers gets one block per row, on the
    fastest workers, and an empty one a single empty block (also with ``align`` above 1); with it, or with
    ``align`` above 1, too few rows are an error."""
    rec = await setup(c, s, [1.0, 3.0, 2.0])
    _, fastest, second = sorted(s.workers)
    x = da.arange(8).reshape(2, 4).rechunk((2, 2))
    y = await run_balance(c, x)
    assert y.chunks == ((1, 1), (2, 2))
    assert s.plugins["octopus"].placement.plans[y.name].workers == [fastest, second]
    np.testing.assert_array_equal(await c.compute(y + 1), np.arange(8).reshape(2, 4) + 1)
    assert {k[1]: w for k, w in per_block_tasks(rec).items() if "add" in key_split(k)} == {0: fastest, 1: second}
    pdf = pd.DataFrame({"a": [5]})
    df = await run_balance(c, dd.from_pandas(pdf, npartitions=1))
    assert s.plugins["octopus"].placement.made[-1][1].workers == [fastest]
    pd.testing.assert_frame_equal(await c.compute(df), pdf)
    assert {w for k, w in rec.worker.items() if key_split(k) == "octopus-rows"} == {fastest}
    empty = await run_balance(c, x[:0])
    assert empty.chunks == ((0,), (2, 2))
    assert (await c.compute(empty)).shape == (0, 4)
    none = await run_balance(c, dd.from_pandas(pdf.iloc[:0], npartitions=1))
    pd.testing.assert_frame_equal(await c.compute(none), pdf.iloc[:0])
    with pytest.raises(PlanningError, match="2 rows are fewer than the 3 workers x per_worker=1 blocks"):
        await run_balance(c, x, per_worker=1)
    with pytest.raises(PlanningError, match=r"align=2 is larger than the smallest worker.s share \(0.8 of 2\)"):
        await run_balance(c, x, align=2)
    assert (await run_balance(c, x[:0], align=2)).chunks == ((0,), (2, 2))


MEMORY_TOO_SMALL = {"octopus.balance.memory-fraction": 1e-12}


def broken_from_row_5(part):
    if part.index[0] >= 5:
        raise ValueError("rows from 5 are broken")
    return part


@pytest.mark.parametrize("stage", ["input", "plan"])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_dataframe_balance_that_fails_leaves_no_task_behind(c, s, a, b, stage):
    """balance computes a dataframe's partitions to plan it: where a partition fails, or the plan does
    (it does not fit), the error reaches the caller and nothing of the input stays on the scheduler,
    although the error's traceback still refers to the futures balance held."""
    await setup(c, s, [1.0, 1.0])
    df = dd.from_pandas(pd.DataFrame({"a": range(10)}), npartitions=2)
    config = {}
    if stage == "input":
        df, error, match = df.map_partitions(broken_from_row_5), ValueError, "rows from 5 are broken"
    else:
        error, match, config = PlanningError, "does not fit in the workers' memory", MEMORY_TOO_SMALL
    with dask.config.set(config), pytest.raises(error, match=match) as info:
        await run_balance(c, df)
    await async_poll_for(lambda: not s.tasks, timeout=5)
    assert info.value.__traceback__ is not None  # (the traceback, and its frames, are still there)


def sum_of_broken(frame):
    """The sum of ``frame``'s ``v`` through :func:`broken_from_row_5`, computed inside ``annotate``."""
    with dask_octopus.annotate():
        return frame.map_partitions(broken_from_row_5).v.sum().compute()


def test_a_failed_annotated_compute_of_a_balanced_frame_keeps_no_input():
    """A step fails in a fragment; the task that reads it raises the error as it runs. Dask's work stealing
    keeps a task that was running until a task of its prefix finishes in memory (none here), with its run
    spec and what that holds (the blocks' run specs, which held the input partitions' futures: in the
    client's process, where LocalCluster runs the scheduler, the input stayed in the workers' memory)."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as c:
        dask_octopus.register(c, calibrate=False)
        bdf = dask_octopus.balance(dd.from_pandas(pd.DataFrame({"v": np.arange(200.0)}), npartitions=8))
        with pytest.raises(ValueError, match="rows from 5 are broken"):
            sum_of_broken(bdf)
        del bdf
        s = cluster.scheduler
        deadline = time.monotonic() + 5
        while s.tasks and time.monotonic() < deadline:
            gc.collect()  # (the error's traceback, Dask's compute frames among it, is cyclic garbage now)
            time.sleep(0.05)
        assert not s.tasks, sorted({(key_split(k), ts.state) for k, ts in s.tasks.items()})
        assert not any(c.run(lambda dask_worker: len(dask_worker.data)).values())
        assert not s.extensions["stealing"].unknown_durations  # (forgotten tasks)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_bad_input(c, s, a, b):
    x = da.ones((100, 4), chunks=10)
    # a dataframe is computed to be planned: never before the checks, which its error would hide
    df = dd.from_pandas(pd.DataFrame({"a": range(10)}), npartitions=2).map_partitions(never_computed, meta={"a": "i8"})
    for coll in (x, df):
        with pytest.raises(NotRegisteredError, match="not registered"):
            await call(c, coll)
    await setup(c, s, [1.0, 1.0])
    cases = [
        (np.ones(10), {}, TypeError, "expects a dask array or dataframe"),
        (dask.delayed(1), {}, TypeError, "supports dask arrays, dataframes"),
        (x, {"axis": 2}, ValueError, "axis 2 is out of range for a 2-d array"),
        (x, {"axis": "0"}, ValueError, "axis must be an integer, got '0'"),
        (da.ones((4, 3), chunks=1), {"axis": 1, "per_worker": 2}, PlanningError,
         "3 entries along axis 1 are fewer than the 2 workers"),
        (x[x[:, 0] > 0], {}, ValueError, "compute_chunk_sizes"),
        (da.ones(3, chunks=1), {"per_worker": 2}, PlanningError, "fewer than the 2 workers"),
        (da.ones(1, chunks=1), {"per_worker": 1}, PlanningError, "^1 row is fewer than the 2 workers x per_worker=1"),
        (da.ones((4, 1), chunks=1), {"axis": 1, "per_worker": 1}, PlanningError,
         "^1 entry along axis 1 is fewer than the 2 workers"),
        (x, {"per_worker": 0}, ValueError, "per_worker must be an integer >= 1"),
        (x, {"per_worker": 2.0}, ValueError, "per_worker must be an integer >= 1"),
        (x, {"align": 60}, PlanningError, "align=60 is larger"),
        (x, {"align": 0}, PlanningError, "align must be an integer >= 1, got 0"),  # per_worker=None too
        (df, {"align": 0}, PlanningError, "align must be an integer >= 1, got 0"),
        (df, {"per_worker": 0}, ValueError, "per_worker must be an integer >= 1"),
        (x, {"resource": "disk"}, ValueError, "unknown resource 'disk'"),
        (dd.from_pandas(pd.DataFrame({"a": range(10)}), npartitions=2), {"axis": 1}, ValueError, "axis must be 0"),
        (df.index, {}, TypeError, "not a dask Index: balance the dataframe or series it indexes"),  # never computed
    ]
    for coll, kwargs, exc, match in cases:
        with pytest.raises(exc, match=match):
            await call(c, coll, **kwargs)
    assert (await call(c, x, per_worker=np.int64(2))).numblocks == (4, 1)  # NumPy's integers are integers
    with dask.config.set(MEMORY_TOO_SMALL), pytest.raises(PlanningError, match="does not fit in the workers' memory"):
        await call(c, x)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_kept_empty_partition_and_a_whole_float_align_give_the_same_rows(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    first, second = sorted(s.workers)
    pdf = pd.DataFrame({"v": np.arange(30.0)}, index=np.arange(30))
    parts = [pdf.iloc[0:10], pdf.iloc[0:0], pdf.iloc[20:25], pdf.iloc[25:30]]  # 10 | 0 | 5 | 5: kept as they are
    futures = [await c.scatter(p, workers=[w]) for p, w in zip(parts, [first, first, second, second])]
    df = dd.from_delayed(futures, meta=pdf.iloc[:0], verify_meta=False)
    kept = await run_balance(c, df)
    assert list(await c.compute(kept.map_partitions(len))) == [10, 0, 5, 5]
    pd.testing.assert_frame_equal(await c.compute(kept), pd.concat(parts))
    frame = dd.from_pandas(pd.DataFrame({"v": np.arange(400.0)}), npartitions=4)
    aligned_ = await run_balance(c, frame, align=4.0, per_worker=3)  # 4.0 is the integer 4
    lengths = list(await c.compute(aligned_.map_partitions(len)))
    assert sum(lengths) == 400 and all(n % 4 == 0 for n in lengths)
    pd.testing.assert_frame_equal(await c.compute(aligned_), frame.compute(scheduler="sync"))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_worker_that_joins_is_used_by_the_next_balance(c, s, a):
    await c.register_plugin(OctopusSchedulerPlugin(calibrate=False))
    x = da.ones((100, 2), chunks=10)
    assert len((await call(c, x, per_worker=1)).chunks[0]) == 1
    from distributed import Worker

    async with Worker(s.address, nthreads=1):
        await c.wait_for_workers(2)
        y = await call(c, x, per_worker=1)
        assert y.chunks[0] == (50, 50)
        assert (await c.compute(y.sum())) == 200


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_blocks_close_to_the_plan_are_kept_and_only_pinned(c, s, a, b):
    rec = await setup(c, s, [1.0, 1.01])
    x = da.ones((1000, 4), chunks=(500, 4))
    y = await run_balance(c, x)
    assert y.chunks == x.chunks and "rechunk" not in str(dict(y.dask))  # nothing moves for a 1% gain
    assert await c.compute(y.sum()) == 4000
    planned = s.plugins["octopus"].placement.plans[y.name].workers
    assert sorted(planned) == sorted(s.workers)
    blocks = per_block_tasks(rec, skip=("finalize",))
    assert len(blocks) >= 2 and all(w == planned[k[1]] for k, w in blocks.items()), blocks
    assert {k for k in rec.restricted if isinstance(k, tuple)} >= set(blocks)  # pinned, not placed by luck


def reversed_layout(s, n_blocks):
    """Annotations putting the first half of ``n_blocks`` row blocks on the last worker by address and
    the rest on the first: the opposite of the sorted order."""
    last, first = sorted(s.workers)[::-1]
    return dask.annotate(workers=lambda k: [last] if k[1] < n_blocks // 2 else [first])


def slowly(block):
    time.sleep(0.2)
    return block


@pytest.mark.parametrize("waited", [True, False])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_kept_blocks_stay_on_the_workers_that_hold_them(c, s, a, b, waited):
    await setup(c, s, [1.0, 1.0])
    with reversed_layout(s, 4):
        x = da.random.random((1000, 4), chunks=(250, 4)).map_blocks(slowly, dtype=float)
    x = c.persist(x, optimize_graph=False)
    if waited:
        await wait(x)
    y = c.persist(await run_balance(c, x))  # not waited for: balance waits for the blocks to know where they are
    await wait(y)
    held = {k: ws for k, ws in (await c.who_has(x)).items()}
    assert held[(x.name, 0, 0)] == (max(s.workers),)  # the layout is the reverse of the sorted workers
    assert y.chunks == x.chunks
    planned = s.plugins["octopus"].placement.plans[y.name].workers
    assert planned == [held[(x.name, i, 0)][0] for i in range(4)]
    assert {k[1]: ws for k, ws in (await c.who_has(y)).items()} == {i: held[(x.name, i, 0)] for i in range(4)}
    assert all(len(ws) == 1 for ws in (await c.who_has(x)).values())  # no block was copied to the other worker
    assert np.array_equal(*await c.gather(c.compute([y, x])))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_re_chunk_gives_each_worker_the_rows_next_to_those_it_holds(c, s, a, b):
    last = max(s.workers)
    await setup(c, s, [1.0, 3.0])  # the last worker by address is three times faster
    with reversed_layout(s, 2):
        x = da.random.random((1000, 4), chunks=(500, 4))
    x = c.persist(x, optimize_graph=False)
    await wait(x)
    y = await run_balance(c, x, per_worker=1)
    planned = s.plugins["octopus"].placement.plans[y.name].workers
    # it holds rows 0-499, so it takes the first 750 rows: 250 rows move (750 if it took the last ones)
    assert planned[0] == last and y.chunks[0] == (750, 250)
    assert np.array_equal(*await c.gather(c.compute([y, x])))


@pytest.mark.parametrize("blocks", [2, 4])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_re_chunk_moves_only_the_rows_that_change_worker(c, s, a, b, blocks):
    rec = await setup(c, s, [1.0, 3.0])
    with reversed_layout(s, blocks):
        x = da.random.random((4000, 100), chunks=(4000 // blocks, 100))
    x = c.persist(x, optimize_graph=False)
    await wait(x)
    held = {k[1]: ws[0] for k, ws in (await c.who_has(x)).items()}
    y = await run_balance(c, x, per_worker=4)
    planned = s.plugins["octopus"].placement.plans[y.name].workers
    # smaller blocks than the input's: some are one slice of an input block held by the other worker
    assert len(planned) == 8 and y.chunks[0] != x.chunks[0]
    ends = np.cumsum(y.chunks[0])
    away = sum(max(0, min(end, (j + 1) * x.chunks[0][0]) - max(end - size, j * x.chunks[0][0]))
               for i, (end, size) in enumerate(zip(ends, y.chunks[0]))
               for j in held if held[j] != planned[i])
    slices = {k: next(iter(node.dependencies)) for k, node in y.dask.items()
              if key_split(k) == "rechunk-split"}
    for w in (a, b):
        w.transfer_incoming_log.clear()
    y = c.persist(y)
    await wait(y)
    moved = sum(e["total"] for w in (a, b) for e in w.transfer_incoming_log)
    assert moved == away * 100 * 8  # the rows that change worker, not the input blocks they are in
    assert all(len(ws) == 1 for ws in (await c.who_has(x)).values())  # no input block was copied
    ran = {k: w for k, w in rec.worker.items() if k in slices}
    assert ran and all(w == held[slices[k][1]] for k, w in ran.items())  # each slice where its block is
    assert np.array_equal(*await c.gather(c.compute([y, x])))


def frame_part(i, rows=2000):
    return pd.DataFrame({"a": np.arange(i * rows, (i + 1) * rows, dtype=float), "b": 1.0})


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_dataframe_re_chunk_moves_only_the_rows_that_change_worker(c, s, a, b):
    rec = await setup(c, s, [1.0, 3.0])
    first, last = sorted(s.workers)  # the last is three times faster: it takes 1000 of the other's rows
    parts = [c.submit(frame_part, i, workers=[last if i == 0 else first]) for i in range(2)]
    await wait(parts)
    df = dd.from_delayed(parts, meta=frame_part(0, 0), verify_meta=False)
    y = await run_balance(c, df, per_worker=4)
    for w in (a, b):
        w.transfer_incoming_log.clear()
    y = c.persist(y)
    await wait(y)
    moved = {k: e["total"] for w in (a, b) for e in w.transfer_incoming_log for k in e["keys"]}
    assert moved and {key_split(k) for k in moved} == {"octopus-slice"}  # slices, not the partitions
    assert sum(moved.values()) < sizeof(frame_part(1)) * 0.6  # 1000 of its 2000 rows
    (holder,) = (await c.who_has(parts[1]))[parts[1].key]
    assert {w for k, w in rec.worker.items() if key_split(k) == "octopus-slice"} == {holder}  # cut where it is
    got = (await c.compute(y)).sort_values("a")
    assert np.array_equal(got.a.values, np.arange(4000.0))


@pytest.mark.parametrize("numpy", [True, False])
def test_a_slice_planned_away_from_its_input_block_stays_out_of_fusion(numpy):
    from dask.array.optimization import optimize

    from dask_octopus._compat import Alias
    from dask_octopus.placement.blocks import _pieces_cut_where_held
    from dask_octopus.placement.unfused import UnfusedTask

    x = da.ones((4000, 10), chunks=(2000, 5))
    y = x.rechunk(((750,) * 4 + (250,) * 4, (5, 5)), method="tasks")
    # the input's blocks by (row, column) block: its first row slab split between workers A and B, the
    # last block held by both; the first four row blocks planned on B, the others on A
    held = {(x.name, 0, 0): ("A",), (x.name, 0, 1): ("B",), (x.name, 1, 0): ("B",), (x.name, 1, 1): ("B", "A")}
    z, pieces = _pieces_cut_where_held(y, 0, held, ["B"] * 4 + ["A"] * 4, numpy=numpy)
    layer = dict(z.dask.layers[z.name])

    def slice_of(i, j):
        node = layer[(z.name, i, j)]
        return None if isinstance(node, Alias) else layer[next(iter(node.dependencies))]

    # one slice each: (0, 0) of A's block for B and (5, 0) of B's block for A are away; (0, 1) is B's
    # own; (3, 1) and (5, 1) slice the block both hold
    away = {(0, 0), (5, 0)}
    for i, j in [(0, 0), (0, 1), (3, 1), (5, 0), (5, 1)]:
        node, piece = layer[(z.name, i, j)], slice_of(i, j)
        if (i, j) in away or numpy:  # through aligned (NumPy: all; a view of a received message)
            assert node.func is aligned and (type(piece) is UnfusedTask) == ((i, j) in away), (i, j)
        else:  # Dask's alias of the slice, which fusion merges into the block's task
            assert isinstance(node, Alias), (i, j)
    first = next(iter(layer[(z.name, 0, 0)].dependencies))
    assert pieces == first[0] and key_split(pieces) == "rechunk-split"
    fused = optimize(z.__dask_graph__(), z.__dask_keys__())
    assert first in fused  # Dask's low-level fusion left the slice on its own
    assert np.array_equal(z.compute(), np.ones((4000, 10)))


def test_aligned_copies_only_a_block_whose_data_is_not_aligned():
    raw = np.zeros(8 * 100 + 4, dtype=np.uint8)
    view = raw[4:].view(np.float64).reshape(10, 10)  # data 4 bytes past an 8-byte boundary
    view[:] = np.arange(100).reshape(10, 10)
    assert not view.flags.aligned
    fixed = aligned(view)
    assert fixed.flags.aligned and np.array_equal(fixed, view)
    ok = np.ones((3, 3))
    assert aligned(ok) is ok


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_re_chunked_numpy_blocks_pass_through_aligned_and_keep_their_values(c, s, a, b):
    await setup(c, s, [1.0, 3.0])
    x = da.random.random((40000, 64), chunks=(20000, 64))
    y = await run_balance(c, x, per_worker=1)
    assert y.chunks[0] == (10000, 30000)
    # the first block is one piece of the input's first block, which Dask's rechunk gives as a view
    first, second = y.dask[(y.name, 0, 0)], y.dask[(y.name, 1, 0)]
    assert first.func is aligned and len(first.dependencies) == 1
    assert second.func is not aligned  # joined from two pieces: a new array
    assert np.array_equal(await c.compute(y), await c.compute(x))


def run_out_of_memory(block):
    raise MemoryError("cannot allocate the block")


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_out_of_memory_on_a_planned_block_names_worker_size_and_remedy(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    data = da.arange(128_000.0, chunks=64_000).reshape(1000, 128)  # real memory (da.ones broadcasts)
    x = c.persist(await run_balance(c, data))
    await wait(x)
    with pytest.raises(MemoryError) as info:
        await c.compute(x.map_blocks(run_out_of_memory, dtype=float).sum())
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert ("worker tcp://" in note and "0.5 MiB" in note and "per_worker=2" in note
            and "octopus.balance.memory-fraction" in note), note


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_out_of_memory_in_a_fragment_names_the_step_and_the_fragment_remedy(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    data = da.arange(128_000.0, chunks=64_000).reshape(1000, 128)
    x = c.persist(await run_balance(c, data, per_worker=4))
    await wait(x)
    with dask_octopus.annotate():
        y = x.map_blocks(run_out_of_memory, dtype=float)
    with pytest.raises(MemoryError) as info:
        await c.compute(y.sum())  # the step failed in its fragment; the task that read it raised it
    notes = getattr(info.value, "__notes__", [])
    assert notes[0].startswith("dask_octopus: raised by task ('sum-") and "of a fragment" in notes[0], notes  # fused
    assert ("the task named above ran out of memory in a fragment" in notes[1]
            and "octopus.fragments.max-bytes (now auto)" in notes[1] and "per_worker=2" in notes[1]), notes
    assert not any("whose inputs hold" in n for n in notes), notes  # (the reader's, not the step's)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_dataframe_cuts_move_to_value_boundaries_and_keep_divisions(c, s, a, b):
    await setup(c, s, [3.0, 1.0])
    pdf = pd.DataFrame({"a": np.arange(5000), "b": np.arange(5000) * 0.5}, index=np.repeat(np.arange(50), 100))
    df = c.persist(dd.from_pandas(pdf, npartitions=4), workers=[min(s.workers)])  # the fast worker holds all rows
    await wait(df)
    assert df.known_divisions
    bdf = await run_balance(c, df, per_worker=1)  # planned 3750 | 1250: the cut falls inside the run of value 37
    assert bdf.npartitions == 2 and bdf.known_divisions, bdf.divisions
    parts = await c.gather(c.compute(bdf.to_delayed()))
    assert list(bdf.divisions[:-1]) == [p.index[0] for p in parts]
    assert bdf.divisions[-1] == 49
    assert all(abs(len(p) - n) <= 50 for p, n in zip(parts, [3750, 1250]))  # the nearer end of a 100-row run
    assert all(len(p) % 100 == 0 for p in parts)
    pd.testing.assert_frame_equal(await c.compute(bdf), pdf)


@pytest.mark.parametrize("cap, lengths", [(None, [3800, 1200]), (3790, [3700, 1300])])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, worker_kwargs={"memory_limit": 2**32})
async def test_dataframe_cut_moves_to_the_farther_end_where_the_nearer_is_over_a_cap(c, s, a, b, cap, lengths):
    await setup(c, s, [3770.0, 1230.0])
    pdf = pd.DataFrame({"a": np.arange(5000), "b": np.arange(5000) * 0.5}, index=np.repeat(np.arange(50), 100))
    df = c.persist(dd.from_pandas(pdf, npartitions=4), workers=[min(s.workers)])
    await wait(df)
    row_bytes = pdf.memory_usage(deep=True).sum() / len(pdf)  # 24: the caps are whole rows of this size
    fraction = (cap + 0.5) * row_bytes / 2**32 if cap else 0.6
    with dask.config.set({"octopus.balance.memory-fraction": fraction}):
        bdf = await run_balance(c, df, per_worker=1)  # planned 3770 | 1230: the cut is 30 rows from the run's end
    parts = await c.gather(c.compute(bdf.to_delayed()))
    assert [len(p) for p in parts] == lengths  # with a cap of 3790 rows each, the fast worker takes 3700
    assert bdf.known_divisions and list(bdf.divisions) == [0, lengths[0] // 100, 49]
    pd.testing.assert_frame_equal(await c.compute(bdf), pdf)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_dataframe_cuts_stay_multiples_of_align_where_index_boundaries_are_not(c, s, a, b):
    await setup(c, s, [1.0, 3.0])
    pdf = pd.DataFrame({"v": range(64)}, index=np.arange(64) // 3)  # runs of three equal values
    df = dd.from_pandas(pdf, npartitions=1)
    snapped = await run_balance(c, df, per_worker=2)  # align 1: the cuts (8, 16, 40 or 24, 48, 56) move
    parts = await c.gather(c.compute(snapped.to_delayed()))  # to the runs' ends, multiples of 3
    cuts = np.cumsum([len(p) for p in parts])[:-1]
    assert all(n % 3 == 0 for n in cuts) and snapped.known_divisions, cuts
    aligned4 = await run_balance(c, df, per_worker=2, align=4)
    parts = await c.gather(c.compute(aligned4.to_delayed()))
    assert all(len(p) % 4 == 0 for p in parts[:-1]), [len(p) for p in parts]  # were 9, 6, 24, 25
    assert not aligned4.known_divisions  # a cut inside a run of equal values: divisions unknown
    pd.testing.assert_frame_equal(await c.compute(aligned4), pdf)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_balanced_frame_converts_to_arrays(c, s, a, b):
    """``to_dask_array``, ``.values`` and ``to_records`` of a balanced frame (with divisions, a cut inside a
    partition): each raised Dask's "lost dependencies" (or "Cycle detected" with ``lengths=True``) where
    the frame was Dask's ``from_delayed`` over the blocks; computed twice, the frame holding its inputs."""
    rec = await setup(c, s, [3.0, 1.0])
    pdf = pd.DataFrame({"v": np.arange(100.0), "w": np.arange(100.0) * 2})
    bdf = await run_balance(c, dd.from_pandas(pdf, npartitions=2), per_worker=1)  # 75 | 25 rows
    assert bdf.known_divisions and bdf.npartitions == 2
    for _ in range(2):
        np.testing.assert_array_equal(await c.compute(bdf.to_dask_array()), pdf.to_numpy())
        with_lengths = await asyncio.get_running_loop().run_in_executor(None, lambda: bdf.to_dask_array(lengths=True))
        assert sorted(with_lengths.chunks[0]) == [25, 75]
        np.testing.assert_array_equal(await c.compute(with_lengths), pdf.to_numpy())
        np.testing.assert_array_equal(await c.compute(bdf.v.values), pdf.v.to_numpy())
        np.testing.assert_array_equal(await c.compute(bdf.to_records()), pdf.to_records())
    (name, plan), = s.plugins["octopus"].placement.plans.items()
    assert [rec.worker[name, j] for j in range(2)] == plan.workers  # each block where planned


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_balanced_frame_dropped_after_a_compute_leaves_nothing_behind(c, s, a, b):
    """The frame's tasks read its input partitions by key: where they held their futures as arguments, the
    scheduler (in this process, as LocalCluster's) kept them in its log of the messages it sent the
    workers, and the partitions stayed in memory until 1,000 more messages pushed them out."""
    await setup(c, s, [3.0, 1.0])
    pdf = pd.DataFrame({"v": np.arange(100.0)})
    bdf = await run_balance(c, dd.from_pandas(pdf, npartitions=4), per_worker=1)
    assert await c.compute(bdf.v.sum()) == pdf.v.sum()
    del bdf
    await async_poll_for(lambda: not s.tasks and not a.data and not b.data, timeout=5)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_cuts_on_edges_with_empty_partitions_keep_the_input_s_unique_divisions(c, s, a, b):
    """Each worker holds its half and an empty partition after it: the plan keeps the blocks (two of no
    rows). Each cut on an edge where empty partitions sit takes its own division; they took the first
    division after the empty ones, each alike (0, 1000, 1000, 1999, 1999), which Dask refuses to
    repartition to."""
    await setup(c, s, [1.0, 1.0])
    pdf = pd.DataFrame({"v": np.arange(1000.0)}, index=pd.Index(np.arange(1000) * 2, name="i"))
    pieces = [pdf.iloc[:500], pdf.iloc[:0], pdf.iloc[500:], pdf.iloc[:0]]
    futures = [await c.scatter(p, workers=[w]) for p, w in zip(pieces, [a.address, a.address, b.address, b.address])]
    divisions = (0, 999, 1000, 1998, 1999)  # of the empty partitions: (999, 1000) and (1998, 1999)
    df = dd.from_delayed(futures, meta=pdf.iloc[:0], divisions=divisions)
    bdf = await run_balance(c, df)
    assert (await c.compute(bdf.map_partitions(len))).tolist() == [500, 0, 500, 0]  # kept
    assert bdf.divisions == divisions
    pd.testing.assert_frame_equal(await c.compute(bdf.repartition(divisions=list(bdf.divisions))), pdf)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_dataframe_cuts_that_cannot_move_leave_divisions_unknown(c, s, a, b):
    await setup(c, s, [3.0, 1.0])
    pdf = pd.DataFrame({"a": np.arange(100)}, index=np.repeat([0, 1], [30, 70]))
    df = c.persist(dd.from_pandas(pdf, npartitions=2), workers=[min(s.workers)])  # the fast worker holds all rows
    await wait(df)
    assert df.known_divisions
    bdf = await run_balance(c, df, per_worker=2)  # planned 38, 37, 13, 12: all three cuts inside the run of 1
    assert bdf.npartitions == 4 and not bdf.known_divisions and bdf.divisions == (None,) * 5
    lengths = await c.compute(bdf.map_partitions(len))
    assert list(lengths) == [38, 37, 13, 12]  # the plan is kept as it is
    pd.testing.assert_frame_equal(await c.compute(bdf), pdf)


calls = []


def counted(part):
    calls.append(len(part))
    return part * 2


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_dataframe_is_computed_once_by_balance_and_its_compute(c, s, a, b):
    await setup(c, s, [3.0, 1.0])
    pdf = pd.DataFrame({"a": np.arange(800.0)})
    df = dd.from_pandas(pdf, npartitions=8).map_partitions(counted)
    calls.clear()
    bdf = await run_balance(c, df)
    assert sorted(calls) == [100] * 8  # planning needs the rows of every partition
    assert await c.compute(bdf.a.sum()) == (pdf.a * 2).sum()
    pd.testing.assert_frame_equal(await c.compute(bdf), pdf * 2)
    assert sorted(calls) == [100] * 8  # ... and nothing runs the input again
    persisted = c.persist(dd.from_pandas(pdf, npartitions=8).map_partitions(counted))
    await wait(persisted)
    calls.clear()
    bdf = await run_balance(c, persisted)  # already persisted: nothing runs again
    assert calls == [] and await c.compute(bdf.a.sum()) == (pdf.a * 2).sum() and calls == []


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_no_planned_block_is_larger_than_the_users_largest_block(c, s, a, b):
    await setup(c, s, [3.5, 1.0])
    x = da.random.default_rng(2).random((1600, 8), chunks=(800, 8))  # two blocks, as Dask chunked it
    y = await run_balance(c, x)
    assert max(y.chunks[0]) <= 800 and len(y.chunks[0]) == 3  # 1244 rows for the fast worker: 2 blocks
    plan = s.plugins["octopus"].placement.plans[y.name].workers
    fast, slow = sorted(s.workers)
    assert plan == [fast, fast, slow] and sum(y.chunks[0][:2]) == 1244  # and 356 in one for the slow one
    np.testing.assert_array_equal(await c.compute(y.sum(axis=1)), await c.compute(x.sum(axis=1)))
    pdf = pd.DataFrame({"a": np.arange(900.0)})
    bdf = await run_balance(c, dd.from_pandas(pdf, npartitions=9))  # partitions of 100 rows
    lengths = await c.compute(bdf.map_partitions(len))
    assert max(lengths) <= 100 and sum(lengths) == 900
    assert await run_balance(c, x, per_worker=1) is not None  # asked for: one block per worker, 1244 rows


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_an_array_of_fewer_rows_than_the_slow_worker_s_share_of_one_takes_one_row_there(c, s, a, b):
    await setup(c, s, [3.0, 1.0])
    x = da.arange(3, chunks=1)  # the slow worker's share: 0.75 rows
    y = await run_balance(c, x)
    fast, slow = sorted(s.workers)
    assert y.chunks == ((1, 1, 1),) and s.plugins["octopus"].placement.plans[y.name].workers == [fast, fast, slow]
    np.testing.assert_array_equal(await c.compute(y), np.arange(3))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
async def test_a_lost_worker_blocks_go_to_the_survivors_in_proportion_to_their_weights(c, s, a, b, w):
    await setup(c, s, [3.0, 1.0, 1.0])
    first, second, third = sorted(s.workers)
    plugin = s.plugins["octopus"]
    plugin.add_plan("planned", [third] * 10)  # ten blocks, all on the worker that will leave
    await (a, b, w)[[x.address for x in (a, b, w)].index(third)].close()
    await async_poll_for(lambda: third not in s.workers, timeout=10)
    moved = plugin.placement.plans["planned"].workers
    assert moved.count(first) == 8 and moved.count(second) == 2  # 3:1 of ten, largest remainder to the faster


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, worker_kwargs={"memory_limit": "6 MB"},
             config={"distributed.worker.memory.target": False, "distributed.worker.memory.spill": False,
                     "distributed.worker.memory.pause": False, "distributed.worker.memory.terminate": False})
async def test_a_worker_is_planned_no_more_than_its_memory_allows(c, s, a, b):
    await setup(c, s, [3.0, 1.0])
    x = da.ones((100_000, 8), chunks=(50_000, 8))  # 6.4 MB; each worker may hold 0.6 x 6 MB = 3.6 MB
    y = await run_balance(c, x, per_worker=1)
    assert y.chunks[0] == (56_250, 43_750)  # the faster worker's 75,000 rows capped at 3.6 MB / 64 B
    assert await c.compute(y.sum()) == 800_000
    with dask.config.set({"octopus.balance.memory-fraction": 0.3}), \
            pytest.raises(PlanningError, match="does not fit in the workers' memory"):
        await run_balance(c, x, per_worker=1)  # 2 x 1.8 MB < 6.4 MB


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1, {"memory_limit": "2 MB"}),
                                    ("127.0.0.1", 1, {"memory_limit": "4 GB"})],
             config={"distributed.worker.memory.target": False, "distributed.worker.memory.spill": False,
                     "distributed.worker.memory.pause": False, "distributed.worker.memory.terminate": False})
async def test_a_worker_too_small_for_one_block_gets_none_and_the_others_all(c, s, a, b):
    """A worker whose share of memory is below its fewest rows (one block, ``per_worker`` blocks, ``align``
    rows each) gets no blocks, with a warning naming it; the others take them all (it failed the whole
    plan: "a cap is below its minimum"). Where none can hold its fewest rows, the error says so."""
    rec = await setup(c, s, [1.0, 1.0])
    x = da.ones((40, 2**18), chunks=(10, 2**18))  # rows of 2 MiB; a may hold 0.6 x 2 MB: no row
    for options in ({}, {"per_worker": 2}, {"align": 4}):
        with pytest.warns(UserWarning, match=f"balance: {a.address} can hold 0.0 B .* it gets no blocks") as caught:
            y = await run_balance(c, x, **options)
        assert {w.filename for w in caught if "it gets no blocks" in str(w.message)} == {__file__}  # the caller's
        assert set(s.plugins["octopus"].placement.plans[y.name].workers) == {b.address}, options
        z = c.persist(y + 1)
        assert await c.compute(z.sum()) == 2 * 40 * 2**18
        assert {rec.worker[k] for k in flatten(z.__dask_keys__())} == {b.address}, options
        del z
    # rows of 1 MiB: a may hold one, b 2288; a row more than b may hold fits both, but a's one row is not
    # the two blocks of per_worker=2: a is left out, and what is left does not fit
    with pytest.warns(UserWarning, match="it gets no blocks"), pytest.raises(
            PlanningError, match=r"does not fit in the workers' memory \(of those that can hold a block\): they can "
                                 r"hold 2.23 GiB"):
        await run_balance(c, da.ones((2289, 2**17), chunks=(327, 2**17)), per_worker=2)
    fits = da.ones((1144, 2**18), chunks=(286, 2**18))  # what b may hold: 0.6 x 4 GB in rows of 2 MiB
    with pytest.raises(PlanningError, match=r"no worker can hold its fewest rows \(1200, 2.34 GiB\)"):
        await run_balance(c, fits, per_worker=2, align=600)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_gpu_worker_with_no_free_memory_gets_no_blocks(c, s, a, b):
    """A GPU worker calibrated with its memory all taken (by another process) may hold nothing: it gets no
    blocks (with no cap known it would have been planned as if its memory had no end)."""
    await setup(c, s, [1.0, 1.0])
    s.plugins["octopus"].profiles[a.address].update(device="gpu", memory_free=0)
    with pytest.warns(UserWarning, match=f"balance: {a.address} can hold 0.0 B"):
        y = await run_balance(c, da.ones((40, 8), chunks=10))
    assert set(s.plugins["octopus"].placement.plans[y.name].workers) == {b.address}
    assert await c.compute(y.sum()) == 320


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config={"octopus.max-plans": 2})
async def test_blocks_of_a_dropped_plan_run_again_elsewhere_when_their_worker_leaves(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    y = await c.persist(await run_balance(c, da.arange(40, chunks=10)))
    held = []  # the maps' futures: their plans stay while their tasks do (gathered, they may go at any time)
    for k in range(2):  # two newer plans: y's is dropped (octopus.max-plans), its pins stay
        held += await asyncio.get_running_loop().run_in_executor(
            None, lambda k=k: dask_octopus.map(abs, [-k, -2, -3], client=c))
    placement = s.plugins["octopus"].placement
    assert len(placement.plans) == 2 and y.name not in placement.plans
    assert any(key_split(k) == key_split(y.name) for k in placement.pins)
    await s.remove_worker(address=a.address, stimulus_id="test", close=True)  # y's blocks there: lost
    assert await asyncio.wait_for(c.compute(y.sum()), 30) == 780
    assert not s.unrunnable


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config={"octopus.max-plans": 4})
async def test_maps_whose_tasks_the_user_restricted_push_no_plan_out(c, s, a, b):
    """``map`` under ``dask.annotate(workers=...)``: no task of it is pinned, so no pin retires its plan;
    kept, such plans pushed a balanced collection's plan out (``octopus.max-plans``)."""
    await setup(c, s, [1.0, 1.0])
    y = await c.persist(await run_balance(c, da.arange(40, chunks=10)))
    placement = s.plugins["octopus"].placement

    def restricted(k):
        with dask.annotate(workers=[a.address]):  # (in the thread that calls map: annotations are per thread)
            return dask_octopus.map(abs, [-k, -2, -3], client=c, gather=True)

    for k in range(4):
        assert await asyncio.get_running_loop().run_in_executor(None, restricted, k) == [k, 2, 3]
        assert not any(name.startswith("abs-octopus-map") for name, _ in placement.pins.values())
    await async_poll_for(lambda: list(placement.plans) == [y.name], timeout=10)  # (the last map's tasks: released)
    assert any(name.startswith("abs-octopus-map") for name in placement._retired)  # (their timings: costs)


def waits_for_go(x):
    Event("go").wait()
    return x


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2), ("127.0.0.1", 1)], config={"octopus.max-plans": 4})
async def test_a_map_whose_tasks_the_user_restricted_keeps_its_plan_while_they_run(c, s, a, b, monkeypatch):
    """Its plan retires when Dask forgot its tasks, not as they arrive: retired at once, maps that ended
    meanwhile pushed it out of the retired plans (the latest 64), and its own timings found no cost."""
    from dask_octopus.placement import pins

    monkeypatch.setattr(pins, "RETIRED", 1)
    await setup(c, s, [1.0, 1.0])
    placement = s.plugins["octopus"].placement

    def restricted():
        with dask.annotate(workers=[a.address]):  # (in the thread that calls map: annotations are per thread)
            return dask_octopus.map(waits_for_go, [1], client=c)

    (future,) = await asyncio.get_running_loop().run_in_executor(None, restricted)
    for k in range(3):
        assert await asyncio.get_running_loop().run_in_executor(
            None, lambda k=k: dask_octopus.map(abs, [-k, -2, -3], client=c, gather=True)) == [k, 2, 3]
    assert placement.cost_of(future.key) == (1.0, 1)
    assert not any(name.startswith("waits_for_go") for name, _ in placement.pins.values())
    await Event("go").set()
    assert await future == 1
    del future
    await async_poll_for(lambda: not any(n.startswith("waits_for_go") for n in placement.plans), timeout=10)
    assert any(n.startswith("waits_for_go") for n in placement._retired) and not placement._unpinned_tasks


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_blocks_pinned_by_an_unregistered_plugin_run_again_elsewhere(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    y = await c.persist(await run_balance(c, da.arange(40, chunks=10)))
    plugin = s.plugins["octopus"]
    await c.unregister_scheduler_plugin("octopus")
    await async_poll_for(lambda: not plugin.placement.pins, timeout=10)  # its sampler saw it go: pins loose
    await a.close()
    assert await asyncio.wait_for(c.compute(y.sum()), 30) == 780
    assert not s.unrunnable


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_an_array_balanced_along_each_axis_keeps_both_plans(c, s, a, b):
    rec = await setup(c, s, [1.0, 1.0])
    x = c.persist(da.arange(64.0, chunks=16).reshape(8, 8).rechunk(4))  # 2 x 2 blocks, as planned
    rows = await run_balance(c, x, axis=0, per_worker=1)
    cols = await run_balance(c, x, axis=1, per_worker=1)
    assert rows.chunks == cols.chunks == x.chunks and rows.name != cols.name
    plans = s.plugins["octopus"].placement.plans
    assert (plans[rows.name].index, plans[cols.name].index) == (1, 2)
    for y, axis in ((rows, 0), (cols, 1)):
        rec.worker.clear()
        np.testing.assert_array_equal(await c.compute(y + 1), np.arange(64.0).reshape(8, 8) + 1)
        blocks = {k: w for k, w in rec.worker.items() if isinstance(k, tuple) and key_split(k) == "add"}
        assert len(blocks) == 4
        assert all(w == plans[y.name].workers[k[1 + axis]] for k, w in blocks.items()), blocks


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, Worker=Nanny, timeout=120)
async def test_after_a_restart_the_workers_that_came_back_share_a_plan(c, s, a, b):
    rec = await setup(c, s, [1.0, 1.0])
    x = da.random.default_rng(1).random((800, 30), chunks=(100, 30))
    y = await run_balance(c, x, per_worker=2)
    reference = await c.compute((x * 2 + 1).sum(axis=1))
    await c.restart()  # every worker leaves, new ones join one after the other
    await c.wait_for_workers(2)
    rec.worker.clear()
    np.testing.assert_array_equal(await c.compute((y * 2 + 1).sum(axis=1)), reference)
    plan = s.plugins["octopus"].placement.plans[y.name].workers
    assert sorted(plan) == sorted(2 * list(s.workers))  # not every block on the first to come back
    blocks = per_block_tasks(rec)
    assert len(blocks) >= 4 and all(w == plan[k[1]] for k, w in blocks.items()), blocks


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_blocks_a_survivor_holds_stay_with_it_when_a_worker_joins(c, s, a, b):
    rec = await setup(c, s, [1.0, 1.0])
    y = c.persist(await run_balance(c, da.ones((400, 8), chunks=(50, 8)), per_worker=1))
    await wait(y)
    plans = s.plugins["octopus"].placement.plans
    moved = [i for i, w in enumerate(plans[y.name].workers) if w == b.address]
    assert len(moved) == 1
    await b.close()  # its block is computed again on a
    assert await c.compute(y.sum()) == 400 * 8
    assert plans[y.name].workers == [a.address, a.address]
    async with Worker(s.address, nthreads=1) as newcomer:
        await c.wait_for_workers(2)
        assert plans[y.name].workers == [a.address, a.address]  # y is held on a: its consumers go there
        rec.worker.clear()
        assert await c.compute((y + 1).sum()) == 400 * 8 * 2
        assert {w for k, w in per_block_tasks(rec).items()} == {a.address}
        name = y.name
        del y
        await async_poll_for(lambda: not s.tasks, timeout=10)
        async with Worker(s.address, nthreads=1) as third:  # y released: the moved block is shared again
            await c.wait_for_workers(3)
            now = plans[name].workers  # a keeps its own block (its share); b's goes to a newcomer
            assert [w for i, w in enumerate(now) if i not in moved] == [a.address]
            assert now[moved[0]] in (newcomer.address, third.address)


async def gated_plan(c, s, a, b, gate):
    """Blocks of ones (400 x 8, 8 blocks) that wait for a task on ``a`` until ``gate`` is set (running
    when this returns), balanced two per worker: the gate's future, the balanced array, its plan and
    the indices of ``b``'s blocks."""
    g = c.submit(wait_for_event, gate.name, workers=[a.address], pure=False)
    # (the submit travels on the client's batched stream: the scheduler may not have it yet)
    await async_poll_for(lambda: g.key in s.tasks and s.tasks[g.key].state == "processing", timeout=10)
    x = da.ones((400, 8), chunks=(50, 8)).map_blocks(add_gate, g, dtype=float)
    y = await run_balance(c, x, per_worker=2)
    plan = s.plugins["octopus"].placement.plans[y.name]
    on_b = [i for i, w in enumerate(plan.workers) if w == b.address]
    assert len(on_b) == 2
    return g, y, plan, on_b


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_worker_that_joins_before_moved_blocks_started_takes_its_share_back(c, s, a, b):
    rec = await setup(c, s, [1.0, 1.0])
    gate = Event()
    _g, y, plan, on_b = await gated_plan(c, s, a, b, gate)
    fut = c.compute(y.sum(axis=1))
    await async_poll_for(lambda: fut.key in s.tasks, timeout=10)  # the compute's tasks are there, none started
    await b.close()  # as a nanny restarting it: its blocks move to a, none of them started
    await async_poll_for(lambda: b.address not in s.workers, timeout=10)
    assert plan.workers == [a.address] * 4
    async with Worker(s.address, nthreads=1) as newcomer:
        await c.wait_for_workers(2)
        assert [plan.workers[i] for i in on_b] == [newcomer.address] * 2  # a keeps its own two
        rec.worker.clear()
        await gate.set()
        np.testing.assert_array_equal(await fut, np.full(400, 8.0 * 2))
        blocks = {k: w for k, w in rec.worker.items() if key_split(k).startswith("rechunk-merge")}  # y's, fused
        assert len(blocks) == 4 and all(w == plan.workers[k[1]] for k, w in blocks.items()), blocks
        assert {w for k, w in blocks.items() if k[1] in on_b} == {newcomer.address}


def test_a_worker_that_joins_takes_only_moved_blocks_no_task_of_which_started():
    """Of the blocks moved to a survivor, those with a task processing or done (the block's own, or a
    task pinned with it) stay with it; the others are shared with a worker that joins (the scheduler's
    side alone, on a stand-in scheduler)."""
    placement = Placement()
    placement.add_plan("y", ["a", "b", "b", "b"])
    tasks = {}
    states = {("y", 0): "memory", ("y", 1): "released", ("s", 1): "memory", ("y", 2): "processing", ("y", 3): "waiting"}
    for key, state in states.items():
        placement.pins[key] = ("y", key[1])  # ("s", 1) reads block 1 only: pinned with it
        tasks[key] = task_state(key, state)
    scheduler = Stub(tasks=tasks, unrunnable=[], transitions=lambda *args: None)
    placement.rehome(scheduler, {"a": 1.0}, "b-left")
    assert placement.plans["y"].workers == ["a"] * 4
    placement.rehome(scheduler, {"a": 1.0, "c": 1.0}, "c-joined")
    assert placement.plans["y"].workers == ["a", "a", "a", "c"]  # blocks 1 (its reader ran) and 2 (running) stay
    assert tasks[("y", 3)].worker_restrictions == {"c"} and tasks[("y", 2)].worker_restrictions == {"a"}


def test_blocks_whose_worker_left_go_to_the_survivor_holding_their_data():
    """Dask's retirement moves a leaving worker's data to survivors: each of its blocks held there stays
    with the survivor that holds it, not the one its share would give it (the next compute would
    fetch it back); the blocks held nowhere are shared by weight (the scheduler's side alone)."""
    placement = Placement()
    placement.add_plan("y", ["a", "b", "c", "c"])
    a, b = Stub(address="a"), Stub(address="b")
    held = {("y", 0): {a}, ("y", 1): {b}, ("y", 2): {b}, ("y", 3): set()}  # c's two: one moved to b, one lost
    tasks = {k: task_state(k, "memory" if w else "released", who_has=w, nbytes=800) for k, w in held.items()}
    # a small result pinned with block 2 (a reader's), held on a and met first: the block's own data decides
    tasks[("s", 2)] = task_state(("s", 2), "memory", who_has={a}, nbytes=8)
    placement.pins[("s", 2)] = ("y", 2)
    for key in held:
        placement.pins[key] = key
    scheduler = Stub(tasks=tasks, unrunnable=[], transitions=lambda *args: None)
    placement.rehome(scheduler, {"a": 1.0, "b": 1.0}, "c-retired")
    # by share alone, in block order, block 2 went to a, 3 to b: block 2's data is on b
    assert placement.plans["y"].workers == ["a", "b", "b", "a"]
    assert tasks[("y", 2)].worker_restrictions == {"b"} and tasks[("y", 3)].worker_restrictions == {"a"}
    assert tasks[("s", 2)].worker_restrictions == {"b"}


def test_moved_blocks_that_had_started_are_shared_again_once_forgotten():
    """Blocks moved to a survivor that were running as a worker joined stay with it then; once their
    tasks are forgotten (computed and released), they are shared again, with the joined worker too, when
    the next graph comes (they stayed on the survivor for good: each later compute 1.5x slower)."""
    placement = Placement()
    placement.add_plan("y", ["a", "a", "b", "b"])
    tasks = {("y", i): task_state(("y", i), "processing") for i in range(4)}
    for key in tasks:
        placement.pins[key] = key
    scheduler = Stub(tasks=tasks, unrunnable=[], transitions=lambda *args: None)
    placement.rehome(scheduler, {"a": 1.0}, "b-left")
    placement.forget(("y", 3))
    assert not placement.reshare  # moved, but no worker joined while it ran: nothing to share again
    placement.pins[("y", 3)] = ("y", 3)
    placement.rehome(scheduler, {"a": 1.0, "c": 1.0}, "c-joined")
    assert placement.plans["y"].workers == ["a"] * 4 and not placement.reshare  # all four running
    placement.forget(("y", 0))
    assert not placement.reshare  # a's own block: not moved
    placement.forget(("y", 2))
    assert placement.reshare
    for i in (1, 3):
        placement.forget(("y", i))
    scheduler.tasks.clear()
    placement.rehome(scheduler, {"a": 1.0, "c": 1.0}, "update-graph")
    assert placement.plans["y"].workers == ["a", "a", "c", "c"] and not placement.reshare


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_moved_blocks_running_as_a_worker_joined_are_its_share_at_the_next_compute(c, s, a, b):
    """Blocks moved to a survivor that run there as a worker joins stay with it for that compute; at the
    next, the worker that joined takes its share (they stayed with the survivor for good)."""
    rec = await setup(c, s, [1.0, 1.0])
    first, second = Event(), Event()
    g, y, plan, on_b = await gated_plan(c, s, a, b, first)
    placement = s.plugins["octopus"].placement
    # b's blocks wait on a (a's own run): one runs there as a worker joins, a's one thread busy with it
    fut = c.compute(y.map_blocks(double_waiting_for, second.name, on_b, dtype=float).sum(axis=1))

    def moved():  # the tasks pinned with b's blocks
        return [s.tasks[k] for k, block in list(placement.pins.items()) if block[1] in on_b and k in s.tasks]

    key = fut.key
    await async_poll_for(lambda: key in s.tasks and moved(), timeout=10)
    await b.close()  # its blocks move to a, not started
    assert plan.workers == [a.address] * 4
    await first.set()
    await async_poll_for(lambda: any(ts.state == "processing" for ts in moved()), timeout=10)
    started = {placement.pins[ts.key][1] for ts in moved() if ts.state in ("processing", "memory")}
    async with Worker(s.address, nthreads=1) as newcomer:
        await c.wait_for_workers(2)
        assert {plan.workers[i] for i in started} == {a.address}  # started on a: they stay
        await second.set()
        np.testing.assert_array_equal(await fut, np.full(400, 2 * 8 * 2.0))
        del fut, g
        await async_poll_for(lambda: not moved(), timeout=10)  # computed and forgotten
        rec.worker.clear()
        np.testing.assert_array_equal(await c.compute((y * 3).sum(axis=1)), np.full(400, 3 * 8 * 2.0))
        assert [plan.workers[i] for i in on_b] == [newcomer.address] * 2
        blocks = {k: w for k, w in rec.worker.items() if key_split(k).startswith("rechunk-merge")}  # y's, fused
        assert len(blocks) == 4 and {w for k, w in blocks.items() if k[1] in on_b} == {newcomer.address}, blocks


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3, config=NO_AMM)
async def test_a_retired_worker_s_persisted_blocks_are_pinned_where_dask_moved_them(c, s, a, b, w):
    """Dask's retirement spreads a leaving worker's data over the survivors: its persisted blocks are pinned
    where each went (two of four were pinned to the other survivor, each compute fetched them there)."""
    await setup(c, s, [1.0, 1.0, 1.0])
    x = da.ones((1200, 50), chunks=(100, 50))
    y = c.persist(await run_balance(c, x, per_worker=4))
    await wait(y)
    plan = s.plugins["octopus"].placement.plans[y.name]
    leaving = plan.workers[0]
    await c.retire_workers([leaving])
    await async_poll_for(lambda: leaving not in s.workers, timeout=10)
    keys = [k for k in flatten(y.__dask_keys__())]
    assert all(plan.workers[k[1]] in {ws.address for ws in s.tasks[k].who_has} for k in keys)  # each where it is
    np.testing.assert_array_equal(await c.compute((y + 1).sum(axis=1)), np.full(1200, 100.0))
    # each block read where it is: no copy fetched to another worker (the memory manager is off: it would stay)
    assert all(len(s.tasks[k].who_has) == 1 for k in keys), {k: s.tasks[k].who_has for k in keys}


def double_waiting_for(block, name, waiting, block_info=None):
    """``block * 2``, once the event ``name`` is set for the blocks ``waiting`` (by their row of blocks)."""
    if block_info[None]["chunk-location"][0] in waiting:
        Event(name).wait(30)
    return block * 2


def wait_then_double(block, name):
    Event(name).wait(30)
    return block * 2


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_moved_blocks_that_a_started_fragment_runs_stay_with_it_when_a_worker_joins(c, s, a, b):
    """A fragment task does the work of both of a worker's blocks, pinned under one key: once it runs
    on the survivor that took them, neither block goes to a worker that joins."""
    rec = await setup(c, s, [1.0, 1.0])
    first, second = Event(), Event()
    g, y, plan, _ = await gated_plan(c, s, a, b, first)
    with dask_octopus.annotate():
        fut = c.compute(y.map_blocks(wait_then_double, second.name, dtype=float).sum(axis=1))
    await async_poll_for(lambda: s.tasks[g.key].state == "processing"
                         and any(key_split(k) == FRAGMENT_PREFIX for k in s.tasks), timeout=10)
    fragments = [k for k in s.tasks if key_split(k) == FRAGMENT_PREFIX]
    assert len(fragments) == 2  # one per worker, each with its two blocks
    await b.close()  # its blocks move to a, their fragment not started
    assert plan.workers == [a.address] * 4
    await first.set()
    await async_poll_for(lambda: all(s.tasks[k].state == "processing" for k in fragments), timeout=10)
    async with Worker(s.address, nthreads=1) as newcomer:
        await c.wait_for_workers(2)
        assert plan.workers == [a.address] * 4  # b's blocks are a's fragment's now, started: they stay
        await second.set()
        np.testing.assert_array_equal(await fut, np.full(400, 2 * 8 * 2.0))
        assert {w for k, w in rec.worker.items() if key_split(k) == FRAGMENT_PREFIX} == {a.address}
        assert not any(w == newcomer.address for w in rec.worker.values())


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_tasks_pinned_under_a_replaced_plan_of_the_same_name_move_when_their_worker_leaves(c, s, a, b):
    """Two balance calls of one input that give the same chunks on other workers share Dask's key names
    (the rechunk's name is the input's and the chunks'): the second plan replaces the first. Tasks
    pinned under the first to a worker that then leaves move to a live one, and the compute ends."""
    await setup(c, s, [1.0, 1.0])
    first, second = sorted(s.workers)
    x = da.arange(400.0, chunks=100)
    held = c.persist(x, workers=[second], allow_other_workers=True)  # the second worker takes the first block
    await wait(held)
    y = await run_balance(c, held, per_worker=1)
    assert s.plugins["octopus"].placement.plans[y.name].workers == [second, first]
    go = Event()
    fut = c.compute(y.map_blocks(wait_then_double, go.name, dtype=float).sum())
    await async_poll_for(lambda: any(ts.state == "processing" for ts in s.tasks.values()), timeout=10)
    z = await run_balance(c, x, per_worker=1)  # a graph: the workers in their sorted order
    assert z.name == y.name and s.plugins["octopus"].placement.plans[y.name].workers == [first, second]
    await s.remove_worker(address=second, stimulus_id="test", close=True)
    await go.set()
    assert await asyncio.wait_for(fut, 10) == 2 * np.arange(400.0).sum()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2,
             config={"distributed.worker.memory.pause": False})  # the worker's memory monitor would unpause it
async def test_blocks_of_a_paused_worker_run_elsewhere_until_it_runs_again(c, s, a, b):
    rec = await setup(c, s, [1.0, 1.0])
    x = da.random.default_rng(1).random((800, 30), chunks=(100, 30))
    y = await run_balance(c, x, per_worker=2)
    plan = s.plugins["octopus"].placement.plans[y.name].workers
    reference = await c.compute((x * 2 + 1).sum(axis=1))
    a.status = Status.paused  # its memory is full: Dask sends it no task
    await async_poll_for(lambda: s.workers[a.address].status == Status.paused, timeout=5)
    rec.worker.clear()
    result = await asyncio.wait_for(c.compute((y * 2 + 1).sum(axis=1)), 30)  # without: waits for a forever
    np.testing.assert_array_equal(result, reference)
    assert set(per_block_tasks(rec).values()) == {b.address}
    a.status = Status.running
    await async_poll_for(lambda: s.workers[a.address].status == Status.running, timeout=5)
    reference = await c.compute((x * 3).sum(axis=1))
    rec.worker.clear()
    np.testing.assert_array_equal(await c.compute((y * 3).sum(axis=1)), reference)
    blocks = per_block_tasks(rec)
    assert len(blocks) >= 8 and all(w == plan[k[1]] for k, w in blocks.items()), blocks


def wait_for_event(name):
    Event(name).wait(30)
    return 1.0


def add_gate(block, gate):
    return block + gate


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config={"distributed.worker.memory.pause": False})
async def test_tasks_pinned_to_a_worker_that_pauses_mid_compute_run_elsewhere(c, s, a, b):
    rec = await setup(c, s, [1.0, 1.0])
    x = da.random.default_rng(1).random((800, 30), chunks=(100, 30))
    y = c.persist(await run_balance(c, x, per_worker=2))
    await wait(y)  # held where planned: a's consumers are pinned to a, and only they
    gate = Event()
    g = c.submit(wait_for_event, gate.name, workers=[b.address], pure=False)  # the user's: never pinned
    rec.worker.clear()
    fut = c.compute(y.map_blocks(add_gate, g, dtype=y.dtype).sum(axis=1))  # a's blocks' consumers wait for g
    await async_poll_for(lambda: g.key in s.tasks and s.tasks[g.key].state == "processing", timeout=10)
    a.status = Status.paused
    await async_poll_for(lambda: s.workers[a.address].status == Status.paused, timeout=5)
    await gate.set()
    result = await asyncio.wait_for(fut, 30)  # without: a's share waits for a forever
    np.testing.assert_allclose(result, (await c.compute(x.sum(axis=1))) + 30.0, rtol=1e-12)
    assert set(per_block_tasks(rec).values()) == {b.address}, rec.worker


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3, timeout=60)
async def test_an_error_in_the_plugin_as_a_worker_leaves_lets_its_pinned_tasks_run_elsewhere(c, s, a, b, w3):
    """The plugin's bookkeeping raises as a worker is removed without closing first (as Dask's TTL check
    removes one that missed its heartbeats): Dask's placement applies, not a wait for that worker forever."""
    await setup(c, s, [1.0, 1.0, 1.0])
    p = s.plugins["octopus"]

    def broken(worker):
        raise RuntimeError("injected")

    p.model.remove = broken
    gate = Event()
    g = c.submit(wait_for_event, gate.name, workers=[a.address], pure=False)
    await async_poll_for(lambda: g.key in s.tasks and s.tasks[g.key].state == "processing", timeout=10)
    x = da.ones((600, 8), chunks=(50, 8)).map_blocks(add_gate, g, dtype=float)
    y = await run_balance(c, x, per_worker=2)
    fut = c.compute(y.sum(axis=1))
    await async_poll_for(lambda: fut.key in s.tasks, timeout=10)
    with captured_logger("dask_octopus.plugins.scheduler", level=logging.ERROR) as log:
        await s.remove_worker(b.address, stimulus_id="worker-ttl-timed-out", close=False)
        await gate.set()
        np.testing.assert_array_equal(await asyncio.wait_for(fut, 30), np.full(600, 16.0))
    assert "remove_worker failed" in log.getvalue()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3, timeout=90,
             config={"distributed.worker.memory.pause": False})
async def test_blocks_moved_onto_a_paused_worker_may_run_elsewhere(c, s, a, b, w3):
    await setup(c, s, [1.0, 1.0, 1.0])
    x = da.random.default_rng(1).random((600, 30), chunks=(100, 30))
    y = c.persist(await run_balance(c, x, per_worker=2))
    await wait(y)
    gate = Event()
    g = c.submit(wait_for_event, gate.name, workers=[b.address], pure=False)
    fut = c.compute(y.map_blocks(add_gate, g, dtype=y.dtype).sum(axis=1))
    await async_poll_for(lambda: g.key in s.tasks and s.tasks[g.key].state == "processing", timeout=10)
    a.status = Status.paused
    await async_poll_for(lambda: s.workers[a.address].status == Status.paused, timeout=5)
    await w3.close()  # its blocks move to a and b: those on a are pinned loosely while a is paused
    await gate.set()
    result = await asyncio.wait_for(fut, 30)
    np.testing.assert_allclose(result, (await c.compute(x.sum(axis=1))) + 30.0, rtol=1e-12)


# -- the scheduler side of placement alone (stand-in task states), from a mutation run of pins.py and blocks.py --


def test_slices_of_inputs_no_one_worker_holds_are_left_unpinned_and_not_counted():
    """A slice (``pieces``) of inputs held on different workers gets no restriction and is not counted among
    the tasks pinned; one whose inputs share a holder is pinned loosely there; the user's own restriction
    stays."""
    workers = {w: Stub(address=w) for w in "ab"}  # (hashable, as in a task's who_has)
    x0 = task_state(("x", 0), "memory", who_has={workers["a"]})
    x1 = task_state(("x", 1), "memory", who_has={workers["b"]})
    x2 = task_state(("x", 2), "memory", who_has={workers["a"], workers["b"]})
    apart = task_state(("slice-x", 0), dependencies=(x0, x1))
    together = task_state(("slice-x", 1), dependencies=(x0, x2))
    users = task_state(("slice-x", 2), dependencies=(x0, x2))
    users.worker_restrictions = {"b"}
    scheduler = Stub(tasks={t.key: t for t in (x0, x1, x2, apart, together, users)})
    placement = Placement()
    placement.add_plan("y", ["a", "b"], source="x", nbytes=[1.0, 1.0], pieces="slice-x")
    assert placement.update_graph(scheduler, [apart.key, together.key, users.key]) == 1
    assert apart.worker_restrictions is None
    assert users.worker_restrictions == {"b"} and not users.loose_restrictions
    assert together.worker_restrictions == {"a"} and together.loose_restrictions
    assert not placement.pins  # loose pins are not kept


def test_an_idle_worker_steals_only_from_a_worker_with_tasks_waiting_for_a_thread():
    """A stealable task is asked for only from a worker with more tasks than threads (one waits); a worker
    whose tasks all have a thread is left alone."""
    asked = []
    stealing = Stub(in_flight={}, move_task_request=lambda ts, victim, thief: asked.append(ts.key))
    thief = Stub(status=Status.running, processing=set(), nthreads=1)
    victim = Stub(status=Status.running, processing=set(), nthreads=2)
    tasks = {("y", i): Stub(key=("y", i), state="processing", processing_on=victim, priority=(i,), prefix="y")
             for i in range(3)}
    scheduler = Stub(extensions={"stealing": stealing}, workers={"thief": thief, "victim": victim}, tasks=tasks,
                          get_comm_cost=lambda ts, ws: 0.0, _get_prefix_duration=lambda prefix: 1.0)
    placement = Placement()
    placement.stealable_keys.update(tasks)
    victim.processing = {0, 1}  # as many tasks as threads
    placement.steal_for(scheduler, "thief")
    assert asked == []
    victim.processing = {0, 1, 2}  # one waits for a thread
    placement.steal_for(scheduler, "thief")
    assert asked == [("y", 2)]  # the last in run order


def test_tasks_of_a_dropped_plan_stay_pinned_to_live_workers_when_workers_change():
    """After octopus.max-plans dropped a plan, a worker joining or leaving unpins only its tasks pinned to
    workers that left; those on live workers stay where they were pinned."""
    tasks = {("y", i): task_state(("y", i)) for i in range(2)}
    scheduler = Stub(tasks=tasks, unrunnable=set(), transitions=lambda recs, stimulus_id: None)
    placement = Placement(max_plans=1)
    placement.add_plan("y", ["a", "b"])
    assert placement.update_graph(scheduler, list(tasks)) == 2
    placement.add_plan("z", ["a", "b"])  # "y" is dropped
    assert "y" not in placement.plans
    assert placement.rehome(scheduler, {"a": 1.0, "c": 1.0}, "test") == 1  # b left, c joined
    assert tasks[("y", 0)].worker_restrictions == {"a"} and ("y", 0) in placement.pins
    assert tasks[("y", 1)].worker_restrictions is None and ("y", 1) not in placement.pins


def test_octopus_max_plans_drops_the_oldest_plan_whose_graph_came_first():
    """Past octopus.max-plans, the plan dropped is the oldest whose tasks are pinned (their pins stand
    without it), not an older one whose graph is still to come (a persist that reached the scheduler
    after the next plans: its blocks got no pin, and ran where Dask put them); where every plan waits
    for its graph, the oldest."""
    tasks = {(name, 0): task_state((name, 0)) for name in "xyzwv"}
    scheduler = Stub(tasks=tasks)
    placement = Placement(max_plans=2)
    placement.add_plan("x", ["a"])
    placement.add_plan("y", ["b"])
    assert placement.update_graph(scheduler, [("y", 0)]) == 1  # y's graph came; x's is to come
    placement.add_plan("z", ["a"])
    assert list(placement.plans) == ["x", "z"]
    assert placement.update_graph(scheduler, [("x", 0)]) == 1 and tasks[("x", 0)].worker_restrictions == {"a"}
    placement.add_plan("w", ["b"])  # x's graph came: x goes
    assert list(placement.plans) == ["z", "w"]
    placement.add_plan("v", ["a"])  # none came: the oldest goes
    assert list(placement.plans) == ["w", "v"]
    assert tasks[("y", 0)].worker_restrictions == {"b"}  # (pins of dropped plans stand)


def test_a_task_made_of_several_takes_the_pin_of_the_first_pinned_one():
    """A fragment (or a split fragment's part) is pinned as the first of its members that is pinned: a
    fragment whose first member reads no planned block (made inside it) is pinned all the same (so it
    counts in its plan's runs on the dashboard)."""
    tasks = {("y", 0): task_state(("y", 0))}
    placement = Placement()
    placement.add_plan("y", ["a"])
    assert placement.update_graph(Stub(tasks=tasks), list(tasks)) == 1
    placement.inherit("fragment", ["made-inside", ("y", 0)])
    placement.inherit("other", ["made-inside"])
    assert placement.pins["fragment"] == ("y", 0) and "other" not in placement.pins
    placement.forget(("y", 0))
    assert placement.pins == {"fragment": ("y", 0)}


def test_rehome_without_weights_changes_nothing():
    """With no worker weights known (none calibrated yet) the pins stay as they are, rather than failing
    (which would make the plugin loosen every pin)."""
    tasks = {("y", 0): task_state(("y", 0))}
    scheduler = Stub(tasks=tasks, unrunnable=set(), transitions=lambda recs, stimulus_id: None)
    placement = Placement()
    placement.add_plan("y", ["gone"])
    assert placement.update_graph(scheduler, list(tasks)) == 1
    assert placement.rehome(scheduler, {}, "test") == 0
    assert placement.plans["y"].workers == ["gone"] and tasks[("y", 0)].worker_restrictions == {"gone"}


def test_a_worker_whose_memory_is_not_known_gets_no_cap_and_a_gpu_worker_counts_one_thread(monkeypatch):
    """A GPU worker whose free memory was not measured plans blocks without a cap, rather than failing
    balance; its two threads count as one (its weight is its device's speed), a CPU worker's three as three."""
    profiles = {"gpu": {"weight": 2.0, "device": "gpu", "threads": 2},  # (its threads share the device)
                "cpu": {"weight": 1.0, "memory_total": 8 * 2**20, "threads": 3}}
    monkeypatch.setattr(blocks, "call_scheduler", lambda client, op, **kw: profiles)
    workers, weights, caps, rates, limits, threads = blocks._workers_caps_and_speed(None, "compute", 8.0, "x")
    assert workers == ["cpu", "gpu"] and weights == [1.0, 2.0] and threads == {"cpu": 3, "gpu": 1}
    assert caps[1] is None and caps[0] > 0 and limits == [sys.maxsize, sys.maxsize] and rates is None


def test_the_workers_speed_for_memory_plans_is_rows_per_second(monkeypatch):
    """For resource="memory" each worker's speed (which decides whether moving an already-held layout
    is worth its seconds) is its streaming bytes per second over the row's bytes."""
    profiles = {"a": {"weight": 2.0, "memory": 4e9, "memory_total": 2**30, "threads": 1},
                "b": {"weight": 1.0, "memory": 2e9, "memory_total": 2**30, "threads": 1}}
    monkeypatch.setattr(blocks, "call_scheduler", lambda client, op, **kw: profiles)
    assert blocks._workers_caps_and_speed(None, "memory", 8.0, "x")[3] == {"a": 4e9 / 8.0, "b": 2e9 / 8.0}
    assert blocks._workers_caps_and_speed(None, "memory", 8e3, "x")[3] == {"a": 4e9 / 8e3, "b": 2e9 / 8e3}
    assert blocks._workers_caps_and_speed(None, "compute", 8.0, "x")[3] is None


def test_a_memory_plan_times_a_pass_by_the_workers_it_plans_on(monkeypatch):
    """The pass time that decides whether moving held blocks is worth it counts the streaming speed of
    the workers that get blocks: not that of one left out, whose memory holds no block."""
    profiles = {"a": {"weight": 2.0, "memory": 4e9, "memory_total": 2**30, "threads": 1},
                "b": {"weight": 1.0, "memory": 2e9, "memory_total": 2**30, "threads": 1},
                "c": {"weight": 1.0, "memory": 8e9, "memory_total": 8, "threads": 1}}  # too small for a block
    monkeypatch.setattr(blocks, "call_scheduler", lambda client, op, **kw: profiles)
    monkeypatch.setattr(blocks, "rechunk_seconds", lambda *args: 0.0)
    seen = []
    monkeypatch.setattr(blocks, "worth_moving", lambda *args, speed, move_seconds: seen.append(speed) or False)
    with pytest.warns(UserWarning, match="c can hold"):
        sizes, workers, _, _ = blocks._plan(None, 1000, 8000.0, "memory", 1, 1, [500, 500], "x", ["a", "b"])
    assert (sizes, workers) == ([500, 500], ["a", "b"])  # kept, as worth_moving said
    assert seen == [(4e9 + 2e9) / 8.0]


def slow_rows(b, per_row):
    """``b + 1`` after sleeping ``per_row[worker]`` seconds per row."""
    time.sleep(len(b) * per_row[get_worker().address])
    return b + 1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def test_the_tasks_of_a_balanced_block_count_its_bytes_however_they_get_their_rows(c, s, a, b):
    """A collection balanced from an input that is not persisted: its blocks are re-chunked from pieces
    of the input's blocks (some read pieces that other tasks cut, some make their rows inside, fused),
    and the work on them is fused into those tasks. Each such timing counts its block's bytes: counted
    by what the task read, the rates depended on which worker got the blocks that straddle the input's,
    and the slow worker's weight swung between 0.04 and 0.59 from one compute to the next. A worker 3x
    slower per row settles at a quarter of the weight. (The sleeps, 60 ms a block of 100 rows on the fast
    worker, stay long beside a task's own cost: with 20 ms, CI's load during one compute moved the slow
    worker's weight to 0.39, as 18 ms more a task on the fast worker would.)"""
    await c.register_plugin(OctopusSchedulerPlugin(calibrate=False))
    plugin = s.plugins["octopus"]
    units = []
    observe = plugin._observe

    def spy(worker, key, prefix, n, seconds, counted=False):
        if plugin.placement.pins.get(key) is not None:
            units.append(n)
        return observe(worker, key, prefix, n, seconds, counted)

    plugin._observe = spy
    per_row = {a.address: 1.8e-3, b.address: 6e-4}
    x = da.zeros((2000, 10), chunks=(100, 10))
    weights = []
    for _ in range(4):
        y = await run_balance(c, x)
        units.clear()
        assert await c.compute(y.map_blocks(slow_rows, per_row, dtype=y.dtype).sum()) == 20000
        assert units and set(units) <= {rows * 10 * 8 for rows in y.chunks[0]}, (units, y.chunks[0])
        weights.append((await dask_octopus.speeds(c))[a.address])
    assert all(0.2 < w < 0.32 for w in weights[1:]), weights


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 2)])
async def test_a_worker_of_two_threads_gets_twice_the_rows_where_both_threads_get_blocks(c, s, a, b):
    """A worker's weight is one thread's speed: of two workers as fast per thread, the one of two threads
    runs two blocks at once and gets twice the rows, where it has two blocks or more (the default's
    blocks no larger than the user's, ``per_worker=2``); with one block each (``per_worker=1``) it runs
    one at a time, and they get as many rows. The dashboard predicts both to finish together. Exact
    results throughout."""
    await setup(c, s, [1.0, 1.0])
    x = da.ones((1200, 4), chunks=(100, 4))
    placement = s.plugins["octopus"].placement
    for kwargs, want in [({}, [400, 800]), ({"per_worker": 2}, [400, 800]), ({"per_worker": 1}, [600, 600])]:
        y = await run_balance(c, x, **kwargs)
        plan = placement.plans[y.name]
        rows = {w: sum(n for o, n in zip(plan.workers, y.chunks[0]) if o == w) for w in (a.address, b.address)}
        assert [rows[a.address], rows[b.address]] == want, kwargs
        predicted = s.plugins["octopus"].plan_records.get(y.name).predicted()  # (the dashboard's)
        assert predicted == {a.address: pytest.approx(1.0), b.address: pytest.approx(1.0)}, kwargs
        assert await c.compute(y.sum()) == 4800


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def test_a_fragment_over_several_balanced_blocks_counts_what_it_reads(c, s, a, b):
    """A fragment (``annotate``) runs all of a worker's balanced blocks in one task: its timing counts the
    bytes of all of them, not the one block that pins it (counted so, the worker of 18 blocks looked 3x
    slower than the one of 6, and the weights flipped from 0.75 / 0.25 to 0.26 / 0.74)."""
    await c.register_plugin(OctopusSchedulerPlugin(calibrate=False))
    plugin = s.plugins["octopus"]
    for w, v in zip(sorted(s.workers), [3.0, 1.0]):
        plugin.model.set_prior(w, {"compute": v, "memory": v})
    units = {}
    observe = plugin._observe

    def spy(worker, key, prefix, n, seconds, counted=False):
        units[key] = n
        return observe(worker, key, prefix, n, seconds, counted)

    plugin._observe = spy
    x = c.persist(da.arange(24000.0, chunks=1000).reshape(2400, 10).rechunk((100, 10)))  # (zeros hold 8 bytes)
    y = c.persist(await run_balance(c, x))
    await wait(y)
    assert max(y.chunks[0]) == 100
    with dask_octopus.annotate():
        z = y.map_blocks(slow_rows, {a.address: 1e-5, b.address: 1e-5}, dtype=y.dtype)
    assert await c.compute(z.sum()) == sum(range(24000)) + 24000
    fragments = {k: n for k, n in units.items() if key_split(k) == FRAGMENT_PREFIX}
    assert len(fragments) == 2 and all(n >= 6 * 100 * 10 * 8 for n in fragments.values()), fragments


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_worker_where_the_worker_plugin_did_not_load_gets_no_balanced_blocks(c, s, a, b):
    """A worker where the worker plugin did not load (its environment lacks dask_octopus) would get the
    mean weight's share of the blocks, and the fragments over them (``annotate``) pinned there would
    fail: ``balance`` plans on the other workers, as ``map`` does; ``profiles`` still lists it."""
    def missing(plugin, name=None, catch_errors=True):
        raise ModuleNotFoundError("No module named 'dask_octopus'", name="dask_octopus")

    b.handlers["plugin-add"] = missing
    await setup(c, s, [1.0, 1.0])
    y = await run_balance(c, da.ones((400, 4), chunks=(100, 4)))
    assert set(s.plugins["octopus"].placement.plans[y.name].workers) == {a.address}
    assert await c.compute(y.sum()) == 1600
    assert set(await dask_octopus.profiles(c)) == {a.address, b.address}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def test_blocks_planned_on_a_worker_that_then_tells_that_the_plugin_did_not_load_go_to_the_others(c, s, a, b):
    """A worker that tells after a plan was made that the worker plugin did not load there (a worker that
    joined meanwhile, say) has its blocks moved to the others, as those of a worker that left."""
    rec = await setup(c, s, [1.0, 1.0])
    y = await run_balance(c, da.ones((400, 4), chunks=(100, 4)))
    assert set(s.plugins["octopus"].placement.plans[y.name].workers) == {a.address, b.address}
    s.plugins["octopus"].report_not_loaded(b.address, "ValueError('bad octopus setting')")
    assert set(s.plugins["octopus"].placement.plans[y.name].workers) == {a.address}
    assert await c.compute(y.sum()) == 1600
    assert {w for k, w in rec.worker.items() if "octopus-blocks" in k[0]} == {a.address}  # (fused with sum)
