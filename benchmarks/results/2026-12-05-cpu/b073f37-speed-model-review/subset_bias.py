"""Three workers, equal calibrations. b and c are equally fast, a is 2x slower. Prefix p1 ran on a and b,
prefix p2 (same task length) on b and c. Ideal weights: a 0.2, b 0.4, c 0.4."""
import sys
sys.path.insert(0, "/work/main")
from dask_octopus.profiling.speedmodel import SpeedModel
m = SpeedModel()
for w in "abc":
    m.set_prior(w, {"compute": 1.0, "memory": 1.0})
for i in range(20):
    m.observe("a", "p1", 1.0, 0.2); m.observe("b", "p1", 1.0, 0.1)
    m.observe("b", "p2", 1.0, 0.1); m.observe("c", "p2", 1.0, 0.1)
print({k: round(v, 3) for k, v in m.weights("abc").items()})
