"""Pure model: 24 consecutive maps of one function over 3 equal items on workers a, b (1 thread each).
Worker a is 4x slower during the first 2 maps (a co-tenant), then as fast as b again (3x in the review: a tie in the packing)."""
import sys
sys.path.insert(0, "/work/main")
from dask_octopus.profiling.speedmodel import SpeedModel
from dask_octopus.placement.packing import pack

m = SpeedModel()
for w in "ab":
    m.set_prior(w, {"compute": 1.0, "memory": 1.0})
P = "f-octopus-map"
for run in range(24):
    slow = run < 2
    wts = m.weights(["a", "b"], "compute", prefix=P)
    items = [1.0] * (8 if run < 2 else 3)
    packing = pack(items, [wts["a"], wts["b"]])
    got = {w: sum(1 for j in packing.assignment if j == i) for i, w in enumerate("ab")}
    for i, j in enumerate(packing.assignment):
        w = "ab"[j]
        m.observe(w, P, 1.0, (0.4 if (w == "a" and slow) else 0.1))
    print(f"map {run}: a is {'4x slower' if slow else 'as fast as b'}; weights {({k: round(v, 3) for k, v in wts.items()})}; items {got}")
