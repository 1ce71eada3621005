"""Two workers, both busy all along. Tasks pulled from one queue: 1 in 20 is prefix "x" (a 1 s
task on b, 4x slower on a: a's co-tenant hits this kind of work), the rest "y" (0.1 s, equal on both).
a runs x regularly (every ~40 timings), never stops. What do the models say about a on x?"""
import statistics
from common import new, old, heapq, random
def run(mod, seed=0, tasks=6000, share=20):
    rng = random.Random(seed)
    m = mod.SpeedModel()
    heap = [(0.0, "a"), (0.0, "b")]
    out, counts = [], {"a": 0, "b": 0}
    for t in range(tasks):
        now, w = heapq.heappop(heap)
        if rng.random() < 1 / share:
            p, d = "x", (4.0 if w == "a" else 1.0)
            counts[w] += t > tasks // 2
        else:
            p, d = "y", 0.1
        d *= rng.lognormvariate(0, 0.05)
        heapq.heappush(heap, (now + d, w))
        m.observe(w, p, 100, d)
        if t > tasks // 2:
            out.append(m.weights("ab", prefix="x")["a"])
    return out, counts
for name, mod in (("old", old), ("new", new)):
    o, c = run(mod)
    print(f"{name}: true a on x 0.2000  median {statistics.median(o):.3f} min {min(o):.3f} max {max(o):.3f}  "
          f"share of time > 0.3: {sum(v > 0.3 for v in o)/len(o):.2f}   x timings in 2nd half {c}")
