"""Fragments keep what plain Dask does: results of every graph, user annotations (restrictions, retries
per task), reuse of results the scheduler holds, collections computed together, errors that do not
pickle, and module globals with local schedulers. Each test compares with the unannotated run."""

import asyncio
import contextlib
import operator
import os
import pickle
import re
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import cloudpickle
import dask
import dask.array as da
import numpy as np
import pytest
from dask.utils import key_split
from distributed import Client, Event, Nanny, Reschedule, Worker, get_worker, wait
from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin
from distributed.utils_test import async_poll_for, captured_logger, gen_cluster
from test_balance import WhereRan, run_balance, setup

import dask_octopus
from dask_octopus._compat import fused_name_of, run_spec_collision
from dask_octopus.groups import marks
from dask_octopus.groups import scheduler as scheduler_groups
from dask_octopus.groups.rewrite import FRAGMENT_PREFIX, GUARD_PREFIX, inner_keys, replaced_keys
from dask_octopus.groups.streams import StepFailed, pick
from dask_octopus.plugins.messages import DONE_SHARE


def scaled(pair, x):
    """Reads a constant tuple that begins with an array (as Dask's cumulative reductions build)."""
    weights, bias = pair
    return x * weights.sum() + bias


def test_tuple_constants_that_begin_with_an_array_are_plain_arguments():
    x = da.arange(64.0, chunks=8).reshape(8, 8).rechunk(4)
    plain = [(x + 1).cumsum(axis=1), (x + 1).cumprod(axis=0) % 7,
             dask.delayed(scaled)((np.ones(3), 0.5), dask.delayed(np.add)(1.0, 2.0))]
    with dask_octopus.annotate():
        grouped = [(x + 1).cumsum(axis=1), (x + 1).cumprod(axis=0) % 7,
                   dask.delayed(scaled)((np.ones(3), 0.5), dask.delayed(np.add)(1.0, 2.0))]
    for got, expected in zip(dask.compute(*grouped, scheduler="sync"), dask.compute(*plain, scheduler="sync")):
        np.testing.assert_array_equal(got, expected)


def inc(x):
    return x + 1


def test_an_array_and_a_delayed_computed_together():
    with dask_octopus.annotate():
        total = ((da.arange(8, chunks=2) + 1) * 2).sum()
        chains = [dask.delayed(inc)(dask.delayed(inc)(dask.delayed(inc)(i))) for i in (1, 10)]
    assert dask.compute(total, dask.delayed(sum)(chains), scheduler="sync") == (72, 17)


def on_the_fpga(b):
    """``b`` doubled, on a worker with the FPGA only."""
    if "FPGA" not in get_worker().state.total_resources:
        raise RuntimeError(f"ran without the FPGA, on {get_worker().address}")
    return 2 * b


@pytest.fixture(params=["optimizer", "update_graph"])
def grouped_by(request, monkeypatch):
    """Where the marked delayed tasks are grouped: by the optimizer on the scheduler (as usual), or by
    the plugin's ``update_graph`` (as when the optimizer cannot read the scheduler's state)."""
    if request.param == "update_graph":
        monkeypatch.setattr(marks, "fragment_here", lambda *args: None)
    return request.param


def load_part(i):
    LOADED.append(i)
    if i == 3:
        raise OSError(f"cannot read part {i}")
    return i


LOADED = []  # the parts load_part was called for (the workers run in this process)


class Executed(WorkerPlugin):
    """Records the run spec of each task its worker starts, pickled as the worker received it."""

    def __init__(self):
        self.specs = {}

    def setup(self, worker):
        self.worker = worker

    def transition(self, key, start, finish, **kwargs):
        if finish == "executing":
            self.specs[key] = cloudpickle.dumps(self.worker.state.tasks[key].run_spec)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def test_no_task_of_dask_octopus_s_code_runs_where_the_worker_plugin_did_not_load(c, s, a, b, grouped_by):
    """A worker where the worker plugin did not load (its environment lacks dask_octopus) could not
    unpickle a fragment task, nor a task that picks a fragment's result: the tasks of an annotated
    compute that run dask_octopus's code run on the other workers, also where the inputs are held
    there (blocks persisted on both, chains of delayed calls); exact results, and the worker still
    runs the compute's plain tasks."""
    b.handlers["plugin-add"] = missing
    await setup(c, s, [1.0, 1.0])
    assert s.plugins["octopus"].profiles[b.address]["error"].startswith("the worker plugin did not load there")
    executed = Executed()
    b.plugins["executed"] = executed
    executed.setup(b)
    x = c.persist(da.arange(64, chunks=4))
    await wait(x)
    assert {ws.address for ts in s.tasks.values() for ws in ts.who_has or ()} == {a.address, b.address}
    with dask_octopus.annotate():
        total = ((x + 1) * 2).sum()
        chains = [dask.delayed(inc)(dask.delayed(inc)(i)) for i in range(16)]
    plain = (x - 1).sum()  # built outside annotate, computed beside them: its tasks may run on b
    assert await c.gather(c.compute([total, plain, *chains])) == [4160, 1952, *range(2, 18)]
    assert any(key_split(k) == FRAGMENT_PREFIX for k in s.plugins["where-ran"].worker)  # it made fragments
    ran_on_b = {k: spec for k, spec in executed.specs.items() if k not in x.__dask_keys__()}
    assert ran_on_b.keys() & dict(plain.__dask_graph__()).keys()  # b still runs plain tasks
    assert not [k for k, spec in ran_on_b.items() if b"dask_octopus" in spec]


def missing(plugin, name=None, catch_errors=True):
    """A worker's ``plugin-add`` handler where dask_octopus is not installed."""
    raise ModuleNotFoundError("No module named 'dask_octopus'", name="dask_octopus")


def gated(name):
    """0, once the distributed Event ``name`` is set."""
    Event(name).wait()
    return 0


async def gated_chains(c, s, workers, n):
    """The futures of an annotated compute of ``n`` chains of two ``inc``, submitted while each of ``workers``
    runs a task that waits for :func:`open_gate` (its fragments queue behind it)."""
    gates = [c.submit(gated, f"gate-{w.address}", workers=[w.address], pure=False) for w in workers]
    await async_poll_for(lambda: all(g.key in s.tasks and s.tasks[g.key].state == "processing" for g in gates), 10)
    with dask_octopus.annotate():
        chains = [dask.delayed(inc)(dask.delayed(inc)(i)) for i in range(n)]
    futures = c.compute(chains)
    await async_poll_for(lambda: any(key_split(k) == FRAGMENT_PREFIX for k in s.tasks), 10)
    return futures


async def open_gate(worker):
    """Let the task of :func:`gated_chains` that waits on ``worker`` end."""
    await Event(f"gate-{worker.address}").set()


async def steal(s, rounds=20):
    """Rounds of Dask's work stealing, at once (Dask's: one every 100 ms), and the moves they asked for
    confirmed or refused by the workers."""
    for _ in range(rounds):
        s.extensions["stealing"].balance()
    await async_poll_for(lambda: not s.extensions["stealing"].in_flight, 10)


def fragments_ran_on(rec):
    """The workers that ran fragment tasks (as :class:`WhereRan` recorded them)."""
    return {w for k, w in rec.worker.items() if key_split(k) == FRAGMENT_PREFIX}


async def with_bad_settings(s):
    """A worker (in this process) with its own bad ``octopus`` settings, once it told the scheduler that the
    worker plugin did not load there."""
    with dask.config.set({"octopus.streams.max-graphs": 0}):
        worker = await Worker(s.address, nthreads=1)
    await async_poll_for(lambda: "error" in s.plugins["octopus"].profiles.get(worker.address, {}), 10)
    return worker


@pytest.mark.parametrize("joins", [True, False])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def test_tasks_kept_off_a_worker_where_the_plugin_did_not_load_run_once_their_workers_left(c, s, a, b,
                                                                                                grouped_by, joins):
    """The tasks kept off a worker where the worker plugin did not load are restricted to the others there
    are: once those have all left, they run on a worker that joined since, or, where none did, on that
    worker (they would fail there without the package), where restrictions to the workers of the moment
    left them waiting for ever."""
    b.handlers["plugin-add"] = missing
    rec = await setup(c, s, [1.0, 1.0])
    futures = await gated_chains(c, s, [a], 8)
    async with contextlib.AsyncExitStack() as stack:
        if joins:
            w3 = await stack.enter_async_context(Worker(s.address, nthreads=1))
            await async_poll_for(lambda: w3.address in s.plugins["octopus"].profiles, 10)
        await open_gate(a)
        await a.close()
        assert await asyncio.wait_for(c.gather(futures), 20) == list(range(2, 10))
        assert {w for k, w in rec.worker.items() if not k.startswith("gated-")} == {w3.address if joins
                                                                                   else b.address}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def test_work_stealing_moves_no_task_kept_off_a_worker_where_the_plugin_did_not_load_there(c, s, a, b):
    """The tasks kept off a worker where the worker plugin did not load are restricted strictly to the
    others there are, a worker that joins among them: restricted loosely, Dask's work stealing gave them
    to that worker where it alone was idle."""
    b.handlers["plugin-add"] = missing
    rec = await setup(c, s, [1.0, 1.0])
    futures = await gated_chains(c, s, [a], 16)
    await steal(s)  # b idle, a busy
    async with Worker(s.address, nthreads=1) as w3:
        await async_poll_for(lambda: w3.address in s.plugins["octopus"].profiles, 10)
        await steal(s)
        await open_gate(a)
        assert await c.gather(futures) == list(range(2, 18))
        assert b.address not in fragments_ran_on(rec) and w3.address in fragments_ran_on(rec)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60)
async def test_tasks_submitted_before_a_worker_where_the_plugin_did_not_load_joined_are_kept_off_it(c, s, a):
    """A worker with bad settings that joins while an annotated compute runs, and tells that the worker
    plugin did not load there: the compute's tasks that run dask_octopus's code are kept off it from then
    on, those submitted before it joined too (Dask's work stealing gave it the fragment queued on a)."""
    rec = await setup(c, s, [1.0])
    futures = await gated_chains(c, s, [a], 16)
    async with await with_bad_settings(s):
        await steal(s)
        await open_gate(a)
        assert await c.gather(futures) == list(range(2, 18))
        assert fragments_ran_on(rec) == {a.address}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def test_results_kept_off_a_worker_that_left_since_are_computed_again_where_the_workers_are(c, s, a, b):
    """Once the worker where the worker plugin did not load left, no task is kept off: results computed
    while it was there, lost with their worker later, are computed again on the workers there are then
    (their restrictions of that time would keep them waiting for ever)."""
    b.handlers["plugin-add"] = missing
    await setup(c, s, [1.0, 1.0])
    with dask_octopus.annotate():
        chains = [dask.delayed(inc)(dask.delayed(inc)(i)) for i in range(8)]
    held = c.compute(chains)  # (their results held: computed again when lost)
    await wait(held)
    await b.close()
    async with Worker(s.address, nthreads=1) as w3:
        await async_poll_for(lambda: w3.address in s.plugins["octopus"].profiles, 10)
        await a.close()
        assert await asyncio.wait_for(c.gather(held), 20) == list(range(2, 10))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def test_tasks_sent_to_a_worker_before_it_told_that_the_plugin_did_not_load_are_placed_again(c, s, a, b):
    """The tasks that run dask_octopus's code sent to a worker (waiting there) before it told that the worker
    plugin did not load there are placed again, on the others."""
    rec = await setup(c, s, [1.0, 1.0])
    futures = await gated_chains(c, s, [a, b], 16)
    await async_poll_for(lambda: any(key_split(ts.key) == FRAGMENT_PREFIX for ts in s.workers[b.address].processing),
                         10)
    s.plugins["octopus"].report_not_loaded(b.address, "ModuleNotFoundError(\"No module named 'dask_octopus'\")")
    for w in (a, b):
        await open_gate(w)
    assert await c.gather(futures) == list(range(2, 18))
    assert fragments_ran_on(rec) == {a.address}


STARTS = []  # the items counted_inc started


def counted_inc(x):
    STARTS.append(x)
    time.sleep(0.2)
    return x + 1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60)
