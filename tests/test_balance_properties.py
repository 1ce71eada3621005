"""``dask_octopus.balance`` on random arrays (hypothesis): the same values, blocks where the plan pins them.

Random integer arrays in random blocks, in memory or persisted (on one worker or spread), balanced
along a random axis over three workers of random speeds with or without ``per_worker`` and ``align``,
then used by a per-block step and a reduction; random dataframes (sorted index with runs of equal
values, or no divisions) balanced by rows. On one in-process cluster with the plugin; the
examples are derandomized: the same ones each run.
"""

import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from dask.core import flatten
from dask.utils import key_split
from distributed import Client, LocalCluster, wait
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_balance import WhereRan

import dask_octopus
from dask_octopus.placement.planning import PlanningError


@pytest.fixture(scope="module")
def client():
    with (LocalCluster(n_workers=3, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster,
          Client(cluster) as client):
        dask_octopus.register(client, calibrate=False)
        client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.add_plugin(WhereRan()))
        yield client


def _speeds(dask_scheduler, speeds):
    for w, v in zip(sorted(dask_scheduler.workers), speeds, strict=True):
        dask_scheduler.plugins["octopus"].model.set_prior(w, {"compute": v, "memory": v})


def _ran(dask_scheduler):
    return dict(dask_scheduler.plugins["where-ran"].worker)


@given(st.integers(64, 400), st.integers(1, 6), st.sampled_from([0, 1]), st.data())
@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_random_balanced_arrays_keep_their_values_and_run_each_block_where_planned(client, long, short, axis, data):
    """Along ``axis`` the array is ``long`` (64-400) in blocks of 8 or more; across it ``short``."""
    shape = (long, short) if axis == 0 else (short, long)
    chunks = tuple(data.draw(st.integers(8, n)) if i == axis else data.draw(st.integers(1, n))
                   for i, n in enumerate(shape))
    per_worker = data.draw(st.one_of(st.none(), st.integers(1, 3)))
    align = data.draw(st.sampled_from([1, 1, 2, 4]))
    speeds = data.draw(st.lists(st.floats(1.0, 3.0), min_size=3, max_size=3))
    held = data.draw(st.sampled_from(["in memory", "persisted", "persisted on one worker"]))
    client.run_on_scheduler(_speeds, speeds=speeds)
    values = np.arange(long * short, dtype=np.int64).reshape(shape)
    x = da.from_array(values, chunks=chunks)
    if held != "in memory":
        workers = sorted(client.scheduler_info()["workers"])[:1] if held == "persisted on one worker" else None
        x = client.persist(x, workers=workers)
        wait(x)
    try:
        y = dask_octopus.balance(x, client=client, axis=axis, per_worker=per_worker, align=align)
    except PlanningError as e:  # a share of a slow worker smaller than align
        assert align > 1 and "align" in str(e), e
        return
    assert y.shape == x.shape and y.chunks[1 - axis] == x.chunks[1 - axis]
    assert all(c % align == 0 for c in y.chunks[axis][:-1])
    z = client.persist(y + 1)
    wait(z)
    np.testing.assert_array_equal(client.compute(z).result(), values + 1)
    assert client.compute(y.sum(axis=1 - axis)).result().tolist() == values.sum(axis=1 - axis).tolist()
    plan = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins["octopus"].placement.plans[y.name])
    ran = client.run_on_scheduler(_ran)
    for key in flatten(z.__dask_keys__()):  # each block of y + 1 ran where its slab of y is planned
        assert ran[key] == plan.workers[key[1 + axis]], (key, ran[key], plan.workers)


@given(st.integers(16, 300), st.integers(1, 8), st.data())
@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_random_balanced_dataframes_keep_their_rows_and_run_each_partition_where_planned(client, rows, parts, data):
    """A dataframe of ``rows`` rows in ``parts`` partitions: a sorted index with runs of equal values
    (known divisions) or without divisions, in memory or persisted; the same rows in the same order,
    divisions known where the input's were, unless a cut could not move to a value boundary."""
    runs = data.draw(st.integers(1, 8))  # the longest run of equal index values
    index = np.sort(np.array(data.draw(st.lists(st.integers(0, rows // runs + 1), min_size=rows, max_size=rows))))
    sorted_ = data.draw(st.booleans())
    per_worker = data.draw(st.one_of(st.none(), st.integers(1, 3)))
    speeds = data.draw(st.lists(st.floats(1.0, 3.0), min_size=3, max_size=3))
    held = data.draw(st.sampled_from(["in memory", "persisted", "persisted on one worker"]))
    client.run_on_scheduler(_speeds, speeds=speeds)
    frame = pd.DataFrame({"a": np.arange(rows), "b": np.arange(rows) % 7}, index=index)
    df = dd.from_pandas(frame, npartitions=parts, sort=sorted_)
    if held != "in memory":
        workers = sorted(client.scheduler_info()["workers"])[:1] if held == "persisted on one worker" else None
        df = client.persist(df, workers=workers)
        wait(df)
    y = dask_octopus.balance(df, client=client, per_worker=per_worker)
    pd.testing.assert_frame_equal(client.compute(y).result(), frame)
    if y.known_divisions:
        assert df.known_divisions
    z = client.persist(y.a + 1)
    wait(z)
    pd.testing.assert_series_equal(client.compute(z).result(), frame.a + 1)
    (name,) = {k[0] for k in y.__dask_graph__() if isinstance(k, tuple) and key_split(k) == "octopus-rows"}
    plan = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins["octopus"].placement.plans[name])
    ran = client.run_on_scheduler(_ran)
    assert len(plan.workers) == y.npartitions
    for key in z.__dask_keys__():  # each partition of y.a + 1 ran where its partition of y is planned
        assert ran[key] == plan.workers[key[1]], (key, ran[key], plan.workers)
