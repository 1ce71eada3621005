# Worker "0" is 3x slower per row than worker "1" (truth: weights 0.25 / 0.75).
# The input is NOT persisted: balance() re-chunks it each pass and the work is fused into rechunk tasks.
import time, dask.array as da, distributed
from distributed import Client, LocalCluster, get_worker
import dask_octopus as do

def work(b):
    time.sleep(len(b) * (6e-4 if get_worker().name == 0 else 2e-4))
    return b + 1

if __name__ == "__main__":
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
    client = Client(cluster); do.register(client)
    names = {a: w["name"] for a, w in client.scheduler_info()["workers"].items()}
    x = da.zeros((4000, 10), chunks=(100, 10))
    for i in range(10):
        b = do.balance(x)
        w0 = do.speeds(client)
        t = time.time()
        with distributed.get_task_stream(client) as ts:
            assert b.map_blocks(work, dtype=b.dtype).sum().compute() == 40000
        el = time.time() - t
        per = {}
        for d in ts.data:
            dur = sum(s["stop"] - s["start"] for s in d["startstops"] if s["action"] == "compute")
            if dur > 0.005:
                p = per.setdefault(names[d["worker"]], [0, 0.0, set()]); p[0] += 1; p[1] += dur; p[2].add(d["key"][0].split("-")[0] if isinstance(d["key"], tuple) else d["key"])
        w = do.speeds(client)
        print(i, f"pass {el:.2f}s", "planned w0=%.3f" % w0[[a for a in w0 if names[a] == 0][0]],
              "work tasks (n, s, prefix):", {k: (v[0], round(v[1], 2), sorted(v[2])) for k, v in sorted(per.items())},
              "-> weight of slow worker 0: %.3f (truth 0.25)" % w[[a for a in w if names[a] == 0][0]], flush=True)
    client.close(); cluster.close()