async def test_tasks_running_where_alone_the_plugin_did_not_load_run_once_when_a_worker_joins(c, s, a):
    """Where only workers on which the worker plugin did not load are left (bad settings here: the package
    imports), Dask runs the tasks kept off them there; a worker that joins later does not have those that
    already run there released and run again."""
    STARTS.clear()
    await setup(c, s, [1.0])
    s.plugins["octopus"].report_not_loaded(a.address, "ValueError('bad octopus setting')")
    with dask_octopus.annotate():
        chains = [dask.delayed(counted_inc)(dask.delayed(inc)(i)) for i in range(8)]
    futures = c.compute(chains)
    await async_poll_for(lambda: STARTS, 10)
    async with Worker(s.address, nthreads=2):
        assert await c.gather(futures) == list(range(2, 10))
    assert sorted(STARTS) == list(range(1, 9))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def test_a_joining_worker_takes_no_task_kept_off_before_it_tells_that_the_plugin_loaded(c, s, a, b):
    """A worker that joins takes none of the tasks kept off the workers where the worker plugin did not
    load before it told that it loaded there (here it did not: bad settings): taken to have it from the
    start, it was given fragments by Dask's work stealing before it told."""
    b.handlers["plugin-add"] = missing
    rec = await setup(c, s, [1.0, 1.0])
    futures = await gated_chains(c, s, [a], 16)
    told = s.handlers["octopus_not_loaded"]

    async def steal_then_tell(worker, error):  # (Dask awaits a handler's coroutine)
        await steal(s)
        return told(worker, error)

    s.handlers["octopus_not_loaded"] = steal_then_tell
    async with await with_bad_settings(s):
        await open_gate(a)
        assert await c.gather(futures) == list(range(2, 18))
        assert fragments_ran_on(rec) == {a.address}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def test_tasks_kept_off_by_an_unregistered_plugin_run_once_their_workers_left(c, s, a, b):
    """Unregistered, the plugin no longer keeps the restrictions of the tasks kept off a worker where the
    worker plugin did not load up to date: they are loosened (those that wait in ``no-worker`` for a worker
    that left run elsewhere), not left waiting for ever."""
    b.handlers["plugin-add"] = missing
    await setup(c, s, [1.0, 1.0])
    futures = await gated_chains(c, s, [a], 8)
    await c.unregister_scheduler_plugin("octopus")  # its remove_worker hook no longer runs
    await open_gate(a)
    await a.close()
    assert await asyncio.wait_for(c.gather(futures), 20) == list(range(2, 10))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)])
async def test_a_failing_task_outside_annotate_fails_only_what_reads_it(c, s, a, grouped_by):
    """Eight loads built outside ``annotate``, each read by one task built inside it: the loads join
    the fragments that alone read them, so the failing load fails only its reader (it failed the
    whole fragment, four results, when the loads were the fragment task's inputs). Loads the
    scheduler holds already are reused, not run again in a fragment."""
    rec = await setup(c, s, [1.0])
    loaded = [dask.delayed(load_part)(i) for i in range(8)]
    with dask_octopus.annotate():
        parts = [dask.delayed(inc)(b) for b in loaded]
    futures = c.compute([dask.delayed(inc)(p) for p in parts])
    await wait(futures)
    assert [f.status for f in futures] == ["finished"] * 3 + ["error"] + ["finished"] * 4
    assert await c.gather(futures[:3] + futures[4:]) == [i + 2 for i in (0, 1, 2, 4, 5, 6, 7)]
    assert repr(await futures[3].exception()) == "OSError('cannot read part 3')"
    assert any(str(k[0]).startswith(FRAGMENT_PREFIX) for k in rec.worker if isinstance(k, tuple))
    assert not any(key_split(k) == "load_part" for k in rec.worker)  # they ran as steps
    del futures
    held = c.compute(loaded[4:])
    await wait(held)
    LOADED.clear()
    with dask_octopus.annotate():
        parts = [dask.delayed(inc)(b) for b in loaded[4:]]
    assert await c.gather(c.compute([dask.delayed(inc)(p) for p in parts])) == [6, 7, 8, 9]
    assert LOADED == []


def stops_at_two(b, block_info=None):
    """``b + 1``, but block 2 raises ``StopIteration`` (a ``next()`` on an empty iterator)."""
    if block_info[0]["chunk-location"][0] == 2:
        next(iter([]))
    return b + 1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_member_that_raises_stop_iteration_fails_what_reads_it_instead_of_shortening_it(c, s, a, b,
                                                                                                  grouped_by):
    """A block raising ``StopIteration``: read from a fragment inside the arguments of the task that
    concatenates the blocks, it ended Dask's evaluation of those arguments there, and the concatenation
    ran on the two blocks before it, without an error. It fails the compute, as without ``annotate``
    (distributed turns it into a ``RuntimeError`` there), and the blocks that do not read it are exact."""
    x = da.arange(40, chunks=4)
    with pytest.raises(RuntimeError, match="coroutine raised StopIteration"):
        await c.compute(x.map_blocks(stops_at_two, dtype=x.dtype))
    with dask_octopus.annotate():
        y = x.map_blocks(stops_at_two, dtype=x.dtype)
    with pytest.raises(RuntimeError, match="a task raised StopIteration") as info:
        await c.compute(y)
    assert isinstance(info.value.__cause__, StopIteration)
    with dask_octopus.annotate():
        sums = [dask.delayed(sum)(y.blocks[i]) for i in range(10)]
    futures = c.compute(sums)
    await wait(futures)
    assert [f.status for f in futures] == ["finished"] * 2 + ["error"] + ["finished"] * 7
    assert await c.gather(futures[:2] + futures[3:]) == [sum(range(4 * i + 1, 4 * i + 5)) for i in range(10) if i != 2]


def test_a_held_stop_iteration_is_raised_as_a_runtime_error_caused_by_it_with_its_notes():
    """Inside the arguments of a task, a pick that raised ``StopIteration`` would end them early (Dask
    evaluates them in a ``map``): it raises a ``RuntimeError`` caused by it, its notes kept; other
    errors as they are."""
    def concat(*parts):
        return [v for part in parts for v in part]

    error = StopIteration()
    error.add_note("dask_octopus: raised by task 'x' of a fragment")
    outputs = ([1], StepFailed(error), [3])
    with pytest.raises(RuntimeError, match="a task raised StopIteration") as info:
        concat(*map(lambda i: pick(outputs, i), range(3)))
    assert isinstance(info.value.__cause__, StopIteration)
    assert info.value.__notes__ == ["dask_octopus: raised by task 'x' of a fragment"]
    with pytest.raises(KeyError):
        pick(([1], StepFailed(KeyError("k"))), 1)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60)
async def test_another_client_s_graph_naming_a_member_before_it_is_forgotten_runs_it_with_its_inputs(
        c, s, a, monkeypatch):
    """Grouped by the plugin's ``update_graph``, the members stay tasks (read by none) until a callback
    forgets them; another client's graph that names one of them meanwhile gets its own task, reading its
    inputs (it kept the member's spec without its inputs: Dask took the new spec for a collision, and
    the task failed with "missing keys")."""
    await setup(c, s, [1.0])
    monkeypatch.setattr(marks, "fragment_here", lambda *args: None)  # grouped by update_graph
    forget = scheduler_groups.forget_unread
    monkeypatch.setattr(scheduler_groups, "forget_unread",  # (the window made long)
                        lambda *args: asyncio.get_running_loop().call_later(2, forget, *args))
    parts = [dask.delayed(inc)(i, dask_key_name=f"part-{i}") for i in range(40)]
    outs = [dask.delayed(inc)(p, dask_key_name=f"out-{i}") for i, p in enumerate(parts)]
    with dask_octopus.annotate():
        first = c.compute(dask.delayed(sum)(outs))
    await async_poll_for(lambda: any(str(k[0]).startswith(FRAGMENT_PREFIX) for k in s.tasks if type(k) is tuple), 5)
    assert s.tasks["part-5"].state == "released"  # a member, forgotten later
    async with Client(s.address, asynchronous=True) as other:
        assert await other.compute(outs[5]) == 7
    assert await first == sum(range(2, 42))


CALLS = []  # the parts load_or_reschedule was called for


def load_or_reschedule(i):
    """Part ``i``; part 3 asks, the first time, to be scheduled again (``distributed.Reschedule``)."""
    CALLS.append(i)
    if i == 3 and CALLS.count(3) == 1:
        raise Reschedule("not here yet")
    return i


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60)
async def test_a_member_that_asks_to_be_rescheduled_reschedules_its_fragment(c, s, a, grouped_by):
    """A member raising ``Reschedule`` (stop, and schedule this task again) ends its fragment, which the
    worker schedules again, as it would the member's own task; kept as the member's failure, it was
    raised by each task reading it, rescheduled without end while the scheduler spun."""
    await setup(c, s, [1.0])
    CALLS.clear()
    with dask_octopus.annotate():
        outs = [dask.delayed(inc)(dask.delayed(load_or_reschedule)(i)) for i in range(8)]
    total = c.compute(dask.delayed(sum)(outs))
    assert await asyncio.wait_for(total, 30) == sum(range(1, 9))
    assert CALLS.count(3) == 2 and set(CALLS) == set(range(8))


@pytest.mark.parametrize("through", [0, 1, 2])  # the part reads the failed task, or through tasks built outside
@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)])
async def test_a_failed_task_a_client_holds_fails_only_what_reads_it(c, s, a, grouped_by, through):
    """A failed task that a client holds, read by one of eight parts (directly, or through one or two
    tasks built outside ``annotate``, which the fragment would pull in; Dask blames only the direct
    readers before plugins run): Dask fails its readers as it gets them, the other parts run in
    fragments, as without fragments (their fragment failed whole, or waited for the failed task)."""
    rec = await setup(c, s, [1.0])
    bad = dask.delayed(load_unless, pure=True)(3, 3)
    held = c.compute(bad)
    await wait(held)
    read = bad
    for _ in range(through):
        read = dask.delayed(inc)(read)
    with dask_octopus.annotate():
        parts = [dask.delayed(add)(read, i) if i == 3 else dask.delayed(inc)(i) for i in range(8)]
    futures = c.compute([dask.delayed(inc)(p) for p in parts])
    await wait(futures)
    assert [f.status for f in futures] == ["finished"] * 3 + ["error"] + ["finished"] * 4
    assert await c.gather(futures[:3] + futures[4:]) == [i + 2 for i in (0, 1, 2, 4, 5, 6, 7)]
    assert repr(await futures[3].exception()) == "OSError('cannot read part 3')"
    assert any(key_split(k) == FRAGMENT_PREFIX for k in rec.worker)


def slow_load_unless(i, bad):
    time.sleep(0.2)
    return load_unless(i, bad)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)])
async def test_an_input_still_running_that_fails_fails_no_output_wrongly_and_once_waited_its_readers_only(
        c, s, a, b, grouped_by):
    """Futures still running when the annotated graph comes, one of which then fails: each output is its
    exact value or that input's error, and its reader fails (Dask fails a task's dependents before they
    run: a fragment reading it fails whole, docs/fragments.md, Failures). Waited for first, the failed
    input is held: only its reader fails, as without fragments."""
    rec = await setup(c, s, [1.0, 1.0])
    for waited in (False, True):
        loads = [c.submit(slow_load_unless, i, 3, key=f"load-{waited}-{i}") for i in range(8)]
        if waited:
            await wait(loads)
        with dask_octopus.annotate():
            parts = [dask.delayed(inc)(f, dask_key_name=f"part-{waited}-{i}") for i, f in enumerate(loads)]
        futures = c.compute([dask.delayed(inc)(p, dask_key_name=f"out-{waited}-{i}") for i, p in enumerate(parts)])
        await asyncio.wait_for(wait(futures), 30)
        for i, f in enumerate(futures):
            if f.status == "finished":
                assert await f == i + 2
            else:
                assert repr(await f.exception()) == "OSError('cannot read part 3')", i
        statuses = [f.status for f in futures]
        assert statuses[3] == "error" and (not waited or statuses.count("error") == 1), statuses
    assert any(key_split(k) == FRAGMENT_PREFIX for k in rec.worker)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_graphs_optimized_beside_the_cluster_of_this_process_do_not_read_its_state(c, s, a):
    """The optimizer reads the scheduler's state only where the scheduler optimizes the graphs it gets:
    an annotated collection whose keys the cluster holds (its results picked from fragments), computed
    with a local scheduler of this process, and a delayed object built over its blocks (``to_delayed``
    optimizes where it is called) and computed once the cluster let the keys go, are exact (they read
    fragment tasks that only the cluster had: Missing dependency, and cancelled for lost dependencies)."""
    await setup(c, s, [1.0])
    xn = np.arange(64 * 64.0).reshape(64, 64) % 13
    with dask_octopus.annotate():
        z = ((da.from_array(xn, chunks=8) + 1) * 2).sum(axis=0)
    expected = ((xn + 1) * 2).sum(axis=0)
    held = c.persist(z)
    await wait(held)
    assert any(key_split(k) == FRAGMENT_PREFIX for k in s.tasks)
    np.testing.assert_array_equal(z.compute(scheduler="sync"), expected)
    with ThreadPoolExecutor(2) as pool:  # (Dask's own pool would outlive the test)
        np.testing.assert_array_equal(z.compute(scheduler="threads", pool=pool), expected)
    with dask_octopus.annotate():
        blocks = dask.delayed(np.concatenate)(z.to_delayed().ravel().tolist())
    del held
    await async_poll_for(lambda: not s.tasks, timeout=5)
    np.testing.assert_array_equal(await c.compute(blocks), expected)


