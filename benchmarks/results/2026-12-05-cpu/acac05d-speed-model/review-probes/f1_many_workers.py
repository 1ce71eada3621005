"""One prefix, N single-thread workers that each pull the next task when free (a long map);
worker w0 is genuinely 4x slower throughout. Timings arrive in completion order. Noise 5%."""
import statistics
from common import new, old, heapq, random
def run(mod, n, seed=0, tasks=3000):
    rng = random.Random(seed)
    m = mod.SpeedModel()
    ws = [f"w{i}" for i in range(n)]
    speed = {w: (0.25 if w == "w0" else 1.0) for w in ws}
    heap = [(0.0, w) for w in ws]
    out = []
    for t in range(tasks):
        now, w = heapq.heappop(heap)
        d = 1.0 / speed[w] * rng.lognormvariate(0, 0.05)
        heapq.heappush(heap, (now + d, w))
        m.observe(w, "f", 100, d)
        if t > tasks // 2:
            out.append(m.weights(ws, prefix="f")["w0"])
    return out
for n in (2, 4, 8, 12, 16, 32):
    true = 0.25 / (0.25 + n - 1)
    for name, mod in (("old", old), ("new", new)):
        o = run(mod, n)
        print(f"n={n:2d} {name}: true w0 {true:.4f}  median {statistics.median(o):.4f} min {min(o):.4f} max {max(o):.4f}  "
              f"mean over/true {statistics.mean(o)/true:.2f}")
