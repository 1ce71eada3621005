"""Probe for issue 15 (fragments): how fast could one Dask task that runs a worker's whole share of an
annotated graph be, on CPU, against Dask, today's stream groups and a plain loop?

1024 NumPy blocks of 64x96, the 8-kernel elementwise chain, then .sum() (Dask's tree reduction), on a
1-worker, 1-thread LocalCluster (processes). Variants, interleaved, median of RUNS:
- dask: unannotated (one task per block and per partial sum);
- groups: the whole compute inside annotate(resource="memory", group=64) (today's same-depth groups);
- fragment: ONE task on the worker that runs the same (optimized, fused) graph with Dask's synchronous
  scheduler: the floor of an executor that runs a fragment's members in dependency order in one task;
- loop: the plain NumPy loop in the client process.

    python benchmarks/results/2026-11-30-cpu-fragment-probe/probe.py OUT.json
"""

import json
import statistics
import sys
import time

import cloudpickle
import dask
import dask.array as da
import numpy as np
from dask.core import flatten
from distributed import Client, LocalCluster, futures_of

import dask_octopus
from dask_octopus.bench.small_tasks import chain_sum
from dask_octopus.bench.workloads import elementwise_chain

BLOCKS, SHAPE, RUNS = 1024, (64, 96), 5


def run_graph(held, body, key):
    """The fragment's floor: every task of the graph, in dependency order, inside this one task (the
    graph travels pickled, so that distributed does not read its tasks' references as dependencies)."""
    return dask.get({**held, **cloudpickle.loads(body)}, key)  # dask's synchronous scheduler


def main(out: str) -> None:
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        dask_octopus.register(client, calibrate=False)
        rng = np.random.default_rng(0)
        local = rng.random((BLOCKS * SHAPE[0], SHAPE[1]))
        x = client.persist(da.from_array(local, chunks=SHAPE))
        blocks = [local[i * SHAPE[0]:(i + 1) * SHAPE[0]] for i in range(BLOCKS)]
        counter = iter(range(10**9))

        def dask_run():
            return float(client.compute(chain_sum(x, f"chain-{next(counter)}")).result())

        def groups_run():
            with dask_octopus.annotate(resource="memory", group=64):
                return float(client.compute(chain_sum(x, f"chain-{next(counter)}")).result())

        def fragment_run():
            (y,) = dask.optimize(chain_sum(x, f"chain-{next(counter)}"))
            held = {f.key: f for f in futures_of(x)}  # the persisted blocks: the task's dependencies
            body = {k: v for k, v in dict(y.__dask_graph__()).items() if k not in held}
            key = next(flatten(y.__dask_keys__()))
            return float(client.submit(run_graph, held, cloudpickle.dumps(body), key, pure=False).result())

        def loop_run():
            return float(np.stack([elementwise_chain(b).sum() for b in blocks]).sum())

        ways = {"dask": dask_run, "groups": groups_run, "fragment": fragment_run, "loop": loop_run}
        values = {k: f() for k, f in ways.items()}  # warm-up, and the values agree
        ref = values["loop"]
        assert all(np.isclose(v, ref, rtol=1e-9) for v in values.values()), values
        seconds = {k: [] for k in ways}
        for _ in range(RUNS):
            for k, f in ways.items():
                start = time.perf_counter()
                f()
                seconds[k].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    record = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "blocks": BLOCKS, "shape": SHAPE,
              "seconds": seconds, "median_seconds": med,
              "speedup_vs_dask": {k: med["dask"] / m for k, m in med.items()},
              "x_loop": {k: m / med["loop"] for k, m in med.items()}}
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    for k in ways:
        print(f"{k:>9}: {med[k] * 1e3:8.1f} ms  {record['speedup_vs_dask'][k]:6.2f}x vs dask  "
              f"{record['x_loop'][k]:6.2f}x the loop")


if __name__ == "__main__":
    main(sys.argv[1])
