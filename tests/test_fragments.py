"""Fragments: a worker's share of an annotated graph runs as one task, chains and reductions included.

Exact results against the unannotated computation, how many tasks ran, a failing member (its own
key's error, the other outputs intact), a worker killed mid-fragment, and the GPU executor's streams
and events (with a stand-in for CuPy on CPU machines).
"""

import contextlib
import logging
import operator
import pickle
import sys
import threading
import time
import types

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from dask.base import tokenize
from dask.core import flatten
from dask.delayed import Delayed
from dask.highlevelgraph import HighLevelGraph
from dask.sizeof import sizeof
from dask.utils import key_split
from distributed import Nanny, futures_of, wait
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.utils_test import async_poll_for, captured_logger, gen_cluster
from stubs import Stub
from test_balance import run_balance, setup
from test_documented import FakeStream, fake_gpu  # noqa: F401 (a fixture)
from test_fragment_semantics import grouped_by  # noqa: F401 (a fixture)

import dask_octopus
from dask_octopus._compat import Alias, DataNode, GraphNode, Task, TaskRef, parse_input
from dask_octopus.groups import streams
from dask_octopus.groups.fragment import Call, Fragment, Ref
from dask_octopus.groups.rewrite import (
    FRAGMENT_PREFIX,
    dependents_of,
    fragment_graph,
    inner_keys,
    is_guard,
    read_before_grouping,
    replaced_keys,
    timing_prefix,
)
from dask_octopus.placement.unfused import UnfusedTask
from dask_octopus.plugins.messages import DONE_SHARE
from dask_octopus.plugins.scheduler import OctopusSchedulerPlugin


def chain(b):
    """A few elementwise steps on a block."""
    return np.sqrt(b * 2.0 + 1.0) - 0.5


def fail_on_block_3(b, block_info=None):
    if block_info and block_info[0]["chunk-location"][0] == 3:
        raise ValueError("block 3 is broken")
    return b + 1


@pytest.fixture
def blocks():
    return da.random.default_rng(0).random((256 * 4, 6), chunks=(4, 6))


async def persisted_with_plain_sum(c, s, blocks):
    """Register, persist ``blocks`` on the one worker and compute their chain's sum unannotated: the
    task log, the persisted blocks, the sum, and how many tasks that plain compute ran."""
    rec = await setup(c, s, [1.0])
    x = await c.persist(blocks)
    await wait(x)
    expected = await c.compute(x.map_blocks(chain).sum())
    plain = len(rec.worker)
    rec.worker.clear()
    return rec, x, expected, plain


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_whole_compute_runs_as_one_fragment_and_the_top_of_the_tree(c, s, a, blocks):
    rec, x, expected, plain = await persisted_with_plain_sum(c, s, blocks)
    with dask_octopus.annotate():
        got = await c.compute((x + 0).map_blocks(chain).sum())  # new keys
    assert got == pytest.approx(expected, rel=1e-12)
    ran = [key_split(k) for k in rec.worker]
    assert ran.count(FRAGMENT_PREFIX) == 1  # one thread, the blocks persisted there: one fragment
    assert len(ran) <= 3 and plain > 500, ran  # the fragment, the top of the sum (and finalize)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_readme_pattern_pulls_the_partial_sums_into_the_fragment(c, s, a, blocks):
    rec, x, expected, _ = await persisted_with_plain_sum(c, s, blocks)
    with dask_octopus.annotate():  # around building the collection only
        y = (x + 0).map_blocks(chain)
    assert await c.compute(y.sum()) == pytest.approx(expected, rel=1e-12)
    ran = [key_split(k) for k in rec.worker]
    assert ran.count(FRAGMENT_PREFIX) == 1 and len(ran) <= 3, ran


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)])
async def test_a_worker_s_threads_each_run_a_fragment(c, s, a, blocks):
    rec = await setup(c, s, [1.0])
    x = await c.persist(blocks)
    await wait(x)
    with dask_octopus.annotate():
        got = await c.compute((x + 0).map_blocks(chain).sum())
    assert got == pytest.approx(float(chain(blocks.compute(scheduler="sync")).sum()), rel=1e-12)
    assert [key_split(k) for k in rec.worker].count(FRAGMENT_PREFIX) == 2


def test_only_a_fragment_pickled_here_is_released_and_not_a_copy_made_of_it():
    """``release`` empties a fragment pickled (sent) from this process only: one never sent (an
    in-process worker may be running it), a copy, and what another process unpickles keep their steps."""
    frag = two_chains()
    frag.release()
    assert frag.names  # never pickled: kept
    received = pickle.loads(pickle.dumps(frag))  # (frag sent)
    copied = frag.copy()
    again = pickle.loads(pickle.dumps(frag))  # (sent again: to another worker, say)
    frag.release()
    assert not hasattr(frag, "names")
    for kept in (copied, again):
        kept.release()
        assert kept.names == received.names and kept.specs()


def sent_fragments(s, parts=False):
    """The fragments of the fragment tasks in the scheduler's log of the messages it sent its workers (or
    those of the parts of split fragments)."""
    from dask_octopus.groups.rewrite import fragment_of

    def wanted(key):
        return FRAGMENT_PREFIX in str(key) and key_split(key) != FRAGMENT_PREFIX if parts else \
            key_split(key) == FRAGMENT_PREFIX

    return [fragment_of(msg["run_spec"].data) for bcomm in s.stream_comms.values()
            for payload in bcomm.recent_message_log if isinstance(payload, list)
            for msg in payload if isinstance(msg, dict) and msg.get("op") == "compute-task" and wanted(msg["key"])]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)])
async def test_a_fragment_sent_holds_nothing_once_its_task_is_forgotten(c, s, a, blocks):
    """Dask's log of the messages sent to a worker keeps the last thousand, with the fragments they
    carried: once Dask forgot a fragment's task, the fragment holds none of its steps or their layout
    (a fragment of 128 blocks held 216 kB; 280 computes, 490 MiB)."""
    rec = await setup(c, s, [1.0])
    x = await c.persist(blocks)
    await wait(x)
    expected = float(chain(blocks.compute(scheduler="sync")).sum())
    for _ in range(2):
        with dask_octopus.annotate():
            y = c.compute((x + 0).map_blocks(chain).sum())
        assert await y == pytest.approx(expected, rel=1e-12)
        assert [key_split(k) for k in rec.worker].count(FRAGMENT_PREFIX) == 2
        rec.worker.clear()
        del y
        await async_poll_for(lambda: not any(key_split(k) == FRAGMENT_PREFIX for k in s.tasks), 10)
        sent = sent_fragments(s)
        assert sent and all(f.__dict__ == {"_specs": b"", "_sent": True} for f in sent), [vars(f).keys() for f in sent]


@pytest.mark.parametrize("registered", [False, True])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_tasks_that_nothing_asked_for_needs_stay_out_of_fragments(c, s, a, monkeypatch, registered):
    """``qr(x)[1]`` leaves each block's Q factor in the optimized graph, read by nothing: Dask never runs
    those tasks, and a fragment must not either (it computed them and held them to its end)."""
    if registered:
        await dask_octopus.register(c, calibrate=False)
    steps, outputs = [], []  # of the fragments made
    lay_out = Fragment._lay_out

    def recording_lay_out(self, names, reads, outs, *args, **kwargs):
        steps.extend(str(name) for name in names)
        outputs.extend(outs := tuple(outs))
        return lay_out(self, names, reads, outs, *args, **kwargs)

    monkeypatch.setattr(Fragment, "_lay_out", recording_lay_out)
    x = da.from_array(np.random.default_rng(0).random((256, 64)), chunks=(16, 64))
    expected = await c.compute(da.linalg.qr(x)[1])
    with dask_octopus.annotate():
        r = da.linalg.qr(x * 1.0)[1]  # (new keys: not the tasks of the compute above, which the scheduler may hold)
    assert np.allclose(await c.compute(r), expected)
    assert steps and not [step for step in steps if "-q1" in step], steps
    # nor are the blocks' QR factorisations, which only the Q extraction read besides the fragment, its
    # outputs: only the top of the tree, which the compute's own task reads, leaves the fragment
    assert len(outputs) == 1 and outputs[0][0].endswith("-qr2"), outputs


class Ran(SchedulerPlugin):
    """The task prefix and worker of each task that finished."""

    def __init__(self):
        self.ran = []

    def transition(self, key, start, finish, *args, **kwargs):
        if start == "processing" and finish == "memory":
            self.ran.append((key_split(key), kwargs.get("worker")))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3, config={"num_workers": 1})
async def test_without_the_plugin_the_scheduler_makes_a_fragment_per_thread_of_its_cluster(c, s, a, b, w, blocks):
    ran = Ran()
    s.add_plugin(ran)
    with dask_octopus.annotate():  # not registered: the optimizer makes the fragments on the scheduler
        y = (blocks + 0).map_blocks(chain)
    assert await c.compute(y.sum()) == pytest.approx(float(chain(blocks.compute(scheduler="sync")).sum()), rel=1e-12)
    fragments = [worker for prefix, worker in ran.ran if prefix == FRAGMENT_PREFIX]
    assert len(fragments) == 3  # the cluster's threads, not the scheduler's cores (num_workers of a local scheduler)
    assert set(fragments) == {a.address, b.address, w.address}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config={"octopus.refine.min-duration": "1us"})
async def test_fragment_timings_teach_speeds_under_the_prefixes_of_their_work(c, s, a, b, blocks):
    """Every fragment task's key has one prefix: two workloads' fragments are timed apart, by the prefixes of
    their members (a worker that ran the heavy one's fragments looked slower than one that ran the light's)."""
    await c.register_plugin(OctopusSchedulerPlugin(calibrate=False))
    with dask_octopus.annotate():
        await c.compute(blocks.map_blocks(chain).sum())
        await c.compute((blocks + 1).max())
    prefixes = sorted(p for p in s.plugins["octopus"].model.rates if p.startswith(FRAGMENT_PREFIX))
    assert len(prefixes) == 2 and FRAGMENT_PREFIX not in prefixes, prefixes
    assert any("sum" in p for p in prefixes) and any("max" in p for p in prefixes), prefixes


def test_a_fragment_s_timing_prefix_names_its_members_work_in_short():
    members = [(f"f{i}-{tokenize(i)}", 0) for i in range(50)] + [f"g-{tokenize('g')}"]
    node = Task("k", streams.run_fragment, DataNode(None, types.SimpleNamespace(members=members)))
    assert timing_prefix(FRAGMENT_PREFIX, node) == f"{FRAGMENT_PREFIX}(f0+f1+f10+f11+47 more)"
    node = Task("k", streams.run_fragment, DataNode(None, types.SimpleNamespace(members=members[:4])))
    assert timing_prefix(FRAGMENT_PREFIX, node) == f"{FRAGMENT_PREFIX}(f0+f1+f2+f3)"  # four: all, not "...+0 more"
    node = Task("k", streams.run_fragment, DataNode(None, types.SimpleNamespace(members=members[:2])))
    assert timing_prefix(FRAGMENT_PREFIX, node) == f"{FRAGMENT_PREFIX}(f0+f1)"
    assert timing_prefix("sum", node) == "sum"  # (another task's prefix as it is)


def test_a_task_run_again_whole_drops_the_share_its_failed_run_gave():
    """A worker keeps a task's state, metadata included, when it runs the task again (a retry)."""
    task = streams.RunningTask()
    task._ts = types.SimpleNamespace(metadata={})
    task.done_share([1, streams.StepFailed(ValueError(), ""), 3, 4], streams.StepFailed, partial=True)
    assert task._ts.metadata == {DONE_SHARE: 0.75}
    task.done_share([1, 2, 3, 4], streams.StepFailed, partial=True)
    assert task._ts.metadata == {}