def add(x, y):
    return x + y


FAILED_ONCE = set()  # the parts that load_unless failed for once


def load_unless(i, bad, once=False):
    """Part ``i``, but an error for part ``bad`` (``once``: the first time only)."""
    if i == bad and not (once and i in FAILED_ONCE):
        FAILED_ONCE.add(i)
        raise OSError(f"cannot read part {i}")
    return i


class Guarded(SchedulerPlugin):
    """Records the keys whose tasks ran as guards (tasks that only fragments read), and those of the guards
    marked as teaching no speed (they failed, or read a failed value)."""

    def __init__(self, scheduler):
        self.scheduler, self.keys, self.untimed = scheduler, set(), set()

    def transition(self, key, start, finish, *args, **kwargs):
        if finish == "memory" and key_split(key).endswith(f"-{GUARD_PREFIX}"):
            keys = replaced_keys(self.scheduler.tasks[key].run_spec)
            self.keys.update(keys)
            if (kwargs.get("metadata") or {}).get(DONE_SHARE) == 0.0:
                self.untimed.update(keys)


@pytest.mark.parametrize("through", [0, 1])  # the readers read the loads, or the loads doubled (not fused)
@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], config={"optimization.fuse.active": False})
async def test_a_failing_task_that_two_fragments_read_fails_only_what_reads_it(c, s, a, grouped_by, through):
    """Eight loads built outside ``annotate`` (and, with ``through``, a task doubling each), each read by
    two neighbouring tasks built inside it, cut into two fragments of four: load 3 is read by both
    fragments. Its failure fails the two results that read it, as without fragments, not the eight (a
    fragment task runs once all its inputs are in memory: such tasks run as guards, whose value holds
    the error for the fragment's steps to fail with)."""
    await setup(c, s, [1.0])
    guarded = Guarded(s)
    s.add_plugin(guarded, name="guarded")

    def outputs(name, bad, once=False):
        loaded = [dask.delayed(load_unless)(i, bad, once, dask_key_name=f"{name}-{i}") for i in range(8)]
        read = [dask.delayed(add)(x, x, dask_key_name=f"{name}-twice-{i}") for i, x in enumerate(loaded)]
        read = read if through else loaded
        with dask_octopus.annotate():
            parts = [dask.delayed(add)(read[i], read[i - 1], dask_key_name=f"part-{name}-{i}") for i in range(8)]
        return c.compute([dask.delayed(inc)(p) for p in parts], retries=1 if once else 0)

    expected = [(1 + through) * (i + (i - 1) % 8) + 1 for i in range(8)]
    assert await c.gather(outputs("probe", None)) == expected
    shared = sorted(int(m[1]) for k in guarded.keys if (m := re.fullmatch(r"probe-(\d)", k)))
    assert len(shared) == 2  # the loads read by both fragments (each at one end of a fragment's run)
    assert guarded.keys == {f"probe-{i}" for i in shared} | {f"probe-twice-{i}" for i in shared if through}
    bad = shared[0]
    futures = outputs("load", bad)
    await wait(futures)
    failed = {bad, (bad + 1) % 8}  # its two readers
    assert [f.status for f in futures] == ["error" if i in failed else "finished" for i in range(8)]
    assert await c.gather([f for i, f in enumerate(futures) if i not in failed]) == [
        e for i, e in enumerate(expected) if i not in failed]
    for i in failed:
        assert repr(await futures[i].exception()) == f"OSError('cannot read part {bad}')"
    # the failed guard (and the one that read its error) finished without doing the work: no timing of a speed
    assert guarded.untimed == {f"load-{bad}"} | ({f"load-twice-{bad}"} if through else set())
    FAILED_ONCE.clear()  # a guard runs its task again as often as its retries allow
    assert await c.gather(outputs("flaky", bad, once=True)) == expected and {bad} == FAILED_ONCE
    assert f"flaky-{bad}" in guarded.keys


def load_on_the_fpga(i):
    if "FPGA" not in get_worker().state.total_resources:
        raise RuntimeError(f"loaded part {i} without the FPGA, on {get_worker().address}")
    return i


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2), ("127.0.0.1", 1, {"resources": {"FPGA": 1}})],
             config={"optimization.fuse.active": False})
async def test_a_task_that_fragments_read_runs_as_a_guard_with_its_own_annotations(c, s, a, b, grouped_by):
    await setup(c, s, [1.0, 1.0])
    guarded = Guarded(s)
    s.add_plugin(guarded, name="guarded")
    with dask.annotate(resources={"FPGA": 1}):
        loaded = [dask.delayed(load_on_the_fpga)(i, dask_key_name=f"fpga-{i}") for i in range(12)]
    with dask_octopus.annotate():
        parts = [dask.delayed(add)(loaded[i], loaded[i - 1]) for i in range(12)]
    assert await c.gather(c.compute([dask.delayed(inc)(p) for p in parts])) == [i + (i - 1) % 12 + 1 for i in range(12)]
    # the loads, of other annotations than the fragments', are read by them only: each a guard, on the FPGA
    assert guarded.keys == {f"fpga-{i}" for i in range(12)}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)])
async def test_a_failing_task_read_by_fragments_and_their_aliases_fails_only_what_reads_it(c, s, a):
    """Each load is read by an alias (as Dask's ``map_overlap`` reads each block's centre) that a
    fragment's task reads and by the next block's task of a fragment: the loads and the aliases run as
    guards, and load 2's failure fails the two outputs that read it, as without fragments (it failed
    whole fragments). A load that a task outside fragments reads too stays a task, and so does its alias
    (a guard's value would reach that task)."""
    from dask_octopus._compat import Alias, Task, TaskRef
    from dask_octopus.groups.rewrite import dependents_of, fragment_graph, is_guard

    def graph(run, also=()):  # the tasks of each run named apart: the runs are in flight at once
        dsk = {}
        for i in range(4):
            dsk[(f"{run}load", i)] = Task((f"{run}load", i), load_unless, i, 2)
            dsk[(f"{run}centre", i)] = Alias((f"{run}centre", i), (f"{run}load", i))
            dsk[(f"{run}part", i)] = Task((f"{run}part", i), add, TaskRef((f"{run}centre", i)),
                                          TaskRef((f"{run}load", (i - 1) % 4)))
            dsk[(f"{run}out", i)] = Task((f"{run}out", i), inc, TaskRef((f"{run}part", i)))
        for i in also:  # read by a task outside fragments too
            dsk[(f"{run}twice", i)] = Task((f"{run}twice", i), add, TaskRef((f"{run}load", i)),
                                           TaskRef((f"{run}load", i)))
        return dsk, [k for k in dsk if k[0] in (f"{run}out", f"{run}twice")]

    def guarded(dsk, keys):
        specs = {k: {"resource": "auto", "group": None} for k in dsk if k[0].endswith("part")}
        out = fragment_graph(dsk, specs, set(keys), dependents_of(dsk), {}, {None: 2})
        assert sum(str(k[0]).startswith(FRAGMENT_PREFIX) for k in out) == 2
        return out, {m for node in out.values() if is_guard(node) for m in replaced_keys(node)}

    out, made = guarded(*graph("grouped-", also=[1]))
    assert made == {(f"grouped-{name}", i) for name in ("load", "centre") for i in (0, 2, 3)}
    dsk, keys = graph("grouped-")
    out, made = guarded(dsk, keys)
    assert made == {(f"grouped-{name}", i) for name in ("load", "centre") for i in range(4)}
    grouped, plain = c.get(out, keys, sync=False), c.get(*graph("plain-"), sync=False)
    await wait(plain + grouped)
    assert [f.status for f in grouped] == [f.status for f in plain] == [
        "error" if i in (2, 3) else "finished" for i in range(4)]
    assert await c.gather([f for f in grouped if f.status == "finished"]) == await c.gather(
        [f for f in plain if f.status == "finished"]) == [4, 2]
    assert {repr(await f.exception()) for f in grouped if f.status == "error"} == {"OSError('cannot read part 2')"}


def fail_on_2(b, block_info=None):
    if block_info[0]["chunk-location"][0] == 2:
        raise OSError("cannot read block 2")
    return b


def smooth(b):
    return b[:-2] + b[2:]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], config={"optimization.fuse.active": False})
async def test_a_failing_block_of_an_annotated_map_overlap_fails_the_blocks_that_read_it(c, s, a, grouped_by):
    """``map_overlap`` reads each block's centre through an alias and its neighbours' edges through
    slices: the failing block 2 fails blocks 1 to 3 of the result, as without ``annotate`` (all of the
    blocks of the fragments that read it, before the blocks and aliases ran as guards)."""
    await setup(c, s, [1.0])
    guarded = Guarded(s)
    s.add_plugin(guarded, name="guarded")

    def blocks(name, annotated):
        x = da.arange(96.0, chunks=8).reshape(48, 2).rechunk((4, 2)).map_blocks(fail_on_2, dtype=float, name=name)
        with dask_octopus.annotate() if annotated else contextlib.nullcontext():
            y = x.map_overlap(smooth, depth={0: 1, 1: 0}, boundary="none", trim=False).sum(axis=1)
        return c.compute([y.blocks[i].sum() for i in range(12)])

    plain, grouped = blocks("load-plain", False), blocks("load-grouped", True)
    await wait(plain + grouped)
    assert [f.status for f in grouped] == [f.status for f in plain] == [
        "error" if i in (1, 2, 3) else "finished" for i in range(12)]
    assert await c.gather([f for f in grouped if f.status == "finished"]) == await c.gather(
        [f for f in plain if f.status == "finished"])
    assert {repr(await f.exception()) for f in grouped if f.status == "error"} == {"OSError('cannot read block 2')"}
    assert {key_split(k) for k in guarded.keys} >= {"load-grouped", "getitem"}  # blocks and aliases


LOADS = []  # the parts slow_load was called for (the workers run in this process)


def slow_load(i):
    LOADS.append(i)
    time.sleep(0.3)
    return i


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], config={"optimization.fuse.active": False})
async def test_computes_in_flight_at_once_share_the_guard_of_a_task_both_read(c, s, a, grouped_by):
    """Two computes, each of two fragments that both read two loads: each load runs once, as Dask runs
    the task that two graphs in flight share."""
    await setup(c, s, [1.0])
    guarded = Guarded(s)
    s.add_plugin(guarded, name="guarded")
    LOADS.clear()
    loaded = [dask.delayed(slow_load)(i, dask_key_name=f"shared-{i}") for i in range(2)]

    def parts(func):
        with dask_octopus.annotate():
            made = [dask.delayed(func)(loaded[0], loaded[1], i) for i in range(4)]
        return [dask.delayed(inc)(p) for p in made]

    first, second = c.compute(parts(lambda x, y, i: x + y + i)), c.compute(parts(lambda x, y, i: x * y * i))
    assert await c.gather([first, second]) == [[2, 3, 4, 5], [1, 1, 1, 1]]
    assert guarded.keys == {"shared-0", "shared-1"}
    assert sorted(LOADS) == [0, 1]


def slow_sum(x, y, i):
    time.sleep(0.3)
    return x + y + i


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], config={"optimization.fuse.active": False})
async def test_computes_that_guard_a_task_differently_do_not_share_its_guard(c, s, a, grouped_by):
    """The first compute guards the loads ``t`` and the tasks ``d`` that read them; the second, in
    flight meanwhile, asks for ``t`` too (which then stays a task), so its guard of ``d`` reads ``t``,
    not ``t``'s guard: another task, under another key (one key with two run specs, Dask warns, may
    fail or deadlock)."""
    await setup(c, s, [1.0])
    t = [dask.delayed(inc)(i, dask_key_name=f"t-{i}") for i in range(2)]
    d = [dask.delayed(inc)(x, dask_key_name=f"d-{i}") for i, x in enumerate(t)]

    def parts(extra):
        with dask_octopus.annotate():
            made = [dask.delayed(slow_sum)(d[0], d[1], i) for i in range(4)]
        return [dask.delayed(inc)(p) for p in made] + extra

    with captured_logger("distributed.scheduler") as log:
        first = c.compute(parts([]))
        await async_poll_for(lambda: any(k[0] == f"d-{GUARD_PREFIX}" for k in s.tasks if type(k) is tuple), 5)
        second = c.compute(parts(t))
        assert await c.gather([first, second]) == [[6, 7, 8, 9], [6, 7, 8, 9, 1, 2]]
    assert "Detected different `run_spec`" not in log.getvalue()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config={"octopus.fragments.max-bytes": "1KiB"})
