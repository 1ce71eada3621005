import sys, time, dask.array as da, numpy as np
from distributed import Client, LocalCluster, wait
import dask_octopus
def normalise(b): return (b - b.mean()) / (b.std() + 1)
if __name__ == "__main__":
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, Client(cluster) as client:
        x = da.random.random((1024, 8), chunks=(2, 8)).persist(); wait(x)
        dask_octopus.register(client)
        ts = []
        for i in range(8):
            t0 = time.perf_counter()
            with dask_octopus.annotate():
                z = x.map_blocks(normalise, name=f"n{i}")
            z.sum().compute()
            ts.append(time.perf_counter() - t0)
        print(sys.argv[1], "median %.3f min %.3f" % (np.median(ts[2:]), min(ts[2:])), [round(t, 3) for t in ts])
