"""dask_octopus.map(gather=True) and imap: results without a Dask key per item, failures per item,
a worker lost mid-map, and stealing of a slowed worker's tail (the pure split of a worker's list:
tests/test_packing.py)."""

import asyncio
import gc
import math
import os
import signal
import threading
import time
import traceback
from concurrent.futures import CancelledError

import dask
import numpy as np
import pytest
from distributed import Client, Event, KilledWorker, LocalCluster, Nanny, Worker, get_worker, wait
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.utils_test import async_poll_for, captured_logger, gen_cluster, inc
from test_balance import setup
from test_map import fails_on_seven, plan_of, slow_identity

import dask_octopus
from dask_octopus.placement.items import _Batches
from dask_octopus.placement.pins import MAP_INFIX
from dask_octopus.plugins.scheduler import OctopusSchedulerPlugin


def in_thread(func, *args, **kwargs):
    return asyncio.get_running_loop().run_in_executor(None, lambda: func(*args, **kwargs))


def held_within(loop, s, named, below, timeout):
    """Poll, from a thread, until the bytes in the scheduler's memory under keys for which ``named(key)``
    holds are below ``below``, or ``timeout`` passed: the last count (read on the scheduler's event loop,
    which changes its tasks meanwhile)."""
    async def held():
        return sum(ts.nbytes for ts in s.tasks.values() if ts.state == "memory" and named(str(ts.key)))

    deadline = time.monotonic() + timeout
    while (n := asyncio.run_coroutine_threadsafe(held(), loop).result()) >= below and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def item_keys(s):
    return [k for k in s.tasks if "octopus-item" in str(k)]


@pytest.mark.parametrize("group", [None, 4])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 2), ("127.0.0.1", 1)])
async def test_gathered_results_come_in_input_order_from_one_task_per_worker_thread(c, s, a, b, group):
    rec = await setup(c, s, [2.0, 1.0])
    items = [np.arange(n, dtype=float) for n in (5, 800, 3, 100, 250, 40, 700, 1, 60, 9, 33, 70)]
    results = await in_thread(dask_octopus.map, np.sum, items, client=c, group=group, gather=True)
    assert results == [x.sum() for x in items]
    name, plan = plan_of(s)
    assert not item_keys(s)  # no key per item: only the batch tasks
    ran = {k[1]: w for k, w in rec.worker.items() if isinstance(k, tuple) and k[0] == name}
    assert sorted(ran) == list(range(len(plan.workers)))  # every batch, each on its planned worker
    assert all(ran[i] == w for i, w in enumerate(plan.workers) if not plan.stealable[i])
    assert sum(plan.counts) == len(items) and len(plan.counts) < len(items)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_gathered_failures_raise_the_first_failed_item_or_are_skipped(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    with pytest.raises(ZeroDivisionError, match="item 7 is bad") as info:
        await in_thread(dask_octopus.map, fails_on_seven, range(40), client=c, group=8, gather=True)
    assert "fails_on_seven" in "".join(traceback.format_tb(info.value.__traceback__))  # the worker's frames
    skipped = await in_thread(dask_octopus.map, fails_on_seven, range(40), client=c, group=8, gather=True,
                              errors="skip")
    assert skipped == [2 * x for x in range(40) if x != 7]  # as client.gather(errors="skip")
    with pytest.raises(ValueError, match="errors must be one of raise, skip, got 'ignore'"):
        await in_thread(dask_octopus.map, fails_on_seven, range(4), client=c, gather=True, errors="ignore")
    with pytest.raises(ValueError, match="errors applies to gathered results"):
        await in_thread(dask_octopus.map, fails_on_seven, range(4), client=c, errors="skip")


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_imap_yields_every_item_once_as_its_task_finishes(c, s, a, b):
    await setup(c, s, [1.0, 1.0])

    def collect(**kwargs):
        return list(dask_octopus.imap(fails_on_seven, range(40), client=c, group=4, **kwargs))

    pairs = await in_thread(collect, errors="skip")
    assert sorted(pairs) == [(x, 2 * x) for x in range(40) if x != 7]
    assert not item_keys(s)
    with pytest.raises(ZeroDivisionError, match="item 7 is bad"):
        await in_thread(collect)
    assert await in_thread(lambda: list(dask_octopus.imap(abs, [], client=c))) == []


def quick_first(x, slow=6.0):
    time.sleep(0.1 if x == 0 else slow)
    return x


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)] * 2, config={"octopus.map.steal-fraction": 0})
async def test_imap_stopped_early_releases_the_tasks_not_finished(c, s, a, b):
    await setup(c, s, [1.0, 1.0])

    def first():
        it = dask_octopus.imap(quick_first, range(8), client=c, cost=[1] * 8)  # one item a task: 0.1 s, then 6 s
        out = next(it)
        it.close()
        return out

    assert await in_thread(first) == (0, 0)
    await async_poll_for(lambda: not [k for k in s.tasks if "quick_first" in str(k)], timeout=3)


def zero_fails_first(x):
    if x == 0:
        time.sleep(0.1)
        raise ZeroDivisionError("item 0")
    time.sleep(1.0)
    return x


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)] * 2, config={"octopus.map.steal-fraction": 0})
async def test_imap_raising_an_item_s_error_releases_the_tasks_not_finished_while_the_error_is_kept(c, s, a, b):
    """The error an item raises (``errors="raise"``) ends the iteration: the tasks not finished are
    released at once, also while the caller keeps the exception (its traceback holds the iterator's
    frames: a REPL's last exception, an ``except ... as`` kept)."""
    await setup(c, s, [1.0, 1.0])

    def raised():
        try:
            for _ in dask_octopus.imap(zero_fails_first, range(8), client=c, cost=[1] * 8):  # one item a task
                pass
        except ZeroDivisionError as e:
            return e

    kept = await in_thread(raised)
    assert repr(kept) == "ZeroDivisionError('item 0')"
    await async_poll_for(lambda: not [k for k in s.tasks if "zero_fails_first" in str(k)], timeout=3)


@gen_cluster(client=False, nthreads=[("127.0.0.1", 1)] * 2)
async def test_an_asynchronous_client_awaits_gathered_results_and_iterates_imap(s, a, b):
    async with Client(s.address, asynchronous=True) as c:
        await setup(c, s, [1.0, 1.0])
        assert await dask_octopus.map(abs, [-1, -2, 3], client=c, gather=True) == [1, 2, 3]
        pairs = [pair async for pair in dask_octopus.imap(abs, [-1, -2, 3], client=c, group=2)]
        assert sorted(pairs) == [(0, 1), (1, 2), (2, 3)]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_to_host_leaves_host_results_as_they_are(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    items = [np.full(3, float(i)) for i in range(6)]
    for group in (None, 2):
        out = await in_thread(dask_octopus.map, lambda x: (x * 2, {"n": x.sum()}), items, client=c, group=group,
                              gather=True, to_host=True)
        assert all(np.array_equal(r[0], 2 * x) and r[1]["n"] == x.sum() for r, x in zip(out, items))
    futs = await in_thread(dask_octopus.map, np.negative, items, client=c, to_host=True)
    assert all(np.array_equal(r, -x) for r, x in zip(await c.gather(futs), items))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, Worker=Nanny, timeout=120)
