"""A TLS-secured cluster: register, speeds, balance, map and annotate over tls://, and the preload path."""

import asyncio

import dask
import dask.array as da
import numpy as np
import pytest
from dask.utils import key_split
from distributed import Client, Scheduler, Worker, wait
from distributed.security import Security
from distributed.utils_test import async_poll_for, gen_cluster, gen_test
from test_annotate import GroupLog, f
from test_balance import blocks_run_where_planned, run_balance, setup

import dask_octopus
from dask_octopus import NotRegisteredError
from dask_octopus.groups.rewrite import FRAGMENT_PREFIX
from dask_octopus.plugins.scheduler import OctopusSchedulerPlugin

FAST = {"octopus.calibration.seconds": 0.1}
# distributed's test certificates (utils_test.get_cert / gen_tls_cluster) are not in its wheel: make our own
SECURITY = Security.temporary()


def gen_tls_cluster(**kwargs):
    """``gen_cluster`` on tls:// with ``SECURITY`` (encryption required) for scheduler, workers and client."""
    return gen_cluster(client=True, scheduler="tls://127.0.0.1", nthreads=[("tls://127.0.0.1", 1)] * 2,
                       security=SECURITY, **kwargs)


def in_thread(func):
    """Run a synchronous public function from an executor thread (the client is asynchronous here)."""
    return asyncio.get_running_loop().run_in_executor(None, func)


def assert_tls(c, s, *workers):
    assert s.address.startswith("tls://") and c.scheduler.address == s.address
    assert c.security.require_encryption
    assert all(w.address.startswith("tls://") for w in workers)
    assert all(addr.startswith("tls://") for addr in s.workers) and len(s.workers) == len(workers)


@gen_tls_cluster()
async def test_register_and_speeds_over_tls(c, s, a, b):
    assert_tls(c, s, a, b)
    with pytest.raises(NotRegisteredError):
        await in_thread(lambda: dask_octopus.speeds(c))
    await in_thread(lambda: dask_octopus.register(c, calibration_seconds=0.1))
    assert isinstance(s.plugins["octopus"], OctopusSchedulerPlugin)
    profiles = s.plugins["octopus"].profiles  # the workers reported their calibration over TLS
    assert set(profiles) == {a.address, b.address}
    assert all(p["error"] is None and p["compute"] > 1e8 and p["memory"] > 1e8 for p in profiles.values())
    for resource in ("compute", "memory"):
        w = await in_thread(lambda resource=resource: dask_octopus.speeds(c, resource))
        assert set(w) == {a.address, b.address} and sum(w.values()) == pytest.approx(1)
        assert all(0 < v < 1 for v in w.values())
    got = await in_thread(lambda: dask_octopus.profiles(c))
    assert {k: v["compute"] for k, v in got.items()} == {k: v["compute"] for k, v in profiles.items()}
    await in_thread(lambda: dask_octopus.register(c, calibration_seconds=0.1))  # idempotent over TLS too
    assert [n for n in s.plugins if "octopus" in n] == ["octopus"]


@gen_tls_cluster()
async def test_balance_over_tls_is_exact_and_pinned(c, s, a, b):
    assert_tls(c, s, a, b)
    rec = await setup(c, s, [3.0, 1.0])
    assert await in_thread(lambda: dask_octopus.speeds(c)) == pytest.approx(
        dict(zip(sorted(s.workers), [0.75, 0.25])))
    x, y, planned = await blocks_run_where_planned(c, s, rec)
    yp = c.persist(y)  # the blocks themselves sit on the planned workers
    await wait(yp)
    who = await c.who_has(yp)
    assert [who[(y.name, i, j)] for i in range(4) for j in range(2)] == [(w,) for w in planned for _ in range(2)]
    np.testing.assert_array_equal(await c.compute(yp), await c.compute(x))


def cumulative(v, scale):
    return np.cumsum(v) * scale


@gen_tls_cluster()
async def test_map_over_tls_is_exact_in_order_and_placed(c, s, a, b):
    assert_tls(c, s, a, b)
    rec = await setup(c, s, [3.0, 1.0])
    items = [np.arange(n, dtype=float) for n in (5, 800, 3, 100, 250, 40, 700, 1, 60, 9)]
    for group in (1, 2):
        futs = await in_thread(lambda group=group: dask_octopus.map(cumulative, items, client=c, group=group,
                                                                       scale=3.0))
        results = await c.gather(futs)
        assert len(results) == len(items)
        for got, item in zip(results, items):
            np.testing.assert_array_equal(got, np.cumsum(item) * 3.0)
        plans = {n: p for n, p in s.plugins["octopus"].placement.plans.items() if "-octopus-map-" in n}
        (name, plan), = plans.items()
        assert set(plan.workers) == set(s.workers)  # both workers got work, pinned by the plan
        batches = [k for k in rec.worker if isinstance(k, tuple) and k[0] == name]
        assert batches and all(rec.worker[k] == plan.workers[k[1]] for k in batches if not plan.stealable[k[1]])
        assert all(rec.worker[fut.key] in plan.workers for fut in futs)
        s.plugins["octopus"].placement.plans.clear()
        del futs, results


