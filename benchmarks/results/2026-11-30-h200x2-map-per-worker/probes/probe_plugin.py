"""Probe (kept with its result): one batch of the video mix (120 images) as one task on the GPU-1 worker
of a 2-GPU LocalCUDACluster: plain, with dask_octopus registered, and with a co-tenant on GPU 0."""
import json, os, sys, time
import numpy as np

from probe_worker import batch


def measure(c, w, items, runs=8):
    inner, outer = [], []
    for r in range(runs + 2):
        s = time.perf_counter()
        t = c.submit(batch, items, False, workers=[w], pure=False).result()
        if r >= 2:
            inner.append(t); outer.append(time.perf_counter() - s)
    return round(float(np.median(inner)) * 1e3, 1), round(float(np.median(outer)) * 1e3, 1)


def main():
    from dask_cuda import LocalCUDACluster
    from distributed import Client
    import dask_octopus
    from dask_octopus.cotenant import CoTenant
    from dask_octopus.workloads import specs
    items = sorted(specs("video", 1.0, 4), key=lambda s: -s[0] * s[1])
    res = {}
    with LocalCUDACluster(CUDA_VISIBLE_DEVICES="0,1", dashboard_address=None) as cl, Client(cl) as c:
        c.upload_file(os.path.join(os.path.dirname(__file__), "probe_worker.py"))
        devs = c.run(lambda: os.environ["CUDA_VISIBLE_DEVICES"])
        w = next(a for a, d in devs.items() if d.startswith("1"))
        res["plain"] = measure(c, w, items)
        dask_octopus.register(c)
        res["registered"] = measure(c, w, items)
        with CoTenant(gpus=["0"]):
            res["registered+cotenant on GPU 0"] = measure(c, w, items)
        res["registered, co-tenant stopped"] = measure(c, w, items)
        print(res, flush=True)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "probe_plugin.json"), "w"), indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    main()
