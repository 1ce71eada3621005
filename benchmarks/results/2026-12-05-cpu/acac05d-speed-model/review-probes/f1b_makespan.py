"""As f1_many_workers.py, for a 2x and a 4x slower w0: a map planned from weights(prefix) taken at a
random moment of a long steady run; its makespan over the ideal one (items in proportion to speed)."""
import statistics
from common import new, old, heapq, random
def run(mod, n, slow, seed=0, tasks=3000):
    rng = random.Random(seed); m = mod.SpeedModel(); ws = [f"w{i}" for i in range(n)]
    speed = {w: (1 / slow if w == "w0" else 1.0) for w in ws}
    heap = [(0.0, w) for w in ws]; spans = []
    ideal = 1 / sum(speed.values())
    for t in range(tasks):
        now, w = heapq.heappop(heap)
        d = 1.0 / speed[w] * rng.lognormvariate(0, 0.05)
        heapq.heappush(heap, (now + d, w)); m.observe(w, "f", 100, d)
        if t > tasks // 2:
            wt = m.weights(ws, prefix="f")
            spans.append(max(wt[x] / speed[x] for x in ws) / ideal)
    return spans
for slow in (2, 4):
    for n in (8, 16, 32):
        r = {name: run(mod, n, slow) for name, mod in (("old", old), ("new", new))}
        print(f"w0 {slow}x slower, {n:2d} workers: makespan/ideal  old mean {statistics.mean(r['old']):.2f} max {max(r['old']):.2f}"
              f"   new mean {statistics.mean(r['new']):.2f} max {max(r['new']):.2f}")
