"""Working sets of balanced blocks: measured per task on the workers, learned per input on the scheduler,
and used by the next ``balance`` of that input to size its blocks."""

import os
import sys
import time
import types

import dask
import dask.array as da
import numpy as np
import pytest
from dask.utils import key_split
from distributed import Client, LocalCluster, wait
from distributed.utils_test import gen_cluster
from stubs import Stub, task_state

import dask_octopus
from dask_octopus.placement.pins import Placement
from dask_octopus.plugins.scheduler import OctopusSchedulerPlugin
from dask_octopus.profiling import working_set
from dask_octopus.profiling.working_set import (
    MEASURE,
    MIN_BASIS,
    MIN_PEAK,
    CupyPeak,
    RssPeak,
    WorkingSetMeter,
    WorkingSets,
)

MiB = 2**20


def test_working_sets_keep_the_largest_recent_ratio_per_input_and_task_prefix():
    ws = WorkingSets(window=2, max_sources=2, max_prefixes=2)
    block = MIN_BASIS
    assert ws.ratio("a") is None
    ws.add("a", "fft", block, 3 * block)
    ws.add("a", "fft", block, 8 * block)
    assert ws.ratio("a") == 8.0
    ws.add("a", "fft", block, 2 * block)
    ws.add("a", "fft", block, 2.5 * block)  # the 8x sample left the window of two
    assert ws.ratio("a") == 2.5
    for _ in range(5):  # light tasks of another kind do not push the fft's samples out
        ws.add("a", "alias", block, block)
    assert ws.ratio("a") == 2.5
    ws.add("a", "fft", block - 1, 100 * block)  # a block too small to bound a plan: ignored
    ws.add("a", "fft", block, float("nan"))
    assert ws.ratio("a") == 2.5
    ws.add("a", "sum", block, 1.5 * block)  # a third kind, room for two: the least recently measured goes
    assert ws.ratio("a") == 1.5
    ws.add("b", "fft", block, block)
    ws.add("c", "fft", block, 3 * block)  # three inputs, room for two: the least recently measured goes
    assert ws.ratio("a") is None and ws.ratio("b") == 1.0 and ws.ratio("c") == 3.0


def test_working_sets_want_a_window_of_tasks_until_its_samples_are_in_then_one_in_a_window():
    sets = WorkingSets(window=4)
    assert not sets.wants("x", "f", MIN_BASIS - 1)  # too small to be learned: never measured
    # no sample back yet: the first four tasks (a window), then one in four (the first graph of a
    # large input does not mark every block)
    assert [sets.wants("x", "f", MIN_BASIS) for _ in range(8)] == [True] * 4 + [False, False, False, True]
    for _ in range(4):
        sets.add("x", "f", MIN_BASIS, MIN_BASIS)
    assert [sets.wants("x", "f", MIN_BASIS) for _ in range(8)] == [False, False, False, True] * 2
    assert sets.wants("x", "g", MIN_BASIS) and sets.wants("y", "f", MIN_BASIS)  # other kinds: their own count
    fresh = WorkingSets(window=4)
    for _ in range(2):
        fresh.add("x", "f", MIN_BASIS, MIN_BASIS)  # samples (of an earlier plugin's marks) but a window not full
    assert [fresh.wants("x", "f", MIN_BASIS) for _ in range(5)] == [True] * 4 + [False]


