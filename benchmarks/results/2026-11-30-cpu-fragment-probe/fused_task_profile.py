import time, dask, dask.array as da, numpy as np
from dask.core import flatten
from dask_octopus._compat import convert_legacy_graph
from dask_octopus.bench.small_tasks import chain_sum
from dask_octopus.bench.workloads import elementwise_chain
local = np.random.default_rng(0).random((1024 * 64, 96))
x = da.from_array(local, chunks=(64, 96)).persist(scheduler="sync")
(y,) = dask.optimize(chain_sum(x, "chain"))
dsk = convert_legacy_graph(dict(y.__dask_graph__()))
k = next(kk for kk in dsk if isinstance(kk, tuple) and kk[0].startswith("array-sum") if True)
node = dsk[k]
print(k, type(node).__name__, getattr(node, "func", None))
print(repr(node)[:600])
deps = {d: dsk[d]({}) if hasattr(dsk[d], "__call__") else dsk[d] for d in node.dependencies}
import cProfile, pstats
t = time.perf_counter()
for _ in range(200): node(deps)
print("per call us", (time.perf_counter() - t) / 200 * 1e6)
inner = node.args[0]
print({kk: (type(v).__name__, getattr(v, "func", None)) for kk, v in inner.items()})
b = local[:64]
t = time.perf_counter()
for _ in range(200): elementwise_chain(b).sum(keepdims=True)
print("chain+sum us", (time.perf_counter() - t) / 200 * 1e6)
cProfile.run("for _ in range(100): node(deps)", "/tmp/p.out")
pstats.Stats("/tmp/p.out").sort_stats("cumulative").print_stats(12)
