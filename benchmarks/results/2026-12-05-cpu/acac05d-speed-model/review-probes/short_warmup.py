"""refine.min-duration per (prefix, worker) (e9a549f): a prefix whose tasks are all far below the minimum
but whose first task is long (imports, JIT, an FFT plan) has its next 3 short timings counted too
(share of short 0 -> .25 -> .44 -> .58), so it reaches confidence_samples=3 and its overhead-dominated
rates set the weights. At 60af4e1 each short timing was dropped: 1 timing per worker, the prefix did not count.
Emulates OctopusSchedulerPlugin._refine's decision (old: seconds >= min; new: ShortTasks.counts)."""
import random, sys
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
import old_speedmodel
from dask_octopus.profiling import speedmodel as new_speedmodel
from dask_octopus.profiling.short_tasks import ShortTasks

MIN = 0.002
rng = random.Random(0)
# two workers equally fast at real work; w1's per-task overhead is higher (0.3 ms vs 1.5 ms): tiny tasks
timings = []
for w, overhead in (("w0", 0.0003), ("w1", 0.0015)):
    timings.append((w, 0.030))  # first task: a warm-up
    timings += [(w, overhead * rng.lognormvariate(0, 0.05)) for _ in range(50)]
rng.shuffle(timings[1:])

for name, mod, new in (("60af4e1", old_speedmodel, False), ("HEAD", new_speedmodel, True)):
    m = mod.SpeedModel()
    short = ShortTasks(1000)
    for w in ("w0", "w1"):
        m.set_prior(w, {"compute": 1.0, "memory": 1.0})
    counted = {"w0": 0, "w1": 0}
    for w, s in sorted(timings, key=lambda t: t[1] != 0.030):  # the warm-ups first
        ok = short.counts("tiny", w, s < MIN) if new else s >= MIN
        if ok:
            counted[w] += 1
            m.observe(w, "tiny", 1000.0, s)
    print(f"{name}: timings counted {counted}; weights {m.weights(['w0', 'w1'])}")