async def test_a_worker_lost_mid_map_loses_no_gathered_result(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    gathered = in_thread(dask_octopus.map, slow_identity, range(16), client=c, cost=[1] * 16, group=2, gather=True,
                         delay=0.2)

    def started_on_a():
        return [m for _, m in s.get_events("slow-identity") if m["worker"] == a.worker_address]

    await async_poll_for(lambda: len(started_on_a()) >= 2, timeout=30)  # a is into its items
    await a.kill()
    assert await gathered == list(range(16))


def ends_its_process_on_seven(x):
    if x == 7:
        os._exit(1)  # as a worker killed for its memory
    return x


def deaths(s):
    """The workers lost so far (each logged under two topics)."""
    return {m["stimulus_id"] for events in s.get_events().values() for _, m in events
            if isinstance(m, dict) and m.get("action") == "remove-worker"}


def ends_its_process_once_on_odd(x, flags):
    """``x``, but an odd ``x`` takes its worker process down the first time it runs (a worker lost once)."""
    flag = os.path.join(flags, str(x))
    if x % 2 and not os.path.exists(flag):
        open(flag, "w").close()
        os._exit(1)
    return x


@pytest.mark.parametrize("how", ["map", "imap", "imap-async"])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, Worker=Nanny, timeout=120,
             config={"distributed.scheduler.allowed-failures": 0, "octopus.map.learn-result-size": False,
                     # one task at a time on a worker's thread: Dask fails only the item that ran where it died
                     "distributed.scheduler.worker-saturation": 1.0})
async def test_an_item_that_kills_its_worker_fails_alone_and_the_others_keep_their_results(c, s, a, b, how):
    await setup(c, s, [1.0, 1.0])
    if how == "map":
        got = await in_thread(dask_octopus.map, ends_its_process_on_seven, range(16), client=c, group=4,
                              gather=True, errors="skip")
    elif how == "imap":
        got = [r for _, r in await in_thread(lambda: list(dask_octopus.imap(ends_its_process_on_seven, range(16),
                                                                             client=c, group=4, errors="skip")))]
    else:  # the client's own loop: an asynchronous iterator
        got = [r async for _, r in dask_octopus.imap(ends_its_process_on_seven, range(16), client=c, group=4,
                                                     errors="skip")]
    assert sorted(got) == [i for i in range(16) if i != 7]  # (was: KilledWorker for the whole call)
    with pytest.raises(KilledWorker):  # raised as that item's error
        await in_thread(dask_octopus.map, ends_its_process_on_seven, [5, 7, 9], client=c, group=4, gather=True)


@pytest.mark.parametrize("group", [None, 4])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, Worker=Nanny, timeout=120,
             config={"distributed.scheduler.allowed-failures": 1, "octopus.map.learn-result-size": False,
                     "distributed.scheduler.worker-saturation": 1.0})
async def test_an_item_that_kills_its_worker_fails_alone_among_futures_per_item(c, s, a, b, group, tmp_path):
    """Futures per item: a task whose worker went down while running it is placed (and queued) by Dask
    from then on, a batch as one task per item read by that item's future; so the item that kills its
    workers fails with ``KilledWorker`` alone (each task pinned to its worker was sent there at once and
    counted every death with it), and items that each take a worker down once all give their results
    (counted for one another's deaths, they failed at their own)."""
    await setup(c, s, [1.0, 1.0])
    futures = await in_thread(dask_octopus.map, ends_its_process_once_on_odd, range(8), client=c, group=group,
                              flags=str(tmp_path))
    assert await c.gather(futures) == list(range(8))
    del futures
    before = deaths(s)
    futures = await in_thread(dask_octopus.map, ends_its_process_on_seven, range(16), client=c, group=group)
    # (results held by a worker that went down are computed again: gathered, not by their status now)
    assert await c.gather(futures[:7] + futures[8:]) == [i for i in range(16) if i != 7]
    with pytest.raises(KilledWorker):
        await futures[7]
    # the first death counts against none of the tasks pinned there (most did not run): the item takes one
    # worker more than a task of client.map's (allowed-failures + 2)
    assert len(deaths(s) - before) == 3
    # the plan's run (the dashboard's) counts the tasks Dask placed since: ended, that item lost
    run = [r.current for name, r in s.plugins["octopus"].plan_records.records.items() if MAP_INFIX in name][-1]
    assert run.ended and not run.complete, run


def fails_on_three(x):
    if x == 3:
        raise ZeroDivisionError("input 3 failed")
    return x


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, Worker=Nanny, timeout=120,
             config={"distributed.scheduler.allowed-failures": 0, "octopus.map.learn-result-size": False,
                     "distributed.scheduler.worker-saturation": 1.0})
async def test_an_item_that_kills_its_worker_beside_an_input_that_failed_before_the_map(c, s, a, b):
    """The items of a batch that killed its worker run again each alone: one given as a future that failed
    before the map fails alone there too, as in its batch (it failed the whole call with its error)."""
    await setup(c, s, [1.0, 1.0])
    failed = c.submit(fails_on_three, 3)
    await wait(failed)
    items = [failed if i == 3 else i for i in range(16)]
    got = await in_thread(dask_octopus.map, ends_its_process_on_seven, items, client=c, group=4, gather=True,
                          errors="skip")
    assert sorted(got) == [i for i in range(16) if i not in (3, 7)]


def blocked_until(event_name, x):
    Event(event_name).wait(30)
    return x


@pytest.mark.parametrize("how", ["map", "imap", "imap-async"])
@pytest.mark.parametrize("group", [None, 2])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_an_input_cancelled_before_the_map_fails_alone_as_client_gather_has_it(c, s, a, b, how, group):
    """A future item cancelled before the map is an item that failed: skipped with ``errors="skip"``, its
    ``CancelledError`` raised with ``"raise"``, as ``client.gather`` has it (it cancelled the whole call,
    or ``who_has`` refused it)."""
    await setup(c, s, [1.0, 1.0])
    cancelled = c.submit(blocked_until, "go", 3, pure=False)
    await c.cancel([cancelled])
    # (forgotten first: the cancel travels on the client's stream, the event's set may overtake it)
    await async_poll_for(lambda: cancelled.key not in s.tasks, timeout=5)
    await Event("go").set()  # (the worker's thread goes on to the map's tasks)
    assert cancelled.status == "cancelled"
    items = [cancelled if i == 3 else i for i in range(8)]
    if how == "map":
        got = await in_thread(dask_octopus.map, inc, items, client=c, group=group, gather=True, errors="skip")
    elif how == "imap":
        got = [r for _, r in await in_thread(lambda: list(dask_octopus.imap(inc, items, client=c, group=group,
                                                                             errors="skip")))]
    else:  # the client's own loop: an asynchronous iterator
        got = [r async for _, r in dask_octopus.imap(inc, items, client=c, group=group, errors="skip")]
    assert sorted(got) == [i + 1 for i in range(8) if i != 3]
    with pytest.raises(CancelledError, match=str(cancelled.key)):
        await in_thread(dask_octopus.map, inc, items, client=c, group=group, gather=True)


