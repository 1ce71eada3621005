"""Registration, calibration, speeds/profiles, join/leave and bad input (in-process clusters)."""

import asyncio
import contextlib
import io
import logging
import math
import operator
import statistics
import subprocess
import sys
import threading
import time
import warnings

import dask
import dask.array as da
import pytest
from distributed import Client, Worker
from distributed.utils_test import async_poll_for, captured_logger, cluster, gen_cluster

import dask_octopus
from dask_octopus import NotRegisteredError
from dask_octopus.plugins.messages import DONE_SHARE, WorkerInfo
from dask_octopus.plugins.scheduler import ERROR, HISTORY_INTERVAL, NOT_LOADED, OctopusSchedulerPlugin

FAST = {"octopus.calibration.seconds": 0.1}


def numpy_rates(seconds):
    """GEMM FLOP/s (384^2 float32) and streaming bytes/s (sqrt, *2, +1 over 16 MiB) of this thread,
    written out with NumPy and a clock as the CPU probes measure theirs."""
    import time

    import numpy as np

    a = np.random.default_rng(0).random((384, 384), dtype=np.float32)
    x = np.ones(4 * 2**20, dtype=np.float32)
    y = np.empty_like(x)
    rates = []
    for work, step in ((2.0 * 384**3, lambda: a @ a),
                       (6.0 * x.nbytes, lambda: (np.sqrt(x, out=y), y.__imul__(2), y.__iadd__(1)))):
        step()
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            step()
            n += 1
        rates.append(work * n / (time.perf_counter() - start))
    return rates


def plugin(s) -> OctopusSchedulerPlugin:
    return s.plugins["octopus"]


def named_here(caught, text: str) -> None:
    """Assert that the warnings of ``caught`` saying ``text`` (one at least) name a line of this file: the
    caller's, not the package's."""
    said = [w for w in caught if text in str(w.message)]
    assert said and all(w.filename == __file__ for w in said), [(w.filename, w.lineno) for w in said]


@gen_cluster(client=True, config=FAST)
async def test_register_twice_is_harmless(c, s, a, b):
    await c.register_plugin(OctopusSchedulerPlugin())
    first = plugin(s)
    await c.register_plugin(OctopusSchedulerPlugin())
    assert plugin(s) is first
    assert set(first.profiles) == {a.address, b.address}
    assert [n for n in s.plugins if n.startswith("octopus")] == ["octopus"]
    assert [n for n in s.worker_plugins if "octopus" in n] == ["octopus-worker"]
    assert [n for n in a.plugins if "octopus" in n] == ["octopus-worker"]


@gen_cluster(client=True, config=FAST)
async def test_a_plugin_registered_under_another_name_works_and_a_second_one_is_removed(c, s, a, b):
    """Dask lets a plugin be registered under any name: it answers, keeps its handlers (it retired itself,
    not finding itself under its own name), and plans; another one registered beside it, under yet
    another name, is removed (two would both pin and group tasks)."""
    await c.register_plugin(OctopusSchedulerPlugin(calibrate=False), name="octopus-cpu")
    first = s.plugins["octopus-cpu"]
    assert await dask_octopus.speeds(c) == {a.address: 0.5, b.address: 0.5}
    await asyncio.sleep(2 * HISTORY_INTERVAL)  # a weight sample: a plugin not registered retires there
    assert first.registered() and not first._retired and "octopus_speeds" in s.handlers
    assert await dask_octopus.speeds(c) == {a.address: 0.5, b.address: 0.5}
    x = da.ones((40, 4), chunks=10)
    assert await c.compute((await dask_octopus.balance(x, client=c)).sum()) == 160.0
    with pytest.warns(UserWarning, match=r"first call client\.unregister_scheduler_plugin\('octopus-cpu'\)"):
        await dask_octopus.register(c, calibration_seconds=0.5)  # other options: the remedy names it as it is
    with captured_logger("dask_octopus") as log:
        await c.register_plugin(OctopusSchedulerPlugin(calibrate=False), name="octopus-gpu")
        await async_poll_for(lambda: "octopus-gpu" not in s.plugins, timeout=5)
    assert "registered as 'octopus-gpu' is removed" in log.getvalue()
    assert [n for n, p in s.plugins.items() if isinstance(p, OctopusSchedulerPlugin)] == ["octopus-cpu"]
    await dask_octopus.register(c)  # idempotent: it finds the one registered
    assert [n for n, p in s.plugins.items() if isinstance(p, OctopusSchedulerPlugin)] == ["octopus-cpu"]
    assert await dask_octopus.speeds(c) == {a.address: 0.5, b.address: 0.5}


def test_cpu_probes_count_flop_and_bytes_as_numpy_and_a_clock_do():
    from threadpoolctl import threadpool_limits

    from dask_octopus.profiling.probes import run_probes

    # probe and reference alternated five times in one thread, so the same cores and BLAS threads serve
    # both; the median rate of each within a few times of the other's, not a factor of n (FLOP) or of the
    # element size (bytes) off (medians: on a loaded machine one short reference timing came out 5x the others).
    # One BLAS thread: two of them on two cores, one busy with another process, ran a GEMM from 7 to 141
    # GFLOP/s by turns (medians 2.7x apart); one ran 150-167
    probes, references = [], []
    with threadpool_limits(limits=1, user_api="blas"):
        for _ in range(5):
            p = run_probes(0.2, "cpu")
            probes.append((p["compute"], p["memory"]))
            references.append(numpy_rates(0.1))
    for probe, reference in zip(zip(*probes), zip(*references)):
        assert 1 / 3 < statistics.median(probe) / statistics.median(reference) < 3


@gen_cluster(client=True, config=FAST)
async def test_calibration_figures_per_worker(c, s, a, b):
    await c.register_plugin(OctopusSchedulerPlugin())
    for w in (a, b):
        p = plugin(s).profiles[w.address]
        assert p["error"] is None and p["device"] == "cpu" and 0 < p["probe_seconds"] < 2
        # each worker's own figures, as its probes measured them, reach the scheduler under its address
        measured = w.plugins["octopus-worker"].profile
        assert (p["compute"], p["memory"]) == (measured["compute"], measured["memory"])
    assert plugin(s).profiles[a.address]["compute"] != plugin(s).profiles[b.address]["compute"]
    profiles = await c.scheduler.octopus_profiles(resource="memory")
    assert profiles[a.address]["memory_total"] == a.memory_manager.memory_limit
    assert sum(p["weight"] for p in profiles.values()) == pytest.approx(1)


def test_speeds_and_profiles_from_a_sync_client(loop):
    with cluster(nworkers=2, worker_kwargs={"nthreads": 1}) as (s, _), Client(s["address"], loop=loop) as c:
        dask_octopus.register(c, calibration_seconds=0.1)
        for resource in ("compute", "memory"):
            w = dask_octopus.speeds(c, resource)
            assert len(w) == 2 and sum(w.values()) == pytest.approx(1)
            assert all(0 < v < 1 for v in w.values())
        assert set(dask_octopus.profiles(c)) == set(w)


def test_preload_installs_the_plugin_in_a_separate_scheduler_process(loop):
    kwargs = {"preload": ["dask_octopus"]}
    with cluster(nworkers=2, scheduler_kwargs=kwargs, worker_kwargs=kwargs) as (s, _), \
            Client(s["address"], loop=loop) as c:
        w = dask_octopus.speeds(c)  # no register(): the preload did it
        assert len(w) == 2 and sum(w.values()) == pytest.approx(1)
        assert all(p["error"] is None for p in dask_octopus.profiles(c).values())
        dask_octopus.register(c)  # harmless on a preloaded scheduler
        plugins = c.run_on_scheduler(lambda dask_scheduler: [n for n in dask_scheduler.plugins if "octopus" in n])
        assert len(plugins) == 1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config=FAST)
async def test_workers_that_join_are_calibrated_and_those_that_leave_drop_out(c, s, a):
    await c.register_plugin(OctopusSchedulerPlugin())
    async with Worker(s.address, nthreads=1) as b:
        await c.wait_for_workers(2)
        await async_poll_for(lambda: b.address in plugin(s).profiles, timeout=10)  # calibrated on arrival
        assert plugin(s).profiles[b.address]["error"] is None
        assert set(await c.scheduler.octopus_speeds()) == {a.address, b.address}
    while b.address in s.workers:
        await asyncio.sleep(0.01)
    assert set(await c.scheduler.octopus_speeds()) == {a.address}
    assert b.address not in plugin(s).profiles and b.address not in plugin(s).model.priors


