"""Which threads of a dask-cuda worker (and of the client process hosting the scheduler) use the CPU
while the worker is idle and while a launch-bound CuPy loop runs in it, over TCP and UCX.

UCX's memory hooks do not slow the loop (``ucx_hooks_probe.txt``); the loop is still 2-3x slower
inside a UCX worker and in a client process with live UCX connections. Here each thread's CPU time
is read from ``/proc/self/task`` (names from ``threading`` or the kernel) over one idle second and
over 5 runs of the chain-sum loop (1024 CuPy blocks 256x384 float32, 8 elementwise kernels and a
sum each), beside the loop thread's wall time, CPU time and context switches; in the worker also
with Python's switch interval (5 ms) set to 0.1 ms and 20 ms.

    python worker_threads_probe.py > worker_threads_probe.txt
"""

import os
import sys
import threading
import time


def thread_cpu():
    """CPU seconds of each thread of this process, by name (threading's name, else the kernel's)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except FileNotFoundError:
            continue
        name = f"{names.get(int(tid), comm)}[{tid}]"
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


def switches():
    with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
        rows = dict(line.split(":", 1) for line in f)
    return int(rows["voluntary_ctxt_switches"]), int(rows["nonvoluntary_ctxt_switches"])


def busy(before, after, seconds):
    """Threads that used more than 2% of a core, as percent of a core."""
    got = {k: round(100 * (after.get(k, 0) - v) / seconds) for k, v in before.items()}
    return {k: v for k, v in sorted(got.items(), key=lambda kv: -kv[1]) if v > 2}


def probe(switch=None):
    import cupy as cp

    from dask_octopus.bench.workloads import elementwise_chain

    rng = cp.random.default_rng(0)
    blocks = [rng.random((256, 384), dtype=cp.float32) for _ in range(1024)]

    def loop():
        return float(cp.stack([elementwise_chain(b).sum() for b in blocks]).sum())

    loop()
    saved = sys.getswitchinterval()
    if switch:
        sys.setswitchinterval(switch)
    a = thread_cpu()
    time.sleep(1.0)
    b = thread_cpu()
    idle = busy(a, b, 1.0)
    s0, t0, c0 = switches(), time.perf_counter(), time.thread_time()
    a = thread_cpu()
    for _ in range(5):
        loop()
    b = thread_cpu()
    wall, cpu, s1 = time.perf_counter() - t0, time.thread_time() - c0, switches()
    sys.setswitchinterval(saved)
    return {"loop_wall_ms": round(200 * wall, 1), "loop_cpu_ms": round(200 * cpu, 1),
            "switches_per_loop": [round((s1[i] - s0[i]) / 5) for i in (0, 1)],
            "affinity": len(os.sched_getaffinity(0)), "idle_busy_%": idle, "loop_busy_%": busy(a, b, wall)}


def main():
    import dask
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    print(f"python {sys.version.split()[0]}, {time.strftime('%Y-%m-%d %H:%M:%S')}", flush=True)
    print("one process, no cluster:", probe(), flush=True)
    for protocol, mode in [("tcp", None), ("ucx", None), ("ucx", "thread")]:
        if mode:
            os.environ["UCXPY_PROGRESS_MODE"] = mode
        with dask.config.set({"distributed.worker.profile.enabled": True}), \
                LocalCUDACluster(CUDA_VISIBLE_DEVICES="0", protocol=protocol, dashboard_address=None,
                                 threads_per_worker=1) as cluster, Client(cluster) as client:
            client.submit(sum, [1, 2]).result()  # the connections live
            label = f"{protocol}" + (f", UCXPY_PROGRESS_MODE={mode}" if mode else "")
            print(f"{label}, in the worker:", client.submit(probe, pure=False).result(), flush=True)
            print(f"{label}, in the client process (scheduler there):", probe(), flush=True)
            for switch in (1e-4, 2e-2):
                print(f"{label}, in the worker, sys.setswitchinterval({switch}):",
                      client.submit(probe, switch, pure=False).result(), flush=True)
        os.environ.pop("UCXPY_PROGRESS_MODE", None)


if __name__ == "__main__":
    main()
