"""A multi-node style deployment from the CLI: dask scheduler / dask worker with --preload dask_octopus."""

import contextlib
import io
import logging
import os
import subprocess
import sys
import time

import dask.array as da
import numpy as np
import pytest
from distributed import Client, Scheduler, wait
from distributed.utils_test import gen_test

import dask_octopus
from dask_octopus import NotRegisteredError

DASK = [sys.executable, "-m", "dask"]
# the processes share the test process's environment, as a deployment's must: functions of the test
# modules, pickled by reference, are then importable on the scheduler, which deserialises the graphs
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(__file__),
                                                                os.environ.get("PYTHONPATH")]))}


def wait_for_scheduler_file(path):
    """Wait until a starting scheduler wrote its scheduler file ``path`` (30 s at most)."""
    deadline = time.monotonic() + 30
    while not path.exists():
        assert time.monotonic() < deadline, "scheduler did not start"
        time.sleep(0.1)


@contextlib.contextmanager
def scheduler_process(command, sched_file, env, stderr):
    """A scheduler process started with ``command``, once it wrote ``sched_file``; terminated after."""
    proc = subprocess.Popen(command, env=env, stderr=stderr)
    try:
        wait_for_scheduler_file(sched_file)
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@contextlib.contextmanager
def cli_cluster(tmp_path, worker_command, n_workers, worker_processes, scheduler_args=(), worker_env=None,
                preloads=1):
    """``dask scheduler`` (with ``scheduler_args``, e.g. ``--protocol ucx``) and ``worker_processes``
    worker commands (with ``worker_env`` added to their environment), all with ``--preload dask_octopus``
    (``preloads`` times); their logs in ``tmp_path``: ``scheduler.log``, ``worker-0.log``, ..."""
    sched_file = str(tmp_path / "scheduler.json")
    preload = ["--preload", "dask_octopus"] * preloads + ["--no-dashboard"]
    logs = []

    def started(command, name, env):
        logs.append(open(tmp_path / f"{name}.log", "w"))  # noqa: SIM115 (closed with the processes)
        return subprocess.Popen(command, env=env, stderr=logs[-1])

    procs = [started([*DASK, "scheduler", "--scheduler-file", sched_file, "--port", "0", "--host", "127.0.0.1",
                      *scheduler_args, *preload], "scheduler", ENV)]
    try:
        wait_for_scheduler_file(tmp_path / "scheduler.json")
        for i in range(worker_processes):
            procs.append(started([*DASK, *worker_command, "--scheduler-file", sched_file, *preload], f"worker-{i}",
                                 {**ENV, **(worker_env or {})}))
        with Client(scheduler_file=sched_file, timeout="30s") as client:
            client.wait_for_workers(n_workers, timeout=60)
            deadline = time.monotonic() + 60  # no register(): the preload did it; workers calibrate on arrival
            while any(p["error"] for p in dask_octopus.profiles(client).values()):
                assert time.monotonic() < deadline, dask_octopus.profiles(client)
                time.sleep(0.2)
            yield client
    finally:
        for p in procs[::-1]:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in logs:
            log.close()


def test_register_refuses_a_scheduler_whose_own_octopus_setting_is_bad(tmp_path):
    """A scheduler of another process (machine) reads its own dask.config: ``register`` from a client whose
    settings are fine raises, naming the key, instead of a plugin that only logs it there."""
    sched_file = tmp_path / "scheduler.json"
    command = [*DASK, "scheduler", "--scheduler-file", str(sched_file), "--port", "0", "--host", "127.0.0.1",
               "--no-dashboard"]
    with (open(tmp_path / "scheduler.log", "w") as log,
          scheduler_process(command, sched_file, {**ENV, "DASK_OCTOPUS__FRAGMENTS__MAX_BYTES": "lots"}, log),
          Client(scheduler_file=str(sched_file), timeout="30s") as client):
        with pytest.raises(ValueError, match=r"on the scheduler at .*octopus\.fragments\.max-bytes"):
            dask_octopus.register(client, calibrate=False)
        assert "octopus" not in client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins))