def delayed_reports(s, seconds):
    """Make the scheduler store the calibration reports of the workers that join from now on ``seconds``
    late (``None``: never); those of its workers now, still calibrating on a loaded machine past a short
    ``octopus.calibration.wait``, as they come."""
    report = s.handlers["octopus_report"]
    present = set(s.workers)

    async def late(worker, profile):
        if worker in present:
            report(worker=worker, profile=profile)
        elif seconds is not None:
            await asyncio.sleep(seconds)
            report(worker=worker, profile=profile)

    s.handlers["octopus_report"] = late


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config=FAST)
async def test_plans_wait_for_a_worker_that_joined_to_report_its_calibration(c, s, a):
    await dask_octopus.register(c)
    delayed_reports(s, 1.0)
    b = Worker(s.address, nthreads=1)
    starting = asyncio.create_task(b.start())  # (a worker's start awaits its plugins' set-up: its calibration)
    await c.wait_for_workers(2)  # as a client sees a worker join, before it calibrates
    assert b.address not in plugin(s).profiles
    profiles = await dask_octopus.profiles(c)
    assert profiles[b.address]["error"] is None and profiles[b.address]["compute"] > 0
    assert set(await dask_octopus.speeds(c)) == {a.address, b.address}
    await starting
    await b.close()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config={**FAST, "octopus.calibration.wait": "300ms"})
async def test_a_worker_that_never_reports_is_waited_for_once(c, s, a):
    await dask_octopus.register(c)
    delayed_reports(s, None)
    async with Worker(s.address, nthreads=1) as b:
        with captured_logger("dask_octopus.plugins.scheduler") as log:
            # the caller is told too (the scheduler's log may be far away), once
            with pytest.warns(UserWarning, match=rf"^dask_octopus: no calibration report from {b.address} within "
                                                 r"octopus.calibration.wait=0.3s: they get the mean weight") as caught:
                assert (await dask_octopus.profiles(c))[b.address]["error"] == "not calibrated"
            named_here(caught, "no calibration report")
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert (await dask_octopus.profiles(c))[b.address]["error"] == "not calibrated"
        assert log.getvalue().count("no calibration report from") == 1, log.getvalue()
        assert b.address in log.getvalue() and plugin(s).unreported == {b.address}
    await async_poll_for(lambda: b.address not in s.workers, 5)
    assert not plugin(s).unreported


LATE_CALLS = {  # each on a line of its own: the line a warning of the call names
    "speeds": lambda c, x: dask_octopus.speeds(c),
    "profiles": lambda c, x: dask_octopus.profiles(c),
    "balance": lambda c, x: dask_octopus.balance(x, client=c),
    "map": lambda c, x: dask_octopus.map(abs, [1, -2], client=c),
    "imap": lambda c, x: list(dask_octopus.imap(abs, [1, -2], client=c)),
}


def test_the_calls_that_wait_for_a_calibration_warn_naming_the_caller_s_line():
    """A worker that never reports its calibration: each call that gives up waiting for it warns naming the
    line that called it (they named a line of the package, as deep in it as each warned)."""
    from distributed import LocalCluster

    with dask.config.set({**FAST, "octopus.calibration.wait": "300ms"}), \
            LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as c:
        dask_octopus.register(c)
        delayed_reports(cluster.scheduler, None)
        x = da.ones(8, chunks=4)
        for name, call in LATE_CALLS.items():
            joined = len(cluster.scheduler.workers) + 1  # one that joins, never reports and is waited for once
            cluster.scale(joined)
            c.wait_for_workers(joined)
            with pytest.warns(UserWarning, match="no calibration report from") as caught:
                call(c, x)
            lines = [(w.filename, w.lineno) for w in caught if "no calibration report" in str(w.message)]
            assert lines == [(__file__, call.__code__.co_firstlineno)], name


def test_the_command_line_shows_a_warning_as_a_line_of_its_own():
    """``dask-octopus profile`` where a worker never reports its calibration: the warning is the command's
    own line, its class and text (it named the line of click's that called the command, and that line)."""
    from click.testing import CliRunner
    from distributed import LocalCluster

    from dask_octopus.cli import main

    with dask.config.set({**FAST, "octopus.calibration.wait": "300ms"}), \
            LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as c:
        dask_octopus.register(c)
        delayed_reports(cluster.scheduler, None)
        first = set(cluster.scheduler.workers)
        cluster.scale(2)
        c.wait_for_workers(2)
        (late,) = set(cluster.scheduler.workers) - first
        result = CliRunner().invoke(main, ["profile", "--scheduler-address", cluster.scheduler_address])
    assert result.exit_code == 0, result.output
    warned = [line for line in result.stderr.splitlines() if "no calibration report" in line]
    assert len(warned) == 1 and warned[0].startswith(f"UserWarning: dask_octopus: no calibration report from {late} ")
    assert result.stderr.strip() == warned[0]  # nothing else: no file name, no source line


WARNED_AT_A_PROMPT = """\
from distributed import Client, LocalCluster
import dask_octopus
with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster, Client(cluster) as c:
    dask_octopus.register(c, calibrate=False)
    dask_octopus.register(c, calibration_seconds=0.3)
"""


@pytest.mark.parametrize("how", ["-c", "-"])
def test_a_warning_reaches_code_run_by_python_c_or_from_stdin(how):
    """The line of ``__main__`` that ``python -c``, a script on stdin or the interactive prompt runs has no
    source its loader gives: the warning named it and raised ImportError ("'__main__' is not a built-in
    module") where it was asked for that source."""
    args = [sys.executable, "-c", WARNED_AT_A_PROMPT] if how == "-c" else [sys.executable, "-"]
    done = subprocess.run(args, input=WARNED_AT_A_PROMPT if how == "-" else None, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    where = "<string>" if how == "-c" else "<stdin>"
    assert f"{where}:5: UserWarning: dask_octopus is already registered on this scheduler" in done.stderr, done.stderr


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config={**FAST, "octopus.calibration.wait": "300ms"})
async def test_an_asynchronous_imap_warns_naming_the_line_that_called_it(c, s, a):
    """Its plan is made in a thread as the iteration starts, where the caller's line is on no stack."""
    await dask_octopus.register(c)
    delayed_reports(s, None)
    async with Worker(s.address, nthreads=1):
        await c.wait_for_workers(2)
        with pytest.warns(UserWarning, match="no calibration report from") as caught:
            line = sys._getframe().f_lineno + 1
            results = dask_octopus.imap(abs, [1, -2], client=c)
            assert sorted([r async for r in results]) == [(0, 1), (1, 2)]
    lines = [(w.filename, w.lineno) for w in caught if "no calibration report" in str(w.message)]
    assert lines == [(__file__, line)]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config={**FAST, "octopus.calibration.wait": "3s"})
async def test_each_worker_is_waited_for_from_when_it_joined(c, s, a):
    """Two workers that never report, the second joining 0.6 s after the first: a plan waits for each
    until its own wait is over, and names each as that happens. (The wait is long beside a worker's
    start, its calibration included, which ends before the plan is asked for.)"""
    await dask_octopus.register(c)
    delayed_reports(s, None)
    async with Worker(s.address, nthreads=1) as b:
        await asyncio.sleep(0.6)
        async with Worker(s.address, nthreads=1) as d:
            with captured_logger("dask_octopus.plugins.scheduler") as log, \
                    pytest.warns(UserWarning, match=f"no calibration report from {b.address}, {d.address} within"):
                assert set(await dask_octopus.speeds(c)) == {a.address, b.address, d.address}
            lines = [line for line in log.getvalue().splitlines() if "no calibration report from" in line]
            assert len(lines) == 2 and b.address in lines[0] and d.address in lines[1], lines


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config=FAST)
async def test_a_plan_waiting_for_calibrations_answers_once_the_plugin_is_unregistered(c, s, a):
    await dask_octopus.register(c)
    delayed_reports(s, None)
    async with Worker(s.address, nthreads=1):
        waiting = asyncio.ensure_future(dask_octopus.speeds(c))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await c.unregister_scheduler_plugin("octopus")
        await asyncio.wait_for(waiting, 10)  # the next weight sample retires it, not octopus.calibration.wait (30 s)


@gen_cluster(client=True, nthreads=[], config=FAST)
async def test_no_workers(c, s):
    await c.register_plugin(OctopusSchedulerPlugin())
    with captured_logger("distributed", level=logging.ERROR) as log:
        with pytest.raises(ValueError, match="the cluster has no workers"):
            await dask_octopus.speeds(c)
        with pytest.raises(ValueError, match="the cluster has no workers"):
            await dask_octopus.profiles(c)
        with pytest.raises(ValueError, match=r"^the cluster has no workers$"):  # (client.map would queue them)
            await dask_octopus.map(abs, [1, 2], client=c)
    assert log.getvalue() == ""  # a clear error for the caller, no traceback in the scheduler's log