async def test_a_split_fragment_s_keys_computed_again_unannotated_are_not_taken_for_other_work(c, s, a, b):
    """Fragments over the memory budget run split, their members under their own keys as Dask's fusion
    made them (our graph resolved the aliases Dask gives them); the same collection computed right
    after without annotations names those keys as aliases of the fused tasks: the same work, no
    warning that a key came with another run spec."""
    await setup(c, s, [1.0, 1.0])
    with captured_logger("distributed.scheduler") as log:
        for i in range(3):
            x = da.random.default_rng(i).random((4000, 32), chunks=(250, 32))
            with dask_octopus.annotate():
                z = (x + 1) * 2
            assert await c.compute(z.sum()) == await c.compute(((x + 1) * 2).sum())
    assert "Detected different `run_spec`" not in log.getvalue()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_result_held_from_a_plain_compute_computed_again_annotated_logs_no_collision(c, s, a):
    """A plain compute's result held (its final keys are aliases of the tasks Dask's fusion made), then
    the same collection computed inside annotate (our graph resolves those aliases: the fused work under
    the keys): exact, and no warning that a key came with another run spec. The helper review's case."""
    await setup(c, s, [1.0])
    x = await c.persist(da.random.default_rng(2).random((64, 8), chunks=(4, 8)))

    def build():
        return (x * 2 + 1).sum(axis=1)

    with captured_logger("distributed.scheduler") as log:
        held = c.compute(build())
        expected = await held
        with dask_octopus.annotate():
            y = build()
        np.testing.assert_array_equal(await c.compute(y), expected)
    assert "Detected different `run_spec`" not in log.getvalue()


DOUBLED = []


def counted_double(b):
    """``b`` doubled, noting which block (of eight elements of ``arange``) it was."""
    DOUBLED.append(int(b[0]) // 8)
    time.sleep(0.01)
    return 2 * b


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_an_annotated_collection_computed_twice_at_once_runs_once(c, s, a, b, grouped_by):
    """One annotated array computed twice, the second compute sent while the first is in flight: both
    get the result and each block runs once, as Dask shares the tasks of graphs in flight; made by the
    optimizer, the second graph takes the scheduler's tasks as they are (reading them as the first
    compute made them: no key gets a second run spec, which Dask warns may fail or deadlock). Made by
    the plugin's ``update_graph``, Dask has compared the graphs before the plugin runs: the warning for
    the first compute's consumers, which read fragments, is dropped."""
    await computed_twice_at_once(c, s, [1.0, 1.0])


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_an_annotated_collection_computed_twice_at_once_on_one_worker_runs_once(c, s, a, grouped_by):
    """As above, on one worker: its one fragment holds the sum's tree up to the top task (fused with
    Dask's finalize, named anew each compute), so the second compute's top reads members of the first
    compute's fragment. Made by ``update_graph``, Dask filled in those members' specs from the second graph:
    they read the fragment in flight (they ran again, every block twice)."""
    await computed_twice_at_once(c, s, [1.0])


async def computed_twice_at_once(c, s, speeds):
    await setup(c, s, speeds)
    x = await c.persist(da.arange(64 * 8, chunks=8))
    expected = int((2 * np.arange(64 * 8) + 1).sum())
    DOUBLED.clear()
    with dask_octopus.annotate():
        y = (x.map_blocks(counted_double, dtype=x.dtype) + 1).sum()
    with captured_logger("distributed.scheduler") as log:
        first, second = c.compute(y), c.compute(y)
        assert await c.gather([first, second]) == [expected, expected]
    assert sorted(DOUBLED) == list(range(64))
    assert "Detected different `run_spec`" not in log.getvalue()


def doubled(v):
    return v * 2


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)])
async def test_a_held_result_released_while_its_recompute_is_prepared_is_computed_again(c, s, a, monkeypatch):
    """A second client holds an annotated sum (its task reads the first compute's fragments); this client
    computes the same sum, and the second client releases its result while the scheduler prepares this
    graph (made slow here: a large graph takes its time). The graph keeps its own spec of the sum and the
    tasks that it reads, ungrouped: they compute it again (the graph had taken the held task's spec, read
    fragments that were gone by then, and failed with 'lost dependencies')."""
    await setup(c, s, [1.0])
    with dask_octopus.annotate():
        parts = [dask.delayed(doubled)(i, dask_key_name=("doubled", i)) for i in range(400)]
    total = dask.delayed(sum)(parts, dask_key_name="total")
    async with Client(s.address, asynchronous=True) as other:
        held = other.compute(total)
        assert await held == 400 * 399
        prepared, prepare = threading.Event(), marks.fragment_here

        def slowly(*args, **kwargs):  # (in the scheduler's offload thread: its event loop goes on)
            out = prepare(*args, **kwargs)
            prepared.set()
            time.sleep(1.0)
            return out

        monkeypatch.setattr(marks, "fragment_here", slowly)
        again = c.compute(total)
        while not prepared.is_set():
            await asyncio.sleep(0.01)
        held.release()
        assert await again == 400 * 399


def exit_on_block_0_5(b, block_info=None):
    """The block, but block (0, 5) takes its worker process down (after a while: the other thread of
    the worker meanwhile runs what waits there)."""
    if block_info[0]["chunk-location"] == (0, 5):
        time.sleep(0.2)
        os._exit(1)
    return b


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)] * 2, Worker=Nanny, timeout=120)
async def test_a_block_that_takes_its_worker_down_fails_only_what_reads_it(c, s, a, b, grouped_by):
    """The fragment whose member kills its worker is lost with it; it runs again as one task per member
    (named for the member), so, as without fragments, the member that kills its worker again fails with
    ``KilledWorker`` and only the output that reads it fails; the others are exact. (Dask's default
    ``allowed-failures``, 3, and two threads per worker. One block kills: a task waiting on a worker
    when it goes down counts too, as without fragments, and with a column of four killing blocks, or
    with one thread per worker, another part took its share of the deaths and sometimes failed so.)"""
    await setup(c, s, [1.0, 1.0])
    x = da.ones((40, 80), chunks=10)
    with dask_octopus.annotate():
        y = x.map_blocks(exit_on_block_0_5, dtype=float)
        outs = [y[:, i * 10:(i + 1) * 10].sum() for i in range(8)]
    futures = c.compute(outs)
    error = await futures[5].exception()  # (the others' results may be lost with a worker, then made again)
    assert await c.gather([f for i, f in enumerate(futures) if i != 5]) == [400.0] * 7
    assert type(error).__name__ == "KilledWorker" and f"-{FRAGMENT_PREFIX}-" in str(error)
    # named for the task of the block's work: its name and index, the fragment's name after the name
    name, index = error.task[0].split(f"-{FRAGMENT_PREFIX}-")[0], error.task[1:]
    assert (name, *index) in dict(outs[5].__dask_graph__()), error.task


def test_the_tasks_of_a_split_fragment_are_named_for_the_tasks_they_run_or_serve():
    """A part of a split fragment (and a gather for one of its readers) keeps its task's name and index,
    the fragment's name after the name; keys of other kinds get their prefix and the part's number.
    A reader that is a fragment task gets the fragment's name. Distinct keys, also those that print
    alike, get distinct names."""
    from dask_octopus.groups.scheduler import GATHER_PREFIX, _named_for

    fkey = (f"{FRAGMENT_PREFIX}-ab", 1)
    assert _named_for(("sum-1", 3, 0), fkey, FRAGMENT_PREFIX, 0) == (f"sum-1-{FRAGMENT_PREFIX}-ab-1", 3, 0)
    assert _named_for("total", fkey, GATHER_PREFIX, 0) == f"total-{GATHER_PREFIX}-ab-1"
    assert _named_for(5, fkey, FRAGMENT_PREFIX, 2) == (f"Other-{FRAGMENT_PREFIX}-ab", 1, 2)
    assert _named_for((f"{FRAGMENT_PREFIX}-cd", 0), fkey, GATHER_PREFIX, 3) == (f"{GATHER_PREFIX}-ab", 1, 3)
    named = ["5", ("5",), ("a", 5), ("a", "5"), "a", ("a",)]  # their names: distinct, whatever the part
    assert len({_named_for(k, fkey, p, 0) for k in named for p in (FRAGMENT_PREFIX, GATHER_PREFIX)}) == 2 * len(named)
    others = [5, (1, 2), (f"{FRAGMENT_PREFIX}-cd", 0)]  # told apart by the part's number, unique in a split
    made = {_named_for(k, fkey, p, j) for j, k in enumerate(named + others) for p in (FRAGMENT_PREFIX, GATHER_PREFIX)}
    assert len(made) == 2 * len(named + others)


def slow_first(i):
    time.sleep(2 if i == 0 else 0)
    return i


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3,
             config={"optimization.fuse.active": False, "distributed.scheduler.allowed-failures": 0})
async def test_a_later_compute_of_a_guarded_task_that_failed_whole_ends(c, s, a, b, w3, grouped_by):
    """A guard whose worker is lost (``allowed-failures: 0``: ``KilledWorker``) fails its readers. A
    later compute of the same work (two fragments again on the two workers left, so the loads are
    guarded again, under the same keys), while those failures are held, ends: made by the optimizer,
    Dask reuses the failed guard as it reuses any failed task, and what reads it fails; made by the
    plugin's ``update_graph``, the compute gives up its fragments and runs as plain tasks (linked to
    the failed guard, its fragments would wait forever)."""
    await setup(c, s, [1.0, 1.0, 1.0])
    loaded = [dask.delayed(slow_first)(i, dask_key_name=f"once-{i}") for i in range(2)]

    def parts(func):
        with dask_octopus.annotate():
            made = [dask.delayed(func)(loaded[0], loaded[1], i) for i in range(6)]
        return [dask.delayed(inc)(p) for p in made]

    first = c.compute(parts(lambda x, y, i: x + y + i))

    def guard_running():
        return [ts for k, ts in s.tasks.items() if type(k) is tuple and k[0] == f"once-{GUARD_PREFIX}"
                and ts.state == "processing" and replaced_keys(ts.run_spec) == ["once-0"]]

    await async_poll_for(guard_running, 5)
    guard = guard_running()[0]
    await s.remove_worker(address=guard.processing_on.address, stimulus_id="test", close=False)
    await wait(first)
    assert [f.status for f in first] == ["error"] * 6 and guard.state == "erred"
    second = c.compute(parts(lambda x, y, i: x * y * i))
    await asyncio.wait_for(wait(second), 10)
    if grouped_by == "optimizer":
        assert [type(await f.exception()).__name__ for f in second] == ["KilledWorker"] * 6
    else:
        assert await c.gather(second) == [1] * 6


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], config={"optimization.fuse.active": False})
async def test_a_task_outside_fragments_that_reads_a_failed_task_fails_without_running(c, s, a, grouped_by):
    """A load that fragments read, and a task outside them that asks for a resource no worker has: the
    load fails, and its reader fails at once, as without fragments (had it read a guard's value, it
    would have waited for a worker to run it, forever; such a load stays a task)."""
    await setup(c, s, [1.0])
    loaded = [dask.delayed(load_unless)(i, 0, dask_key_name=f"part-{i}") for i in range(2)]
    with dask_octopus.annotate():
        made = [dask.delayed(slow_sum)(loaded[0], loaded[1], i) for i in range(4)]
    with dask.annotate(resources={"GPU": 1}):
        reader = dask.delayed(inc)(loaded[0])
    futures = c.compute([dask.delayed(inc)(p) for p in made] + [reader])
    await asyncio.wait_for(wait(futures), 10)
    assert [repr(await f.exception()) for f in futures] == ["OSError('cannot read part 0')"] * 5


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1, {"resources": {"FPGA": 1}})])
async def test_tasks_annotated_with_resources_run_where_they_are(c, s, a, b, grouped_by):
    rec = await setup(c, s, [1.0, 1.0])
    x = da.arange(64.0, chunks=4)
    with dask.config.set({"optimization.fuse.active": False}):  # Dask's fusion drops annotations, with or without us
        for i in range(3):  # wherever the fragments land
            with dask_octopus.annotate():
                y = (x + i).map_blocks(inc, dtype=float)
            with dask.annotate(resources={"FPGA": 1}):
                z = y.map_blocks(on_the_fpga, dtype=float)  # marked too (pull_marks): fragments of their own
            assert await c.compute(z.sum()) == 2 * (64 * 63 / 2 + 64 * (i + 1))
    assert FRAGMENT_PREFIX in {key_split(k) for k in rec.worker}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_work_restricted_to_one_worker_is_cut_for_its_threads(c, s, a, b, grouped_by):
    rec = await setup(c, s, [1.0, 1.0])
    expected = float((da.random.default_rng(0).random((256, 6), chunks=(4, 6)) * 2).sum().compute(scheduler="sync"))
    with dask.annotate(workers=[a.address]), dask_octopus.annotate():
        y = (da.random.default_rng(0).random((256, 6), chunks=(4, 6)) * 2).sum()
    with dask.config.set({"optimization.fuse.active": False}):  # Dask's fusion drops annotations, with or without us
        assert await c.compute(y) == pytest.approx(expected, rel=1e-12)
    fragments = [w for k, w in rec.worker.items() if key_split(k) == FRAGMENT_PREFIX]
    assert fragments == [a.address]  # its one thread's (not one per thread of the cluster, all run on a)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 4)