def test_a_preload_that_failed_on_a_bad_setting_is_named_to_the_clients(tmp_path):
    """``dask scheduler --preload dask_octopus`` with a bad ``octopus`` setting in the scheduler's process:
    distributed logs the preload's error and starts the scheduler without the plugin; the calls that need
    it say that the preload failed and why, not to start the scheduler with the preload."""
    sched_file = tmp_path / "scheduler.json"
    command = [*DASK, "scheduler", "--scheduler-file", str(sched_file), "--port", "0", "--host", "127.0.0.1",
               "--no-dashboard", "--preload", "dask_octopus"]
    with (open(tmp_path / "scheduler.log", "w") as log,
          scheduler_process(command, sched_file, {**ENV, "DASK_OCTOPUS__FRAGMENTS__MAX_BYTES": "lots"}, log),
          Client(scheduler_file=str(sched_file), timeout="30s") as client,
          pytest.raises(NotRegisteredError, match=r"its --preload dask_octopus failed there: "
                                                  r"octopus\.fragments\.max-bytes")):
        dask_octopus.speeds(client)
    assert "Failed to start preload: dask_octopus" in (tmp_path / "scheduler.log").read_text()


def test_a_worker_preload_with_a_bad_setting_names_the_key_in_the_worker_s_log(tmp_path):
    """``dask worker --preload dask_octopus`` in a process whose own ``octopus`` setting is bad: distributed
    logs the preload's error, naming the key, as the worker starts; the worker plugin does not set up there,
    and ``register`` names the worker and the key, and its profile holds the error (a setting that the setup
    itself does not read, such as this one, let it set up before)."""
    sched_file = tmp_path / "scheduler.json"
    command = [*DASK, "scheduler", "--scheduler-file", str(sched_file), "--port", "0", "--host", "127.0.0.1",
               "--no-dashboard"]
    worker = [*DASK, "worker", "--scheduler-file", str(sched_file), "--nthreads", "1", "--no-nanny", "--host",
              "127.0.0.1", "--no-dashboard", "--preload", "dask_octopus"]
    with (open(tmp_path / "scheduler.log", "w") as log, open(tmp_path / "worker.log", "w") as worker_log,
          scheduler_process(command, sched_file, ENV, log),
          Client(scheduler_file=str(sched_file), timeout="30s") as client):
        proc = subprocess.Popen(worker, env={**ENV, "DASK_OCTOPUS__BALANCE__MEMORY_FRACTION": "7"}, stderr=worker_log)
        try:
            client.wait_for_workers(1, timeout=60)
            (address,) = client.scheduler_info()["workers"]
            message = (rf"did not load on {address} \(ValueError\('octopus\.balance\.memory-fraction must be a "
                       r"number in \(0, 1\], got 7'\)\): fix that worker's setup")
            with pytest.warns(UserWarning, match=message):
                dask_octopus.register(client, calibrate=False)
            error = dask_octopus.profiles(client)[address]["error"]
            assert error.startswith("the worker plugin did not load there") and "memory-fraction" in error, error
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    text = (tmp_path / "worker.log").read_text()
    assert "Failed to start preload: dask_octopus" in text, text
    assert "octopus.balance.memory-fraction must be a number in (0, 1], got 7" in text, text


def test_preloaded_twice_the_cli_cluster_has_one_plugin_and_logs_as_distributed(tmp_path):
    """``--preload dask_octopus`` given twice installs one plugin without Dask's warning about overwriting
    it, and the package's INFO lines appear in the processes' logs, formatted as distributed's."""
    worker = ["worker", "--nthreads", "1", "--no-nanny", "--host", "127.0.0.1"]
    with cli_cluster(tmp_path, worker, n_workers=1, worker_processes=1, preloads=2) as c:
        assert c.run_on_scheduler(lambda dask_scheduler: [n for n in dask_scheduler.plugins if "octopus" in n]) == [
            "octopus"]
        assert len(dask_octopus.speeds(c)) == 1
    scheduler, worker = (tmp_path / "scheduler.log").read_text(), (tmp_path / "worker-0.log").read_text()
    assert "already contains a plugin" not in scheduler, scheduler
    assert " - dask_octopus - INFO - dask_octopus " in worker, worker  # "... available on tcp://..."