def test_speeds_before_register_and_unknown_resource(loop):
    with cluster(nworkers=1) as (s, _), Client(s["address"], loop=loop) as c:
        with pytest.raises(NotRegisteredError, match=r"dask_octopus.register\(client\)"):
            dask_octopus.speeds(c)
        with pytest.raises(ValueError, match="unknown resource 'gpu'"):
            dask_octopus.speeds(c, "gpu")
        with pytest.raises(TypeError, match="unknown register options"):
            dask_octopus.register(c, calibrate_seconds=1)
        with pytest.raises(TypeError, match="calibrate must be True or False, got 'no'"):
            dask_octopus.register(c, calibrate="no")
        message = r"^calibration_seconds \(as octopus\.calibration\.seconds\) must be a number > 0, got 0$"
        with pytest.raises(ValueError, match=message):
            dask_octopus.register(c, calibration_seconds=0)
        with pytest.raises(ValueError, match=r"^device \(as octopus\.calibration\.device\) must be one of auto"):
            dask_octopus.register(c, device="tpu")
        assert not c.run_on_scheduler(lambda dask_scheduler: "octopus" in dask_scheduler.plugins)


@gen_cluster(client=True, config=FAST)
async def test_probe_failure_on_one_worker_is_reported_and_others_unaffected(c, s, a, b, monkeypatch):
    from dask_octopus.plugins import worker as worker_plugin
    from dask_octopus.profiling import probes

    calls = []

    def flaky(seconds, device, stop):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("no device here")
        return probes.run_probes(seconds, device, stop)

    monkeypatch.setattr(worker_plugin, "run_probes", flaky)
    with captured_logger("dask_octopus.plugins.scheduler", level=logging.WARNING) as log:
        await c.register_plugin(OctopusSchedulerPlugin())
    errors = {w: p["error"] for w, p in plugin(s).profiles.items()}
    failed = [w for w, e in errors.items() if e]
    assert len(failed) == 1 and "RuntimeError: no device here" in errors[failed[0]]
    assert "has no calibration" in log.getvalue() and failed[0] in log.getvalue()
    ok = ({a.address, b.address} - set(failed)).pop()
    assert plugin(s).profiles[ok]["compute"] > 0
    w = await c.scheduler.octopus_speeds()
    assert w[failed[0]] == pytest.approx(0.5)  # the mean weight until timings refine it


@gen_cluster(client=True, config=FAST)
async def test_register_warns_naming_the_workers_whose_calibration_failed(c, s, a, b, monkeypatch):
    """The caller is told, not only the scheduler's log (``register(device="gpu")`` where the workers
    have no CuPy, say: register returned as if all was well)."""
    from dask_octopus.plugins import worker as worker_plugin

    def without_cupy(seconds, device, stop):
        raise ModuleNotFoundError("No module named 'cupy'")

    monkeypatch.setattr(worker_plugin, "run_probes", without_cupy)
    first, second = sorted([a.address, b.address])
    message = (rf"^dask_octopus: calibration failed on {first}, {second} \(ModuleNotFoundError: No module named "
               r"'cupy'\): they get the mean weight until their task timings set it \(dask_octopus.profiles\(\) "
               r"shows each error\)$")
    with pytest.warns(UserWarning, match=message) as caught:
        await dask_octopus.register(c, device="gpu")
    named_here(caught, "calibration failed")
    assert await c.scheduler.octopus_speeds() == {first: pytest.approx(0.5), second: pytest.approx(0.5)}


@gen_cluster(client=True, config=FAST)
async def test_invalid_calibration_figures_are_excluded_with_a_warning(c, s, a, b):
    await c.register_plugin(OctopusSchedulerPlugin())
    with captured_logger("dask_octopus.plugins.scheduler", level=logging.WARNING) as log:
        plugin(s).report(worker=a.address, profile={"error": None, "compute": math.nan, "memory": 1.0})
    assert "ignoring calibration" in log.getvalue()
    assert "invalid calibration" in plugin(s).profiles[a.address]["error"]


@pytest.mark.parametrize("start, stop", [(1.0, 1.0), (2.0, 1.0), (math.nan, 1.0), (0.0, math.inf)])
@pytest.mark.parametrize("path", ["task stream", "GPU events"])
@gen_cluster(client=True, config=FAST)
async def test_each_kind_of_bad_task_timing_alone_is_ignored_with_a_warning(c, s, a, b, start, stop, path):
    from dask_octopus.profiling.gpu_timing import TOPIC

    await c.register_plugin(OctopusSchedulerPlugin())
    p = plugin(s)
    await c.submit(sum, [1, 2], key="t")
    before = {k: dict(v) for k, v in p.model.rates.items()}
    with captured_logger("dask_octopus.plugins.scheduler", level=logging.WARNING) as log:
        if path == "task stream":
            p.transition("t", "processing", "memory", worker=a.address, stimulus_id="x",
                         startstops=[{"action": "compute", "start": start, "stop": stop}])
        else:
            s.log_event(TOPIC, {"worker": a.address, "timings": [("t", "sum", 16, stop - start)]})
    assert log.getvalue().count("ignoring task timings") == 1, log.getvalue()
    assert {k: dict(v) for k, v in p.model.rates.items()} == before
    assert not p.failed_hooks


@gen_cluster(client=True, config=FAST)
async def test_a_task_that_computed_nothing_is_no_bad_timing(c, s, a, b):
    """A task finished with no compute interval (nothing ran) teaches nothing, without the one warning its
    worker gets for bad timings."""
    await c.register_plugin(OctopusSchedulerPlugin())
    p = plugin(s)
    await c.submit(sum, [1, 2], key="t")
    before = {k: dict(v) for k, v in p.model.rates.items()}
    with captured_logger("dask_octopus.plugins.scheduler", level=logging.WARNING) as log:
        p.transition("t", "processing", "memory", worker=a.address, stimulus_id="x",
                     startstops=[{"action": "transfer", "start": 0.0, "stop": 1.0, "source": b.address}])
    assert log.getvalue() == "" and a.address not in p.bad_timings
    assert {k: dict(v) for k, v in p.model.rates.items()} == before


@gen_cluster(client=True, config=FAST)
async def test_bad_task_timings_are_ignored_and_warned_once(c, s, a, b):
    await c.register_plugin(OctopusSchedulerPlugin())
    p = plugin(s)
    fut = c.submit(sum, [1, 2], key="t")
    await fut
    before = dict(p.model.rates)
    with captured_logger("dask_octopus.plugins.scheduler", level=logging.WARNING) as log:
        for start, stop in [(1.0, 1.0), (2.0, 1.0), (math.nan, 1.0), (0.0, math.inf)]:
            p.transition("t", "processing", "memory", worker=a.address, stimulus_id="x",
                         startstops=[{"action": "compute", "start": start, "stop": stop}])
    assert log.getvalue().count("ignoring task timings") == 1
    assert dict(p.model.rates) == before
    assert not p.failed_hooks


@gen_cluster(client=True, config=FAST)
async def test_gpu_event_timings_replace_launch_timings(c, s, a, b):
    from dask_octopus.profiling.gpu_timing import TOPIC

    await c.register_plugin(OctopusSchedulerPlugin())
    p = plugin(s)
    for w in (a, b):
        p.profiles[w.address]["event_timing"] = True
    for _ in range(3):  # a twice as slow as b on the same prefix and units
        s.log_event(TOPIC, {"worker": a.address, "timings": [(["gemm-1", 0], "gemm", 1000, 0.2)]})
        s.log_event(TOPIC, {"worker": b.address, "timings": [(["gemm-2", 0], "gemm", 1000, 0.1)]})
    fut = c.submit(sum, [1, 2], key="t", workers=[a.address])
    await fut
    p.transition("t", "processing", "memory", worker=a.address, stimulus_id="x",  # a launch timing: ignored
                 startstops=[{"action": "compute", "start": 0.0, "stop": 1.0}])
    w = await c.scheduler.octopus_speeds()
    assert w[a.address] == pytest.approx(1 / 3, rel=0.01)
    assert set(p.model.rates) == {"gemm"}
    s.log_event(TOPIC, {"worker": a.address, "timings": [("k", "gemm", 1000, math.nan)]})
    assert a.address in p.bad_timings and not p.failed_hooks


@gen_cluster(client=True, config=FAST)
async def test_a_worker_s_task_timings_count_once_it_reported_its_calibration(c, s, a, b):
    await c.register_plugin(OctopusSchedulerPlugin(calibrate=False))
    p = plugin(s)
    profile = p.profiles.pop(a.address)  # a GPU worker still calibrating: its CuPy tasks end at launch
    futures = [c.submit(sum, [1, 2], key=f"launched-{k}", workers=[a.address]) for k in range(3)]
    await c.gather(futures)  # (held: the scheduler keeps their tasks)
    for k in range(3):
        p.transition(f"launched-{k}", "processing", "memory", worker=a.address, stimulus_id="x",
                     startstops=[{"action": "compute", "start": 0.0, "stop": 0.01}])
    assert a.address not in p.model.table().get("launched", {})
    p.profiles[a.address] = profile  # reported (without CUDA-event timings): its tasks' wall times count
    p.transition("launched-0", "processing", "memory", worker=a.address, stimulus_id="x",
                 startstops=[{"action": "compute", "start": 0.0, "stop": 1.0}])
    assert p.model.table()["launched"][a.address][2] == 1