@pytest.mark.parametrize("group", [None, 2])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_future_per_item_of_an_input_cancelled_before_the_map_fails_alone(c, s, a, b, group):
    """With a future per item, the item of a future cancelled before the map raises its
    ``CancelledError``; the others have their results (one task per item read the cancelled key: Dask
    refused the whole graph, cancelling every item for lost dependencies)."""
    await setup(c, s, [1.0, 1.0])
    cancelled = c.submit(blocked_until, "go", 3, pure=False)
    await c.cancel([cancelled])
    # (forgotten first: the cancel travels on the client's stream, the event's set may overtake it)
    await async_poll_for(lambda: cancelled.key not in s.tasks, timeout=5)
    await Event("go").set()
    items = [cancelled if i == 3 else i for i in range(8)]
    futures = await in_thread(dask_octopus.map, inc, items, client=c, group=group)
    for i, f in enumerate(futures):
        if i == 3:
            with pytest.raises(CancelledError, match=str(cancelled.key)):
                await f
        else:
            assert await f == i + 1


def a_lock(x):
    return threading.Lock()


@pytest.mark.parametrize("how", ["map", "map-skip", "imap"])
@pytest.mark.parametrize("group", [None, 2])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config={"octopus.map.learn-result-size": False})
async def test_a_result_that_cannot_be_sent_raises_dask_s_error_as_client_gather_does(c, s, a, b, how, group):
    """A batch whose results cannot be pickled to the client raises what ``client.gather`` raises for
    them, ``errors="skip"`` too (the batch finished: its items did not fail); it raised ``'TypeError'
    object is not iterable``, the error taken for the batch's results."""
    await setup(c, s, [1.0, 1.0])
    with pytest.raises(TypeError, match="Could not serialize object of type lock"):
        await c.gather(c.map(a_lock, [1, 2]))
    with pytest.raises(TypeError, match="Could not serialize object of type lock"):
        if how == "imap":
            await in_thread(lambda: list(dask_octopus.imap(a_lock, [1, 2], client=c, group=group)))
        else:
            await in_thread(dask_octopus.map, a_lock, [1, 2], client=c, group=group, gather=True,
                            errors="skip" if how == "map-skip" else "raise")


def a_lock_for_zero(a):
    return threading.Lock() if a[0] == 0 else float(a.sum())


@pytest.mark.parametrize("how", ["map", "imap", "imap-async"])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config={"octopus.map.learn-result-size": False})
async def test_a_gathered_map_that_fails_mid_run_leaves_no_task_behind(c, s, a, b, how):
    """A batch whose results cannot be sent ends a gathered ``map`` or an ``imap`` with that error: the
    batches that finished and were not read, that batch and the items computed from delayed objects are
    released, although the error's traceback, which the caller keeps, refers to them."""
    await setup(c, s, [1.0, 1.0])
    items = [dask.delayed(np.full)(10, float(n)) for n in range(8)]
    with pytest.raises(TypeError, match="Could not serialize object of type lock") as info:
        if how == "imap-async":
            [pair async for pair in dask_octopus.imap(a_lock_for_zero, items, client=c, cost=[1.0] * 8)]
        elif how == "imap":
            await in_thread(lambda: list(dask_octopus.imap(a_lock_for_zero, items, client=c, cost=[1.0] * 8)))
        else:
            await in_thread(dask_octopus.map, a_lock_for_zero, items, client=c, cost=[1.0] * 8, gather=True)
    await async_poll_for(lambda: not s.tasks, timeout=5)
    assert info.value.__traceback__ is not None


def slow_plus_one(x):
    worker = get_worker()
    worker.log_event("slow-identity", {"worker": worker.address})
    time.sleep(0.2)
    return x + 1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, Worker=Nanny, timeout=120,
             config={"distributed.scheduler.active-memory-manager.interval": "50ms"})
async def test_items_scattered_by_the_user_and_lost_with_their_worker_fail_alone(c, s, a, b):
    """Items given as futures of data the user scattered to a worker that is then lost: Dask cancels them
    (nothing can compute them again) and with them the batches that read them; those batches run again
    without them, each of them failing alone, as ``client.gather(errors="skip")`` leaves them out (the
    whole call raised the batch's ``CancelledError``). The items of ``b`` that batches on ``a`` read give
    their results: Dask's active memory manager, which keeps one of the two copies (here many times
    before the kill), keeps ``b``'s (the plugin's ``ReduceReplicas``: data the user scattered that pinned
    tasks read keeps the worker it was scattered to)."""
    await setup(c, s, [1.0, 1.0])
    items = (await c.scatter(list(range(8)), workers=[a.worker_address], hash=False)
             + await c.scatter(list(range(8, 16)), workers=[b.worker_address], hash=False))
    run = in_thread(dask_octopus.map, slow_plus_one, items, client=c, group=2, gather=True, errors="skip")

    def started_on_a():
        return [m for _, m in s.get_events("slow-identity") if m["worker"] == a.worker_address]

    await async_poll_for(lambda: len(started_on_a()) >= 2, timeout=30)
    await a.kill()
    got = await run
    kept = {i + 1 for i, f in enumerate(items) if f.status == "finished"}
    assert [f.status for f in items[8:]] == ["finished"] * 8 and [f.status for f in items[:8]].count("cancelled") > 0
    assert kept <= set(got) <= set(range(1, 17)) and len(got) == len(set(got)) < 16
    # none of the map's tasks is held once it returned (the cancelled items' errors, raised in it, held its
    # frames and its batches' futures for as long as the test held the items); the items keep their home
    # while Dask knows them
    await async_poll_for(lambda: not [k for k in s.tasks if "octopus" in str(k)], 10)
    placement = s.plugins["octopus"].placement
    assert [placement.home(f.key) for f in items[8:]] == [b.worker_address] * 8
    keys = [f.key for f in items]
    del items
    await async_poll_for(lambda: all(placement.home(k) is None for k in keys), 10)


class Annotations(SchedulerPlugin):
    """The Dask annotations and retries of each task as it starts processing."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.of = {}

    def transition(self, key, start, finish, *args, **kwargs):
        if finish == "processing":
            ts = self.scheduler.tasks[key]
            self.of[key] = (dict(ts.annotations), ts.retries)


@pytest.mark.parametrize("how", ["imap", "imap-async"])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, Worker=Nanny, timeout=120,
             config={"distributed.scheduler.allowed-failures": 0, "octopus.map.learn-result-size": False,
                     "distributed.scheduler.worker-saturation": 1.0})
async def test_items_run_alone_after_a_killed_worker_keep_the_caller_s_annotations(c, s, a, b, how):
    """A stream is read outside the ``dask.annotate`` block it was made in: the items sent again each
    alone (their batch killed its worker) keep the annotations of the call, as its batches had them."""
    await setup(c, s, [1.0, 1.0])
    rec = Annotations(s)
    s.add_plugin(rec)
    if how == "imap":
        def stream():
            with dask.annotate(retries=2, priority=7):
                it = dask_octopus.imap(ends_its_process_on_seven, range(16), client=c, group=4, errors="skip")
            return [r for _, r in it]

        got = await in_thread(stream)
    else:
        with dask.annotate(retries=2, priority=7):
            it = dask_octopus.imap(ends_its_process_on_seven, range(16), client=c, group=4, errors="skip")
        got = [r async for _, r in it]
    assert sorted(got) == [i for i in range(16) if i != 7]
    alone = {k: v for k, v in rec.of.items() if "octopus-alone" in str(k)}
    batches = {k: v for k, v in rec.of.items() if "octopus-map" in str(k)}
    assert alone and batches
    for annotations, retries in [*alone.values(), *batches.values()]:
        assert annotations.get("retries") == 2 and retries == 2, (annotations, retries)
    assert {v[0].get("priority") for v in alone.values()} == {7}


def fails_fast_on(x, bad):
    """Raises after 3 ms on the worker ``bad`` (a library missing there), else works 20 ms."""
    if get_worker().address == bad:
        time.sleep(0.003)  # (a batch of 2 ms or more is timed)
        raise ImportError("library missing on this worker")
    time.sleep(0.02)
    return x


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_batches_whose_items_failed_teach_no_speed(c, s, a, b):
    """A worker where the function fails at once finishes its batches fast: they say nothing of its speed
    (it got 90% of the weight, and most of the next map's items, which failed again)."""
    await c.register_plugin(OctopusSchedulerPlugin(calibrate=False))
    good, bad = sorted(s.workers)
    for _ in range(3):
        out = await in_thread(dask_octopus.map, fails_fast_on, range(40), client=c, cost=[1.0] * 40, gather=True,
                              errors="skip", bad=bad)
        assert out and set(out) < set(range(40))
    rates = {p: per for p, per in s.plugins["octopus"].model.table().items() if "octopus-map" in p}
    assert rates and all(good in per and bad not in per for per in rates.values()), rates
    assert await c.scheduler.octopus_speeds() == {good: 0.5, bad: 0.5}


def fails_when_computed_again(event):
    from distributed import Event

    if Event(event).is_set():
        raise ZeroDivisionError("input computed again failed")
    return -1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, Worker=Nanny, timeout=120)