class Untimed(SchedulerPlugin):
    """Whether each fragment task that finished was marked as teaching no speed (some of its work failed)."""

    def __init__(self):
        self.of = {}

    def transition(self, key, start, finish, *args, **kwargs):
        if finish == "memory" and key_split(key) == FRAGMENT_PREFIX:
            self.of[key] = (kwargs.get("metadata") or {}).get(DONE_SHARE) == 0.0


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_failing_member_fails_only_its_own_outputs(c, s, a, blocks):
    rec = await setup(c, s, [1.0])
    untimed = Untimed()
    s.add_plugin(untimed)
    with dask_octopus.annotate():
        assert await c.compute(blocks.map_blocks(chain).sum()) == pytest.approx(
            float(chain(blocks.compute(scheduler="sync")).sum()), rel=1e-12)
    assert untimed.of and not any(untimed.of.values())  # whole: its timing says how fast the worker is
    untimed.of.clear()
    with dask_octopus.annotate():
        y = blocks.map_blocks(fail_on_block_3)
    z = c.persist(y.rechunk((8, 6)))  # block i of z joins blocks 2i and 2i + 1 of y, which form fragments
    futures = futures_of(z)
    await wait(futures)
    assert FRAGMENT_PREFIX in {key_split(k) for k in rec.worker}
    expected = blocks.compute(scheduler="sync") + 1
    for f in futures:
        i = f.key[1]
        if i == 1:  # it reads block 3 of y
            error = await f.exception()
            assert isinstance(error, ValueError) and "block 3 is broken" in str(error)
            notes = getattr(error, "__notes__", [])
            assert any("raised by task" in n and "fail_on_block_3" in n and ", 3, 0)" in n for n in notes), notes
        else:
            np.testing.assert_array_equal(await f, expected[8 * i:8 * i + 8])
    assert any(untimed.of.values())  # a fragment that failed a member teaches the speed model nothing


FLAKY = {}  # calls per block of flaky_on_block_3 (the workers run in this process)


def flaky_on_block_3(b, failures, block_info=None):
    """Raises the first ``failures`` times it runs on block 3, as a task hitting a passing fault."""
    i = block_info[0]["chunk-location"][0] if block_info else None
    FLAKY[i] = FLAKY.get(i, 0) + 1
    if i == 3 and FLAKY[i] <= failures:
        raise OSError(f"block 3: transient fault {FLAKY[i]}")
    return b + 1


@pytest.mark.parametrize("failures, retries, fails", [(2, 2, False), (3, 2, True), (1, 0, True)])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_failing_member_runs_again_as_often_as_compute_retries_allow(c, s, a, blocks, failures, retries,
                                                                             fails):
    rec = await setup(c, s, [1.0])
    FLAKY.clear()
    with dask_octopus.annotate():
        y = blocks.map_blocks(flaky_on_block_3, failures)
    future = c.compute(y.sum(), retries=retries)
    assert FRAGMENT_PREFIX in {key_split(k) for k in (await wait(future), rec.worker)[1]}
    if fails:  # as without fragments: the error of the last try, after the retries
        error = await future.exception()
        assert isinstance(error, OSError) and f"transient fault {retries + 1}" in str(error)
    else:
        assert await future == pytest.approx(float((blocks + 1).sum().compute(scheduler="sync")), rel=1e-12)
    assert FLAKY[3] == min(failures, retries) + 1 and FLAKY[2] == 1  # the other blocks ran once


def slow_chain(b):
    """:func:`chain`, slowly, telling the test which worker ran it."""
    from distributed import get_worker

    worker = get_worker()
    worker.log_event("slow-chain", {"worker": worker.address})
    time.sleep(0.05)
    return chain(b)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, Worker=Nanny, timeout=120)
async def test_a_worker_killed_mid_fragment_loses_nothing(c, s, a, b):
    rec = await setup(c, s, [1.0, 1.0])
    x = da.random.default_rng(2).random((64 * 4, 6), chunks=(4, 6))
    expected = float(chain(x.compute(scheduler="sync")).sum())
    with dask_octopus.annotate():
        fut = c.compute(x.map_blocks(slow_chain, dtype=float).sum())  # 64 blocks of 50 ms in two fragments
    victim = min(s.workers)

    def started_on_victim():
        return sum(m["worker"] == victim for _, m in s.get_events("slow-chain"))

    await async_poll_for(lambda: started_on_victim() >= 2, timeout=30)  # its fragment is running
    assert not fut.done()
    await (a if a.worker_address == victim else b).kill()
    assert await fut == pytest.approx(expected, rel=1e-12)
    ran = [key_split(k) for k in rec.worker]
    assert ran.count(FRAGMENT_PREFIX) == 1  # the survivor's; the lost one ran again as one task per member,
    # each named for its member: a block's chain and partial sum (fused, Dask's prefix "sum"), or a node
    # of the reduction tree ("sum-partial")
    parts = [k for k in rec.worker if FRAGMENT_PREFIX in str(k) and key_split(k) != FRAGMENT_PREFIX]
    assert len(parts) >= 2 and {key_split(k) for k in parts} <= {"sum", "sum-partial"}, parts


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, Worker=Nanny, timeout=120)
async def test_a_balanced_fragment_split_as_its_worker_left_counts_its_parts_in_the_plan_s_run(c, s, a, b):
    """The fragment of a worker killed mid-run runs again as one task per member: they count in the
    plan's run in its place (the dashboard's "n of N tasks"), not the fragment as failed; and their
    fragments sent hold nothing once Dask forgot them, as whole fragments."""
    await setup(c, s, [1.0, 1.0])
    x = await run_balance(c, da.random.default_rng(2).random((64 * 4, 6), chunks=(4, 6)), per_worker=32)
    expected = float(chain(x.compute(scheduler="sync")).sum())
    with dask_octopus.annotate():
        fut = c.compute(x.map_blocks(slow_chain, dtype=float).sum())
    victim = min(s.workers)
    await async_poll_for(lambda: sum(m["worker"] == victim for _, m in s.get_events("slow-chain")) >= 2, 30)
    survivor = (a if a.worker_address != victim else b).worker_address
    await (a if a.worker_address == victim else b).kill()
    assert await fut == pytest.approx(expected, rel=1e-12)
    run = s.plugins["octopus"].plan_records.get(x.name).current
    # (the survivor's fragment, and the parts of the victim's: one per block and partial sum)
    assert run.complete and run.lost == 0 and run.expected > 2 and run.tasks == {survivor: run.expected}, run
    del fut  # the parts' fragments sent are released once Dask forgets them, as whole fragments are
    await async_poll_for(lambda: not any(FRAGMENT_PREFIX in str(k) for k in s.tasks), 10)
    sent = sent_fragments(s, parts=True)
    assert len(sent) == run.expected - 1 and all(f.__dict__ == {"_specs": b"", "_sent": True} for f in sent), sent


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_dataframe_map_partitions_then_groupby_agg(c, s, a, b):
    rec = await setup(c, s, [1.0, 1.0])
    frame = pd.DataFrame({"k": np.arange(800) % 7, "v": np.arange(800.0)})
    df = dd.from_pandas(frame, npartitions=16)
    expected = frame.assign(v=np.sqrt(frame.v + 1)).groupby("k").agg({"v": ["sum", "max"]})
    with dask_octopus.annotate():
        got = await c.compute(df.map_partitions(lambda p: p.assign(v=np.sqrt(p.v + 1))).groupby("k").agg(
            {"v": ["sum", "max"]}))
    pd.testing.assert_frame_equal(got.sort_index(), expected)
    assert FRAGMENT_PREFIX in {key_split(k) for k in rec.worker}


def double_v(p):
    return p.assign(v=p.v * 2)


class Aliases(SchedulerPlugin):
    """The target of each alias task of the graphs the scheduler is given, by the alias's key."""

    def __init__(self):
        self.targets = {}

    def update_graph(self, scheduler, *, tasks, **kwargs):
        self.targets.update((k, ts.run_spec.target) for k in tasks
                            if isinstance((ts := scheduler.tasks[k]).run_spec, Alias))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_fragments_read_a_persisted_dataframe_s_partitions_in_place_of_its_aliases(c, s, a):
    """dask-expr reads a persisted dataframe through one alias task per partition; the fragments read
    the partitions themselves: the compute runs its fragment and the top of the sum, no alias task."""
    aliases = Aliases()
    s.add_plugin(aliases)  # (before the octopus plugin: it sees the graph as given)
    rec = await setup(c, s, [1.0])
    frame = pd.DataFrame({"k": np.arange(800) % 7, "v": np.arange(800.0)})
    df = c.persist(dd.from_pandas(frame, npartitions=16))
    await wait(df)
    persisted = {f.key for f in futures_of(df)}
    aliases.targets.clear()
    assert await c.compute(df.map_partitions(double_v).v.sum()) == 2 * frame.v.sum()
    assert len(aliases.targets) == 16 and set(aliases.targets.values()) == persisted
    assert aliases.targets.keys() <= rec.worker.keys()  # without annotate: a task per partition's alias
    await async_poll_for(lambda: not aliases.targets.keys() & s.tasks.keys(), timeout=5)  # (else still read)
    rec.worker.clear()
    aliases.targets.clear()
    with dask_octopus.annotate():  # (other keys: the first compute's may still be held)
        assert await c.compute(df.map_partitions(double_v, token="annotated").v.sum()) == 2 * frame.v.sum()
    assert len(aliases.targets) == 16  # the graph's aliases: none runs, and the plugin forgets them
    assert sorted(key_split(k) for k in rec.worker) == [FRAGMENT_PREFIX, "sum-tree"], rec.worker
    await async_poll_for(lambda: not aliases.targets.keys() & s.tasks.keys(), timeout=5)


def inc(x):
    return x + 1


def add(x, y):
    return x + y


def two_chains():
    """Steps of two independent chains (``a``: three steps, ``b``: two) and a step joining them."""
    graph = {"a1": Task("a1", inc, TaskRef("x")), "a2": Task("a2", inc, TaskRef("a1")),
             "a3": Task("a3", inc, TaskRef("a2")), "b1": Task("b1", inc, TaskRef("y")),
             "b2": Task("b2", inc, TaskRef("b1")), "j": Task("j", add, TaskRef("a3"), TaskRef("b2")),
             "c": Task("c", add, TaskRef("a3"), DataNode(None, 10))}
    return Fragment(graph, ["j", "c"], dict.fromkeys(graph, "memory"))


def test_fragment_walks_its_steps_and_frees_intermediates():
    frag = two_chains()
    assert frag.inputs == ("x", "y") and frag.outputs == ("j", "c")
    assert streams.run_fragment(frag, 1, 100) == (1 + 3 + 100 + 2, 1 + 3 + 10)
    values = {0: 1, 1: 100}  # by slot: the inputs first
    streams.walk(frag, frag.specs(), values)
    assert values == dict(zip(frag.results, (106, 14)))  # every input and intermediate is dropped after its last reader


def test_peak_bytes_counts_the_inputs_and_the_intermediates_alive_at_once_in_the_run_order():
    frag = two_chains()  # x -> a1 -> a2 -> a3; y -> b1 -> b2; j = a3 + b2; c = a3 + 10
    order = list(frag.names)
    assert order.index("a3") < order.index("b1")  # depth first: chain a ends before chain b starts
    assert order == ["a1", "a2", "a3", "b1", "b2", "j", "c"]
    # the inputs, 110 bytes, held to the end; each step as large as the largest value it reads: a* 100
    # bytes, b* 10, outputs j and c 100 held to the end; at the peak (after c): a3 (freed after c), j and
    # c; before, a3 + b1 + b2 + j = 220
    assert frag.peak_bytes({"x": 100, "y": 10}) == 110 + 300
    assert frag.peak_bytes({}) == 0  # sizes unknown: nothing to estimate from