@gen_cluster(client=True, config=FAST)
async def test_a_task_whose_work_partly_failed_counts_for_the_share_done(c, s, a, b):
    """A map batch with half its items failed counts half its planned cost in its time; one whose items all
    failed, nothing (nor does either teach a result size)."""
    await c.register_plugin(OctopusSchedulerPlugin(calibrate=False))
    p = plugin(s)
    name = f"f-octopus-map-{'2' * 32}"
    await c.scheduler.octopus_add_plan(name=name, workers=[a.address, b.address], costs=[10, 10], counts=[4, 4],
                                       nbytes=[100, 100])
    futures = [c.submit(sum, [1, 2], key=(name, i), workers=[w]) for i, w in enumerate([a.address, b.address])]
    await c.gather(futures)
    p.model.rates.clear()
    p.short_tasks.shares.clear()  # (their real timings, too short: the prefix would not count yet)
    p.result_sizes.clear()  # (of those tasks, which ran whole)
    for (i, w), share in zip(enumerate([a.address, b.address]), [0.5, 0.0]):
        p.transition((name, i), "processing", "memory", worker=w, stimulus_id="x", metadata={DONE_SHARE: share},
                     nbytes=1000, startstops=[{"action": "compute", "start": 0.0, "stop": 1.0}])
    rates = p.model.table()["f-octopus-map"]
    assert set(rates) == {a.address} and rates[a.address][0] == pytest.approx(5.0)  # 10 * 0.5 in 1 s
    assert not p.result_sizes.get("f-octopus-map")


@gen_cluster(client=True, config=FAST)
async def test_a_gpu_worker_without_event_timings_keeps_its_calibrated_speed(c, s, a, b):
    """A GPU worker of several threads times no task with CUDA events: its tasks' durations end at launch
    (but a worker registered as a GPU one without CuPy runs its tasks on the host: they count)."""
    await c.register_plugin(OctopusSchedulerPlugin(calibrate=False))
    p = plugin(s)
    p.profiles[a.address].update(device="gpu", event_timing=False, ends_at_launch=True)
    p.profiles[b.address].update(device="gpu", event_timing=False, ends_at_launch=False)
    futures = [c.submit(sum, [1, 2], key=f"launched-{k}", workers=[w.address]) for k in range(3) for w in (a, b)]
    await c.gather(futures)
    for k in range(3):
        for w in (a, b):
            p.transition(f"launched-{k}", "processing", "memory", worker=w.address, stimulus_id="x",
                         startstops=[{"action": "compute", "start": 0.0, "stop": 0.01}])
    assert set(p.model.table()["launched"]) == {b.address}  # the host's wall times count


@gen_cluster(client=True, config=FAST)
async def test_planned_costs_replace_bytes_as_work_units(c, s, a, b):
    from dask_octopus.profiling.gpu_timing import TOPIC

    await c.register_plugin(OctopusSchedulerPlugin())
    await c.scheduler.octopus_add_plan(name="octopus-map-f-abc", workers=[a.address, b.address], costs=[10, 20])
    s.log_event(TOPIC, {"worker": b.address, "timings": [(["octopus-map-f-abc", 1], "octopus-map-f", 999, 2.0)]})
    s.log_event(TOPIC, {"worker": b.address, "timings": [(["other", 1], "other", 999, 2.0)]})
    # a map's task whose plan is gone (dropped, or retired before its late timing): no bytes among its costs
    gone = [f"f-octopus-map-{'1' * 32}", 0]
    s.log_event(TOPIC, {"worker": b.address, "timings": [(gone, "f-octopus-map", 999, 2.0)]})
    rates = plugin(s).model.table()
    assert "f-octopus-map" not in rates
    assert rates["octopus-map-f"][b.address][0] == pytest.approx(10.0)  # cost 20 in 2 s
    assert rates["other"][b.address][0] == pytest.approx(499.5)  # not planned: bytes
    # costs of any scale (megapixels, seconds): 0.05 in 0.5 s is 0.1 a second, not 1 unit in 0.5 s; a
    # batch of cost 0 has no rate (its items still count for the fits)
    await c.scheduler.octopus_add_plan(name="octopus-map-g-abc", workers=[a.address, b.address], costs=[0.05, 0.0],
                                       counts=[1, 2])
    s.log_event(TOPIC, {"worker": a.address, "timings": [(["octopus-map-g-abc", 0], "octopus-map-g", 999, 0.5)]})
    s.log_event(TOPIC, {"worker": b.address, "timings": [(["octopus-map-g-abc", 1], "octopus-map-g", 999, 0.5)]})
    rates = plugin(s).model.table()
    assert rates["octopus-map-g"] == {a.address: (pytest.approx(0.1), 0.5, 1)}
    assert list(plugin(s).item_costs["octopus-map-g"][b.address].points) == [(0.0, 0.25)]


@gen_cluster(client=True, config=FAST)
async def test_map_batch_timings_fit_each_worker_s_seconds_per_item(c, s, a, b):
    from dask_octopus.profiling.gpu_timing import TOPIC

    await c.register_plugin(OctopusSchedulerPlugin())
    shapes = [(1, 10.0), (4, 100.0), (2, 2000.0)]  # (items, total cost) of three batches on b
    await c.scheduler.octopus_add_plan(name="octopus-map-f-abc", workers=[b.address] * 3,
                                       costs=[cost for _, cost in shapes], counts=[n for n, _ in shapes])
    timings = [(["octopus-map-f-abc", i], "octopus-map-f", 999, n * 0.01 + cost * 0.001)
               for i, (n, cost) in enumerate(shapes)]
    s.log_event(TOPIC, {"worker": b.address, "timings": timings})
    info = {w: WorkerInfo.of(v) for w, v in (await c.scheduler.octopus_workers(prefix="octopus-map-f")).items()}
    assert info[a.address].fit is None  # never ran a batch
    assert info[b.address].fit == pytest.approx((0.01, 0.001))
    assert info[a.address].rate is None and info[b.address].rate > 0  # the prefix's observed units per second
    # bad plans are refused with a ValueError's message (the client raises it again)
    reply = await c.scheduler.octopus_add_plan(name="x", workers=[b.address] * 3, costs=[1, 1, 1], counts=[1, 1])
    assert "2 counts for 3 blocks" in reply[ERROR]
    reply = await c.scheduler.octopus_add_plan(name="x", workers=[b.address], counts=[1])
    assert "counts without costs" in reply[ERROR]
    reply = await c.scheduler.octopus_add_plan(name="x", workers=[b.address], axis=-1)
    assert "plan x axis must be a non-negative int" in reply[ERROR] and "-1" in reply[ERROR]
    reply = await c.scheduler.octopus_add_plan(name="x", workers=[b.address], axis="0")
    assert "plan x axis must be a non-negative int" in reply[ERROR]
    reply = await c.scheduler.octopus_add_plan(name="x", workers=[])
    assert "plan x must name a worker address" in reply[ERROR]
    reply = await c.scheduler.octopus_add_plan(name="x", workers=b.address)
    assert "plan x must name a worker address" in reply[ERROR]
    reply = await c.scheduler.octopus_add_plan(name=("x", 0), workers=[b.address])
    assert "plan name must be a collection's key name" in reply[ERROR]
    assert "x" not in plugin(s).placement.plans
    # a worker that left while the client planned: its blocks go to the others
    await c.scheduler.octopus_add_plan(name="y", workers=["tcp://127.0.0.1:1", b.address, "tcp://127.0.0.1:1"])
    assert plugin(s).placement.plans["y"].workers[1] == b.address
    assert set(plugin(s).placement.plans["y"].workers) <= {a.address, b.address}
    await c.scheduler.retire_workers(workers=[b.address])
    assert "octopus-map-f" not in plugin(s).item_costs  # b's fits gone, and the prefix that had only them


def test_per_prefix_item_figures_keep_the_prefixes_that_ran_last():
    import dask

    from dask_octopus.plugins.scheduler import OctopusSchedulerPlugin

    with dask.config.set({"octopus.refine.max-prefixes": 2}):
        plugin = OctopusSchedulerPlugin(calibrate=False)
    for prefix in ("f", "g", "f", "h"):  # job names of their own: a prefix each, without end
        plugin.item_costs.use(prefix)["w"].add(1, 1.0, 0.1)
        plugin.result_sizes.use(prefix).append(1.0)
    assert list(plugin.item_costs) == list(plugin.result_sizes) == ["f", "h"]  # g, used least recently, dropped
    assert len(plugin.item_costs["f"]["w"].points) == 2


