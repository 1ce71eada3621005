"""Real cluster (2 in-process workers, 1 thread each): worker A is 4x slower (a co-tenant) for the first
two maps of `work`, then as fast as B; 24 maps in all (the review ran 8 and found A given no item again)."""
import os, sys, time
sys.path.insert(0, "/work/main")
from distributed import Client, LocalCluster
import dask_octopus

FLAG = "/tmp/octopus-stuck-map/slow_worker"

def work(x):
    from distributed import get_worker
    try:
        slow = open(FLAG).read().strip() == get_worker().address
    except FileNotFoundError:
        slow = False
    time.sleep(0.4 if slow else 0.1)
    return get_worker().address

if __name__ == "__main__":
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cl, Client(cl) as c:
        dask_octopus.register(c, calibrate=False)
        a = sorted(c.scheduler_info()["workers"])[0]
        open(FLAG, "w").write(a)
        for run in range(24):
            if run == 2:
                os.remove(FLAG)
            n = 8 if run < 2 else 3
            t = time.perf_counter()
            where = c.gather(dask_octopus.map(work, list(range(run * 10, run * 10 + n)), pure=False))
            dt = time.perf_counter() - t
            print(f"map {run}: A {'4x slower' if run < 2 else 'as fast as B'}; items on A: {where.count(a)}/{n}; "
                  f"{dt:.2f} s; speeds {[round(v, 3) for k, v in sorted(dask_octopus.speeds(c).items())]}")
