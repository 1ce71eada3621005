"""Speeds collapse after the same Dask key prefix does different work on different workers."""
import numpy as np, dask.array as da, dask, time
from distributed import Client, LocalCluster
import dask_octopus as do

def slow(b):
    time.sleep(0.3); return b + 1

def short(d):
    return {k[-5:]: round(v, 3) for k, v in d.items()}

if __name__ == "__main__":
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True, dashboard_address=None) as cl, Client(cl) as c:
        do.register(c)
        W = sorted(c.scheduler_info()["workers"])
        print("calibrated:", short(do.speeds(c)))
        x = da.random.random((60000, 200), chunks=(5000, 200)).persist()
        y = do.balance(x, client=c, per_worker=2).persist()
        print("plan", y.chunks[0])
        for _ in range(4):   # A: ~10 ms tasks, prefix e.g. 'sin-sum-sum-aggregate'
            np.sin(y).sum(axis=1).compute()
        print("after A:", short(do.speeds(c)))
        z = y.map_blocks(slow).sum(axis=1)   # B: same fused prefix, 0.3 s tasks, on 2 workers only
        for _ in range(2):
            c.compute(z, workers=W[1:], allow_other_workers=False).result()
        time.sleep(2)
        print("after B:", short(do.speeds(c)))
        def tab(dask_scheduler):
            from dask_octopus.plugins.scheduler import registered_plugin
            return {k: {w[-5:]: (round(v[1], 4), v[2]) for w, v in d.items()} for k, d in registered_plugin(dask_scheduler).model.table().items()}
        for k, v in c.run_on_scheduler(tab).items(): print("  prefix", k, "(median s, n):", v)
        print("next plan of x:", do.balance(x, client=c, per_worker=1).chunks[0])