@gen_tls_cluster()
async def test_annotate_over_tls_is_exact_and_groups_stay_with_their_blocks(c, s, a, b):
    assert_tls(c, s, a, b)
    await setup(c, s, [3.0, 1.0])
    log = GroupLog.on(s)
    x = da.random.default_rng(2).random((4000, 8), chunks=(100, 8))
    expected = f(await c.compute(x))
    xb = c.persist(await run_balance(c, x, per_worker=4))
    await wait(xb)
    plan = s.plugins["octopus"].placement.plans[xb.name].workers
    assert set(plan) == set(s.workers)
    with dask_octopus.annotate(group=8):
        y = xb.map_blocks(f)
    np.testing.assert_array_equal(await c.compute(y), expected)
    assert log.groups, "no stream group ran"
    assert {w for _, w, _ in log.groups.values()} == set(s.workers)
    for members, worker, holders in log.groups.values():
        assert holders == {worker}, members  # each group ran where its balanced blocks are
        assert all(k[0] == y.name and worker == plan[k[1]] for k in members), members
    log.groups.clear()
    with dask_octopus.annotate(group=5):  # marked delayed tasks group over TLS too
        parts = [dask.delayed(np.cumsum)(np.arange(n, dtype=float)) for n in range(1, 21)]
    total = await c.compute(dask.delayed(sum)([p[-1] for p in parts]))
    assert total == sum(np.cumsum(np.arange(n, dtype=float))[-1] for n in range(1, 21))
    assert all(key_split(k) == FRAGMENT_PREFIX for k in log.groups)
    # 20 parts in fragments of 5 (each with the tasks that read only it)
    assert sorted(sum(key_split(k) == "cumsum" for k in m) for m, _, _ in log.groups.values()) == [5] * 4


@gen_test(timeout=60, config=FAST)
async def test_preloaded_tls_scheduler_has_the_plugin_and_serves_speeds():
    sec = Security.temporary()  # its own certificates, not distributed's test ones
    assert sec.require_encryption
    async with Scheduler(security=sec, protocol="tls", host="127.0.0.1", port=0, dashboard_address=":0",
                         preload=["dask_octopus"]) as s:
        assert s.address.startswith("tls://")
        assert isinstance(s.plugins["octopus"], OctopusSchedulerPlugin)  # no register(): the preload did it
        async with Worker(s.address, security=sec, nthreads=1, preload=["dask_octopus"]) as a, \
                Worker(s.address, security=sec, nthreads=1, preload=["dask_octopus"]) as b, \
                Client(s.address, security=sec, asynchronous=True) as c:
            assert_tls(c, s, a, b)
            plugin = s.plugins["octopus"]
            await async_poll_for(lambda: set(plugin.profiles) == {a.address, b.address}, timeout=20)
            assert all(p["error"] is None for p in plugin.profiles.values())  # calibrated, reported over TLS
            w = await in_thread(lambda: dask_octopus.speeds(c))
            assert set(w) == {a.address, b.address} and sum(w.values()) == pytest.approx(1)
            assert w == pytest.approx(plugin.speeds())
            await in_thread(lambda: dask_octopus.register(c))  # harmless on a preloaded scheduler
            assert s.plugins["octopus"] is plugin and [n for n in s.plugins if "octopus" in n] == ["octopus"]
            x = da.arange(6000, chunks=500).reshape(600, 10).rechunk((100, 10)).astype(float)
            y = c.persist(await in_thread(lambda: dask_octopus.balance(x, client=c, per_worker=2)))
            await wait(y)
            assert len(y.chunks[0]) == 4
            who = await c.who_has(y)
            assert [who[(y.name, i, 0)][0] for i in range(4)] == plugin.placement.plans[y.name].workers
            np.testing.assert_array_equal(await c.compute((y * 2).sum(axis=1)),
                                          (np.arange(6000).reshape(600, 10) * 2).sum(axis=1))