async def test_work_restricted_to_some_workers_is_cut_for_their_threads(c, s, *workers, grouped_by):
    rec = await setup(c, s, [1.0] * 4)
    two = sorted(s.workers)[:2]
    xn = np.arange(256.0)
    with dask.annotate(workers=two), dask_octopus.annotate():
        y = (da.from_array(xn, chunks=4) * 2).map_blocks(inc, dtype=float)
    with dask.config.set({"optimization.fuse.active": False}):
        np.testing.assert_array_equal(await c.compute(y), xn * 2 + 1)  # (no unrestricted tasks to group)
    fragments = [w for k, w in rec.worker.items() if key_split(k) == FRAGMENT_PREFIX]
    assert sorted(fragments) == two  # one per thread of the two workers that may run them


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1, {"resources": {"FPGA": 1}})] * 2 + [("127.0.0.1", 1)] * 2)
async def test_work_needing_a_resource_is_cut_for_the_threads_of_the_workers_that_have_it(c, s, *workers,
                                                                                         grouped_by):
    rec = await setup(c, s, [1.0] * 4)
    with_fpga = sorted(w.address for w in workers[:2])
    xn = np.arange(256.0)
    with dask.annotate(resources={"FPGA": 1}), dask_octopus.annotate():
        y = (da.from_array(xn, chunks=4) * 2).map_blocks(inc, dtype=float)
    with dask.config.set({"optimization.fuse.active": False}):
        np.testing.assert_array_equal(await c.compute(y), xn * 2 + 1)
    fragments = [w for k, w in rec.worker.items() if key_split(k) == FRAGMENT_PREFIX]
    assert sorted(fragments) == with_fpga  # one per thread of the two workers that have the resource


def test_annotated_restrictions_are_read_as_dask_sets_them():
    from dask_octopus._compat import annotated_restrictions

    def coerce(w):  # as Scheduler.coerce_address: an address (or a worker's name) is a worker, else a host
        if "://" not in w:
            raise ValueError(w)
        return w

    annotation = {"workers": ["tcp://a:1", "hostb"], "allow_other_workers": True, "resources": {"GPU": 1}}
    assert annotated_restrictions(annotation, coerce) == ({"tcp://a:1"}, {"hostb"}, {"GPU": 1}, True)
    one = {"workers": "tcp://a:1", "priority": 3}
    assert annotated_restrictions(one, coerce) == ({"tcp://a:1"}, set(), None, False)
    assert annotated_restrictions({}, coerce) == (set(), set(), None, False)


def where(value):
    """``value`` and the worker that read it."""
    return value, get_worker().address


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1, {"resources": {"FPGA": 1}})])
async def test_an_unmarked_task_that_could_join_a_fragment_keeps_its_resources(c, s, a, b, monkeypatch):
    """Grouped in ``update_graph`` (the optimizer sees tasks given to another delayed call as outputs):
    each ``where`` reads one marked chain only, so it could join that chain's fragment, which has no
    resources: it stays a task of its own, on the FPGA's worker."""
    monkeypatch.setattr(marks, "fragment_here", lambda *args: None)
    rec = await setup(c, s, [1.0, 1.0])
    for _ in range(3):  # wherever the fragments land
        with dask_octopus.annotate():
            parts = [dask.delayed(inc)(dask.delayed(inc)(i)) for i in range(8)]
        with dask.annotate(resources={"FPGA": 1}):
            ends = [dask.delayed(where)(p) for p in parts]
        assert await c.compute(dask.delayed(list)(ends)) == [(i + 2, b.address) for i in range(8)]
    assert FRAGMENT_PREFIX in {key_split(k) for k in rec.worker}
    assert [w for k, w in rec.worker.items() if key_split(k) == "where"] == [b.address] * 24


FLAKY = {}  # calls per name (the workers run in this process)


def flaky(name, failures):
    """Raises the first ``failures`` times it runs under ``name``."""
    FLAKY[name] = FLAKY.get(name, 0) + 1
    if FLAKY[name] <= failures:
        raise OSError(f"{name}: transient fault {FLAKY[name]}")
    return name


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_each_member_retries_as_its_own_annotation_says(c, s, a, grouped_by):
    rec = await setup(c, s, [1.0])
    FLAKY.clear()
    with dask_octopus.annotate():
        with dask.annotate(retries=2):
            patient = [dask.delayed(flaky)(f"patient-{i}", 2) for i in range(3)]
        strict = [dask.delayed(flaky)(f"strict-{i}", 1) for i in range(3)]
        tasks = [dask.delayed(inc)(dask.delayed(len)(t)) for t in patient + strict]
    futures = c.compute(tasks)
    await wait(futures)
    assert [f.status for f in futures] == ["finished"] * 3 + ["error"] * 3
    assert {k: n for k, n in FLAKY.items()} == {**{f"patient-{i}": 3 for i in range(3)},
                                                **{f"strict-{i}": 1 for i in range(3)}}
    assert FRAGMENT_PREFIX in {key_split(k) for k in rec.worker}


CALLS = []  # the blocks counted() computed (the workers run in this process)


def counted(b, block_info=None):
    CALLS.append(block_info[0]["chunk-location"][0])
    return b * 2


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_results_the_scheduler_holds_are_reused_not_computed_again(c, s, a):
    await setup(c, s, [1.0])
    CALLS.clear()
    x = da.arange(64.0, chunks=4)
    with dask_octopus.annotate():
        y = x.map_blocks(counted, dtype=float)
    held = c.compute(list(y.to_delayed()))  # the blocks, in memory and wanted by this client
    await wait(held)
    with dask_octopus.annotate():  # y's tasks in the graph again, not fused (each is read twice): Dask reuses them
        total = await c.compute((y + 1).sum() + y.sum())
    assert total == 2 * (2 * 64 * 63 / 2) + 64
    assert sorted(CALLS) == list(range(16))  # once each


def slow_inc(i):
    time.sleep(0.01)
    return i + 1


def pure_chains(group):
    """The same keys whatever ``group`` (pure calls), cut into other fragments."""
    with dask_octopus.annotate(group=group):
        parts = [dask.delayed(slow_inc, pure=True)(dask.delayed(slow_inc, pure=True)(i)) for i in range(16)]
    return dask.delayed(sum, pure=True)(parts)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_the_same_keys_cut_otherwise_while_in_flight_leave_no_task_behind(c, s, a):
    await setup(c, s, [1.0])
    first = c.compute(pure_chains(4))
    second = c.compute(pure_chains(2))  # its total is the first's: its own fragments are read by nothing
    assert await first == await second == sum(i + 2 for i in range(16))
    del first, second
    await async_poll_for(lambda: not s.tasks, timeout=10)


class GraphsSeen(SchedulerPlugin):
    """Counts the graphs the scheduler took (its plugins see each after Dask compared it with its tasks)."""

    def __init__(self):
        self.count = 0

    def update_graph(self, *args, **kwargs):
        self.count += 1


def slow_plus_one(b):
    time.sleep(0.02)
    return b + 1


@pytest.mark.parametrize("first_done", [False, True])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)])
async def test_the_same_dataframe_computed_without_annotate_while_held_leaves_no_task_behind(c, s, a, first_done):
    """The first compute's consumers read fragments; the second, unannotated, brings the same keys
    with Dask's run specs: Dask keeps the first's (the warning that they differ, only by our grouping,
    is dropped), and the tasks of the second that only those consumers would read are read by nothing.
    They are forgotten (64 of them stayed released for good), in flight or once the first has
    finished."""
    import dask.dataframe as dd
    import pandas as pd

    rec, seen = WhereRan(), GraphsSeen()
    s.add_plugin(rec)
    s.add_plugin(seen)
    await dask_octopus.register(c, calibrate=False)
    df = dd.from_pandas(pd.DataFrame({"v": np.arange(64.0)}), npartitions=16)
    with dask_octopus.annotate():
        first = c.compute(df.v.map_partitions(slow_plus_one).sum())
    if first_done:
        await wait(first)
    await async_poll_for(lambda: seen.count == 1, timeout=5)
    assert all(str(d.key[0]).startswith(FRAGMENT_PREFIX) for d in s.tasks[first.key].dependencies)  # they collide
    with captured_logger("distributed.scheduler") as log:
        second = c.compute(df.v.map_partitions(slow_plus_one).sum())
        assert await first == await second == 64 * 63 / 2 + 64
        await async_poll_for(lambda: seen.count == 2, timeout=5)  # (done, the client knew the result)
    assert "Detected different `run_spec`" not in log.getvalue()
    assert any(str(k[0]).startswith(FRAGMENT_PREFIX) for k in rec.worker if isinstance(k, tuple))
    del first, second
    await async_poll_for(lambda: not s.tasks, timeout=10)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_without_the_plugin_a_held_annotated_result_computed_plainly_is_dask_s_collision(c, s, a):
    """Without the plugin nothing on the scheduler sees the graphs: the held annotated result's task reads
    fragments, the plain compute's reads the partial sums. Exact, Dask's warning is logged, and the plain
    graph's tasks that only its version of the held keys would read stay on the scheduler, released and
    holding no data (Dask's handling of a reused key: dask/dask#9888), until the scheduler restarts."""
    x = da.from_array(np.arange(256.0).reshape(32, 8), chunks=(2, 8))

    def build():  # 16 blocks, partial means of 4 of them: those of two fragments of 2 stay tasks
        return x.map_blocks(np.abs).mean(axis=0)

    with dask_octopus.annotate(group=2):
        held = c.compute(build())
    expected = await held
    with captured_logger("distributed.scheduler") as log:
        np.testing.assert_array_equal(await c.compute(build()), expected)
    assert "Detected different `run_spec`" in log.getvalue()
    del held
    await async_poll_for(lambda: all(ts.state == "released" for ts in s.tasks.values()), timeout=5)
    assert s.tasks and not a.data


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_an_annotated_dataframe_computed_again_while_its_result_is_held_logs_no_collision(c, s, a, b):
    """The same annotated sum computed again before the client released the first result (as a loop
    computing it does): the scheduler still holds the first compute's result, whose task reads the
    fragments; the second graph's reads the partitions' partial sums. Both give the sum; Dask keeps its
    task, and its warning that the key came with other dependencies, which says this may fail or
    deadlock, is not logged: the two differ only by our grouping."""
    import dask.dataframe as dd
    import pandas as pd

    await dask_octopus.register(c, calibrate=False)
    df = await c.persist(dd.from_pandas(pd.DataFrame({"v": np.arange(256.0)}), npartitions=16))
    seen = GraphsSeen()
    s.add_plugin(seen)
    with captured_logger("distributed.scheduler") as log:
        results = []
        for _ in range(3):
            with dask_octopus.annotate():
                results.append(c.compute(df.v.map_partitions(slow_plus_one).sum()))
            await wait(results[-1])  # held, still, when the next one comes
        assert await c.gather(results) == [256 * 255 / 2 + 256] * 3
        await async_poll_for(lambda: seen.count == 3, timeout=5)  # (the client knew the later ones' result)
    held = s.tasks[results[0].key].dependencies  # the held result reads fragments: the keys collide
    assert held and all(str(d.key[0]).startswith(FRAGMENT_PREFIX) for d in held)
    assert "Detected different `run_spec`" not in log.getvalue()


def plus_one_twice(block):
    return block * 2 + 1


@pytest.mark.parametrize("key, name, fused", [
    (("var-1a", 4, 0), ("array-var-1a", 4, 0), True),  # Dask's name for the chain array -> var
    (("var-1a", 4, 0), ("array-getitem-var-1a", 4, 0), True),
    ("var-1a", "array-var-1a", True),
    (("var-1a", 4, 0), ("array-var-1a", 4, 1), False),  # another block
    (("var-1a", 4, 0), ("var-1a", 4, 0), False),
    (("ar-1a", 0), ("bar-1a", 0), False),  # not a prefix joined by "-"
    (("var-1a", 0), "array-var-1a", False),
])
def test_the_names_dask_s_fusion_gives_a_chain_are_told_apart(key, name, fused):
    assert fused_name_of(key, name) is fused


def fused_std(data):
    return da.from_array(data, chunks=(10, 10), name="src").map_blocks(plus_one_twice).std()


