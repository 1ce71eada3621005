"""Time ``PlanMemo.plan`` (planning, with the memo) over N annotated computes of the chain-sum (1024
persisted 64x96 blocks, the 8-kernel chain, ``.sum()``) on a LocalCluster of one one-thread worker in
this process: the chain named anew each compute (new keys, as ``stream_groups.py`` repeats it) or the
same each time. Prints how many computes were planned and the milliseconds of each ``plan`` call."""
import sys
import time

from distributed import Client, LocalCluster

import dask_octopus
from dask_octopus.bench.small_tasks import chain_sum
from dask_octopus.bench.workloads import persist_on_workers, random_matrix
from dask_octopus.groups import memo, rewrite

planned = []
real = rewrite._fragment_graph
rewrite._fragment_graph = lambda *args: planned.append(1) or real(*args)
times = []
plan = memo.PlanMemo.plan


def timed(self, *args, **kwargs):
    t = time.perf_counter()
    try:
        return plan(self, *args, **kwargs)
    finally:
        times.append(time.perf_counter() - t)


memo.PlanMemo.plan = timed

if __name__ == "__main__":
    n, keys = int(sys.argv[1]), sys.argv[2]
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        x = persist_on_workers(client, random_matrix(1024 * 64, 96, chunks=(64, 96), gpu=False))
        seconds = []
        for i in range(n):
            t = time.perf_counter()
            with dask_octopus.annotate():
                client.compute(chain_sum(x, "chain" if keys == "same" else f"chain-{i}")).result()
            seconds.append(time.perf_counter() - t)
    ms = sorted(t * 1e3 for t in times[2:])
    total = sorted(s * 1e3 for s in seconds[2:])
    print(f"{keys} keys: planned {len(planned)} of {n}; plan ms {[round(t * 1e3, 1) for t in times]}; "
          f"median of computes 3-{n}: plan {ms[len(ms) // 2]:.1f} ms, compute {total[len(total) // 2]:.1f} ms")