async def test_an_input_lost_with_its_worker_that_fails_when_computed_again_fails_only_its_item(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    victim = a if a.worker_address == sorted(s.workers)[0] else b
    again = Event()
    lost = c.submit(fails_when_computed_again, again.name, workers=[victim.worker_address], allow_other_workers=True)
    await wait(lost)
    items = [lost, *range(1, 16)]
    # the largest item goes first to the first of equal workers (packing's order): the one holding it
    gathered = in_thread(dask_octopus.map, slow_identity, items, client=c, cost=[2] + [1] * 15, group=2,
                         gather=True, errors="skip", delay=0.2)

    def started_on_victim():
        return [m for _, m in s.get_events("slow-identity") if m["worker"] == victim.worker_address]

    await async_poll_for(lambda: len(started_on_victim()) >= 2, timeout=30)  # into its batch, which holds the input
    await again.set()
    await victim.kill()
    assert await gathered == list(range(1, 16))  # Dask computes the input again, which fails its item alone


def slows_down_on(x, slow, fast_s, slow_s):
    """Sleeps ``fast_s``, or ``slow_s`` on the worker named ``slow`` (a slowdown the plan does not know)."""
    time.sleep(slow_s if get_worker().name == slow else fast_s)
    return x


# Dask's own periodic stealing is kept from running: the steals below are the plugin's
NO_DASK_STEALING = {"distributed.scheduler.work-stealing-interval": "1h"}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config=NO_DASK_STEALING)
async def test_a_worker_that_ran_out_of_work_steals_the_tail_of_a_slowed_worker(c, s, a, b):
    rec = await setup(c, s, [1.0, 1.0])  # equal weights: the plan gives each worker 20 items
    out = await in_thread(dask_octopus.map, slows_down_on, range(40), client=c, cost=[1] * 40, group=2, gather=True,
                          slow=a.name, fast_s=0.002, slow_s=0.1)  # (a's head runs long beside b's work)
    assert out == list(range(40))
    name, plan = plan_of(s)
    ran = {k[1]: w for k, w in rec.worker.items() if isinstance(k, tuple) and k[0] == name}
    heads = [i for i, st in enumerate(plan.stealable) if not st]
    assert all(ran[i] == plan.workers[i] for i in heads)  # a worker's own tasks are pinned
    tails_of_a = [i for i, w in enumerate(plan.workers) if w == a.address and plan.stealable[i]]
    assert len(tails_of_a) == 2
    assert any(ran[i] == b.address for i in tails_of_a)  # b ran out of work and took some of a's tail


class Priorities(SchedulerPlugin):
    """The scheduler's priority of each task, as it went to a worker."""

    name = "priorities"

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.of = {}

    def transition(self, key, start, finish, *args, **kwargs):
        if finish == "processing":
            self.of[key] = self.scheduler.tasks[key].priority


@pytest.mark.parametrize("user", [5, 2.5, 0, -3, 1e12, 2.0**60, math.inf])  # any number, as dask.annotate takes
def test_each_worker_runs_its_own_tasks_before_its_stealable_tail(user):
    @gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
    async def run(c, s, a, b):
        await check_own_tasks_before_the_tail(c, s, user)

    run()


async def check_own_tasks_before_the_tail(c, s, user):
    await setup(c, s, [1.0, 1.0])
    rec = Priorities(s)
    s.add_plugin(rec)
    def mapped():
        with dask.annotate(priority=user):  # the user's priority is kept: the tail comes after, within the map
            return dask_octopus.map(abs, range(-20, 20), client=c, cost=[1] * 40, group=2, gather=True)

    assert await in_thread(mapped) == [abs(x) for x in range(-20, 20)]
    name, plan = plan_of(s)
    for w in s.workers:
        mine = [i for i, x in enumerate(plan.workers) if x == w]
        heads = [rec.of[(name, i)] for i in mine if not plan.stealable[i]]
        tails = [rec.of[(name, i)] for i in mine if plan.stealable[i]]
        assert heads and tails and max(heads) < min(tails)  # a smaller priority runs first
        # the tail just after the heads, before the user's work of the next lower priority (where floats
        # can tell the two apart)
        assert {p[0] for p in heads} == {-user}
        assert all(-user < p[0] and (p[0] <= 1 - user or 1 - user == -user) for p in tails), tails


@pytest.mark.parametrize("config", [{"octopus.map.steal-fraction": 0}, {"distributed.scheduler.work-stealing": False}])
def test_without_stealing_every_task_stays_on_its_planned_worker(config):
    @gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config=config)
    async def run(c, s, a, b):
        rec = await setup(c, s, [1.0, 1.0])
        out = await in_thread(dask_octopus.map, slows_down_on, range(40), client=c, cost=[1] * 40, group=2,
                              gather=True, slow=a.name, fast_s=0.002, slow_s=0.03)
        assert out == list(range(40))
        name, plan = plan_of(s)
        assert any(plan.stealable) is ("distributed.scheduler.work-stealing" in config)
        assert all(rec.worker[(name, i)] == w for i, w in enumerate(plan.workers))  # a's tail too

    run()


@pytest.mark.parametrize("floor, tails", [("50ms", False), ("0s", True)])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_tails_too_short_to_pay_for_their_own_task_are_not_split_off(c, s, a, b, floor, tails):
    await setup(c, s, [1.0, 1.0])
    for w in s.workers:  # abs was observed: a million cost units a second on each worker
        s.plugins["octopus"].model.observe(w, "abs-octopus-map", 1e6, 1.0)
    with dask.config.set({"octopus.map.steal-min-seconds": floor}):
        out = await in_thread(dask_octopus.map, abs, range(-20, 20), client=c, cost=[1] * 40, group=2, gather=True)
    assert out == [abs(x) for x in range(-20, 20)]
    _, plan = plan_of(s)
    # each worker's 20 units take 20 us: a quarter of it in two tasks is far below 50 ms
    assert any(plan.stealable) is tails and len(plan.workers) == (6 if tails else 2)


class LockedError(Exception):
    """An exception that holds a lock: it does not pickle."""

    def __init__(self, message):
        super().__init__(message)
        self.lock = threading.Lock()


