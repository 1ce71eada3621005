# Defect 4: an in-place graph whose outputs are views of its inputs keeps the persisted blocks alive
# after the user releases them, outside held_bytes / max-graph-bytes.
import time, cupy as cp, numpy as np, dask.array as da
from dask_cuda import LocalCUDACluster
from distributed import Client, wait
import dask_octopus

def head(b):
    return b[:, :16]                               # a view of the block

def used():
    import cupy
    return cupy.get_default_memory_pool().used_bytes()

if __name__ == "__main__":
    with LocalCUDACluster(CUDA_VISIBLE_DEVICES="0", n_workers=1, threads_per_worker=1) as cluster, \
            Client(cluster) as c:
        dask_octopus.register(c, calibrate=False)
        rng = da.random.default_rng(cp.random.default_rng(0))
        x = c.persist(rng.random((64 * 256, 4096), chunks=(256, 4096), dtype=np.float32)); wait(x)  # 256 MiB
        for run in range(3):
            with dask_octopus.annotate():
                y = x.map_blocks(head, chunks=(256, 16), name=f"head-{run}")
            c.compute(y.sum()).result()
        print(c.run(lambda dask_worker: dask_worker.extensions["octopus-streams"].stats()))
        before = next(iter(c.run(used).values()))
        del x, y
        time.sleep(2)
        after = next(iter(c.run(used).values()))
        print(f"pool in use: {before / 2**20:.0f} MiB before releasing x, {after / 2**20:.0f} MiB after")
# Expected with the defect: ~256 MiB still in use after the release, while graph_bytes reports ~0.
