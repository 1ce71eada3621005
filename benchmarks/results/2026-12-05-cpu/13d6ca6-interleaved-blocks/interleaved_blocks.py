"""A persisted array whose blocks Dask spread over two workers, then the README pattern (a map_blocks
built inside annotate, summed): tasks run and seconds per compute, with and without the plugin,
after balance, and plain Dask (no annotate); with the plugin also at a task cost of 1 s (fragments
then fetch the blocks unless moving them takes longer). Each variant computes on its own copy of the
input, made block by block where each block is (no replicas left by an earlier variant's fetches).
New keys each compute (a name per run).
Arguments: rows and columns of a block (default 2 8), of 512 blocks stacked by rows."""
import statistics
import sys
import time

import dask
import dask.array as da
from distributed import Client, LocalCluster, get_task_stream, wait

import dask_octopus


def normalise(b):
    return (b - b.mean()) / (b.std() + 1)


def copy_of(client, x, label):
    """``x`` copied block by block where each block is (new keys: no replica that an earlier variant's
    fetches left), and how many of the copy's blocks lie where the original's do."""
    y = x.map_blocks(lambda b: b.copy(), name=f"copy-{label}").persist()
    wait(y)
    old, new = client.who_has(x), client.who_has(y)
    same = sum(new[(y.name, *k[1:])] == old[k] for k in old)
    return y, same


def measure(client, x, label, annotated=True, runs=6):
    x, same = copy_of(client, x, label)
    tasks, times = [], []
    for i in range(runs):
        t0 = time.perf_counter()
        with get_task_stream(client) as ts:
            if annotated:
                with dask_octopus.annotate():
                    z = x.map_blocks(normalise, name=f"{label}-{i}")
            else:
                z = x.map_blocks(normalise, name=f"{label}-{i}")
            z.sum().compute()
        times.append(time.perf_counter() - t0)
        tasks.append(len(ts.data))
    print(f"{label:28s} tasks {tasks[-1]:5d}  median {statistics.median(times[1:]):.3f} s  "
          f"runs {[round(t, 3) for t in times]}  (copy: {same} of {x.npartitions} blocks where the input's)",
          flush=True)


if __name__ == "__main__":
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        rows, cols = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (2, 8)
        x = da.random.random((512 * rows, cols), chunks=(rows, cols)).persist()
        wait(x)
        who = client.who_has(x)
        workers = sorted({w for ws in who.values() for w in ws})
        layout = "".join(str(workers.index(who[k][0])) for k in sorted(who, key=lambda k: k[1]))
        print("holder of blocks 0-63:", layout[:64])
        measure(client, x, "plain Dask", annotated=False)
        measure(client, x, "annotate, no plugin")
        dask_octopus.register(client)
        print("scheduler bandwidth (B/s), overall and per pair:", client.run_on_scheduler(
            lambda dask_scheduler: (dask_scheduler.bandwidth, dict(dask_scheduler.bandwidth_workers))))
        measure(client, x, "annotate, plugin")
        with dask.config.set({"octopus.fragments.task-cost": "1s"}):
            measure(client, x, "annotate, plugin, task 1 s")
        print("scheduler bandwidth (B/s), overall and per pair:", client.run_on_scheduler(
            lambda dask_scheduler: (dask_scheduler.bandwidth, dict(dask_scheduler.bandwidth_workers))))
        xb = dask_octopus.balance(x)
        measure(client, xb, "annotate, plugin, balanced")
