"""../../2026-12-05-cpu/13d6ca6-interleaved-blocks/interleaved_blocks.py on GPU workers: a persisted CuPy
array whose blocks Dask spread over two dask-cuda workers (sharing GPU 0: devices 0,0), each variant on
its own copy, mapped and summed inside annotate, new keys each compute; plain Dask, annotate without
and with the plugin (task cost 1 ms and 1 s), after balance. Arguments: rows and columns of a block,
protocol (default 2 8 ucx)."""
import sys
from pathlib import Path

import cupy
import dask
import dask.array as da
from distributed import wait

import dask_octopus
from dask_octopus.bench.experiment import local_cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "2026-12-05-cpu" / "13d6ca6-interleaved-blocks"))
from interleaved_blocks import measure  # noqa: E402  (the CPU run's variants, timings and copies)


def bandwidths(client):
    return client.run_on_scheduler(lambda dask_scheduler: (dask_scheduler.bandwidth,
                                                           dict(dask_scheduler.bandwidth_workers)))


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
        print("scheduler bandwidth (B/s), overall and per pair:", bandwidths(client), flush=True)
        measure(client, x, "annotate, plugin")
        with dask.config.set({"octopus.fragments.task-cost": "1s"}):
            measure(client, x, "annotate, plugin, task 1 s")
        print("scheduler bandwidth (B/s), overall and per pair:", bandwidths(client), flush=True)
        measure(client, dask_octopus.balance(x), "annotate, plugin, balanced")
