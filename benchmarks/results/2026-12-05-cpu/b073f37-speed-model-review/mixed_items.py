"""Two identical workers. map over one large item and ten small ones, each taking 5 ms + 1 ms per unit
of cost. The model's rate is cost / seconds, so the worker packed with the small items (whose fixed
5 ms dominates) looks several times slower, and later maps and balance plan it so."""
import sys, time
sys.path.insert(0, "/work/main")
from distributed import Client, LocalCluster
import dask_octopus

def work(c):
    time.sleep(0.005 + 0.001 * c)
    from distributed import get_worker
    return get_worker().address

if __name__ == "__main__":
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cl, Client(cl) as c:
        dask_octopus.register(c, calibrate=False)
        items = [100] + [1] * 10
        for run in range(5):
            t = time.perf_counter()
            where = c.gather(dask_octopus.map(work, items, cost=items, pure=False))
            dt = time.perf_counter() - t
            per = {}
            for w, it in zip(where, items):
                per.setdefault(w[-5:], []).append(it)
            print(f"map {run}: {dt:.3f} s; items per worker {({w: (len(v), sum(v)) for w, v in per.items()})}; "
                  f"speeds {({w[-5:]: round(v, 3) for w, v in dask_octopus.speeds(c).items()})}")
        p = c.run_on_scheduler(lambda dask_scheduler: {k: {w[-5:]: (round(u, 3), n) for w, (u, s, n) in v.items()}
                                                       for k, v in dask_scheduler.plugins["octopus"].model.table().items()})
        print("rates (units/s, timings):", p)
        x = __import__("dask.array", fromlist=["x"]).ones((1000, 10), chunks=500)
        y = dask_octopus.balance(x, client=c)
        print("balance of 1000 rows on these identical workers:", y.chunks[0])
        even = [10] * 20
        t = time.perf_counter()
        where = c.gather(dask_octopus.map(work, even, cost=even, pure=False))
        print(f"then a map of 20 items of cost 10 (15 ms each): {time.perf_counter() - t:.3f} s, items per worker",
              {w[-5:]: where.count(w) for w in set(where)}, "(even split: 10/10, ~0.15 s)")
