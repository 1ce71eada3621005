"""_missed takes a worker's share of a prefix's timings as its share of the per-task rates, ignoring
threads: a 1-thread worker beside a 32-thread one counts as 'stale' while it runs the prefix all along,
and its measured (per-thread) speed fades toward its prior. A: 1 thread, 2 s a task; B: 32 threads,
1 s a task; priors equal. Correct per-thread weights: A 1/3, B 2/3."""
import heapq, random, sys
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
import old_speedmodel
from dask_octopus.profiling import speedmodel as new_speedmodel

def simulate(mod):
    m = mod.SpeedModel()
    rng = random.Random(0)
    for w in "AB":
        m.set_prior(w, {"compute": 1.0, "memory": 1.0})
    secs = {"A": 2.0, "B": 1.0}
    events = [(secs["A"], "A")] + [(secs["B"] + i * 1e-3, "B") for i in range(32)]
    heapq.heapify(events)
    seen = []
    while events:
        t, w = heapq.heappop(events)
        if t > 60:
            break
        m.observe(w, "f", 1.0, secs[w] * rng.lognormvariate(0, 0.05))
        seen.append(m.weights(["A", "B"], prefix="f")["A"])
        heapq.heappush(events, (t + secs[w], w))
    late = seen[len(seen) // 2:]
    return min(late), max(late), sum(late) / len(late)

for name, mod in (("60af4e1", old_speedmodel), ("HEAD", new_speedmodel)):
    lo, hi, mean = simulate(mod)
    print(f"{name}: A's weight over the 2nd half of the run: min {lo:.3f} max {hi:.3f} mean {mean:.3f} (correct 0.333)")