def test_settings_fall_back_to_the_package_defaults_when_the_config_lacks_them(monkeypatch):
    import dask

    from dask_octopus import config

    monkeypatch.setattr(dask.config, "config", {})  # as Dask's test utilities do in some tests
    assert config.get("calibration.seconds") == 0.6 and config.get("streams.max-graphs") == 64
    with dask.config.set({"octopus.streams.max-graphs": 3}):
        assert config.get("streams.max-graphs") == 3
    OctopusSchedulerPlugin(calibrate=False)  # reads its settings without a KeyError


@gen_cluster(client=True, config=FAST)
async def test_an_asynchronous_client_awaits_every_call(c, s, a, b):
    import numpy as np

    with pytest.raises(NotRegisteredError):
        await dask_octopus.speeds(c)
    assert await dask_octopus.register(c, calibrate=False) is None
    assert "octopus" in s.plugins
    weights = await dask_octopus.speeds(c, "memory")
    assert set(weights) == {a.address, b.address} and math.isclose(sum(weights.values()), 1.0)
    assert set(await dask_octopus.profiles(c)) == {a.address, b.address}
    futs = await dask_octopus.map(np.sum, [np.ones(n) for n in (3, 5, 7)], client=c)
    assert await c.gather(futs) == [3.0, 5.0, 7.0]
    import dask.array as da

    x = da.arange(40.0, chunks=10)
    y = await dask_octopus.balance(x, client=c)
    assert await c.compute(y.sum()) == float(np.arange(40.0).sum())
    assert y.name in plugin(s).placement.plans


@pytest.mark.skipif(__import__("importlib").util.find_spec("cupy") is not None, reason="a machine without CuPy")
@gen_cluster(client=True, config={**FAST, "octopus.calibration.wait": "20s"})
async def test_uncalibrated_gpu_workers_without_cupy_report_at_once_as_gpu_workers(c, s, a, b):
    with captured_logger("distributed.worker", level=logging.ERROR) as log:
        await dask_octopus.register(c, calibrate=False, device="gpu")
        profiles = await asyncio.wait_for(dask_octopus.profiles(c), 5)  # not waiting for a failed set-up
    assert "failed to setup" not in log.getvalue()
    for p in profiles.values():
        assert p["device"] == "gpu" and p["error"] is None and p["calibrated"] is False
        assert p["event_timing"] is False  # no CUDA events to time tasks with


@gen_cluster(client=True, config=FAST)
async def test_registering_again_with_other_options_says_it_changes_nothing(c, s, a, b):
    await dask_octopus.register(c, calibrate=False)
    with pytest.warns(UserWarning, match=r"already registered .* changes nothing.*unregister_scheduler_plugin") \
            as caught:
        await dask_octopus.register(c, calibration_seconds=0.2)
    named_here(caught, "changes nothing")
    assert plugin(s).worker_plugin.calibrate is False  # the first registration stands
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        await dask_octopus.register(c, calibrate=False)  # the same options: silent


@gen_cluster(client=True, config=FAST)
async def test_registering_again_after_unregistering_calibrates_the_workers_anew(c, s, a, b):
    await dask_octopus.register(c, calibrate=False)
    first = plugin(s)
    assert [p["calibrated"] for p in first.profiles.values()] == [False, False]
    await c.unregister_scheduler_plugin("octopus")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        await dask_octopus.register(c, calibration_seconds=0.05)  # other options: taken, no warning
    assert plugin(s) is not first and a.plugins["octopus-worker"].seconds == 0.05
    profiles = plugin(s).profiles
    assert set(profiles) == {a.address, b.address}
    assert all(p.get("calibrated") is not False and p["compute"] > 0 for p in profiles.values()), profiles
    await async_poll_for(lambda: first._sampler is None, 5)  # the first noticed, at its next weight sample
    assert all(s.handlers[name] is handler for name, handler in plugin(s)._handlers.items())  # the new one's kept


def reduce_replicas(s):
    """The replica-reducing policies of the scheduler's active memory manager, each with the plugin
    whose homes it keeps (``None``: Dask's own)."""
    return sorted(((type(p).__name__, getattr(p, "home", None)) for p in s.extensions["amm"].policies), key=str)


@gen_cluster(client=True, config=FAST)
async def test_the_memory_manager_keeps_homes_while_a_plugin_is_registered(c, s, a, b):
    assert reduce_replicas(s) == [("ReduceReplicas", None)]
    await dask_octopus.register(c, calibrate=False)
    first = plugin(s)
    await dask_octopus.register(c, calibrate=False)  # idempotent: the same plugin, one policy
    assert reduce_replicas(s) == [("ReduceReplicasOffHome", first.placement.home)]
    await c.unregister_scheduler_plugin("octopus")
    await dask_octopus.register(c, calibrate=False)  # before the first noticed its unregistration
    second = plugin(s)
    await async_poll_for(lambda: first._sampler is None, 5)
    assert reduce_replicas(s) == [("ReduceReplicasOffHome", second.placement.home)]  # the first took only its own
    await c.unregister_scheduler_plugin("octopus")
    await async_poll_for(lambda: second._sampler is None, 5)
    assert reduce_replicas(s) == [("ReduceReplicas", None)]


@gen_cluster(client=True, config={**FAST, "distributed.scheduler.active-memory-manager.policies": []})
async def test_a_memory_manager_configured_without_reduce_replicas_gets_none(c, s, a, b):
    await dask_octopus.register(c, calibrate=False)
    assert reduce_replicas(s) == []


@gen_cluster(client=True, config=FAST)
async def test_a_plugin_registered_over_another_without_idempotence_starts_and_serves(c, s, a, b):
    """Dask installs a plugin registered with ``idempotent=False`` in place of the one there, without
    starting it if its start() returned early: it had no handlers, and speeds, balance and map failed."""
    from distributed.protocol.pickle import dumps

    await c.register_plugin(OctopusSchedulerPlugin(calibrate=False))
    first = plugin(s)
    with pytest.warns(UserWarning, match="already contains a plugin with name octopus; overwriting"):  # Dask's
        await c.scheduler.register_scheduler_plugin(plugin=dumps(OctopusSchedulerPlugin(calibrate=False)),
                                                    name="octopus", idempotent=False)
    second = plugin(s)
    assert second is not first
    await async_poll_for(lambda: second.scheduler is s and second._sampler is not None, timeout=10)
    await async_poll_for(lambda: first._retired, timeout=5)  # at its next weight sample
    assert all(s.handlers[name] is handler for name, handler in second._handlers.items())
    assert set(await c.scheduler.octopus_speeds()) == {a.address, b.address}


def test_a_plugin_unregistered_just_before_its_scheduler_closes_is_retired():
    """Dask closes only the plugins registered when the scheduler closes, and stops the sampler that notices
    an unregistered one: such a plugin kept its filter on the process's scheduler log and its metrics,
    and with them itself and its scheduler, for the life of the process."""
    from dask_octopus.dashboard import serve

    kept = []

    @gen_cluster(client=True, config=FAST)
    async def run(c, s, a, b):
        await c.register_plugin(OctopusSchedulerPlugin(calibrate=False))
        kept.append(plugin(s))
        await c.unregister_scheduler_plugin("octopus")  # (its next weight sample is 1 s away)

    run()
    (p,) = kept
    assert p._retired and p._log_filter is None and p not in serve._exported
    assert not [f for f in logging.getLogger("distributed.scheduler").filters
                if getattr(f, "_scheduler", lambda: None)() is p.scheduler]


@gen_cluster(client=True, config={"octopus.calibration.seconds": 0.5})
async def test_a_worker_leaving_while_the_workers_calibrate_does_not_fail_register(c, s, a, b):
    registering = asyncio.ensure_future(dask_octopus.register(c))
    await async_poll_for(lambda: "octopus-worker" in b.plugins, 5)  # its probes run for 0.5 s
    await b.close()
    await registering
    assert list(plugin(s).profiles) == [a.address] and plugin(s).profiles[a.address]["compute"] > 0


@gen_cluster(client=True, config={"octopus.calibration.seconds": 0.5,
                                  "distributed.worker.memory.pause": False})  # (its monitor would unpause it)
async def test_a_worker_paused_while_the_workers_calibrate_is_held(c, s, a, b):
    from distributed.core import Status

    registering = asyncio.ensure_future(dask_octopus.register(c))
    await async_poll_for(lambda: "octopus-worker" in a.plugins, 5)  # its probes run for 0.5 s
    a.status = Status.paused
    await async_poll_for(lambda: s.workers[a.address].status == Status.paused, 5)
    await registering
    assert plugin(s).placement.held == {a.address}  # its pins loose, as for a worker paused later


@gen_cluster(client=True, config=FAST)
async def test_two_registrations_at_once_leave_one_working_plugin(c, s, a, b):
    await asyncio.gather(dask_octopus.register(c), dask_octopus.register(c))
    registered = plugin(s)
    await asyncio.sleep(1.2 * HISTORY_INTERVAL)  # a dropped duplicate's weight sample would run meanwhile
    assert set(registered.profiles) == {a.address, b.address}
    assert all(s.handlers[name] is handler for name, handler in registered._handlers.items())
    assert set(await dask_octopus.speeds(c)) == {a.address, b.address}


