"""observe() per timing with many workers on one prefix (round robin): _missed sums every worker's
rate on each timing once more than STALE timings passed since the worker's last (N > 9 workers)."""
import random, sys, time
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
import old_speedmodel
from dask_octopus.profiling import speedmodel as new_speedmodel

for n in (8, 64, 512, 2048):
    for name, mod in (("60af4e1", old_speedmodel), ("HEAD", new_speedmodel)):
        rng = random.Random(0)
        m = mod.SpeedModel()
        ws = [f"w{i}" for i in range(n)]
        k = 0
        for _ in range(20 * n):  # warm up: windows fill
            m.observe(ws[k % n], "p", 1.0, rng.lognormvariate(0, 0.1)); k += 1
        t0 = time.perf_counter()
        for _ in range(20000):
            m.observe(ws[k % n], "p", 1.0, rng.lognormvariate(0, 0.1)); k += 1
        print(f"{n} workers {name}: {(time.perf_counter() - t0) / 20000 * 1e6:.1f} us per observe")
