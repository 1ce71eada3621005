"""A script's own function mapped over 1024 persisted blocks and summed, computed again and again inside
``annotate`` (the same keys each compute): the time the scheduler spends finding or making the fragment
plan (``PlanMemo.plan``), how many computes were planned, and each compute's time; beside it the same
pipeline with the library's function (pickled by reference: the same object on the scheduler each
compute). One one-thread worker process, the scheduler in this process (``LocalCluster``), so the
graph is pickled on its way there and ``__main__`` functions arrive as new objects each compute.

    PYTHONPATH=<package> python plan_memo_script_functions.py [RUNS]
"""

import statistics
import sys
import time

import dask.array as da
import numpy as np
from distributed import Client, LocalCluster, wait

import dask_octopus
from dask_octopus.bench.workloads import elementwise_chain
from dask_octopus.groups import memo, rewrite


def chain(b):  # the script's function: pickled by value, unpickled anew on the scheduler each compute
    return elementwise_chain(b)


def main(runs: int) -> None:
    spent, planned = [], []
    plan, make = memo.PlanMemo.plan, rewrite._fragment_graph

    def timed_plan(self, *args):
        t0 = time.perf_counter()
        try:
            return plan(self, *args)
        finally:
            spent.append(time.perf_counter() - t0)

    memo.PlanMemo.plan = timed_plan
    rewrite._fragment_graph = lambda *args: planned.append(1) or make(*args)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        dask_octopus.register(client)
        x = client.persist(da.random.default_rng(0).random((1024 * 64, 96), chunks=(64, 96)).astype("f4"))
        wait(x)
        expected = float(np.stack([elementwise_chain(b).sum() for b in
                                   np.split(x.compute(), 1024)]).sum())
        for label, func in [("script's function (__main__)", chain), ("library function", elementwise_chain)]:
            spent.clear(), planned.clear()
            totals, values = [], []
            for _ in range(runs):
                t0 = time.perf_counter()
                with dask_octopus.annotate():
                    values.append(client.compute(x.map_blocks(func, dtype=x.dtype).sum()).result())
                totals.append(time.perf_counter() - t0)
                time.sleep(0.2)
            same = all(abs(v - expected) <= 1e-4 * abs(expected) for v in values)
            print(f"{label}: planned {len(planned)} of {runs} computes; plan lookup/making first "
                  f"{spent[0] * 1e3:.1f} ms, then median {statistics.median(spent[2:]) * 1e3:.1f} ms "
                  f"(runs 3-{runs}); compute first {totals[0] * 1e3:.0f} ms, then median "
                  f"{statistics.median(totals[2:]) * 1e3:.0f} ms; results equal the loop's: {same}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