@pytest.mark.parametrize("group", [None, 3])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_an_annotated_array_computed_again_while_held_logs_no_collision(c, s, a, b, group):
    """As for the dataframe, with an array whose keys Dask's fusion renames: the held result's tasks
    read fragments (with ``group=3``, fragments whose members read other fragments' results inline);
    the same array computed again without ``annotate`` reads the keys they stand for, and a block's key
    as an alias of the name Dask's fusion gives its chain. (Without the filter, Dask warns here.)"""
    await dask_octopus.register(c, calibrate=False)
    data = np.arange(60 * 40, dtype=float).reshape(60, 40)
    seen = GraphsSeen()
    s.add_plugin(seen)
    with captured_logger("distributed.scheduler") as log:
        with dask_octopus.annotate(group=group):
            first = c.compute(fused_std(data))
        await wait(first)  # held, still, when the next one comes
        second = c.compute(fused_std(data))
        assert await first == await second == (data * 2 + 1).std()
        await async_poll_for(lambda: seen.count == 2, timeout=5)
    assert any(str(d.key[0]).startswith(FRAGMENT_PREFIX) for k in s.tasks[first.key].dependencies
               for d in k.dependencies)  # the held result's tasks read fragments
    assert "Detected different `run_spec`" not in log.getvalue()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_grouped_key_brought_again_reading_work_done_upstream_is_still_warned_about(c, s, a, b):
    """Each held task that reads groups, sent again reading a source block whose work a fragment
    upstream of it did (fused into a member; two fragments away for the partial results): other work,
    warned about."""
    await dask_octopus.register(c, calibrate=False)
    data = np.arange(60 * 40, dtype=float).reshape(60, 40)
    with dask_octopus.annotate(group=3):
        first = c.compute(fused_std(data))
    await wait(first)

    def blocks_upstream(ts):  # the source blocks fused into the members of the groups upstream of ts
        out, stack, seen = set(), list(ts.dependencies), set()
        while stack:
            group = stack.pop()
            if group.key not in seen and replaced_keys(group.run_spec):
                seen.add(group.key)
                out |= {k for k in inner_keys(group.key, group.run_spec) if type(k) is tuple and k[0] == "src"}
                stack.extend(group.dependencies)
        return out

    held = {k: min(blocks_upstream(ts)) for k, ts in s.tasks.items() if ts.dependencies
            and not replaced_keys(ts.run_spec) and all(replaced_keys(d.run_spec) for d in ts.dependencies)}
    assert len(held) > 3 and any("partial" in key_split(k) for k in held)
    async with Client(s.address, asynchronous=True) as c2:
        for key, block in held.items():
            with captured_logger("distributed.scheduler") as log:
                await c2.get({key: (inc, block), block: 1}, key, sync=False)
            assert f"Detected different `run_spec` for key {key!r}" in log.getvalue()
    assert await first == (data * 2 + 1).std()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_grouped_sum_brought_again_reading_one_of_its_members_is_still_warned_about(c, s, a):
    """The held sum reads one fragment (one worker thread); its key sent again reading one member."""
    import dask.dataframe as dd
    import pandas as pd

    await dask_octopus.register(c, calibrate=False)
    df = await c.persist(dd.from_pandas(pd.DataFrame({"v": np.arange(256.0)}), npartitions=16))
    with dask_octopus.annotate():
        first = c.compute(df.v.map_partitions(slow_plus_one).sum())
    await wait(first)
    (group,) = s.tasks[first.key].dependencies
    member = replaced_keys(group.run_spec)[0]
    with captured_logger("distributed.scheduler") as log:
        async with Client(s.address, asynchronous=True) as c2:
            await c2.get({first.key: (inc, member), member: 1}, first.key, sync=False)
    assert f"Detected different `run_spec` for key {first.key!r}" in log.getvalue()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_named_grouped_total_brought_again_over_its_inputs_is_still_warned_about(c, s, a, b):
    """A user's key held as the sum of f(part) (grouped), then the same key for the sum of the parts:
    other work, whose dependencies are the fragments' inputs. Dask keeps the first (the second client
    gets the first sum): the warning is the user's one signal."""
    parts = await c.scatter([np.arange(10.0) + i for i in range(8)])
    await dask_octopus.register(c, calibrate=False)
    with dask_octopus.annotate():
        first = c.compute(dask.delayed(sum)([dask.delayed(slow_plus_one)(p) for p in parts], dask_key_name="total"))
    await wait(first)
    assert all(replaced_keys(d.run_spec) for d in s.tasks["total"].dependencies)  # it reads fragments
    with captured_logger("distributed.scheduler") as log:
        async with Client(s.address, asynchronous=True) as c2:
            await c2.compute(dask.delayed(sum)(parts, dask_key_name="total"))
    assert "Detected different `run_spec` for key 'total'" in log.getvalue()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_plain_key_brought_again_for_other_work_is_still_warned_about(c, s, a):
    """The plugin drops Dask's warning only where the difference is our grouping: a key sent again with
    other dependencies than the task the scheduler holds (a user's key reused for other work) still gets it."""
    await dask_octopus.register(c, calibrate=False)
    seen = GraphsSeen()
    s.add_plugin(seen)
    first = c.get({"src-a": 1, "src-b": 2, "out": (inc, "src-a")}, "out", sync=False)
    await wait(first)
    with captured_logger("distributed.scheduler") as log:
        second = c.get({"src-a": 1, "src-b": 2, "out": (inc, "src-b")}, "out", sync=False)
        assert await second == await first == 2  # Dask keeps the task it has
        await async_poll_for(lambda: seen.count == 2, timeout=5)
    assert "Detected different `run_spec` for key 'out'" in log.getvalue()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_plain_key_brought_again_reading_a_key_named_like_its_fused_chain_is_still_warned_about(c, s, a):
    """Dask's fusion names a chain ending at ``out`` ``...-out``: a plain task ``out`` brought again for
    other work that reads a key so named (``grand-out``) is not taken for a member run under its alias."""
    await dask_octopus.register(c, calibrate=False)
    seen = GraphsSeen()
    s.add_plugin(seen)
    first = c.get({"src-a": 1, "out": (inc, "src-a")}, "out", sync=False)
    await wait(first)
    with captured_logger("distributed.scheduler") as log:
        second = c.get({"grand-out": 10, "out": (inc, "grand-out")}, "out", sync=False)
        assert await second == await first == 2  # Dask keeps the task it has
        await async_poll_for(lambda: seen.count == 2, timeout=5)
    assert "Detected different `run_spec` for key 'out'" in log.getvalue()


@pytest.mark.parametrize("reads", ["nothing", "one member"])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_grouped_key_brought_again_for_other_work_is_still_warned_about(c, s, a, b, reads):
    """The held result of an annotated sum reads two fragments; its key sent again (by another client) for
    other work, reading nothing or one member of one fragment: not the work of the held task, which the
    second spec does not cover (the other fragment), so Dask's warning stays."""
    import dask.dataframe as dd
    import pandas as pd
    from distributed import Client

    await dask_octopus.register(c, calibrate=False)
    df = await c.persist(dd.from_pandas(pd.DataFrame({"v": np.arange(256.0)}), npartitions=16))
    seen = GraphsSeen()
    s.add_plugin(seen)
    with dask_octopus.annotate():
        first = c.compute(df.v.map_partitions(slow_plus_one).sum())
    await wait(first)
    held = s.tasks[first.key].dependencies
    assert len(held) == 2 and all(str(d.key[0]).startswith(FRAGMENT_PREFIX) for d in held)
    member = replaced_keys(next(iter(held)).run_spec)[0]
    other = {first.key: (inc, 1)} if reads == "nothing" else {first.key: (inc, member), member: 1}
    with captured_logger("distributed.scheduler") as log:
        async with Client(s.address, asynchronous=True) as c2:
            second = c2.get(other, first.key, sync=False)
            assert await second == await first == 256 * 255 / 2 + 256  # Dask keeps the task it has
            await async_poll_for(lambda: seen.count == 2, timeout=5)
    assert "Detected different `run_spec`" in log.getvalue()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_another_scheduler_s_warning_for_a_key_held_grouped_here_passes(c, s, a):
    """Schedulers of one process share one logger: this scheduler holds an annotated sum's result, read
    from fragments; another scheduler (no plugin) holds the same key for other work and then gets the sum's
    graph. Its warning names a key held here too, and dependencies this one's grouping would explain,
    but the task it holds is not this one's: the warning stays."""
    import dask.dataframe as dd
    import pandas as pd
    from distributed import Client, LocalCluster

    await dask_octopus.register(c, calibrate=False)
    df = dd.from_pandas(pd.DataFrame({"v": np.arange(64.0)}), npartitions=8)
    with dask_octopus.annotate():
        first = c.compute(df.v.map_partitions(slow_plus_one).sum())
    await wait(first)
    assert all(str(d.key[0]).startswith(FRAGMENT_PREFIX) for d in s.tasks[first.key].dependencies)
    async with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, asynchronous=True,
                            dashboard_address=":0") as cluster, Client(cluster, asynchronous=True) as c2:
        seen = GraphsSeen()
        cluster.scheduler.add_plugin(seen)
        other = c2.get({first.key: (inc, 1)}, first.key, sync=False)
        await wait(other)
        with captured_logger("distributed.scheduler") as log:
            again = c2.compute(df.v.map_partitions(slow_plus_one).sum())
            assert await again == 2 and await first == 64 * 63 / 2 + 64
            await async_poll_for(lambda: seen.count == 2, timeout=5)
    assert f"Detected different `run_spec` for key {first.key!r}" in log.getvalue()


COLLISION = """Detected different `run_spec` for key {key} between two consecutive calls to `update_graph`. \
This can cause failures and deadlocks down the line.
Debugging information
---------------------
old task state: memory
old run_spec: <Task {key} apply(...)>
new run_spec: {spec}
old dependencies: {{('octopus-fragments-ab', 0), ('octopus-fragments-ab', 1)}}
new dependencies: {new}
"""


@pytest.mark.parametrize("key, spec, new, read", [
    ("('sum-tree-1', 0)", "<Task x>", "frozenset({('chunk-1', 0), ('chunk-1', 1)})",
     (("sum-tree-1", 0), {("octopus-fragments-ab", 0), ("octopus-fragments-ab", 1)}, {("chunk-1", 0), ("chunk-1", 1)})),
    ("'out'", "<Task x>", "frozenset()", ("out", {("octopus-fragments-ab", 0), ("octopus-fragments-ab", 1)}, set())),
    # a run spec whose repr spans lines like the ones read: the last of each is the warning's own
    ("'out'", "<weird\nnew dependencies: {'decoy'}>", "frozenset({'a'})",
     ("out", {("octopus-fragments-ab", 0), ("octopus-fragments-ab", 1)}, {"a"})),
    ("<Key object at 0x1>", "<Task x>", "frozenset()", None),  # a key that does not read back
    ("'out'", "<Task x>", "frozenset({<Key object>})", None),
])
def test_the_scheduler_s_run_spec_warning_is_read_back_or_left_alone(key, spec, new, read):
    assert run_spec_collision(COLLISION.format(key=key, spec=spec, new=new)) == read
    assert run_spec_collision("Shuffle 5b31 initialized by task ('shuffle-transfer-5b31', 9)") is None


class CodedError(Exception):
    """An exception whose arguments pickle does not give back to its ``__init__``."""

    def __init__(self, code, detail):
        super().__init__(f"{code}: {detail}")
        self.code = code


def test_a_failed_step_whose_error_does_not_unpickle_travels_as_its_repr():
    error = CodedError(7, "bad block")
    error.add_note("dask_octopus: raised by task 'x' of a fragment")
    failed = StepFailed(error)
    with pytest.raises(TypeError):
        pickle.loads(pickle.dumps(failed.error))
    copy = pickle.loads(pickle.dumps((failed, 1.0)))  # a fragment's outputs, sent to another worker
    assert pick(copy, 1) == 1.0
    with pytest.raises(Exception, match=r"CodedError\('7: bad block'\)") as info:
        pick(copy, 0)
    assert info.value.__notes__ == ["dask_octopus: raised by task 'x' of a fragment"]
    fine = pickle.loads(pickle.dumps(StepFailed(ValueError("block 3"))))
    with pytest.raises(ValueError, match="block 3"):
        pick([fine], 0)


INITS: list[str] = []  # the messages FormattedError.__init__ was called with


class FormattedError(Exception):
    """An exception whose ``__init__`` formats its argument into its message (and counts its calls)."""

    def __init__(self, x):
        INITS.append(x)
        super().__init__(f"wrapped({x})")
        self.x = x


def fails_formatted(b, block_info=None):
    if block_info[0]["chunk-location"][0] == 3:
        raise FormattedError("boom")
    return b + 1


SHARED = CodedError(9, "cached failure")  # one object, raised by several members


class PartsError(ExceptionGroup):
    """An exception group of its own class."""


def raise_part(block):
    raise ValueError("part 1")


def raise_group(block):
    errors = []
    try:
        raise_part(block)
    except ValueError as e:
        errors.append(e)
    raise PartsError("parts", errors)


