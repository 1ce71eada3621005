"""../../2026-12-06-cpu/7585f54-interleaved-blocks-cold/interleaved_blocks_cold.py on GPU workers: a
persisted CuPy array whose blocks Dask spread over dask-cuda workers (several may share a GPU: devices
"0,0"), mapped and summed inside annotate, every compute on its own copy of the blocks (no replica
left by an earlier fetch), new keys each compute; plain Dask, annotate without and with the plugin
(task cost 1 ms and 1 s). Run with both results folders on PYTHONPATH (the workers import them).
Arguments: rows and columns of a block, protocol, devices (default 2 8 ucx 0,0)."""
import sys

import cupy
import dask
import dask.array as da
from distributed import wait
from interleaved_blocks_cold import figures, measure

import dask_octopus
from dask_octopus.bench.experiment import local_cluster

if __name__ == "__main__":
    given = sys.argv[1:]
    rows, cols, protocol, devs = given + ["2", "8", "ucx", "0,0"][len(given):]
    rows, cols = int(rows), int(cols)
    with local_cluster(True, devs, protocol=protocol) as client:
        x = da.random.random((512 * rows, cols), chunks=(rows, cols)).map_blocks(cupy.asarray).persist()
        wait(x)
        who = client.who_has(x)
        workers = sorted({w for ws in who.values() for w in ws})
        layout = "".join(str(workers.index(who[k][0])) for k in sorted(who, key=lambda k: k[1]))
        print(f"blocks of {rows}x{cols} float64 over {protocol} on devices {devs}; holder of blocks 0-63:",
              layout[:64], "blocks per worker:", [layout.count(str(i)) for i in range(len(workers))], flush=True)
        measure(client, x, "plain Dask", annotated=False)
        measure(client, x, "annotate, no plugin")
        dask_octopus.register(client)
        print("scheduler bandwidth (B/s), overall and per pair (sorted):", client.run_on_scheduler(figures),
              flush=True)
        measure(client, x, "annotate, plugin")
        with dask.config.set({"octopus.fragments.task-cost": "1s"}):
            measure(client, x, "annotate, plugin, task 1 s")
        print("scheduler bandwidth (B/s), overall and per pair (sorted):", client.run_on_scheduler(figures),
              flush=True)