@gen_cluster(client=True, config=FAST)
async def test_of_two_registrations_at_once_with_other_options_the_one_dropped_is_warned(c, s, a, b):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        await asyncio.gather(dask_octopus.register(c, calibration_seconds=0.1),
                             dask_octopus.register(c, calibration_seconds=0.2))
    other = {0.1: 0.2, 0.2: 0.1}[plugin(s).options()["calibration_seconds"]]  # the options of the one dropped
    dropped = [str(w.message) for w in caught if "changes nothing" in str(w.message)]
    assert len(dropped) == 1 and f"'calibration_seconds': {other}" in dropped[0].split("register() with")[1]


@gen_cluster(client=True, config=FAST)
async def test_a_worker_joining_after_unregistering_reports_to_no_one_quietly(c, s, a, b):
    await dask_octopus.register(c, calibrate=False)
    first = plugin(s)
    await c.unregister_scheduler_plugin("octopus")
    await async_poll_for(lambda: first._sampler is None, 5)  # retired
    with captured_logger("distributed.core") as log:
        async with Worker(s.address, nthreads=1) as w:
            await async_poll_for(lambda: "octopus-worker" in w.plugins, 5)  # Dask keeps the worker plugin
            await asyncio.sleep(0.2)
    assert "No handler" not in log.getvalue()


@gen_cluster(client=True, config=FAST)
async def test_a_failed_start_leaves_no_handler(c, s, a, b, monkeypatch):
    async def fails(*args):
        raise RuntimeError("the workers could not be reached")

    monkeypatch.setattr("dask_octopus.plugins.scheduler.add_worker_plugin", fails)
    with pytest.raises(RuntimeError, match="could not be reached"):
        await dask_octopus.register(c)
    assert "octopus" not in s.plugins and "octopus_speeds" not in s.handlers


@gen_cluster(client=True, config=FAST)
async def test_a_worker_that_calibrated_and_left_before_register_returned_is_forgotten(c, s, a, b, monkeypatch):
    from dask_octopus.plugins import scheduler as plugin_module

    async def then_b_leaves(*args):
        failed = await add_worker_plugin(*args)  # both calibrated and reported
        await b.close()
        return failed

    add_worker_plugin = plugin_module.add_worker_plugin
    monkeypatch.setattr(plugin_module, "add_worker_plugin", then_b_leaves)
    await dask_octopus.register(c)
    assert list(plugin(s).profiles) == [a.address] and b.address not in plugin(s).model.priors


@gen_cluster(client=True, config=FAST)
async def test_register_sets_the_worker_plugin_up_again_where_it_alone_was_unregistered(c, s, a, b):
    await dask_octopus.register(c, calibrate=False)
    await c.unregister_worker_plugin("octopus-worker")
    assert "octopus-worker" not in a.plugins
    await dask_octopus.register(c, calibrate=False)
    assert "octopus-worker" in s.worker_plugins and "octopus-worker" in a.plugins and "octopus-worker" in b.plugins


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config={**FAST, "octopus.calibration.wait": "1h"})
async def test_a_worker_joining_after_the_worker_plugin_alone_was_unregistered_is_not_waited_for(c, s, a):
    """No worker plugin registered, a worker that joins never calibrates: the calls do not wait for its
    report (for ``octopus.calibration.wait``), they say why, and give it the mean weight; ``register``
    sets the worker plugin up again, and the worker calibrates."""
    await dask_octopus.register(c)
    await c.unregister_worker_plugin("octopus-worker")
    async with Worker(s.address, nthreads=1) as b:
        with captured_logger("dask_octopus.plugins.scheduler") as log:
            weights = await asyncio.wait_for(dask_octopus.speeds(c), 30)
        assert weights == {a.address: 0.5, b.address: 0.5}
        assert f"['{b.address}'] will not report a calibration: the worker plugin 'octopus-worker' was " \
               "unregistered (call register to set it up again)" in log.getvalue(), log.getvalue()
        await dask_octopus.register(c)
        assert plugin(s).profiles[b.address]["compute"] > 0 and plugin(s).profiles[b.address]["error"] is None


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config=FAST)
async def test_an_unregistered_plugin_is_freed_once_its_handlers_are_withdrawn(c, s, a):
    """Distributed keeps every RPC handler it called for good: a plugin unregistered, whose handlers had
    answered calls, was kept alive with its records (one more per unregistering)."""
    import gc
    import weakref

    await dask_octopus.register(c, calibrate=False)
    await dask_octopus.speeds(c)
    await dask_octopus.profiles(c)
    first = weakref.ref(plugin(s))
    await c.unregister_scheduler_plugin("octopus")
    await async_poll_for(lambda: "octopus_speeds" not in s.handlers, 5)  # at its next weight sample
    await dask_octopus.register(c, calibrate=False)
    assert await dask_octopus.speeds(c) == {a.address: 1.0}
    gc.collect()
    assert first() is None, [type(r) for r in gc.get_referrers(first())]


def test_the_worker_plugin_is_held_for_joining_workers_before_the_others_are_set_up():
    """The scheduler holds the worker plugin as soon as the plugin starts setting it up: a call that
    comes before the workers there are set up does not take it for unregistered (and give workers that
    joined meanwhile the mean weight)."""
    from types import SimpleNamespace

    from dask_octopus._compat import add_worker_plugin

    scheduler = SimpleNamespace(worker_plugins={})
    setting_up = add_worker_plugin(scheduler, b"plugin", "octopus-worker")
    assert scheduler.worker_plugins == {"octopus-worker": b"plugin"}
    setting_up.close()


@gen_cluster(client=True, config=FAST)
async def test_an_unregistered_plugin_drops_its_handlers_and_metrics(c, s, a, b):
    from dask_octopus.dashboard import serve

    await dask_octopus.register(c, calibrate=False)
    first = plugin(s)
    await c.unregister_scheduler_plugin("octopus")
    await async_poll_for(lambda: "octopus_speeds" not in s.handlers, 5)  # at its next weight sample
    assert first not in serve._exported and first._sampler is None


@gen_cluster(client=True, config=FAST)
async def test_a_failing_weight_sample_stops_the_history_not_the_watch_for_unregistering(c, s, a, b):
    await dask_octopus.register(c, calibrate=False)
    first = plugin(s)

    def broken(*args, **kwargs):
        raise RuntimeError("broken speeds")

    first.speeds = broken
    with captured_logger("dask_octopus.plugins.scheduler") as log:
        await async_poll_for(lambda: first.history_failed, 5)
        await c.unregister_scheduler_plugin("octopus")
        await async_poll_for(lambda: "octopus_speeds" not in s.handlers, 5)  # still noticed
    assert log.getvalue().count("weight history stops") == 1


@gen_cluster(client=True, config=FAST)
async def test_weights_that_take_long_to_work_out_are_sampled_less_often(c, s, a, b):
    from dask_octopus.dashboard import snapshot

    await dask_octopus.register(c, calibrate=False)
    sampler = plugin(s)
    asked = []

    def slow_speeds(resource="compute"):  # as 64 workers x 1000 prefixes take: 0.05 s each
        asked.append(resource)
        time.sleep(0.05)
        return dict.fromkeys(s.workers, 0.5)

    sampler.speeds, sampler._resample_at = slow_speeds, 0.0
    for _ in range(5):  # the work goes on: new timings every second, the page polled, /metrics scraped
        sampler.model.clock += 1
        sampler._sample_weights()
        assert snapshot.take(sampler).workers[0].weight_compute == 0.5
    assert asked == ["compute", "memory"]  # then not again for 100x the 0.1 s (2% of the scheduler's time)
    sampler._resample_at = 0.0
    sampler.model.clock += 1
    sampler._sample_weights()
    assert asked == ["compute", "memory"] * 2


@gen_cluster(client=True, config=FAST)
async def test_a_bad_calibration_report_is_ignored(c, s, a, b):
    await dask_octopus.register(c, calibrate=False)
    with captured_logger("dask_octopus.plugins.scheduler") as log:
        await c.scheduler.octopus_report(worker=a.address, profile=None)
    assert "not a mapping" in log.getvalue()
    assert set(await dask_octopus.profiles(c)) == {a.address, b.address}  # still answers


@pytest.mark.parametrize("field, value, why", [
    ("compute", True, "compute must be int or float, got True"),
    ("memory_total", 2.5, "memory_total must be int, got 2.5"),
    ("error", 7, "error must be str or NoneType, got 7"),
    ("calibrated", 1, "calibrated must be bool, got 1"),
    ("device", None, "device must be str, got None"),
    ("compute", 3, None), ("memory_total", 2**40, None), ("error", None, None), ("calibrated", False, None),
    ("working_set", "anything", None),  # (not a reported field)
])
def test_a_report_s_fields_of_other_types_are_named(field, value, why):
    from dask_octopus.plugins.messages import malformed

    assert malformed({"device": "cpu", "compute": 1e9, field: value}) == why