def locked_on_3(i):
    if i == 3:
        raise LockedError("item 3")
    return i * 10


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_an_item_error_that_does_not_pickle_fails_that_item_only(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    out = await in_thread(dask_octopus.map, locked_on_3, range(8), client=c, gather=True, errors="skip")
    assert out == [0, 10, 20, 40, 50, 60, 70]  # the batch's results travel; item 3's error as its repr
    with pytest.raises(Exception, match=r"LockedError\('item 3'\)"):
        await in_thread(dask_octopus.map, locked_on_3, range(8), client=c, gather=True)


FLAKY_ITEMS = {}  # calls per item of flaky_item (the workers run in this process)


def flaky_item(i, run):
    """Raises the first time it runs on item 3, as a task hitting a passing fault (``run``: new keys)."""
    FLAKY_ITEMS[i] = FLAKY_ITEMS.get(i, 0) + 1
    if i == 3 and FLAKY_ITEMS[i] == 1:
        raise OSError("item 3: transient fault")
    return i * 10


@pytest.mark.parametrize("kwargs", [{"group": 2}, {"gather": True}])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_an_item_in_a_batch_runs_again_as_its_retries_allow(c, s, a, b, kwargs):
    await setup(c, s, [1.0, 1.0])

    def annotated_map(retries):  # dask.annotate as a user writes it around the call (in the calling thread)
        with dask.annotate(retries=retries):
            return dask_octopus.map(flaky_item, range(6), client=c, run=retries, **kwargs)

    FLAKY_ITEMS.clear()
    with pytest.raises(OSError, match="transient"):
        out = await in_thread(annotated_map, 0)
        await c.gather(out) if "group" in kwargs else None
    FLAKY_ITEMS.clear()
    out = await in_thread(annotated_map, 2)
    assert (await c.gather(out) if "group" in kwargs else out) == [i * 10 for i in range(6)]
    assert FLAKY_ITEMS == {0: 1, 1: 1, 2: 1, 3: 2, 4: 1, 5: 1}  # item 3 again, in place; the others once


def fail_on_3(i):
    if i == 3:
        raise ZeroDivisionError("input 3 failed")
    return i


@pytest.mark.parametrize("kwargs", [{"group": 2}, {"gather": True, "errors": "skip"}, {"cost": lambda v: 1.0 + v}])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_an_input_that_failed_before_the_map_fails_only_its_item(c, s, a, b, kwargs):
    await setup(c, s, [1.0, 1.0])
    inputs = c.map(fail_on_3, range(6))
    await wait(inputs)
    out = await in_thread(dask_octopus.map, lambda v: v + 1, inputs, client=c, **kwargs)
    if kwargs.get("gather"):
        assert out == [1, 2, 3, 5, 6]
        return
    results = await c.gather(out, errors="skip")
    assert results == [1, 2, 3, 5, 6]  # plain client.map: only the item that reads input 3 fails
    with pytest.raises(ZeroDivisionError, match="input 3 failed"):
        await out[3]


def fail_on_3_after(i, event):
    from distributed import Event

    Event(event).wait(30)
    return fail_on_3(i)


async def map_while_inputs_run(c, s, how, items, go):
    """Run ``map(gather=True)`` or ``imap`` of ``v + 1`` over ``items`` (errors skipped), in groups of 3,
    letting the inputs finish (``go``) once the map waits for them (before it plans its batches: their
    sizes cut them); their results. No batch task is submitted before the inputs finish."""
    if how == "map":
        run = in_thread(dask_octopus.map, lambda v: v + 1, items, client=c, group=3, gather=True, errors="skip")
    else:
        run = in_thread(lambda: sorted(dask_octopus.imap(lambda v: v + 1, items, client=c, group=3, errors="skip")))
    await async_poll_for(lambda: sum("fail_on_3_after" in str(k) for k in s.tasks) == 6, timeout=10)
    await asyncio.sleep(0.2)  # (the map waiting, or about to: either way the same results)
    assert not any("octopus-map" in str(k) for k in s.tasks)
    await go.set()
    return await asyncio.wait_for(run, 20)


@pytest.mark.parametrize("how", ["map", "imap"])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_an_input_that_fails_while_the_map_waits_for_it_fails_only_its_item(c, s, a, b, how):
    await setup(c, s, [1.0, 1.0])
    go = Event()
    inputs = c.map(fail_on_3_after, range(6), event=go.name)  # still running when the map is called
    got = await map_while_inputs_run(c, s, how, inputs, go)
    assert (got if how == "map" else [r for _, r in got]) == [1, 2, 3, 5, 6]
    assert how == "map" or [i for i, _ in got] == [0, 1, 2, 4, 5]


def total(x):
    time.sleep(0.05)
    return float(x.sum())


@pytest.mark.parametrize("how", ["map", "imap"])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_worker_planned_only_futures_beside_large_local_items_gets_no_scatter(c, s, a, b, how):
    """Local items of SCATTER_BYTES or more in all are scattered to their workers; a worker whose items
    are all futures has none to scatter (an empty scatter failed the call with distributed's bare
    "not enough values to unpack")."""
    await setup(c, s, [1.0, 1.0])
    items = [np.ones(200_000), *await c.scatter([7.0, 8.0])]  # 1.6 MB here; the futures cost 1 each

    def run():
        if how == "map":
            return dask_octopus.map(np.sum, items, client=c, gather=True)
        return [x for _, x in sorted(dask_octopus.imap(np.sum, items, client=c))]

    assert await in_thread(run) == [200000.0, 7.0, 8.0]
    _, plan = plan_of(s)
    assert len(set(plan.workers)) == 2  # the local item on one worker, the futures on the other


class Unsized:
    """An item whose size cannot be measured (a handle to something outside Python, say)."""

    def __sizeof__(self):
        raise RuntimeError("no size")


@pytest.mark.parametrize("gather", [True, False])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_items_whose_size_cannot_be_measured_are_mapped_as_client_map_maps_them(c, s, a, b, gather):
    """Their size is taken as distributed does where ``sizeof`` raises (``safe_sizeof``: 1 MB, and a
    warning logged); the map raised the item's own error from ``__sizeof__``, cost given or not."""
    await setup(c, s, [1.0, 1.0])
    items = [Unsized(), Unsized()]
    with captured_logger("distributed.sizeof") as log:
        out = await in_thread(dask_octopus.map, type, items, client=c, cost=[1, 1], gather=gather)
    assert (out if gather else await c.gather(out)) == [Unsized, Unsized]
    assert "Sizeof calculation for object of type" in log.getvalue()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60, config={"octopus.map.steal-fraction": 0})
