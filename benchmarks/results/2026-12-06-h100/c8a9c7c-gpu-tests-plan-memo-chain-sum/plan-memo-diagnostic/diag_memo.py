"""Why a renamed plan is or is not reused, per compute: the chain-sum (1024 persisted blocks, 256x384
CuPy on GPU, 64x96 NumPy on CPU; the 8-kernel chain, ``.sum()``) named anew each compute on a local
cluster of one worker (TCP, the scheduler in this process), printing for each compute whether it was
planned, the milliseconds of ``shape_of``, of reusing the plan (and how many layers it renamed) and of
``PlanMemo.plan`` in all. Run from the repository root: ``python3 diag_memo.py gpu|cpu``."""
import sys
import time

import dask_octopus
from dask_octopus.bench.experiment import local_cluster
from dask_octopus.bench.small_tasks import chain_sum
from dask_octopus.bench.workloads import persist_on_workers, random_matrix
from dask_octopus.groups import memo, rewrite

log = []
real_make = rewrite._fragment_graph
rewrite._fragment_graph = lambda *a: log.append("PLANNED") or real_make(*a)
real_shape = memo.shape_of
shapes = []


def shape_of(inputs):
    t = time.perf_counter()
    s = real_shape(inputs)
    shapes.append(s)
    log.append(f"shape {1e3 * (time.perf_counter() - t):.1f}ms")
    return s


memo.shape_of = shape_of
real_reuse = memo.PlanMemo._reuse


def reuse(self, entry, dsk, ends, fresh, rename=None, moved=None):
    t = time.perf_counter()
    try:
        out = real_reuse(self, entry, dsk, ends, fresh, rename, moved)
    finally:
        log.append(f"reuse moved={len(moved or {})} {1e3 * (time.perf_counter() - t):.1f}ms")
    log.append("reused" if out is not None else "STALE")
    return out


memo.PlanMemo._reuse = reuse
real_stale = memo.Stale.__init__
memo.Stale.__init__ = lambda self, *a: (log.append(f"stale: {a[0][:150]}"), real_stale(self, *a))[1]
real_plan = memo.PlanMemo.plan


def plan(self, *a, **k):
    t = time.perf_counter()
    try:
        return real_plan(self, *a, **k)
    finally:
        log.append(f"plan {1e3 * (time.perf_counter() - t):.1f}ms")


memo.PlanMemo.plan = plan

if __name__ == "__main__":
    gpu = sys.argv[1] == "gpu"
    shape = (256, 384) if gpu else (64, 96)
    with local_cluster(gpu, "0" if gpu else None, n_workers=1, protocol="tcp") as client:
        dask_octopus.register(client, calibrate=False)
        x = persist_on_workers(client, random_matrix(1024 * shape[0], shape[1], chunks=shape, gpu=gpu))
        for i in range(6):
            log.clear()
            with dask_octopus.annotate():
                client.compute(chain_sum(x, f"phases-{i}")).result()
            print(i, log, flush=True)
            if len(shapes) >= 2 and shapes[-1].form is not None and shapes[-2].form is not None:
                a, b = shapes[-1].form, shapes[-2].form
                print("   form parts differing:", [j for j, (p, q) in enumerate(zip(a, b)) if p != q],
                      "layers", sorted(str(v[1]) for v in shapes[-1].layers.values())[:8])
