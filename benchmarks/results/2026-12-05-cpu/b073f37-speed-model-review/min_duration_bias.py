"""Short tasks around octopus.refine.min-duration (2 ms): the plugin drops the fast worker's timings
under 2 ms (scheduler.py _refine/_observe) but keeps all of the slow worker's. b is truly 2x slower."""
import random, sys
sys.path.insert(0, "/work/main")
from dask_octopus.profiling.speedmodel import SpeedModel
rng = random.Random(0)
for lo, hi in ((1.0, 3.0), (0.5, 3.5), (3.0, 5.0)):
    m = SpeedModel(); kept = 0
    for w in "ab":
        m.set_prior(w, {"compute": 1.0, "memory": 1.0})
    for i in range(200):
        ta = rng.uniform(lo, hi) / 1e3       # a: mean (lo+hi)/2 ms
        tb = 2 * rng.uniform(lo, hi) / 1e3   # b: twice as long
        for w, t in (("a", ta), ("b", tb)):
            if t >= 0.002:                   # _refine / _observe: shorter tasks are ignored
                m.observe(w, "p", 1e6, t); kept += w == "a"
    wt = m.weights("ab")
    print(f"a's tasks {lo}-{hi} ms: a timings kept {kept}/200, weights a={wt['a']:.3f} b={wt['b']:.3f} (ideal a=0.667)")