def test_fused_members_are_flattened_once_and_keep_their_keys():
    import dask

    from dask_octopus._compat import convert_legacy_graph, execute_subgraph

    x = da.from_array(np.arange(32.0).reshape(8, 4), chunks=(2, 4))
    (y,) = dask.optimize(x.map_blocks(inc).map_blocks(inc).sum(axis=1))
    graph = convert_legacy_graph(dict(y.__dask_graph__()))
    fused = {k: v for k, v in graph.items() if isinstance(v, Task) and v.func is execute_subgraph}
    assert fused  # Dask fused each block's chain
    frag = Fragment(fused, list(fused), dict.fromkeys(fused, "memory"))
    specs = frag.specs()
    assert not any(execute_subgraph in spec for spec in specs)
    # the blocks' fused graphs are one object: their steps share its specs (made and pickled once)
    incs = [s for s in specs if type(s) is tuple and s[:2] == (Call, inc)]
    assert len(incs) == 2 * len(fused) and len({id(s) for s in incs}) == 2
    assert set(frag.covers) > set(fused)  # the members and the keys fused into them
    got = streams.run_fragment(frag, *[graph[k]({}) for k in frag.inputs])
    expected = (np.arange(32.0).reshape(8, 4) + 2).sum(axis=1)
    assert sorted(np.concatenate(got).tolist()) == sorted(expected.tolist())


def test_a_fragment_split_into_its_members_computes_what_it_computes():
    """One part per member (fused ones keep their inner steps), each returning the values that other
    members or the fragment's readers read: run in order, the parts give the fragment's results."""
    import dask

    from dask_octopus._compat import convert_legacy_graph, execute_subgraph

    x = da.from_array(np.arange(64.0).reshape(16, 4), chunks=(2, 4))
    (y,) = dask.optimize(x.map_blocks(inc).map_blocks(inc).sum(split_every=2))
    graph = convert_legacy_graph(dict(y.__dask_graph__()))
    (top,) = y.__dask_keys__()  # a 0-d array: one key
    members = {k: v for k, v in graph.items() if not (isinstance(v, Task) and v.func is operator.getitem)
               and k not in x.__dask_keys__() and not isinstance(v, DataNode)}
    frag = Fragment(members, [top], dict.fromkeys(members, "memory"))
    inputs = {k: graph[k]({}) for k in frag.inputs}
    parts = frag.split()
    assert sorted(map(str, (p.members[0] for p in parts))) == sorted(map(str, members))
    assert any(len(p.names) > 1 for p in parts)  # fused members keep their inner steps
    assert any(isinstance(members[p.members[0]], Task) and members[p.members[0]].func is execute_subgraph
               for p in parts)
    values = dict(inputs)
    for part in sorted(parts, key=lambda p: frag.names.index(p.members[0])):  # each after what it reads
        assert set(part.outputs) <= {top} | {d for q in parts if q is not part for d in q.inputs}
        values.update(zip(part.outputs, streams.run_fragment(part, *(values[k] for k in part.inputs))))
    assert values[top] == streams.run_fragment(frag, *(inputs[k] for k in frag.inputs))[0] == 64 * 63 / 2 + 128
    retried = next(iter(members))  # each step keeps its member's retries
    kept = Fragment(members, [top], dict.fromkeys(members, "memory"), {retried: 2}).split()
    assert {p.members[0]: set(p.step_retries(0)) for p in kept} == {m: {2 if m == retried else 0} for m in members}


def test_a_member_read_through_a_split_fragment_s_gatherer_is_known_as_regrouped():
    """A fragment split as its worker left: the task that picked a member's value from it picks it from
    the task gathering the parts' results; what the member read before the grouping is still known (the
    parts keep it), so that task held, and the same collection computed again, is ours regrouped: Dask's
    warning that the key came with another run spec is dropped (it was logged)."""
    from dask_octopus._compat import convert_legacy_graph
    from dask_octopus.groups.scheduler import regrouped

    x = da.from_array(np.arange(64.0).reshape(16, 4), chunks=(2, 4))
    (y,) = dask.optimize(x.map_blocks(inc).sum(split_every=2))
    graph = convert_legacy_graph(dict(y.__dask_graph__()))
    (top,) = y.__dask_keys__()
    members = {k: v for k, v in graph.items() if not (isinstance(v, Task) and v.func is operator.getitem)
               and k not in x.__dask_keys__() and not isinstance(v, DataNode)}
    frag = Fragment(members, [top], dict.fromkeys(members, "memory"))
    before = frozenset(graph[top].dependencies)
    frag.read_before = {top: before}
    (part,) = [p for p in frag.split() if top in p.outputs]
    assert part.read_before == {top: before}
    part_ts = Stub(key="part", run_spec=Task("part", streams.run_fragment, DataNode(None, part)), dependencies=set())
    gatherer = Stub(key="gathered", run_spec=Task("gathered", streams.collected, 1, DataNode(None, (0,)),
                                                  TaskRef("part")), dependencies={part_ts})
    reader = Stub(key=top, run_spec=Task(top, streams.pick, TaskRef("gathered"), 0), dependencies={gatherer})
    assert regrouped(reader, before)
    assert not regrouped(reader, {("other", 0)})


def gated(x, name):
    """``x``, once the test sets the event ``name``."""
    from distributed import Event

    Event(name).wait()
    return x


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_split_fragment_whose_first_part_reads_a_later_one_runs_exact(c, s, a):
    """Member ``b`` (fused: ``neg(y) + a``) starts before member ``a`` (``neg(x)``) ends, so its part
    comes first and reads the next one: every part's task exists before any is linked. The split
    fragment task is forgotten; its reader reads the gatherer, and gets the fragment's result."""
    from distributed import Event

    from dask_octopus._compat import execute_subgraph
    from dask_octopus.groups import scheduler as scheduler_groups

    inner = {"b0": Task("b0", operator.neg, TaskRef("y")), "b": Task("b", operator.add, TaskRef("b0"), TaskRef("a"))}
    members = {"b": Task("b", execute_subgraph, DataNode(None, inner), "b", ("y", "a"), TaskRef("y"), TaskRef("a")),
               "a": Task("a", operator.neg, TaskRef("x"))}
    frag = Fragment(members, ["b"], dict.fromkeys(members, "memory"))
    assert [p.members for p in frag.split()] == [("b",), ("a",)]
    fkey = (f"{FRAGMENT_PREFIX}-{tokenize('test')}", 0)
    graph = {"x": Task("x", gated, 2, "gate"), "y": Task("y", gated, 5, "gate"),
             fkey: Task(fkey, streams.run_fragment, DataNode(None, frag), TaskRef("x"), TaskRef("y")),
             "out": Task("out", streams.pick, TaskRef(fkey), 0)}
    out = c.get(graph, "out", sync=False)
    await async_poll_for(lambda: fkey in s.tasks and s.tasks[fkey].state == "waiting", 10)
    ts = s.tasks[fkey]
    ts.suspicious = 1  # as if its worker had left while running it
    made = []  # (the plugin pins the new tasks and counts the parts in the plan's run before the fragment goes)
    parts = scheduler_groups.split_fragment(s, ts, scheduler_groups.hold_if_lost(ts), "test",
                                            lambda *new: made.append((*new, s.tasks.get(fkey) is ts)))
    assert [key_split(k) for k in parts] == ["b-" + FRAGMENT_PREFIX, "a-" + FRAGMENT_PREFIX]
    assert made == [(parts, [k for k in s.tasks if k not in graph and k not in parts], True)]
    assert fkey not in s.tasks and s.tasks["out"].state == "waiting"
    await Event("gate").set()
    assert await out == -5 + -2


def test_gpu_chains_stay_on_their_streams_with_events_where_they_meet(fake_gpu, monkeypatch):  # noqa: F811
    cp, fresh_runtime = fake_gpu
    fresh_runtime()
    ran_on, waits = {}, []
    monkeypatch.setattr(FakeStream, "wait_event", lambda self, event: waits.append(self.name))

    def spy(name, func):
        def run(*args):
            ran_on[name] = cp.cuda.get_current_stream().name
            return func(*args)

        return run

    frag = two_chains()  # the steps report their stream (the fake has no device arrays: no capture)
    specs = tuple((head, spy(name, func), *rest) for name, (head, func, *rest) in zip(frag.names, frag.specs()))
    frag.specs = lambda: specs
    assert streams.run_fragment(frag, 1, 100) == (106, 14)
    assert ran_on["a1"] == ran_on["a2"] == ran_on["a3"] and ran_on["b1"] == ran_on["b2"]
    assert ran_on["a1"] != ran_on["b1"] and "task's own" not in ran_on.values()
    assert ran_on["j"] == ran_on["a1"]  # the join continues the first chain it reads
    assert ran_on["c"] not in (ran_on["a1"], ran_on["b1"])  # a3's second reader starts a branch
    # each pool stream waits once for the inputs; j waits for chain b, c for chain a
    assert sorted(waits) == sorted([ran_on["a1"], ran_on["b1"], ran_on["c"], ran_on["j"], ran_on["c"]])


def test_an_eager_run_keeps_to_one_stream_where_more_would_hold_more_than_one_block_more(fake_gpu):  # noqa: F811
    cp, fresh_runtime = fake_gpu
    fresh_runtime()

    class Block(cp.ndarray):  # a stand-in device array of 100 bytes holding a number
        nbytes = 100

        def __init__(self, n):
            self.n = n

        def __add__(self, other):
            return Block(self.n + (other.n if isinstance(other, Block) else other))

    frag = two_chains()
    sizes = {"x": 100, "y": 100}
    over, one = (streams.FragmentLayout(frag, n).pool_bytes(frag, sizes) for n in (8, 1))
    assert (over, one) == (800, 400)  # one arena per stream (results and temporaries) against one arena
    ran_on = set()

    def spy(func):
        def run(*args):
            ran_on.add(cp.cuda.get_current_stream().name)
            return func(*args)

        return run

    specs = tuple((head, spy(func), *rest) for head, func, *rest in frag.specs())
    frag.specs = lambda: specs
    with dask.config.set({"octopus.streams.capture": False}):  # eager runs (the stand-in cannot capture)
        j, c = streams.run_fragment(frag, Block(1), Block(100))
    assert (j.n, c.n) == (106, 14) and len(ran_on) == 1 and "task's own" not in ran_on  # a pool stream
    ran_on.clear()
    assert streams.run_fragment(frag, 1, 100) == (106, 14)  # sizes unknown (not device arrays)
    assert len(ran_on) > 1


def _switch_interval_in_steps(frag):
    """``frag`` with every step recording Python's switch interval as it runs, and those records."""
    seen = []

    def spy(func):
        def run(*args):
            seen.append(sys.getswitchinterval())
            return func(*args)

        return run

    specs = tuple((head, spy(func), *rest) for head, func, *rest in frag.specs())
    frag.specs = lambda: specs
    return frag, seen


@pytest.mark.parametrize("setting, short", [("100us", True), ("off", False), (False, False), ("1s", False)])
def test_a_gpu_worker_launches_with_a_short_switch_interval_and_gets_python_s_back_after(
        fake_gpu, setting, short):  # noqa: F811
    """Python's switch interval is at most ``octopus.streams.switch-interval`` while a fragment's and a map
    batch's kernels are launched (``off``, or longer than Python's: as it was), and Python's again after,
    also where a batch's member raises; CPU workers' runs keep Python's."""
    _, fresh_runtime = fake_gpu
    python_s = sys.getswitchinterval()
    during = pytest.approx(1e-4, rel=0.02) if short else python_s  # (kept in whole microseconds: 99us)
    with dask.config.set({"octopus.streams.switch-interval": setting, "octopus.streams.capture": False}):
        fresh_runtime()
        frag, seen = _switch_interval_in_steps(two_chains())
        assert streams.run_fragment(frag, 1, 100) == (106, 14)
        assert seen == [during] * len(frag.names) and sys.getswitchinterval() == python_s
        batch = []
        streams.run_group([lambda x: batch.append(sys.getswitchinterval())] * 3, [[1]] * 3, ["memory"] * 3,
                          lambda: ["t"] * 3)
        assert batch == [during] * 3 and sys.getswitchinterval() == python_s

        def fails(x):
            batch.append(sys.getswitchinterval())
            raise ZeroDivisionError(x)

        batch.clear()
        with pytest.raises(ZeroDivisionError):
            streams.run_group([fails], [[1]], ["memory"], lambda: ["t"])
        assert batch == [during] and sys.getswitchinterval() == python_s
        del sys.modules["cupy"]  # a CPU worker
        frag, seen = _switch_interval_in_steps(two_chains())
        assert streams.run_fragment(frag, 1, 100) == (106, 14)
        assert seen == [python_s] * len(frag.names)


