"""Probe (kept with its result): do two busy dask-cuda workers slow each other down, and why? CPU
affinity of the workers, and the fast (GPU 1) worker's video batch with the GPU-0 worker idle or busy,
with and without a co-tenant on GPU 0, and with the workers' affinity widened to every core."""
import json, os, time
import numpy as np


def timed(fn, *args):
    import cupy as cp
    cp.cuda.Device().synchronize()
    s = time.perf_counter()
    fn(*args)
    return time.perf_counter() - s


def widen():
    for tid in os.listdir("/proc/self/task"):  # every thread of the worker process
        os.sched_setaffinity(int(tid), range(os.cpu_count()))
    return sorted(os.sched_getaffinity(0))


def main():
    from dask_cuda import LocalCUDACluster
    from distributed import Client
    import dask_octopus
    from dask_octopus.cotenant import CoTenant
    from dask_octopus.mapping import run_group
    from dask_octopus.workloads import image_pipeline, specs
    items = specs("video", 1.0, 4)
    res = {"cpu_count": os.cpu_count(), "client_affinity": sorted(os.sched_getaffinity(0))}
    with LocalCUDACluster(CUDA_VISIBLE_DEVICES="0,1", dashboard_address=None) as cl, Client(cl) as c:
        dask_octopus.register(c)
        devs = c.run(lambda: os.environ["CUDA_VISIBLE_DEVICES"])
        res["worker_affinity"] = {devs[a]: v for a, v in c.run(lambda: sorted(os.sched_getaffinity(0))).items()}
        fast = next(a for a, d in devs.items() if d.startswith("1"))
        slow = next(a for a in devs if a != fast)

        def measure(label):
            for other in ("idle", "busy"):
                t = []
                for r in range(8):
                    side = c.submit(timed, run_group, image_pipeline, items, {}, "auto", workers=[slow], pure=False) if other == "busy" else None
                    t.append(c.submit(timed, run_group, image_pipeline, items, {}, "auto", workers=[fast], pure=False).result())
                    if side is not None:
                        side.result()
                res[f"{label}; GPU-0 worker {other}"] = round(float(np.median(t[2:])) * 1e3, 1)
                print(label, other, res[f"{label}; GPU-0 worker {other}"], flush=True)

        measure("no co-tenant")
        with CoTenant(gpus=["0"]):
            measure("co-tenant on GPU 0")
            res["widened_affinity"] = {devs[a]: len(v) for a, v in c.run(widen).items()}
            measure("co-tenant on GPU 0, workers on every core")
    print(res)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "probe_interference.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
