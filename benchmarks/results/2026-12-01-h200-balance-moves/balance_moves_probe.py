"""Bytes a CuPy re-chunk by ``balance`` moves between two dask-cuda workers (sharing GPU 0, UCX), against
the rows that change worker: the GPU side of
``tests/test_balance.py::test_a_re_chunk_moves_only_the_rows_that_change_worker`` (CuPy blocks reach
the rewrite as Dask's aliases of slices, NumPy ones through ``aligned``).

Fixed speeds 1:3 (no calibration), 4000 x 25,000 float32 rows (400 MB) in 2 or 4 input blocks laid out
half on each worker, 4 blocks per worker after ``balance``.

    python balance_moves_probe.py > balance_moves_probe.txt
"""

import sys
import time

import cupy as cp
import dask
import dask.array as da
import numpy as np
from distributed import wait

import dask_octopus
from dask_octopus.bench.experiment import local_cluster

COLS = 25_000


def received(dask_worker):
    return sum(e["total"] for e in dask_worker.transfer_incoming_log)


def clear(dask_worker):
    dask_worker.transfer_incoming_log.clear()


def main():
    print(f"python {sys.version.split()[0]}, {time.strftime('%Y-%m-%d %H:%M:%S')}", flush=True)
    with dask.config.set({"octopus.refine.min-duration": "1h"}), \
            local_cluster(True, "0,0", protocol="ucx") as client:
        dask_octopus.register(client, calibrate=False)
        first, last = sorted(client.scheduler_info()["workers"])

        def priors(dask_scheduler, speeds):
            for w, v in speeds.items():
                dask_scheduler.plugins["octopus"].model.set_prior(w, {"compute": v, "memory": v})

        client.run_on_scheduler(priors, speeds={first: 1.0, last: 3.0})
        for blocks in (2, 4):
            with dask.annotate(workers=lambda k, n=blocks: [last] if k[1] < n // 2 else [first]):
                x = da.random.random((4000, COLS), chunks=(4000 // blocks, COLS)).map_blocks(cp.asarray,
                                                                                            dtype=np.float64)
            x = client.persist(x.astype(np.float32), optimize_graph=False)
            wait(x)
            held = {k[1]: ws[0] for k, ws in client.who_has(x).items()}
            y = dask_octopus.balance(x, client=client, per_worker=4)
            planned = client.run_on_scheduler(lambda dask_scheduler, n=y.name:
                                              dask_scheduler.plugins["octopus"].placement.plans[n].workers)
            ends = np.cumsum(y.chunks[0])
            away = sum(max(0, min(end, (j + 1) * x.chunks[0][0]) - max(end - size, j * x.chunks[0][0]))
                       for i, (end, size) in enumerate(zip(ends, y.chunks[0]))
                       for j in held if held[j] != planned[i])
            client.run(clear)
            t = time.perf_counter()
            y = client.persist(y)
            wait(y)
            seconds = time.perf_counter() - t
            moved = sum(client.run(received).values())
            copies = sum(len(ws) > 1 for ws in client.who_has(x).values())
            same = bool(cp.array_equal(*client.gather(client.compute([y, x]))))
            print(f"{blocks} input blocks -> chunks {y.chunks[0]}: moved {moved:,} bytes; the rows that change "
                  f"worker are {away * COLS * 4:,} bytes; input blocks copied: {copies}; re-chunk "
                  f"{1000 * seconds:.0f} ms; values equal: {same}", flush=True)
            del x, y


if __name__ == "__main__":
    main()
