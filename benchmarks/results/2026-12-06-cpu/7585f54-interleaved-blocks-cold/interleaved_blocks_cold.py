"""A persisted array whose blocks Dask spread over the workers, then the README pattern (a map_blocks
built inside annotate, summed): tasks run and seconds per compute, plain Dask (no annotate),
annotated without and with the plugin, and with it at a task cost of 1 s (fragments then fetch the
blocks unless moving them takes longer). Every compute reads its own copy of the input, made block by
block where each block is: no replica that an earlier compute's fetches left (those make a later
compute of the same input cheaper). New keys each compute.
Uses ``copy_of`` and ``normalise`` of ../../2026-12-05-cpu/13d6ca6-interleaved-blocks/interleaved_blocks.py:
run with that folder on PYTHONPATH (the worker processes import it too).
Arguments: rows and columns of a block (default 2 8), of 512 blocks stacked by rows; workers (default 2)."""
import statistics
import sys
import time

import dask
import dask.array as da
from distributed import Client, LocalCluster, get_task_stream, wait
from interleaved_blocks import copy_of, normalise

import dask_octopus


def figures(dask_scheduler):
    """The scheduler's bandwidth figures (B/s): overall, and per pair of workers, sorted."""
    return round(dask_scheduler.bandwidth), sorted(round(bw) for bw in dask_scheduler.bandwidth_workers.values())


def measure(client, x, label, annotated=True, runs=6):
    tasks, times = [], []
    for i in range(runs):
        y, same = copy_of(client, x, f"{label}-{i}")
        assert same == x.npartitions
        t0 = time.perf_counter()
        with get_task_stream(client) as ts:
            if annotated:
                with dask_octopus.annotate():
                    z = y.map_blocks(normalise, name=f"{label}-{i}")
            else:
                z = y.map_blocks(normalise, name=f"{label}-{i}")
            z.sum().compute()
        times.append(time.perf_counter() - t0)
        tasks.append(len(ts.data))
        del y, z
    print(f"{label:28s} tasks {tasks[-1]:5d}  median {statistics.median(times[1:]):.3f} s  "
          f"runs {[round(t, 3) for t in times]}", flush=True)


if __name__ == "__main__":
    given = [int(a) for a in sys.argv[1:]]
    rows, cols, workers = given + [2, 8, 2][len(given):]
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        x = da.random.random((512 * rows, cols), chunks=(rows, cols)).persist()
        wait(x)
        who = client.who_has(x)
        names = sorted({w for ws in who.values() for w in ws})
        layout = "".join(str(names.index(who[k][0])) for k in sorted(who, key=lambda k: k[1]))
        print("holder of blocks 0-63:", layout[:64],
              "blocks per worker:", [layout.count(str(i)) for i in range(workers)])
        measure(client, x, "plain Dask", annotated=False)
        measure(client, x, "annotate, no plugin")
        dask_octopus.register(client)
        print("scheduler bandwidth (B/s), overall and per pair (sorted):", client.run_on_scheduler(figures))
        measure(client, x, "annotate, plugin")
        with dask.config.set({"octopus.fragments.task-cost": "1s"}):
            measure(client, x, "annotate, plugin, task 1 s")
        print("scheduler bandwidth (B/s), overall and per pair (sorted):", client.run_on_scheduler(figures))