@gen_cluster(client=True, config={**FAST, "octopus.refine.min-duration": "1h"})
async def test_a_malformed_or_invalid_calibration_report_leaves_the_worker_uncalibrated(c, s, a, b):
    """A report whose fields have other types (a worker running another version of the package) is
    not taken: the worker has that error for profile, which the CLI's table shows, and the mean weight;
    a later report with an invalid calibration drops the one before it."""
    from rich.console import Console

    from dask_octopus.cli import profile_table

    await dask_octopus.register(c, calibrate=False)
    good = {"device": "cpu", "name": "CPU", "compute": 3e9, "memory": 1e9, "error": None}
    await c.scheduler.octopus_report(worker=a.address, profile=good)
    await c.scheduler.octopus_report(worker=b.address, profile={**good, "compute": 1e9})
    assert (await dask_octopus.speeds(c))[a.address] == pytest.approx(0.75)
    with captured_logger("dask_octopus.plugins.scheduler") as log:
        await c.scheduler.octopus_report(worker=a.address, profile={**good, "compute": "3e9", "error": 7})
    why = "compute must be int or float, got '3e9'"
    assert f"ignoring calibration report of {a.address}: {why}" in log.getvalue()
    profiles = await dask_octopus.profiles(c)
    assert profiles[a.address]["error"] == f"its calibration report was malformed: {why}"
    assert await dask_octopus.speeds(c) == {a.address: 0.5, b.address: 0.5}
    Console(file=io.StringIO(), width=200).print(profile_table(profiles, await dask_octopus.speeds(c, "memory"), "t"))
    await c.scheduler.octopus_report(worker=a.address, profile=good)
    assert (await dask_octopus.speeds(c))[a.address] == pytest.approx(0.75)
    await c.scheduler.octopus_report(worker=a.address, profile={**good, "compute": -1.0})
    assert (await dask_octopus.profiles(c))[a.address]["error"].startswith("invalid calibration")
    assert await dask_octopus.speeds(c) == {a.address: 0.5, b.address: 0.5}


@gen_cluster(client=True, config=FAST)
async def test_a_calibration_report_of_a_worker_that_left_is_dropped(c, s, a, b):
    await dask_octopus.register(c, calibrate=False)
    gone = "tcp://127.0.0.1:1"
    await c.scheduler.octopus_report(worker=gone, profile={"error": None, "compute": 1.0, "memory": 1.0})
    assert gone not in plugin(s).profiles
    assert set(await dask_octopus.profiles(c)) == {a.address, b.address}


def test_probes_told_to_stop_stop_before_their_time_is_up():
    from dask_octopus.profiling.probes import ProbeStopped, run_probes

    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    start = time.perf_counter()
    with pytest.raises(ProbeStopped, match=r"^stopped after [\d.]+ of 15 s$"):
        run_probes(30, "cpu", stop)
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("how", ["closed", "replaced"])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_worker_closing_while_it_calibrates_stops_its_probes(c, s, a, monkeypatch, how):
    """A close waited for the probes' whole budget (a 20 s budget: a cluster's close raised "join
    timed out" after 10 s, a nanny killed its worker after 4 s); the probes ran on, reporting nothing.
    A plugin replaced meanwhile (a new register's) stops them too: the new one reports."""
    from dask_octopus.plugins import worker as worker_plugin

    await dask_octopus.register(c, calibrate=False)
    started = threading.Event()
    real = worker_plugin.run_probes

    def probes(seconds, device, stop):
        started.set()
        return real(seconds, device, stop)

    monkeypatch.setattr(worker_plugin, "run_probes", probes)
    calibrating = asyncio.ensure_future(a.plugin_add(worker_plugin.OctopusWorkerPlugin(seconds=30, device="cpu")))
    await async_poll_for(started.is_set, 5)
    with captured_logger("dask_octopus.plugins.worker", level=logging.WARNING) as log:
        start = time.perf_counter()
        if how == "closed":
            await a.close()
        else:
            await a.plugin_add(worker_plugin.OctopusWorkerPlugin(calibrate=False), name="octopus-worker")
        assert await calibrating == {"status": "OK"}
    assert time.perf_counter() - start < 10  # (it waited 30 s: the probes ran to the end)
    assert log.getvalue() == ""  # (no "calibration failed")
    if how == "replaced":
        assert plugin(s).profiles[a.address]["calibrated"] is False  # the new plugin's report stands


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_worker_plugin_replaced_while_calibrating_reports_nothing_and_keeps_nothing(c, s, a, monkeypatch):
    from dask_octopus.plugins import worker as worker_plugin

    await dask_octopus.register(c, calibrate=False)
    started, release = threading.Event(), threading.Event()

    def slow_probes(seconds, device, stop):
        started.set()
        release.wait(10)
        return {"compute": 1e9, "memory": 1e9, "device": "cpu"}

    monkeypatch.setattr(worker_plugin, "run_probes", slow_probes)
    old, new = worker_plugin.OctopusWorkerPlugin(calibrate=True), worker_plugin.OctopusWorkerPlugin(calibrate=False)
    calibrating = asyncio.ensure_future(a.plugin_add(old, name=old.name))
    await async_poll_for(started.is_set, 5)
    await a.plugin_add(new, name=new.name)  # tears the old one down (a register with other options does)
    release.set()
    await calibrating
    assert old.meter is None and old.timer is None  # (a meter nothing would close)
    assert plugin(s).profiles[a.address]["calibrated"] is False  # the new plugin's report stays


def test_register_and_annotate_check_every_setting_when_called():
    """A setting read later elsewhere (fragments.max-bytes: on the scheduler, where a dataframe's
    fragments are made, which logged the error and made none) fails the call that sets the work up."""
    import dask

    with dask.config.set({"octopus.fragments.max-bytes": "lots"}):
        with pytest.raises(ValueError, match=r"octopus\.fragments\.max-bytes must be auto or a size"):
            OctopusSchedulerPlugin(calibrate=False)  # what register and the --preload make
        with pytest.raises(ValueError, match=r"octopus\.fragments\.max-bytes must be auto or a size"), \
                dask_octopus.annotate():
            pass


@pytest.mark.parametrize("key, value, message", [
    ("balance.memory-fraction", "half", r"octopus.balance.memory-fraction must be a number in \(0, 1\], got 'half'"),
    ("balance.memory-fraction", 2, r"octopus.balance.memory-fraction must be a number in \(0, 1\], got 2"),
    ("map.item-cost-alpha", 0, "octopus.map.item-cost-alpha must be a number in"),
    ("calibration.wait", "soon", "octopus.calibration.wait must be a duration such as 30s"),
    ("refine.confidence-samples", 1.5, "octopus.refine.confidence-samples must be an integer >= 1"),
    ("refine.min-duration", "soon", "octopus.refine.min-duration must be a duration"),
    ("calibration.device", "tpu", "octopus.calibration.device must be one of auto, cpu, gpu"),
    ("streams.large-bytes", "big", "octopus.streams.large-bytes must be a size"),
    ("streams.capture", "yes", "octopus.streams.capture must be true or false"),
    ("max-plans", 0, "octopus.max-plans must be an integer >= 1"),
])
def test_bad_settings_raise_a_value_error_naming_the_key(key, value, message):
    import dask

    from dask_octopus import config

    with dask.config.set({f"octopus.{key}": value}), pytest.raises(ValueError, match=message):
        config.get(key)
    # arguments are checked like the configuration, naming the argument
    with pytest.raises(ValueError, match=r"^item_cost_alpha \(as octopus\.map\.item-cost-alpha\) must be a number in"):
        OctopusSchedulerPlugin(item_cost_alpha=1.5)
    with pytest.raises(ValueError, match=r"^max_plans \(as octopus\.max-plans\) must be an integer >= 1, got 0$"):
        OctopusSchedulerPlugin(max_plans=0)


