"""distributed-ucxx's progress settings against a launch-bound loop in the worker, Dask's task
latency and a 1 GiB move between two workers on one GPU.

By default distributed-ucxx progresses UCX in "blocking" mode with Python futures off, so every
pending receive (each Dask comm keeps one) waits by yielding to the event loop
(``UCXRequest.wait_yield``): the loop never sleeps and takes the GIL back from a worker thread at
every CuPy launch, which releases it (``event_loop_sampler.txt``, ``worker_threads_probe.txt``).
With ``UCXPY_PROGRESS_MODE=thread`` and ``UCXPY_ENABLE_PYTHON_FUTURE=1`` a C++ thread progresses UCX
and completed requests wake their futures. Each setting runs in a fresh process (UCX reads them once),
the workers inheriting the environment: two dask-cuda workers sharing GPU 0, one thread each.

    python ucx_progress_probe.py > ucx_progress_probe.txt
"""

import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {
    "tcp": ("tcp", {}),
    "ucx, distributed-ucxx's default (blocking, no Python futures)": ("ucx", {}),
    "ucx, thread + Python futures": ("ucx", {"UCXPY_PROGRESS_MODE": "thread", "UCXPY_ENABLE_PYTHON_FUTURE": "1"}),
    "ucx, thread-polling + Python futures": ("ucx", {"UCXPY_PROGRESS_MODE": "thread-polling",
                                                     "UCXPY_ENABLE_PYTHON_FUTURE": "1"}),
}


def child(protocol):
    import cloudpickle
    import cupy as cp
    from distributed import wait

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import worker_threads_probe

    from dask_octopus.bench.experiment import local_cluster

    cloudpickle.register_pickle_by_value(worker_threads_probe)
    out = {}
    with local_cluster(True, "0,0", protocol=protocol) as client:
        a, b = sorted(client.scheduler_info()["workers"])[:2]
        out["worker"] = client.submit(worker_threads_probe.probe, pure=False, workers=[a]).result()
        out["client process"] = worker_threads_probe.probe()
        lat = []
        for i in range(200):
            t = time.perf_counter()
            client.submit(abs, -i, pure=False, workers=[a]).result()
            lat.append(time.perf_counter() - t)
        out["one task round trip ms (median of 200)"] = round(1000 * statistics.median(lat), 2)
        t = time.perf_counter()
        futures = client.map(abs, range(-2000, 0), pure=False, workers=[a])
        wait(futures)
        out["2000 tasks ms"] = round(1000 * (time.perf_counter() - t), 1)
        del futures
        moves = []
        for i in range(4):
            x = client.submit(lambda i: cp.full(2**28, i, dtype=cp.float32), i, workers=[a], pure=False)
            wait(x)
            t = time.perf_counter()
            s = client.submit(lambda v: float(v.sum()), x, workers=[b], pure=False).result()
            moves.append(round(1000 * (time.perf_counter() - t), 1))
            assert s == float(i) * 2**28, s
            del x
        out["move 1 GiB ms"] = moves
    print(json.dumps(out))


def main():
    print(f"python {sys.version.split()[0]}, {time.strftime('%Y-%m-%d %H:%M:%S')}", flush=True)
    for label, (protocol, env) in SETTINGS.items():
        got = subprocess.run([sys.executable, __file__, "--child", protocol], env={**os.environ, **env},
                             capture_output=True, text=True, timeout=150)
        if got.returncode:
            print(f"== {label}: failed\n{got.stderr[-3000:]}", flush=True)
            continue
        print(f"== {label} {env}", flush=True)
        for k, v in json.loads(got.stdout.strip().splitlines()[-1]).items():
            print(f"  {k}: {v}", flush=True)


if __name__ == "__main__":
    if "--child" in sys.argv:
        child(sys.argv[sys.argv.index("--child") + 1])
    else:
        main()
