"""Two workers, an iterative job: each iteration maps 10 items of f (planned by weights(prefix="f");
a is 4x slower on f, always), then runs 40 other tasks (y, 20 per worker, equal). Makespan of each
map over the ideal (a gets 2 items: 8 s)."""
import heapq
from common import new, old
def plan(wt, n=10):
    raw = {w: wt[w] * n for w in wt}; got = {w: int(raw[w]) for w in wt}
    for w in sorted(wt, key=lambda w: raw[w] - got[w], reverse=True)[: n - sum(got.values())]:
        got[w] += 1
    return got
import sys
Y = int(sys.argv[1]) if len(sys.argv) > 1 else 20
for name, mod in (("old", old), ("new", new)):
    m = mod.SpeedModel(); spans = []; shares = []
    for it in range(12):
        got = plan(m.weights("ab", prefix="f")); shares.append(got["a"])
        dur = {"a": 4.0, "b": 1.0}
        ev = sorted((k * dur[w] + dur[w], w) for w in got for k in range(got[w]))
        for t, w in ev:
            m.observe(w, "f", 100, dur[w])
        spans.append(ev[-1][0] if ev else 0)
        for _ in range(Y):
            m.observe("a", "y", 100, 0.1); m.observe("b", "y", 100, 0.1)
    print(f"{name}: a's items per map {shares}\n     makespans {spans}")