def test_python_s_switch_interval_comes_back_when_the_last_launching_thread_ends():
    """Two threads launching at once: the interval stays short until both have ended (Python keeps it in
    whole microseconds: 100us reads back as 99us); one changed meanwhile by someone else is left as it is."""
    python_s = sys.getswitchinterval()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with streams.launching():
            first_in.set()
            seen["second came in"] = second_in.wait(5)
        first_out.set()

    def second():
        seen["first came in"] = first_in.wait(5)
        with streams.launching():
            second_in.set()
            seen["first went out"] = first_out.wait(5)
            seen["interval then"] = sys.getswitchinterval()

    threads = [threading.Thread(target=f) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert seen == {"first came in": True, "second came in": True, "first went out": True,
                    "interval then": pytest.approx(1e-4, rel=0.02)}
    assert sys.getswitchinterval() == python_s
    try:
        with streams.launching():
            sys.setswitchinterval(0.02)  # someone else's setting, made while launching
        assert sys.getswitchinterval() == pytest.approx(0.02)
    finally:
        sys.setswitchinterval(python_s)


def test_an_eager_run_estimates_the_memory_of_its_streams_once_per_shape_and_input_sizes(fake_gpu, monkeypatch):  # noqa: F811
    cp, fresh_runtime = fake_gpu
    fresh_runtime()
    estimates = []
    extra_bytes = streams._extra_bytes
    monkeypatch.setattr(streams, "_extra_bytes", lambda *args: estimates.append(args[-1]) or extra_bytes(*args))

    def block(nbytes):
        b = cp.ndarray()
        b.nbytes = nbytes
        return b

    rt = streams.runtime()
    frag = two_chains()
    for n in (100, 100, 200, 100):
        layout = rt.eager_layout(cp, two_chains(), [block(n), block(n)])  # another fragment of the same shape
        assert layout.used == 1
    assert [[x.nbytes for x in inputs] for inputs in estimates] == [[100, 100], [200, 200]]
    assert rt.eager_layout(cp, frag, [1, 2]).used > 1  # sizes unknown: over the pool


class HeldGraph:
    """A stand-in captured graph holding ``n`` bytes, made over ``streams`` streams."""

    def __init__(self, n, streams):
        self.n, self.streams = n, streams

    def held_bytes(self):
        return self.n


@pytest.mark.parametrize("one, spread, refused, kept", [
    (100, 100 + 32 * 2**20 + 100, (), "spread"),  # within capture-spare-bytes plus the largest input (100)
    (100, 100 + 32 * 2**20 + 101, (), "one"),  # one byte over
    (100, 50, (), "spread"),
    (100, 200, (8,), "one"),  # the capture over the pool refused: the one-stream graph stays
    (100, 200, (1,), None),  # refused on one stream: no graph (it runs eagerly), the pool's not tried
])
def test_the_multi_stream_graph_is_kept_only_within_the_capture_allowance(
        fake_gpu, one, spread, refused, kept):  # noqa: F811
    """Fragments and ``map`` batches alike (``_capture_within``): captured on one stream and over the
    pool's, the latter kept where it holds at most ``capture-spare-bytes`` plus the largest input more."""
    cp, fresh_runtime = fake_gpu
    fresh_runtime()
    rt = streams.runtime()
    tried = []

    def capture_on(n):
        tried.append(n)
        if n in refused:
            raise streams.CaptureRefused("a host synchronisation")
        return HeldGraph(one if n == 1 else spread, n)

    graph = streams._capture_within(rt, cp, capture_on, 8, 100)
    assert (graph and {1: "one", 8: "spread"}[graph.streams]) == kept
    assert tried == ([1] if refused == (1,) else [1, 8])
    assert rt.last_refusal == {(): None, (8,): "over 8 streams (kept on one): a host synchronisation",
                               (1,): "a host synchronisation"}[refused]
    tried.clear()
    if refused != (1,):  # a pool of one stream: captured once
        assert streams._capture_within(rt, cp, capture_on, 1, 100).streams == 1 and tried == [1]


def test_structure_tells_constants_and_partials_apart():
    from functools import partial

    def frag(node):
        return Fragment({"s": node}, ["s"], {"s": "memory"})

    one = frag(Task("s", np.roll, TaskRef("x"), -1))
    assert one.structure() == frag(Task("t", np.roll, TaskRef("y"), -1)).structure()  # whatever the keys
    assert one.structure() != frag(Task("s", np.roll, TaskRef("x"), -2)).structure()  # hash(-1) == hash(-2)
    sums = [frag(Task("s", partial(np.sum, axis=a), TaskRef("x"))).structure() for a in (0, 1)]
    assert sums[0] != sums[1]
    # a task kind with its own __call__ is kept as it is, its keys renamed: the same whatever the keys
    assert frag(Doubled("s", operator.add, TaskRef("x"), 1)).structure() == \
        frag(Doubled("t", operator.add, TaskRef("y"), 1)).structure()
    # a lambda travels by value (cloudpickle), the same each time
    increment = Task("s", lambda v: v + 1, TaskRef("x"))
    assert streams.run_fragment(pickle.loads(pickle.dumps(frag(increment))), 2) == (3,)
    assert frag(increment).structure() == frag(increment).structure()
    # a constant that nothing pickles still runs where the scheduler is this process
    locked = frag(Task("s", lambda v, held: v + held.locked(), TaskRef("x"), threading.Lock()))
    assert streams.run_fragment(locked, 2) == (2,) and locked.structure()


def test_replay_in_place_copies_nothing_and_returns_copies_of_the_outputs_made_on_the_task_s_stream():
    from test_documented import FakeCupy, FakeStream

    from dask_octopus.groups.replay import CapturedGroup

    cp, launched, copied_on = FakeCupy(), [], []

    class Graph:
        def launch(self, stream):
            launched.append(stream)

    class Output:
        def copy(self):
            copied_on.append(cp.current[-1].name)  # the stream current while it is copied
            return "copy"

    def copyto(dst, src):
        raise AssertionError("an input read in place was copied")

    cp.copyto = copyto
    pool, task = FakeStream(cp, "pool 1"), cp.current[-1]
    got = CapturedGroup(Graph(), None, [Output()], None).replay(cp, [np.ones(3), np.ones(4)], pool, task)
    assert launched == [pool] and got == ["copy"]
    assert copied_on == ["task's own"]  # its readers free it into the task stream's part of the pool


@pytest.mark.parametrize("threads", [1, 2])
def test_results_of_the_pool_s_streams_are_handed_over_on_the_task_s_stream_where_other_threads_read(
        monkeypatch, threads):
    from test_documented import FakeCupy

    cp, copied_on = FakeCupy(), []

    class Block(cp.ndarray):
        def copy(self):
            copied_on.append(cp.current[-1].name)
            return "copy"

    monkeypatch.setattr(streams, "_several_threads", lambda: threads > 1)
    block = Block()
    # Dask's reductions' chunk functions return dicts of arrays: those are handed over too
    chunk = {"n": Block(), "total": Block(), "count": 3}
    got = streams.handed_over(cp, [block, 7, None, chunk, (Block(), "x"), [Block()]])
    if threads > 1:  # a reader on another thread frees it into the task stream's part of the pool
        assert got == ["copy", 7, None, {"n": "copy", "total": "copy", "count": 3}, ("copy", "x"), ["copy"]]
        assert copied_on == ["task's own"] * 5
    else:  # this thread's next run waits for the task's stream as it starts: no copy needed
        assert got[0] is block and got[1:3] == [7, None] and got[3] is chunk and copied_on == []


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_outputs_and_their_sum_in_one_compute(c, s, a, blocks):
    await setup(c, s, [1.0])
    x = await c.persist(blocks)
    await wait(x)
    with dask_octopus.annotate():
        y = (x + 0).map_blocks(chain)
    # y's blocks are outputs, so the partial sums that read them are sources of their own fragment
    got_y, got_sum = await c.gather(c.compute([y, y.sum()]))
    expected = chain(blocks.compute(scheduler="sync"))
    np.testing.assert_allclose(got_y, expected)
    assert got_sum == pytest.approx(float(expected.sum()), rel=1e-12)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_the_memory_budget_cuts_a_fragment_into_parts_that_fit(c, s, a, blocks):
    rec, x, expected, _ = await persisted_with_plain_sum(c, s, blocks)
    fragments = []
    for budget in ("auto", 32 * blocks.blocks[0].nbytes):  # 256 blocks: their inputs alone do not fit
        rec.worker.clear()
        with dask.config.set({"octopus.fragments.max-bytes": budget}), dask_octopus.annotate():
            got = await c.compute((x + 0).map_blocks(chain).sum())  # new keys each time
        assert got == pytest.approx(expected, rel=1e-12)
        fragments.append(sum(key_split(k) == FRAGMENT_PREFIX for k in rec.worker))
    assert fragments[0] == 1 and fragments[1] > 1, fragments


def unknown_chunks(x):
    """``x`` with its blocks' rows unknown to Dask (as after a boolean mask): not sized before they exist."""
    return x.map_blocks(np.asarray, chunks=((np.nan,) * x.numblocks[0], x.chunks[1]), dtype=x.dtype)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_fragment_whose_inputs_made_by_the_graph_exceed_the_budget_is_split_before_it_runs(c, s, a):
    """Inputs made by the same graph that are not blocks of known chunks are not sized when fragments
    are cut: once they exist, a fragment whose inputs and intermediates exceed
    ``octopus.fragments.max-bytes`` runs as one task per member, each holding its own inputs only (the
    others may spill, as without fragments); exact either way."""
    rec = await setup(c, s, [1.0])
    # 64 blocks of 192 bytes (Dask fuses each random block into its block of unknown rows: no input is sized)
    x = unknown_chunks(da.random.default_rng(3).random((64 * 4, 6), chunks=(4, 6)))
    expected = await c.compute(x.map_blocks(inc).sum() + x.sum())
    for budget, split in (("auto", False), (40 * 192, True)):  # the inputs alone: 64 x 192 bytes
        with dask_octopus.annotate():
            y = x.map_blocks(inc, name=f"inc-{split}")  # new keys each time
        total = y.sum() + x.sum()  # x's blocks: read by the fragment and by x.sum's tasks (not pulled in)
        rec.worker.clear()
        with dask.config.set({"octopus.fragments.max-bytes": budget}), \
                captured_logger("dask_octopus.plugins.scheduler", level=logging.INFO) as log:
            assert await c.compute(total) == pytest.approx(expected, rel=1e-12)
        whole = [k for k in rec.worker if key_split(k) == FRAGMENT_PREFIX]
        parts = [k for k in rec.worker if FRAGMENT_PREFIX in str(k) and key_split(k) != FRAGMENT_PREFIX]
        if split:
            assert not whole and len(parts) > 64, (whole, parts)  # the blocks and the partial sums
            assert "exceed octopus.fragments.max-bytes (7.50 kiB here), runs as" in log.getvalue(), log.getvalue()
        else:
            assert len(whole) == 1 and not parts, (whole, parts)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_fragment_of_two_inputs_over_the_budget_is_split_before_it_runs(c, s, a):
    """Two inputs are enough: a fragment reading two unsized inputs whose bytes exceed
    ``octopus.fragments.max-bytes`` runs as one task per member."""
    rec = await setup(c, s, [1.0])
    x = unknown_chunks(da.random.default_rng(3).random((2 * 4, 6), chunks=(4, 6)))  # 2 blocks of 192 bytes
    expected = await c.compute(x.map_blocks(inc).sum() + x.sum())
    with dask_octopus.annotate():
        y = x.map_blocks(inc, name="inc-two")
    rec.worker.clear()
    with dask.config.set({"octopus.fragments.max-bytes": 200}), \
            captured_logger("dask_octopus.plugins.scheduler", level=logging.INFO) as log:
        assert await c.compute(y.sum() + x.sum()) == pytest.approx(expected, rel=1e-12)
    assert not [k for k in rec.worker if key_split(k) == FRAGMENT_PREFIX]
    assert "exceed octopus.fragments.max-bytes" in log.getvalue(), log.getvalue()


@pytest.mark.parametrize("inside", ["built", "computed"])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_blocks_the_graph_makes_are_sized_from_their_chunks_when_fragments_are_cut(c, s, a, inside):
    """Blocks of dask arrays that the graph makes (random blocks here) are sized from their chunks and
    dtype before they exist: a fragment over the budget is cut when it is made, into fragments that
    fit, and none is split as it runs; whether the fragments are made from the marks of blocks built
    inside ``annotate`` (the mapped blocks read the random ones, which other tasks read too) or from
    those of a compute inside it (the random blocks join the fragments)."""
    rec = await setup(c, s, [1.0])
    for budget, cut in (("auto", False), (40 * 192, True)):  # the inputs alone: 64 x 192 bytes
        x = da.random.default_rng(3 + cut).random((64 * 4, 6), chunks=(4, 6))  # 64 blocks of 192 bytes; new keys
        expected = x.map_blocks(inc).sum().compute(scheduler="sync") + x.sum().compute(scheduler="sync")
        with dask_octopus.annotate() if inside == "built" else contextlib.nullcontext():
            y = x.map_blocks(inc, name=f"inc-sized-{cut}")  # new keys each time
        rec.worker.clear()
        with dask.config.set({"octopus.fragments.max-bytes": budget}), \
                dask_octopus.annotate() if inside == "computed" else contextlib.nullcontext(), \
                captured_logger("dask_octopus.plugins.scheduler", level=logging.INFO) as log:
            assert await c.compute(y.sum() + x.sum()) == pytest.approx(expected, rel=1e-12)
        whole = [k for k in rec.worker if key_split(k) == FRAGMENT_PREFIX]
        parts = [k for k in rec.worker if FRAGMENT_PREFIX in str(k) and key_split(k) != FRAGMENT_PREFIX]
        assert not parts and "runs as" not in log.getvalue(), (parts, log.getvalue())
        assert len(whole) > 1 if cut else len(whole) == 1, whole


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_persisted_dataframe_s_partitions_read_through_aliases_are_sized_when_fragments_are_cut(c, s, a):
    """The partitions of a persisted dask-expr dataframe, which its graph reads through aliases, count
    with their bytes when fragments are cut: a fragment over the budget is cut when it is made, into
    fragments that fit, and none is split as it runs; exact."""
    rec = await setup(c, s, [1.0])
    frame = pd.DataFrame({"k": np.arange(1600) % 7, "v": np.arange(1600.0)})
    df = c.persist(dd.from_pandas(frame, npartitions=16))
    await wait(df)
    part = max(ts.get_nbytes() for f in futures_of(df) if (ts := s.tasks[f.key]))
    for budget, cut in (("auto", False), (8 * part, True)):  # all 16 partitions do not fit in 8
        rec.worker.clear()
        with dask.config.set({"octopus.fragments.max-bytes": budget}), dask_octopus.annotate(), \
                captured_logger("dask_octopus.plugins.scheduler", level=logging.INFO) as log:
            got = await c.compute(df.map_partitions(double_v, token=f"sized-{cut}").v.sum())
        assert got == 2 * frame.v.sum()
        whole = [k for k in rec.worker if key_split(k) == FRAGMENT_PREFIX]
        parts = [k for k in rec.worker if FRAGMENT_PREFIX in str(k) and key_split(k) != FRAGMENT_PREFIX]
        assert not parts and "runs as" not in log.getvalue(), (parts, log.getvalue())
        assert len(whole) > 1 if cut else len(whole) == 1, whole


def test_array_blocks_are_sized_from_the_chunks_and_dtype_of_their_layer(monkeypatch):
    from collections import OrderedDict

    from dask_octopus.groups import blocksizes

    monkeypatch.setattr(blocksizes, "_layers", OrderedDict())
    x = da.ones((10, 6), chunks=(4, 6), dtype="f4")  # blocks of 4, 4 and 2 rows
    unknown = unknown_chunks(x)
    objects = da.from_array(np.array(["a", "b"], dtype=object), chunks=1)
    masked = x.map_blocks(np.ma.masked_invalid, meta=np.ma.masked_array(np.ones((0, 0), "f4")))  # not NumPy's array
    blocksizes.remember((x + unknown.sum() + masked).__dask_graph__())
    blocksizes.remember(objects.__dask_graph__())
    blocksizes.remember({"not": "a HighLevelGraph"})  # left as it is
    sizes = blocksizes.block_bytes()
    assert [sizes[(x.name, i, 0)] for i in range(3)] == [96.0, 96.0, 48.0]
    assert [sizes.get((x.name, i, 0)) for i in range(3)] == [96.0, 96.0, 48.0]
    unsized = [(x.name, 3, 0), (x.name, -1, 0), (x.name, 0), (x.name, 0, 0, 0), (x.name, 0.0, 0), (x.name, True, 0),
               (unknown.name, 0, 0), (objects.name, 0), (masked.name, 0, 0), "x", ("other", 0, 0), ()]
    for key in unsized:
        assert key not in sizes, key  # past its blocks, other shapes, unknown chunks, objects, other types, layers
        assert sizes.get(key) is None and sizes.get(key, -1.0) == -1.0, key
        with pytest.raises(KeyError):
            sizes[key]
    blocks = {(x.name, 2, 0): 48.0, (x.name, 0, 0): 96.0}  # in one pass, as a fragment looks up its steps
    assert sizes.known([*blocks, *unsized]) == blocks == blocksizes.known_bytes(sizes, [*unsized, *blocks])
    assert blocksizes.known_bytes({"a": 1.0, "b": None}, ["a", "b", "c"]) == {"a": 1.0}  # any mapping
    assert len(sizes) == len(list(sizes)) >= 3 and (x.name, 2, 0) in list(sizes)
    later = blocksizes.block_bytes()
    monkeypatch.setattr(blocksizes, "LAYERS", 2)
    blocksizes.remember(da.zeros(4, chunks=2).__dask_graph__())  # two layers kept: the first seen go
    assert (x.name, 0, 0) not in blocksizes.block_bytes() and (x.name, 0, 0) in later  # (a copy)
    many = da.stack([da.zeros(4, chunks=2) + i for i in range(3)])  # more layers than kept: all of one graph
    blocksizes.remember(many.__dask_graph__())
    assert (many.name, 0, 0) in blocksizes.block_bytes()
    assert len(blocksizes._layers) == len(many.__dask_graph__().layers)


def test_a_step_counts_its_block_s_recorded_bytes_only_where_they_are_more_than_it_reads():
    """Dask records an array layer's chunks before some operations change them (a reduction's partial
    results are recorded as large as the blocks they read): a step's estimate is the larger of its
    block's recorded bytes and the largest value it reads; a step reading nothing takes its block's."""
    members = {"r": Task("r", np.ones, 4), "s": Task("s", np.sum, TaskRef("x")), "t": Task("t", add, TaskRef("r"),
                                                                                           TaskRef("s"))}
    fragment = Fragment(members, ["t"], dict.fromkeys(members, "memory"), made={"r": 50.0, "s": 8.0, "t": 300.0})
    sizes, _ = fragment.estimate({"x": 192})
    assert dict(zip(fragment.names, sizes, strict=True)) == {"r": 50.0, "s": 192.0, "t": 300.0}


def test_a_fragment_s_inputs_picked_inline_count_their_share_of_what_they_are_picked_from():
    from types import SimpleNamespace

    from dask_octopus.groups.scheduler import _input_sizes

    members = {"m": Task("m", add, TaskRef("a"), TaskRef("b")), "n": Task("n", add, TaskRef("m"), TaskRef("c")),
               "o": Task("o", add, TaskRef("n"), TaskRef("d"))}
    fragment = Fragment(members, ["o"], dict.fromkeys(members, "memory"), made={"b": 700.0, "c": 10.0, "d": 1500.0})
    assert fragment.inputs == ("a", "b", "c", "d") and fragment.made == {"b": 700.0, "c": 10.0, "d": 1500.0}
    upstream = Fragment({k: Task(k, inc, 1) for k in "bcde"}, "bcde", dict.fromkeys("bcde", "memory"))
    tasks = [SimpleNamespace(key="a", get_nbytes=lambda: 50, run_spec=None),
             SimpleNamespace(key="f", get_nbytes=lambda: 1000,  # a fragment task of four results
                             run_spec=Task("f", streams.run_fragment, DataNode(None, upstream)))]
    args = (TaskRef("a"), *(Task(k, streams.pick, TaskRef("f"), i) for i, k in enumerate("bcd")))
    spec = Task("frag", streams.run_fragment, DataNode(None, fragment), *args)
    ts = SimpleNamespace(dependencies=tasks, run_spec=spec)
    # a: its task's bytes; b, c and d, picked from a task of 1000 bytes and four results: 250 each, or their
    # estimate where that is more, but no more than the task's bytes
    assert _input_sizes(ts, fragment) == {"a": 50, "b": 700.0, "c": 250.0, "d": 1000.0}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_fragment_reading_another_s_results_inline_is_sized_from_them_before_it_runs(c, s, a):
    """A fragment that reads the results of another fragment inline (the blocks of ``x`` below, which
    the maximum's fragment makes and the division's reads) sizes them once they exist, from that
    fragment's result, and is split before it runs where they exceed the budget; exact."""
    await setup(c, s, [1.0])
    x = unknown_chunks(da.random.default_rng(5).random((32 * 4, 6), chunks=(4, 6)))  # 32 blocks of 192 bytes
    expected = (x / x.max()).sum().compute(scheduler="sync")  # (the cluster gets the keys once)
    # the division's fragments are made from the marks of the blocks built inside annotate, the maximum's
    # (x's blocks, built outside) from the compute's: the division's then read x's blocks inline
    with dask.config.set({"octopus.fragments.max-bytes": 8 * 192}), dask_octopus.annotate(), \
            captured_logger("dask_octopus.plugins.scheduler", level=logging.INFO) as log:
        assert await c.compute((x / x.max()).sum()) == pytest.approx(expected, rel=1e-12)
    assert "failed" not in log.getvalue() and not s.plugins["octopus"].failed_hooks, log.getvalue()
    assert "exceed octopus.fragments.max-bytes (1.50 kiB here), runs as" in log.getvalue(), log.getvalue()


def total(*parts):
    return sum(parts)


def test_every_fragment_cut_by_the_budget_fits_it_or_holds_one_source():
    from dask_octopus.groups.planning import topological
    from dask_octopus.groups.rewrite import dependents_of, fragment_graph

    data = {("x", i): np.arange(24.0).reshape(4, 6) + i for i in range(16)}  # blocks that exist already
    graph = {}
    for i in range(16):  # each block through the chain, its sum; partial sums of 4; the top
        graph[("c", i)] = Task(("c", i), chain, TaskRef(("x", i)))
        graph[("s", i)] = Task(("s", i), np.sum, TaskRef(("c", i)))
    for j in range(4):
        graph[("p", j)] = Task(("p", j), total, *(TaskRef(("s", i)) for i in range(4 * j, 4 * j + 4)))
    graph["top"] = Task("top", total, *(TaskRef(("p", j)) for j in range(4)))
    sizes = {k: v.nbytes for k, v in data.items()}
    specs = {k: {"resource": "memory"} for k in graph}
    expected = sum(chain(v).sum() for v in data.values())
    counts = []
    for budget in (None, 16 * 192, 8 * 192, 1):  # bytes; a block is 192
        out = fragment_graph(graph, specs, {"top"}, dependents_of(graph), {}, {None: 1}, sizes=sizes,
                             budgets={None: budget})
        made = [node.args[0].value for k, node in out.items() if k not in graph]
        for fragment in made:
            sources = [k for k in fragment.inputs if k in data]
            assert budget is None or fragment.peak_bytes(sizes) <= budget or len(sources) == 1
        got = dict(data)
        for k in topological(list(out), {k: node.dependencies for k, node in out.items()}):
            got[k] = out[k]({d: got[d] for d in out[k].dependencies})
        assert got["top"] == pytest.approx(expected, rel=1e-12)
        counts.append(len(made))
    assert counts[0] == 1 and counts[-1] > counts[2] > counts[1] >= 1, counts


@pytest.mark.parametrize("keep", ["total", "outputs"])
def test_a_graph_is_cut_alike_however_it_lists_its_tasks(keep):
    """Twelve loads, each read with its neighbour by an annotated task, cut for three threads: the same
    fragments whatever the order of the graph's dict (a layer's blocks may come from a set, whose order
    changes from process to process), planned from the outputs in the order asked for (several: one
    string key each, as Dask names the output of each collection computed at once)."""
    import random

    from dask_octopus.groups.rewrite import dependents_of, fragment_graph, replaced_keys

    graph = {}
    for i in range(12):
        graph[("load", i)] = Task(("load", i), inc, i)
        graph[("part", i)] = Task(("part", i), operator.add, TaskRef(("load", i)), TaskRef(("load", (i + 1) % 12)))
    outs = [("out", i) for i in range(12)] if keep == "total" else [f"out-{i}" for i in range(12)]
    for i, out in enumerate(outs):
        graph[out] = Task(out, inc, TaskRef(("part", i)))
    if keep == "total":
        graph["total"] = Task("total", total, *map(TaskRef, outs))
    asked = ["total"] if keep == "total" else outs
    specs = {("part", i): {"resource": "memory"} for i in range(12)}
    cuts = set()
    for seed in range(8):
        keys = list(graph)
        random.Random(seed).shuffle(keys)
        listed = {k: graph[k] for k in keys}
        out = fragment_graph(listed, specs, asked, dependents_of(listed), {}, {None: 3})
        cuts.add(tuple(sorted(tuple(sorted(replaced_keys(node), key=repr)) for node in out.values()
                              if len(replaced_keys(node)) > 1)))
    assert len(cuts) == 1
    (cut,) = cuts
    assert [sorted(k[1] for k in members if k[0] == "part") for members in cut] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


class Barrier(Task):
    """A special task, as Dask's P2P barrier is: a subclass of Task whose neighbours Dask tracks by key."""

    __slots__ = ()


@pytest.mark.parametrize("kind, joins", [(Task, True), (UnfusedTask, True), (Barrier, False)])
def test_a_task_reading_an_unfused_slice_joins_a_fragment_and_one_next_to_a_special_task_does_not(kind, joins):
    """A plain slice that only the fragment reads runs inside it too (pulled upstream); balance's
    unfused slice runs where its input is, and a special task keeps its readers out."""
    from dask_octopus.groups.rewrite import dependents_of, fragment_graph

    graph = {"slice": kind("slice", operator.getitem, TaskRef("x"), slice(0, 2))}  # "x" exists already
    for i in range(4):
        graph[("c", i)] = Task(("c", i), chain, TaskRef("slice"))
    graph["top"] = Task("top", total, *(TaskRef(("c", i)) for i in range(4)))
    specs = {("c", i): {"resource": "memory"} for i in range(4)}
    out = fragment_graph(graph, specs, {"top"}, dependents_of(graph), {}, {None: 1})
    grouped = {m for k, node in out.items() if k not in graph for m in node.args[0].value.members}
    pulled = {"slice"} if kind is Task else set()
    assert grouped == ({("c", i) for i in range(4)} | pulled if joins else set())
    assert ("slice" in out) is not pulled and (pulled or type(out["slice"]) is kind)


@pytest.mark.parametrize("through, movable", [(True, True), (True, False), (False, True)])
def test_fragments_read_the_targets_of_aliases_and_the_aliases_only_they_read_go(through, movable):
    """Blocks read through aliases (one of an alias) of tasks that exist already: where the aliases may
    be read through, the fragment reads the targets, and the aliases go where they may (the plugin's new
    tasks that only this graph reads) and stay, read by nothing here, where something else may read
    them; otherwise it reads the aliases. The values are the graph's; an alias of a special task stays
    what the fragment reads."""
    from dask_octopus.groups.rewrite import dependents_of, fragment_graph

    graph = {"special": Barrier("special", operator.add, TaskRef(("x", 0)), 0),
             "of-special": Alias("of-special", "special")}
    for i in range(4):
        graph[("alias", i)] = Alias(("alias", i), ("x", i))  # ("x", i) exist already
        graph[("again", i)] = Alias(("again", i), ("alias", i))
        graph[("c", i)] = Task(("c", i), chain, TaskRef(("again", i)))
    graph[("c", 4)] = Task(("c", 4), chain, TaskRef("of-special"))
    graph["top"] = Task("top", total, *(TaskRef(("c", i)) for i in range(5)))
    specs = {("c", i): {"resource": "memory"} for i in range(5)}
    aliases = {(name, i) for name in ("alias", "again") for i in range(4)}
    pullable = None if movable else set(graph) - aliases
    out = fragment_graph(graph, specs, {"top"}, dependents_of(graph), {}, {None: 1}, pullable,
                         read_through={*aliases, "of-special"} if through else ())
    (fkey,) = [k for k in out if k not in graph]
    read = {("x", i) for i in range(4)} if through else {("again", i) for i in range(4)}
    assert out[fkey].dependencies == read | {"of-special"}
    assert (aliases & out.keys()) == (set() if through and movable else aliases)
    inputs = {("x", i): np.full(3, float(i)) for i in range(4)}
    np.testing.assert_array_equal(dask.get({**out, **inputs}, "top"), dask.get({**graph, **inputs}, "top"))


def aliased(x, name):
    """``x`` read through one alias task per block (as ``balance`` names blocks it keeps)."""
    layer = {(name, *k[1:]): Alias((name, *k[1:]), k) for k in flatten(x.__dask_keys__())}
    return da.Array(HighLevelGraph.from_collections(name, layer, dependencies=[x]), name, x.chunks, meta=x._meta)


@pytest.mark.parametrize("inside", ["built", "computed"])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config={"optimization.fuse.active": False})
async def test_aliases_the_scheduler_holds_are_read_as_they_are(c, s, a, inside):
    """Aliases that the scheduler holds (persisted) are reused, as Dask reuses them: the fragments read
    them, and their targets, released since, do not run again."""
    rec = await setup(c, s, [1.0])
    x = da.ones((800, 8), chunks=(100, 8)).map_blocks(inc)
    y = aliased(x, "held-alias")
    held = c.persist(y)  # held: the aliases; x's blocks are released
    await wait(held)
    expected = await c.compute(y.map_blocks(chain).sum())
    rec.worker.clear()
    with dask_octopus.annotate() if inside == "built" else contextlib.nullcontext():
        z = y.map_blocks(chain, token="annotated").sum()
    with dask_octopus.annotate() if inside == "computed" else contextlib.nullcontext():
        assert await c.compute(z) == pytest.approx(expected, rel=1e-12)
    assert FRAGMENT_PREFIX in {key_split(k) for k in rec.worker}
    assert not {k for k in rec.worker if key_split(k) in ("inc", "held-alias")}, rec.worker


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_fragments_over_blocks_balance_names_run_where_the_plan_pins_them(c, s, a, b, grouped_by):  # noqa: F811
    """``balance`` keeps blocks it need not move under new names, aliases of the blocks, which its plan
    pins (read by two layers here: not fused into them); built inside ``annotate``, each worker's
    blocks make one fragment, which runs on that worker, and the aliases stay tasks where planned,
    whether the optimizer or the plugin's ``update_graph`` makes the fragments."""
    rec = await setup(c, s, [1.0, 1.0])
    x = c.persist(da.ones((800, 8), chunks=(100, 8)), workers=[a.address])
    await wait(x)
    y = await run_balance(c, x, per_worker=4)
    plan = s.plugins["octopus"].placement.plans[y.name]
    assert sorted(plan.workers) == sorted([a.address] * 4 + [b.address] * 4)
    with dask_octopus.annotate():
        z = (y.map_blocks(chain).sum(axis=1) + y.map_blocks(np.sin).sum(axis=1)).sum()
    expected = (chain(np.ones((800, 8))).sum(axis=1) + np.sin(np.ones((800, 8))).sum(axis=1)).sum()
    assert await c.compute(z) == pytest.approx(expected, rel=1e-12)
    fragments = [w for k, w in rec.worker.items() if key_split(k) == FRAGMENT_PREFIX]
    assert sorted(fragments) == sorted([a.address, b.address]), rec.worker
    blocks = {k[1]: w for k, w in rec.worker.items() if k[0] == y.name}  # the aliases, run as tasks
    assert blocks == dict(enumerate(plan.workers)), rec.worker


