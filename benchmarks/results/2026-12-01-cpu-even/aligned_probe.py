"""balance re-chunking an unpersisted 200,000 x 64 NumPy array over 2 CPU workers (weights 0.53 / 0.47):
whether each balanced block is aligned, a view, and how long a.T @ a takes on it (argument off: without
the aligned copies of 337da8c)."""
import sys, time, numpy as np, dask, dask.array as da
from distributed import Client, LocalCluster, wait, futures_of
import dask_octopus
from dask_octopus.plugins.scheduler import OctopusSchedulerPlugin
def t(a):
    s = time.perf_counter(); a.T @ a; return round(1000*(time.perf_counter()-s),1)
if __name__ == "__main__":
    import dask_octopus.placement.blocks as blocks
    if sys.argv[1:] == ["off"]:  # the re-chunk as before 337da8c
        blocks._copied_where_unaligned = lambda y: y
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cl, Client(cl) as c:
        c.register_plugin(OctopusSchedulerPlugin(calibrate=False))
        c.run_on_scheduler(lambda dask_scheduler: [dask_scheduler.plugins["octopus"].model.set_prior(w, {"compute": v, "memory": v}) for w, v in zip(sorted(dask_scheduler.workers), [0.53, 0.47])])
        for i in range(3):
            x = da.random.random((200000, 64), chunks=(100000, 64))
            y = c.persist(dask_octopus.balance(x, client=c)); wait(y)
            keys = [f.key for f in futures_of(y)]
            print("block rows", y.chunks[0], "per worker: (key, aligned, a view, ms of a.T @ a)", c.run(lambda dask_worker: [(str(k[0])[:20], dask_worker.data[k].flags.aligned, dask_worker.data[k].base is not None, t(dask_worker.data[k])) for k in keys if k in dask_worker.data]))
