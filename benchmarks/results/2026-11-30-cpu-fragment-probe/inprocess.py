"""Where the fragment floor's time goes, in one process (no distributed): the same 1024 x (64, 96)
blocks, chain and sum, run by Dask's synchronous scheduler on the optimized graph, by a plain walk of
the graph's tasks in dask.order's order (each Task called on a dict of its inputs), and by the loop.

    python benchmarks/results/2026-11-30-cpu-fragment-probe/inprocess.py
"""

import statistics
import time

import dask
import dask.array as da
import numpy as np
from dask.core import flatten
from dask.order import order

from dask_octopus._compat import convert_legacy_graph
from dask_octopus.bench.small_tasks import chain_sum
from dask_octopus.bench.workloads import elementwise_chain

BLOCKS, SHAPE = 1024, (64, 96)
local = np.random.default_rng(0).random((BLOCKS * SHAPE[0], SHAPE[1]))
x = da.from_array(local, chunks=SHAPE).persist(scheduler="sync")  # blocks as data, as on a worker
(y,) = dask.optimize(chain_sum(x, "chain"))
dsk = convert_legacy_graph(dict(y.__dask_graph__()))
key = next(flatten(y.__dask_keys__()))
ranks = order(dsk)
steps = sorted(dsk, key=ranks.__getitem__)


def walk():
    values = {}
    for k in steps:
        node = dsk[k]
        values[k] = node({d: values[d] for d in node.dependencies})
    return values[key]


blocks = [local[i * SHAPE[0]:(i + 1) * SHAPE[0]] for i in range(BLOCKS)]
ways = {"dask sync scheduler": lambda: dask.get(dsk, key), "walk in dask.order": walk,
        "loop": lambda: np.stack([elementwise_chain(b).sum() for b in blocks]).sum()}
ref = float(ways["loop"]())
for name, f in ways.items():
    assert np.isclose(float(f()), ref)
    secs = []
    for _ in range(5):
        t = time.perf_counter()
        f()
        secs.append(time.perf_counter() - t)
    print(f"{name:>20}: {statistics.median(secs) * 1e3:7.1f} ms ({len(dsk)} tasks)")

# the walk's time per kind of task (key name prefix), one walk
from collections import defaultdict  # noqa: E402

from dask.utils import key_split  # noqa: E402

spent, count, values = defaultdict(float), defaultdict(int), {}
for k in steps:
    node = dsk[k]
    t = time.perf_counter()
    values[k] = node({d: values[d] for d in node.dependencies})
    spent[key_split(k)] += time.perf_counter() - t
    count[key_split(k)] += 1
for name in sorted(spent, key=spent.get, reverse=True):
    print(f"{name:>30}: {count[name]:5d} tasks, {spent[name] * 1e3:7.1f} ms, {spent[name] / count[name] * 1e6:6.1f} us each")
