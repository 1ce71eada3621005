# Defect 2: GPU work a step runs on a stream other than the capturing one runs once, at capture, and
# is not in the graph: replays read what it computed from the capture's inputs.
import cupy as cp, numpy as np, dask.array as da
from dask_cuda import LocalCUDACluster
from distributed import Client, wait
import dask_octopus

def doubled_on_the_null_stream(b):
    with cp.cuda.Stream.null:                      # legacy stream: legal while non-blocking streams capture
        t = b * 2
        cp.cuda.Stream.null.synchronize()          # correct eagerly: t is ready before it is read below
    return t + 1

if __name__ == "__main__":
    with LocalCUDACluster(CUDA_VISIBLE_DEVICES="0", n_workers=1, threads_per_worker=1) as cluster, \
            Client(cluster) as c:
        dask_octopus.register(c, calibrate=False)
        for run in range(5):
            rng = da.random.default_rng(cp.random.default_rng(run))
            x = c.persist(rng.random((16 * 256, 256), chunks=(256, 256), dtype=np.float32)); wait(x)
            with dask_octopus.annotate():
                y = x.map_blocks(doubled_on_the_null_stream, name=f"side-{run}")
            got = c.compute(y.sum(axis=0)).result()
            want = c.compute((2 * x + 1).sum(axis=0)).result()
            print(run, "max error", float(abs(got - want).max()))
        print(c.run(lambda dask_worker: dask_worker.extensions["octopus-streams"].stats()))
# Expected with the defect: error ~0 on the eager runs, large from the first replay on new data
# (graphs >= 1, refused == 0).
