"""Temporary probe (not committed): per-item host syncs and stream groups, video mix, one GPU, no Dask."""
import time, json, sys
import numpy as np, cupy as cp, dask
from dask_octopus.workloads import image_pipeline, specs, frame_pipeline, make_frame, to_host
from dask_octopus.mapping import run_group, run_batch

def device_pipeline(spec):
    return frame_pipeline(make_frame(*spec, gpu=True))

def timed(fn, runs=7):
    out = []
    for _ in range(runs + 2):
        cp.cuda.Device().synchronize(); s = time.perf_counter(); fn(); cp.cuda.Device().synchronize(); out.append(time.perf_counter() - s)
    return round(float(np.median(out[2:])) * 1e3, 2)

res = {}
for scen in ("video", "web", "satellite"):
    items = specs(scen, 1.0, 4)
    items = sorted(items, key=lambda s: -s[0] * s[1])
    r = {}
    def alone():
        for s in items:
            image_pipeline(s); cp.cuda.get_current_stream().synchronize()
    r["alone_sum"] = timed(alone)
    r["loop_host"] = timed(lambda: [image_pipeline(s) for s in items])
    r["group_all_8streams_host"] = timed(lambda: run_group(image_pipeline, items, {}, "compute"))
    r["batch_g8_host"] = timed(lambda: run_batch(image_pipeline, items, {}, "compute", 8))
    with dask.config.set({"octopus.streams.max-streams": 1}):
        r["group_all_1stream_host"] = timed(lambda: run_group(image_pipeline, items, {}, "compute"))
    r["loop_device_then_host"] = timed(lambda: [to_host(x) for x in [device_pipeline(s) for s in items]])
    r["batch_g8_device_then_host"] = timed(lambda: [to_host(x) for x in run_batch(device_pipeline, items, {}, "compute", 8)])
    r["group_all_device_then_host"] = timed(lambda: [to_host(x) for x in run_group(device_pipeline, items, {}, "compute")])
    res[scen] = r
    print(scen, len(items), r, flush=True)
import os
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "probe_streams.json"), "w"), indent=1)
