"""Real heterogeneity on CPU: a co-tenant shares one worker's core; calibration and task timings see it."""

import os

import numpy as np
import pytest
from distributed import Client, LocalCluster, wait

import dask_octopus
from dask_octopus.bench.cotenant import CoTenant, pin_workers
from dask_octopus.bench.workloads import gemm_repeat

pytestmark = [pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPU cores"),
              pytest.mark.xdist_group("cpu-cotenant")]  # (tests/conftest.py)


@pytest.fixture
def pinned_client():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cl, \
            Client(cl) as c:
        yield c, pin_workers(c)


def test_pin_workers_sets_each_worker_process_to_its_core(pinned_client):
    c, plan = pinned_client
    seen = c.run(lambda: sorted(os.sched_getaffinity(0)))
    assert {w: cores for w, cores in seen.items()} == {w: [core] for w, core in plan.items()}


def test_calibration_sees_a_cotenant(pinned_client):
    c, plan = pinned_client
    slow = min(plan)
    with CoTenant(cores=[plan[slow]], procs=2):
        # a 2 s budget: in the default 0.6 s, what else ran on the two cores for a moment (the previous
        # test's cluster closing) moved the weight by up to 0.2 (0.433 once in 24 runs)
        dask_octopus.register(c, calibration_seconds=2)
        w = dask_octopus.speeds(c)
    assert w[slow] < 0.4, (w, dask_octopus.profiles(c))


def test_online_refinement_after_a_real_slowdown(pinned_client):
    c, plan = pinned_client
    # uncalibrated: the workers start equal, so the weight the slowed worker loses is the task timings'
    # doing (a 0.6 s probe on 2 shared cores varies by +-0.1 of weight; test_calibration_sees_a_cotenant)
    dask_octopus.register(c, calibrate=False)
    slow = min(plan)
    before = dask_octopus.speeds(c)[slow]
    assert before == pytest.approx(0.5)
    data = {w: c.scatter(np.ones((512, 512), dtype=np.float64), workers=[w]) for w in plan}
    with CoTenant(cores=[plan[slow]], procs=2):
        # the other worker runs three times as many tasks, busy until the slowed one is done: idle, it
        # would hand its share of their process group's CPU time (Linux's autogroups) to the slowed one,
        # whose last tasks then ran as fast as the other's
        # (ten timings of the slowed one: the model moves weights only past 2.5 standard errors of the
        # timings' noise, which the other test process, on the same two cores, raises)
        futs = [c.submit(gemm_repeat, data[w], 20, workers=[w], pure=False)
                for w in plan for _ in range(10 if w == slow else 30)]
        wait(futs)
        w = dask_octopus.speeds(c)
    assert w[slow] < 0.4, w  # the slowed worker lost weight (it runs at about a third of the other's speed)
    assert dask_octopus.profiles(c)[slow]["samples"] >= 3


def test_cotenant_bad_input_and_cleanup():
    with pytest.raises(ValueError, match="procs must be >= 1"):
        CoTenant(cores=[0], procs=0)
    with pytest.raises(ValueError, match="not available"):
        CoTenant(cores=[10_000])
    load = CoTenant(cores=[min(os.sched_getaffinity(0))]).start()  # (a core this process may use)
    children = list(load.children)
    try:
        assert children and all(ch.poll() is None for ch in children)
    finally:
        load.stop()  # (a burner left running would slow every later test)
    assert all(ch.poll() is not None for ch in children)