def alias_of(value, name):
    """The delayed ``value`` read through a new alias task named ``name``."""
    return Delayed(name, HighLevelGraph.from_collections(name, {name: Alias(name, value.key)}, dependencies=[value]))


@pytest.mark.parametrize("inside", ["built", "computed"])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_values_read_through_new_aliases_are_sized_when_the_optimizer_cuts_fragments(c, s, a, inside):
    """Delayed values persisted, read through new aliases made outside ``annotate`` (fragments made by the
    optimizer on the scheduler, where nothing else says how large the values are): the values count
    with their bytes when fragments are cut, as they would read directly; exact, none split as it runs."""
    rec = await setup(c, s, [1.0])
    blocks = c.persist([dask.delayed(np.full, pure=True)((100, 8), float(i)) for i in range(16)])
    await wait(blocks)
    block = 100 * 8 * 8
    expected = float(sum(chain(np.full((100, 8), float(i))).sum() for i in range(16)))
    for budget, cut in (("auto", False), (8 * block, True)):  # all 16 blocks do not fit in 8
        rec.worker.clear()
        aliases = [alias_of(b, f"new-alias-{inside}-{cut}-{i}") for i, b in enumerate(blocks)]  # (not marked)
        with dask.config.set({"octopus.fragments.max-bytes": budget}), \
                captured_logger("dask_octopus.plugins.scheduler", level=logging.INFO) as log:
            with dask_octopus.annotate() if inside == "built" else contextlib.nullcontext():
                z = dask.delayed(total)(*(dask.delayed(np.sum)(dask.delayed(chain)(b)) for b in aliases))
            with dask_octopus.annotate() if inside == "computed" else contextlib.nullcontext():
                assert await c.compute(z) == pytest.approx(expected, rel=1e-12)
        whole = [k for k in rec.worker if key_split(k) == FRAGMENT_PREFIX]
        parts = [k for k in rec.worker if FRAGMENT_PREFIX in str(k) and key_split(k) != FRAGMENT_PREFIX]
        assert not parts and "runs as" not in log.getvalue(), (parts, log.getvalue())
        assert len(whole) > 1 if cut else len(whole) == 1, whole
        assert not {k for k in rec.worker if key_split(k).startswith("new-alias")}, rec.worker  # read through