async def test_imap_holds_no_scattered_input_of_a_batch_that_finished(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    items = [np.full(2**17, float(i)) for i in range(40)]  # 40 MiB: scattered to their planned workers
    loop = asyncio.get_running_loop()

    def first_then_held():
        it = dask_octopus.imap(total, items, client=c, cost=list(range(1, 41)))
        first = next(it)  # the stream has read one; the other batches finish, unread
        held = held_within(loop, s, lambda key: "octopus-map" not in key, 2**20, timeout=10)
        return held, sorted([first, *it])

    held, got = await in_thread(first_then_held)
    assert held < 2**20  # the inputs of the batches not read yet are released too
    assert got == [(i, float(x.sum())) for i, x in enumerate(items)]



@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def test_a_scatter_that_failed_holds_none_of_the_call_s_futures(c, s, a, b, monkeypatch):
    """A worker gone as its items were scattered: distributed's error, caught, and the frame that raised
    it hold each other, and until Python collected that cycle its traceback held the frames of the call,
    with the futures of its batches and of the items scattered to the other worker: their data stayed
    on the workers (items of 40 MB on two 500 MB nanny workers paused them, and imap hung: a helper's
    hunt). With Python's collector off, the call leaves nothing on the cluster."""
    await setup(c, s, [1.0, 1.0])
    scatter = c.scatter

    def scatter_failing_on_a(data, workers=None, **kwargs):
        if workers == [a.address]:
            error = OSError(f"{a.address} is gone")

            def cell():  # (as distributed's sync(): the frame that raises holds its error in a cell)
                return error

            raise error
        return scatter(data, workers=workers, **kwargs)

    monkeypatch.setattr(c, "scatter", scatter_failing_on_a)
    items = [np.full(2**16, float(i)) for i in range(8)]  # 4 MiB: scattered to their planned workers
    gc.disable()
    try:
        got = await in_thread(lambda: sorted(dask_octopus.imap(total, items, client=c)))
        await async_poll_for(lambda: not s.tasks, timeout=5)
    finally:
        gc.enable()
    assert got == [(i, float(x.sum())) for i, x in enumerate(items)]


@pytest.mark.parametrize("how", ["map", "imap"])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_batch_read_is_released_whatever_else_holds_its_future(c, s, a, b, monkeypatch, how):
    await setup(c, s, [1.0, 1.0])
    held = []
    take = _Batches.take

    def take_and_hold(run):
        futures = take(run)
        held.extend(futures)
        return futures

    monkeypatch.setattr(_Batches, "take", take_and_hold)
    if how == "map":
        got = await in_thread(dask_octopus.map, inc, list(range(8)), client=c, gather=True)
    else:
        got = [r for _, r in await in_thread(lambda: sorted(dask_octopus.imap(inc, list(range(8)), client=c)))]
    assert got == list(range(1, 9)) and held
    await async_poll_for(lambda: not s.tasks, timeout=5)  # (held here: Dask forgets them only when told)


class SlowToSend:
    """``x`` as a result whose first sending from its worker (pickled) takes 3 s, its start told by
    creating the file ``marker``."""

    def __init__(self, x, marker):
        self.x, self.marker = x, marker

    def __reduce__(self):
        if not os.path.exists(self.marker):
            open(self.marker, "w").close()
            time.sleep(3)
        return SlowToSend, (self.x, self.marker)


def held_back(x, name, marker=None):
    """``x``; item 1 once the test lets it (event ``{name}-1``), and when computed again (its worker
    left) once it lets it again (``{name}-again``); item 2 once it lets it (``{name}-2``). With a
    ``marker``, item 1 as :class:`SlowToSend`."""
    from distributed import Event, get_worker

    if x == 1 and Event(f"{name}-ran").is_set():
        Event(f"{name}-again").wait(30)
    elif x in (1, 2):
        Event(f"{name}-{x}").wait(30)
        if x == 1:
            Event(f"{name}-ran").set()
    get_worker().log_event("held-back", {"worker": get_worker().address, "item": x})
    return SlowToSend(x, marker) if marker is not None and x == 1 else x


async def items_1_then_2_finished(s, name):
    """Let items 1 and 2 of :func:`held_back` (each alone on a worker, item 0 read) finish, item 1's batch
    first (a reader's queue then holds it first); the worker each ran on."""
    for x in (1, 2):
        await Event(f"{name}-{x}").set()
        await async_poll_for(lambda x=x: sum(ts.state == "memory" for ts in s.tasks.values()) == x, timeout=10)
    where = {m["item"]: m["worker"] for _, m in s.get_events("held-back")}
    assert len(set(where.values())) == 3  # one item a worker: a batch each
    # the two batches not read yet (the one read is released)
    await async_poll_for(lambda: [ts.state for ts in s.tasks.values()] == ["memory"] * 2, timeout=10)
    return where


@pytest.mark.parametrize("how", ["imap", "async for"])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3, timeout=60)
async def test_a_batch_lost_after_it_finished_is_read_after_those_finished_meanwhile(c, s, a, b, w, how):
    """The worker of a finished batch not read yet leaves: Dask computes it again, and the reader takes
    the batches that finish meanwhile first. It waited for the lost one, leaving the others unread on the
    workers, which under memory pressure paused, full, and never computed it (items of 40 MB on two
    500 MB nanny workers: imap hung in 6 of 7 runs, a helper's hunt). Here its computing again waits until
    the reader has had the time to read the other."""
    await setup(c, s, [1.0, 1.0, 1.0])
    name = "held-back"
    args = (held_back, [0, 1, 2])
    if how == "imap":
        it = await in_thread(dask_octopus.imap, *args, client=c, cost=[1, 1, 1], name=name)
        assert await in_thread(next, it) == (0, 0)
    else:  # (the client is asynchronous here)
        it = dask_octopus.imap(*args, client=c, cost=[1, 1, 1], name=name)
        assert await it.__anext__() == (0, 0)
    where = await items_1_then_2_finished(s, name)
    victim = next(wk for wk in (a, b, w) if wk.address == where[1])
    await victim.close()
    await async_poll_for(lambda: any(st.status == "lost" for st in c.futures.values()), timeout=10)
    order = []

    async def read_the_rest():
        async for i, _ in it:
            order.append(i)

    rest = in_thread(lambda: order.extend(i for i, _ in it)) if how == "imap" else asyncio.ensure_future(
        read_the_rest())
    await async_poll_for(lambda: order == [2], timeout=20)  # (item 1, computed again, waits for the test)
    await Event(f"{name}-again").set()
    await asyncio.wait_for(rest, 20)
    assert order == [2, 1]

def make_mib(i):
    time.sleep(2.0 if i == 0 else 0.02)  # item 0, alone in the last task to finish, keeps the stream open
    return np.full(2**17, float(i))


def first_of(x):
    time.sleep(2.0 if x[0] == 0 else 0.02)
    return float(x[0])


@pytest.mark.parametrize("what", ["results", "delayed inputs"])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)] * 2, config={"octopus.map.steal-fraction": 0})
async def test_imap_holds_nothing_of_what_it_has_read(c, s, a, b, what):
    await setup(c, s, [1.0, 1.0])
    if what == "results":  # 1 MiB results
        func, items, name = make_mib, list(range(40)), "octopus-map"
    else:  # 1 MiB inputs, computed by the map
        func, items, name = first_of, [dask.delayed(make_mib)(-i) for i in range(40)], "make_mib"

    loop = asyncio.get_running_loop()

    def read_39():
        it = dask_octopus.imap(func, items, client=c, cost=[40] + [1] * 39)  # item 0 alone in a task
        read = [next(it)[0] for _ in range(39)]
        held = held_within(loop, s, lambda key: name in key, 2**20 + 2**10, timeout=5)
        return read, held, list(it)

    read, held, rest = await in_thread(read_39)
    assert sorted(read + [i for i, _ in rest]) == list(range(40)) and 0 not in read
    assert held < 2**20 + 2**10  # of 40 MiB, only item 0's, not read yet, is in the cluster


