"""Two equal workers; after 30 steady timings each, worker a has two tasks 100x slower (a swap storm,
a GC pause), then is normal again. a's weight after each later timing:"""
import sys
sys.path.insert(0, "/work/main")
from dask_octopus.profiling.speedmodel import SpeedModel
m = SpeedModel()
for w in "ab":
    m.set_prior(w, {"compute": 1.0, "memory": 1.0})
for i in range(30):
    m.observe("a", "p", 1e6, 0.1); m.observe("b", "p", 1e6, 0.1)
out = []
for i in range(20):
    m.observe("a", "p", 1e6, 10.0 if i in (0, 1) else 0.1); m.observe("b", "p", 1e6, 0.1)
    out.append(round(m.weights("ab")["a"], 3))
print(out)