@pytest.mark.parametrize("made", [False, True])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_value_read_through_two_aliases_counts_once_against_the_budget(c, s, a, made):
    """Values each read through two new aliases (two collections over the same blocks): the fragment
    task receives each value once, and it counts once against the budget, when the fragments are cut
    (values persisted: sized then) and before they run (values the graph makes, and reads elsewhere
    too: sized once they exist). Estimated: 16 blocks received, 16 sums (as large as what they read)
    held to the end and 3 at a time in the making: 35 blocks, 51 counting each value twice, in a budget
    of 40 make one fragment, none split; exact."""
    rec = await setup(c, s, [1.0])
    blocks = [dask.delayed(np.full, pure=True)((100, 8), float(i)) for i in range(16)]
    if not made:
        blocks = c.persist(blocks)
        await wait(blocks)
    block = 100 * 8 * 8
    expected = float(sum(2 * chain(np.full((100, 8), float(i))).sum() for i in range(16)))
    left = [alias_of(b, f"left-alias-{made}-{i}") for i, b in enumerate(blocks)]
    right = [alias_of(b, f"right-alias-{made}-{i}") for i, b in enumerate(blocks)]
    with dask_octopus.annotate():
        sums = [dask.delayed(np.sum)(dask.delayed(chain)(p) + dask.delayed(chain)(q))
                for p, q in zip(left, right, strict=True)]
    z = dask.delayed(total)(*sums)
    if made:  # the blocks, read by a task outside the fragments too, stay tasks of their own
        z, expected = z + dask.delayed(total)(*map(dask.delayed(np.sum), blocks)), expected + 800 * 120
    with dask.config.set({"octopus.fragments.max-bytes": 40 * block}), \
            captured_logger("dask_octopus.plugins.scheduler", level=logging.INFO) as log:
        assert await c.compute(z) == pytest.approx(expected, rel=1e-12)
    whole = [k for k in rec.worker if key_split(k) == FRAGMENT_PREFIX]
    parts = [k for k in rec.worker if FRAGMENT_PREFIX in str(k) and key_split(k) != FRAGMENT_PREFIX]
    assert len(whole) == 1 and not parts and "runs as" not in log.getvalue(), (whole, parts, log.getvalue())


