"""A multi-node style deployment from the CLI: dask scheduler / dask worker with --preload dask_octopus."""

import shutil
import subprocess
import time

import dask.array as da
import numpy as np
import pytest
from distributed import Client, wait

import dask_octopus

pytestmark = pytest.mark.skipif(shutil.which("dask") is None, reason="needs the dask CLI")


@pytest.fixture
def cli_cluster(tmp_path):
    sched_file = str(tmp_path / "scheduler.json")
    common = ["--preload", "dask_octopus", "--no-dashboard", "--host", "127.0.0.1"]
    procs = [subprocess.Popen(["dask", "scheduler", "--scheduler-file", sched_file, "--port", "0", *common])]
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "scheduler.json").exists():
            assert time.monotonic() < deadline, "scheduler did not start"
            time.sleep(0.1)
        for _ in range(2):
            procs.append(subprocess.Popen(["dask", "worker", "--scheduler-file", sched_file, "--nthreads", "1",
                                           "--no-nanny", *common]))
        with Client(scheduler_file=sched_file, timeout="30s") as client:
            client.wait_for_workers(2, timeout=30)
            yield client
    finally:
        for p in procs[::-1]:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_preloaded_cli_cluster_balances_and_pins(cli_cluster):
    c = cli_cluster
    deadline = time.monotonic() + 30  # no register(): the preload did it; workers calibrate as they join
    while any(p["error"] for p in dask_octopus.profiles(c).values()):
        assert time.monotonic() < deadline, dask_octopus.profiles(c)
        time.sleep(0.2)
    assert len(dask_octopus.speeds(c)) == 2
    x = da.arange(6000, chunks=500).reshape(600, 10).rechunk((100, 10)).astype(float)
    y = c.persist(dask_octopus.balance(x, per_worker=2))
    wait(y)
    assert len(y.chunks[0]) == 4
    plan = c.run_on_scheduler(lambda dask_scheduler, name=y.name: dask_scheduler.plugins["octopus"].placement.plans[name].workers)
    who = c.who_has(y)
    assert [who[(y.name, i, 0)][0] for i in range(4)] == plan
    np.testing.assert_array_equal((y * 2).sum(axis=1).compute(), (np.arange(6000).reshape(600, 10) * 2).sum(axis=1))
