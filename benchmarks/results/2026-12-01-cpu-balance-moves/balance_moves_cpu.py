"""Bytes a NumPy re-chunk by ``balance`` moves between two CPU workers, against the rows that change
worker, and the input blocks left copied on a second worker: the shapes of
``tests/test_balance.py::test_a_re_chunk_moves_only_the_rows_that_change_worker``, run at a commit
before the change and at one after it (the same script).

Two one-thread worker processes (``LocalCluster``), fixed speeds 1:3 (no calibration), 4000 x 100
float64 in 2 or 4 row blocks laid out half on each worker, 4 blocks per worker after ``balance``.

    python balance_moves_cpu.py
"""

import subprocess
import sys
import time

import dask
import dask.array as da
import numpy as np
from distributed import Client, LocalCluster, wait

import dask_octopus


def received(dask_worker):
    return sum(e["total"] for e in dask_worker.transfer_incoming_log)


def clear(dask_worker):
    dask_worker.transfer_incoming_log.clear()


def priors(dask_scheduler, speeds):
    for w, v in speeds.items():
        dask_scheduler.plugins["octopus"].model.set_prior(w, {"compute": v, "memory": v})


def main():
    commit = subprocess.run(["git", "log", "--oneline", "-1"], capture_output=True, text=True).stdout.strip()
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')}, python {sys.version.split()[0]}, dask {dask.__version__}, "
          f"commit {commit}", flush=True)
    with dask.config.set({"octopus.refine.min-duration": "1h"}), \
            LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        dask_octopus.register(client, calibrate=False)
        first, last = sorted(client.scheduler_info()["workers"])
        client.run_on_scheduler(priors, speeds={first: 1.0, last: 3.0})
        for blocks in (2, 4):
            with dask.annotate(workers=lambda k, n=blocks: [last] if k[1] < n // 2 else [first]):
                x = da.random.random((4000, 100), chunks=(4000 // blocks, 100))
            x = client.persist(x, optimize_graph=False)
            wait(x)
            y = dask_octopus.balance(x, client=client, per_worker=4)
            client.run(clear)
            y = client.persist(y)
            wait(y)
            moved = sum(client.run(received).values())
            copies = sum(len(ws) > 1 for ws in client.who_has(x).values())
            same = bool(np.array_equal(*client.gather(client.compute([y, x]))))
            print(f"{blocks} input blocks -> chunks {y.chunks[0]}: moved {moved:,} bytes; input blocks copied: "
                  f"{copies}; values equal: {same}", flush=True)
            del x, y


if __name__ == "__main__":
    main()