@pytest.mark.skipif(not RssPeak.available(), reason="needs Linux's /proc/self/clear_refs")
def test_rss_peak_sees_memory_freed_before_the_end_and_resets_per_measurement():
    peak = RssPeak()
    peak.start()
    a = np.ones(64 * MiB // 8)  # written, so resident
    del a
    assert peak.extra() >= 60 * MiB
    peak.start()
    assert peak.extra() < 16 * MiB  # reset: the earlier peak is not seen again


class Obj:
    """An object with the given attributes (hashable by identity, as Dask's task states are)."""

    def __init__(self, **attributes):
        self.__dict__.update(attributes)


class FakeState:
    def __init__(self):
        self.tasks = {}
        self.executing = set()
        self.long_running = set()  # seceded tasks
        self.in_flight_tasks = set()  # data arriving from other workers


class FakeWorker:
    """What the meter reads of a worker: its task states, what executes and where events go."""

    def __init__(self, address):
        self.address = address
        self.state = FakeState()
        self.events = []

    def log_event(self, topic, msg):
        self.events.append((topic, msg))

    def task(self, key, inputs=(), marked=True):
        deps = {Obj(nbytes=n) for n in inputs}
        ts = Obj(key=key, dependencies=deps, nbytes=None, annotations={MEASURE: True} if marked else {})
        self.state.tasks[key] = ts
        return ts

    def start(self, meter, key):
        ts = self.state.tasks[key]
        self.state.executing.add(ts)
        meter.transition(key, "ready", "executing")

    def finish(self, meter, key, nbytes, finish="memory"):
        ts = self.state.tasks[key]
        self.state.executing.discard(ts)
        ts.nbytes = nbytes
        meter.transition(key, "executing", finish)


class FixedPeak:
    def __init__(self, extra):
        self.value, self.starts = extra, 0

    def start(self):
        self.starts += 1

    def extra(self):
        return self.value


@pytest.fixture
def workers():
    """Two workers of one process with a meter each (the peak: 100 MiB allocated by any task)."""
    made = []
    for name in "ab":
        w = FakeWorker(f"tcp://{name}")
        made.append((w, WorkingSetMeter(w, FixedPeak(100 * MiB))))
    yield made
    for _, meter in made:
        meter.close()


def test_a_marked_task_alone_reports_its_inputs_plus_its_peak(workers):
    (w, meter), _ = workers
    w.task("x", inputs=(20 * MiB, 12 * MiB))
    w.start(meter, "x")
    w.finish(meter, "x", nbytes=40 * MiB)
    assert w.events == [(working_set.TOPIC, {"worker": "tcp://a", "samples": [("x", 132 * MiB)]})]


def test_unmarked_small_failed_and_overlapping_tasks_are_not_reported(workers):
    (a, ma), (b, mb) = workers
    a.task("unmarked", inputs=(64 * MiB,), marked=False)
    a.start(ma, "unmarked")
    a.finish(ma, "unmarked", 64 * MiB)
    ma.peak.value = MIN_PEAK - 1
    a.task("small")
    a.start(ma, "small")
    a.finish(ma, "small", 8)
    ma.peak.value = 100 * MiB
    a.task("failed", inputs=(64 * MiB,))
    a.start(ma, "failed")
    a.finish(ma, "failed", None, finish="error")
    # another worker of the process starts a task while "x" runs: both peaks would mix
    a.task("x", inputs=(64 * MiB,))
    b.task("y", inputs=(64 * MiB,), marked=False)
    a.start(ma, "x")
    b.start(mb, "y")
    b.finish(mb, "y", 64 * MiB)
    a.finish(ma, "x", 64 * MiB)
    # and one that starts while the other worker is still executing is not measured at all
    b.task("z", inputs=(64 * MiB,), marked=False)
    b.start(mb, "z")
    a.task("w", inputs=(64 * MiB,))
    a.start(ma, "w")
    a.finish(ma, "w", 64 * MiB)
    b.finish(mb, "z", 64 * MiB)
    assert a.events == [] and b.events == []
    # after all that, a task alone is measured again
    a.task("v", inputs=(64 * MiB,))
    a.start(ma, "v")
    a.finish(ma, "v", 64 * MiB)
    assert a.events == [(working_set.TOPIC, {"worker": "tcp://a", "samples": [("v", 164 * MiB)]})]


def test_tasks_beside_a_seceded_task_or_arriving_data_are_not_reported(workers):
    """A seceded task (``secede()``, ``worker_client()``) and data arriving for a later task hold memory
    of the process as a task does: a peak measured beside them is theirs too (a 300 MiB fetch read as
    a 2 MiB task's working set made the next balance of its input cut blocks 150x smaller)."""
    (a, ma), (b, mb) = workers
    b.state.long_running.add(b.task("seceded", marked=False))
    a.task("x", inputs=(2 * MiB,))
    a.start(ma, "x")
    a.finish(ma, "x", 2 * MiB)
    b.state.long_running.clear()
    a.state.in_flight_tasks.add(a.task("arriving", marked=False))
    a.task("y", inputs=(2 * MiB,))
    a.start(ma, "y")
    a.finish(ma, "y", 2 * MiB)
    a.state.in_flight_tasks.clear()
    a.task("z", inputs=(2 * MiB,))
    a.start(ma, "z")
    mb.transition("arriving-on-b", "fetch", "flight")  # data for a task of the other worker of the process
    a.finish(ma, "z", 2 * MiB)
    assert a.events == [] and ma.peak.starts == 1  # z started, and was not reported
    a.task("v", inputs=(2 * MiB,))
    a.start(ma, "v")
    a.finish(ma, "v", 2 * MiB)
    assert a.events == [(working_set.TOPIC, {"worker": "tcp://a", "samples": [("v", 102 * MiB)]})]


class FakeCupy(types.ModuleType):
    """The allocator API of CuPy that :class:`CupyPeak` uses, over host ``bytearray``s."""

    def __init__(self):
        super().__init__("cupy")
        cuda = self.cuda = types.SimpleNamespace()
        cuda.allocator = self.pool_malloc
        cuda.get_allocator = lambda: cuda.allocator
        cuda.set_allocator = lambda f: setattr(cuda, "allocator", f)
        cuda.MemoryPointer = lambda mem, offset: types.SimpleNamespace(mem=mem, ptr=mem.ptr + offset)
        cuda.UnownedMemory = lambda ptr, size, owner, device_id: types.SimpleNamespace(
            ptr=ptr, size=size, owner=owner, device_id=device_id)

    @staticmethod
    def pool_malloc(size):
        return types.SimpleNamespace(ptr=id(bytearray(size)), device_id=0)


def test_cupy_peak_counts_the_bytes_held_while_measuring_and_gives_the_allocator_back(monkeypatch):
    cp = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    pool = cp.cuda.allocator
    peak = CupyPeak.shared()
    assert CupyPeak.shared() is peak  # the second worker of the process: the same wrapper, never one of another
    before = cp.cuda.allocator(10)  # allocated before: not counted
    peak.start()
    assert cp.cuda.get_allocator() == peak.malloc
    a = peak.malloc(100)
    b = peak.malloc(300)
    del a
    c = peak.malloc(50)
    assert peak.held == 350
    assert peak.extra() == 400  # a and b were held together
    del b, c
    assert peak.held == 0
    peak.start()
    d = cp.cuda.allocator(70)
    assert peak.extra() == 70
    e = peak.malloc(1000)  # not measuring: handed back as the inner allocator made it
    assert peak.held == 70 and not hasattr(e, "mem")
    cp.cuda.set_allocator(pool)  # something else (RMM's setup) replaced the wrapper: the next start wraps it
    peak.start()
    assert cp.cuda.get_allocator() == peak.malloc and peak.inner is pool
    peak.close()  # one of its two users
    assert cp.cuda.get_allocator() == peak.malloc
    peak.close()
    fresh = CupyPeak.shared()
    assert cp.cuda.get_allocator() is pool and fresh is not peak
    fresh.close()
    del before, d, e


def test_a_meter_closed_while_measuring_stops_the_shared_cupy_peak_measuring(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", FakeCupy())
    a, b = FakeWorker("tcp://a"), FakeWorker("tcp://b")
    ma, mb = WorkingSetMeter(a, CupyPeak.shared()), WorkingSetMeter(b, CupyPeak.shared())
    a.task("x")
    a.start(ma, "x")
    assert ma.peak.measuring
    ma.close()  # its worker closes mid-task; b's keeps the wrapper
    assert not mb.peak.measuring  # (every allocation of the process was wrapped and counted since)
    mb.close()


def inflate(block):
    """Six block-sized temporaries, written: a working set of about eight blocks."""
    temporaries = np.ones((6, *block.shape))
    return block + temporaries.sum(axis=0)


def learned(c, source, timeout=30):
    """The scheduler's working set per byte of block for ``source``, once one arrived."""
    def ratio(dask_scheduler, source=source):
        return dask_scheduler.plugins["octopus"].working_sets.ratio(source)

    deadline = time.monotonic() + timeout
    while (r := c.run_on_scheduler(ratio)) is None:
        assert time.monotonic() < deadline, "no working set reached the scheduler"
        time.sleep(0.05)
    return r


@pytest.mark.skipif(not RssPeak.available(), reason="needs Linux's /proc/self/clear_refs")
def test_the_next_balance_of_an_input_keeps_blocks_within_what_its_working_set_lets_a_worker_process():
    limit, fraction = 2**30, 0.2
    with dask.config.set({"octopus.balance.memory-fraction": fraction}), \
            LocalCluster(n_workers=2, threads_per_worker=1, memory_limit=limit, dashboard_address=":0") as cluster, \
            Client(cluster) as c:
        dask_octopus.register(c, calibration_seconds=0.1)
        x = da.random.default_rng(3).random(16_000_000, chunks=8_000_000)  # two blocks of 64 MB
        expected = x.sum().compute() + 6 * x.size
        first = dask_octopus.balance(x)
        assert max(first.chunks[0]) <= 8_000_000  # no block above the user's own
        assert first.map_blocks(inflate).sum().compute() == pytest.approx(expected, rel=1e-12)
        ratio = learned(c, key_split(x.name))
        assert 4 < ratio < 16  # about eight blocks' worth at the peak, by the process's resident set
        assert max(first.chunks[0]) * 8 * ratio > limit * fraction  # the first plan's largest block does not fit
        second = dask_octopus.balance(x)
        # each block, times the working set, fits the memory share of one worker thread
        assert all(n * 8 * ratio <= limit * fraction for n in second.chunks[0])
        assert len(second.chunks[0]) > len(first.chunks[0])
        assert second.map_blocks(inflate).sum().compute() == pytest.approx(expected, rel=1e-12)
        with pytest.warns(dask_octopus.WorkingSetWarning) as caught:  # shown by Python's default filters
            kept = dask_octopus.balance(x, per_worker=1)  # asked for: kept, with a warning naming the input
        assert len(kept.chunks[0]) == 2 and len(caught) == 1 and caught[0].filename == __file__
        assert f"'{key_split(x.name)}'" in str(caught[0].message) and "per_worker=None" in str(caught[0].message)
        # another input is not sized by this one's working set
        z = da.random.default_rng(4).standard_normal(16_000_000, chunks=8_000_000)
        assert key_split(z.name) != key_split(x.name)
        assert max(dask_octopus.balance(z).chunks[0]) * 8 * ratio > limit * fraction


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_only_tasks_pinned_by_a_balance_plan_are_marked_and_learned(c, s, a, b):
    with dask.config.set({"octopus.refine.min-duration": "1h"}):
        await c.register_plugin(OctopusSchedulerPlugin(calibrate=False))
    plugin = s.plugins["octopus"]
    x = da.ones(4 * MIN_BASIS // 8, chunks=MIN_BASIS // 8)  # four blocks of MIN_BASIS bytes
    y = await dask_octopus.balance(x, client=c, per_worker=2)  # kept, pinned two per worker
    items = await dask_octopus.map(lambda i: i, range(4), client=c)
    one, two = c.persist([y + 1, (y * 2).rechunk(MIN_BASIS // 4)])  # a task per block; merges of two blocks
    await c.gather(items)
    await wait([one, two])
    marked = {k for k, ts in s.tasks.items() if (ts.annotations or {}).get(MEASURE)}
    source = key_split(x.name)
    pinned = {k for k in plugin.placement.pins if plugin.placement.measured_block(k) == (source, MIN_BASIS)}
    merges = {k for k in pinned if len(s.tasks[k].dependencies) == 2}
    assert merges and not merges & marked  # two blocks' work is not measured against one block's bytes
    assert {k for k in one.__dask_keys__()} <= marked <= pinned - merges  # map's items are not pinned by balance
    assert not {k for k in s.tasks if "lambda" in str(k)} & marked
    key = next(iter(one.__dask_keys__()))
    plugin.log_event(working_set.TOPIC, {"worker": a.address, "samples": [(list(key), 4 * MIN_BASIS)]})
    plugin.log_event(working_set.TOPIC, {"worker": a.address, "samples": [("unpinned", 64 * MIN_BASIS)]})
    assert list(plugin.working_sets.ratios) == [source]
    assert plugin.working_sets.ratio(source) == 4.0
    for _ in range(plugin.working_sets.window):  # a full window for the prefix of `one`'s tasks
        plugin.log_event(working_set.TOPIC, {"worker": a.address, "samples": [(list(key), 4 * MIN_BASIS)]})
    again = c.persist(y + 2)  # four tasks of the same kind (prefix "add") once more: the 5th-8th asked
    await wait(again)
    keys = set(again.__dask_keys__())
    assert keys <= set(plugin.placement.pins)  # pinned for the plan, but none marked
    assert not {k for k in keys if (s.tasks[k].annotations or {}).get(MEASURE)}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, worker_kwargs={"memory_limit": "1GiB"})
async def test_a_huge_working_set_never_makes_blocks_smaller_than_those_it_is_learned_from(c, s, a, b):
    await c.register_plugin(OctopusSchedulerPlugin(calibrate=False))
    x = da.ones(8 * MIN_BASIS // 8, chunks=4 * MIN_BASIS // 8)  # two blocks of 4 x MIN_BASIS bytes
    s.plugins["octopus"].working_sets.add(key_split(x.name), "f", MIN_BASIS, 1e6 * MIN_BASIS)
    y = await dask_octopus.balance(x, client=c)
    assert y.chunks[0] == (MIN_BASIS // 8,) * 8  # a block per MIN_BASIS bytes, not one per row


# -- from a mutation run of placement/pins.py and placement/blocks.py ------------------------------------------------


def test_a_task_marked_for_measuring_keeps_the_annotations_it_had():
    """The measure mark is added to a task's annotations, which stay (a worker reads them: executor,
    resources...); a task without annotations gets the mark alone."""
    placement = Placement(measure=lambda source, prefix, nbytes: True)
    kept, bare = task_state(("y", 0), annotations={"executor": "gpu"}), task_state(("y", 1))
    bare.annotations = None  # (as a task of a graph without annotations)
    placement.add_plan("y", ["a", "b"], source="x", nbytes=[8.0, 8.0])
    assert placement.update_graph(Stub(tasks={kept.key: kept, bare.key: bare}), [kept.key, bare.key]) == 2
    assert kept.annotations == {"executor": "gpu", MEASURE: True}
    assert bare.annotations == {MEASURE: True}
    assert kept.worker_restrictions == {"a"} and bare.worker_restrictions == {"b"}


def test_the_working_set_warning_names_the_first_worker_over_even_when_it_is_the_only_one():
    """per_worker blocks over one worker's working-set limit warn about that worker (the first one over),
    whether one or more workers are over."""
    from dask_octopus.placement.blocks import WorkingSetWarning, _warn_over_working_set

    with pytest.warns(WorkingSetWarning, match="on a are larger"):
        _warn_over_working_set(["a", "b"], [[10, 9], [2]], [5, 100], 8.0, "x")
    with pytest.warns(WorkingSetWarning, match="on a are larger"):
        _warn_over_working_set(["a", "b"], [[10], [20]], [5, 5], 8.0, "x")


# -- from a mutation run of profiling/working_set.py -----------------------------------------------------------------


def test_cupy_peak_counts_only_what_a_task_allocates_above_what_was_held_when_it_started(monkeypatch):
    """A task measured while arrays allocated under an earlier measurement are still alive (results the
    worker holds): its working set is its own peak above those bytes, not that peak plus them."""
    monkeypatch.setitem(sys.modules, "cupy", FakeCupy())
    peak = CupyPeak.shared()
    try:
        peak.start()
        held = peak.malloc(200)  # an earlier task's result, still held
        assert peak.extra() == 200
        peak.start()
        assert peak.baseline == 200
        temporary = peak.malloc(100)
        del temporary
        assert peak.extra() == 100
        del held
    finally:
        peak.close()


def test_cupy_peak_hands_back_the_pool_s_own_allocations(monkeypatch):
    """While measuring, the wrapper returns the pool's allocation wrapped (to count it down when freed) at
    the same address and size: CuPy's arrays then live in the memory the pool gave; outside a
    measurement (and for 0 bytes within one) it returns the pool's allocation itself: CuPy allocates
    through the wrapper between measurements too."""
    cp = FakeCupy()
    made = []

    def pool(size):
        made.append(FakeCupy.pool_malloc(size))
        return made[-1]

    cp.cuda.set_allocator(pool)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    peak = CupyPeak.shared()
    try:
        peak.start()
        a = peak.malloc(100)
        assert a.ptr == made[-1].ptr and a.mem.ptr == made[-1].ptr and a.mem.size == 100
        del a
        assert peak.malloc(0) is made[-1]
        peak.extra()  # measuring stops
        assert peak.malloc(1000) is made[-1]
    finally:
        peak.close()


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's /proc/self/clear_refs")
def test_rss_peak_is_available_where_clear_refs_is_writable():
    """The other RssPeak tests skip where it is not available: this one does not ask it."""
    assert RssPeak.available() is True


def test_working_sets_measure_sixteen_tasks_then_one_in_sixteen_as_documented():
    """docs/placement.md: 16 tasks (of an input and prefix) are measured while fewer than 16 peaks are
    in, then one task in 16."""
    sets = WorkingSets()
    assert [sets.wants("x", "f", MIN_BASIS) for _ in range(32)] == [True] * 16 + [False] * 15 + [True]


def test_working_sets_count_each_input_and_prefix_apart_while_many_interleave():
    """The counts of up to ``max_sources * max_prefixes`` inputs and prefixes are kept: tasks of several
    interleaved inputs are each measured one in a window once their first window is asked, not all of
    them because the counts were dropped."""
    sets = WorkingSets(window=2, max_sources=4, max_prefixes=4)
    pairs = [(f"in{i}", "f") for i in range(6)]
    rounds = [[sets.wants(s, p, MIN_BASIS) for s, p in pairs] for _ in range(4)]
    assert rounds == [[True] * 6, [True] * 6, [False] * 6, [True] * 6]
