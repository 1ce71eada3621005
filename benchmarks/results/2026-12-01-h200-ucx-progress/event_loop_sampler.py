"""What an idle dask-cuda worker's event loop thread runs while it burns a core over UCX
(``worker_threads_probe.txt``: 100% of a core idle, none over TCP).

The worker's main thread (its event loop) is sampled 1000 times, 1 ms apart, from a task, and the
innermost frames of each sample counted, for the progress modes of distributed-ucxx.

    python event_loop_sampler.py > event_loop_sampler.txt
"""

import os
import sys
import time
from collections import Counter


def sample(n=1000, depth=4):
    import threading

    main = threading.main_thread().ident
    seen = Counter()
    for _ in range(n):
        frame = sys._current_frames().get(main)
        stack = []
        while frame is not None and len(stack) < depth:
            code = frame.f_code
            stack.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}")
            frame = frame.f_back
        seen[" <- ".join(stack)] += 1
        time.sleep(0.001)
    return seen.most_common(8)


def main():
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    print(f"python {sys.version.split()[0]}, {time.strftime('%Y-%m-%d %H:%M:%S')}", flush=True)
    for protocol, mode in [("ucx", None), ("ucx", "thread"), ("tcp", None)]:
        if mode:
            os.environ["UCXPY_PROGRESS_MODE"] = mode
        with LocalCUDACluster(CUDA_VISIBLE_DEVICES="0", protocol=protocol, dashboard_address=None,
                              threads_per_worker=1) as cluster, Client(cluster) as client:
            client.submit(sum, [1, 2]).result()
            label = f"{protocol}" + (f", UCXPY_PROGRESS_MODE={mode}" if mode else "")
            print(f"== {label}: the worker's event loop, idle", flush=True)
            for stack, count in client.submit(sample, pure=False).result():
                print(f"{count:5d}  {stack}", flush=True)
        os.environ.pop("UCXPY_PROGRESS_MODE", None)


if __name__ == "__main__":
    main()