class Doubled(Task):
    """A task kind that calls itself differently from Dask's ``Task``: a step keeps it as it is."""

    def __call__(self, values=()):
        return 2 * super().__call__(values)


@pytest.mark.parametrize("node", [
    Task("s", operator.add, TaskRef("x"), 10),
    Task("s", operator.add, TaskRef("x"), TaskRef("y")),
    Task("s", operator.add, TaskRef("y"), TaskRef("x")),  # refs numbered as the arguments name them
    Task("s", pow, TaskRef("x"), exp=TaskRef("y")),  # a ref among the keyword arguments
    Task("s", operator.add, Task(None, operator.mul, TaskRef("x"), DataNode(None, 3)), TaskRef("x")),
    Task("s", sum, parse_input([TaskRef("x"), TaskRef("y"), 5])),  # Dask's List
    Task("s", dict, parse_input({"a": TaskRef("x"), "b": (TaskRef("y"), 1)})),  # Dict with a Tuple inside
    Task("s", sorted, parse_input({TaskRef("x"), TaskRef("y")})),  # Set
    Task("s", len, ((0, 1), (2,))),  # constant tuples stay constants
    Task("s", list, (Ref, 5)),  # also one that begins as a spec does
    Task("s", list, DataNode(None, (Call, 5))),
    Doubled("s", operator.add, TaskRef("x"), TaskRef("y")),
])
def test_a_step_gives_what_dask_s_task_gives_and_travels_without_task_objects(node):
    frag = Fragment({"s": node}, ["s"], {"s": "memory"})
    inputs = [{"x": 4, "y": 7}[k] for k in frag.inputs]
    assert streams.run_fragment(frag, *inputs) == (node({"x": 4, "y": 7}),)
    assert streams.run_fragment(pickle.loads(pickle.dumps(frag)), *inputs) == (node({"x": 4, "y": 7}),)
    # its steps stay as they are (the very functions and constants) until it is pickled, then travel packed
    live = Fragment({"s": node}, ["s"], {"s": "memory"})
    assert streams.run_fragment(live, *inputs) == (node({"x": 4, "y": 7}),) and live.specs() is live.specs()
    assert tokenize(DataNode(None, live)) == tokenize(DataNode(None, frag))  # a token from its keys, unpacked
    assert live.specs() is live.specs() and live.structure() == frag.structure()
    sent = pickle.loads(pickle.dumps(live))
    assert streams.run_fragment(sent, *inputs) == (node({"x": 4, "y": 7}),) and sent.specs() is not sent.specs()
    assert live.specs() is not live.specs()  # once sent, the sender keeps the packed steps only

    def graph_nodes(spec):  # Dask's task objects inside a step's spec
        if isinstance(spec, GraphNode):
            return [spec]
        return [n for part in spec for n in graph_nodes(part)] if type(spec) is tuple else []

    # plain tuples travel to the worker, not Dask's task objects (those cost ten times more to pickle)
    assert bool(graph_nodes(frag.specs())) == isinstance(node, Doubled)


def test_the_collector_is_paused_while_an_annotated_graph_is_optimized_and_resumed_after():
    import gc

    from dask_octopus.groups.collector import collector_paused
    from dask_octopus.groups.marks import GroupingOptimizer

    seen = []

    def base(dsk, keys, **kwargs):  # Dask's optimizer, recording whether the collector runs
        seen.append(gc.isenabled())
        return dsk

    optimize = GroupingOptimizer(base)
    x = da.ones(8, chunks=4)
    with dask_octopus.annotate():
        marked = x + 1
    unmarked = x + 2
    optimize(marked.__dask_graph__(), marked.__dask_keys__())
    optimize(unmarked.__dask_graph__(), unmarked.__dask_keys__())
    assert seen == [False, True] and gc.isenabled()  # paused for the marked graph only
    with pytest.raises(RuntimeError), collector_paused():
        with collector_paused():
            pass
        assert not gc.isenabled()  # the outer block (another thread's planning) still pauses it
        raise RuntimeError("planning failed")
    assert gc.isenabled()  # resumed by the outermost block, also on an error
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # a collector paused by the user stays paused
    finally:
        gc.enable()


COLLECTING = []  # whether the garbage collector ran at each call of collecting (the workers run in this process)


def collecting(x, seconds=0.0):
    """Notes whether the collector runs as it starts and, after ``seconds``, as it ends."""
    import gc

    COLLECTING.append(gc.isenabled())
    if seconds:
        time.sleep(seconds)
        COLLECTING.append(gc.isenabled())
    return x + 1


async def run_collecting(c, s, seconds=0.0):
    """A chain of four steps computed inside ``annotate``, the first one ``seconds`` long: a fragment of
    three, and the key asked for (a task of its own); returns its result."""
    await setup(c, s, [1.0])
    COLLECTING.clear()
    with dask_octopus.annotate():
        y = dask.delayed(collecting)(0, seconds)
        for _ in range(3):
            y = dask.delayed(collecting)(y)
    return await c.compute(y)


@pytest.mark.parametrize("collect_after, seconds, seen", [(5.0, 0.0, [False, False, False, True]),
                                                          (0.3, 2.0, [False, True, True, True, True])])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_fragment_runs_with_the_collector_paused_on_a_one_thread_worker(c, s, a, monkeypatch,
                                                                                 collect_after, seconds, seen):
    """On a worker of one thread the cyclic garbage collector is paused while a fragment runs (its steps'
    specs are freed, never promoted), for ``RunningTask.collect_after`` seconds at most, also within a
    long step (a longer run collects as Dask's tasks do), and runs again after it."""
    import gc

    monkeypatch.setattr(streams.RunningTask, "collect_after", collect_after)
    assert gc.isenabled()
    assert await run_collecting(c, s, seconds) == 4
    assert seen == COLLECTING and gc.isenabled()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)])
async def test_a_fragment_leaves_the_collector_running_on_a_worker_of_several_threads(c, s, a):
    """Fragments back to back on several threads would keep the collector paused: it runs."""
    assert await run_collecting(c, s) == 4
    assert COLLECTING == [True] * 4


def test_the_collector_pause_may_end_early_and_once():
    import gc

    from dask_octopus.groups.collector import collector_paused

    with collector_paused() as outer:
        with collector_paused() as inner:
            inner()
            inner()  # once: the outer block's share is left
            assert not gc.isenabled()
        outer()
        assert gc.isenabled()
    assert gc.isenabled()


def test_a_fragment_of_functions_defined_in_a_script_runs_in_another_process(tmp_path):
    import subprocess
    import sys

    # a script's functions live in its __main__: they must travel by value, as Dask sends a task's
    script = tmp_path / "script.py"
    script.write_text(
        "import sys\n"
        "from distributed.protocol.pickle import dumps\n"
        "from dask_octopus._compat import Task, TaskRef\n"
        "from dask_octopus.groups.fragment import Fragment\n"
        "def double(x):\n"
        "    return 2 * x\n"
        "frag = Fragment({'a': Task('a', double, TaskRef('x')), 'b': Task('b', double, TaskRef('a'))}, ['b'],\n"
        "                {'a': 'memory', 'b': 'memory'})\n"
        "sys.stdout.buffer.write(dumps(frag))\n")
    sent = subprocess.run([sys.executable, str(script)], capture_output=True, check=True).stdout
    run = ("import sys; from distributed.protocol.pickle import loads; from dask_octopus.groups import streams; "
           "print(streams.run_fragment(loads(sys.stdin.buffer.read()), 21))")
    got = subprocess.run([sys.executable, "-c", run], input=sent, capture_output=True, check=True)
    assert got.stdout.decode().strip() == "(84,)"


def test_a_closed_runtime_forgets_what_it_learned_and_runs_again(fake_gpu):  # noqa: F811
    cp, fresh_runtime = fake_gpu
    fresh_runtime()
    rt = streams.runtime()
    frag = two_chains()
    rt.eager_layout(cp, frag, [1, 2])
    rt.classify("member", [np.ones(4)], np.ones(4), 1.0)
    assert rt.layouts and rt.spreads and rt.classes
    rt.close()
    assert not (rt.layouts or rt.spreads or rt.classes)
    assert streams.run_fragment(frag, 1, 100) == (106, 14) and rt.layouts


def test_the_pool_streams_wait_for_the_steps_constants_unpickled_on_the_task_s_stream(fake_gpu, monkeypatch):  # noqa: F811
    _, fresh_runtime = fake_gpu
    fresh_runtime()
    log = []  # what happened, in order: specs unpickled (device constants uploaded on the current stream), events

    def record(stream):
        log.append(("record", stream.name, len(log)))
        return log[-1]

    monkeypatch.setattr(FakeStream, "record", record)
    monkeypatch.setattr(FakeStream, "wait_event", lambda stream, event: log.append(("wait", stream.name, event)))
    frag = two_chains()
    specs = frag.specs()
    frag.specs = lambda: log.append(("specs",)) or specs
    with dask.config.set({"octopus.streams.capture": False}):
        assert streams.run_fragment(frag, 1, 100) == (106, 14)
    unpickled = max(i for i, entry in enumerate(log) if entry[0] == "specs")
    waited = [entry[2] for entry in log if entry[0] == "wait" and entry[2][1] == "task's own"]
    assert waited and all(event[2] > unpickled for event in waited)  # each pool stream's wait for the inputs


class Held:
    """An input whose lifetime a test follows."""


