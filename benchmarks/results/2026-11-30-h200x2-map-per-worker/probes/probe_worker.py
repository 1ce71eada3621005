"""Temporary probe (not committed): the same batch in a dask-cuda worker task, with worker settings varied."""
import os, sys, time, json
import numpy as np

def batch(items, device_then_host=False):
    import cupy as cp
    from dask_octopus.workloads import image_pipeline, to_host, frame_pipeline, make_frame
    from dask_octopus.mapping import run_group
    cp.cuda.Device().synchronize()
    s = time.perf_counter()
    if device_then_host:
        out = [to_host(x) for x in run_group(lambda sp: frame_pipeline(make_frame(*sp, gpu=True)), items, {}, "compute")]
    else:
        out = run_group(image_pipeline, items, {}, "compute")
    return time.perf_counter() - s

def main():
    from dask_cuda import LocalCUDACluster
    from distributed import Client
    import dask
    from dask_octopus.workloads import specs
    items = sorted(specs("video", 1.0, 4), key=lambda s: -s[0] * s[1])
    res = {}
    for label, cfg in [("default", {}), ("no-profiler", {"distributed.worker.profile.enabled": False})]:
        with dask.config.set(cfg), LocalCUDACluster(CUDA_VISIBLE_DEVICES="1", n_workers=1, dashboard_address=None) as cl, Client(cl) as c:
            for sw in (None, 0.0005):
                if sw: c.run(sys.setswitchinterval, sw)
                for dth in (False, True):
                    inner, outer = [], []
                    for r in range(8):
                        s = time.perf_counter(); t = c.submit(batch, items, dth, pure=False).result(); e = time.perf_counter() - s
                        if r >= 2: inner.append(t); outer.append(e)
                    key = f"{label} switch={sw} device_then_host={dth}"
                    res[key] = (round(float(np.median(inner)) * 1e3, 1), round(float(np.median(outer)) * 1e3, 1))
                    print(key, res[key], flush=True)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "probe_worker.json"), "w"), indent=1)

if __name__ == "__main__":
    main()
