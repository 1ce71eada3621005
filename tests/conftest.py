import fcntl
from pathlib import Path

import dask
import distributed.core
import pytest
from distributed.utils_test import cleanup, loop, loop_in_thread  # noqa: F401  (fixtures)
from hypothesis import settings

import dask_octopus  # noqa: F401  (registers its dask.config defaults)
from dask_octopus import config
from dask_octopus.groups.memo import plans
from dask_octopus.profiling.probes import gpu_available

# The suite runs in two processes on CI's two cores (README: ``-n 2 --dist loadgroup``). Tests that start
# CPU co-tenants (burner processes pinned to a worker's core) and assert what they slow share the xdist
# group "cpu-cotenant": one process runs them one after the other, never two co-tenants at once (a demo's
# on the core a test keeps free for its reference worker), and each runs alone (below). Hypothesis has no
# deadline: an example of a pure function may wait past 200 ms for a core the other process holds,
# without being slow.
settings.register_profile("octopus", deadline=None)
settings.load_profile("octopus")
COTENANT_GROUP = "cpu-cotenant"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, a test of the group ``cpu-cotenant`` runs (its fixtures' set-up and tear-down
    included) while no test of the other process does: its co-tenant must be the only load its workers
    share their cores with (a calibration saw a co-tenant's worker at the other's speed, 0.50 of the
    weight, while the other process ran its tests). File locks in the run's temporary directory (each
    process's is ``popen-gwN`` in it): the group's tests take the lock alone, the others share it; a test
    waiting to run alone holds the gate, so the other process starts no new test first."""
    basetemp = item.config.option.basetemp if hasattr(item.config, "workerinput") else None
    if basetemp is None:
        yield
        return
    alone = any(COTENANT_GROUP in (*m.args, m.kwargs.get("name")) for m in item.iter_markers("xdist_group"))
    root = Path(basetemp).parent
    with open(root / "cotenant.gate", "a") as gate, open(root / "cotenant.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(gate, fcntl.LOCK_UN)
        yield


@pytest.fixture(autouse=True)
def result_sizes_not_learned_first(request, monkeypatch):
    """The first batched ``map`` of a function runs one item alone first (``octopus.map.learn-result-size``),
    which adds a plan of one item before the plan most tests look at; the tests of that step turn it on.
    Off in ``dask.config`` and in the package's defaults, which stand where Dask's test utilities
    replace the whole configuration (``gen_cluster``); as shipped for tests marked ``package_defaults``."""
    if request.node.get_closest_marker("package_defaults"):
        yield
        return
    monkeypatch.setitem(config.defaults["octopus"]["map"], "learn-result-size", False)
    with dask.config.set({"octopus.map.learn-result-size": False}):
        yield


@pytest.fixture(autouse=True)
def no_plans_remembered_from_other_tests():
    """Each test plans its fragments itself: the plans remembered (``octopus.fragments.plan-memo``) are
    the process's, and another test's graph of the same keys would skip the planning a test looks at."""
    plans.clear()
    yield
    plans.clear()


@pytest.fixture(autouse=True)
def servers_let_go_after_each_test():
    """distributed caches, without bound, whether each handler a server ran expects a comm
    (``distributed.core._expects_comm``, ``functools.cache``), keyed by the handler: a bound method of
    its scheduler or worker, so every cluster of every test stayed alive to the end of the suite (their
    task logs and transitions with them), and each garbage collection walked them all. Cleared after
    each test, the clusters of the tests before are freed."""
    yield
    expects_comm = getattr(distributed.core, "_expects_comm", None)
    if expects_comm is not None and hasattr(expects_comm, "cache_clear"):
        expects_comm.cache_clear()


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs CuPy and a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