def fails_on(block):
    raise ValueError(f"cannot use {type(block).__name__}")


def test_a_failed_step_guard_or_map_item_holds_its_error_from_the_user_s_code_and_none_of_its_inputs():
    import gc
    import traceback
    import weakref

    from dask_octopus.placement import items

    block = Held()
    alive = weakref.ref(block)
    frag = Fragment({"s": Task("s", fails_on, TaskRef("x")), "t": Task("t", len, TaskRef("y"))}, ["s", "t"],
                    {"s": "memory", "t": "memory"})
    failed, length = streams.run_fragment(frag, block, "abc")
    out = streams.run_guarded("d", Task("d", fails_on, TaskRef("x")), ("x",), 0, block)
    (item,) = items.run_batch(fails_on, [block], {}, "memory", None)
    del block
    gc.collect()
    assert type(item) is items.ItemError and repr(item.exception()) == "ValueError('cannot use Held')"
    assert length == 3 and type(failed) is type(out) is streams.StepFailed
    assert alive() is None  # the failed values keep none of the inputs alive (their frames' locals did)
    with pytest.raises(ValueError, match="cannot use Held") as raised:
        streams.pick((failed,), 0)
    assert [f.name for f in traceback.extract_tb(raised.value.__traceback__)][1:] == ["pick", "fails_on"]
    assert repr(out.error) == "ValueError('cannot use Held')"
    assert [f.name for f in traceback.extract_tb(out.traceback.as_traceback())] == ["fails_on"]  # the user's code
    assert "dask_octopus: raised by task 'd', read by fragments" in out.error.__notes__


def parses(block):
    try:
        return {}[type(block).__name__]
    except KeyError as e:
        raise ValueError("cannot parse") from e  # a chained error: its cause's frame holds the block too


def test_a_chained_error_holds_none_of_the_inputs_and_keeps_its_cause():
    import gc
    import weakref

    block = Held()
    alive = weakref.ref(block)
    frag = Fragment({"s": Task("s", parses, TaskRef("x"))}, ["s"], {"s": "memory"})
    (failed,) = streams.run_fragment(frag, block)
    del block
    gc.collect()
    assert alive() is None  # the cause's traceback (its frame's locals, and the fragment's up the stack) is gone
    with pytest.raises(ValueError, match="cannot parse") as raised:
        streams.pick((failed,), 0)
    assert type(raised.value.__cause__) is KeyError and raised.value.__cause__.__traceback__ is None


SHARED_FAILURE = RuntimeError("service unavailable")  # a cached failure, raised again by every call


def raise_shared(x):
    raise SHARED_FAILURE


def test_one_exception_object_raised_by_several_steps_carries_each_its_own_note():
    frag = Fragment({k: Task(k, raise_shared, TaskRef("x")) for k in ("f-0", "f-1")}, ["f-0", "f-1"],
                    {"f-0": "memory", "f-1": "memory"})
    for _ in range(2):
        outputs = streams.run_fragment(frag, 1)
        for i, key in enumerate(("f-0", "f-1")):
            with pytest.raises(RuntimeError, match="service unavailable") as raised:
                streams.pick(outputs, i)
            assert raised.value.__notes__ == [f"dask_octopus: raised by task {key!r} of a fragment"]
    assert not hasattr(SHARED_FAILURE, "__notes__")  # the user's object is left as it was (8 notes before)


def test_a_failed_step_keeps_its_traceback_when_it_travels():
    import traceback

    frag = Fragment({"s": Task("s", fails_on, TaskRef("x"))}, ["s"], {"s": "memory"})
    (failed,) = pickle.loads(pickle.dumps(streams.run_fragment(frag, "abc")))  # to another worker, or the spill
    with pytest.raises(ValueError, match="cannot use str") as raised:
        streams.pick((failed,), 0)
    assert [f.name for f in traceback.extract_tb(raised.value.__traceback__)][1:] == ["pick", "fails_on"]


@pytest.mark.parametrize("memory, fraction, budget", [
    ({"target": 0.6, "spill": 0.7, "pause": 0.8, "terminate": 0.95}, 0.6, 0.2 * 1000 / 2),  # Dask's defaults
    ({"target": 0.6, "spill": 0.7, "pause": 0.8, "terminate": 0.95}, 0.1, 0.1 * 1000 / 2),  # a smaller fraction
    ({"target": False, "spill": 0.7, "pause": 0.8, "terminate": 0.95}, 0.6, 0.1 * 1000 / 2),  # spilling from spill
    ({"target": 0.6, "spill": 0.7, "pause": False, "terminate": 0.95}, 0.6, 0.35 * 1000 / 2),  # never paused
    ({"target": 0.6, "spill": 0.7, "pause": False, "terminate": False}, 0.6, 0.6 * 1000 / 2),  # nor terminated
])
def test_a_cpu_worker_s_budget_leaves_dask_room_to_spill_before_it_pauses_the_worker(memory, fraction, budget):
    """``fragments.max-bytes: auto`` on a CPU worker: ``balance.memory-fraction`` of its memory limit per
    thread, and no more than the fraction between Dask's spill target and its pause threshold, else its
    terminate threshold (what a fragment holds while it runs cannot spill); on a GPU worker, of the free
    device memory."""
    from types import SimpleNamespace

    from dask_octopus.groups.scheduler import thread_budget

    ws = SimpleNamespace(memory_limit=1000, nthreads=2)
    unlimited = SimpleNamespace(memory_limit=0, nthreads=2)  # no limit: Dask neither spills nor pauses it
    with dask.config.set({"octopus.balance.memory-fraction": fraction,
                          **{f"distributed.worker.memory.{k}": v for k, v in memory.items()}}):
        assert thread_budget(ws, {"device": "cpu"}) == pytest.approx(budget)
        assert thread_budget(ws, {"device": "gpu", "memory_free": 4000}) == pytest.approx(fraction * 4000 / 2)
        assert thread_budget(unlimited, {"memory_total": 4000}) == pytest.approx(fraction * 4000 / 2)
        assert thread_budget(unlimited, {}) is None  # memory unknown


def test_fragments_that_may_run_on_several_workers_are_cut_to_the_smallest_one_s_budget():
    """Fragments of no one place get the budget of the smallest worker that may run them, not the largest
    one's (which the smaller one would run out of memory on); with no worker's memory known, none."""
    from dask_octopus.groups.scheduler import _budget, thread_budget

    small = Stub(memory_limit=1000, nthreads=1, host="h", resources={})
    large = Stub(memory_limit=8000, nthreads=1, host="h", resources={})
    unknown = Stub(memory_limit=None, nthreads=1, host="h", resources={})
    with dask.config.set({"octopus.fragments.max-bytes": "auto"}):
        assert thread_budget(small, {}) < thread_budget(large, {})
        assert _budget(Stub(workers={"a": large, "b": small, "c": unknown}), {}, None) == thread_budget(small, {})
        assert _budget(Stub(workers={"c": unknown}), {}, None) is None


def test_a_fragment_alternates_compute_and_memory_bound_steps_where_both_are_ready():
    """docs/fragments.md: steps of both classes that are ready alternate (``"auto"`` counts as memory)."""
    graph = {"a1": Task("a1", inc, TaskRef("x")), "a2": Task("a2", inc, TaskRef("a1")),
             "b1": Task("b1", inc, TaskRef("y")), "b2": Task("b2", inc, TaskRef("b1")),
             "j": Task("j", add, TaskRef("a2"), TaskRef("b2"))}
    resources = {"a1": "compute", "a2": "compute", "b1": "auto", "b2": "auto", "j": "memory"}
    frag = Fragment(graph, ["j"], resources)
    assert list(frag.names) == ["a1", "b1", "a2", "b2", "j"]  # not chain by chain (a1 a2 b1 b2 j)
    assert streams.run_fragment(frag, 1, 100) == (105,)
    same = Fragment(graph, ["j"], dict.fromkeys(graph, "memory"))  # one class: depth first, chain by chain
    assert list(same.names) == ["a1", "a2", "b1", "b2", "j"]


def test_a_member_moving_bytes_at_exactly_a_quarter_of_the_bandwidth_is_memory_bound():
    """StreamRuntime.classify: memory-bound when it moved bytes at a quarter *or more* of the bandwidth."""
    inputs, output = [b"x" * 1000], b"y" * 1000
    moved = sizeof(list(inputs)) + sizeof(output)
    rt = streams.StreamRuntime(bandwidth=4.0 * moved)
    assert rt.classify("t", inputs, output, 1.0) == "memory"  # moved / 1 s == 0.25 * bandwidth exactly
    assert rt.classify("t", inputs, output, 1.001) == "compute"


def test_a_guard_s_inner_keys_are_its_own_and_the_task_it_runs():
    """inner_keys: the keys whose work a task does; a guard does the work of the one task it runs."""
    dsk = {}
    for i in range(4):  # each load read by two parts of two fragments: the loads run as guards
        dsk[("load", i)] = Task(("load", i), inc, i)
        dsk[("part", i)] = Task(("part", i), add, TaskRef(("load", i)), TaskRef(("load", (i - 1) % 4)))
        dsk[("out", i)] = Task(("out", i), inc, TaskRef(("part", i)))
    specs = {k: {"resource": "auto", "group": None} for k in dsk if k[0] == "part"}
    out = fragment_graph(dsk, specs, {k for k in dsk if k[0] == "out"}, dependents_of(dsk), {}, {None: 2})
    guards = {k: node for k, node in out.items() if is_guard(node)}
    assert guards
    for gkey, node in guards.items():
        (guarded,) = replaced_keys(node)
        assert inner_keys(gkey, node) == [gkey, guarded]


def test_a_task_reading_some_results_of_one_fragment_and_no_other_fragment_s_reads_them_inline():
    """read_apart: a consumer reading some of a fragment's results but none of another fragment's (and
    of the same labels) reads them inline; its results get no tasks of their own."""
    dsk = {"a": Task("a", inc, 1), "b": Task("b", inc, 2), "x": Task("x", inc, 0),
           "c1": Task("c1", add, TaskRef("a"), TaskRef("x")), "c2": Task("c2", add, TaskRef("b"), TaskRef("x"))}
    specs = {k: {"resource": "memory", "group": None} for k in ("a", "b")}
    out = fragment_graph(dsk, specs, ["c1", "c2"], dependents_of(dsk), {}, {None: 1})
    assert "a" not in out and "b" not in out  # picked inline by c1 and c2
    assert read_before_grouping(out["c1"]) == {"a", "x"}
    assert list(dask.get(out, ["c1", "c2"])) == [3, 4]


def test_a_place_over_its_budget_is_cut_into_twice_as_many_parts():
    """fragment_graph: a place whose fragments exceed its budget is cut into twice as many parts (one
    fragment of four sources over it: two of two, which fit; not four of one)."""
    data = {("x", i): np.arange(24.0) + i for i in range(4)}  # blocks that exist already, 192 bytes each
    graph = {("s", i): Task(("s", i), np.sum, TaskRef(("x", i))) for i in range(4)}
    graph["top"] = Task("top", total, *(TaskRef(("s", i)) for i in range(4)))
    sizes = {k: v.nbytes for k, v in data.items()}
    specs = {k: {"resource": "memory"} for k in graph}
    args = (graph, specs, {"top"}, dependents_of(graph), {}, {None: 1})
    (whole,) = [node.args[0].value for k, node in fragment_graph(*args, sizes=sizes).items() if k not in graph]
    assert whole.peak_bytes(sizes) == 8 * 192  # the four inputs and the four sums
    out = fragment_graph(*args, sizes=sizes, budgets={None: 5 * 192})
    made = [node.args[0].value for k, node in out.items() if k not in graph]
    assert sorted(len(f.members) for f in made) == [2, 2]
    assert all(f.peak_bytes(sizes) <= 5 * 192 for f in made)