class SlottedError(Exception):
    """An exception that keeps its state in a slot, set by ``__init__``."""

    __slots__ = ("code",)

    def __init__(self, code):
        super().__init__(code)
        self.code = code

    def __str__(self):
        return f"code {self.code}"


class ArgumentsNewError(Exception):
    """An exception whose ``__new__`` wants its argument."""

    def __new__(cls, code):
        return super().__new__(cls, code)

    def __init__(self, code):
        super().__init__(f"error {code}")


class ArgsPropertyError(Exception):
    """An exception whose ``args`` cannot be set."""

    def __init__(self, what):
        super().__init__(what)

    @property
    def args(self):
        return (str(self),)


class ArgsPropertyGroup(ExceptionGroup):
    """An exception group whose ``args`` cannot be set."""

    @property
    def args(self):
        return (self.message, list(self.exceptions))


def raises_shared(i):
    raise SHARED


def test_a_held_error_is_a_copy_made_without_calling_its_class_s_init_again():
    """A step's error is copied (its frames dropped) as tblib copies one: an ``__init__`` that formats
    its argument is not called again on the formatted message (it read "wrapped(wrapped(boom))"), one
    that takes other arguments than it passes on does not make the copy fail, and the caller's own
    object gathers no notes however many steps raise it."""
    INITS.clear()
    failed = StepFailed(FormattedError("boom"), "dask_octopus: raised by task 'x' of a fragment")
    assert INITS == ["boom"]
    assert (type(failed.error), str(failed.error), failed.error.x) == (FormattedError, "wrapped(boom)", "boom")
    notes = [StepFailed(SHARED, f"dask_octopus: raised by task {k!r} of a fragment").error.__notes__ for k in "ab"]
    assert notes == [[f"dask_octopus: raised by task {k!r} of a fragment"] for k in "ab"]
    assert not hasattr(SHARED, "__notes__") and SHARED.code == 9 and str(SHARED) == "9: cached failure"
    missing = StepFailed(FileNotFoundError(2, "No such file", "/data/part-3")).error
    assert (type(missing), missing.errno, missing.filename, str(missing)) == (
        FileNotFoundError, 2, "/data/part-3", "[Errno 2] No such file: '/data/part-3'")
    group = StepFailed(ExceptionGroup("parts", [ValueError("a"), OSError("b")])).error
    assert type(group) is ExceptionGroup and group.message == "parts" and len(group.exceptions) == 2
    try:  # an exception group's exceptions are copied without their frames too (their locals: big inputs)
        raise_group(np.ones(10))
    except ExceptionGroup as e:
        raised = e
    held = StepFailed(raised).error
    assert type(held) is PartsError and held.message == "parts" and str(held.exceptions[0]) == "part 1"
    assert held.exceptions[0].__traceback__ is None and raised.exceptions[0].__traceback__ is not None
    slotted = StepFailed(SlottedError(5)).error  # its slot is copied: its message reads it
    assert type(slotted) is SlottedError and str(slotted) == "code 5"
    for error in (ArgumentsNewError(7), ArgsPropertyError("read-only")):  # copied as pickle copies them
        failed = StepFailed(error, "dask_octopus: raised by task 'x' of a fragment")
        assert failed.error is not error and type(failed.error) is type(error) and str(failed.error) == str(error)
        assert not hasattr(error, "__notes__")
    try:  # a group that cannot be made anew with copies of its parts: copied as pickle copies it
        raise_group(np.ones(10))
    except ExceptionGroup as e:
        raised = ArgsPropertyGroup("parts", list(e.exceptions))
        raised.__traceback__ = e.__traceback__
    held = StepFailed(raised).error
    assert held is not raised and type(held) is ArgsPropertyGroup and held.message == "parts"
    assert held.__traceback__ is None and raised.__traceback__ is not None  # the caller's keeps its frames


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_member_s_error_reaches_the_client_as_it_was_raised(c, s, a, grouped_by):
    """The client gets a failing member's error with the message it was raised with, and an error
    object that members raise again and again collects no notes of theirs, from compute to compute."""
    x = da.arange(64, chunks=8)
    with dask_octopus.annotate():
        y = x.map_blocks(fails_formatted, dtype=x.dtype)
    with pytest.raises(FormattedError) as info:
        await c.compute((y * 2).sum())
    assert (str(info.value), info.value.x) == ("wrapped(boom)", "boom")
    for _ in range(2):
        with dask_octopus.annotate():
            parts = [dask.delayed(raises_shared, pure=False)(i) for i in range(3)]
        futures = c.compute([dask.delayed(inc)(p) for p in parts])
        await wait(futures)
        for f in futures:
            error = await f.exception()
            assert type(error) is CodedError and str(error) == "9: cached failure"
            assert len(getattr(error, "__notes__", [])) <= 1
        assert not hasattr(SHARED, "__notes__")


SCRIPT = """
import dask, dask.array as da
import dask_octopus

SEEN = []


def record(b, block_info=None):
    SEEN.append(block_info[0]["chunk-location"][0])
    return b + 1


if __name__ == "__main__":
    for scheduler in ("sync", "threads"):
        SEEN.clear()
        with dask_octopus.annotate():
            total = da.arange(32.0, chunks=4).map_blocks(record, dtype=float).sum()
        assert total.compute(scheduler=scheduler) == 32 * 31 / 2 + 32
        assert sorted(SEEN) == list(range(8)), (scheduler, SEEN)
    print("ok")
"""


def test_a_script_s_functions_see_its_globals_with_local_schedulers(tmp_path):
    script = tmp_path / "globals_script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_keys_that_print_alike_make_other_fragments():
    from dask_octopus._compat import Task, TaskRef
    from dask_octopus.groups.rewrite import fragment_graph

    def graph(name):  # a chain of four tasks named name(i) and its total
        dsk = {name(0): Task(name(0), inc, 0)}
        dsk.update({name(i): Task(name(i), inc, TaskRef(name(i - 1))) for i in range(1, 4)})
        dsk["total"] = Task("total", inc, TaskRef(name(3)))
        return dsk

    made = []
    for name in (lambda i: ("a", i), lambda i: str(("a", i))):  # ('a', 0) and "('a', 0)"
        dsk = graph(name)
        specs = {k: {"resource": "auto", "group": None} for k in dsk if k != "total"}
        dependents = {k: {d for d, node in dsk.items() if k in node.dependencies} for k in dsk}
        made.append({k for k in fragment_graph(dsk, specs, {"total"}, dependents, {}, {None: 1}) if k not in dsk})
    assert all(len(m) == 1 for m in made) and not made[0] & made[1]


def test_plugins_registering_while_the_optimizer_reads_them_do_not_fail_it(monkeypatch):
    from dask_octopus.groups import scheduler as groups_scheduler

    class Changing(list):  # the first copy sees the set change size (a plugin registering meanwhile)
        changed = False

        def __iter__(self):
            if not Changing.changed:
                Changing.changed = True
                raise RuntimeError("Set changed size during iteration")
            return super().__iter__()

    monkeypatch.setattr(groups_scheduler, "hosts", Changing())
    monkeypatch.setattr(groups_scheduler, "running_schedulers", lambda: [])
    assert groups_scheduler.grouping_here() is False and Changing.changed


def cancelled_on_2(i):
    """Raises a ``BaseException`` (not an ``Exception``) for item 2, as a task may."""
    import asyncio

    if i == 2:
        raise asyncio.CancelledError("item 2 cancelled")
    return i


def boom_on_block_3(b, block_id=None):
    if block_id == (3,):
        raise KeyError("bad block 3")
    return b * 2


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_base_exception_fails_only_what_reads_it_and_notes_name_user_keys(c, s, a):
    import asyncio

    await setup(c, s, [1.0])
    with dask_octopus.annotate():
        items = [dask.delayed(inc)(dask.delayed(cancelled_on_2)(i)) for i in range(6)]
    futures = c.compute(items)
    await wait(futures)
    assert [f.status for f in futures] == ["finished"] * 2 + ["error"] + ["finished"] * 3
    assert isinstance(await futures[2].exception(), asyncio.CancelledError)
    assert await c.gather([f for i, f in enumerate(futures) if i != 2]) == [1, 2, 4, 5, 6]
    x = da.arange(40, chunks=4)
    with dask_octopus.annotate():
        y = x.map_blocks(boom_on_block_3)
    with pytest.raises(KeyError, match="bad block 3") as info:
        await c.compute(y.sum())
    notes = getattr(info.value, "__notes__", [])
    # the task of Dask's optimized graph that does block 3's work (fused into its partial sum), as Dask's
    # dashboard shows it failing without annotate; not a name made up inside the fragment
    note = r"dask_octopus: raised by task \('sum-[0-9a-f]+', 3\) of a fragment"
    assert any(re.fullmatch(note, n) for n in notes), notes


SLOW = []  # the blocks slow_block ran (the workers run in this process)
GATE = threading.Event()  # the third block waits for it


def slow_block(b, block_info=None):
    SLOW.append(block_info[0]["chunk-location"][0])
    if len(SLOW) == 3:
        GATE.wait(30)
    time.sleep(0.01)
    return b + 1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_cancelled_compute_stops_its_running_fragment(c, s, a):
    await setup(c, s, [1.0])
    SLOW.clear()
    GATE.clear()
    x = await c.persist(da.arange(100.0, chunks=1))
    with dask_octopus.annotate():
        future = c.compute(x.map_blocks(slow_block, dtype=float).sum())  # one fragment of 100 blocks, 1 s
    await async_poll_for(lambda: len(SLOW) == 3, timeout=30)  # the third block waits for the gate
    await future.cancel()
    await async_poll_for(lambda: any(key_split(k) == FRAGMENT_PREFIX and ts.state == "cancelled"
                                     for k, ts in a.state.tasks.items()), timeout=30)
    GATE.set()  # the fragment goes on: its next look at the worker's state (50 ms at most) ends it
    await async_poll_for(lambda: not a.state.executing, timeout=30)
    assert len(SLOW) < 20  # of 100: as a cancelled small task would, the fragment stopped (in 5 blocks or so)
    assert await c.compute(x[:4].sum()) == 6  # and the worker takes the next compute


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_fragment_cancelled_then_asked_for_again_as_it_runs_is_run_once_again(c, s, a):
    """Cancelled and computed again before the fragment's next look at the worker's state: the worker
    resumes the task, but the scheduler drops the result of the run begun before (a stale run); the run
    stops within a step, as a cancelled one does, and runs again at once, instead of running its whole
    share for nothing first (100 blocks then ran 200 times)."""
    await setup(c, s, [1.0])
    SLOW.clear()
    GATE.clear()
    x = await c.persist(da.arange(100.0, chunks=1))
    y = x.map_blocks(slow_block, dtype=float).sum()
    with dask_octopus.annotate():
        future = c.compute(y)  # one fragment of 100 blocks, 1 s
    await async_poll_for(lambda: len(SLOW) == 3, timeout=30)  # the third block waits for the gate
    (key,) = [k for k in a.state.tasks if key_split(k) == FRAGMENT_PREFIX]
    run_id = a.state.tasks[key].run_id
    await future.cancel()
    await async_poll_for(lambda: a.state.tasks[key].state == "cancelled", timeout=30)
    with dask_octopus.annotate():
        future = c.compute(y)
    await async_poll_for(lambda: a.state.tasks[key].run_id != run_id, timeout=30)  # resumed, not run yet
    GATE.set()
    assert await future == 4950 + 100
    assert len(SLOW) < 120  # 100 blocks, and the few the stale run ran before it stopped


DONE_AT = {}  # when work last ran for each name (the workers run in this process)


def work(name, i):
    time.sleep(0.005)
    DONE_AT[name] = time.monotonic()
    return i


@pytest.mark.parametrize("scope", ["built", "computed"])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_fragment_of_higher_priority_sent_with_another_runs_first(c, s, a, scope):
    """Two fragments of one compute on a worker of one thread, one of them of higher ``priority``: the
    worker starts whichever the scheduler sent first, and a fragment holds the thread for its whole
    share (the high-priority work ended last in 3 to 5 computes of 6). As Dask's worker runs its ready
    tasks by priority (plain Dask: the high-priority work always first), the fragment of lower priority
    steps back before its first step. ``annotate`` around building the collections, or around the
    compute; the two outputs asked for in either order."""
    await setup(c, s, [1.0])
    for r in range(8):
        DONE_AT.clear()
        with dask_octopus.annotate() if scope == "built" else contextlib.nullcontext():
            low = [dask.delayed(work)("low", i) for i in range(20)]
            with dask.annotate(priority=10):
                high = [dask.delayed(work)("high", i) for i in range(20)]
            pair = [dask.delayed(sum)(low), dask.delayed(sum)(high)]
        with dask_octopus.annotate() if scope == "computed" else contextlib.nullcontext():
            futures = c.compute(pair if r % 2 else pair[::-1])
        assert await c.gather(futures) == [190, 190]
        assert DONE_AT["high"] < DONE_AT["low"], r
        assert any(key_split(k) == FRAGMENT_PREFIX for k in a.state.tasks), r  # (fragments ran)


