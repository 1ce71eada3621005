"""Why a launch-bound CuPy loop runs 1.6-3x slower in a process that initialised UCX.

Each configuration runs in a fresh process: UCX initialised the way distributed-ucxx does it
(``init_once``) or not at all, with UCX's memory hooks (``UCX_MEM_*``) left on or turned off one by
one. In each: the plain chain-sum loop (1024 CuPy blocks 256x384 float32, 8 elementwise kernels and a
sum each) and the same work as one fragment run eagerly, wall time and the thread's CPU time (a
thread waiting for the GIL or the OS shows wall > CPU). Then the same inside a dask-cuda worker
(``LocalCUDACluster``, two workers on the GPUs of ``--devs``) with and without the best setting,
with a 1 GiB block moved from one worker to the other (UCX must still move device memory).

    python ucx_hooks_probe.py --devs 0,0 > ucx_hooks_probe.txt
"""

import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
HOOKS = {
    "malloc hooks off": {"UCX_MEM_MALLOC_HOOKS": "n"},
    "mmap hooks off": {"UCX_MEM_MMAP_HOOK_MODE": "none"},
    "memory events off": {"UCX_MEM_EVENTS": "n"},
    "cuda hooks off": {"UCX_MEM_CUDA_HOOK_MODE": "none"},
}
HOOKS["all four off"] = {k: v for env in HOOKS.values() for k, v in env.items()}


def measure():
    """The loop and the fragment in this process: median wall and thread CPU ms over 7 runs."""
    import cupy as cp
    import dask

    sys.path.insert(0, os.path.join(HERE, "..", "2026-11-30-h200x2-fragments"))
    from executor_probe import chain_sum_fragment

    from dask_octopus.bench.workloads import elementwise_chain
    from dask_octopus.groups import streams

    rng = cp.random.default_rng(0)
    blocks = [rng.random((256, 384), dtype=cp.float32) for _ in range(1024)]
    frag = chain_sum_fragment(1024)
    cases = {"loop": lambda: float(cp.stack([elementwise_chain(b).sum() for b in blocks]).sum()),
             "fragment": lambda: streams.run_fragment(frag, *blocks)}
    out = {}
    with dask.config.set({"octopus.streams.capture": False}):
        for name, fn in cases.items():
            fn()
            walls, cpus = [], []
            for _ in range(7):
                cp.cuda.Device().synchronize()
                t, c = time.perf_counter(), time.thread_time()
                fn()
                cp.cuda.Device().synchronize()
                walls.append(time.perf_counter() - t)
                cpus.append(time.thread_time() - c)
            out[name] = {"wall_ms": round(1000 * statistics.median(walls), 1),
                         "cpu_ms": round(1000 * statistics.median(cpus), 1)}
    out["threads"] = len(os.listdir("/proc/self/task"))
    return out


def child(use_ucx):
    if use_ucx:
        from distributed_ucxx.ucxx import init_once

        init_once()
    print(json.dumps(measure()))


def in_process(label, env, use_ucx):
    full = {**os.environ, **env}
    got = subprocess.run([sys.executable, __file__, "--child", "ucx" if use_ucx else "none"], env=full,
                         capture_output=True, text=True, timeout=240)
    if got.returncode:
        print(f"{label}: failed\n{got.stderr[-2000:]}", flush=True)
        return None
    result = json.loads(got.stdout.strip().splitlines()[-1])
    warnings = [line for line in got.stderr.splitlines() if "UCX" in line and "WARN" in line]
    print(f"process, {label} {env or ''}: {result}" + (f"\n  {warnings[:3]}" if warnings else ""), flush=True)
    return result


def in_workers(label, env, protocol, devs):
    import cupy as cp
    from dask_cuda import LocalCUDACluster
    from distributed import Client, wait

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # inherited by the worker processes
    try:
        with LocalCUDACluster(CUDA_VISIBLE_DEVICES=devs, protocol=protocol, dashboard_address=None,
                              threads_per_worker=1) as cluster, Client(cluster) as client:
            a, b = list(client.scheduler_info()["workers"])[:2]
            got = client.submit(measure, pure=False, workers=[a]).result()
            moves = []
            for i in range(4):
                x = client.submit(lambda i: cp.full(2**28, i, dtype=cp.float32), i, workers=[a], pure=False)
                wait(x)
                t = time.perf_counter()
                s = client.submit(lambda v: float(v.sum()), x, workers=[b], pure=False).result()
                moves.append(time.perf_counter() - t)
                assert s == float(i) * 2**28, s
            got["move_1GiB_ms"] = [round(1000 * m, 1) for m in moves]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    print(f"dask-cuda worker, {protocol}, {label} {env or ''}: {got}", flush=True)


def main():
    devs = sys.argv[sys.argv.index("--devs") + 1] if "--devs" in sys.argv else "0,0"
    print(f"python {sys.version.split()[0]}, {time.strftime('%Y-%m-%d %H:%M:%S')}", flush=True)
    in_process("no UCX", {}, False)
    base = in_process("UCX initialised", {}, True)
    best, best_ms = None, base["loop"]["wall_ms"] if base else float("inf")
    for label, env in HOOKS.items():
        got = in_process(f"UCX initialised, {label}", env, True)
        if got and got["loop"]["wall_ms"] < best_ms:
            best, best_ms = label, got["loop"]["wall_ms"]
    in_process("no UCX, again", {}, False)
    in_workers("", {}, "tcp", devs)
    in_workers("", {}, "ucx", devs)
    if best:
        in_workers(best, HOOKS[best], "ucx", devs)
    if best != "all four off":
        in_workers("all four off", HOOKS["all four off"], "ucx", devs)


if __name__ == "__main__":
    if "--child" in sys.argv:
        child(sys.argv[sys.argv.index("--child") + 1] == "ucx")
    else:
        main()