def test_map_and_imap_use_the_client_they_are_given_not_the_default():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster, set_as_default=False) as c:
        dask_octopus.register(c, calibrate=False)
        assert dask_octopus.map(abs, [-1, -2, 3], client=c, gather=True) == [1, 2, 3]
        assert sorted(dask_octopus.imap(abs, [-1, -2, 3], client=c)) == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize("how", ["map", "imap"])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_delayed_input_that_fails_while_the_map_waits_for_it_fails_only_its_item(c, s, a, b, how):
    await setup(c, s, [1.0, 1.0])
    go = Event()
    items = [dask.delayed(fail_on_3_after)(i, go.name) for i in range(6)]
    got = await map_while_inputs_run(c, s, how, items, go)
    assert (got if how == "map" else [r for _, r in got]) == [1, 2, 3, 5, 6]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)] * 2, config={"octopus.map.steal-fraction": 0})
async def test_an_imap_stopped_early_cancels_nothing_of_the_same_map_running_beside_it(c, s, a, b):
    await setup(c, s, [1.0, 1.0])

    def both():
        other = dask_octopus.imap(quick_first, range(8), client=c, cost=[1] * 8, slow=1.0)
        stopped = dask_octopus.imap(quick_first, range(8), client=c, cost=[1] * 8, slow=1.0)  # the same work
        next(stopped)
        stopped.close()  # cancels its own tasks only
        return sorted(other)

    assert await in_thread(both) == [(i, i) for i in range(8)]


NO_MEMORY_MONITOR = {f"distributed.worker.memory.{k}": False for k in ("target", "spill", "pause", "terminate")}


@pytest.mark.parametrize("given", ["local", "delayed"])
@pytest.mark.parametrize("budget, counts", [("auto", [2, 2, 4, 4]), ("1.1 MB", [2] * 6)])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, worker_kwargs={"memory_limit": "4 MB"},
             config={"octopus.map.steal-fraction": 0, **NO_MEMORY_MONITOR})
async def test_a_batch_holds_no_more_than_its_worker_s_memory_budget(c, s, a, b, given, budget, counts):
    rec = await setup(c, s, [1.0, 1.0])
    # 256 KiB items, counted with results of their size: 0.5 MB each; auto gives 0.6 x 4 MB per thread
    items = [np.full(2**15, float(i)) for i in range(12)]
    if given == "delayed":
        items = [dask.delayed(np.full)(2**15, float(i)) for i in range(12)]
    with dask.config.set({"octopus.fragments.max-bytes": budget}):
        results = await in_thread(dask_octopus.map, np.sum, items, client=c, gather=True)
    assert results == [i * 2**15 for i in range(12)]
    name, plan = plan_of(s)
    assert sorted(plan.counts) == counts  # six items per worker, cut into batches within the budget
    ran = {k[1]: w for k, w in rec.worker.items() if isinstance(k, tuple) and k[0] == name}
    assert [ran[i] for i in range(len(plan.workers))] == plan.workers


def four_times(x):
    return np.tile(x, 4)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config={"octopus.map.steal-fraction": 0,
                                                                   "octopus.fragments.max-bytes": "1.1 MB"})
async def test_batches_count_results_as_large_as_the_function_s_last_batches_made_them(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    items = [np.full(2**15, float(i)) for i in range(12)]  # 256 KiB each, results four times as large
    counts = []
    for _ in range(2):
        results = await in_thread(dask_octopus.map, four_times, items, client=c, gather=True)
        assert all(np.array_equal(r, np.tile(x, 4)) for r, x in zip(results, items))
        counts.append(list(plan_of(s)[1].counts))
        s.plugins["octopus"].placement.plans.clear()
    # first taken as large as its items (two of 0.5 MB each a batch), then 5 x 256 KiB each: one a batch
    assert counts == [[2] * 6, [1] * 12]
    assert 3.9 < max(s.plugins["octopus"].result_sizes["four_times-octopus-map"]) < 4.1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config={"octopus.map.steal-fraction": 0,
                                                                   "octopus.fragments.max-bytes": "1 MiB"})
async def test_a_batch_s_results_are_read_when_the_caller_gets_to_them(c, s, a, b):
    """A finished batch's results stay on its worker until the caller's loop reaches them (as a loop over
    ``as_completed`` reading each result): read all as they finish, several batches at once, a worker
    that had spilled them would read them all back to send them."""
    await setup(c, s, [1.0, 1.0])
    items = [np.full(2**15, float(i)) for i in range(12)]  # 256 KiB each and results as large: two a batch
    stream = dask_octopus.imap(np.negative, items, client=c)
    got = [await stream.__anext__()]

    def batches():
        return [ts for k, ts in s.tasks.items() if "-octopus-map-" in str(k)]

    def all_finished():  # the five others in memory (the first may be released already: read and dropped)
        states = [ts.state for ts in batches()]
        return len(states) >= 5 and all(state == "memory" for state in states)

    await async_poll_for(all_finished, timeout=10)
    await asyncio.sleep(0.2)
    assert a.transfer_outgoing_count_total + b.transfer_outgoing_count_total == 1  # the first batch only
    got += [pair async for pair in stream]
    assert sorted((i, float(r[0])) for i, r in got) == [(i, -float(i)) for i in range(12)]
    assert a.transfer_outgoing_count_total + b.transfer_outgoing_count_total == 6


def render(i):
    return np.full(2**17, float(i))  # 1 MiB from an int of 28 bytes


@pytest.mark.parametrize("gather", [True, False])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config={
    "octopus.map.steal-fraction": 0, "octopus.fragments.max-bytes": "4 MiB", "octopus.map.learn-result-size": True})
async def test_a_function_s_first_batches_count_results_as_large_as_its_first_item_made(c, s, a, b, gather):
    """The first batched map of a function (paths in, images out) runs its cheapest item alone first: the
    others' batches then count their results that large (3 of 1 MiB in 4 MiB), not as large as the
    items (which would put each worker's 12 in one batch); the next map of it plans all at once."""
    await setup(c, s, [1.0, 1.0])
    for _ in range(2):
        if gather:
            results = await in_thread(dask_octopus.map, render, list(range(24)), client=c, gather=True)
        else:
            results = await c.gather(await in_thread(dask_octopus.map, render, list(range(24)), client=c, group=2))
        assert [(r.shape, r[0]) for r in results] == [((2**17,), float(i)) for i in range(24)]
    counts = [list(p.counts) for _, p in s.plugins["octopus"].placement.made]
    assert [sum(n) for n in counts] == [1, 23, 24] and counts[0] == [1], counts
    assert max(counts[1]) == max(counts[2]) == 3, counts


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config={
    "octopus.map.steal-fraction": 0, "octopus.fragments.max-bytes": "4 MiB", "octopus.map.learn-result-size": True})
async def test_two_lambdas_learn_their_result_sizes_apart(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    assert await in_thread(dask_octopus.map, lambda x: x + 1, list(range(24)), client=c, gather=True) == [
        i + 1 for i in range(24)]  # small results: learned for this lambda
    results = await in_thread(dask_octopus.map, lambda i: np.full(2**17, float(i)), list(range(24)), client=c,
                              gather=True)
    assert [(r.shape, r[0]) for r in results] == [((2**17,), float(i)) for i in range(24)]
    counts = [list(p.counts) for _, p in s.plugins["octopus"].placement.made]
    # this one's first item alone first, then batches of 3 of its 1 MiB results in 4 MiB (was: 12 a batch)
    assert counts[-2] == [1] and sum(counts[-1]) == 23 and max(counts[-1]) == 3, counts


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config={
    "octopus.map.learn-result-size": True, "octopus.map.learn-result-wait": "300ms"})
