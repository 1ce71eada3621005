"""Memory the scheduler keeps after repeated annotated computes: Dask's log of the messages sent to the
worker (the last thousand, `distributed.admin.low-level-log-length`) and the process's RSS.

One worker process of 2 threads, the scheduler in this process; each compute
`(da.ones((512, 512), chunks=16).map_blocks(np.sin) * 2).sum(axis=0)` (1024 blocks), annotated or not,
then wait until the scheduler holds no task. Prints (computes, log entries, log MiB, RSS MiB) four
times.

    python scheduler_memory.py 1 120   # annotated, 120 computes
    python scheduler_memory.py 0 40    # plain Dask
"""
import contextlib
import gc
import os
import sys
import time
import types

import dask
import dask.array as da
import distributed
import numpy as np
import psutil

import dask_octopus


def deep(root):
    """Bytes of ``root`` and everything it refers to (not types, modules, functions)."""
    seen, stack, total = set(), [root], 0
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)):
            continue
        total += sys.getsizeof(o)
        stack.extend(gc.get_referents(o))
    return total


if __name__ == "__main__":
    annotated, n = sys.argv[1] == "1", int(sys.argv[2])
    dask.config.set({"octopus.calibration.seconds": 0.05})
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=True, dashboard_address=":0") as cluster, \
            distributed.Client(cluster) as client:
        dask_octopus.register(client)
        rows, start = [], time.time()
        for i in range(n):
            with dask_octopus.annotate() if annotated else contextlib.nullcontext():
                y = (da.ones((512, 512), chunks=16).map_blocks(np.sin) * 2).sum(axis=0)
            y.compute()
            while cluster.scheduler.tasks:
                time.sleep(0.01)
            if (i + 1) % (n // 4) == 0:
                gc.collect()
                log = next(iter(cluster.scheduler.stream_comms.values())).recent_message_log
                rows.append((i + 1, len(log), deep(log) // 2**20, psutil.Process(os.getpid()).memory_info().rss // 2**20))
        print("annotated" if annotated else "plain", "(computes, log entries, log MiB, RSS MiB):", rows,
              f"{time.time() - start:.0f} s")