def test_a_scheduler_without_the_package_says_to_install_it(tmp_path):
    """A scheduler whose environment lacks dask_octopus: ``register`` and ``speeds`` raise
    ``NotRegisteredError`` saying so, and ``dask-octopus profile`` prints it in one line, not a traceback."""
    sched_file = tmp_path / "scheduler.json"
    hidden = "import sys; sys.modules['dask_octopus'] = None; from distributed.cli.dask_scheduler import main; main()"
    command = [sys.executable, "-c", hidden, "--scheduler-file", str(sched_file), "--port", "0", "--host",
               "127.0.0.1", "--no-dashboard"]
    with scheduler_process(command, sched_file, ENV, subprocess.DEVNULL):
        with Client(scheduler_file=str(sched_file), timeout="30s") as c:
            for call in (dask_octopus.register, dask_octopus.speeds):
                with pytest.raises(NotRegisteredError, match="not installed where the scheduler runs"):
                    call(c)
            out = subprocess.run([sys.executable, "-m", "dask_octopus", "profile", "--scheduler-address",
                                  c.scheduler.address], env=ENV, capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
        assert "not installed where the scheduler runs" in out.stderr


@pytest.mark.parametrize("preloaded", [False, True])
def test_a_worker_that_lacks_the_package_cannot_join_once_the_plugin_is_there(tmp_path, preloaded):
    """Dask sends a joining worker the worker plugins registered (by ``register``, or by the scheduler's
    ``--preload dask_octopus``): a worker whose environment lacks dask_octopus cannot unpickle ours, and
    fails to start, naming the module; the cluster goes on without it."""
    sched_file = tmp_path / "scheduler.json"
    command = [*DASK, "scheduler", "--scheduler-file", str(sched_file), "--port", "0", "--host", "127.0.0.1",
               "--no-dashboard", *(["--preload", "dask_octopus"] if preloaded else [])]
    hidden = ("import sys; sys.modules['dask_octopus'] = None; sys.argv[0] = 'dask-worker'; "
              "from distributed.cli.dask_worker import main; main()")
    with scheduler_process(command, sched_file, ENV, subprocess.DEVNULL), \
            Client(scheduler_file=str(sched_file), timeout="30s") as c:
        if not preloaded:
            dask_octopus.register(c, calibrate=False)
        out = subprocess.run([sys.executable, "-c", hidden, "--scheduler-file", str(sched_file), "--no-nanny",
                              "--no-dashboard", "--nthreads", "1"], env=ENV, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode != 0 and "Worker failed to start" in out.stderr, out.stderr
        assert "ModuleNotFoundError: No module named 'dask_octopus.plugins'" in out.stderr, out.stderr
        deadline = time.monotonic() + 30  # (the scheduler registered it, and removes it once its comm closed)
        while c.scheduler_info()["workers"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.scheduler_info()["workers"] == {}


@gen_test(timeout=30)
async def test_a_preload_in_the_user_s_process_leaves_its_logging_alone():
    """In a process whose logging is configured (handlers on the root logger: ``basicConfig``, pytest),
    an in-process preload leaves the ``dask_octopus`` logger as it is: its records still reach the
    user's handlers."""
    ours, root = logging.getLogger("dask_octopus"), logging.getLogger()
    before = (list(ours.handlers), ours.level, ours.propagate)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root.addHandler(handler)
    try:
        async with Scheduler(dashboard_address=":0", preload=["dask_octopus"]) as s:
            assert "octopus" in s.plugins
            assert (list(ours.handlers), ours.level, ours.propagate) == before
            ours.warning("to the user's handler")
        assert "to the user's handler" in stream.getvalue()
    finally:
        root.removeHandler(handler)
        ours.handlers[:], ours.propagate = before[0], before[2]
        ours.setLevel(before[1])


def check_balanced_and_pinned(c, x):
    weights = dask_octopus.speeds(c)
    y = c.persist(dask_octopus.balance(x, per_worker=2))
    wait(y)
    assert len(y.chunks[0]) == 4
    plan = c.run_on_scheduler(
        lambda dask_scheduler, name=y.name: dask_scheduler.plugins["octopus"].placement.plans[name].workers)
    who = c.who_has(y)
    assert [who[(y.name, i, 0)][0] for i in range(4)] == plan
    # the rows follow the calibrated weights: the predicted makespan (a worker's rows over its weight)
    # within octopus.balance.min-gain (3%) of the best split, one row of rounding aside (equal blocks
    # that close to the plan are kept as they are)
    rows = {w: sum(n for n, owner in zip(y.chunks[0], plan) if owner == w) for w in weights}
    assert max(rows[w] / weights[w] for w in weights) <= 1.03 * (x.shape[0] + len(weights)), (rows, weights)
    return y


def test_preloaded_cli_cluster_balances_and_pins(tmp_path):
    worker = ["worker", "--nthreads", "1", "--no-nanny", "--host", "127.0.0.1"]
    with cli_cluster(tmp_path, worker, n_workers=2, worker_processes=2) as c:
        assert len(dask_octopus.speeds(c)) == 2
        x = da.arange(6000, chunks=500).reshape(600, 10).rechunk((100, 10)).astype(float)
        y = check_balanced_and_pinned(c, x)
        expected = (np.arange(6000).reshape(600, 10) * 2).sum(axis=1)
        np.testing.assert_array_equal((y * 2).sum(axis=1).compute(), expected)