def test_register_reads_no_options_where_the_plugin_was_unregistered_meanwhile():
    """register() reads back the options of the plugin that stands; where another client unregistered it
    between the registration and that read, there is none (``None``: no warning), not an AttributeError
    raised out of register() from the scheduler."""
    from stubs import Stub

    from dask_octopus.plugins.client import _registered_options

    assert asyncio.run(_registered_options(Stub(plugins={}, worker_plugins={}))) is None


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_worker_where_the_worker_plugin_does_not_load_is_named_and_not_waited_for(c, s, a, b):
    """A worker whose environment lacks dask_octopus answers the plugin's setup with the error (Dask logs
    it): register() warns naming it, its profile holds the error, and speeds answer at once (it is not
    waited for octopus.calibration.wait) with the mean weight for it."""
    def missing(plugin, name=None, catch_errors=True):  # as a worker that cannot unpickle the plugin: its
        raise ModuleNotFoundError("No module named 'dask_octopus'", name="dask_octopus")  # handler raises

    b.handlers["plugin-add"] = missing
    with (dask.config.set({"octopus.calibration.wait": "30s"}),
          pytest.warns(UserWarning, match=rf"worker plugin did not load on {b.address} "
                                          r"\(ModuleNotFoundError\(\"No module named 'dask_octopus'\"\)\): install")
          as caught):
        await dask_octopus.register(c, calibration_seconds=0.05)
    named_here(caught, "did not load on")
    start = time.monotonic()
    weights = await dask_octopus.speeds(c)
    assert time.monotonic() - start < 5 and weights[b.address] == pytest.approx(0.5)
    profiles = await dask_octopus.profiles(c)
    assert profiles[b.address]["error"].startswith("the worker plugin did not load there: ModuleNotFoundError")
    assert profiles[a.address]["error"] is None and profiles[a.address]["compute"] > 0


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_worker_plugin_that_fails_to_set_up_otherwise_is_named_with_its_error(c, s, a, b):
    """A worker whose plugin setup fails for another reason than a missing package (its own settings):
    register() names it and its error, and does not tell to install dask_octopus."""
    def bad(plugin, name=None, catch_errors=True):
        raise ValueError("octopus.streams.max-graphs must be an integer >= 1, got 0")

    b.handlers["plugin-add"] = bad
    with pytest.warns(UserWarning, match=rf"did not load on {b.address} \(ValueError\('octopus\.streams\.max-graphs "
                                         r"must be .*\)\): fix that worker's setup") as record:
        await dask_octopus.register(c, calibration_seconds=0.05)
    assert not any("install" in str(w.message) for w in record)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_worker_that_joins_later_with_bad_settings_is_named_and_not_waited_for(c, s, a, b):
    """A worker that joins after register() (as under ``dask worker --preload dask_octopus``, where no
    register runs) with a bad ``octopus`` setting of its own: its plugin fails to set up, and says so to
    the scheduler first, so its profile holds the error (logged once), speeds answer at once, and
    ``map`` and ``balance`` plan nothing there."""
    await dask_octopus.register(c, calibrate=False)
    with (dask.config.set({"octopus.calibration.wait": "30s"}),
          captured_logger("dask_octopus.plugins.scheduler") as log):
        with dask.config.set({"octopus.streams.max-graphs": 0}):  # (in-process: this worker's settings)
            late = await Worker(s.address, nthreads=1)
        async with late:
            start = time.monotonic()
            weights = await dask_octopus.speeds(c)
            assert time.monotonic() - start < 5 and set(weights) == {a.address, b.address, late.address}
            error = (await dask_octopus.profiles(c))[late.address]["error"]
            assert error == ("the worker plugin did not load there: ValueError('octopus.streams.max-graphs must be "
                             "an integer >= 1, got 0')"), error
            futures = await dask_octopus.map(operator.neg, list(range(8)), client=c)
            assert await c.gather(futures) == [-i for i in range(8)]
            assert set().union(*(await c.who_has(futures)).values()) == {a.address, b.address}
            x = await dask_octopus.balance(da.ones(64, chunks=16), client=c)
            assert set(s.plugins["octopus"].placement.plans[x.name].workers) == {a.address, b.address}
            # told again (a register's setup broadcast hears it too): logged once
            s.plugins["octopus"].report_not_loaded(late.address, error.removeprefix(NOT_LOADED))
    assert log.getvalue().count(f"did not load on {late.address}") == 1, log.getvalue()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_the_calls_that_ask_the_scheduler_refuse_a_misspelt_setting_of_this_process(c, s, a, b):
    """Where the scheduler was started with ``--preload dask_octopus`` and no ``register`` runs, a misspelt
    key of the client's process (read by nothing) is refused by each call that asks the scheduler, naming it."""
    await c.register_plugin(OctopusSchedulerPlugin(calibrate=False))
    x = da.ones(64, chunks=16)
    calls = {"speeds": lambda: dask_octopus.speeds(c), "profiles": lambda: dask_octopus.profiles(c),
             "balance": lambda: dask_octopus.balance(x, client=c),
             "map": lambda: dask_octopus.map(operator.neg, [1, 2], client=c),
             "imap": lambda: next(dask_octopus.imap(operator.neg, [1, 2], client=c))}
    for name, call in calls.items():
        with (dask.config.set({"octopus.balance.memory-fracton": 0.5}),
              pytest.raises(ValueError, match=r"octopus\.balance\.memory-fracton is not a dask_octopus setting; "
                                              r"did you mean octopus\.balance\.memory-fraction\?")):
            await asyncio.to_thread(call)
        assert await asyncio.to_thread(call) is not None, name  # (and with good settings it answers)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_worker_whose_calibration_hangs_holds_register_no_longer_than_the_wait(c, s, a, b):
    """One worker's plugin setup (its calibration) never ends: register() returns after
    octopus.calibration.wait with a warning naming it, speeds answer at once with the mean weight for it,
    and the other worker is calibrated."""
    async def hanging(plugin, name=None, catch_errors=True):
        await asyncio.sleep(3600)

    b.handlers["plugin-add"] = hanging
    start = time.monotonic()
    with (dask.config.set({"octopus.calibration.wait": "3s"}),  # (long beside a's calibration, under load too)
          pytest.warns(UserWarning, match=rf"no calibration report from {b.address} within "
                                          r"octopus\.calibration\.wait=3s: they get the mean weight") as caught):
        await dask_octopus.register(c, calibration_seconds=0.05)
    named_here(caught, "no calibration report")
    assert time.monotonic() - start < 10
    start = time.monotonic()
    weights = await dask_octopus.speeds(c)
    assert time.monotonic() - start < 1 and weights[b.address] == pytest.approx(0.5)
    profiles = await dask_octopus.profiles(c)
    assert profiles[a.address]["compute"] > 0 and profiles[b.address]["error"] == "not calibrated"


@gen_cluster(client=True, config=FAST)
async def test_the_calls_that_ask_the_scheduler_run_no_function_there(c, s, a, b):
    """``speeds``, ``profiles``, ``balance`` and ``map`` call the plugin's handlers: no out-of-band function
    runs on the scheduler (distributed logs a line for each); the client asks why only when a handler does
    not answer, as a plugin unregistered does not."""
    await dask_octopus.register(c, calibration_seconds=0.05)
    x = da.ones((40, 4), chunks=10)
    with captured_logger("distributed.worker", level=logging.INFO) as log:
        await dask_octopus.speeds(c)
        await dask_octopus.profiles(c, "memory")
        assert (await c.compute((await dask_octopus.balance(x)).sum())) == 160
        assert await c.gather(await dask_octopus.map(abs, [-1, 2], client=c)) == [1, 2]
    assert "Run out-of-band function" not in log.getvalue()
    await c.unregister_scheduler_plugin("octopus")  # (its handlers stay until its sampler withdraws them)
    with pytest.raises(NotRegisteredError, match=r"call dask_octopus\.register\(client\)"):
        await dask_octopus.speeds(c)


@gen_cluster(client=True, config=FAST)
async def test_a_plugin_registered_after_a_failed_preload_clears_the_preload_s_error(c, s, a, b):
    """After a ``--preload dask_octopus`` that failed (its error recorded on the scheduler), a plugin
    registered since stands: once it is unregistered, clients hear to register, not of the old preload."""
    from dask_octopus.plugins.scheduler import PRELOAD_ERROR

    setattr(s, PRELOAD_ERROR, "octopus.fragments.max-bytes: 'lots' is not a size")
    with pytest.raises(NotRegisteredError, match=r"its --preload dask_octopus failed there: octopus\.fragments"):
        await dask_octopus.speeds(c)
    await dask_octopus.register(c, calibrate=False)
    assert not hasattr(s, PRELOAD_ERROR)
    await c.unregister_scheduler_plugin("octopus")
    with pytest.raises(NotRegisteredError, match=r"call dask_octopus\.register\(client\)"):
        await dask_octopus.speeds(c)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def test_a_worker_closed_while_it_calibrates_logs_no_traceback(c, s, a, b):
    """A worker closed while its probes run (a Ctrl-C in the demo, a cluster closed): the setup that
    waited for them ends quietly, where distributed logged its CancelledError with a traceback."""
    with captured_logger("distributed", level=logging.ERROR) as log:
        registering = asyncio.ensure_future(dask_octopus.register(c, calibration_seconds=3))
        await async_poll_for(lambda: "octopus-worker" in b.plugins, timeout=10)
        await asyncio.sleep(0.3)  # (its probes run)
        await b.close()
        with contextlib.suppress(Exception):
            await registering
    assert "CancelledError" not in log.getvalue(), log.getvalue()
