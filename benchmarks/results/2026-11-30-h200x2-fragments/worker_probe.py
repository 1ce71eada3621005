"""The same executor and loop timed inside a dask-cuda worker (one GPU, one thread), over TCP and UCX,
with Dask's statistical profiler on and off: what the worker process's surroundings cost a
launch-bound loop of CuPy kernels (compare executor_probe.txt, one process without Dask).

    python benchmarks/results/2026-11-30-h200x2-fragments/worker_probe.py > worker_probe.txt
    python benchmarks/results/2026-11-30-h200x2-fragments/worker_probe.py --modes > worker_probe_modes.txt
"""

import os
import sys
import time

import dask
from dask_cuda import LocalCUDACluster
from distributed import Client

HERE = __file__.rsplit("/", 1)[0]


def in_worker():
    import cupy as cp

    sys.path.insert(0, HERE)
    from executor_probe import chain_sum_fragment, elementwise_chain

    from dask_octopus.groups import streams

    rng = cp.random.default_rng(0)
    blocks = [rng.random((256, 384), dtype=cp.float32) for _ in range(1024)]
    frag = chain_sum_fragment(1024)
    out = {}
    for name, fn in {"loop": lambda: float(cp.stack([elementwise_chain(b).sum() for b in blocks]).sum()),
                     "fragment": lambda: streams.run_fragment(frag, *blocks)}.items():
        fn()
        times = []
        for _ in range(5):
            cp.cuda.Device().synchronize()
            t = time.perf_counter()
            fn()
            cp.cuda.Device().synchronize()
            times.append(time.perf_counter() - t)
        out[name] = round(1000 * sorted(times)[2], 1)
    return out


def main():
    runs = [("tcp", None), ("ucx", None)] if "--modes" not in sys.argv else [
        ("ucx", None), ("ucx", "thread"), ("ucx", "thread-polling"), ("ucx", "polling"), ("tcp", None)]
    for protocol, mode in runs:
        if mode is None:
            os.environ.pop("UCXPY_PROGRESS_MODE", None)
        else:
            os.environ["UCXPY_PROGRESS_MODE"] = mode  # inherited by the worker processes
        for profile in (True, False) if "--modes" not in sys.argv else (True,):
            with dask.config.set({"distributed.worker.profile.enabled": profile,
                                  "octopus.streams.capture": False}), \
                    LocalCUDACluster(CUDA_VISIBLE_DEVICES="0", protocol=protocol, dashboard_address=None) as cluster, \
                    Client(cluster) as client:
                client.run(lambda: dask.config.set({"octopus.streams.capture": False}))
                got = client.submit(in_worker, pure=False).result()
                mode_text = mode or "unset (distributed-ucxx: blocking)"
                print(f"{protocol}, UCXPY_PROGRESS_MODE={mode_text}, worker profiler {'on' if profile else 'off'}: "
                      f"median ms {got}", flush=True)


if __name__ == "__main__":
    main()