async def test_a_first_item_that_cannot_run_yet_holds_map_back_no_longer_than_learn_result_wait(c, s, a, b):
    """Under resources no worker has yet, the item run alone first cannot run: ``map`` returns its futures
    after ``octopus.map.learn-result-wait``, the others planned as they are without it (``map`` waited
    for ever, where ``client.map`` returns at once), and they all run once such a worker comes."""
    await setup(c, s, [1.0, 1.0])

    def under_resources():
        with dask.annotate(resources={"GPU": 1}):  # (in the thread that calls map: annotations are per thread)
            return dask_octopus.map(inc, list(range(6)), client=c, group=2)

    start = time.monotonic()
    futures = await asyncio.wait_for(in_thread(under_resources), 15)
    assert time.monotonic() - start < 5
    assert [f.status for f in futures] == ["pending"] * 6
    counts = [list(p.counts) for _, p in s.plugins["octopus"].placement.made]
    assert counts[0] == [1] and sum(counts[1]) == 5, counts
    async with Worker(s.address, nthreads=1, resources={"GPU": 1}):
        assert await asyncio.wait_for(c.gather(futures), 15) == [inc(i) for i in range(6)]


def raises_late_below_three(x):
    time.sleep(0.8)
    if x < 3:
        raise ValueError(x)
    return x


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60, config={
    "octopus.map.learn-result-size": True, "octopus.map.learn-result-wait": "1s"})
async def test_learn_result_wait_bounds_all_the_items_run_alone_first_together(c, s, a, b):
    """The cheapest items raise after 0.8 s each: the first alone, then the next, whose wait ends with the
    1 s the first began (each waited its own second: three alone, 2.4 s, before the others)."""
    await setup(c, s, [1.0, 1.0])
    futures = await in_thread(dask_octopus.map, raises_late_below_three, list(range(8)), client=c, group=2,
                              cost=[1, 2, 3, 4, 5, 6, 7, 8])
    counts = [list(p.counts) for _, p in s.plugins["octopus"].placement.made]
    assert len(counts) <= 3 and sum(map(sum, counts)) == 8, counts
    results = await c.gather(futures, errors="skip")
    assert results == [3, 4, 5, 6, 7]


def render_but_the_first(i):
    if i == 0:
        raise ValueError("no frame 0")
    return render(i)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config={
    "octopus.map.steal-fraction": 0, "octopus.fragments.max-bytes": "4 MiB", "octopus.map.learn-result-size": True})
async def test_a_first_item_that_raises_teaches_nothing_the_next_cheapest_runs_alone(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    results = await in_thread(dask_octopus.map, render_but_the_first, list(range(24)), cost=range(1, 25), client=c,
                              gather=True, errors="skip")
    assert [r[0] for r in results] == [float(i) for i in range(1, 24)]  # item 0 left out
    counts = [list(p.counts) for _, p in s.plugins["octopus"].placement.made]
    assert counts[:2] == [[1], [1]] and sum(counts[2]) == 22 and max(counts[2]) == 3, counts


# a worker process holds ~200 MiB of its own here, a large share of so small a limit: the default budget, the
# fraction Dask leaves between its spill target and its pause threshold (0.2), leaves it room
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, Worker=Nanny, worker_kwargs={"memory_limit": "1000 MiB"},
             timeout=120, config={"octopus.map.steal-fraction": 0})
async def test_batches_of_more_than_a_worker_holds_run_in_parts_instead_of_killing_it(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    # 32 items of 32 MiB, and results of their size: one batch of a worker's 16 would hold 1 GiB at once
    items = [dask.delayed(np.full)(2**22, float(i)) for i in range(32)]
    results = await in_thread(dask_octopus.map, np.negative, items, client=c, gather=True)
    assert [(r.shape, r[0], r[-1]) for r in results] == [((2**22,), -i, -i) for i in range(32)]
    assert max(plan_of(s)[1].counts) == 3  # 0.2 x 1000 MiB over 64 MiB (an item and its result)


def slow_abs(x):
    time.sleep(0.5)
    return abs(x)


@pytest.mark.parametrize("when", ["submitted", "running"])
@pytest.mark.parametrize("how", ["gathered", "streamed"])
def test_a_map_whose_client_another_thread_closes_raises_rather_than_waiting_for_ever(how, when, monkeypatch):
    """The client (with an event loop of its own) closed by another thread of the program while
    ``map(gather=True)`` or ``imap`` waits for its batches: as they were submitted (the loop, which
    reports each batch that finishes, stopped with it: they waited for ever), or as they run (its futures
    cancelled with it: they raised FutureCancelledError, reason unknown). Both say that the client is
    closed, as for a close at any other moment."""
    from dask_octopus.placement import items as items_module

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster:
        with Client(cluster) as admin:
            dask_octopus.register(admin, calibrate=False)
        c = Client(cluster.scheduler_address, set_as_default=False)
        if when == "submitted":
            real = items_module.as_completed

            def closing(*args, **kwargs):  # the other thread's close, at this moment
                c.close()
                return real(*args, **kwargs)

            monkeypatch.setattr(items_module, "as_completed", closing)
        calls = {"gathered": lambda: dask_octopus.map(slow_abs, [-1, -2], client=c, gather=True),
                 "streamed": lambda: list(dask_octopus.imap(slow_abs, [-1, -2], client=c))}
        outcome = []

        def run():
            try:
                outcome.append(calls[how]())
            except Exception as e:
                outcome.append(e)

        thread = threading.Thread(target=run, daemon=True)  # (a daemon: where it waits for ever, the test ends)
        thread.start()
        if when == "running":
            deadline = time.monotonic() + 10
            while not any(ts.state == "processing" for ts in cluster.scheduler.tasks.values()):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            c.close()
        thread.join(30)
        assert outcome, "still waiting 30 s after the client closed"
        assert isinstance(outcome[0], RuntimeError) and str(outcome[0]).startswith("the client is clos"), outcome


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3, Worker=Nanny, timeout=120)
async def test_a_batch_lost_as_its_result_is_read_is_read_after_those_finished_meanwhile(c, s, a, b, w, tmp_path):
    """The worker of a finished batch dies as the reader reads its result: the reader takes the batches
    that finish meanwhile first (``Future.result`` waited for the batch to be computed again)."""
    await setup(c, s, [1.0, 1.0, 1.0])
    name, marker = "lost-read", str(tmp_path / "sending")
    it = await in_thread(dask_octopus.imap, held_back, [0, 1, 2], client=c, cost=[1, 1, 1], name=name,
                         marker=marker)
    assert await in_thread(next, it) == (0, 0)
    where = await items_1_then_2_finished(s, name)
    order = []
    rest = in_thread(lambda: order.extend(i for i, _ in it))
    await async_poll_for(lambda: os.path.exists(marker), timeout=10)  # the reader is into item 1's batch
    # (its event loop sends the result, asleep: a nanny's kill would wait for it to stop)
    os.kill(next(n for n in (a, b, w) if n.worker_address == where[1]).pid, signal.SIGKILL)
    await async_poll_for(lambda: order == [2], timeout=20)  # (item 1, computed again, waits for the test)
    await Event(f"{name}-again").set()
    await asyncio.wait_for(rest, 30)
    assert order == [2, 1]
