import time, dask, numpy as np
from distributed import Client, LocalCluster, wait
import dask_octopus
def mk(i): return np.ones((64, 64))
def f(x): return x.sum()
if __name__ == "__main__":
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as c, Client(c) as client:
        frames = client.map(mk, range(216), pure=False); wait(frames)
        for ann in (False, True, False, True):
            ts = []
            for r in range(5):
                t0 = time.perf_counter()
                if ann:
                    with dask_octopus.annotate():
                        y = dask.delayed(sum)([dask.delayed(f, pure=False)(x) for x in frames])
                else:
                    y = dask.delayed(sum)([dask.delayed(f, pure=False)(x) for x in frames])
                ts.append(time.perf_counter() - t0)
            print(ann, [round(t*1e3, 1) for t in ts])
        import cProfile, pstats
        pr = cProfile.Profile(); pr.enable()
        for r in range(5):
            y = dask.delayed(sum)([dask.delayed(f, pure=False)(x) for x in frames])
        pr.disable(); pstats.Stats(pr).sort_stats("cumulative").print_stats(18)
        pstats.Stats(pr).sort_stats("cumulative").print_callees("marks.py:70")
        from dask_octopus.groups import marks
        print(pstats.Stats(pr).sort_stats("tottime").print_stats(12))
