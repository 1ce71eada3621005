"""weights() when prefixes ran on different subsets of the workers (maps of few items, keys of their own):
old (60af4e1) vs new (HEAD) on identical timings."""
import random, sys, time
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
import old_speedmodel
from dask_octopus.profiling import speedmodel as new_speedmodel

def run(mod, n_workers, n_prefixes, per_prefix):
    rng = random.Random(1)
    m = mod.SpeedModel(max_prefixes=max(1000, n_prefixes))
    ws = [f"w{i}" for i in range(n_workers)]
    speed = {w: 1 + i % 4 for i, w in enumerate(ws)}
    for w in ws:
        m.set_prior(w, {"compute": 1.0, "memory": 1.0})
    for p in range(n_prefixes):
        sub = rng.sample(ws, per_prefix)
        for _ in range(4):
            for w in sub:
                m.observe(w, f"job_{p}", 1.0, rng.lognormvariate(0, 0.05) / speed[w])
    t0 = time.perf_counter()
    out = m.weights(ws)
    return time.perf_counter() - t0, out

for nw, npf, k in [(16, 1000, 4), (64, 1000, 4), (64, 1000, 16)]:
    to, wo = run(old_speedmodel, nw, npf, k)
    tn, wn = run(new_speedmodel, nw, npf, k)
    print(f"{nw} workers, {npf} prefixes on {k} each: weights() old {to*1e3:.0f} ms, new {tn*1e3:.0f} ms")
