"""The CPU folder's interleaved_blocks.py on GPU workers: a persisted CuPy array whose blocks Dask
spread over two dask-cuda workers (sharing GPU 0: DEVS 0,0), mapped and summed inside annotate, new
keys each compute; plain Dask, annotate without and with the plugin (task cost 1 ms and 1 s), after
balance. Arguments: rows and columns of a block, protocol (default 2 8 ucx)."""
import statistics
import sys
import time

import cupy
import dask
import dask.array as da
from distributed import get_task_stream, wait

import dask_octopus
from dask_octopus.bench.experiment import local_cluster


def normalise(b):
    return (b - b.mean()) / (b.std() + 1)


def measure(client, x, label, annotated=True, runs=6):
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
          f"runs {[round(t, 3) for t in times]}", flush=True)


if __name__ == "__main__":
    rows, cols = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (2, 8)
    protocol = sys.argv[3] if len(sys.argv) > 3 else "ucx"
    with local_cluster(True, "0,0", protocol=protocol) as client:
        x = da.random.random((512 * rows, cols), chunks=(rows, cols)).map_blocks(cupy.asarray).persist()
        wait(x)
        who = client.who_has(x)
        workers = sorted({w for ws in who.values() for w in ws})
        layout = "".join(str(workers.index(who[k][0])) for k in sorted(who, key=lambda k: k[1]))
        print(f"blocks of {rows}x{cols} float64 over {protocol}; holder of blocks 0-63:", layout[:64], flush=True)
        measure(client, x, "plain Dask", annotated=False)
        measure(client, x, "annotate, no plugin")
        dask_octopus.register(client)
        measure(client, x, "annotate, plugin")
        with dask.config.set({"octopus.fragments.task-cost": "1s"}):
            measure(client, x, "annotate, plugin, task 1 s")
        print("scheduler bandwidth (B/s):", client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.bandwidth))
        measure(client, dask_octopus.balance(x), "annotate, plugin, balanced")
