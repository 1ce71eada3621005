"""One-off: how long register() takes on a LocalCUDACluster worker, and whether the plugin groups."""
import time
from dask_cuda import LocalCUDACluster
from distributed import Client
import dask_octopus

if __name__ == "__main__":
    with LocalCUDACluster(CUDA_VISIBLE_DEVICES="0", protocol="ucx") as cl, Client(cl) as c:
        t = time.perf_counter()
        dask_octopus.register(c)
        took = time.perf_counter() - t
        time.sleep(1.5)
        here = c.run_on_scheduler(lambda: __import__("dask_octopus.groups.scheduler", fromlist=["x"]).grouping_here())
        print(f"register took {took:.2f} s; grouping_here after 1.5 s: {here}")
