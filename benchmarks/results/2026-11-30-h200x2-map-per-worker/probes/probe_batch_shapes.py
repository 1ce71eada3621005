"""Probe (kept with its result): the video mix's batch on the fast (GPU 1) worker of a registered 2-GPU
LocalCUDACluster with a co-tenant on GPU 0, in the ways the images variants run it, with the GPU-0
worker idle or busy with its own batch at the same time."""
import json, os, time
import numpy as np


def timed(fn, *args):
    import cupy as cp
    cp.cuda.Device().synchronize()
    s = time.perf_counter()
    fn(*args)
    return time.perf_counter() - s


def main():
    from dask_cuda import LocalCUDACluster
    from distributed import Client
    import dask_octopus
    from dask_octopus.cotenant import CoTenant
    from dask_octopus.mapping import run_batch, run_group
    from dask_octopus.workloads import image_pipeline, specs
    items = specs("video", 1.0, 4)
    big_first = sorted(items, key=lambda s: -s[0] * s[1])
    ways = {
        "run_group all, auto (loop variant)": (run_group, image_pipeline, items, {}, "auto"),
        "run_group all, compute, largest first": (run_group, image_pipeline, big_first, {}, "compute"),
        "run_batch group=8, compute, largest first (map)": (run_batch, image_pipeline, big_first, {}, "compute", 8),
    }
    res = {}
    with LocalCUDACluster(CUDA_VISIBLE_DEVICES="0,1", dashboard_address=None) as cl, Client(cl) as c:
        dask_octopus.register(c)
        devs = c.run(lambda: os.environ["CUDA_VISIBLE_DEVICES"])
        fast = next(a for a, d in devs.items() if d.startswith("1"))
        slow = next(a for a in devs if a != fast)
        with CoTenant(gpus=["0"]):
            for other in ("idle", "busy"):
                got = {w: [] for w in ways}
                for r in range(8):
                    for w, (fn, *args) in ways.items():
                        side = c.submit(timed, run_group, image_pipeline, items[:24], {}, "auto", workers=[slow], pure=False) if other == "busy" else None
                        got[w].append(c.submit(timed, fn, *args, workers=[fast], pure=False).result())
                        if side is not None:
                            side.result()
                for w, t in got.items():
                    res[f"{w}; GPU-0 worker {other}"] = round(float(np.median(t[2:])) * 1e3, 1)
                    print(w, other, res[f"{w}; GPU-0 worker {other}"], flush=True)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "probe_batch_shapes.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