TRIES = []  # the parts still_failing was called for


def still_failing(i):
    TRIES.append(i)
    time.sleep(0.05)
    raise OSError(f"cannot read part {i} yet")


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], config={"optimization.fuse.active": False})
async def test_a_cancelled_compute_stops_the_retries_of_its_fragments_and_guards(c, s, a, grouped_by):
    """Eight failing loads, each read by two neighbouring annotated tasks (in two fragments: loads run
    as steps or as guards), retried up to 200 times each: cancelled, the retries stop."""
    await setup(c, s, [1.0])
    TRIES.clear()
    loaded = [dask.delayed(still_failing)(i, dask_key_name=f"retried-{i}") for i in range(8)]
    with dask_octopus.annotate():
        parts = [dask.delayed(add)(loaded[i], loaded[i - 1]) for i in range(8)]
    futures = c.compute([dask.delayed(inc)(p) for p in parts], retries=200)
    await async_poll_for(lambda: len(TRIES) >= 10, timeout=30)
    await c.cancel(futures)
    await async_poll_for(lambda: not s.tasks, timeout=30)  # (the cancel travels on the client's stream)
    await async_poll_for(lambda: not a.state.executing, timeout=30)
    stopped = len(TRIES)
    await asyncio.sleep(0.5)
    assert len(TRIES) == stopped and stopped < 60  # of 8 x 201 tries: it stopped within a few of them


def test_store_into_an_array_of_this_process_with_workers_in_it():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as lc, \
            Client(lc) as client:
        dask_octopus.register(client, calibrate=False)
        x = da.arange(40, chunks=4, dtype=float)
        plain, grouped = np.zeros(40), np.zeros(40)
        da.store(x * 2 + 1, plain)  # the workers run the very target array: Dask writes into it
        with dask_octopus.annotate():
            da.store(x * 2 + 1, grouped)
    np.testing.assert_array_equal(plain, np.arange(40) * 2 + 1)
    np.testing.assert_array_equal(grouped, plain)


def test_a_failed_step_s_traceback_starts_in_the_user_s_code():
    import traceback

    with dask_octopus.annotate():
        y = da.arange(40, chunks=4).map_blocks(boom_on_block_3)
    with pytest.raises(KeyError) as info:
        y.sum().compute(scheduler="sync")
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert frames[-1] == "boom_on_block_3" and "_step" not in frames and "evaluate" not in frames, frames


def raise_at(x):
    raise ValueError(f"boom at {x}")


async def awaited_inc(x):
    await asyncio.sleep(0)
    return x + 1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_coroutine_function_s_task_is_awaited_as_dask_awaits_it(c, s, a):
    await dask_octopus.register(c, calibrate=False)
    with dask_octopus.annotate():
        total = dask.delayed(sum)([dask.delayed(inc)(dask.delayed(awaited_inc)(i)) for i in range(4)])
    assert await c.compute(total) == 14  # was a TypeError: a coroutine, never awaited, plus 1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_failed_member_read_on_another_worker_raises_with_the_member_s_frames(c, s, a, b):
    import traceback

    await dask_octopus.register(c, calibrate=False)
    with dask_octopus.annotate():
        with dask.annotate(workers=[a.address]):
            failed = dask.delayed(raise_at)(dask.delayed(inc)(1))
        with dask.annotate(workers=[b.address]):
            other = dask.delayed(inc)(dask.delayed(inc)(2))
    with dask.annotate(workers=[b.address]):
        top = dask.delayed(operator.add)(failed, other)  # reads a's fragment output on b: it travels pickled
    future = c.compute(top)
    with pytest.raises(ValueError, match="boom at 2"):
        await future
    assert [fr.name for fr in traceback.extract_tb(await future.traceback())] == ["pick", "raise_at"]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_each_reader_of_a_failed_step_raises_its_traceback_once(c, s, a):
    """Four tasks read a failed member, each tried three times (retries=2): each raises the member's
    error with the member's own frames after its one ``pick`` (raising the one error object again
    used to stack every reader's frames onto it: 22 to 57 frames)."""
    import traceback

    await dask_octopus.register(c, calibrate=False)
    with dask_octopus.annotate():
        failed = dask.delayed(raise_at)(dask.delayed(inc)(1))
        readers = [dask.delayed(inc)(failed, dask_key_name=f"reader-{i}") for i in range(4)]
    futures = c.compute([*readers, dask.delayed(inc)(dask.delayed(inc)(2))], retries=2)
    await wait(futures)
    assert await futures[-1] == 4
    for f in futures[:4]:
        frames = [fr.name for fr in traceback.extract_tb(await f.traceback())]
        assert frames == ["pick", "raise_at"], (f.key, frames)
        assert repr(await f.exception()) == "ValueError('boom at 2')"


@pytest.mark.parametrize("priority", [None, 1])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_partial_sums_of_pinned_blocks_join_their_fragments(c, s, a, b, grouped_by, priority):
    """Balanced blocks are pinned (and held) where they live; the partial sums that read them are
    pinned too, or not, and share the blocks' annotations (none, or the same priority): they join.
    Each worker runs its own blocks as one fragment; the aggregate over both stays a task."""
    rec = await setup(c, s, [1.0, 1.0])
    x = await c.persist(await run_balance(c, da.arange(4096.0, chunks=16), per_worker=4))
    with dask.annotate(**({"priority": priority} if priority else {})):
        with dask_octopus.annotate():
            y = x.map_blocks(inc)
        total = await c.compute(y.sum(split_every=4))
    assert total == 4096 * 4095 / 2 + 4096
    ran = [key_split(k) for k in rec.worker]
    assert FRAGMENT_PREFIX in ran and "sum-partial" not in ran and "inc" not in ran, sorted(set(ran))
    fragments = sorted(w for k, w in rec.worker.items() if FRAGMENT_PREFIX in str(k))
    assert fragments == sorted([a.address, b.address]), fragments


def test_each_reader_raises_an_error_of_its_own():
    """Readers of one failed step (threads of a worker, at once) each raise a copy of its error with the
    step's frames: Python adds the frames an exception passes through to the object raised, so readers
    raising one object would stack their frames onto one another's traceback."""
    import traceback


    def failed_step():
        try:
            raise_at(2)
        except ValueError as e:
            return StepFailed(e, "raised by task 'x'")

    held = failed_step()

    def reader():
        pick([held], 0)

    errors = []
    for _ in range(2):
        try:
            reader()
        except ValueError as e:
            errors.append(e)
    first, second = errors
    assert first is not second and first is not held.error
    for e in errors:  # the first keeps its frames after the second was raised
        frames = [f.name for f in traceback.extract_tb(e.__traceback__)]
        assert frames[1:] == ["reader", "pick", "failed_step", "raise_at"], frames
        assert repr(e) == "ValueError('boom at 2')" and e.__notes__ == ["raised by task 'x'"]


class OneStream:
    """Stands in for a CUDA stream: a context, events that are nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def record(self):
        return None

    def wait_event(self, event):
        pass


def test_a_captured_launch_never_runs_a_step_again_a_running_task_does():
    from dask_octopus._compat import Task, TaskRef
    from dask_octopus.groups import streams
    from dask_octopus.groups.fragment import Fragment

    frag = Fragment({"a": Task("a", flaky, "captured", 1), "b": Task("b", len, TaskRef("a"))}, ["b"],
                    {"a": "memory", "b": "memory"}, retries={"a": 2})
    layout = streams.FragmentLayout(frag, 1)
    FLAKY.clear()
    values = {}
    with pytest.raises(OSError, match="captured: transient fault 1"):  # as captured: no task, no retries; the
        streams.launch(frag, frag.specs(), layout, values, [OneStream()])  # error ends it (the capture's reason)
    assert 1 not in values and FLAKY == {"captured": 1}  # the failed launch is not repeated
    task = streams.RunningTask()  # outside a worker: the fragment's own retries only
    values = {}
    streams.launch(frag, frag.specs(), layout, values, [OneStream()], task)
    assert values[1] == len("captured") and FLAKY == {"captured": 2}


def double(b):
    return b * 2.0


def received(worker):
    """The keys ``worker`` fetched from other workers, and their bytes."""
    log = list(worker.transfer_incoming_log)
    return [k for e in log for k in e["keys"]], sum(e["total"] for e in log)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_task_elsewhere_reading_one_result_of_a_fragment_fetches_that_one(c, s, a, b):
    """Eight 80 kB blocks live on ``a``; doubled inside ``annotate`` they run as two fragments there. A
    task restricted to ``b`` reads one doubled block: ``b`` fetches that block alone, as without
    fragments (it fetched the fragment's tuple of every result, 8 times the bytes, when the readers
    read the results from the fragment task inline); the tasks on ``a`` read theirs inline."""
    rec = WhereRan()
    s.add_plugin(rec)
    await dask_octopus.register(c, calibrate=False)
    blocks = await c.scatter([np.full(10_000, float(i)) for i in range(8)], workers=[a.address])
    with dask_octopus.annotate(group=4):
        parts = [dask.delayed(double)(x) for x in blocks]
    with dask.annotate(workers=[b.address]):
        on_b = dask.delayed(np.sum)(parts[0])
    sums = await c.gather(c.compute([on_b] + [dask.delayed(np.sum)(p) for p in parts[1:]]))
    assert sums == [20_000.0 * i for i in range(8)]
    assert any(str(k[0]).startswith(FRAGMENT_PREFIX) for k in rec.worker if isinstance(k, tuple))
    keys, nbytes = received(b)
    assert len(keys) == 1 and not str(keys[0]).startswith(f"('{FRAGMENT_PREFIX}") and nbytes < 100_000, (keys, nbytes)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_the_readers_of_a_fragment_s_results_run_where_it_ran(c, s, a, b):
    """Sixteen blocks live on ``a``; doubled inside ``annotate`` they run as one or two fragments
    there, and sixteen tasks each read one result of one fragment, inline: a group of many tasks
    reading few, which Dask takes for root tasks and spreads over both workers (``b`` then fetched
    whole fragments to read one result each). They run on ``a``, and ``b`` fetches nothing."""
    rec = WhereRan()
    s.add_plugin(rec)
    await dask_octopus.register(c, calibrate=False)
    blocks = await c.scatter([np.full(10_000, float(i)) for i in range(16)], workers=[a.address])
    with dask_octopus.annotate():
        parts = [dask.delayed(double)(x) for x in blocks]
    sums = c.compute([dask.delayed(np.sum)(p) for p in parts])
    assert await c.gather(sums) == [20_000.0 * i for i in range(16)]
    assert {rec.worker[f.key] for f in sums} == {a.address}
    assert received(b) == ([], 0)


# -- from a mutation run of groups/scheduler.py (the labels of shared annotations) -----------------------------------


def test_mapping_annotations_label_tasks_by_their_content():
    """Tasks join a fragment only with tasks of equal shared annotations: two equal dicts (two
    ``dask.annotate(resources={...})`` blocks, or one per key after the graph's trip to the scheduler)
    are one label, not two objects that each group only with themselves; unequal dicts are two labels
    (a task that needs two GPUs joins no fragment that runs under the first member's one)."""
    def label(gpus):
        return scheduler_groups.shared_annotations({"resources": {"GPU": gpus}, "mine": {"tags": ["a", "b"]},
                                                    "retries": 2})

    assert label(1) == label(1)
    assert hash(label(1)) == hash(label(1))
    assert label(1) != label(2)
    labels = scheduler_groups.annotation_labels({"x": {"resources": {"GPU": 1}}, "y": {"resources": {"GPU": 1}}})
    assert labels["x"] == labels["y"]


def test_tasks_of_other_scalar_annotations_get_other_labels():
    """Plain values (a priority, a user's own annotation, the workers of a list) label tasks by their
    value: tasks of other priorities or other workers never join one fragment, which would run all of
    them with its first member's annotations."""
    def label(**annotations):
        return scheduler_groups.shared_annotations(annotations)

    assert label(priority=1) == label(priority=1) != label(priority=2)
    assert label(workers=["tcp://a"]) != label(workers=["tcp://b"])
    assert label(mine="x") != label(mine="y")
    assert label(retries=3) is None  # (each step keeps its own)


def test_equal_set_annotations_label_alike():
    """A set-valued annotation (one's own, say) labels tasks by its members, whatever set object holds
    them, as a list or a dict does."""
    assert scheduler_groups.shared_annotations({"mine": {"a", "b"}}) \
        == scheduler_groups.shared_annotations({"mine": {"b", "a"}}) \
        != scheduler_groups.shared_annotations({"mine": {"a"}})
